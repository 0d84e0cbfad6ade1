"""Shared-prompt packing: the training forward runs each prompt once for all of its samples in a micro batch.

GRPO's n samples of a prompt repeat the prompt n times; with long prompts and short completions the training
forward and backward spend nearly all their tokens on those copies. :func:`pack_shared_prompts` lays out a micro
batch as one row per distinct prompt::

    [prompt[:-1] | prompt[-1] c1[0] ... c1[C-1] | prompt[-1] c2[0] ... c2[C-1] | ...]

Every segment starts with its own copy of the prompt's last token (the position that predicts the completion's
first token), carries the positions the completion has in its own sequence, and attends to the shared prompt and
to itself only (a 4D mask). The per-token log-probs of each completion are then those of the unpacked batch,
computed over ``prompts x (P + K x (C + 1))`` tokens instead of ``samples x (P + C)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trl_nrollout.plan.packing_rules import (  # noqa: F401  (re-exported: the trainer's names)
    MAX_PACKED_MASK_BYTES,
    mask_bytes_of,
    packed_length,
    packing_pays,
)


@dataclass
class PackedBatch:
    """One micro batch in the packed layout (G distinct prompts, K segments per row, row length L).

    - ``input_ids``, ``position_ids``, ``shift_labels``: ``[G, L]``; ``shift_labels[g, t]`` is the token that
      position ``t`` predicts (``-100`` where nothing is scored), TRL's fused LM head's ``shift_labels``.
    - ``attention_mask``: ``[G, 1, L, L]``: boolean (True where a query may attend) or additive (0 there, the
      dtype's minimum elsewhere), as :func:`mask_dtype` chose.
    - ``index``: ``[B, C]`` flat positions into ``[G * L]``: sample ``b``'s token ``j`` is scored at ``index[b, j]``.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    shift_labels: Tensor
    index: Tensor

    def gather(self, per_position: Tensor) -> Tensor:
        """``[G, L]`` per-position values (log-probs, entropies) -> ``[B, C]`` per completion token."""
        return per_position.reshape(-1)[self.index]


def _distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Distinct prompts ``[G, P]`` and each row's prompt ``[B]``. Padding is compared as padding (-1 where the
    mask is 0), so a prompt that starts with the pad token's id is never taken for a shorter one."""
    keys = prompt_ids if prompt_mask is None else prompt_ids.masked_fill(prompt_mask == 0, -1)
    return torch.unique(keys, dim=0, return_inverse=True)


def packed_shape(prompt_ids: Tensor, completion_ids: Tensor, prompt_mask: Tensor | None = None) -> tuple[int, int]:
    """Rows ``G`` and row length ``L`` of the packed layout of a micro batch (its block mask is ``G x L x L``):
    ``prompt_ids [B, P]`` (``prompt_mask``: its padding), ``completion_ids [B, C]``."""
    rows, inverse = _distinct_prompts(prompt_ids, prompt_mask)
    k = int(torch.bincount(inverse).max())
    return rows.shape[0], packed_length(prompt_ids.shape[1], k, completion_ids.shape[1])


def _attention(config) -> str:
    """The model's attention implementation (transformers' default, SDPA, when the config does not say; under
    Ulysses the one it wraps: :func:`~trl_nrollout.passes.varlen.attention_of`)."""
    from trl_nrollout.passes.varlen import attention_of

    return attention_of(config)


def structural_reason(config, *, images: bool = False, aux_loss: bool = False, varlen: bool = False) -> str | None:
    """Why a model cannot take the packed layout at all (None: it can). ``config``: the model's config. ``varlen``:
    rows that separate their sequences by boundaries are enough (padding-free rows), so flash-attention's varlen
    kernels serve too (:data:`~trl_nrollout.passes.varlen.VARLEN_ATTENTION`)."""
    from trl_nrollout.passes.varlen import VARLEN_ATTENTION

    layers = getattr(config, "layer_types", None) or ["full_attention"]
    attn = _attention(config)
    if images:
        return "the prompts hold images (a vision-language model places its own positions)"
    if aux_loss:
        return "the MoE router loss counts every token of the plain layout"
    if varlen and attn in VARLEN_ATTENTION:
        pass
    elif attn not in ("sdpa", "eager"):
        return (f"attn_implementation={attn!r} ignores a 4D block mask (use 'sdpa' or 'eager'"
                + (", or a varlen attention: " + ", ".join(repr(a) for a in VARLEN_ATTENTION) if varlen else "")
                + ")")
    # a configured window is applied unless the config switches it off: Mistral-v0.1 and Phi-3 apply theirs from
    # `sliding_window` alone (no layer_types, no use_sliding_window); Qwen2 nulls it when use_sliding_window=False
    window = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if any(t != "full_attention" for t in layers) or window:
        return "the model has sliding-window layers"
    return None


def round_up(width: int, multiple_of: int | None) -> int:
    """``width`` rounded up to a multiple of ``multiple_of`` (None or 1: unchanged)."""
    if not multiple_of or multiple_of <= 1:
        return width
    return -(-width // multiple_of) * multiple_of



def pad_samples(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_token_id: int,
                device: torch.device | str = "cpu", multiple_of: int | None = None,
                logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, Tensor]:
    """TRL's layout of ``B`` samples' token lists: ``prompt_ids`` / ``prompt_mask`` left-padded ``[B, P]``,
    ``completion_ids`` / ``completion_mask`` right-padded ``[B, C]``, and ``logprobs`` ``[B, C]`` (float32, 0 past
    each completion's given log-probs; all 0 without ``logprobs``). ``P`` and ``C`` are the longest prompt and
    completion rounded up to a multiple of ``multiple_of`` (TRL's ``pad_to_multiple_of``). The critic's value pass
    pads with it; :meth:`~trl_nrollout.rollout.types.RolloutBatch.padded` is the same layout of a rollout."""
    b = len(prompts)
    logprobs = [[] for _ in range(b)] if logprobs is None else logprobs
    p_max = round_up(max((len(p) for p in prompts), default=0), multiple_of)
    c_max = round_up(max((len(c) for c in completions), default=0), multiple_of)
    prompt = torch.full((b, p_max), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, p_max, dtype=torch.long)
    comp = torch.full((b, c_max), pad_token_id, dtype=torch.long)
    comp_mask = torch.zeros(b, c_max, dtype=torch.long)
    lp = torch.zeros(b, c_max, dtype=torch.float32)
    for i, (p, c, lps) in enumerate(zip(prompts, completions, logprobs)):
        if p:
            prompt[i, p_max - len(p):] = torch.tensor(p)
            prompt_mask[i, p_max - len(p):] = 1
        if c:
            comp[i, :len(c)] = torch.tensor(c)
            comp_mask[i, :len(c)] = 1
            lp[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    out = {"prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": comp,
           "completion_mask": comp_mask, "logprobs": lp}
    return {k: v.to(device) for k, v in out.items()}

def mask_dtype(config, weights_dtype: torch.dtype) -> torch.dtype:
    """The packed mask's dtype for a model: boolean under SDPA (True: may attend; PyTorch turns it into the
    queries' dtype itself, whatever the mixed-precision setup, e.g. FSDP2's bf16 compute over float32 weights),
    additive in the weights' dtype under eager attention (which adds the mask to its scores)."""
    return torch.bool if _attention(config) == "sdpa" else weights_dtype


def query_dtype(weights_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype attention's queries will have: autocast's where it is on for ``device_type``, else the weights'."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weights_dtype


def mask_bytes(groups: int, length: int, dtype: torch.dtype, queries: torch.dtype = torch.float32) -> int:
    """Peak bytes of a packed micro batch's block mask ``[G, 1, L, L]`` in ``dtype``
    (:func:`~trl_nrollout.plan.packing_rules.mask_bytes_of`): a boolean mask under SDPA with its copies in the
    queries' dtype ``queries``, an additive mask alone."""
    def size(dt: torch.dtype) -> int:
        return torch.empty((), dtype=dt).element_size()

    return mask_bytes_of(groups, length, size(dtype), size(queries) if dtype == torch.bool else None)

def decide(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, plain_width: int,
           dtype: torch.dtype, queries: torch.dtype = torch.float32) -> tuple[bool, str | None]:
    """Whether to pack a micro batch (``prompt_ids``/``prompt_mask`` ``[B, P]`` left-padded, ``completion_ids``
    ``[B, C]``; its plain rows are ``plain_width`` tokens; ``dtype``: the mask's, ``queries``: attention's), and,
    when it would pay but cannot, why (to be said)."""
    groups, length = packed_shape(prompt_ids, completion_ids, prompt_mask)
    if not packing_pays(prompt_ids.shape[0], plain_width, groups, length):
        return False, None  # it shares too little: the plain forward is as cheap
    size = mask_bytes(groups, length, dtype, queries)
    if size > MAX_PACKED_MASK_BYTES:  # long completions x many samples: one row's L x L mask
        return False, (f"a micro batch's block mask would take {size / 2**20:.0f} MiB (over "
                       f"{MAX_PACKED_MASK_BYTES >> 20} MiB; long completions or many samples per prompt)")
    return True, None


def pack_shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, pad_token_id: int,
                        dtype: torch.dtype = torch.float32, pad_to_multiple_of: int | None = None) -> PackedBatch:
    """Pack a micro batch whose rows share prompts.

    Args:
        prompt_ids, prompt_mask: ``[B, P]``, left-padded (TRL's layout: the last column is each prompt's last token).
        completion_ids: ``[B, C]``, right-padded (padding is packed too and scored, as in the plain layout; the loss
            mask drops it).
        pad_token_id: filler of the rows with fewer segments than the longest.
        dtype: ``torch.bool`` for a boolean mask, or the dtype of an additive one (see :func:`mask_dtype`).
        pad_to_multiple_of: the packed length ``L`` is rounded up to a multiple of it (TRL's option); the extra
            columns are padding no query attends to.
    """
    device = prompt_ids.device
    batch, width = prompt_ids.shape
    c = completion_ids.shape[1]
    rows, inverse = _distinct_prompts(prompt_ids, prompt_mask)
    rows = rows.clamp(min=0)  # padding (-1) becomes token 0: masked out, never attended to
    groups = rows.shape[0]
    counts = torch.bincount(inverse, minlength=groups)
    k_max = int(counts.max())
    seg_len = c + 1
    length = round_up(width - 1 + k_max * seg_len, pad_to_multiple_of)
    # each sample's slot within its prompt's row, in batch order (counted on the host: one transfer, not one per row)
    seen = [0] * groups
    slots = []
    for g in inverse.tolist():
        slots.append(seen[g])
        seen[g] += 1
    slot = torch.tensor(slots, dtype=torch.long, device=device)
    row_mask = torch.zeros(groups, width, dtype=prompt_mask.dtype, device=device)
    row_mask[inverse] = prompt_mask
    prompt_len = row_mask.sum(-1)  # [G]

    input_ids = torch.full((groups, length), pad_token_id, dtype=prompt_ids.dtype, device=device)
    input_ids[:, :width - 1] = rows[:, :-1]
    position_ids = torch.zeros(groups, length, dtype=torch.long, device=device)
    position_ids[:, :width - 1] = (row_mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
    shift_labels = torch.full((groups, length), -100, dtype=torch.long, device=device)
    segment = torch.full((groups, length), -1, dtype=torch.long, device=device)  # -1: the shared prompt
    key_ok = torch.zeros(groups, length, dtype=torch.bool, device=device)
    key_ok[:, :width - 1] = row_mask[:, :-1].bool()
    seg_pos = prompt_len[:, None] - 1 + torch.arange(seg_len, device=device)  # [G, C + 1]
    for s in range(k_max):
        start = width - 1 + s * seg_len
        span = slice(start, start + seg_len)
        input_ids[:, start] = rows[:, -1]
        position_ids[:, span] = seg_pos
        segment[:, span] = s
        key_ok[:, span] = (counts > s)[:, None]
    # sample b's segment starts at (width - 1 + slot * (C + 1)) of its row; its tokens follow the copied last token
    starts = inverse * length + width - 1 + slot * seg_len  # [B], flat
    index = starts[:, None] + torch.arange(c, device=device)  # [B, C]
    input_ids.view(-1)[index + 1] = completion_ids
    shift_labels.view(-1)[index] = completion_ids

    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    allowed = causal & key_ok[:, None, :] & ((k_seg == -1) | (k_seg == q_seg))
    allowed |= torch.eye(length, dtype=torch.bool, device=device)  # padding queries see themselves: no NaN rows
    if dtype == torch.bool:
        return PackedBatch(input_ids, position_ids, allowed[:, None], shift_labels, index)
    mask = torch.zeros(groups, 1, length, length, dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return PackedBatch(input_ids, position_ids, mask, shift_labels, index)
