"""Agents' calls across a step's end (partial rollouts): tokens drawn twice and rollout time, continued vs restarted.

One vLLM engine of ``builtin:tiny-qwen2-longtail`` (long-tailed completions) and the trainer's OpenAI-compatible
endpoint in this process; ``--episodes`` async agents (the ``openai`` client) each make 2 chat completions of at most
``--max-tokens`` tokens, every call with a ``stop`` string (as agent frameworks send them). The rollout is cut into
"steps" as partial rollouts cut it: each step serves the calls until ``--per-step`` more episodes have ended (as a
partial rollout's step ends when its groups have finished), then the running calls are aborted
(``serve(carry=True)``) and queued for the next step, whose tokens carry the next policy version. Variants, interleaved, the same seeds:

- ``continued`` (this package): a cut call keeps its tokens up to the last place no stop string could straddle and
  continues from them (:func:`~trl_nrollout.rollout.episodes.agent_calls.safe_cut`);
- ``restarted`` (before, and what the endpoint did for a call with stop strings): a cut call keeps nothing and runs
  again from its start (emulated here by a cut that keeps no token).

Reports the tokens drawn again per step, the calls cut, the steps, and the rollout's wall time (median of
``--repeats``) with the ratio ``continued / restarted``. Goal (issue 65 item 3): tokens drawn again -> 0. Writes
``agent_carry.json`` / ``.md`` under ``--out``.

    python benchmarks/agent_carry.py [--episodes 32] [--max-tokens 48] [--per-step 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import ROOT, check_load, endpoint_on_engine, finish, write_table  # noqa: E402

VARIANTS = ("continued", "restarted")
STOP = "\n\nUser:"


async def run_agents(endpoint, keys: list[str], max_tokens: int, ended: list[int]) -> None:
    import openai

    async def agent(e: int) -> None:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url(keys[e]), api_key="x", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": f"Write a long answer for episode {e}:"}]
        for _ in range(2):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens,
                                                     stop=[STOP])
            messages = messages + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                                   {"role": "user", "content": "Go on."}]
        await client.close()
        ended.append(e)

    await asyncio.gather(*(agent(e) for e in range(len(keys))))


def one_rollout(engine, endpoint, episodes: int, max_tokens: int, per_step: int, variant: str, rep: int) -> dict:
    """Every episode to its end, cut into steps that end when ``per_step`` more episodes have; returns the counts
    and the time."""
    from trl_nrollout.rollout.episodes import endpoint as endpoint_module
    from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord, safe_cut
    from trl_nrollout.rollout.types import SamplingOptions

    endpoint_module.safe_cut = safe_cut if variant == "continued" else (lambda ids, stop, decode, floor=0: floor)
    records = [EpisodeRecord(key=f"{variant}{rep}e{e}", row={}) for e in range(episodes)]
    endpoint.open(records, lambda i, c: 1000 + 7919 * i + c)
    done, finished = threading.Event(), []

    def go():
        try:
            asyncio.run(run_agents(endpoint, [r.key for r in records], max_tokens, finished))
        finally:
            done.set()

    base = SamplingOptions(max_tokens=max_tokens, temperature=1.0)

    def params(c):
        return engine.sampling_params(1, replace(base, max_tokens=c.max_tokens, seed=c.seed, stop=tuple(c.stop)))

    totals = {"redrawn_tokens": 0.0, "kept_tokens": 0.0, "carried": 0.0, "engine_steps": 0.0}
    steps = 0
    start = time.perf_counter()
    threading.Thread(target=go, daemon=True).start()
    while not done.is_set():
        before = len(finished)
        stats = endpoint.serve(engine.request_loop(stream=True), params,
                               lambda before=before: len(finished) - before >= per_step or done.is_set(),
                               carry=True, version=steps)
        steps += 1
        for k in totals:
            totals[k] += stats.get(k, 0.0)
    wall = time.perf_counter() - start
    endpoint_module.safe_cut = safe_cut
    endpoint.forget([r.key for r in records])
    calls = [c for r in records for c in r.calls]
    if len(calls) != 2 * episodes:
        raise RuntimeError(f"{variant}: {len(calls)} calls recorded, {2 * episodes} planned")
    return {"variant": variant, "wall_s": wall, "steps": steps, "calls_cut": totals["carried"],
            "redrawn_tokens": totals["redrawn_tokens"], "kept_tokens": totals["kept_tokens"],
            "trained_tokens": sum(len(c.completion_ids) for c in calls),
            "versions_per_call_max": max(len(set(c.versions)) for c in calls)}


def table_lines(result: dict) -> list[str]:
    """The table docs/benchmarks.md quotes, from a run's JSON."""
    rows = result["rows"]
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
               for k in ("wall_s", "steps", "calls_cut", "redrawn_tokens", "trained_tokens")} for v in VARIANTS}
    lines = ["| variant | steps | calls cut | tokens drawn again / step | tokens trained | rollout s | / restarted |",
             "|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        m = med[v]
        lines.append(f"| {v} | {m['steps']:.0f} | {m['calls_cut']:.0f} | {m['redrawn_tokens'] / m['steps']:.1f} | "
                     f"{m['trained_tokens']:.0f} | {m['wall_s']:.2f} | "
                     f"{m['wall_s'] / med['restarted']['wall_s']:.3f} |")
    meta = result["meta"]
    lines += ["", f"{meta['episodes']} agents at once, 2 calls each of at most {meta['max_tokens']} tokens with a stop "
              f"string, a step ending when {meta['per_step']} more have ended, `builtin:tiny-qwen2-longtail`, one vLLM "
              f"engine, medians of {meta['repeats']} interleaved repeats, {meta['cpus']} CPUs. Load average (1 min) "
              f"{result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end."]
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    return write_table(result, table_lines(result), out_dir, "agent_carry")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-step", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    load, busy = check_load("agent_carry")

    engine, endpoint = endpoint_on_engine("builtin:tiny-qwen2-longtail", max_calls=4)
    rows = []
    try:
        for rep in range(args.repeats):
            for variant in VARIANTS:
                rows.append(one_rollout(engine, endpoint, args.episodes, args.max_tokens, args.per_step,
                                        variant, rep))
                r = rows[-1]
                print(f"rep {rep} {variant}: {r['steps']} steps, {r['calls_cut']:.0f} calls cut, "
                      f"{r['redrawn_tokens']:.0f} tokens drawn again, {r['wall_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        endpoint.close()
        engine.close()
    result = {"meta": {"episodes": args.episodes, "max_tokens": args.max_tokens,
                       "per_step": args.per_step, "repeats": args.repeats, "cpus": os.cpu_count()},
              "rows": rows, "load_avg_start": list(load),
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
