"""LoRA weight sync to a rollout rank: ``rollout_lora_sync="adapter"`` vs ``"merged"`` on ``builtin:medium-qwen2``.

Each mode is one real launch (``accelerate launch --multi_gpu --num_processes 2``: one trainer, one rollout rank,
synchronous ``rollout_lookahead=0``) of ``tests/assets/lora_sync_train.py`` with a rank-``--rank`` LoRA adapter on every
linear layer (alpha 2r), ``--steps`` GRPO steps of 8 prompts x 4 samples. Per step the trainer logs what crossed to
the rollout rank (``weight_sync/transfer_mb``) and how long the transfer took (``weight_sync/transfer_s``: trainer
rank 0's device -> host -> gloo -> the rollout rank's engine). The table gives their medians and the ratio.

Goal (issue 49): sync time to a rollout rank with ``adapter`` <= 0.2x ``merged``.

    python benchmarks/lora_sync_ranks.py [--model builtin:medium-qwen2] [--rank 16] [--steps 4]
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

from common import CHILD_ENV, ROOT, finish, start_parent, write_table

GOAL = 0.2
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def run_mode(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               str(ROOT / "tests/assets/lora_sync_train.py"), out, mode, "ranks", f"model={args.model}",
               f"r={args.rank}", f"steps={args.steps}"]
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}
        print(f"{mode}: launching 1 trainer + 1 rollout rank ({args.steps} steps)", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads((Path(out) / "log_history.json").read_text())
    steps = [h for h in result["history"] if "weight_sync/transfer_s" in h]
    return {"mode": mode, "lora_sync": result["lora_sync"], "steps": len(steps),
            "transfer_mb": statistics.median(h["weight_sync/transfer_mb"] for h in steps),
            "transfer_s": statistics.median(h["weight_sync/transfer_s"] for h in steps),
            "transfer_s_all": [h["weight_sync/transfer_s"] for h in steps],
            "adapter_mb": result["adapter_bytes"] / 2**20, "model_mb": result["model_bytes"] / 2**20}


def write_outputs(result: dict, out_dir: Path) -> str:
    meta, rows = result["meta"], result["rows"]
    merged = next(r for r in rows if r["mode"] == "merged")
    lines = ["| mode | MiB per transfer | transfer s (median) | transfer s (each step) | ratio to merged |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['transfer_mb']:.2f} | {r['transfer_s']:.4f} | "
                     f"{', '.join(f'{s:.3f}' for s in r['transfer_s_all'])} | "
                     f"{r['transfer_s'] / merged['transfer_s']:.3f} |")
    lines += ["", f"Goal: adapter transfer time <= {GOAL}x merged. `{meta['model']}`, LoRA r={meta['rank']} on every "
              f"linear layer (adapter {rows[0]['adapter_mb']:.2f} MiB, model {rows[0]['model_mb']:.2f} MiB); one trainer "
              f"+ one rollout rank, {meta['steps']} steps each, {meta['cpus']} CPUs. Load average (1 min) "
              f"{result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end."]
    return write_table(result, lines, out_dir, "lora_sync_ranks")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:medium-qwen2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    name, load, busy = start_parent(args, "lora_sync_ranks")
    rows = [run_mode(mode, args) for mode in ("merged", "adapter")]
    result = {"meta": {"model": name, "rank": args.rank, "steps": args.steps, "cpus": os.cpu_count()},
              "rows": rows, "load_avg_start": list(load), "load_avg_end": [round(x, 2) for x in os.getloadavg()],
              "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
