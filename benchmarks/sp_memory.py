"""Ulysses sequence parallelism on CPU: the update's peak memory per rank for one long sample at S = 1 and S = 2,
and the all-to-all's share of the update's time (gloo).

One sample of ``--tokens`` tokens (a prompt of 256 and the rest completion) of ``builtin:medium-qwen2`` (8 layers,
8 heads, 4,096 positions), float32, gradient checkpointing on (TRL's default), varlen rows (each sequence by its
boundaries: no ``L x L`` mask), one update micro batch: the forward through TRL's fused LM head
(:func:`~trl_nrollout.passes.ulysses.sharded_policy_logps` at S = 2), a GRPO-like loss, the backward. Each
configuration runs in fresh processes (S = 1: one; S = 2: two, gloo): per rank the peak resident memory the step
added (``ru_maxrss`` after the step less before it; the model, its gradients and the optimizer-free state are
allocated by a warm-up step first) and the step's seconds, with the seconds spent in ``all_to_all_single`` (forward,
backward and the checkpointed recomputation) measured around each call.

Goals (issue 48): peak activation memory per rank at S = 2 <= 0.6x that at S = 1; the all-to-all's share written.

    python benchmarks/sp_memory.py [--tokens 4000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import ROOT, check_load, finish, write_table  # noqa: E402

GOAL = 0.6


def _step(model, rows, sp) -> None:
    import torch

    from trl_nrollout.passes.ulysses import sharded_policy_logps

    if sp is None:
        out = model(input_ids=rows.input_ids, shift_labels=rows.shift_labels, fused_lm_head=True,
                    **rows.forward_kwargs())
        logps = rows.gather(out.log_probs)
    else:
        logps, _ = sharded_policy_logps(model, rows, sp)
    mask = rows.valid.float()
    loss = -(torch.exp(logps - logps.detach()) * mask).sum() / mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=False)


def worker(rank: int, world: int, tokens: int, repeats: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.passes.padfree import pack_rows
    from trl_nrollout.passes.ulysses import install, new_sp_group, sp_multiple
    from trl_nrollout.passes.varlen import VARLEN_NAME, register

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:medium-qwen2"), dtype=torch.float32)
    model.config._attn_implementation = VARLEN_NAME
    add_fused_lm_head(model, outputs=("log_probs",))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    sp = None
    if world > 1:
        install(model)
        sp = new_sp_group(world)
    g = torch.Generator().manual_seed(1)

    def rows_of(n: int):
        prompt = torch.randint(3, 1000, (256,), generator=g)
        completion = torch.randint(3, 1000, (n - 256,), generator=g)
        return pack_rows([prompt], [completion], 0, mask_dtype=None, pad_to_multiple_of=sp_multiple(None, world))

    a2a = [0.0]
    plain = dist.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = plain(*args, **kwargs)
        a2a[0] += time.perf_counter() - start
        return result

    dist.all_to_all_single = timed
    _step(model, rows_of(512), sp)  # warm-up: gradients allocated, kernels loaded
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, shares = [], []
    for _ in range(repeats):
        a2a[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        _step(model, rows_of(tokens), sp)
        seconds.append(time.perf_counter() - start)
        shares.append(a2a[0])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(out, f"s{world}_rank{rank}.json"), "w") as f:
        json.dump({"peak_added_mib": (after - before) / 1024, "seconds": seconds, "all_to_all_s": shares}, f)
    dist.destroy_process_group()


def run(world: int, args, out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    port = 29700 + world
    mp.spawn(worker, args=(world, args.tokens, args.repeats, port, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"s{world}_rank{r}.json").read_text()) for r in range(world)]


def write_outputs(result: dict, out_dir: Path) -> str:
    one, two = result["s1"][0], result["s2"]
    peak2 = max(r["peak_added_mib"] for r in two)
    step1, step2 = min(one["seconds"]), max(min(r["seconds"]) for r in two)
    a2a = max(min(r["all_to_all_s"]) for r in two)
    peaks = " / ".join(f"{r['peak_added_mib']:.0f}" for r in two)
    lines = ["| S | ranks | peak memory the step added per rank (MiB) | update step (s, best) | all-to-all (s) | share |",
             "|---|---|---|---|---|---|",
             f"| 1 | 1 | {one['peak_added_mib']:.0f} | {step1:.2f} | 0 | 0 |",
             f"| 2 | 2 | {peaks} | {step2:.2f} | {a2a:.3f} | "
             f"{a2a / step2:.1%} |",
             "", f"Peak per rank at S = 2 over S = 1: **{peak2 / one['peak_added_mib']:.2f}x** (goal <= {GOAL}x). "
             f"One sample of {result['tokens']} tokens, `builtin:medium-qwen2`, float32, gradient checkpointing, varlen "
             f"rows, one thread per rank, {result['cpus']} CPUs. Load average (1 min) {result['load_avg_start'][0]:.2f} "
             f"at start, {result['load_avg_end'][0]:.2f} at end."]
    return write_table(result, lines, out_dir, "sp_memory")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    load, busy = check_load("sp_memory")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"tokens": args.tokens, "cpus": os.cpu_count(), "load_avg_start": list(load), "busy_at_start": busy}
    for world in (1, 2):
        print(f"S = {world}: {world} process(es), one sample of {args.tokens} tokens", file=sys.stderr, flush=True)
        result[f"s{world}"] = run(world, args, out)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
