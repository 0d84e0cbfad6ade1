"""Token-budgeted micro batches for the policy update (verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``).

TRL's loop cuts a rank's rollout into ``steps_per_generation`` micro batches by count and takes an optimizer step
every ``gradient_accumulation_steps`` of them, each micro batch as wide as the step's longest sample. Under a token
budget the samples of one optimizer step (its ``gradient_accumulation_steps`` micro batches, pooled) are cut instead
into micro batches of at most ``budget`` tokens each (:func:`~trl_nrollout.passes.padfree.budgeted_parts`: real tokens
when the forward is padding-free, samples x the longest when it is padded), of even work, as many on every rank
(the busiest rank's count, at least one per TRL micro step), and handed to TRL's micro steps in order
(:func:`slot_sizes`); a micro step runs its micro batches one after another, each a forward and a backward, with the
gradients synchronised after the last (:class:`BudgetedStep`).

Every micro batch keeps the normalizers of its optimizer step (the loss is a sum over micro batches of per-token sums
over global counts, so the cut does not change the gradient) and each sample carries ``micro_tokens``, the tokens
of the count-based micro batch it came from, so that TRL's per-micro-batch mean (``bnpo``, ``token-mean-micro``) and
the entropy bonus normalize as they did before the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: the batch keys laid out as left-padded prompts ``[B, P]``; every other ``[B, C]`` tensor is right-padded completions
PROMPT_KEYS = ("prompt_ids", "prompt_mask")


@dataclass
class BudgetedStep:
    """One of TRL's micro steps (one ``training_step``) under a token budget: its micro batches, each a TRL batch
    dict (``prompt_ids`` ``[b, P']``, ``completion_ids`` ``[b, C']``...), run in order; gradients are synchronised
    after the last."""

    parts: list[dict[str, Any]]

    def __len__(self) -> int:
        return sum(int(p["completion_ids"].shape[0]) for p in self.parts)


def sample_lengths(batch: dict[str, Any]) -> list[int]:
    """Each sample's tokens in a forward: real prompt tokens plus its completion up to the last masked-in token
    (``[B]`` as a list). A completion whose mask is all zeros (``mask_truncated_completions``) counts its prompt."""
    prompt = batch["prompt_mask"].sum(-1)
    mask = batch["completion_mask"]
    width = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    completion = (mask.bool() * width).amax(-1) if mask.shape[1] else torch.zeros_like(prompt)
    return (prompt + completion).tolist()


def slot_sizes(count: int, slots: int) -> list[int]:
    """How many of ``count`` micro batches each of ``slots`` micro steps runs: as even as possible, at least one
    each (``count >= slots``), the extra ones on the last micro steps."""
    if count < slots or slots < 1:
        raise ValueError(f"slot_sizes: {count} micro batches cannot fill {slots} micro steps (one at least each).")
    base, extra = divmod(count, slots)
    return [base + (i >= slots - extra) for i in range(slots)]


def concat_batches(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TRL micro batches of one rollout (same widths) as one: per-sample tensors and lists concatenated, scalars
    (the normalizers, equal within an optimizer step) taken from the first."""
    out: dict[str, Any] = {}
    rows = int(batches[0]["completion_ids"].shape[0])
    for key, value in batches[0].items():
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            out[key] = torch.cat([b[key] for b in batches])
        elif isinstance(value, list) and len(value) == rows:
            out[key] = [x for b in batches for x in b[key]]
        else:
            out[key] = value
    return out


def select_rows(batch: dict[str, Any], index: Sequence[int], multiple_of: int | None = None) -> dict[str, Any]:
    """Samples ``index`` of a TRL batch, each tensor cut to the selection's own widths: prompts keep their last
    ``P'`` columns (left-padded), completions their first ``C'`` (right-padded), ``P'`` and ``C'`` the longest of
    the selection (rounded up to ``multiple_of``, TRL's ``pad_to_multiple_of``). Scalars are kept."""
    rows = int(batch["completion_ids"].shape[0])
    prompt_w, completion_w = int(batch["prompt_ids"].shape[1]), int(batch["completion_ids"].shape[1])
    idx = torch.as_tensor(list(index), dtype=torch.long, device=batch["completion_ids"].device)
    lengths_p = batch["prompt_mask"][idx].sum(-1)
    mask = batch["completion_mask"][idx]
    cols = torch.arange(1, completion_w + 1, device=mask.device)
    lengths_c = (mask.bool() * cols).amax(-1) if completion_w else torch.zeros_like(lengths_p)
    p_keep = min(prompt_w, _round_up(int(lengths_p.max()) if len(idx) else 0, multiple_of))
    c_keep = min(completion_w, _round_up(max(int(lengths_c.max()) if len(idx) else 0, 1), multiple_of))
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            value = value[idx]
            if key in PROMPT_KEYS:
                value = value[:, prompt_w - p_keep:]
            elif value.dim() >= 2 and value.shape[1] == completion_w:
                value = value[:, :c_keep]
            out[key] = value
        elif isinstance(value, list) and len(value) == rows:
            out[key] = [value[i] for i in idx.tolist()]
        else:
            out[key] = value
    return out


def with_micro_tokens(batch: dict[str, Any], tokens: Tensor) -> dict[str, Any]:
    """``batch`` with ``micro_tokens`` ``[B]``: every sample tagged with ``tokens`` (``[]``), the loss tokens of
    the count-based micro batch it belongs to."""
    rows = int(batch["completion_ids"].shape[0])
    return {**batch, "micro_tokens": tokens.to(torch.float32).reshape(()).expand(rows).clone()}


def budget_units(units: Sequence[Sequence[int]], prompt_lens: Sequence[int], completion_lens: Sequence[int],
                 budget: int) -> list[list[int]]:
    """Groups of samples sharing a prompt (:func:`~trl_nrollout.passes.padfree.shared_units`) as the items a token
    budget cuts, so that a group's samples train in one micro batch (its prompt once,
    :func:`~trl_nrollout.passes.padfree.unit_lengths`): a group over ``budget`` tokens is split, in order, into
    as few runs as fit (a sample on its own always fits: the caller checked the budget against each)."""
    from trl_nrollout.passes.padfree import unit_lengths

    out: list[list[int]] = []
    for unit in units:
        run: list[int] = []
        for b in unit:
            if run and unit_lengths(prompt_lens, completion_lens, [[*run, b]])[0] > budget:
                out.append(run)
                run = []
            run.append(b)
        out.append(run)
    return out


def full_numel(p: Tensor) -> int:
    """A parameter's elements at its full size: DeepSpeed ZeRO-3 partitions parameters as they are built
    (``zero3_init_flag``: ``deepspeed.zero.Init``), leaving each an empty local tensor and its size in ``ds_numel``
    (the weight sync reads it the same way)."""
    return int(getattr(p, "ds_numel", p.numel()))


def update_state_bytes(params: Iterable[Tensor], processes: int, sharded: bool) -> tuple[int, int]:
    """(parameters, trainer-state bytes per device) of a model's parameters: its weights in their dtype, and per
    trainable parameter gradients, float32 master weights and two Adam moments
    (:data:`~trl_nrollout.plan.cost.TRAIN_BYTES_PER_PARAM`), split over ``processes`` where ``sharded`` (ZeRO-3,
    FSDP). Parameters count at their full size (:func:`full_numel`), partitioned already or not."""
    from trl_nrollout.plan.cost import TRAIN_BYTES_PER_PARAM

    params = list(params)
    total = sum(full_numel(p) for p in params)
    trainable = sum(full_numel(p) for p in params if p.requires_grad)
    weight_bytes = params[0].element_size() if params else 2
    state = (total * weight_bytes + trainable * (TRAIN_BYTES_PER_PARAM - 2)) // (processes if sharded else 1)
    return total, state


def frozen_weight_bytes(params: Iterable[Tensor], processes: int, sharded: bool) -> int:
    """Bytes per device of frozen models' parameters (a reference model, a teacher: weights only, no gradients nor
    optimizer states, whatever their ``requires_grad``), each at its full size (:func:`full_numel`) in its dtype,
    split over ``processes`` where ``sharded`` (ZeRO-3, FSDP)."""
    total = sum(full_numel(p) * p.element_size() for p in params)
    return total // (processes if sharded else 1)


def logits_bytes_per_token(vocab_size: int, dtype_bytes: int, head_on_scored_rows: bool) -> int:
    """What a log-prob pass's logits take per token of a micro batch: nothing where the output head runs on the scored
    rows a chunk at a time (the lean path, or :class:`~trl_nrollout.passes.logprobs.ScoredHead` inside the model's
    own forward: a bounded ``[chunk_rows, V]`` block, whatever the micro batch); else ``V`` logits in the model's
    dtype and accelerate's float32 copy of them (``convert_outputs_to_fp32`` under mixed precision), ``V (b + 4)``,
    per token (conservatively every token: which ones are scored is not known when the budget is set)."""
    return 0 if head_on_scored_rows else vocab_size * (dtype_bytes + 4)


def logprob_pass_tokens(update_tokens: int, *, room_bytes: int | None, activation_bytes_per_token: int,
                        logits_bytes: int, longest_sample: int, fraction: float, rounding: int) -> int:
    """The default token budget of the log-prob passes (old policy, reference) per device, by their own bytes per
    token: the update's (``update_tokens``: ``fraction x room_bytes / activation_bytes_per_token`` tokens, the
    training activations being more than a no-grad forward holds at any time) where their logits take nothing per
    token (:func:`logits_bytes_per_token`), else ``fraction x room_bytes / (activation_bytes_per_token +
    logits_bytes)`` rounded down to ``rounding``, never above the update's nor below ``longest_sample``. ``room_bytes``
    None (a CPU: memory unknown) keeps the update's."""
    if room_bytes is None or logits_bytes <= 0:
        return update_tokens
    own = int(fraction * max(0, room_bytes) // (activation_bytes_per_token + logits_bytes)) // rounding * rounding
    return max(int(longest_sample), min(update_tokens, own))


def sync_each_micro_batch(fsdp: bool) -> bool:
    """Whether a micro batch that is not its optimizer step's last reduces its gradients anyway: under FSDP (1 or 2)
    yes, as verl does. Holding them (``no_sync`` / ``set_requires_gradient_sync(False)``) would keep every
    parameter's *unsharded* gradient (FSDP2: in the reduce dtype) until the step's last backward, the whole model's
    gradients on every device, which neither the default token budget nor ``trl-nrollout plan`` counts (Qwen2.5-14B
    on 8 x H100: 87 GB at the second micro batch); reduce-scattering each micro batch keeps the shard only, at the
    cost of one reduce-scatter per micro batch. DDP and DeepSpeed hold them as before (their accumulated gradients
    are the size they always are)."""
    return bool(fsdp)


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple and multiple > 1 else n


def pack_by_tokens(lengths: Sequence[int], max_token_len: int, max_seqs: int | None = None) -> list[list[int]]:
    """Group sequence indices into micro batches whose padded size ``len(batch) * max(length)`` fits
    ``max_token_len`` (first-fit decreasing); ``max_seqs`` also caps the sequences per micro batch. A sequence
    alone over ``max_token_len`` is a ``ValueError`` naming the option."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > max_token_len:
        raise ValueError(
            f"log_prob_max_token_len_per_device={max_token_len} is smaller than the longest sequence "
            f"({lengths[order[0]]} tokens, prompt + completion); every sequence must fit one forward: use "
            f"at least {lengths[order[0]]} (e.g. max_prompt_length + max_completion_length)."
        )
    bins: list[list[int]] = []
    widths: list[int] = []  # longest sequence of each bin (its first, as we go in decreasing order)
    for i in order:
        for b, members in enumerate(bins):
            if (max_seqs is None or len(members) < max_seqs) and (len(members) + 1) * widths[b] <= max_token_len:
                members.append(i)
                break
        else:
            bins.append([i])
            widths.append(lengths[i])
    return bins


def split_by_count(num: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro batches of at most ``micro_batch_size`` indices covering ``range(num)``."""
    return [list(range(s, min(s + micro_batch_size, num))) for s in range(0, num, micro_batch_size)]
