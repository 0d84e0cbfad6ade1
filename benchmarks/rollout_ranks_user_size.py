"""Rollout ranks at a user's size: 64 prompts x 8 samples of 2,100 tokens each, 2 trainers + 1 rollout rank.

One rollout rank generates the whole job: 512 samples x 2,100 tokens = 1.08 M tokens, whose ids and log-probs
(4 bytes each) are 8.6 MB, over the 8 MiB a value of the launcher's store may hold (torch's libuv store drops the
connection past it, and the trainers then saw "trainer rank 0 died"). The model is the built-in tiny Qwen2 with a
4,096-token context (random weights, so completions are forced to their full length with ``min_tokens``).

Runs the recipe with ``accelerate launch`` (3 processes, DDP over gloo, one-step-off: ``rollout_lookahead=1``) for
``--steps`` steps and reports: whether it trained to the end, the step times, the samples' tokens per step and
what one rollout rank's result weighs. Prints and saves ``rollout_ranks_user_size.json`` / ``.md`` under ``--out``.

    python benchmarks/rollout_ranks_user_size.py [--steps 2] [--tokens 2100] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import check_load, write_table  # noqa: E402


def build_model(folder: Path) -> str:
    """The built-in tiny Qwen2's shape and tokenizer with 4,096 positions (random weights)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trl_nrollout.builtin import BUILTIN_MODELS, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    shape = {k: v for k, v in BUILTIN_MODELS["tiny-qwen2"].items() if k in Qwen2Config().to_dict()}
    config = Qwen2Config(**{**shape, "vocab_size": len(tok), "max_position_embeddings": 4096,
                            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id})
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    args = parser.parse_args(argv)
    load, busy = check_load("the user-size rollout-rank run")
    work = args.out / "rollout_ranks_user_size"
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work / "model")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "3",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "recipes/grpo.py"),
           "--model_name_or_path", model, "--output_dir", str(work / "run"), "--max_steps", str(args.steps),
           "--train_batch_size", "64", "--rollout_n", "8", "--max_completion_length", str(args.tokens),
           "--generation_kwargs", json.dumps({"min_tokens": args.tokens}), "--rollout_max_model_len", "4096",
           "--rollout_ranks", "1", "--rollout_lookahead", "1", "--ppo_micro_batch_size_per_device", "16",
           "--log_prob_micro_batch_size_per_device", "16", "--rollout_kv_cache_memory_bytes", str(1536 << 20),
           "--gradient_checkpointing", "true", "--logging_steps", "1", "--save_strategy", "no", "--ddp_backend", "gloo"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    history_file = work / "run" / "log_history.json"
    history = [h for h in json.loads(history_file.read_text()) if "reward" in h] if history_file.exists() else []
    tokens = [h.get("completions/mean_length", 0) * 64 * 8 for h in history]
    result = {"load_at_start": load, "busy_at_start": busy, "returncode": proc.returncode, "wall_s": wall,
              "steps": len(history), "step_time_s": [h.get("step_time", h.get("timing_s/step")) for h in history],
              "tokens_per_step": tokens, "result_mb_per_rollout_rank": [t * 8 / 2**20 for t in tokens],
              "staleness": [h.get("rollout/staleness") for h in history]}
    if proc.returncode:
        result["error_tail"] = (proc.stdout[-2000:] + proc.stderr[-4000:])
    lines = ["| steps trained | of | completion tokens per step | one result (MiB) | staleness | wall (s) |",
             "|---|---|---|---|---|---|",
             f"| {len(history)} | {args.steps} | {', '.join(f'{t:,.0f}' for t in tokens)} | "
             f"{', '.join(f'{m:.1f}' for m in result['result_mb_per_rollout_rank'])} | {result['staleness']} | "
             f"{wall:.0f} |"]
    print(write_table(result, lines, args.out, "rollout_ranks_user_size"))
    if proc.returncode:
        print(result["error_tail"], file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
