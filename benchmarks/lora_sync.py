"""LoRA weight sync, colocated: ``rollout_lora_sync="adapter"`` (the engine serves the adapter; only its tensors
travel) vs ``"merged"`` (full weights with the adapter merged in), on ``builtin:medium-qwen2`` by default.

Each (mode, rank) runs in a fresh process (vLLM runs one engine per process): a PEFT model (LoRA on every
projection of the decoder, ``init_lora_weights=False``), its vLLM engine (LoRA enabled for ``adapter``), one
initial sync (``adapter``: the base once, then the adapter), then ``--reps`` timed syncs (each after a change of
the adapter, as an optimizer step makes) and ``--reps`` timed rollouts of ``--prompts x n`` samples
(``--prompt-tokens``-token prompts, ``--max-tokens`` new tokens, EOS ignored, temperature 1.0). Per sync: bytes
sent and seconds (median); per rollout: seconds (median) and generated tokens/s, which show the cost of vLLM's
LoRA kernels (a low-rank matmul beside every targeted layer in each forward). ``sync + rollout`` is the part of a
step that the sync mode changes (the update and the log-prob passes run on the trainer's PEFT model either way).

Goals (issue 49): bytes per sync with ``adapter`` = the adapter's; sync time ``adapter`` <= 0.2x ``merged``.

    python benchmarks/lora_sync.py [--quick] [--model builtin:medium-qwen2] [--ranks 16 64] [--n 8] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import CHILD_ENV, ROOT, finish, start_parent, write_table

GOAL = 0.2  # adapter sync seconds / merged sync seconds
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_one(mode: str, rank: int, args) -> dict:
    """One engine, one sync mode: sync and rollout timings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, long_prompts
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.engines.weight_sync import adapter_bytes
    from trl_nrollout.rollout.types import SamplingOptions

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False,
                                      lora_dropout=0.0)).eval()
    lora_bytes, model_bytes = adapter_bytes(model)
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = long_prompts(digits_prompts(args.prompts), tok, args.prompt_tokens)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=args.prompts, rollout_n=args.n)
    start = time.perf_counter()
    group = VLLMEngineGroup(args.model, layout, rank=0, max_model_len=args.prompt_tokens + args.max_tokens + 8,
                            seed=0, lora_rank=rank if mode == "adapter" else None)
    startup_s = time.perf_counter() - start
    first = (group.load_weights(model, merge_lora=False)["bytes"] if mode == "adapter" else 0)

    def sync() -> dict:
        return group.load_adapter(model) if mode == "adapter" else group.load_weights(model)

    sync()
    params = [p for n, p in model.named_parameters() if "lora_B" in n]
    sync_s, sync_bytes, gen_s, tokens = [], [], [], []
    expanded = [p for p in prompts for _ in range(args.n)]
    opts = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=1)
    group.generate_expanded(expanded, args.n, opts)  # warm-up
    for _ in range(args.reps):
        with torch.no_grad():  # what an optimizer step does to the adapter
            for p in params:
                p.mul_(1.01)
        t0 = time.perf_counter()
        stats = sync()
        sync_s.append(time.perf_counter() - t0)
        sync_bytes.append(stats["bytes"])
        t0 = time.perf_counter()
        batch = group.generate_expanded(expanded, args.n, opts)
        gen_s.append(time.perf_counter() - t0)
        tokens.append(batch.num_completion_tokens)
    group.close()
    gen = statistics.median(gen_s)
    return {"mode": mode, "rank": rank, "adapter_bytes": lora_bytes, "model_bytes": model_bytes,
            "base_bytes_once": first, "sync_bytes": sync_bytes[0], "sync_s": round(statistics.median(sync_s), 4),
            "sync_s_all": [round(s, 4) for s in sync_s], "gen_s": round(gen, 3),
            "gen_s_all": [round(s, 3) for s in gen_s], "tokens_per_s": round(tokens[0] / gen, 1),
            "samples": len(expanded), "startup_s": round(startup_s, 2)}


def child(mode: str, rank: int, args) -> dict:
    cmd = [sys.executable, __file__, "--one", mode, str(rank), "--model", args.model, "--n", str(args.n),
           "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens), "--max-tokens",
           str(args.max_tokens), "--reps", str(args.reps)]
    env = {**os.environ, **CHILD_ENV}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(f"{mode} r={rank} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(last)


def write_outputs(result: dict, out_dir: Path) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = ["| rank | adapter / model bytes | mode | bytes per sync | sync s | sync ratio (adapter / merged) | "
             "rollout s | tokens/s | rollout ratio | sync + rollout s | step part ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rank in meta["ranks"]:
        merged = next(r for r in rows if r["rank"] == rank and r["mode"] == "merged")
        for r in (merged, next(r for r in rows if r["rank"] == rank and r["mode"] == "adapter")):
            ratio = r["sync_s"] / merged["sync_s"]
            gen_ratio = r["gen_s"] / merged["gen_s"]
            part = (r["sync_s"] + r["gen_s"]) / (merged["sync_s"] + merged["gen_s"])
            lines.append(f"| {rank} | {r['adapter_bytes'] / r['model_bytes']:.3f} | {r['mode']} | "
                         f"{r['sync_bytes'] / 2**20:.2f} MiB | {r['sync_s']:.4f} | {ratio:.3f} | {r['gen_s']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {gen_ratio:.3f} | {r['sync_s'] + r['gen_s']:.2f} | {part:.3f} |")
    lines += ["", f"Goal: adapter sync time <= {GOAL}x merged. Model `{meta['model_name']}`; LoRA on "
              f"{', '.join(TARGETS)}, alpha = 2r; {meta['prompts']} prompts x n = {meta['n']} "
              f"({meta['prompts'] * meta['n']} samples) of {meta['prompt_tokens']}-token prompts, {meta['max_tokens']} "
              f"new tokens, {meta['reps']} timed syncs and rollouts each (medians), one process per row, "
              f"{meta['cpus']} CPUs. Load average (1 min) {result['load_avg_start'][0]:.2f} at start, "
              f"{result['load_avg_end'][0]:.2f} at end."]
    return write_table(result, lines, out_dir, "lora_sync")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:medium-qwen2", help="built-in name, hub id or local folder")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="rank 16 only, 2 timed reps, 32 new tokens")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "RANK"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args)))
        return 0
    if args.quick:
        args.ranks, args.reps, args.max_tokens = [16], 2, 32
    model_name, load_start, busy = start_parent(args, "sync and rollout ratios")
    rows = [child(mode, rank, args) for rank in args.ranks for mode in ("merged", "adapter")]
    result = {"rows": rows,
              "meta": {"model_name": model_name, "model_path": args.model, "ranks": args.ranks, "n": args.n,
                       "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                       "reps": args.reps, "quick": args.quick, "cpus": os.cpu_count()},
              "load_avg_start": [round(x, 2) for x in load_start],
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load_start)


if __name__ == "__main__":
    raise SystemExit(main())
