"""Rollout ranks (``rollout_ranks=1``): one-step-off-policy training vs synchronous and colocated runs.

Real launches of the recipe (``accelerate launch recipes/grpo.py``, DeepSpeed ZeRO-3 on CPU, the embedded default:
the built-in digits task on ``builtin:tiny-qwen2``, 40 steps), each process pinned to a core of this machine
(2 cores: the two trainers share core 0, the rollout rank has core 1; a colocated run's two ranks one core each):

- ``colocated``: 2 processes, each trains and generates (the reference curve), seeds 0, 1, 2;
- ``one-step-off``: 3 processes (2 ZeRO-3 trainers + 1 rollout rank, ``rollout_lookahead=1``), seeds 0, 1, 2;
- ``one-step-off+is``: the same with the rollout correction ``rollout_is="token"`` (what the trainer now does by
  default with rollout ranks: ``decoupled_loss``; the plain arm turns it off) (each token weighted by the
  trainer's / the engine's probability, truncated at 2), seeds 0, 1, 2;
- ``synchronous``: the same 3 processes with ``rollout_lookahead=0`` (the trainers wait for each step's samples), seed 0.

Reported: the mean reward of the last 10 steps of each run and whether the one-step-off runs end within the
colocated runs' spread (the goal: the same reward in the same number of steps), the steps each run takes to reach
rewards 0.5 and 0.9, the reward of its last step, the median step time of the
synchronous and one-step-off runs on the same 3 processes (ratio; steps after the first two), where a step's time
goes (waiting for samples, weight staging, update) and each weight transfer's bytes and seconds. Prints and saves
``rollout_ranks.json`` / ``.md`` / ``.png`` under ``--out``; ``--docs`` copies the plot to docs/img.

    python benchmarks/rollout_ranks.py [--quick] [--steps 40] [--seeds 0 1 2] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import check_load, pyplot, save_figure, write_table  # noqa: E402

ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def pinned_main() -> None:
    """A launched rank: pin this process to its core (``BENCH_CORES``, one entry per local rank), run the
    recipe."""
    import runpy

    cores = os.environ["BENCH_CORES"].split(",")
    os.sched_setaffinity(0, {int(cores[int(os.environ["LOCAL_RANK"])]) % os.cpu_count()})
    recipe = str(ROOT / "recipes" / "grpo.py")
    sys.argv = [recipe, *sys.argv[2:]]
    runpy.run_path(recipe, run_name="__main__")


def launch(label: str, procs: int, cores: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    folder = out / f"{label}_seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "recipes/accelerate/zero3_cpu.yaml"),
           "--num_processes", str(procs), __file__, "--pinned", "--output_dir", str(folder), "--use_cpu", "false",
           "--ddp_backend", "gloo", "--bf16", "false", "--max_steps", str(steps), "--seed", str(seed),
           "--save_strategy", "no", *extra]
    env = {**os.environ, "BENCH_CORES": cores, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{label} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    steps_logged = [h for h in json.loads((folder / "log_history.json").read_text()) if "reward" in h]
    print(f"  {label:13s} seed {seed}: {len(steps_logged)} steps in {wall:.0f} s, reward "
          f"{steps_logged[0]['reward']:.3f} -> {steps_logged[-1]['reward']:.3f}", flush=True)
    return {"label": label, "seed": seed, "wall_s": wall, "steps": steps_logged}


def median_after(steps: list[dict], key: str, skip: int = 2) -> float | None:
    values = [h[key] for h in steps[skip:] if key in h and h[key] is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], tail: int) -> dict:
    by = {}
    for run in runs:
        by.setdefault(run["label"], []).append(run)
    end = {label: [statistics.mean(h["reward"] for h in r["steps"][-tail:]) for r in rs] for label, rs in by.items()}
    band = (min(end["colocated"]), max(end["colocated"]))
    within = {label: [band[0] <= v <= band[1] for v in end[label]] for label in end if label != "colocated"}

    def first(ys: list[float], threshold: float) -> int | None:
        return next((i + 1 for i, y in enumerate(ys) if y >= threshold), None)

    reach = {label: [{"0.5": first([h["reward"] for h in r["steps"]], 0.5),
                      "0.9": first([h["reward"] for h in r["steps"]], 0.9),
                      "last": r["steps"][-1]["reward"]} for r in rs] for label, rs in by.items()}
    timing = {}
    for label in ("synchronous", "one-step-off", "colocated"):
        run = by[label][0]
        timing[label] = {k: median_after(run["steps"], k) for k in (
            "timing_s/step", "timing_s/gen", "rollout/wait_s", "timing_s/weight_sync", "timing_s/update_actor",
            "weight_sync/transfer_s", "weight_sync/transfer_mb", "rollout/staleness")}
    ratio = timing["one-step-off"]["timing_s/step"] / timing["synchronous"]["timing_s/step"]
    return {"end_reward": end, "colocated_band": band, "within_band": within, "reach": reach, "timing": timing,
            "step_ratio_offpolicy_vs_sync": ratio}


def write_outputs(result: dict, out: Path, docs: bool) -> None:
    s = result["summary"]
    lines = [
        f"# Rollout ranks: one-step-off vs synchronous vs colocated ({result['steps']} steps, load "
        f"{result['load'][0]:.2f} at start)", "",
        "| run | seeds | mean reward, last 10 steps |", "|---|---|---|"]
    for label, values in s["end_reward"].items():
        lines.append(f"| {label} | {len(values)} | " + ", ".join(f"{v:.3f}" for v in values) + " |")
    lines += ["", f"colocated spread of the last-10-step means: [{s['colocated_band'][0]:.3f}, "
              f"{s['colocated_band'][1]:.3f}]; within it: " + ", ".join(
                  f"{label} {sum(v)}/{len(v)}" for label, v in s["within_band"].items()), "",
              "| run | steps to reward 0.5 | steps to reward 0.9 | last step's reward |", "|---|---|---|---|"]
    for label, rows in s["reach"].items():
        cells = [", ".join(str(r[k]) for r in rows) for k in ("0.5", "0.9")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | " + ", ".join(f"{r['last']:.3f}" for r in rows) + " |")
    lines += ["",
              "| median per step (s) | synchronous (3 procs) | one-step-off (3 procs) | colocated (2 procs) |",
              "|---|---|---|---|"]
    for key in ("timing_s/step", "timing_s/gen", "rollout/wait_s", "timing_s/weight_sync", "timing_s/update_actor",
                "weight_sync/transfer_s", "weight_sync/transfer_mb", "rollout/staleness"):
        cells = []
        for label in ("synchronous", "one-step-off", "colocated"):
            v = s["timing"][label].get(key)
            cells.append("-" if v is None else f"{v:.4f}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", f"step time one-step-off / synchronous: **{s['step_ratio_offpolicy_vs_sync']:.2f}x**"]
    write_table(result, lines, out, "rollout_ranks")
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"colocated": "tab:gray", "one-step-off": "tab:blue", "one-step-off+is": "tab:green",
              "synchronous": "tab:orange"}
    for run in result["runs"]:
        ys = [h["reward"] for h in run["steps"]]
        ax.plot(range(1, len(ys) + 1), ys, color=colors[run["label"]], alpha=0.8,
                label=run["label"] if run["seed"] == result["seeds"][0] else None)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward: colocated (2 procs) vs rollout rank (3 procs)")
    ax.legend()
    labels = ["synchronous", "one-step-off"]
    parts = [("rollout/wait_s", "waiting for samples"), ("timing_s/weight_sync", "weights staged"),
             ("timing_s/update_actor", "update")]
    bottom = [0.0, 0.0]
    for key, name in parts:
        vals = [s["timing"][label].get(key) or 0.0 for label in labels]
        bx.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    steps = [s["timing"][label]["timing_s/step"] for label in labels]
    bx.plot(labels, steps, "k_", markersize=40, label="step (median)")
    bx.set_ylabel("seconds per step (median)")
    bx.set_title(f"same 3 processes: one-step-off / sync = {s['step_ratio_offpolicy_vs_sync']:.2f}x")
    bx.legend(fontsize=8)
    path = out / "rollout_ranks.png"
    save_figure(fig, path)
    if docs:
        shutil.copy(path, ROOT / "docs" / "img" / "rollout_ranks.png")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--pinned":
        pinned_main()
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--docs", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.seeds = 8, [0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load, busy = check_load("rollout_ranks")
    runs = []
    for seed in args.seeds:
        runs.append(launch("colocated", 2, "0,1", seed, args.steps, out / "rollout_ranks_runs", []))
        runs.append(launch("one-step-off", 3, "0,0,1", seed, args.steps, out / "rollout_ranks_runs",
                           ["--rollout_ranks", "1", "--decoupled_loss", "false"]))  # uncorrected (the default corrects)
        runs.append(launch("one-step-off+is", 3, "0,0,1", seed, args.steps, out / "rollout_ranks_runs",
                           ["--rollout_ranks", "1", "--rollout_is", "token"]))
    runs.append(launch("synchronous", 3, "0,0,1", args.seeds[0], args.steps, out / "rollout_ranks_runs",
                       ["--rollout_ranks", "1", "--rollout_lookahead", "0"]))
    result = {"steps": args.steps, "seeds": args.seeds, "load": load, "busy_at_start": busy, "runs": runs,
              "summary": summarize(runs, tail=min(10, args.steps))}
    (out / "rollout_ranks.json").write_text(json.dumps(result, indent=1))
    write_outputs(result, out, args.docs)
    print((out / "rollout_ranks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
