"""What our rollout engine adds over plain vLLM: ``VLLMEngineGroup.generate_expanded`` vs ``LLM.generate`` on the
same engine object.

One process builds one :class:`~trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup` (the trainer's engine arguments)
and times, interleaved, on the same prompts:

- ``ours``: ``generate_expanded`` on the prompts repeated n times (TRL's order, as the trainer calls it), with a
  seed (per-prompt ``SamplingParams``), the sampled tokens' log-probs the trainer needs, and the repeat check,
  the gather and the ``RolloutBatch`` building;
- ``ours_engine_seed``: the same with ``rollout_seed_mode="engine"`` (no per-request seed; the engine's generator
  seeded once per call);
- ``plain``: ``llm.generate([TokensPrompt(...)], SamplingParams(n=n, ...))``: vLLM's own n-sampling, no
  log-probs, no seed, the engine's default detokenization.

Both sample at temperature 1.0 with ``--max-tokens`` new tokens and EOS ignored, so every call generates exactly
``prompts x n x max_tokens`` tokens. The calls alternate (which one goes first flips every repetition) so that a
change in machine load hits both; tokens/s come from each side's median call (the ratio of the means is in the
JSON too). The prompts are the built-in ``digits`` prompts lengthened to
``--prompt-tokens`` by :func:`trl_nrollout.builtin.long_prompts`; by default ``prompts x prompt_tokens`` exceeds
the engine's token budget of one scheduler step (``max_num_batched_tokens``), so a call takes several prefill
steps. Goal (issue 15): ours / plain tokens/s >= 0.95 at n = 8.

    python benchmarks/engine_overhead.py [--quick] [--model PATH] [--ns 4 8 16] [--prompts 32] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import ROOT, finish, pyplot, save_figure, start_parent, write_table

GOAL = 0.95  # ours / plain tokens/s at n = 8


def measure(args) -> dict:
    """Build the engine and time both calls, interleaved, for every n."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trl_nrollout.builtin import digits_prompts, long_prompts
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.types import SamplingOptions

    tok = AutoTokenizer.from_pretrained(args.model)
    texts = long_prompts(digits_prompts(args.prompts), tok, args.prompt_tokens)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=args.prompts,
                                 rollout_n=max(args.ns))
    group = VLLMEngineGroup(args.model, layout, rank=0, max_model_len=args.prompt_tokens + args.max_tokens + 8,
                            seed=0)
    budget = group.engine_kwargs.get("max_num_batched_tokens")
    rows = []
    bar = tqdm(total=len(args.ns) * (args.reps + 1), desc="engine overhead (n, rep)")
    for n in args.ns:
        expanded = [p for p in prompts for _ in range(n)]

        def ours(seed: int, n: int = n, expanded: list = expanded, mode: str = "sample") -> int:
            opts = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=seed)
            group.seed_mode = mode
            batch = group.generate_expanded(expanded, n, opts)
            group.seed_mode = "sample"
            return batch.num_completion_tokens

        def ours_engine_seed(seed: int, n: int = n, expanded: list = expanded) -> int:
            return ours(seed, n, expanded, mode="engine")

        def plain(seed: int, n: int = n) -> int:
            params = SamplingParams(n=n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
            outs = group.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        calls = {"ours": ours, "ours_engine_seed": ours_engine_seed, "plain": plain}
        seconds: dict[str, list[float]] = {k: [] for k in calls}
        tokens: dict[str, list[int]] = {k: [] for k in calls}
        for rep in range(args.reps + 1):  # rep 0 warms both up and is not counted
            order = list(calls) if rep % 2 == 0 else list(calls)[::-1]
            for name in order:
                start = time.perf_counter()
                count = calls[name](rep)
                if rep:
                    seconds[name].append(time.perf_counter() - start)
                    tokens[name].append(count)
            bar.update(1)
        # medians: every call generates the same tokens, and one call slowed by a foreign job must not decide it
        tps = {k: tokens[k][0] / statistics.median(seconds[k]) for k in calls}
        mean_tps = {k: sum(tokens[k]) / sum(seconds[k]) for k in calls}
        rows.append({"n": n, "tokens_per_call": tokens["ours"][0], "call_seconds": seconds,
                     "ours_tokens_per_s": round(tps["ours"], 1), "plain_tokens_per_s": round(tps["plain"], 1),
                     "ours_engine_seed_tokens_per_s": round(tps["ours_engine_seed"], 1),
                     "ratio": round(tps["ours"] / tps["plain"], 3),
                     "ratio_engine_seed": round(tps["ours_engine_seed"] / tps["plain"], 3),
                     "ratio_of_means": round(mean_tps["ours"] / mean_tps["plain"], 3),
                     "same_tokens": tokens["ours"] == tokens["plain"]})
    bar.close()
    return {"rows": rows, "max_num_batched_tokens": budget,
            "prompt_tokens_per_call": sum(len(p) for p in prompts),
            "block_size": group.llm.llm_engine.vllm_config.cache_config.block_size}


def write_outputs(result: dict, out_dir: Path) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = ["| n | tokens / call | ours tokens/s | ours, engine seed, tokens/s | plain vLLM tokens/s | "
             "ours / plain (medians) | ours, engine seed / plain | ours / plain (means) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['tokens_per_call']:,} | {r['ours_tokens_per_s']:.0f} | "
                     f"{r['ours_engine_seed_tokens_per_s']:.0f} | {r['plain_tokens_per_s']:.0f} | {r['ratio']:.3f} | "
                     f"{r['ratio_engine_seed']:.3f} | {r['ratio_of_means']:.3f} |")
    at8 = next((r["ratio"] for r in rows if r["n"] == 8), None)
    at8e = next((r["ratio_engine_seed"] for r in rows if r["n"] == 8), None)
    verdict = ("not measured (n = 8 not in --ns)" if at8 is None
               else f"**{at8:.3f}** with a seed per sample (the default), **{at8e:.3f}** with "
                    f"rollout_seed_mode='engine': {'met' if at8 >= GOAL else 'NOT met'} / "
                    f"{'met' if at8e >= GOAL else 'NOT met'}")
    lines += ["", f"Goal: ours / plain >= {GOAL} at n = 8: {verdict}.", "",
              f"{meta['prompts']} prompts of {meta['prompt_tokens']} tokens ({result['prompt_tokens_per_call']:,} "
              f"prompt tokens per call; one scheduler step takes {result['max_num_batched_tokens']:,}), "
              f"{meta['max_tokens']} new tokens (EOS ignored), temperature 1.0, {meta['reps']} timed calls of each "
              f"after a warm-up, interleaved (tokens/s from the median call); model `{meta['model_name']}`, KV block {result['block_size']}, "
              f"{meta['cpus']} CPUs. Load average (1 min) {result['load_avg_start'][0]:.2f} at start, "
              f"{result['load_avg_end'][0]:.2f} at end."]
    table = write_table(result, lines, out_dir, "engine_overhead")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["ratio"] for r in rows], width=0.4, color="C2", label="seed per sample")
        ax.bar([x + 0.2 for x in xs], [r["ratio_engine_seed"] for r in rows], width=0.4, color="C0",
               label="rollout_seed_mode='engine'")
        ax.set_xticks(list(xs), [str(r["n"]) for r in rows])
        ax.axhline(GOAL, color="C3", ls="--", lw=1, label=f"goal {GOAL}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="samples per prompt n", ylabel="ours / plain vLLM (tokens/s)",
               title=f"engine overhead, {meta['model_name']}, {meta['prompt_tokens']}-token prompts")
        ax.set_ylim(0, max(1.1, max(max(r["ratio"], r["ratio_engine_seed"]) for r in rows) * 1.1))
        ax.legend()
        save_figure(fig, out_dir / "engine_overhead.png")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2", help="built-in name, hub id or local folder")
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4, help="timed calls of each, after one warm-up")
    ap.add_argument("--quick", action="store_true", help="n = 8 only, 2 timed calls of each")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.ns, args.reps = [8], 2
    model_name, load_start, busy = start_parent(args, "overhead ratios")
    result = measure(args)
    result.update({
        "meta": {"model_name": model_name, "model_path": args.model, "ns": args.ns, "prompts": args.prompts,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "reps": args.reps,
                  "quick": args.quick, "cpus": os.cpu_count()},
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "busy_at_start": busy})
    return finish(result, args.out, write_outputs, busy, load_start)


if __name__ == "__main__":
    raise SystemExit(main())
