"""The shapes of the training passes in the step's cost model (:mod:`trl_nrollout.plan.cost`): how the trainer
cuts a rank's samples into micro batches and lays each one out (the shared-prompt layout where
:func:`~trl_nrollout.plan.packing_rules.packing_pays`, else padding-free rows where they fit, else padded rows),
as :class:`PassShape`: forwards, token slots and attention's query-key pairs. :func:`pass_shape` for the log-prob
passes, :func:`update_shape` for the update (count-based or under ``update_token_budget``), and
:func:`padfree_token_cap`, the padding-free rows' bound the trainer shares. Pure: no torch at import."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.packing_rules import (
    MAX_PACKED_MASK_BYTES,
    mask_bytes_of,
    packed_length,
    packing_pays,
)
from trl_nrollout.plan.workload import Workload


@dataclass(frozen=True)
class PassShape:
    """The forwards of one training pass over a rank's samples, as the trainer lays them out: ``forwards`` micro
    batches, ``tokens`` through the linear layers in all (padding and prompt copies included), ``pairs``: the
    query-key pairs attention computes in all, whether the micro batches are ``packed`` (shared prompts) or
    ``padfree`` (padding-free rows), and the token slots of the largest micro batch (``slots_per_forward``: what
    its activations scale with)."""

    forwards: int
    tokens: float
    pairs: float
    packed: bool
    padfree: bool = False
    slots_per_forward: float = 0.0

    def flops(self, dims: ModelDims) -> float:
        """FLOPs of one forward pass over all of it."""
        return self.tokens * 2 * dims.matmul_params + self.pairs * dims.attention_flops_per_pair


def padfree_rows_of(samples: float, work: Workload, query_bytes: int = 2) -> tuple[float, float] | None:
    """Our trainer's padding-free rows for a micro batch of ``samples`` samples (:mod:`~trl_nrollout.passes.padfree`
    lays them out): ``(rows, width)``, rows expected (a fraction), or None where the trainer runs the padded rows.

    The rows are as wide as the micro batch's longest sample (``work.row_width``: the tail, prompt and completion)
    and hold its real tokens (``samples x work.sample_len``) end to end, so the token slots are the real tokens plus
    the last row's unused end, half a row expected: ``real / width + 1/2`` rows (first-fit decreasing, the trainer's
    packing, fills all but the last row to within a sample of the width at long-tailed lengths), at most one per
    sample. The trainer's rule (``padfree_fits``), on the whole rows: they save at least a tenth of the padded slots
    (``samples x width``) and their block mask (``rows x width^2``, boolean with SDPA's copy in the queries' dtype,
    ``query_bytes``) stays within :data:`~trl_nrollout.plan.packing_rules.MAX_PACKED_MASK_BYTES`."""
    width = math.ceil(work.row_width)
    real = samples * work.sample_len
    rows = max(1.0, min(samples, real / max(width, 1) + 0.5))
    whole = math.ceil(rows - 1e-9)  # the trainer decides on whole rows
    if whole * width > 0.9 * samples * width or mask_bytes_of(whole, width, 1, query_bytes) > MAX_PACKED_MASK_BYTES:
        return None
    return rows, float(width)


def padfree_token_cap(row_width: int, query_bytes: int = 2) -> int:
    """The most real tokens a micro batch may hold and still run as padding-free rows of ``row_width`` (its longest
    sample) under SDPA: the rows whose boolean block mask (with its copy in the queries' dtype, ``query_bytes``)
    stays within :data:`~trl_nrollout.plan.packing_rules.MAX_PACKED_MASK_BYTES`, less half a row (the last row's
    expected unused end). Beyond it the trainer runs the micro batch padded. At least ``row_width`` (one sample)."""
    if row_width < 1:
        raise ValueError(f"row_width={row_width} must be >= 1 (the longest sample's tokens).")
    rows = 1
    while mask_bytes_of(rows + 1, row_width, 1, query_bytes) <= MAX_PACKED_MASK_BYTES:
        rows += 1
    return max(row_width, rows * row_width - row_width // 2)


def _micro_batch_cost(size: float, n: int, work: Workload, query_bytes: int) -> tuple[float, float, bool, bool]:
    """One micro batch of ``size`` samples as the trainer lays it out: ``(tokens, pairs, packed, padfree)``. The
    shared-prompt layout where it pays (the trainer's first choice), else the padding-free rows
    (``work.padfree_rows``) where they fit, else the padded rows (``size x row_width``; a masked SDPA computes every
    pair of a row: ``L^2`` per row). ``work.padding_free``: the ideal varlen trainer's real tokens and causal pairs."""
    if work.padding_free:
        length = work.sample_len
        return size * length, size * length * length / 2, False, False
    plain_width = work.row_width
    if work.padfree_rows and work.varlen_rows and size * work.sample_len <= 0.9 * max(1, round(size)) * plain_width:
        length = work.sample_len  # one varlen row: the real tokens, each sequence's causal pairs (the trainer's first
        return size * length, size * length * length / 2, False, True  # choice, before the shared-prompt layout)
    whole = max(1, round(size))
    per_prompt = min(n, whole)  # a micro batch holds whole groups, or a part of one prompt's
    groups = math.ceil(whole / per_prompt)
    if work.packed and whole > 1:
        length = packed_length(work.prompt_width, per_prompt, work.completion_max)
        mask = mask_bytes_of(groups, math.ceil(length), 1, query_bytes)
        if packing_pays(whole, plain_width, groups, length) and mask <= MAX_PACKED_MASK_BYTES:
            rows = groups * size / whole
            return rows * length, rows * length * length, True, False
    if work.padfree_rows:
        free = padfree_rows_of(size, work, query_bytes)
        if free is not None:
            rows, width = free
            return rows * width, rows * width * width, False, True
    return size * plain_width, size * plain_width * plain_width, False, False


def pass_shape(samples: int, per_forward: int, n: int, work: Workload, *, max_token_len: int | None = None,
               query_bytes: int = 4, budgeted: bool = False, min_forwards: int = 1) -> PassShape:
    """The forwards of a pass over ``samples`` samples (a rank's; a prompt's ``n`` samples side by side) cut into
    micro batches of ``per_forward`` samples, or under a token budget ``max_token_len``.

    The budget: with ``budgeted`` and padding-free rows (``work.padfree_rows``; the trainer's
    ``budgeted_parts``) the micro batches count real tokens, ``ceil(samples x sample_len / max_token_len)`` of
    them (at least ``min_forwards``: the update's ``gradient_accumulation_steps``; at most one per sample) of even
    work; otherwise each holds as many samples as fit padded to the longest (``max_token_len // row_width``).

    Each micro batch (:func:`_micro_batch_cost`) runs the shared-prompt layout where the trainer's own rule
    (:func:`~trl_nrollout.plan.packing_rules.packing_pays` and the mask's bound) packs it (``G`` rows of ``L = P
    - 1 + K (C + 1)`` tokens, ``G L^2`` pairs), else our padding-free rows (:func:`padfree_rows_of`: the real tokens
    plus the last row's end, ``R W^2`` pairs under the block mask), else the padded rows: ``B`` rows of the longest
    prompt and completion (the update pads the rank's whole batch to the step's longest, the log-prob passes each
    micro batch to its own: at long-tailed lengths both hold a sample at the cap), ``B (P + C)^2`` pairs (a padding
    mask: no causal skipping). ``work.padding_free``: an ideal trainer's real tokens and causal pairs per sequence.
    ``query_bytes``: attention's query dtype (the masks' copies under SDPA)."""
    if samples <= 0:
        return PassShape(0, 0.0, 0.0, False)
    if max_token_len is not None and budgeted and (work.padfree_rows or work.padding_free):
        forwards = math.ceil(samples * work.sample_len / max_token_len)
        forwards = min(samples, max(forwards, min_forwards, 1))
        size = samples / forwards
    else:
        if max_token_len is not None:
            per_forward = min(per_forward, max(1, int(max_token_len // max(work.row_width, 1.0))))
        whole = max(1, min(per_forward, samples))
        forwards = max(math.ceil(samples / whole), min(min_forwards, samples))
        size = samples / forwards if budgeted else float(whole)  # count-cut: full micro batches, a short last one
    tokens, pairs, packed, padfree = _micro_batch_cost(size, n, work, query_bytes)
    scale = samples / size  # the last micro batch may be short: every figure in proportion to the samples
    return PassShape(forwards, tokens * scale, pairs * scale, packed, padfree, slots_per_forward=tokens)


def update_shape(layout: RolloutLayout, work: Workload, query_bytes: int = 2) -> PassShape:
    """The update's forwards on one rank for one pass over the rollout (one PPO epoch), as the trainer cuts them.

    Without a budget (``work.update_token_budget`` None): micro batches of ``ppo_micro_batch_size_per_device``
    samples (:func:`pass_shape`). With one (``use_dynamic_bsz``): each optimizer step's samples on the rank pooled
    (``mini_batch_samples_per_rank``) and cut under the budget into at least ``gradient_accumulation_steps`` micro
    batches (the trainer's ``_budgeted_steps``; every rank runs the busiest rank's count, which even lengths make
    this one's), or, where optimizer steps span rollouts, each count-based micro batch cut alone."""
    samples, n = layout.samples_per_rank, layout.rollout_n
    budget = work.update_token_budget
    if budget is None:
        return pass_shape(samples, layout.ppo_micro_batch_size_per_device, n, work, query_bytes=query_bytes)
    accum = layout.gradient_accumulation_steps
    micro = layout.ppo_micro_batch_size_per_device
    if (samples // micro) % accum == 0:
        pool, least = layout.mini_batch_samples_per_rank, accum
    else:
        pool, least = micro, 1
    one = pass_shape(pool, pool, n, work, max_token_len=budget, query_bytes=query_bytes, budgeted=True,
                     min_forwards=least)
    pools = samples / pool
    return PassShape(math.ceil(one.forwards * pools - 1e-9), one.tokens * pools, one.pairs * pools, one.packed,
                     one.padfree, one.slots_per_forward)
