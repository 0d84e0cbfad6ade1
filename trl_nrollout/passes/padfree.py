"""Padding-free rows: a micro batch's samples as rows of concatenated real tokens (no padding between them).

The padded layout runs every sample of a micro batch at the width of the longest (TRL's layout: prompts
left-padded, completions right-padded), so at long-tailed completion lengths most token slots are padding.
:func:`pack_rows` lays the samples' real tokens (prompt then completion) end to end into rows of at most
``row_len`` tokens (first-fit decreasing, :func:`row_bins`), each sequence with its own positions (``0 ..
len - 1``) and attending to itself only::

    row 0: [p0 c0 | p3 c3 | p5 c5 | pad]      positions [0 1 .. | 0 1 .. | 0 1 .. | 0]
    row 1: [p1 c1 | p2 c2 | p4 c4       ]

Attention stays inside each sequence by a block-diagonal causal mask ``[R, 1, L, L]`` (what SDPA and eager attention
take: transformers 5.19 with SDPA does NOT separate sequences from ``position_ids`` alone, measured here: logits
off by about 2), or, for flash-attention's varlen kernels, by the positions alone (``mask=None``: transformers
reads the sequence starts from where the positions return to 0). Rows are at most as long as the micro batch's
longest sample by default, so a row's ``L x L`` attention (which SDPA computes in full under a mask) is never more
than one padded row's.

:func:`balanced_parts` cuts a rank's samples into a given number of micro batches of even work (tokens and attention
pairs, :func:`workload`); :func:`budget_count` is the number a token budget needs.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trl_nrollout.passes.varlen import packed_attention, varlen_forward, varlen_kwargs

#: attention implementations that take a 4D block mask (varlen ones: :data:`~.varlen.VARLEN_ATTENTION`).
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class PackedRows:
    """A micro batch of ``B`` samples as ``R`` padding-free rows of ``L`` tokens.

    - ``input_ids``, ``position_ids``: ``[R, L]``; positions restart at 0 with every sequence (and on the padding at
      a row's end, which is a sequence of its own that nothing reads).
    - ``attention_mask``: ``[R, 1, L, L]`` block-diagonal causal (bool: True where a query may attend, or additive in
      the given dtype), or None for varlen attention (sequences known from the positions).
    - ``index``: ``[B, C]`` flat positions into ``[R * L]``: the position whose output predicts sample ``b``'s
      completion token ``j`` (0 past the sample's completion: :attr:`valid` says which are real).
    - ``valid``: ``[B, C]`` bool, ``j < completion length of b``.
    - ``shift_labels``: ``[R, L]``, the token each position predicts where it is scored (``-100`` elsewhere): TRL's
      fused LM head's ``shift_labels``.
    - ``rows``: each row's samples, in the order they sit in it.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    index: Tensor
    valid: Tensor
    shift_labels: Tensor
    rows: list[list[int]]

    def gather(self, per_position: Tensor) -> Tensor:
        """``[R, L]`` per-position values (log-probs, entropies) -> ``[B, C]`` per completion token, 0 past the end."""
        out = per_position.reshape(-1)[self.index]
        return out.masked_fill(~self.valid, 0)

    @property
    def token_slots(self) -> int:
        return self.input_ids.numel()

    def forward_kwargs(self) -> dict:
        """The model's keyword arguments for these rows: the block mask and positions, or for varlen attention
        (no mask) the positions and the sequences' boundaries (:func:`~trl_nrollout.passes.varlen.varlen_kwargs`).
        Run a varlen forward within :func:`rows_attention`."""
        if self.attention_mask is None:
            return {"position_ids": self.position_ids, **varlen_kwargs(self.position_ids)}
        return {"attention_mask": self.attention_mask, "position_ids": self.position_ids}


def rows_attention(config, rows: PackedRows):
    """The context a forward of ``rows`` runs in: a model whose attention is SDPA runs varlen attention for rows
    without a mask (:func:`~trl_nrollout.passes.varlen.varlen_forward`), else nothing changes."""
    return varlen_forward(config) if rows.attention_mask is None else contextlib.nullcontext()


def rows_mask_dtype(config, weights: torch.dtype, queries: torch.dtype, device_type: str) -> torch.dtype | None:
    """The mask dtype of a model's padding-free rows (:func:`~trl_nrollout.passes.packing.mask_dtype`), or None
    where its rows run varlen attention (:func:`~trl_nrollout.passes.varlen.packed_attention`: flash-attention, or
    SDPA on CUDA in half precision)."""
    from trl_nrollout.passes.packing import mask_dtype

    if packed_attention(config, device_type, queries) == "varlen":
        return None
    return mask_dtype(config, weights)


def row_bins(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Sample indices in rows of at most ``row_len`` tokens (first-fit decreasing; ties by index). A sample longer
    than ``row_len`` is an error (the caller picks ``row_len >= max(lengths)``)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > row_len:
        raise ValueError(f"a sample of {lengths[order[0]]} tokens does not fit a row of {row_len}.")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_len - lengths[i])
    return rows


def block_causal_mask(segments: Tensor, dtype: torch.dtype = torch.bool) -> Tensor:
    """``[R, 1, L, L]``: query ``t`` may attend key ``s`` when ``s <= t`` and both lie in the same sequence.
    ``segments``: ``[R, L]`` sequence number of each position (any ids; padding a sequence of its own)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    allowed = causal & (segments[:, :, None] == segments[:, None, :])
    if dtype == torch.bool:
        return allowed[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def unit_causal_mask(units: Tensor, segments: Tensor, dtype: torch.dtype = torch.bool) -> Tensor:
    """``[R, 1, L, L]``: query ``t`` may attend key ``s <= t`` of its own unit (``units`` ``[R, L]``: ids) when the
    key lies in the unit's shared prompt (``segments == -1``) or in the query's own segment (``segments``: each
    sample's id). A unit of one sample is one causal sequence (:func:`block_causal_mask`)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    same_unit = units[:, :, None] == units[:, None, :]
    visible = (segments[:, None, :] == -1) | (segments[:, :, None] == segments[:, None, :])
    allowed = causal & same_unit & visible
    if dtype == torch.bool:
        return allowed[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def shared_units(prompts: Sequence[Sequence[int] | Tensor]) -> list[list[int]]:
    """Sample indices grouped by identical prompt (a group's samples), in order of first appearance."""
    if prompts and all(isinstance(p, Tensor) for p in prompts):  # one copy to the host, not one per prompt
        sizes = [p.numel() for p in prompts]
        flat = torch.cat([p.reshape(-1) for p in prompts]).tolist()
        bounds = [0, *itertools.accumulate(sizes)]
        keys = [tuple(flat[s:e]) for s, e in itertools.pairwise(bounds)]
    else:
        keys = [tuple(p.tolist()) if isinstance(p, Tensor) else tuple(p) for p in prompts]
    seen: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        seen.setdefault(key, []).append(i)
    return list(seen.values())


def unit_lengths(prompt_lens: Sequence[int], completion_lens: Sequence[int], units: Sequence[Sequence[int]]
                 ) -> list[int]:
    """Tokens of each unit in :func:`pack_rows`'s layout: its prompt but the last token once, then per sample the
    prompt's last token and the completion (``p - 1 + sum(n_i + 1)``; a unit of one sample: ``p + n``)."""
    return [prompt_lens[u[0]] - 1 + sum(completion_lens[b] + 1 for b in u) for u in units]


def pack_rows(prompts: Sequence[Tensor], completions: Sequence[Tensor], pad_token_id: int, *,
              row_len: int | None = None, mask_dtype: torch.dtype | None = torch.bool,
              pad_to_multiple_of: int | None = None, completion_width: int | None = None,
              units: Sequence[Sequence[int]] | None = None) -> PackedRows:
    """Pack ``B`` samples (each prompt ``prompts[b]`` ``[P_b]`` then completion ``completions[b]`` ``[C_b]``, real
    tokens only, on one device) into padding-free rows.

    Args:
        row_len: tokens per row at most (default: the longest unit, so no row attends over more pairs than a
            padded row would under a mask; varlen attention: every token in one row); rounded up to
            ``pad_to_multiple_of`` (TRL's option: it rounds the row, not each sample).
        mask_dtype: ``torch.bool`` (SDPA), an additive mask's dtype (eager), or None (varlen attention: positions
            and sequence boundaries, :meth:`PackedRows.forward_kwargs`; every unit a single sample).
        completion_width: ``C`` of :attr:`PackedRows.index` (default: the longest completion).
        units: samples sharing a prompt (each sample in one unit; default: every sample alone), laid out with
            the prompt once: its tokens but the last, then per sample the prompt's last token (which predicts the
            completion's first) and the completion, each sample attending to the shared prompt and to itself only
            (the shared-prompt layout, padding-free: several groups to a row)::

                row: [p0 .. p(n-2) | p(n-1) c1 | p(n-1) c2 | ... | next unit ...]
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"pack_rows needs as many prompts as completions, at least one ({len(prompts)}, "
                         f"{len(completions)}).")
    device = prompts[0].device
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("pack_rows: every sample needs at least one prompt token (the position predicting its "
                         "first completion token).")
    units = [[b] for b in range(len(prompts))] if units is None else [list(u) for u in units]
    if sorted(b for u in units for b in u) != list(range(len(prompts))):
        raise ValueError("pack_rows: units must hold every sample exactly once.")
    if mask_dtype is None and any(len(u) > 1 for u in units):
        raise ValueError("pack_rows: shared-prompt units need a mask (varlen attention only separates sequences).")
    p_lens = [int(p.numel()) for p in prompts]
    c_lens = [int(c.numel()) for c in completions]
    lengths = unit_lengths(p_lens, c_lens, units)
    if row_len is None:
        row_len = sum(lengths) if mask_dtype is None else max(lengths)  # varlen: no L x L to bound
    width = max(row_len, max(lengths))
    if pad_to_multiple_of and pad_to_multiple_of > 1:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    bins = row_bins(lengths, width)
    c_width = max(c_lens) if completion_width is None else completion_width
    rows = len(bins)
    # the layout, on the host: pieces of consecutive slots in row order (a unit's prompt but its last token; per
    # sample that token and its completion; a row's padding tail), each with its tokens and (length, its first
    # position less its flat start, unit, segment: the sample, or -1 for a shared prompt or a tail)
    used = [sum(lengths[u] for u in members) for members in bins]
    pad = prompts[0].new_full((width - min(used),), pad_token_id)
    pieces: list[Tensor] = []
    meta: list[tuple[int, int, int, int]] = []
    starts = [0] * len(prompts)  # each sample's block: the flat slot of its prompt's last token
    at = 0
    for r, members in enumerate(bins):
        for u in members:
            prompt, head = prompts[units[u][0]], p_lens[units[u][0]] - 1
            if head:
                pieces.append(prompt[:-1])
                meta.append((head, -at, u, -1))
                at += head
            for b in units[u]:
                pieces += [prompt[-1:], completions[b].reshape(-1)]
                meta.append((c_lens[b] + 1, head - at, u, b))
                starts[b] = at
                at += c_lens[b] + 1
        if at < (r + 1) * width:  # the row's tail: a sequence of its own, positions from 0
            tail = (r + 1) * width - at
            pieces.append(pad[:tail])
            meta.append((tail, -at, len(units) + r, -1))
            at += tail
    total = rows * width
    count, samples = len(meta), len(prompts)
    lens, offsets, unit_of, segment_of = ([m[k] for m in meta] for k in range(4))
    lens_t, offsets_t, unit_t, segment_t, starts_t, c_len_t = _to_device(
        [*lens, *offsets, *unit_of, *segment_of, *starts, *c_lens], device).split(
        [count, count, count, count, samples, samples])
    input_ids = torch.cat(pieces).to(prompts[0].dtype).view(rows, width)
    # positions: each piece from its first position on (0, or after the unit's shared prompt)
    flat_pos = torch.arange(total, device=device)
    position_ids = (flat_pos + torch.repeat_interleave(offsets_t, lens_t, output_size=total)).view(rows, width)
    # each sample's completion token j is predicted at its block's position j (the prompt's last token first)
    j = torch.arange(c_width, device=device)
    valid = j[None, :] < c_len_t[:, None]
    index = torch.where(valid, starts_t[:, None] + j[None, :], 0)
    scored = torch.zeros(total + 1, dtype=torch.bool, device=device)
    scored[index.masked_fill(~valid, total)] = True  # the slot past the end takes what is not scored
    flat_ids = input_ids.reshape(-1)
    following = torch.cat([flat_ids[1:], flat_ids[:1]]).long()  # a scored position is never a block's last
    shift_labels = torch.where(scored[:total], following, -100).view(rows, width)
    mask = None
    if mask_dtype is not None:
        unit_ids = torch.repeat_interleave(unit_t, lens_t, output_size=total).view(rows, width)
        segments = torch.repeat_interleave(segment_t, lens_t, output_size=total).view(rows, width)
        mask = unit_causal_mask(unit_ids, segments, mask_dtype)
    return PackedRows(input_ids, position_ids, mask, index, valid, shift_labels, [
        [b for u in members for b in units[u]] for members in bins])


def _to_device(values: list[int], device: torch.device) -> Tensor:
    """Host integers as one int64 tensor on ``device``; to a GPU from pinned memory without waiting (one copy, no
    host sync: the caching host allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def choose_units(prompt_lens: Sequence[int], completion_lens: Sequence[int], units: Sequence[Sequence[int]],
                 hidden_size: int = 4096) -> list[list[int]] | None:
    """The shared-prompt units where they make the rows cheaper than one sample per unit (:func:`rows_cost` of
    the units' lengths against the samples', at least 5% less), else None: a group's prompt once pays where prompts
    are long against completions; rows as long as a whole group cost attention where they are not."""
    if all(len(u) == 1 for u in units):
        return None
    alone = [p + n for p, n in zip(prompt_lens, completion_lens)]
    shared = unit_lengths(prompt_lens, completion_lens, units)
    if rows_cost(shared, hidden_size) <= 0.95 * rows_cost(alone, hidden_size):
        return [list(u) for u in units]
    return None


def padfree_pays(lengths: Sequence[int], plain_width: int, row_width: int | None = None, samples: int | None = None
                 ) -> tuple[bool, int, int]:
    """Whether ``B`` samples (``samples``, default ``len(lengths)``) laid out as units of ``lengths`` tokens (a
    sample each, or shared-prompt units), which the plain layout runs as ``B`` rows of ``plain_width``, run cheaper
    as padding-free rows of ``row_width`` (default: the longest unit): at least a tenth of the token slots saved.
    Returns (pays, rows, row width)."""
    width = max(lengths) if row_width is None else max(row_width, max(lengths))
    rows = len(row_bins(lengths, width))
    count = len(lengths) if samples is None else samples
    return rows * width <= 0.9 * count * plain_width, rows, width


def padfree_fits(lengths: Sequence[int], plain_width: int, mask_dtype: torch.dtype | None, queries: torch.dtype,
                 pad_to_multiple_of: int | None = None, samples: int | None = None) -> bool:
    """Whether a micro batch runs as padding-free rows: they save a tenth of the slots (:func:`padfree_pays`) and
    their block mask, rows rounded to ``pad_to_multiple_of``, stays within the shared-prompt layout's bound
    (:data:`~trl_nrollout.plan.packing_rules.MAX_PACKED_MASK_BYTES`; ``mask_dtype`` and ``queries`` as
    :func:`~trl_nrollout.passes.packing.mask_bytes` takes them; None: varlen attention, one row, no mask). The
    update and the log-prob passes decide alike."""
    from trl_nrollout.passes.packing import MAX_PACKED_MASK_BYTES, mask_bytes, round_up

    if mask_dtype is None:  # varlen attention: one row of every token, no mask
        return padfree_pays(lengths, plain_width, round_up(sum(lengths), pad_to_multiple_of), samples=samples)[0]
    pays, rows, width = padfree_pays(lengths, plain_width, samples=samples)
    return pays and mask_bytes(rows, round_up(width, pad_to_multiple_of), mask_dtype, queries) <= MAX_PACKED_MASK_BYTES


def padfree_layout(prompt_lens: Sequence[int], completion_lens: Sequence[int], plain_width: int,
                   mask_dtype: torch.dtype | None, queries: torch.dtype, *, prompts: Sequence | None = None,
                   pad_to_multiple_of: int | None = None, hidden_size: int = 4096
                   ) -> tuple[bool, list[list[int]] | None]:
    """The padding-free decision of one micro batch, the same in the update, the log-prob passes and the critic:
    whether its rows run (:func:`padfree_fits`), and in units of a shared prompt (``prompts`` given: the
    shared-prompt layout is allowed; :func:`choose_units`) or one sample each (None; always under varlen
    attention, ``mask_dtype`` None, which separates sequences only)."""
    units = None
    if prompts is not None and len(prompts) > 1 and mask_dtype is not None:
        units = choose_units(prompt_lens, completion_lens, shared_units(prompts), hidden_size)
    lengths = (unit_lengths(prompt_lens, completion_lens, units) if units is not None
               else [p + n for p, n in zip(prompt_lens, completion_lens)])
    fits = padfree_fits(lengths, plain_width, mask_dtype, queries, pad_to_multiple_of, samples=len(prompt_lens))
    return fits, units


def prefix_lengths(mask: Tensor) -> Tensor | None:
    """``[B]`` lengths of right-padded rows of ``mask`` ``[B, C]`` (1: a real token), or None when a row has a hole
    (a masked token before a real one: the sequence is not its first ``n`` tokens)."""
    lengths = mask.sum(-1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    return lengths if torch.equal(prefix, mask.bool()) else None


def unpad(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_len: Tensor
          ) -> tuple[list[Tensor], list[Tensor]]:
    """TRL's padded layout (``prompt_ids``/``prompt_mask`` ``[B, P]`` left-padded, ``completion_ids`` ``[B, C]``
    right-padded, ``completion_len`` ``[B]`` each completion's length, tool results inside it included) as each
    sample's real prompt and completion tokens (views: of one tensor of the prompts' tokens, of ``completion_ids``).
    One host sync in all (the lengths), none per sample: the prompts' kept tokens are gathered in one go (the
    ``k``-th kept token where the running count of kept tokens reaches ``k + 1``)."""
    batch = prompt_ids.shape[0]
    rows_keep = prompt_mask.bool()
    keep = rows_keep.reshape(-1)
    counts = torch.cat([rows_keep.sum(-1), completion_len.reshape(-1).to(device=keep.device, dtype=torch.long)]
                       ).tolist()
    p_lens, c_lens = counts[:batch], counts[batch:]
    kept = keep.long().cumsum(0)
    where = torch.searchsorted(kept, torch.arange(1, sum(p_lens) + 1, device=keep.device))
    prompts = list(prompt_ids.reshape(-1)[where].split(p_lens))
    completions = [ids[:n] for ids, n in zip(completion_ids, c_lens, strict=True)]
    return prompts, completions


def workload(length: int, hidden_size: int = 4096) -> float:
    """A sample's training work, in attention-pair units: its linear layers (``6 x hidden`` per token, the ratio of
    a decoder layer's matmul FLOPs per token, ~24 h^2, to its attention FLOPs per query-key pair, ~4 h) plus its
    causal pairs."""
    return 6.0 * hidden_size * length + length * (length + 1) / 2


def balanced_parts(weights: Sequence[float], k: int) -> list[list[int]]:
    """Indices into ``k`` parts of even total weight: longest processing time first (each item, heaviest first, to
    the lightest part; ties by part index), every part non-empty when there are at least ``k`` items. Each part's
    indices are sorted."""
    if k < 1:
        raise ValueError(f"balanced_parts: k={k} must be >= 1.")
    heap = [(0.0, 0, p) for p in range(k)]  # (load, items, part)
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + weights[i], count + 1, p))
    return [sorted(p) for p in parts]


def budget_count(lengths: Sequence[int], budget: int) -> int:
    """How many micro batches a rank's samples need so that each holds at most ``budget`` real tokens (first-fit
    decreasing; at least one). A sample longer than the budget is an error naming the option."""
    if not lengths:
        return 1
    longest = max(lengths)
    if longest > budget:
        raise ValueError(f"ppo_max_token_len_per_device={budget} is below the longest sample ({longest} tokens, prompt "
                         f"+ completion); every sample must fit one micro batch: use at least {longest} (e.g. "
                         "max_prompt_length + max_completion_length).")
    return len(row_bins(lengths, budget))


def budgeted_parts(lengths: Sequence[int], budget: int, count: int, hidden_size: int = 4096, *,
                   padded: bool = False, varlen: bool = False) -> list[list[int]]:
    """A rank's samples in exactly ``count`` non-empty micro batches (``count``: the largest :func:`budget_count`
    over the data-parallel ranks, so that every rank runs as many forwards; at most ``len(lengths)``) of even work
    (:func:`balanced_parts` on :func:`workload`). Where evening the work breaks the budget, the parts of first-fit
    decreasing, the most populous split until there are ``count``. ``padded``: a micro batch costs its samples times
    its longest (the padded layout, :func:`padded_budget_parts`) instead of its real tokens. ``varlen``: the rows
    run varlen attention (each sample's pairs only), so no runs of neighbouring lengths are needed to keep short
    samples out of long rows' masks."""
    if not 1 <= count <= max(len(lengths), 1):
        raise ValueError(f"budgeted_parts: count={count} must be between 1 and the {len(lengths)} samples.")
    if padded:
        return split_to(padded_budget_parts(lengths, budget), count)
    runs = None if varlen else length_runs(lengths, budget, count, hidden_size)
    if runs is not None:
        return runs
    parts = balanced_parts([workload(n, hidden_size) for n in lengths], count)
    if all(sum(lengths[i] for i in p) <= budget for p in parts):
        return parts
    return split_to([sorted(b) for b in row_bins(lengths, budget)], count)


def rows_cost(lengths: Sequence[int], hidden_size: int = 4096) -> float:
    """The work of one padding-free micro batch (attention-pair units, as :func:`workload`): its real tokens'
    linear layers, and the attention of its rows, each as long as its longest sample, which SDPA under a block mask
    computes in full (``rows x L (L + 1) / 2`` pairs, rows by :func:`row_bins`)."""
    if not lengths:
        return 0.0
    width = max(lengths)
    return 6.0 * hidden_size * sum(lengths) + len(row_bins(lengths, width)) * width * (width + 1) / 2


def length_runs(lengths: Sequence[int], budget: int, count: int, hidden_size: int = 4096) -> list[list[int]] | None:
    """``count`` micro batches of samples of neighbouring lengths (runs of the samples sorted longest first), each
    within ``budget`` real tokens, the most expensive as cheap as possible (:func:`rows_cost`, binary search over
    the bound with a greedy fill): a long-tailed batch's short samples then share short rows instead of filling the
    rows of its longest (whose attention a block mask pays in full). None where runs cannot meet the budget in
    ``count`` parts (first-fit decreasing packs tighter: the caller falls back to it)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    linear = 6.0 * hidden_size

    def fill(bound: float) -> list[list[int]] | None:
        parts: list[list[int]] = []
        rooms: list[int] = []  # the current part's rows' free tokens (first-fit, longest first: its row_bins)
        width = tokens = 0
        for i in order:
            n = lengths[i]
            if parts:
                fits = next((r for r, left in enumerate(rooms) if n <= left), None)
                rows = len(rooms) + (fits is None)
                if tokens + n <= budget and linear * (tokens + n) + rows * width * (width + 1) / 2 <= bound:
                    parts[-1].append(i)
                    tokens += n
                    if fits is None:
                        rooms.append(width - n)
                    else:
                        rooms[fits] -= n
                    continue
            if len(parts) == count:
                return None
            parts.append([i])
            width, tokens, rooms = n, n, [0]
        return parts

    high = rows_cost(lengths, hidden_size) + 1.0
    best = fill(high)
    if best is None:  # runs need more than count parts under the budget
        return None
    low = max(rows_cost([n], hidden_size) for n in lengths)
    for _ in range(40):  # bisection on the bound
        if high - low <= 1e-6 * high:
            break
        mid = (low + high) / 2
        found = fill(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    return split_to(best, count)


def padded_budget_parts(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Samples in micro batches whose padded size (samples x the longest) is at most ``budget``: longest first, each
    micro batch takes the next samples while they fit (neighbours in length, so little padding). A sample longer
    than the budget is an error naming the option (:func:`budget_count`)."""
    budget_count(lengths, budget)  # the error for a sample over the budget
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return [sorted(p) for p in parts] or [[]]


def split_to(parts: list[list[int]], count: int) -> list[list[int]]:
    """``parts`` made exactly ``count`` (more than there are: the most populous split in halves, which keeps every
    part within the budget it met; fewer: the smallest merged is NOT done, the caller asks for at least as many as it
    has). Each part's indices sorted."""
    parts = [sorted(p) for p in parts if p]
    if len(parts) > count:
        raise ValueError(f"split_to: {len(parts)} parts cannot become {count}.")
    while len(parts) < count:
        big = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
        if len(parts[big]) < 2:
            raise ValueError(f"split_to: {sum(map(len, parts))} samples cannot fill {count} non-empty parts.")
        half = len(parts[big]) // 2
        parts[big], extra = parts[big][:half], parts[big][half:]
        parts.insert(big + 1, extra)
    return parts


def padded_budget_count(lengths: Sequence[int], budget: int) -> int:
    """How many padded micro batches (:func:`padded_budget_parts`) a rank's samples need under ``budget``."""
    return len(padded_budget_parts(lengths, budget)) if lengths else 1
