"""LoRA sync modes learn the same: reward curves of ``rollout_lora_sync="adapter"`` vs ``"merged"``.

The engines sample from the trainer's PEFT policy either way: merged weights (the adapter folded into a copy of each
base weight) or the base once plus the adapter served by vLLM's LoRA layers. Their log-probs agree within 1e-4
(tests/test_lora_sync.py), so the runs should learn alike; this measures it where users look, on the reward curve.

Runs the recipe (one process, vLLM engine, the embedded default task: ``builtin:tiny-qwen2`` learning ``digits``,
8 prompts x 8 samples per step) with LoRA (``--use_peft``, r=8, alpha 16, every projection of the decoder),
``--runs`` seeds per mode, one run at a time. Per step: the mean reward; per mode: the band (min..max) over its
seeds; the summary says at how many steps the adapter runs' mean curve lies inside the merged runs' band and
compares the mean reward of the second half of the steps, with the seeds' spread.

Writes ``lora_curves.json``, ``lora_curves.md`` and ``lora_curves.png`` under ``--out`` (default
benchmarks/results); ``--docs`` also copies the plot to docs/img/lora_curves.png.

    python benchmarks/lora_curves.py [--quick] [--steps 40] [--runs 3] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CHILD_ENV, ROOT, check_load

TASK = ["--config", str(ROOT / "trl_nrollout/recipes/configs/default.yaml"), "--use_peft", "true",
        "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj",
        "gate_proj", "up_proj", "down_proj", "--learning_rate", "2e-2", "--save_strategy", "no",
        "--logging_steps", "1", "--report_to", "none"]
MODES = ("merged", "adapter")


def run(mode: str, seed: int, steps: int, folder: Path) -> dict:
    """One recipe run: its per-step mean reward, the bytes of its syncs and its wall time."""
    out = folder / f"{mode}-{seed}"
    cmd = [sys.executable, "-m", "trl_nrollout.recipe.run", *TASK, "--output_dir", str(out), "--max_steps", str(steps),
           "--seed", str(seed), "--rollout_lora_sync", mode]
    start = time.perf_counter()
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    sync_mb = [h["weight_sync/mb"] for h in history if "weight_sync/mb" in h]
    return {"mode": mode, "seed": seed, "wall_s": wall, "reward": [h["reward"] for h in history],
            "sync_mb_median": statistics.median(sync_mb) if sync_mb else None}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = {"merged": "tab:blue", "adapter": "tab:orange"}
    for r in results:
        ax.plot(range(1, len(r["reward"]) + 1), r["reward"], color=colours[r["mode"]], alpha=0.7,
                label=f"{r['mode']} (seed {r['seed']})")
    ax.set(xlabel="step", ylabel="mean reward", title="LoRA r=8 on tiny-qwen2, digits: sync modes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(results: list[dict], steps: int) -> tuple[dict, list[str]]:
    """The adapter runs' mean curve against the merged runs' band, and the second half's mean rewards."""
    by = {m: [r for r in results if r["mode"] == m] for m in MODES}
    steps = min(len(r["reward"]) for r in results)
    band = [(min(r["reward"][i] for r in by["merged"]), max(r["reward"][i] for r in by["merged"]))
            for i in range(steps)]
    adapter_mean = [statistics.mean(r["reward"][i] for r in by["adapter"]) for i in range(steps)]
    inside = sum(lo <= a <= hi for a, (lo, hi) in zip(adapter_mean, band))
    half = slice(steps // 2, steps)
    second = {m: [statistics.mean(r["reward"][half]) for r in by[m]] for m in MODES}
    first = {m: statistics.mean(statistics.mean(r["reward"][:3]) for r in by[m]) for m in MODES}
    summary = {"steps": steps, "adapter_mean_inside_merged_band": inside,
               "second_half_mean": {m: statistics.mean(v) for m, v in second.items()},
               "second_half_range": {m: [min(v), max(v)] for m, v in second.items()},
               "first_three_steps_mean": first,
               "wall_s_mean": {m: statistics.mean(r["wall_s"] for r in by[m]) for m in MODES}}
    lines = ["| mode | seed | reward, steps 1-3 | reward, second half | sync MiB (median) | wall s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['seed']} | {statistics.mean(r['reward'][:3]):.3f} | "
                     f"{statistics.mean(r['reward'][half]):.3f} | {r['sync_mb_median']} | {r['wall_s']:.0f} |")
    s = summary
    lines.append(f"\nMean reward over steps {steps // 2 + 1}-{steps}: adapter {s['second_half_mean']['adapter']:.3f} "
                 f"(seeds {s['second_half_range']['adapter'][0]:.3f}..{s['second_half_range']['adapter'][1]:.3f}), "
                 f"merged {s['second_half_mean']['merged']:.3f} (seeds {s['second_half_range']['merged'][0]:.3f}.."
                 f"{s['second_half_range']['merged'][1]:.3f}); the adapter runs' mean curve lies inside the merged "
                 f"runs' band at {inside} of {steps} steps.")
    return summary, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 steps, 1 run per mode")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3, help="seeds per mode")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--docs", action="store_true", help="copy the plot to docs/img/")
    args = ap.parse_args(argv)
    steps, runs = (6, 1) if args.quick else (args.steps, args.runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load, busy = check_load("the LoRA reward-curve benchmark")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(runs):
            for mode in MODES:
                print(f"[lora_curves] {mode} seed {seed}, {steps} steps", flush=True)
                r = run(mode, seed, steps, Path(tmp))
                print(f"[lora_curves]   reward {r['reward'][0]:.3f} -> {r['reward'][-1]:.3f}, sync "
                      f"{r['sync_mb_median']} MiB, {r['wall_s']:.0f} s", flush=True)
                results.append(r)
    summary, lines = summarize(results, steps)
    lines.append(f"Load average at start {load[0]:.2f}{' (busy)' if busy else ''}.")
    (out / "lora_curves.json").write_text(json.dumps({**summary, "load_at_start": load, "busy": busy,
                                                      "task": TASK, "results": results}, indent=1))
    (out / "lora_curves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "lora_curves.png")
    if args.docs:
        shutil.copy(out / "lora_curves.png", ROOT / "docs/img/lora_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
