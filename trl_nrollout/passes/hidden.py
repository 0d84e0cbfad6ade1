"""The final hidden states at the completion positions, by the log-prob passes' machinery (the distillation drop-in's
teacher pass).

TRL's ``DistillationTrainer`` runs its teacher's backbone over the padded micro batch (left-padded prompts, right-padded
completions) and projects the hidden states through the teacher's head a chunk of tokens at a time inside its
generalized JSD. :func:`completion_hidden_states` gives the same ``[B, C, H]`` hidden states as the reference pass
lays out its forwards (:mod:`trl_nrollout.passes.logprobs`): under a token budget (real tokens per forward when
padding-free, first-fit decreasing; as many forwards on every rank as the busiest needs under ZeRO-3 / FSDP), as
padding-free rows where they save a tenth of the slots, each sequence with its own positions. Only hidden states are
returned (``H`` wide, not ``V``): the divergence projects them chunk by chunk, so no ``[tokens, vocab]`` block of the
whole batch is ever held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trl_nrollout.passes.budget import pack_by_tokens
from trl_nrollout.passes.distributed import is_fsdp, is_zero3, synced_count
from trl_nrollout.passes.logprobs import _lean_parts, completion_features, completion_positions, unwrap_model
from trl_nrollout.passes.packing import round_up
from trl_nrollout.passes.padfree import budget_count, budgeted_parts


@dataclass
class HiddenOutput:
    """``hidden`` ``[B, C, H]``: the decoder's last hidden state at the position predicting each completion token
    (right-aligned with right-padded completions, zero past each completion's end); ``num_forwards``: the forwards
    run (fillers included); ``micro_batches``: the sample indices of each real forward."""

    hidden: Tensor
    num_forwards: int
    micro_batches: list[list[int]]


def lean_parts(model: nn.Module, *, in_forward: bool = False) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, output head) of ``model`` (wrappers stripped) when its logits are a plain head over its decoder (no
    soft-capping, no logit scale); None otherwise (then the model's own forward must run). An FSDP-wrapped model
    (FSDP1 or FSDP2) only ``in_forward``: when the caller runs inside the model's own forward, whose hooks have
    gathered the root's parameters (the embeddings, the final norm) and whose layers gather theirs as they are
    called, as TRL's ``_forward_redirection`` runs its teacher's backbone; outside it they are shards."""
    inner = unwrap_model(model)
    return None if is_fsdp(inner) and not in_forward else _lean_parts(inner)


@torch.no_grad()
def completion_hidden_states(model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                             *, max_token_len: int | None = None, pad_token_id: int = 0, padding_free: bool = False,
                             pad_to_multiple_of: int | None = None, sync_forwards: bool | None = None,
                             in_forward: bool = False) -> HiddenOutput:
    """The decoder's last hidden states at the completion positions of each sample ``[B, C_max, H]``.

    - ``prompts[i]``, ``completions[i]``: real token ids (no padding) of sample ``i``; every prompt non-empty.
    - ``max_token_len``: token budget per forward (real tokens when ``padding_free``, else samples x the longest);
      None: one forward for all samples.
    - ``padding_free``: lay a forward's samples end to end in rows (:mod:`~trl_nrollout.passes.padfree`) where that
      saves a tenth of its slots; the caller vouches that the model takes a block mask or varlen boundaries.
    - ``sync_forwards``: every rank runs as many forwards as the busiest (default: under ZeRO-3 or FSDP).
    - ``in_forward``: the caller runs this inside ``model``'s own forward (needed for an FSDP-wrapped model, see
      :func:`lean_parts`); the decoder then runs once per micro batch, its FSDP layers gathering their parameters
      in each (every rank as many times: ``sync_forwards``).

    ``model`` must have a plain head over its decoder (:func:`lean_parts`); it is put in eval mode and restored."""
    prompts = [list(p) for p in prompts]
    completions = [list(c) for c in completions]
    inner = unwrap_model(model)
    parts = lean_parts(inner, in_forward=in_forward)
    if parts is None:
        raise ValueError("completion_hidden_states needs a causal LM whose logits are a plain head over its decoder "
                         "(no soft-capping or logit scale; FSDP-wrapped only when called inside the model's own "
                         "forward, in_forward=True); run the model's own forward instead.")
    if not prompts or len(prompts) != len(completions) or any(len(p) == 0 for p in prompts):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions: they must pair up (at least "
                         "one), and every prompt needs a token before its completion.")
    b = len(prompts)
    c_max = max((len(c) for c in completions), default=0)
    device = next(inner.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    if sync_forwards is None:
        sync_forwards = is_zero3(inner) or is_fsdp(inner)
    if padding_free and max_token_len is not None:  # even work per forward, as many as the busiest rank needs
        count = synced_count(budget_count(lengths, max_token_len), device, sync_forwards)
        config = getattr(inner, "config", None)
        width = getattr(config.get_text_config() if config is not None else None, "hidden_size", None) or 4096
        batches = budgeted_parts(lengths, max_token_len, min(count, b), width)
    else:
        batches = pack_by_tokens(lengths, max_token_len) if max_token_len is not None else [list(range(b))]
        count = synced_count(len(batches), device, sync_forwards)
    out: Tensor | None = None
    was_training = inner.training
    inner.eval()
    try:
        for idx in batches:
            rows, cols, feats = _micro_batch(model, parts, [prompts[i] for i in idx], [completions[i] for i in idx],
                                             pad_token_id=pad_token_id, multiple_of=pad_to_multiple_of, device=device,
                                             padding_free=padding_free)
            if out is None:
                out = feats.new_zeros(b, c_max, feats.shape[-1])
            out[torch.tensor(idx, device=device)[rows], cols] = feats
        for _ in range(count - len(batches)):  # keep collectives in step with busier ranks
            _micro_batch(model, parts, prompts[:1], completions[:1], pad_token_id=pad_token_id,
                         multiple_of=pad_to_multiple_of, device=device, padding_free=padding_free)
    finally:
        inner.train(was_training)
    assert out is not None  # at least one micro batch ran
    return HiddenOutput(out, count, batches)


def _micro_batch(model, parts, prompts: list[list[int]], completions: list[list[int]], *, pad_token_id: int,
                 multiple_of: int | None, device: torch.device, padding_free: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One forward: (row, column) of every completion token ``[tokens]`` each and its hidden state ``[tokens, H]``."""
    width = round_up(max(len(p) + len(c) for p, c in zip(prompts, completions)), multiple_of)
    starts = [0] * len(prompts)  # the plain layout's rows are right-padded: positions from each row's first token
    rows, pos, _, cols = completion_positions(prompts, completions, starts, device)
    feats = completion_features(model, parts, prompts, completions, rows, pos, cols, starts=starts, width=width,
                                pad_token_id=pad_token_id, device=device, multiple_of=multiple_of,
                                padding_free=padding_free)
    return rows, cols, feats
