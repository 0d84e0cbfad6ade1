"""How well ``trl-nrollout plan --predict`` predicts measured steps on this machine.

1. Calibrate this machine (``trl-nrollout plan --calibrate``, in a child process) with each model, or use
   ``--profile`` (a saved profile's name or a JSON file) for all.
2. Measure steps with ``benchmarks/step_benchmark.py`` (ours, vLLM engine, one process): for each model
   (``--models``, default the tiny and medium built-ins), n = 4 / 8 / 12 / 16 and 32- and 512-token prompts.
3. Predict each configuration with the cost model (the same layout; the workload as run: the prompt length, the
   mean completion length the run generated, ``max_completion_length`` as the longest) and compare: step time,
   each modelled phase (generation, weight sync, old-policy pass, update), and step(n=12) / step(n=4).

Goals (issue 33): step within +-25%, each phase within +-40%, the n=12 / n=4 ratio within +-15%. Writes
``plan_accuracy.json`` / ``.md`` / ``.png`` (predicted vs measured) under ``--out``; ``--docs`` copies the plot to
docs/img/plan_accuracy.png.

    python benchmarks/plan_accuracy.py [--quick] [--profile NAME] [--models builtin:tiny-qwen2 ...] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PHASE_MAP = {"generation": "gen", "weight_sync": "weight_sync", "old_log_prob": "old_log_prob", "update": "update"}
GOAL_STEP, GOAL_PHASE, GOAL_RATIO = 0.25, 0.40, 0.15


def calibrate(out: Path, model: str) -> str:
    """This machine's profile, calibrated with ``model`` (its engine's decode steps and the trainer around it)."""
    from common import CHILD_ENV

    env = {**os.environ, **CHILD_ENV, "TRL_NROLLOUT_PROFILES": str(out)}
    name = "plan-accuracy-" + model.replace(":", "_").replace("/", "_")
    subprocess.run([sys.executable, "-m", "trl_nrollout.cli", "plan", "--calibrate", "--device", name,
                    "--model", model], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return str(out / f"{name}.json")


def measure(model: str, ns: list[int], lengths: list[int], steps: int, out: Path, reuse: bool = False,
            repeats: int = 1) -> list[dict]:
    folder = out / model.replace(":", "_").replace("/", "_")
    if not reuse:
        subprocess.run([sys.executable, str(ROOT / "benchmarks/step_benchmark.py"), "--model", model, "--impls",
                    "ours-vllm", "--ns", *map(str, ns), "--prompt-tokens", *map(str, lengths), "--steps", str(steps),
                    "--no-colocate", "--repeats", str(repeats), "--out", str(folder)], cwd=ROOT, check=True)
    rows = json.loads((folder / "step_benchmark.json").read_text())["rows"]
    return [dict(r, model=model) for r in rows if r.get("impl") == "ours-vllm" and "phases_s" in r]


def predict(row: dict, profile, max_completion_length: int) -> dict:
    from trl_nrollout.plan.cost import predict_step
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.plan.models import model_dims
    from trl_nrollout.plan.workload import Workload

    dims = model_dims(row["model"], dtype="float32")
    prompts, n = int(row["prompts"]), int(row["n"])  # medians over repeats come back as floats
    layout = RolloutLayout.build(num_processes=1, train_batch_size=prompts, rollout_n=n)
    samples = prompts * n
    mean = row["gen_tokens_per_step"] / samples
    work = Workload(prompt_len=float(row["prompt_tokens"]), completion_mean=mean, completion_max=max_completion_length)
    return predict_step(dims, layout, work, profile).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a saved profile or JSON file (default: calibrate now)")
    ap.add_argument("--models", nargs="+", default=["builtin:tiny-qwen2", "builtin:medium-qwen2"])
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="fresh processes per configuration (step_benchmark.py's --repeats: medians)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, n = 4 and 12, 32-token prompts")
    ap.add_argument("--reuse", action="store_true",
                    help="compare with the steps measured and the profiles calibrated by an earlier run in --out "
                         "(no new measurement)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_accuracy")
    ap.add_argument("--docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.models, args.ns, args.prompt_tokens, args.steps = ["builtin:tiny-qwen2"], [4, 12], [32], 3
    from common import check_load

    from trl_nrollout.plan.devices import load_profile

    load, busy = check_load("the plan accuracy benchmark")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    profiles, rows = {}, []
    for model in args.models:  # calibrated with the model it predicts, as a user would (plan --calibrate --model)
        saved = args.out / f"plan-accuracy-{model.replace(':', '_').replace('/', '_')}.json"
        reused = args.reuse and args.profile is None and saved.is_file()
        if args.profile is None and not reused:
            print(f"calibrating this machine with {model} ...", flush=True)
        profiles[model] = load_profile(args.profile or (str(saved) if reused else calibrate(args.out, model)))
        rows += measure(model, args.ns, args.prompt_tokens, args.steps, args.out, args.reuse, args.repeats)
    results = []
    for row in rows:
        pred = predict(row, profiles[row["model"]], 32)
        measured = {"step": row["step_s"], **{p: row["phases_s"][k] for p, k in PHASE_MAP.items()}}
        predicted = {"step": pred["total_s"], **{p: pred["phases"][p] for p in PHASE_MAP}}
        error = {k: predicted[k] / measured[k] - 1 if measured[k] > 0 else None for k in measured}
        results.append({"model": row["model"], "n": int(row["n"]), "prompt_tokens": int(row["prompt_tokens"]),
                        "measured": measured, "predicted": predicted, "error": error,
                        "unmodelled_s": row["phases_s"].get("reward", 0) + row["phases_s"].get("adv", 0)
                        + row["phases_s"].get("other", 0) + row["phases_s"].get("ref", 0)})
    ratios = []
    for model in args.models:
        for length in args.prompt_tokens:
            by_n = {r["n"]: r for r in results if r["model"] == model and r["prompt_tokens"] == length}
            if 4 in by_n and 12 in by_n:
                m = by_n[12]["measured"]["step"] / by_n[4]["measured"]["step"]
                p = by_n[12]["predicted"]["step"] / by_n[4]["predicted"]["step"]
                ratios.append({"model": model, "prompt_tokens": length, "measured": m, "predicted": p,
                               "error": p / m - 1})
    lines = ["| model | prompt | n | step measured (s) | predicted (s) | error | generation m / p | weight sync m / p "
             "| old log-prob m / p | update m / p |", "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(r: dict, k: str) -> str:
        e = r["error"][k]
        return f"{r['measured'][k]:.3f} / {r['predicted'][k]:.3f} ({'n/a' if e is None else f'{e:+.0%}'})"

    for r in results:
        lines.append(f"| {r['model'].removeprefix('builtin:')} | {r['prompt_tokens']} | {r['n']} | "
                     f"{r['measured']['step']:.3f} | {r['predicted']['step']:.3f} | **{r['error']['step']:+.0%}** | "
                     f"{pair(r, 'generation')} | {pair(r, 'weight_sync')} | {pair(r, 'old_log_prob')} | "
                     f"{pair(r, 'update')} |")
    lines += ["", "| model | prompt | step(n=12) / step(n=4) measured | predicted | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['model'].removeprefix('builtin:')} | {r['prompt_tokens']} | {r['measured']:.2f} | "
              f"{r['predicted']:.2f} | **{r['error']:+.0%}** |" for r in ratios]
    steps_ok = sum(abs(r["error"]["step"]) <= GOAL_STEP for r in results)
    phases = [(r, k) for r in results for k in PHASE_MAP if r["error"][k] is not None]
    phases_ok = sum(abs(r["error"][k]) <= GOAL_PHASE for r, k in phases)
    ratios_ok = sum(abs(r["error"]) <= GOAL_RATIO for r in ratios)
    verdict = (f"step within +-25%: {steps_ok}/{len(results)}; phases within +-40%: {phases_ok}/{len(phases)}; "
               f"n=12/n=4 within +-15%: {ratios_ok}/{len(ratios)}")
    lines += ["", verdict, f"load average at start: {load[0]:.2f}{' (busy)' if busy else ''}"]
    table = "\n".join(lines)
    print(table)
    (args.out / "plan_accuracy.md").write_text(table + "\n")
    (args.out / "plan_accuracy.json").write_text(json.dumps(
        {"profiles": {m: p.to_dict() for m, p in profiles.items()}, "results": results, "ratios": ratios, "verdict": verdict,
         "load_at_start": load, "wall_s": time.perf_counter() - start}, indent=1))
    _plot(results, args.out / "plan_accuracy.png")
    if args.docs:
        shutil.copy(args.out / "plan_accuracy.png", ROOT / "docs" / "img" / "plan_accuracy.png")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    markers = {32: "o", 512: "s"}
    for r in results:
        colour = "tab:blue" if "tiny" in r["model"] else "tab:orange"
        axes[0].scatter(r["measured"]["step"], r["predicted"]["step"], c=colour,
                        marker=markers.get(r["prompt_tokens"], "^"))
        axes[0].annotate(f"n={r['n']}", (r["measured"]["step"], r["predicted"]["step"]), fontsize=7)
        for k, c in (("generation", "tab:green"), ("old_log_prob", "tab:red"), ("update", "tab:purple"),
                     ("weight_sync", "tab:gray")):
            if r["measured"][k] > 0:
                axes[1].scatter(r["measured"][k], r["predicted"][k], c=c, s=12, label=k)
    for ax, title, band in ((axes[0], "step time (blue: tiny, orange: medium; o 32, s 512 tokens)", GOAL_STEP),
                            (axes[1], "phases", GOAL_PHASE)):
        lo = min(min(p.get_offsets()[:, 0].min(), p.get_offsets()[:, 1].min()) for p in ax.collections)
        hi = max(max(p.get_offsets()[:, 0].max(), p.get_offsets()[:, 1].max()) for p in ax.collections)
        xs = [lo * 0.8, hi * 1.2]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs], color="k", alpha=0.08,
                        label=f"+-{band:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (s)")
        ax.set_ylabel("predicted (s)")
        ax.set_title(title, fontsize=9)
    handles, labels = axes[1].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[1].legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle("trl-nrollout plan --predict vs step_benchmark.py on this machine (calibrated profile)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
