"""Partial rollouts vs the synchronous rollout stage on a long-tail task.

The built-in ``longtail`` model (``builtin:tiny-qwen2-longtail``) ends its completions at a long-tailed length:
most samples are short, a few run to ``max_completion_length``, as in long chain-of-thought. A synchronous step
waits for its longest sample; with ``rollout_partial=True`` the step stops once its groups have finished and the
unfinished samples continue in the next step.

Runs the recipe (one process, vLLM engine, the ``digits`` reward) ``--runs`` times synchronously and ``--runs``
times with partial rollouts, with seeds 0, 1, 2, ..., for ``--steps`` steps each, one run at a time, and reports:

- rollout throughput: completion tokens of the trained samples per second of rollout (generation) wall time,
  summed over the steps after the first (a warm-up), and the engine's generated tokens per second;
- the ratio partial / synchronous of the throughput (the runs' means), against the goal of 1.5x;
- the reward curves: partial runs' mean reward per step against the band of the synchronous runs (min..max);
- staleness and the samples carried over, aborted and restarted.

Writes ``partial_rollout.json``, ``partial_rollout.md`` and ``partial_rollout.png`` (rollout time per step and the
reward curves) under ``--out`` (default benchmarks/results); ``--docs`` also copies the plot to
docs/img/partial_rollout.png.

    python benchmarks/partial_rollout.py [--quick] [--steps 30] [--runs 3] [--out DIR] [--docs]
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

GOAL_THROUGHPUT = 1.5
TASK = ["--model_name_or_path", "builtin:tiny-qwen2-longtail", "--max_completion_length", "128",
        "--train_batch_size", "16", "--rollout_n", "8", "--learning_rate", "2e-3", "--save_strategy", "no",
        "--logging_steps", "1", "--report_to", "none"]
MODES = {"sync": [], "partial": ["--rollout_partial", "true"]}


def run(mode: str, seed: int, steps: int, folder: Path) -> dict:
    """One recipe run; its per-step log history and wall time."""
    out = folder / f"{mode}-{seed}"
    cmd = [sys.executable, str(ROOT / "recipes/grpo.py"), "--output_dir", str(out), "--use_cpu", "true",
           "--max_steps", str(steps), "--seed", str(seed), *TASK, *MODES[mode]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    return {"mode": mode, "seed": seed, "wall_s": wall, "steps": history}


def summarize(r: dict, samples_per_step: int) -> dict:
    """Throughput over the steps after the first (the engine's warm-up), and the curves."""
    steps = r["steps"][1:]
    gen_s = sum(h["timing_s/gen"] for h in steps)
    trained = sum(h["completions/mean_length"] * samples_per_step for h in steps)
    generated = sum(h["perf/gen_tokens_per_s"] * h["timing_s/gen"] for h in steps)
    out = {"mode": r["mode"], "seed": r["seed"], "gen_s": gen_s, "trained_tokens": trained,
           "trained_tokens_per_s": trained / gen_s, "generated_tokens_per_s": generated / gen_s,
           "gen_s_per_step": [h["timing_s/gen"] for h in r["steps"]], "reward": [h["reward"] for h in r["steps"]],
           "mean_length": [h["completions/mean_length"] for h in r["steps"]],
           "clipped_ratio": statistics.mean(h["completions/clipped_ratio"] for h in r["steps"])}
    if r["mode"] == "partial":
        for key in ("staleness_max", "staleness_mean", "aborted_samples", "restarted_samples", "pool_groups"):
            out[key] = statistics.mean(h[f"partial/{key}"] for h in r["steps"])
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "partial": "tab:orange"}
    for r in results:
        label = f"{r['mode']} (seed {r['seed']})"
        a.plot(range(1, len(r["gen_s_per_step"]) + 1), r["gen_s_per_step"], color=colours[r["mode"]], alpha=0.7,
               label=label)
        b.plot(range(1, len(r["reward"]) + 1), r["reward"], color=colours[r["mode"]], alpha=0.7, label=label)
    a.set(xlabel="step", ylabel="rollout (generation) time, s", title="Rollout time per step")
    b.set(xlabel="step", ylabel="mean reward", title="Reward (digits)")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 steps, 1 run per mode")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--docs", action="store_true", help="copy the plot to docs/img/")
    args = ap.parse_args(argv)
    steps, runs = (8, 1) if args.quick else (args.steps, args.runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load, busy = check_load("the partial-rollout benchmark")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(runs):
            for mode in MODES:
                print(f"[partial_rollout] {mode} seed {seed}: {steps} steps", flush=True)
                r = summarize(run(mode, seed, steps, Path(tmp)), samples_per_step=16 * 8)
                print(f"[partial_rollout]   trained tokens/s {r['trained_tokens_per_s']:.0f}, generated tokens/s "
                      f"{r['generated_tokens_per_s']:.0f}, rollout {r['gen_s']:.1f} s", flush=True)
                results.append(r)
    by = {m: [r for r in results if r["mode"] == m] for m in MODES}
    tput = {m: statistics.mean(r["trained_tokens_per_s"] for r in rs) for m, rs in by.items()}
    ratio = tput["partial"] / tput["sync"]
    band = [(min(r["reward"][i] for r in by["sync"]), max(r["reward"][i] for r in by["sync"]))
            for i in range(steps)]
    partial_mean = [statistics.mean(r["reward"][i] for r in by["partial"]) for i in range(steps)]
    inside = sum(lo <= p <= hi for p, (lo, hi) in zip(partial_mean, band))
    summary = {"steps": steps, "runs": runs, "load_at_start": load, "busy": busy, "task": TASK,
               "throughput_trained_tokens_per_s": tput, "ratio_partial_over_sync": ratio,
               "goal_ratio": GOAL_THROUGHPUT, "goal_met": ratio >= GOAL_THROUGHPUT,
               "partial_reward_steps_inside_sync_band": inside, "results": results}
    (out / "partial_rollout.json").write_text(json.dumps(summary, indent=1))
    lines = ["| mode | seed | rollout s | trained tok/s | generated tok/s | clipped | staleness max/mean | "
             "aborted | restarted |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        extra = (f"{r['staleness_max']:.2f} / {r['staleness_mean']:.2f} | {r['aborted_samples']:.1f} | "
                 f"{r['restarted_samples']:.1f}" if r["mode"] == "partial" else "- | - | -")
        lines.append(f"| {r['mode']} | {r['seed']} | {r['gen_s']:.1f} | {r['trained_tokens_per_s']:.0f} | "
                     f"{r['generated_tokens_per_s']:.0f} | {r['clipped_ratio']:.3f} | {extra} |")
    lines.append(f"\npartial / sync rollout throughput (trained tokens per rollout second): **{ratio:.2f}x** "
                 f"(goal >= {GOAL_THROUGHPUT}x); partial mean reward inside the sync runs' band at {inside} of "
                 f"{steps} steps; load at start {load[0]:.2f}.")
    (out / "partial_rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "partial_rollout.png")
    if args.docs:
        shutil.copy(out / "partial_rollout.png", ROOT / "docs/img/partial_rollout.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
