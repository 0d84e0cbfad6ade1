"""Multi-turn rollouts with a slow tool: turn by turn vs request by request (``rollout_multi_turn``).

One vLLM engine of the built-in tools model (``builtin:tiny-qwen2-tools``) in this process; a scripted agent on
real generation: every sample's first turn calls the tool, a later turn calls it again when it has an odd number of
tokens, at most 4 rounds (so 1-4 calls per sample, as in the goal), and each call sleeps ``--tool-s`` seconds
(0.2 s: a sandbox, a search API; in the "long-tail" scenario, drawn from an exponential distribution of that mean,
the same draws in every variant). Every variant rolls out the same episodes (same seeds, same script: the calls per
sample are checked equal across variants), so only the scheduling differs:

- ``turns``: the trainer's turn-by-turn loop (TRL's): every turn waits for the batch's tool calls, run one at a
  time;
- ``turns+concurrent``: the same loop with each turn's calls running at once (emulated here: the calls are started
  on a pool and the next turn waits for all of them), what a turn barrier costs when tools are concurrent;
- ``requests/1`` and ``requests/16``: ``rollout_multi_turn="requests"`` with ``tool_workers`` 1 and 16: a sample
  leaves the engine while its tool runs and re-enters with the result, the others keep generating.

Reports the rollout wall time of each (median of ``--repeats``, interleaved), the ratio against ``turns`` (goal:
requests/16 <= 0.6x) and against ``turns+concurrent``, the engine's idle seconds and the share of engine steps
taken while a tool ran. Writes ``tool_latency.json`` / ``.md`` / ``.png`` under ``--out`` (default
benchmarks/results); ``--docs`` copies the plot to docs/img/tool_latency.png.

    python benchmarks/tool_latency.py [--quick] [--prompts 8] [--tool-s 0.2] [--repeats 2] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
from common import ROOT, check_load  # noqa: E402

sys.path.insert(0, str(ROOT))
GOAL = 0.6
N = 8
MAX_ROUNDS = 4
BUDGET = 256
SUFFIX_TEXT = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
VARIANTS = ("turns", "turns+concurrent", "requests/1", "requests/16")
SCENARIOS = ("fixed", "long-tail")


def latency(scenario: str, tool_s: float, sample: int, call: int) -> float:
    """Seconds of call ``call`` of ``sample``: ``tool_s`` ("fixed"), or drawn from an exponential distribution of
    mean ``tool_s`` ("long-tail": most calls quick, a few several times the mean), the same in every variant."""
    if scenario == "fixed":
        return tool_s
    return random.Random(f"{sample}/{call}").expovariate(1.0 / tool_s)


class Script:
    """The scripted agent: the first turn calls the tool; a later turn calls it when its length is odd."""

    def __init__(self, tokenizer, prompts: list[list[int]], tool_s: float, scenario: str,
                 pool: ThreadPoolExecutor | None = None):
        self.suffix = tokenizer.encode(SUFFIX_TEXT)
        self.prompts, self.tool_s, self.scenario, self.pool = prompts, tool_s, scenario, pool
        self.pending: list = []
        self.calls: dict[int, int] = {}  # calls made per sample (each sample's calls run one after another)

    def parse(self, i, ids, prefix):
        calls = list(prefix) == self.prompts[i] or len(ids) % 2 == 1
        call = {"type": "function", "function": {"name": "lucky_number", "arguments": {}}}
        return {"role": "assistant", "content": "", **({"tool_calls": [call]} if calls else {})}

    def run_tools(self, i, calls):
        delays = []
        for _ in calls:
            self.calls[i] = self.calls.get(i, 0) + 1
            delays.append(latency(self.scenario, self.tool_s, i, self.calls[i]))
        if self.pool is not None:  # turns+concurrent: start the calls; the next turn waits for them
            self.pending += [self.pool.submit(time.sleep, d) for d in delays]
        else:
            for d in delays:
                time.sleep(d)
        return [{"role": "tool", "name": "lucky_number", "content": "7"} for _ in calls], 0

    def drain(self) -> None:
        wait(self.pending)
        self.pending = []

    def suffix_ids(self, messages):
        return list(self.suffix)


def _turn_seed(round_: int) -> int:
    from trl_nrollout.rollout.seeds import step_seed

    return step_seed(5, 0, round_, "train/turn")


def rollout(engine, tokenizer, prompts, stops, variant: str, tool_s: float, scenario: str = "fixed") -> dict:
    """One rollout of ``prompts`` (repeated N times) in ``variant``; its wall time and episode statistics."""
    from trl_nrollout.rollout.dispatch.shares import run_agents
    from trl_nrollout.rollout.episodes.tools import AgentCallbacks, collect_turns, run_tool_turns
    from trl_nrollout.rollout.types import SamplingOptions

    opts = SamplingOptions(max_tokens=BUDGET, temperature=1.0, seed=_turn_seed(0), stop_token_ids=stops)
    pool = ThreadPoolExecutor(64) if variant == "turns+concurrent" else None
    script = Script(tokenizer, prompts, tool_s, scenario, pool)
    agent = AgentCallbacks(parse=script.parse, run_tools=script.run_tools, suffix_ids=script.suffix_ids,
                           max_iterations=MAX_ROUNDS, max_completion_length=BUDGET, max_model_len=engine.max_model_len)
    start = time.perf_counter()
    stats = None
    if variant.startswith("turns"):
        def generate(contexts, budgets, turn, samples):
            script.drain()
            return engine.generate_turns(contexts, budgets, replace(opts, seed=_turn_seed(turn)), sample_ids=samples,
                                         num_samples=len(prompts))

        first = engine.generate_expanded(prompts, N, opts, sample_offset=0)
        turns = run_tool_turns(first, parse=agent.parse, run_tools=agent.run_tools, suffix_ids=agent.suffix_ids,
                               generate=generate, any_rank=lambda flag: flag, max_iterations=MAX_ROUNDS,
                               max_completion_length=BUDGET, max_model_len=agent.max_model_len)
        script.drain()
    else:
        workers = int(variant.split("/")[1])
        samples, _, stats = run_agents(engine, prompts, N, opts, _turn_seed, agent, workers, sample_offset=0)
        turns = collect_turns(samples)
    wall = time.perf_counter() - start
    if pool is not None:
        pool.shutdown()
    tokens = sum(sum(m) for m in turns.tool_mask)
    return {"variant": variant, "scenario": scenario, "wall_s": wall, "calls": list(turns.tool_calls), "model_tokens": tokens,
            "engine_idle_s": stats.idle_s if stats else None, "engine_steps": stats.engine_steps if stats else None,
            "overlap": stats.steps_with_tools / max(1, stats.engine_steps) if stats else None}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(10, 3.8), sharey=True)
    colors = ["#888888", "#bbbbbb", "#6baed6", "#2171b5"]
    top = max(max(s["median_wall_s"].values()) for s in summary["scenarios"].values())
    for ax, scenario in zip(axes, SCENARIOS):
        walls = [summary["scenarios"][scenario]["median_wall_s"][v] for v in VARIANTS]
        bars = ax.bar(range(len(VARIANTS)), walls, color=colors)
        ax.set_xticks(range(len(VARIANTS)), VARIANTS, fontsize=8)
        ax.axhline(GOAL * walls[0], color="red", ls="--", lw=1, label=f"goal: {GOAL}x turn by turn")
        for bar, wall in zip(bars, walls):
            ax.text(bar.get_x() + bar.get_width() / 2, wall, f"{wall:.1f} s\n{wall / walls[0]:.2f}x", ha="center",
                    va="bottom", fontsize=8)
        ax.set_title(f"{scenario} tool latency (mean {summary['tool_s']} s/call)", fontsize=9)
        ax.set_ylim(0, top * 1.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_ylabel("rollout wall time (s)")
    fig.suptitle(f"{summary['samples']} samples, {summary['calls_per_sample']['mean']:.2f} tool calls per sample "
                 f"(1-{MAX_ROUNDS}), tiny model on CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tool-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 0.05 s tools, 1 repeat")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.tool_s, args.repeats = 2, 0.05, 1
    load, busy = check_load("the tool-latency benchmark")

    from transformers import AutoTokenizer, GenerationConfig

    from trl_nrollout.builtin import digits_prompts, resolve_model
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    path = resolve_model("builtin:tiny-qwen2-tools")
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    stops = list(eos if isinstance(eos, list) else [eos]) + list(range(100, 140))  # turns of about 12 tokens
    prompts = [tokenizer.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n")
               for p in digits_prompts(args.prompts, seed=3)]
    prompts = [list(p) for p in prompts for _ in range(N)]
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=len(prompts), rollout_n=N)
    engine = VLLMEngineGroup(path, layout, rank=0, max_model_len=1024, seed=0)
    rollout(engine, tokenizer, prompts[: 2 * N], stops, "requests/16", 0.0)  # warm-up
    runs = []
    for scenario in SCENARIOS:
        for r in range(args.repeats):
            for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                result = rollout(engine, tokenizer, prompts, stops, variant, args.tool_s, scenario)
                runs.append(result)
                print(f"  {scenario:9s} {variant:17s} {result['wall_s']:6.2f} s  calls {sum(result['calls'])}",
                      flush=True)
    engine.close()
    reference = runs[0]["calls"]
    summary = {"samples": len(prompts), "tool_s": args.tool_s, "repeats": args.repeats, "load_at_start": load,
               "busy": busy, "same_episodes": all(r["calls"] == reference for r in runs),
               "calls_per_sample": {"mean": statistics.mean(reference), "min": min(reference), "max": max(reference)},
               "goal": GOAL, "scenarios": {}, "runs": runs}
    lines = [f"# Tool latency: {len(prompts)} samples, tool {args.tool_s} s per call (mean), calls per sample "
             f"{summary['calls_per_sample']['mean']:.2f} ({min(reference)}-{max(reference)}), load {load[0]:.2f}",
             "", "| tool latency | variant | rollout s (median) | vs turns | vs turns+concurrent | engine idle s | "
             "steps with a tool |", "|---|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        mine = [r for r in runs if r["scenario"] == scenario]
        median = {v: statistics.median(r["wall_s"] for r in mine if r["variant"] == v) for v in VARIANTS}
        summary["scenarios"][scenario] = {
            "median_wall_s": median, "ratio_vs_turns": {v: median[v] / median["turns"] for v in VARIANTS},
            "ratio_vs_turns_concurrent": {v: median[v] / median["turns+concurrent"] for v in VARIANTS},
            "met": median["requests/16"] / median["turns"] <= GOAL}
        for v in VARIANTS:
            last = [r for r in mine if r["variant"] == v][-1]
            idle = "" if last["engine_idle_s"] is None else f"{last['engine_idle_s']:.2f}"
            share = "" if last["overlap"] is None else f"{last['overlap']:.0%}"
            lines.append(f"| {scenario} | {v} | {median[v]:.2f} | {median[v] / median['turns']:.2f}x | "
                         f"{median[v] / median['turns+concurrent']:.2f}x | {idle} | {share} |")
    fixed = summary["scenarios"]["fixed"]
    summary["met"] = fixed["met"]
    lines += ["", f"Goal (fixed {args.tool_s} s tool) requests/16 <= {GOAL}x turns: "
              f"{'met' if fixed['met'] else 'NOT met'} ({fixed['ratio_vs_turns']['requests/16']:.2f}x); the same "
              f"episodes in every run: {summary['same_episodes']}."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tool_latency.json").write_text(json.dumps(summary, indent=1))
    (args.out / "tool_latency.md").write_text("\n".join(lines) + "\n")
    plot(summary, args.out / "tool_latency.png")
    if args.docs:
        shutil.copy(args.out / "tool_latency.png", ROOT / "docs/img/tool_latency.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
