"""Padding-free training forwards at long-tailed completion lengths (issue 45's first goal, on the forward the
update runs).

A rank's micro batch of ``--samples`` samples (``--prompt`` prompt tokens each) whose completions are either
long-tailed (a clipped exponential, mean = cap / 4, cap ``--cap``) or uniform at the same mean (the same real
tokens), on ``builtin:small-qwen2`` (float32, SDPA): one forward and backward of the completion tokens' log-probs
(what the update runs per micro batch), in the padded layout (every sample as wide as the longest, TRL's) and in
padding-free rows (:func:`trl_nrollout.passes.padfree.pack_rows`, rows as long as the longest sample, under a
block mask), under the token budget (``budgeted``), and as one varlen row (``varlen``: every sample in one row, no
mask, each sequence attending to itself by its boundaries; on the CPU one SDPA per sequence). Reported:
seconds per real token of each, and the long-tailed / uniform ratio of each layout (the goal: <= 1.15 padding-free;
the padded layout pays for the tail's longest sample on every row), median of ``--repeats``. Prints and saves
``padding_free.json`` / ``.md`` / ``.png`` under ``--out``; ``--docs`` copies the plot to docs/img.

    python benchmarks/padding_free.py [--samples 32] [--cap 512] [--repeats 3] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import check_load, pyplot, save_figure, write_table  # noqa: E402

LAYOUTS = ("padded", "padding-free", "budgeted", "varlen")


def lengths_of(kind: str, samples: int, cap: int, seed: int = 0) -> list[int]:
    import torch

    mean = cap / 4
    if kind == "uniform":
        return [round(mean)] * samples
    gen = torch.Generator().manual_seed(seed)
    draws = torch.empty(samples).exponential_(1 / mean, generator=gen).round().clamp(1, cap).long().tolist()
    draws[0] = cap  # the tail reaches the cap, as at reasoning lengths
    scale = mean * samples / sum(draws)  # the same real tokens as the uniform batch
    return [max(1, min(cap, round(d * scale))) for d in draws]


def step_seconds(model, prompts, completions, layout: str, repeats: int, budget: int | None = None) -> float:
    """Median seconds of one forward + backward of the samples in ``layout``: ``padded``, ``padding-free`` (one
    micro batch of rows), or ``budgeted`` (micro batches of at most ``budget`` real tokens, as the update cuts them,
    each padding-free where the trainer's rule says it pays, else padded)."""
    import torch

    from trl_nrollout.passes.padfree import budget_count, budgeted_parts, padfree_fits

    if layout == "budgeted":
        lengths = [p.numel() + c.numel() for p, c in zip(prompts, completions)]
        parts = budgeted_parts(lengths, budget, budget_count(lengths, budget), model.config.hidden_size)
        plans = []
        for idx in parts:
            sub = [lengths[i] for i in idx]
            free = padfree_fits(sub, max(sub), torch.bool, torch.float32)
            plans.append(([prompts[i] for i in idx], [completions[i] for i in idx],
                          "padding-free" if free else "padded"))
        times = []
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            for ps, cs, how in plans:
                _forward_backward(model, ps, cs, how)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _forward_backward(model, prompts, completions, layout)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first warms up


def _forward_backward(model, prompts, completions, layout: str) -> None:
    import torch

    from trl_nrollout.passes.padfree import pack_rows, rows_attention

    if layout == "padded":
        width = max(p.numel() + c.numel() for p, c in zip(prompts, completions))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            seq = torch.cat([p, c])
            ids[r, :seq.numel()] = seq
            mask[r, :seq.numel()] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = (lp * mask[:, 1:]).sum()
    else:  # padding-free: rows under a block mask, or (varlen) one row whose sequences SDPA runs one by one
        pk = pack_rows(prompts, completions, 0, mask_dtype=None if layout == "varlen" else torch.bool)
        with rows_attention(model.config, pk):
            logits = model(input_ids=pk.input_ids, **pk.forward_kwargs()).logits
        labels = pk.shift_labels.clamp(min=0)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        loss = (lp * (pk.shift_labels >= 0)).sum()
    loss.backward()


def main(argv: list[str] | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--cap", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=None,
                        help="real tokens per micro batch of the budgeted arm (default: 2 x (cap + prompt))")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args(argv)
    load, busy = check_load("the padding-free timing")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:small-qwen2"), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    model.train()
    gen = torch.Generator().manual_seed(1)
    budget = args.budget or 2 * (args.cap + args.prompt)
    rows = []
    for kind in ("uniform", "long-tailed"):
        lengths = lengths_of(kind, args.samples, args.cap)
        prompts = [torch.randint(5, 900, (args.prompt,), generator=gen) for _ in lengths]
        completions = [torch.randint(5, 900, (n,), generator=gen) for n in lengths]
        real = sum(lengths) + args.prompt * len(lengths)
        for layout in LAYOUTS:
            s = step_seconds(model, prompts, completions, layout, args.repeats, budget)
            rows.append({"lengths": kind, "layout": layout, "real_tokens": real, "seconds": s,
                         "us_per_real_token": s / real * 1e6, "longest": max(lengths)})
            print(rows[-1], flush=True)
    by = {(r["lengths"], r["layout"]): r for r in rows}
    ratios = {layout: by[("long-tailed", layout)]["us_per_real_token"] / by[("uniform", layout)]["us_per_real_token"]
              for layout in LAYOUTS}
    result = {"load_at_start": load, "busy_at_start": busy, "samples": args.samples, "cap": args.cap,
              "prompt": args.prompt, "rows": rows, "tail_over_uniform": ratios,
              "budget": budget, "goal_met": min(ratios[k] for k in LAYOUTS if k != "padded") <= 1.15}
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Padding-free forwards: {args.samples} samples, {args.prompt}-token prompts, completions capped at "
             f"{args.cap} (mean {args.cap // 4}), small-qwen2 fp32, forward + backward (load {load[0]:.2f})", "",
             "| completions | layout | real tokens | s per micro batch | us per real token |", "|---|---|---|---|---|"]
    lines += [f"| {r['lengths']} | {r['layout']} | {r['real_tokens']} | {r['seconds']:.3f} | "
              f"{r['us_per_real_token']:.1f} |" for r in rows]
    lines += ["", f"long-tailed / uniform, per real token: padded **{ratios['padded']:.2f}x**, padding-free (one "
                  f"micro batch) **{ratios['padding-free']:.2f}x**, budgeted ({budget} real tokens per micro batch, as "
                  f"the update cuts them) **{ratios['budgeted']:.2f}x**, varlen (one row, SDPA per sequence) "
                  f"**{ratios['varlen']:.2f}x** (goal <= 1.15: {'met' if result['goal_met'] else 'not met'}); "
                  f"varlen / padding-free, long-tailed: "
                  f"{by[('long-tailed', 'varlen')]['seconds'] / by[('long-tailed', 'padding-free')]['seconds']:.2f}x"]
    print(write_table(result, lines, args.out, "padding_free"))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    fig.set_size_inches(7.5, 3.8)
    for i, layout in enumerate(LAYOUTS):
        vals = [by[(k, layout)]["us_per_real_token"] for k in ("uniform", "long-tailed")]
        ax.bar([i * 3, i * 3 + 1], vals, color=["tab:gray", "tab:blue"])
    ax.set_xticks([t for i in range(len(LAYOUTS)) for t in (i * 3, i * 3 + 1)],
                  [f"{layout}\n{kind}" for layout in LAYOUTS for kind in ("uniform", "long tail")], fontsize=7)
    ax.set_ylabel("us per real token (fwd + bwd)")
    ax.set_title(f"long tail / uniform: padded {ratios['padded']:.2f}x, padding-free {ratios['padding-free']:.2f}x, "
                 f"budgeted {ratios['budgeted']:.2f}x, varlen {ratios['varlen']:.2f}x", fontsize=9)
    save_figure(fig, args.out / "padding_free.png")
    if args.docs:
        shutil.copy(args.out / "padding_free.png", ROOT / "docs" / "img" / "padding_free.png")
    return result


if __name__ == "__main__":
    main()
