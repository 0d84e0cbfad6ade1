"""The typed values the stages of one rollout step hand each other (see ``NRolloutGRPOTrainer._generate_and_score_completions``).

    collect rounds  ->  Round        the job's samples (every rank's, job order), their rewards, the table
    assign          ->  Assignment   which of them this rank trains on
    log-prob passes ->  LogProbs     old-policy and reference log-probs of this rank's samples
    advantages      ->  Advantages   per-token advantages of the job (and PPO's returns and values)
    TRL's batch     ->  dict         this rank's tensors in TRL's layout

Shapes: ``G`` samples in the job (all ranks), ``F`` reward functions, ``T`` the job's longest completion, ``B`` this
rank's samples, ``C`` this rank's longest completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sample:
    """One sample as the engine produced it; what travels between ranks (gathered, balanced, selected)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    #: the engine's log-prob of each completion token (behaviour policy)
    logprobs: list[float]
    #: ``"stop"`` or ``"length"`` (cut at ``max_completion_length``)
    finish_reason: str
    #: multi-turn: 1 for tokens the policy sampled, 0 for tool results (None: all sampled)
    tool_mask: list[int] | None = None
    #: a vision-language model's image tensors, carried only where samples change ranks
    mm: Any = None
    #: an agent's split episode (it edited its history, so its calls do not chain into one sample): the calls after
    #: the first (this sample), each a sample of its own, trained with this sample's advantage
    #: (:func:`expand_segments`); empty otherwise
    segments: tuple[Sample, ...] = ()

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def sampled_length(self) -> int:
        """Completion tokens the policy sampled (tool results left out)."""
        return len(self.completion_ids) if self.tool_mask is None else sum(self.tool_mask)

    @property
    def num_tokens(self) -> int:
        """Prompt and completion tokens, a split episode's later calls included."""
        return len(self.prompt_ids) + len(self.completion_ids) + sum(s.num_tokens for s in self.segments)


@dataclass
class Round:
    """One or more rounds of generation and scoring, the same on every rank.

    ``samples``: the job's samples ``[G]`` in job order (rank 0's first), ``n`` contiguous per prompt; ``rewards``
    ``[G, F]`` (NaN: the function does not apply); ``table``: TRL's completions table of these samples (None
    unless ``log_completions``); ``mm_local``: this rank's image tensors in its own order, where they did not travel
    with the samples.
    """

    samples: list[Sample]
    rewards: Tensor
    gen_s: float = 0.0
    reward_s: float = 0.0
    gen_tokens: int = 0
    table: dict | None = None
    mm_local: list | None = None
    #: DAPO's extra rounds and what its filter did (0 without dynamic sampling)
    extra_rounds: int = 0
    #: this rank's dataset rows of its samples, ``n`` per group, where they are not the step's inputs (a partial
    #: rollout trains the groups that finished first); None: the step's inputs
    rows: list[dict] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def then(self, more: Round) -> Round:
        """This round followed by ``more`` (DAPO's next round), times and tokens added."""
        return Round(self.samples + more.samples, torch.cat([self.rewards, more.rewards]), self.gen_s + more.gen_s,
                     self.reward_s + more.reward_s, self.gen_tokens + more.gen_tokens,
                     join_tables(self.table, more.table, len(self.samples)), self.mm_local, self.extra_rounds + 1)

    def select(self, keep: list[int]) -> Round:
        """The samples ``keep`` (job indices), in that order."""
        return Round([self.samples[i] for i in keep], self.rewards[keep], self.gen_s, self.reward_s,
                     self.gen_tokens, select_rows(self.table, keep), self.mm_local, self.extra_rounds)


@dataclass
class Assignment:
    """The samples this rank trains on: ``mine`` (job indices, ``[B]``) and those samples, in that order; ``mm``:
    their image tensors (None without images). An agent's split episode trains each call as a sample of its own
    (:func:`expand_segments`): its job index then appears once per call, and ``segment`` ``[B]`` marks the rows that
    are a later call (None: no split episode here)."""

    mine: list[int]
    samples: list[Sample]
    mm: list | None = None
    segment: list[bool] | None = None

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [s.prompt_ids for s in self.samples]

    @property
    def completion_ids(self) -> list[list[int]]:
        return [s.completion_ids for s in self.samples]

    @property
    def num_tokens(self) -> int:
        """Prompt and completion tokens of this rank's samples (the step's throughput counts them)."""
        return sum(s.num_tokens for s in self.samples)


def expand_segments(mine: list[int], samples: list[Sample], mm: list | None = None
                    ) -> tuple[list[int], list[Sample], list[bool] | None, list | None]:
    """This rank's samples with every split episode's later calls (:attr:`Sample.segments`) as samples of their own,
    right after their episode's first call: ``(mine, samples, segment, mm)``, ``mine`` repeating the episode's job
    index for each of its calls, ``segment`` marking the later calls (None where no sample has any: nothing
    changes), ``mm`` the image tensors per row (``mm`` ``[B]`` given per sample; a later call's are its own,
    :attr:`Sample.mm`; None where no row has images)."""
    if not any(s.segments for s in samples):
        return mine, samples, None, mm
    out_mine, out, segment, out_mm = [], [], [], []
    for index, sample, m in zip(mine, samples, mm if mm is not None else [None] * len(samples), strict=True):
        out_mine.append(index)
        out.append(replace(sample, segments=()))
        segment.append(False)
        out_mm.append(m)
        for call in sample.segments:
            out_mine.append(index)
            out.append(call)
            segment.append(True)
            out_mm.append(call.mm)
    return out_mine, out, segment, out_mm if any(m is not None for m in out_mm) else None


def fit_width(t: Tensor, width: int) -> Tensor:
    """``t`` ``[B, W]`` cut or right-padded with zeros to ``[B, width]`` (per-token values of the job, which may be
    wider than this rank's tensors, or narrower once those are padded to TRL's ``pad_to_multiple_of``)."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


@dataclass
class LogProbs:
    """The log-prob passes over this rank's samples: old-policy ``old`` and reference ``ref`` ``[B, C]`` (None
    where the pass did not run); ``on_policy``: the update takes one optimizer step per rollout, so its own
    log-probs are the old ones (the old-policy pass was skipped, or ran only for ``support_log_mass``);
    ``support_log_mass`` ``[B, C]``: with a truncating sampler (top-k, top-p, min-p), the log of the probability
    mass the sampler kept at each token under the old policy (None without truncation): the engine's log-probs
    are over that support."""

    old: Tensor | None
    ref: Tensor | None
    on_policy: bool = False
    support_log_mass: Tensor | None = None


@dataclass
class Advantages:
    """The advantage stage over the whole job: ``advantages`` ``[G, T]`` (0 outside ``response_mask``), the
    sample ``scores`` ``[G]`` they came from (weighted rewards, less the KL penalty when it is in the reward),
    ``response_mask`` ``[G, T]`` (sampled tokens: tool results 0), and for a critic's estimator (GAE) its
    ``returns`` and ``values`` ``[G, T]``."""

    advantages: Tensor
    scores: Tensor
    response_mask: Tensor
    returns: Tensor | None = None
    values: Tensor | None = None


@dataclass(frozen=True)
class StepContext:
    """What every stage of one rollout step knows: ``mode`` ("train" or "eval"), ``n`` samples per prompt, and this
    rank's ``inputs`` (TRL's rows, each prompt repeated ``n`` times)."""

    mode: str
    n: int
    inputs: list[dict] = field(repr=False)


def join_tables(first: dict | None, more: dict | None, rows_before: int) -> dict | None:
    """Completions tables of two rounds, one after the other (a column missing in one round gets None there)."""
    if first is None or more is None:
        return None
    rows_more = len(more["prompt"])
    columns = set(first["extra"]) | set(more["extra"])
    extra = {c: first["extra"].get(c, [None] * rows_before) + more["extra"].get(c, [None] * rows_more)
             for c in sorted(columns)}
    images = None
    if first.get("images") is not None or more.get("images") is not None:
        images = (first.get("images") or [[]] * rows_before) + (more.get("images") or [[]] * rows_more)
    return {"prompt": first["prompt"] + more["prompt"], "completion": first["completion"] + more["completion"],
            "extra": extra, "images": images}


def select_rows(table: dict | None, keep: list[int]) -> dict | None:
    """The rows ``keep`` of a completions table."""
    if table is None:
        return None

    def pick(values: list) -> list:
        return [values[i] for i in keep]

    images = table.get("images")
    return {"prompt": pick(table["prompt"]), "completion": pick(table["completion"]),
            "extra": {c: pick(v) for c, v in table["extra"].items()},
            "images": None if images is None else pick(images)}


def split_rows(batch: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """``batch``'s rows cut into ``chunks`` consecutive parts, as TRL's ``split_tensor_dict`` cuts them where
    ``chunks`` divides the rows; otherwise (an agent's split episodes add rows) the first ``rows % chunks`` parts
    take one row more: no row is dropped. Lists (a VLM's image tensors) are cut alike; scalars go to every part."""
    rows = next(v for v in batch.values() if v is not None and (isinstance(v, list) or v.ndim > 0))
    total = len(rows) if isinstance(rows, list) else rows.shape[0]
    size, extra = divmod(total, chunks)
    out, at = [], 0
    for i in range(chunks):
        end = at + size + (1 if i < extra else 0)
        out.append({k: (v[at:end] if v is not None and (isinstance(v, list) or v.ndim > 0) else v)
                    for k, v in batch.items()})
        at = end
    return out
