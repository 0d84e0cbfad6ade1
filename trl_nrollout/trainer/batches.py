"""This rank's share of a rollout step's job and TRL's training batch of it: the ``assign`` stage (a ``Round`` ->
the ``Assignment`` this rank trains on) and TRL's batch (the ``Assignment``, its ``LogProbs`` and the job's
``Advantages`` -> TRL's tensors), pure functions the trainer's ``_assign`` and ``_trl_batch`` call."""

from __future__ import annotations

from typing import Any

import torch

from trl_nrollout.algos.batching import balance_groups
from trl_nrollout.rollout.types import RolloutBatch
from trl_nrollout.trainer.advantage_stage import rows_advantages
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.stages import (
    Advantages,
    Assignment,
    LogProbs,
    Round,
    StepContext,
    expand_segments,
    fit_width,
)


def check_balance(layout, balance_batch: bool) -> None:
    """``balance_batch=True`` assigns whole groups to ranks: each rank's samples must be whole groups (a
    ``ValueError`` naming the counts and the fixes)."""
    if balance_batch and layout.samples_per_rank % layout.rollout_n:
        raise ValueError(
            f"balance_batch=True assigns whole groups to ranks, but each rank trains on "
            f"{layout.samples_per_rank} samples, not a multiple of rollout_n={layout.rollout_n}; "
            "make train_batch_size a multiple of the number of processes, or set balance_batch=False."
        )


def assign(collected: Round, ctx: StepContext, world: int, rank: int, *, balance: bool, metrics: Metrics
           ) -> Assignment:
    """The samples rank ``rank`` of ``world`` (data-parallel: a sequence-parallel group counts once) trains on:
    whole groups balanced by tokens over the ranks (``balance``: ``balance_batch``, in training; the spread is
    logged), or its slice of the job in order."""
    samples, n = collected.samples, ctx.n
    per_rank = len(samples) // world
    if ctx.mode == "train" and balance:
        tokens = [sum(samples[g * n + k].num_tokens for k in range(n)) for g in range(len(samples) // n)]
        assignment = balance_groups(tokens, world)
        mine = [g * n + k for g in assignment[rank] for k in range(n)]
        loads = [sum(tokens[g] for g in a) for a in assignment]
        metrics.add(ctx.mode, "balance/max_over_mean_tokens", max(loads) / max(1e-9, sum(loads) / world))
    else:
        mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    local = [samples[i] for i in mine]
    mm = [s.mm for s in local] if any(s.mm is not None for s in local) else None
    if collected.mm_local is not None and any(x is not None for x in collected.mm_local):
        mm = collected.mm_local  # this rank's own samples, in order (mine is its slice of the job)
    mine, local, segment, mm = expand_segments(mine, local, mm)  # an agent's split episode: each call a sample
    return Assignment(mine, local, mm, segment)


def trl_batch(assigned: Assignment, logps: LogProbs, adv: Advantages, ctx: StepContext, *, pad_token_id: int,
              device: torch.device, pad_to_multiple_of: int | None, beta: float, mask_truncated: bool
              ) -> dict[str, Any]:
    """This rank's samples as TRL's training batch on ``device``: prompts left-padded ``[B, P]``, completions,
    masks, the engine's log-probs and the advantages right-padded ``[B, C]`` (widths a multiple of TRL's
    ``pad_to_multiple_of``); the old-policy log-probs where the update uses them, the reference's where TRL's
    ``beta`` is not 0; a VLM's image tensors and multi-turn's tool mask where present; ``mask_truncated``
    (``mask_truncated_completions``): completions cut at the maximum length take no part in the loss."""
    dev = device
    local = assigned.samples
    rb = RolloutBatch(assigned.prompt_ids, assigned.completion_ids, [s.logprobs for s in local],
                      [s.finish_reason for s in local], [i // ctx.n for i in assigned.mine])
    tensors = rb.padded(pad_token_id, dev, multiple_of=pad_to_multiple_of)
    c_max = tensors["completion_ids"].shape[1]
    out = {
        "prompt_ids": tensors["prompt_ids"], "prompt_mask": tensors["prompt_mask"],
        "completion_ids": tensors["completion_ids"], "completion_mask": tensors["completion_mask"],
        "advantages": rows_advantages(adv.advantages, adv.response_mask, assigned.mine, assigned.segment,
                                      c_max).to(dev),
        "sampling_per_token_logps": tensors["logprobs"],
    }
    if assigned.mm is not None:  # a VLM's image tensors per sample (they follow the samples through shuffles)
        out["mm_inputs"] = assigned.mm
    if any(s.tool_mask is not None for s in local):  # multi-turn: tool-response tokens are not trained on (TRL's)
        tool_mask = torch.zeros_like(tensors["completion_mask"])
        for i, s in enumerate(local):
            tool_mask[i, :len(s.completion_ids)] = torch.tensor(
                s.tool_mask if s.tool_mask is not None else [1] * len(s.completion_ids), dtype=tool_mask.dtype)
        out["tool_mask"] = tool_mask
    if logps.old is not None and not logps.on_policy:
        out["old_per_token_logps"] = fit_width(logps.old, c_max).to(dev)
    if logps.ref is not None and beta != 0.0:
        out["ref_per_token_logps"] = fit_width(logps.ref, c_max).to(dev)
    if logps.support_log_mass is not None:  # what the sampler kept: the engine's log-probs are over it
        out["sampling_support_log_mass"] = fit_width(logps.support_log_mass, c_max).to(dev)
    if mask_truncated:  # TRL's option: completions cut at max length take no part in the loss
        truncated = torch.tensor([s.truncated for s in local], device=dev)
        out["completion_mask"] = out["completion_mask"] * (~truncated).unsqueeze(1).to(out["completion_mask"].dtype)
    return out

