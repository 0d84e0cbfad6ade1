"""Agents through the endpoint (``agent=``): no turn barrier, against a turn-by-turn loop emulated on the same engine.

One vLLM engine of ``builtin:tiny-qwen2-tools`` and the trainer's OpenAI-compatible endpoint in this process;
``--episodes`` async agents (the ``openai`` client) run at once. Episode ``e`` makes ``1 + e % 4`` calls (1-4, as in
the goal), each a chat completion of at most 16 tokens followed by a tool that sleeps ``--tool-s`` seconds (0.2 s;
"long-tail": an exponential draw of that mean, the same draws in every variant). Variants:

- ``endpoint``: each episode goes at its own pace (what ``agent=`` does: a request joins the engine when it comes);
- ``turns+concurrent``: a turn barrier emulated in the agents: every episode still running waits for every other's
  call of the turn, the turn's tools run at once, and the next turn starts when all have returned;
- ``turns``: the same with the turn's tools run one at a time (TRL's turn-by-turn loop with synchronous tools).

Reports each variant's rollout wall time (median of ``--repeats``, interleaved) and the ratio of ``endpoint`` to each
(goal: <= 0.6x the turn-by-turn loop). Writes ``agent_barrier.json`` / ``.md`` under ``--out``.

    python benchmarks/agent_barrier.py [--episodes 64] [--tool-s 0.2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import ROOT, check_load, endpoint_on_engine, finish, write_table  # noqa: E402

GOAL = 0.6
VARIANTS = ("endpoint", "turns+concurrent", "turns")


def episode_plan(episodes: int, tool_s: float, long_tail: bool, seed: int = 0) -> list[list[float]]:
    """Each episode's tool seconds per call (1-4 calls)."""
    rng = random.Random(seed)
    return [[rng.expovariate(1 / tool_s) if long_tail else tool_s for _ in range(1 + e % 4)] for e in range(episodes)]


async def run_agents(endpoint, keys: list[str], plan: list[list[float]], variant: str) -> None:
    import openai

    turns = max(len(p) for p in plan)
    active = [sum(len(p) > t for p in plan) for t in range(turns)]
    replied = [asyncio.Barrier(n) for n in active]
    tools_done = [asyncio.Barrier(n) for n in active]
    one_tool = asyncio.Lock()

    async def agent(e: int) -> None:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url(keys[e]), api_key="x", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": f"Write a number for episode {e}:"}]
        for t, seconds in enumerate(plan[e]):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
            messages = messages + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                                   {"role": "user", "content": "7"}]
            if variant != "endpoint":
                await replied[t].wait()
            if variant == "turns":
                async with one_tool:
                    await asyncio.sleep(seconds)
            else:
                await asyncio.sleep(seconds)
            if variant != "endpoint":
                await tools_done[t].wait()
        await client.close()

    await asyncio.gather(*(agent(e) for e in range(len(plan))))


def one_rollout(engine, endpoint, plan: list[list[float]], variant: str, rep: int) -> dict:
    from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
    from trl_nrollout.rollout.types import SamplingOptions

    records = [EpisodeRecord(key=f"{variant.replace('+', '_')}{rep}e{e}", row={}) for e in range(len(plan))]
    endpoint.open(records, lambda i, c: 1000 + 7919 * i + c)
    done = threading.Event()

    def go():
        try:
            asyncio.run(run_agents(endpoint, [r.key for r in records], plan, variant))
        finally:
            done.set()

    base = SamplingOptions(max_tokens=16, temperature=1.0)
    start = time.perf_counter()
    threading.Thread(target=go, daemon=True).start()
    stats = endpoint.serve(engine.request_loop(), lambda c: engine.sampling_params(
        1, replace(base, max_tokens=c.max_tokens, seed=c.seed, stop=tuple(c.stop))), done.is_set)
    wall = time.perf_counter() - start
    calls = sum(len(r.calls) for r in records)
    expected = sum(len(p) for p in plan)
    if calls != expected:
        raise RuntimeError(f"{variant}: {calls} calls recorded, {expected} planned")
    return {"variant": variant, "wall_s": wall, "calls": calls, "engine_idle_s": stats["idle_s"],
            "engine_steps": stats["engine_steps"]}


def write_outputs(result: dict, out_dir: Path) -> str:
    lines = ["| scenario | variant | rollout s (median) | endpoint / this |", "|---|---|---|---|"]
    for scenario, rows in result["scenarios"].items():
        med = {v: statistics.median(r["wall_s"] for r in rows if r["variant"] == v) for v in VARIANTS}
        for v in VARIANTS:
            lines.append(f"| {scenario} | {v} | {med[v]:.2f} | {med['endpoint'] / med[v]:.3f} |")
    m = result["meta"]
    lines += ["", f"Goal: endpoint <= {GOAL}x the turn-by-turn loop. {m['episodes']} episodes at once (1-4 calls each, "
              f"16 tokens per call, tool {m['tool_s']} s), `builtin:tiny-qwen2-tools`, one vLLM engine, "
              f"{m['repeats']} repeats interleaved, {m['cpus']} CPUs. Load average (1 min) "
              f"{result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end."]
    return write_table(result, lines, out_dir, "agent_barrier")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tool-s", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    load, busy = check_load("agent_barrier")

    engine, endpoint = endpoint_on_engine("builtin:tiny-qwen2-tools", max_calls=8)
    scenarios = {}
    try:
        for scenario, long_tail in (("constant", False), ("long-tail", True)):
            plan = episode_plan(args.episodes, args.tool_s, long_tail)
            rows = []
            for rep in range(args.repeats):
                for variant in VARIANTS:
                    rows.append(one_rollout(engine, endpoint, plan, variant, rep))
                    print(f"{scenario} rep {rep} {variant}: {rows[-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
            scenarios[scenario] = rows
    finally:
        endpoint.close()
        engine.close()
    result = {"meta": {"episodes": args.episodes, "tool_s": args.tool_s, "repeats": args.repeats,
                       "cpus": os.cpu_count()}, "scenarios": scenarios, "load_avg_start": list(load),
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
