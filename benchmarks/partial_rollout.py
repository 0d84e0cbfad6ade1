"""Partial rollouts vs the synchronous rollout stage on a long-tail task.

The built-in ``longtail`` model (``builtin:tiny-qwen2-longtail``) ends its completions at a long-tailed length:
most samples are short, a few run to ``max_completion_length``, as in long chain-of-thought. A synchronous step
waits for its longest sample; with ``rollout_partial=True`` the step stops once its groups have finished and the
unfinished samples continue in the next step.

Runs the recipe (one process, vLLM engine, the ``digits`` reward), one run at a time, in two parts:

- throughput: 2 runs per mode at ``learning_rate=1e-7`` (the policy stays put, so both modes generate the same
  length distribution): useful completion tokens (generated, less those of samples restarted as stale) per second
  of rollout (generation) wall time, summed over the steps after the first (a warm-up), and the ratio partial /
  synchronous against the goal of 1.5x; also the tokens of the samples that trained per rollout second (over a
  short run it favours the synchronous mode: the partial pool holds the long samples back until they finish);
- learning: ``--runs`` runs per mode at ``learning_rate=1e-3``: each partial run's reward curve against the band
  of the synchronous runs (min..max per step), and the mean reward over the second half of the steps;

with staleness and the samples aborted and restarted per step.

Writes ``partial_rollout.json``, ``partial_rollout.md`` and ``partial_rollout.png`` (rollout time per step and the
reward curves) under ``--out`` (default benchmarks/results); ``--docs`` also copies the plot to
docs/img/partial_rollout.png.

    python benchmarks/partial_rollout.py [--quick] [--steps 20] [--runs 3] [--out DIR] [--docs]
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
LR_FIXED = 1e-7  # the throughput part: the policy stays put, so both modes generate the same length distribution
LR_LEARN = 1e-3  # the learning part
TASK = ["--model_name_or_path", "builtin:tiny-qwen2-longtail", "--max_completion_length", "128",
        "--train_batch_size", "16", "--rollout_n", "8", "--save_strategy", "no",
        "--logging_steps", "1", "--report_to", "none"]
MODES = {"sync": [], "partial": ["--rollout_partial", "true"]}


def run(mode: str, seed: int, steps: int, folder: Path, lr: float) -> dict:
    """One recipe run; its per-step log history and wall time."""
    out = folder / f"{mode}-{seed}-{lr}"
    cmd = [sys.executable, str(ROOT / "recipes/grpo.py"), "--output_dir", str(out), "--use_cpu", "true",
           "--max_steps", str(steps), "--seed", str(seed), "--learning_rate", str(lr), *TASK, *MODES[mode]]
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
    dropped = sum(h.get("partial/dropped_tokens", 0.0) for h in steps)  # tokens of samples restarted as stale
    out = {"mode": r["mode"], "seed": r["seed"], "gen_s": gen_s, "trained_tokens": trained,
           "trained_tokens_per_s": trained / gen_s, "generated_tokens_per_s": generated / gen_s,
           "useful_tokens_per_s": (generated - dropped) / gen_s,
           "gen_s_per_step": [h["timing_s/gen"] for h in r["steps"]], "reward": [h["reward"] for h in r["steps"]],
           "mean_length": [h["completions/mean_length"] for h in r["steps"]],
           "clipped_ratio": statistics.mean(h["completions/clipped_ratio"] for h in r["steps"])}
    if r["mode"] == "partial":
        for key in ("staleness_max", "staleness_mean", "aborted_samples", "restarted_samples", "pool_groups"):
            out[key] = statistics.mean(h[f"partial/{key}"] for h in r["steps"])
    return out


def plot(speed: list[dict], learn: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "partial": "tab:orange"}
    for r in speed:
        a.plot(range(1, len(r["gen_s_per_step"]) + 1), r["gen_s_per_step"], color=colours[r["mode"]], alpha=0.8,
               label=f"{r['mode']} (seed {r['seed']})")
    for r in learn:
        b.plot(range(1, len(r["reward"]) + 1), r["reward"], color=colours[r["mode"]], alpha=0.7,
               label=f"{r['mode']} (seed {r['seed']})")
    a.set(xlabel="step", ylabel="rollout (generation) time, s", title="Rollout time per step (policy fixed)")
    b.set(xlabel="step", ylabel="mean reward", title="Reward while learning (digits)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 steps, 1 run per mode and part")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (learning part; the throughput part: 2)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--docs", action="store_true", help="copy the plot to docs/img/")
    args = ap.parse_args(argv)
    steps, runs, speed_runs = (8, 1, 1) if args.quick else (args.steps, args.runs, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load, busy = check_load("the partial-rollout benchmark")
    speed, learn = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for part, lr, count, bucket in (("throughput", LR_FIXED, speed_runs, speed), ("learning", LR_LEARN, runs, learn)):
            for seed in range(count):
                for mode in MODES:
                    print(f"[partial_rollout] {part}: {mode} seed {seed}, {steps} steps, learning_rate {lr}", flush=True)
                    r = summarize(run(mode, seed, steps, Path(tmp), lr), samples_per_step=16 * 8)
                    print(f"[partial_rollout]   useful tokens/s {r['useful_tokens_per_s']:.0f}, generated tokens/s "
                          f"{r['generated_tokens_per_s']:.0f}, rollout {r['gen_s']:.1f} s, clipped "
                          f"{r['clipped_ratio']:.3f}", flush=True)
                    bucket.append({**r, "part": part, "learning_rate": lr})
    tput = {m: statistics.mean(r["useful_tokens_per_s"] for r in speed if r["mode"] == m) for m in MODES}
    ratio = tput["partial"] / tput["sync"]
    sync = [r for r in learn if r["mode"] == "sync"]
    band = [(min(r["reward"][i] for r in sync), max(r["reward"][i] for r in sync)) for i in range(steps)]
    partial_mean = [statistics.mean(r["reward"][i] for r in learn if r["mode"] == "partial") for i in range(steps)]
    inside = sum(lo <= p <= hi for p, (lo, hi) in zip(partial_mean, band))
    last = slice(steps // 2, steps)  # the second half of the run: where the curves have moved
    mean_of = {m: statistics.mean(statistics.mean(r["reward"][last]) for r in learn if r["mode"] == m) for m in MODES}
    spread = [statistics.mean(r["reward"][last]) for r in sync]
    summary = {"steps": steps, "load_at_start": load, "busy": busy, "task": TASK,
               "throughput_useful_tokens_per_s": tput, "ratio_partial_over_sync": ratio,
               "goal_ratio": GOAL_THROUGHPUT, "goal_met": ratio >= GOAL_THROUGHPUT,
               "reward_second_half": mean_of, "sync_reward_second_half_range": [min(spread), max(spread)],
               "partial_reward_steps_inside_sync_band": inside, "results": speed + learn}
    (out / "partial_rollout.json").write_text(json.dumps(summary, indent=1))
    lines = ["| part | mode | seed | rollout s | useful tok/s | generated tok/s | trained tok/s | clipped | "
             "staleness max/mean | aborted / step | restarted / step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in speed + learn:
        extra = (f"{r['staleness_max']:.2f} / {r['staleness_mean']:.2f} | {r['aborted_samples']:.1f} | "
                 f"{r['restarted_samples']:.1f}" if r["mode"] == "partial" else "- | - | -")
        lines.append(f"| {r['part']} | {r['mode']} | {r['seed']} | {r['gen_s']:.1f} | {r['useful_tokens_per_s']:.0f} | "
                     f"{r['generated_tokens_per_s']:.0f} | {r['trained_tokens_per_s']:.0f} | {r['clipped_ratio']:.3f} | "
                     f"{extra} |")
    lines.append(f"\nThroughput (learning_rate {LR_FIXED}: the policy stays put, both modes see the same lengths): "
                 f"partial / sync = **{ratio:.2f}x** useful completion tokens (generated, less those of samples restarted as "
                 f"stale) per rollout second (goal >= {GOAL_THROUGHPUT}x). "
                 f"Learning (learning_rate {LR_LEARN}): mean reward over steps {steps // 2 + 1}-{steps}: partial "
                 f"{mean_of['partial']:.3f}, sync {mean_of['sync']:.3f} (sync runs {min(spread):.3f}..{max(spread):.3f}); "
                 f"partial's mean curve inside the sync runs' band at {inside} of {steps} steps. Load at start "
                 f"{load[0]:.2f}.")
    (out / "partial_rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(speed, learn, out / "partial_rollout.png")
    if args.docs:
        shutil.copy(out / "partial_rollout.png", ROOT / "docs/img/partial_rollout.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
