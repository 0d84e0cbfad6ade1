"""The critic (value model) of PPO: a causal LM with a scalar head, its forward and its micro-batched value pass.

The critic is ``AutoModelForTokenClassification`` with one label (verl's choice): the model's decoder with a
linear ``score`` head on every position. The value of the state before completion token ``j`` is the head's output
at the position that predicts that token (the last prompt token for ``j = 0``), so values line up with the policy's
log-probs ``[B, C]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from trl_nrollout.passes.distributed import is_zero3, synced_count
from trl_nrollout.passes.logprobs import pack_by_tokens, split_by_count, unwrap_model
from trl_nrollout.passes.packing import pad_samples, query_dtype
from trl_nrollout.passes.padfree import (
    budget_count,
    budgeted_parts,
    pack_rows,
    padfree_layout,
    prefix_lengths,
    rows_attention,
    rows_mask_dtype,
    unpad,
)
from trl_nrollout.passes.ulysses import (
    SPGroup,
    gather_sequence,
    inner_for_rows,
    install,
    shard_rows,
    sp_multiple,
)


def build_critic(name_or_path: str, *, seed: int = 0, dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False) -> nn.Module:
    """The critic initialized from ``name_or_path`` (a policy or reward model): its weights, and a fresh scalar
    ``score`` head drawn from ``seed`` (the same on every rank). A reward model's own head is kept."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from trl_nrollout.builtin import resolve_model

    path = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config.num_labels = 1
    # the token-classification head applies dropout (0.1 by default) in train mode: values would be noisy and
    # differ between processes; verl's critic sets it to 0 too
    config.classifier_dropout = 0.0
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head's "missing weights" report is expected, not a problem
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = AutoModelForTokenClassification.from_pretrained(
                path, config=config, trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True,
                **({"dtype": dtype} if dtype is not None else {}))
    finally:
        hf_logging.set_verbosity(verbosity)
    if getattr(critic.config, "pad_token_id", None) is None:
        critic.config.pad_token_id = getattr(config, "eos_token_id", None)
    return critic


def critic_values(critic: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                  completion_mask: Tensor, *, padding_free: bool = False, pad_token_id: int = 0,
                  pad_to_multiple_of: int | None = None, shared_prompts: bool = True,
                  sequence_parallel: SPGroup | None = None) -> Tensor:
    """Values ``[B, C]`` of a left-padded prompt batch ``[B, P]`` followed by right-padded completions ``[B, C]``
    (TRL's layout), with gradient; positions count from each sequence's first real token.

    ``padding_free``: the real tokens in padding-free rows (:func:`~trl_nrollout.passes.padfree.pack_rows`, a
    block-diagonal mask: same values) wherever that saves a tenth of the slots, a group's prompt once where
    ``shared_prompts`` allows and it pays (:func:`~trl_nrollout.passes.padfree.padfree_layout`); 0 past each
    completion's end.

    ``sequence_parallel`` (a Ulysses group of S > 1 ranks holding the same samples): padding-free rows split over the
    group (:func:`sharded_values`), each rank's shard through the critic, the values gathered (every rank of the
    group returns the whole ``[B, C]``; the backward keeps the rank's own shard's part)."""
    if sequence_parallel is not None and sequence_parallel.size > 1:
        return sharded_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask, pad_token_id,
                              pad_to_multiple_of, sequence_parallel)
    if padding_free:
        values = _padfree_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask, pad_token_id,
                                 pad_to_multiple_of, shared_prompts)
        if values is not None:
            return values
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    width, c = prompt_ids.shape[1], completion_ids.shape[1]
    return out.logits[:, width - 1:width - 1 + c, 0].float()


def _padfree_values(critic: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                    completion_mask: Tensor, pad_token_id: int, pad_to_multiple_of: int | None,
                    shared_prompts: bool = True) -> Tensor | None:
    """:func:`critic_values` from padding-free rows, or None where the padded forward runs (masked holes in a
    completion, too little padding to save, a mask over its bound)."""
    completion_len = prefix_lengths(completion_mask)
    if completion_len is None:
        return None
    prompts, completions = unpad(prompt_ids, prompt_mask, completion_ids, completion_len)
    if not prompts:
        return None
    inner = unwrap_model(critic)
    weights = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    queries = query_dtype(weights, prompt_ids.device.type)
    dtype = rows_mask_dtype(inner.config, weights, queries, prompt_ids.device.type)  # None: varlen attention
    fits, units = padfree_layout([p.numel() for p in prompts], completion_len.tolist(),
                                 prompt_ids.shape[1] + completion_ids.shape[1], dtype, queries,
                                 prompts=prompts if shared_prompts else None, pad_to_multiple_of=pad_to_multiple_of,
                                 hidden_size=getattr(inner.config, "hidden_size", None) or 4096)
    if not fits:
        return None
    pk = pack_rows(prompts, completions, pad_token_id, mask_dtype=dtype, pad_to_multiple_of=pad_to_multiple_of,
                   completion_width=completion_ids.shape[1], units=units)
    with rows_attention(inner.config, pk):
        out = critic(input_ids=pk.input_ids, **pk.forward_kwargs())
    return pk.gather(out.logits[..., 0].float())


def sharded_values(critic: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                   completion_mask: Tensor, pad_token_id: int, pad_to_multiple_of: int | None, sp: SPGroup) -> Tensor:
    """:func:`critic_values` with the padding-free rows split over the Ulysses group ``sp``: each rank runs its
    ``1/S`` of every row's tokens through the critic (attention exchanging heads for sequence,
    :mod:`~trl_nrollout.passes.ulysses`), and the group's shards are gathered into the whole ``[B, C]``."""
    completion_len = prefix_lengths(completion_mask)
    if completion_len is None:
        raise ValueError(f"sequence_parallel_size={sp.size}: a completion mask with holes cannot be laid out as "
                         "padding-free rows for the critic; use sequence_parallel_size=1.")
    prompts, completions = unpad(prompt_ids, prompt_mask, completion_ids, completion_len)
    inner = unwrap_model(critic)
    install(inner)
    weights = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    dtype = rows_mask_dtype(inner.config, weights, query_dtype(weights, prompt_ids.device.type),
                            prompt_ids.device.type)  # None: varlen attention
    pk = pack_rows(prompts, completions, pad_token_id, mask_dtype=dtype,
                   pad_to_multiple_of=sp_multiple(pad_to_multiple_of, sp.size), completion_width=completion_ids.shape[1])
    shard = shard_rows(pk, sp, inner_for_rows(inner.config, pk))
    out = critic(input_ids=shard.input_ids, **shard.forward_kwargs())
    return pk.gather(gather_sequence(out.logits[..., 0].float(), sp))


def pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_token_id: int,
              device: torch.device | str = "cpu", multiple_of: int | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """TRL's layout of token lists (:func:`~trl_nrollout.passes.packing.pad_samples`): prompts left-padded
    ``[B, P]``, completions right-padded ``[B, C]`` (both widths rounded up to ``multiple_of``, TRL's
    ``pad_to_multiple_of``), and their masks."""
    t = pad_samples([list(p) for p in prompts], [list(c) for c in completions], pad_token_id, device, multiple_of)
    return t["prompt_ids"], t["prompt_mask"], t["completion_ids"], t["completion_mask"]


@torch.no_grad()
def compute_values(critic: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                   pad_token_id: int, micro_batch_size: int | None = None, max_token_len: int | None = None,
                   device: torch.device | str | None = None, sync_forwards: bool | None = None,
                   pad_to_multiple_of: int | None = None, padding_free: bool = False, shared_prompts: bool = True,
                   sequence_parallel: SPGroup | None = None) -> Tensor:
    """The critic's values ``[B, C_max]`` of every completion token (0 past a completion's end), in input order,
    micro-batched like the log-prob passes (``micro_batch_size`` sequences, or a ``max_token_len`` budget). The
    critic is put in eval mode for the pass and its mode restored. Under ZeRO-3 (detected, or ``sync_forwards``)
    every rank runs as many forwards as the busiest one. Every rank must call it, even with no samples.
    ``pad_to_multiple_of``: each forward's widths rounded up to a multiple of it (TRL's option).
    ``padding_free``: forwards in padding-free rows (:func:`critic_values`); with ``max_token_len`` and no
    ``micro_batch_size`` the budget then counts real tokens, micro batches of even work
    (:func:`~trl_nrollout.passes.padfree.budgeted_parts`), as the log-prob passes. ``sequence_parallel``: each
    forward's rows split over the Ulysses group (:func:`sharded_values`), the budget per device (a group's micro
    batch holds S times it)."""
    sp = sequence_parallel if sequence_parallel is not None and sequence_parallel.size > 1 else None
    if sp is not None and max_token_len is not None:
        max_token_len *= sp.size
    b = len(prompts)
    c_max = max((len(c) for c in completions), default=0)
    inner = unwrap_model(critic)
    device = device or next(inner.parameters()).device
    values = torch.zeros(b, c_max, device=device)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    budgeted = padding_free and max_token_len is not None and micro_batch_size is None
    if b == 0 or c_max == 0:
        batches = []
    elif budgeted:
        batches = [list(range(b))] * budget_count(lengths, max_token_len)  # placeholders: the count is synced first
    elif max_token_len is not None:
        batches = pack_by_tokens(lengths, max_token_len, micro_batch_size)
    else:
        batches = split_by_count(b, micro_batch_size or b)
    sync = is_zero3(inner) if sync_forwards is None else sync_forwards
    forwards = synced_count(len(batches), device, sync)
    if budgeted and batches:  # as many micro batches as the busiest rank (up to this rank's samples), even work
        hidden = getattr(inner.config, "hidden_size", None) or 4096
        batches = budgeted_parts(lengths, max_token_len, min(forwards, b), hidden)
    was_training = inner.training
    inner.eval()
    try:
        for idx in batches:
            tensors = pad_batch([prompts[i] for i in idx], [completions[i] for i in idx], pad_token_id, device,
                                pad_to_multiple_of)
            v = (critic_values(critic, *tensors, padding_free=padding_free, pad_token_id=pad_token_id,
                               pad_to_multiple_of=pad_to_multiple_of, shared_prompts=shared_prompts,
                               sequence_parallel=sp) * tensors[3])[:, :c_max]
            values[torch.as_tensor(idx, device=device), :v.shape[1]] = v
        for _ in range(forwards - len(batches)):  # keep ZeRO-3's collectives in step with busier ranks
            critic_values(critic, *pad_batch([[pad_token_id]], [[pad_token_id]], pad_token_id, device,
                                             pad_to_multiple_of), sequence_parallel=sp)
    finally:
        inner.train(was_training)
    return values
