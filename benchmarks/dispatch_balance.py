"""Fixed shares vs a balanced queue (``rollout_dispatch``): rollout wall time with two engines.

Two processes (``torchrun``), one vLLM engine each (TP=1, one core each on this machine), the built-in long-tail
model (most completions short, a few at ``max_tokens``), each engine running at most ``--max-num-seqs`` samples at
once (below its share, as when KV-cache memory bounds the batch at scale). The same engines alternate the two
dispatches call by call, with a fresh seed per pair, so both see the same machine state; each call's wall time is
taken from a barrier before it to the last rank's end. Two scenarios:

- ``longtail``: both engines alike; the imbalance is the long tail's (one engine's groups happened to run longer);
- ``slow-engine``: engine 0's every step waits ``--slow-ms`` more (a slower or shared device);

Prints and saves ``dispatch_balance.json`` / ``.md`` / ``.png`` under ``--out`` (default benchmarks/results);
``--docs`` also copies the plot to docs/img/dispatch_balance.png. Ratios are balanced / shares within one run.

    python benchmarks/dispatch_balance.py [--quick] [--pairs 6] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
    """One rank: build the engine, run ``pairs`` (shares, balanced) pairs per scenario, write rank<r>.json."""
    import torch

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.dispatch.balanced import generate_balanced
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.types import SamplingOptions

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.set_num_threads(1)
    model = resolve_model("builtin:tiny-qwen2-longtail")
    layout = RolloutLayout.build(num_processes=world, rollout_tp_size=1, train_batch_size=world * args.prompts,
                                 rollout_n=args.n)
    group = VLLMEngineGroup(model, layout, rank=rank, max_model_len=256, seed=0, max_num_seqs=args.max_num_seqs,
                            dispatch="balanced")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    from trl_nrollout.builtin import digits_prompts

    texts = digits_prompts(world * args.prompts, seed=3)[rank * args.prompts:(rank + 1) * args.prompts]
    mine = [tok(t)["input_ids"] for t in texts for _ in range(args.n)]
    engine_step = group.llm.llm_engine.step
    rows = []
    for scenario in ("longtail", "slow-engine"):
        if scenario == "slow-engine" and group.engine_index == 0:
            def slow_step():
                time.sleep(args.slow_ms / 1000)
                return engine_step()

            group.llm.llm_engine.step = slow_step
        for pair in range(-1, args.pairs):  # pair -1: a warm-up of both, not reported
            for mode in ("shares", "balanced"):
                options = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, seed=1000 + pair)
                torch.distributed.barrier()
                start = time.perf_counter()
                if mode == "shares":
                    batch = group.generate_expanded(mine, args.n, options, sample_offset=rank * len(mine))
                    busy, moved = time.perf_counter() - start, 0
                else:
                    batch, stats = generate_balanced(group, mine, args.n, options)
                    busy = stats.busy_s
                    per_engine = args.prompts  # groups per engine's ranks (TP=1)
                    moved = sum(1 for g in stats.groups if g // per_engine != group.engine_index)
                mine_done = time.perf_counter() - start
                ends = [None] * world
                torch.distributed.all_gather_object(ends, (mine_done, busy, batch.num_completion_tokens, moved))
                if pair >= 0:
                    rows.append({"scenario": scenario, "pair": pair, "mode": mode,
                                 "wall_s": max(e[0] for e in ends), "busy_s": [e[1] for e in ends],
                                 "tokens": sum(e[2] for e in ends), "moved_groups": sum(e[3] for e in ends)})
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    group.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def summarize(rows: list[dict], groups: int) -> dict:
    out = {}
    for scenario in sorted({r["scenario"] for r in rows}):
        per = {m: [r for r in rows if r["scenario"] == scenario and r["mode"] == m] for m in ("shares", "balanced")}
        wall = {m: statistics.mean(r["wall_s"] for r in per[m]) for m in per}
        idle = {m: statistics.mean((max(r["busy_s"]) - min(r["busy_s"])) / max(r["busy_s"]) for r in per[m])
                for m in per}
        ratios = [b["wall_s"] / s["wall_s"] for s, b in zip(per["shares"], per["balanced"])]
        out[scenario] = {"shares_s": wall["shares"], "balanced_s": wall["balanced"],
                         "ratio_mean": statistics.mean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "idle_shares": idle["shares"], "idle_balanced": idle["balanced"],
                         "moved_share": statistics.mean(r["moved_groups"] for r in per["balanced"]) / groups,
                         "tokens_per_call": statistics.mean(r["tokens"] for r in per["shares"])}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3.4), sharey=True)
    for ax, scenario in zip(axes, scenarios):
        for mode, colour in (("shares", "tab:gray"), ("balanced", "tab:blue")):
            pts = [r for r in rows if r["scenario"] == scenario and r["mode"] == mode]
            ax.plot([r["pair"] for r in pts], [r["wall_s"] for r in pts], "o-", color=colour, label=mode)
        ax.set_title(scenario)
        ax.set_xlabel("call (a fresh seed per pair)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rollout wall time (s)")
    axes[0].legend()
    fig.suptitle("rollout_dispatch: fixed shares vs one balanced queue (2 engines)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 pairs, fewer prompts")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rank")
    parser.add_argument("--rollout-n", dest="n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--slow-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    from common import CHILD_ENV, check_load

    if args.quick:
        args.pairs, args.prompts = 2, 8
    load, busy = check_load("the dispatch benchmark")
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "dispatch_balance.rows.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with socket.socket() as sock:  # a free port: torchrun's default 29500 fails when another run on this machine has it
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", port, __file__, "--worker-out", str(raw), "--pairs", str(args.pairs),
           "--prompts", str(args.prompts), "--rollout-n", str(args.n), "--max-tokens", str(args.max_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--slow-ms", str(args.slow_ms)]
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    subprocess.run(cmd, cwd=ROOT, env={**env, **CHILD_ENV}, check=True)
    rows = json.loads(raw.read_text())
    summary = summarize(rows, 2 * args.prompts)
    result = {"summary": summary, "rows": rows, "load_at_start": load, "busy_at_start": busy,
              "wall_s": time.perf_counter() - start,
              "setup": {"engines": 2, "tp": 1, "prompts_per_rank": args.prompts, "n": args.n,
                        "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs, "slow_ms": args.slow_ms,
                        "pairs": args.pairs, "model": "builtin:tiny-qwen2-longtail"}}
    lines = ["| scenario | shares (s/call) | balanced (s/call) | balanced / shares (min..max) | engine idle, shares "
             "| engine idle, balanced | groups moved |", "|---|---|---|---|---|---|---|"]
    for scenario, s in summary.items():
        lines.append(f"| {scenario} | {s['shares_s']:.2f} | {s['balanced_s']:.2f} | **{s['ratio_mean']:.2f}x** "
                     f"({s['ratio_min']:.2f}..{s['ratio_max']:.2f}) | {s['idle_shares']:.0%} | "
                     f"{s['idle_balanced']:.0%} | {s['moved_share']:.0%} |")
    table = "\n".join(lines)
    print(table)
    print(f"load average at start: {load[0]:.2f}{' (busy)' if busy else ''}")
    (args.out / "dispatch_balance.json").write_text(json.dumps(result, indent=1))
    (args.out / "dispatch_balance.md").write_text(table + "\n")
    plot(rows, args.out / "dispatch_balance.png")
    if args.docs:
        shutil.copy(args.out / "dispatch_balance.png", ROOT / "docs" / "img" / "dispatch_balance.png")


if __name__ == "__main__":
    main()
