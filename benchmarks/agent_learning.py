"""An agent with two tools learns through the endpoint (``agent=``): the built-in tool task, trained as the agent is.

``NRolloutGRPOTrainer(agent=...)`` on ``builtin:tiny-qwen2-tools`` (one process, vLLM engine), 16 prompts x n = 4
per step, learning rate 1e-2: an async agent written with the ``openai`` client offers two tools
(``lucky_number`` and ``word_count``), runs the calls the model makes and asks again (at most 3 calls per episode,
each extending the last: one sample per episode), and returns 1.0 when ``lucky_number`` gave its result. A random
model calls it in a few percent of its samples. Prints and saves the reward per step and its calls per episode.

    python benchmarks/agent_learning.py [--steps 16] [--seed 0] [--history edited]

``--history edited``: an agent that rewrites its conversation before its second call (every episode splits), rewarded
for what its second call does: it learns only because each call of a split episode trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import ROOT, check_load, finish, pyplot, save_figure, write_table  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "lucky_number", "description": "Returns today's lucky number.",
                                           "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "word_count", "description": "Counts the words of a text.",
                                           "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                          "required": ["text"]}}}]


def run_tool(name: str, arguments: str) -> str:
    if name == "lucky_number":
        return "7"
    if name == "word_count":
        return str(len(json.loads(arguments or "{}").get("text", "").split()))
    return json.dumps({"error": f"no tool {name}"})


async def agent(client, row):
    messages, lucky = list(row["prompt"]), False
    for _ in range(3):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                      max_tokens=16)).choices[0].message
        if not reply.tool_calls:
            break
        results = [{"role": "tool", "tool_call_id": c.id, "name": c.function.name,
                    "content": run_tool(c.function.name, c.function.arguments)} for c in reply.tool_calls]
        lucky = lucky or any(c.function.name == "lucky_number" for c in reply.tool_calls)
        messages = messages + [reply.model_dump(exclude_none=True)] + results
    return float(lucky)


async def edited_agent(client, row):
    """An agent that edits its history (every episode splits): its second call starts a new conversation holding
    the first answer as text, with the tools offered again; reward 1 when that second call runs ``lucky_number``.
    Only the second call's rows carry what is rewarded: it learns only if each call of a split episode trains."""
    first = (await client.chat.completions.create(model="policy", messages=row["prompt"], tools=TOOLS,
                                                  max_tokens=16)).choices[0].message
    said = first.content or ", ".join(c.function.name for c in first.tool_calls or [])
    messages = [{"role": "user", "content": f"{row['prompt'][-1]['content']} (you said: {said})"}]
    second = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                   max_tokens=16)).choices[0].message
    return float(any(c.function.name == "lucky_number" for c in second.tool_calls or []))


def write_outputs(result: dict, out_dir: Path) -> str:
    lines = ["| step | reward | calls per episode | split episodes |", "|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['reward']:.3f} | {s['calls']:.2f} | {s['split']:.2f} |")
    lines += ["", f"`builtin:tiny-qwen2-tools`, history {result.get('history', 'appended')}, 16 prompts x 4 per "
              f"step, lr 1e-2, seed {result['seed']}, one process, "
              f"{result['cpus']} CPUs. Load average (1 min) {result['load_avg_start'][0]:.2f} at start, "
              f"{result['load_avg_end'][0]:.2f} at end."]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        steps = [s["step"] for s in result["steps"]]
        ax.plot(steps, [s["reward"] for s in result["steps"]], marker="o", label="reward (lucky_number ran)")
        ax.plot(steps, [s["calls"] / 3 for s in result["steps"]], marker=".", ls="--", label="calls per episode / 3")
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
        edited = result.get("history", "").startswith("edited")
        ax.set_title("openai-client agent, 2 tools, via the endpoint" + (" (history edited: split)" if edited else ""),
                     fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        name = ("agent_learning_split" + ("_first_call" if "first" in result["history"] else "")) if edited \
            else "agent_learning"
        save_figure(fig, out_dir / f"{name}.png")
        if result.get("docs"):
            save_figure_copy = ROOT / "docs" / "img" / f"{name}.png"
            save_figure_copy.write_bytes((out_dir / f"{name}.png").read_bytes())
    history = result.get("history", "appended")
    return write_table(result, lines, out_dir, "agent_learning" if not history.startswith("edited") else
                       "agent_learning_split" + ("_first_call" if "first" in history else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--history", choices=["appended", "edited"], default="appended",
                    help="edited: an agent whose every episode splits (reward from its second call)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--first-call-only", action="store_true",
                    help="the counterfactual: a split episode trains its first call only (its later calls dropped)")
    ap.add_argument("--docs", action="store_true", help="also copy the plot to docs/img/agent_learning.png")
    ap.add_argument("--replot", help=argparse.SUPPRESS)  # a saved agent_learning.json: its table and plot again
    args = ap.parse_args(argv)
    if args.replot:
        result = {**json.loads(Path(args.replot).read_text()), "docs": args.docs}
        return finish(result, args.out, write_outputs, result["busy_at_start"], tuple(result["load_avg_start"]))
    load, busy = check_load("agent_learning")

    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import tool_dataset

    if args.first_call_only:  # what trained before split episodes did: their later calls never reach the update
        import trl_nrollout.trainer.grpo as grpo
        from trl_nrollout.trainer.stages import Sample

        grpo.expand_segments = lambda mine, samples: (
            mine, [Sample(*[getattr(s, f) for f in ("prompt_ids", "completion_ids", "logprobs", "finish_reason",
                                                    "tool_mask", "mm")]) for s in samples], None)

    with tempfile.TemporaryDirectory() as out:
        cfg = NRolloutConfig(output_dir=out, train_batch_size=16, rollout_n=4, max_completion_length=96,
                             max_steps=args.steps, learning_rate=1e-2, logging_steps=1, report_to="none", bf16=False,
                             save_strategy="no", seed=args.seed, use_cpu=True, disable_tqdm=True)
        trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2-tools", args=cfg, train_dataset=tool_dataset(256),
                                      agent=edited_agent if args.history == "edited" else agent)
        trainer.train()
        trainer.close()
    steps = [{"step": h["step"], "reward": h["reward"], "calls": h["agent/calls_per_episode"],
              "split": h["agent/split_episodes"]} for h in trainer.state.log_history if "agent/calls_per_episode" in h]
    for s in steps:
        print(f"step {s['step']}: reward {s['reward']:.3f}, calls per episode {s['calls']:.2f}", file=sys.stderr)
    result = {"steps": steps, "seed": args.seed, "docs": args.docs, "history": args.history + (" (first call only)" if args.first_call_only else ""), "cpus": os.cpu_count(), "load_avg_start": list(load),
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
