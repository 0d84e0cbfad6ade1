"""How much could one-step-off-policy rollouts (generate step k+1 while step k trains) gain on this machine?

An upper bound, measured without changing the trainer: the two halves of a step run on their own, one after the
other, then at the same time in two threads of one process (the engine's ``generate`` in one, a training
forward/backward/AdamW step in the other, as an asynchronous trainer would run them), with the CPU's threads
either shared (every OpenMP pool on all cores) or split (half each: ``torch.set_num_threads`` is per thread).
Overlap can only pay if the concurrent wall time is below the sequential sum; on a machine whose two phases each
fill every core it cannot, whatever the trainer does. Writes ``overlap_probe.{json,md}`` under ``--out``.

    python benchmarks/overlap_probe.py [--quick] [--model PATH] [--prompts 16] [--prompt-tokens 32] [--n 8]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from common import ROOT, start_parent


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, long_prompts
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.types import SamplingOptions

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(t, add_special_tokens=False)["input_ids"]
               for t in long_prompts(digits_prompts(args.prompts), tok, args.prompt_tokens)]
    expanded = [p for p in prompts for _ in range(args.n)]
    group = VLLMEngineGroup(args.model, RolloutLayout.build(num_processes=1, rollout_tp_size=1,
                                                            train_batch_size=args.prompts, rollout_n=args.n),
                            rank=0, max_model_len=args.prompt_tokens + args.max_tokens + 8, seed=0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-7)
    width = max(map(len, prompts)) + args.max_tokens
    batch = torch.randint(10, tok.vocab_size - 10, (len(expanded), width))
    cores = os.cpu_count() or 1

    def generate(threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        group.generate_expanded(expanded, args.n, SamplingOptions(max_tokens=args.max_tokens, ignore_eos=True, seed=1))

    def train(threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        for start in range(0, len(batch), args.micro_batch):  # micro batches, one optimizer step
            ids = batch[start:start + args.micro_batch]
            model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()

    def clock(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def together(gen_threads: int | None, train_threads: int | None) -> float:
        start = time.perf_counter()
        worker = threading.Thread(target=generate, args=(gen_threads,))
        worker.start()
        train(train_threads)
        worker.join()
        torch.set_num_threads(cores)
        return time.perf_counter() - start

    generate()  # warm-ups
    train()
    out: dict = {"gen_s": [], "train_s": [], "shared_s": [], "split_s": []}
    for _ in range(args.reps):
        out["gen_s"].append(clock(generate))
        out["train_s"].append(clock(train))
        out["shared_s"].append(together(None, None))
        half = max(1, cores // 2)
        out["split_s"].append(together(half, max(1, cores - half)))
    mean = {k: sum(v) / len(v) for k, v in out.items()}
    sequential = mean["gen_s"] + mean["train_s"]
    return {"seconds": out, "mean_s": {k: round(v, 4) for k, v in mean.items()},
            "sequential_s": round(sequential, 4),
            "speedup_shared": round(sequential / mean["shared_s"], 3),
            "speedup_split": round(sequential / mean["split_s"], 3),
            "best_possible": round(sequential / max(mean["gen_s"], mean["train_s"]), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repetition")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 1
    name, load_start, busy = start_parent(args, "overlap figures")
    result = measure(args)
    result.update({"meta": {"model_name": name, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                            "n": args.n, "max_tokens": args.max_tokens, "reps": args.reps, "cpus": os.cpu_count()},
                   "load_avg_start": [round(x, 2) for x in load_start],
                   "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy})
    m = result["mean_s"]
    table = "\n".join([
        "| generation alone (s) | update alone (s) | one after the other (s) | together, threads shared (s) | "
        "together, threads split (s) |", "|---|---|---|---|---|",
        f"| {m['gen_s']:.3f} | {m['train_s']:.3f} | {result['sequential_s']:.3f} | {m['shared_s']:.3f} | "
        f"{m['split_s']:.3f} |", "",
        f"Overlap speed-up: {result['speedup_shared']:.2f}x with shared threads, {result['speedup_split']:.2f}x with "
        f"split threads (a perfect overlap would give {result['best_possible']:.2f}x). Model `{name}`, "
        f"{args.prompts} prompts x n = {args.n}, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, "
        f"{os.cpu_count()} CPUs; load {load_start[0]:.2f} at start."])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overlap_probe.json").write_text(json.dumps(result, indent=2))
    (out_dir / "overlap_probe.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
