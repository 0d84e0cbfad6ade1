"""A multi-turn ``rollout_func``: TRL's one call per rank (a turn barrier) against group by group
(``rollout_multi_turn="requests"``: each group's function on a thread of its own, its engine calls as requests).

One vLLM engine of ``builtin:tiny-qwen2`` in this process, a trainer with ``rollout_func=``; ``--prompts`` groups of
``n = 4``. Group ``g`` runs ``1 + g % 4`` turns (1-4); each turn generates at most 16 tokens for the group's samples
and then runs a "tool" that sleeps ``--tool-s`` seconds per sample (an exponential draw of that mean, the same draws
in both variants). Variants:

- ``whole``: TRL's contract, the function called once with every prompt: each turn generates for every sample still
  running, then runs their tools one after another (what a plain rollout_func does);
- ``groups``: the same function body per group, its tools for its own samples one after another, every group at
  its own pace.

Reports each variant's rollout wall time (the trainer's ``_generate_and_score_completions`` over the same prompts,
median of ``--repeats``, interleaved) and the ratio groups / whole. Writes ``func_groups.json`` / ``.md`` under
``--out``.

    python benchmarks/func_groups.py [--quick] [--prompts 16] [--tool-s 0.02] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import ROOT, check_load, finish, write_table  # noqa: E402

N = 4


def make_rollout(plan: dict[str, list[float]]):
    """The user's multi-turn function: per sample, turns of 16 tokens, each followed by its tool's sleep (the plan
    keyed by prompt: each turn's seconds)."""
    from trl_nrollout.rollout.types import SamplingOptions

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        contexts = [tok(text=p)["input_ids"] for p in prompts]
        prompt_ids = [list(c) for c in contexts]
        completions = [[] for _ in prompts]
        logprobs = [[] for _ in prompts]
        for turn in range(max(len(plan[p]) for p in prompts)):
            live = [i for i, p in enumerate(prompts) if turn < len(plan[p])]
            out = trainer.rollout_engine.generate_expanded([contexts[i] for i in live], 1,
                                                           SamplingOptions(max_tokens=16, ignore_eos=True, seed=turn))
            for j, i in enumerate(live):
                completions[i] += out.completion_ids[j]
                logprobs[i] += out.logprobs[j]
                contexts[i] = contexts[i] + out.completion_ids[j]
            for i in live:  # the turn's tools, one after another
                time.sleep(plan[prompts[i]][turn])
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}

    return rollout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tool-s", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true", help="8 groups, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 8, 1
    load, busy = check_load("func_groups")
    sys.path.insert(0, str(ROOT))
    from datasets import Dataset

    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digit_fraction

    rng = random.Random(0)
    prompts = [f"Write a number for group {g}:" for g in range(args.prompts)]
    plan = {p: [rng.expovariate(1 / args.tool_s) for _ in range(1 + g % 4)] for g, p in enumerate(prompts)}
    inputs = [{"prompt": p} for p in prompts for _ in range(N)]
    times: dict[str, list[float]] = {"whole": [], "groups": []}
    config = NRolloutConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", num_generations=N,
                            per_device_train_batch_size=len(inputs), max_completion_length=64, rollout_backend="vllm")
    trainer = NRolloutGRPOTrainer(  # one engine: the variants switch the option between calls
        model="builtin:tiny-qwen2", args=config, train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        reward_funcs=[lambda completions, **kw: [digit_fraction(c) for c in completions]],
        rollout_func=make_rollout(plan))
    trainer.model.train()
    modes = {"whole": "turns", "groups": "requests"}
    for repeat in range(args.repeats + 1):  # the first: a warm-up of each
        for variant, mode in modes.items():
            trainer.args.rollout_multi_turn = mode
            start = time.perf_counter()
            trainer._generate_and_score_completions(inputs)
            if repeat:
                times[variant].append(time.perf_counter() - start)
        print(f"repeat {repeat}: " + ", ".join(f"{v} {t[-1]:.2f}s" for v, t in times.items() if t and repeat),
              flush=True)
    whole, groups = statistics.median(times["whole"]), statistics.median(times["groups"])
    result = {"prompts": args.prompts, "n": N, "tool_s": args.tool_s, "repeats": args.repeats, "times_s": times,
              "whole_s": whole, "groups_s": groups, "ratio": groups / whole, "load_at_start": load,
              "busy_at_start": busy}

    def write(result, out_dir):
        lines = [f"**A multi-turn rollout_func** ({args.prompts} groups x n={N}, 1-4 turns of 16 tokens, tools of "
                 f"{args.tool_s} s mean per sample; median of {args.repeats}; load at start {load[0]:.2f}):", "",
                 "| variant | rollout s | vs whole |", "|---|---|---|",
                 f"| whole (TRL's call, a turn barrier) | {whole:.2f} | 1.00x |",
                 f"| groups (rollout_multi_turn='requests') | {groups:.2f} | {groups / whole:.2f}x |"]
        return write_table(result, lines, out_dir, "func_groups")

    trainer.close()
    return finish(result, args.out, write, busy, load)


if __name__ == "__main__":
    sys.exit(main())
