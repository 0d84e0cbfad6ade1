"""Weights as what changed (``weight_sync_delta``, issue 65 item 2): bytes and seconds per weight sync to a rollout
rank, whole buckets vs deltas, at two learning rates, on ``builtin:medium-qwen2`` with a bf16 engine.

Each arm is one real launch of the recipe (``accelerate launch --multi_gpu --num_processes 2``: one trainer, one
rollout rank, synchronous ``rollout_lookahead=0``, Adam, ``rollout_dtype=bfloat16``), ``--steps`` GRPO steps of 8 prompts x
4 samples. Per version after the first (the first is whole: nothing is held yet) the trainer logs the version's bytes
(``weight_sync/transfer_mb``), the bytes that crossed (``weight_sync/transfer_sent_mb``) and the transfer's seconds
(``weight_sync/transfer_s``: device -> host -> encode -> gloo -> the rollout rank's decode and staging). The table gives
the medians and the ratios to the whole-bucket arm at the same learning rate.

Goal (issue 65): delta bytes / full bytes <= 0.3x at lr 1e-6 (Adam, bf16 engine).

    python benchmarks/weight_delta.py [--model builtin:medium-qwen2] [--steps 5] [--lrs 1e-6,1e-5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import CHILD_ENV, ROOT, finish, pyplot, save_figure, start_parent, write_table

GOAL = 0.3
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def run_arm(lr: float, delta: bool, args) -> dict:
    """One launch: the per-version bytes and seconds after the first version."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "recipes/grpo.py"),
               "--model_name_or_path", args.model, "--output_dir", out, "--max_steps", str(args.steps),
               "--learning_rate", str(lr), "--train_batch_size", "8", "--rollout_n", "4",
               "--max_completion_length", "32", "--rollout_ranks", "1", "--rollout_lookahead", "0",
               "--rollout_dtype", "bfloat16", "--weight_sync_delta", str(delta).lower(), "--save_strategy", "no",
               "--use_cpu", "true", "--bf16", "false"]
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}
        print(f"lr {lr:g}, {'deltas' if delta else 'whole buckets'}: 1 trainer + 1 rollout rank, {args.steps} steps",
              file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"lr {lr} delta {delta} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        history = json.loads((Path(out) / "log_history.json").read_text())
    steps = [h for h in history if "weight_sync/transfer_s" in h][1:]  # after the first (whole) version
    if not steps:
        raise RuntimeError("no transfer after the first was logged: raise --steps")
    sent = [h.get("weight_sync/transfer_sent_mb", h["weight_sync/transfer_mb"]) for h in steps]
    return {"lr": lr, "delta": delta, "versions": len(steps),
            "full_mb": statistics.median(h["weight_sync/transfer_mb"] for h in steps),
            "sent_mb": statistics.median(sent), "sent_mb_all": sent,
            "transfer_s": statistics.median(h["weight_sync/transfer_s"] for h in steps)}


def table_lines(result: dict) -> list[str]:
    """The Markdown table of a result (its JSON as written): one row per arm. docs/benchmarks.md quotes it, and
    tests/test_benchmark_figures.py regenerates it from docs/results/weight_delta.json to check the quote."""
    rows = result["rows"]
    lines = ["| lr | sync | MiB per version | MiB sent (median) | sent / version | transfer s (median) | "
             "s vs whole at this lr |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        whole = next(w for w in rows if w["lr"] == r["lr"] and not w["delta"])
        lines.append(f"| {r['lr']:g} | {'deltas' if r['delta'] else 'whole'} | {r['full_mb']:.2f} | "
                     f"{r['sent_mb']:.2f} | {r['sent_mb'] / r['full_mb']:.3f}x | {r['transfer_s']:.3f} | "
                     f"{r['transfer_s'] / whole['transfer_s']:.2f}x |")
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = table_lines(result)
    lines += ["", f"Goal: sent / version <= {GOAL}x at lr 1e-6. `{meta['model']}` (bf16 engine, float32 trainer, "
              f"Adam), one trainer + one rollout rank, {meta['steps']} steps per arm, versions after the first; "
              f"{meta['cpus']} CPUs. Load average (1 min) {result['load_avg_start'][0]:.2f} at start, "
              f"{result['load_avg_end'][0]:.2f} at end."]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for lr in sorted({r["lr"] for r in rows}):
            arm = next(r for r in rows if r["lr"] == lr and r["delta"])
            ax.plot(range(1, len(arm["sent_mb_all"]) + 1), [mb / arm["full_mb"] for mb in arm["sent_mb_all"]],
                    marker="o", label=f"lr {lr:g}")
        ax.axhline(GOAL, color="grey", linestyle="--", label=f"goal {GOAL}x")
        ax.set(xlabel="weight version (after the first)", ylabel="bytes sent / version's bytes",
               title="weight_sync_delta: what crosses to the rollout rank", ylim=(0, 1.05))
        ax.legend()
        save_figure(fig, out_dir / "weight_delta.png")
    return write_table(result, lines, out_dir, "weight_delta")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:medium-qwen2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="builtin:tiny-qwen2, 3 steps, lr 1e-6 only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.lrs = "builtin:tiny-qwen2", 3, "1e-6"
    name, load, busy = start_parent(args, "weight_delta")
    rows = [run_arm(float(lr), delta, args) for lr in args.lrs.split(",") for delta in (False, True)]
    result = {"meta": {"model": name, "steps": args.steps, "cpus": os.cpu_count()}, "rows": rows,
              "load_avg_start": list(load), "load_avg_end": [round(x, 2) for x in os.getloadavg()],
              "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
