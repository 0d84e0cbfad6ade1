"""The typed sampling options and batch of a rollout, and a rollout rank's answer (the engine protocol:
:mod:`trl_nrollout.rollout.engines.protocol`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trl_nrollout.passes.packing import pad_samples


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling options of one rollout, in vLLM's vocabulary (``top_k=-1`` and ``min_p=0`` disable them).

    ``seed`` fixes the sampling of the call (the same seed and inputs give the same samples); ``None`` draws from
    the engine's own seeded generator, which differs from call to call but is reproducible across runs.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    #: extra keyword arguments for the engine's sampler, as (name, value) pairs (TRL's ``generation_kwargs``):
    #: vLLM ``SamplingParams`` fields on the vLLM engine, ``generate()`` arguments on the HF engine
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    #: completions must match this regular expression (vLLM's structured outputs; TRL's
    #: ``vllm_structured_outputs_regex``)
    regex: str | None = None
    #: tokens never sampled (a vision-language model's image placeholder, as TRL suppresses it: a sampled one
    #: would ask the model for image features that do not exist)
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (the completion length to generate).")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable it.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (disabled) or >= 1.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]; use 0.0 to disable it.")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RolloutBatch:
    """Samples of one rollout, one entry per sample; the ``n`` samples of a prompt are contiguous, in prompt order.

    - ``prompt_ids[i]`` / ``completion_ids[i]``: token ids (no padding) of sample ``i``;
    - ``logprobs[i][t]``: the engine's log-prob of completion token ``t`` (after temperature, as sampled);
    - ``finish_reasons[i]``: ``"stop"`` (EOS or a stop token/string) or ``"length"`` (hit ``max_tokens``);
    - ``group_index[i]``: the global index of the prompt (group) sample ``i`` came from.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    group_index: list[int]
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.completion_ids), len(self.logprobs), len(self.finish_reasons),
                 len(self.group_index)}
        if len(sizes) != 1:
            raise ValueError(f"RolloutBatch fields have different lengths: {sorted(sizes)}.")

    def slice(self, start: int, stop: int) -> RolloutBatch:
        """Samples ``start:stop`` as a new batch."""
        return RolloutBatch(self.prompt_ids[start:stop], self.completion_ids[start:stop], self.logprobs[start:stop],
                            self.finish_reasons[start:stop], self.group_index[start:stop], dict(self.timings))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def padded(self, pad_token_id: int, device: torch.device | str = "cpu", multiple_of: int | None = None
               ) -> dict[str, Tensor]:
        """TRL-style tensors: prompts left-padded ``[B, P]``, completions and log-probs right-padded ``[B, C]``;
        ``P`` and ``C`` are rounded up to a multiple of ``multiple_of`` when given (TRL's ``pad_to_multiple_of``)."""
        return pad_samples(self.prompt_ids, self.completion_ids, pad_token_id, device, multiple_of, self.logprobs)


def pack_extras(tool_mask: np.ndarray | None, fields: list[dict] | None, lengths: np.ndarray) -> list[dict | None]:
    """Per sample of a :class:`JobResult`: its ``tool_mask`` (a list, ``[L]``) and the episode's fields
    (:data:`~trl_nrollout.rollout.ranks.episodes.EPISODE_FIELDS`), or None for a single-turn job; a partial job's
    fields without a mask (:mod:`~trl_nrollout.rollout.ranks.partial`)."""
    if fields is None:
        return [None] * len(lengths)
    if tool_mask is None:
        return [dict(f) for f in fields]
    ends = np.cumsum(lengths)
    masks = tool_mask.tolist()
    return [{"tool_mask": masks[b - n:b], **f} for b, n, f in zip(ends.tolist(), lengths.tolist(), fields)]


@dataclass
class JobResult:
    """What one rollout rank generated for its slice of a job, as flat arrays (4 bytes a token and a log-prob
    instead of a pickled list of Python numbers): ``tokens`` and ``logprobs`` ``[sum of lengths]``, ``lengths``
    ``[samples]``."""

    tokens: np.ndarray  # int32 [total tokens]
    logprobs: np.ndarray  # float32 [total tokens]
    lengths: np.ndarray  # int64 [samples]
    finish_reasons: list[str]
    gen_s: float
    version: int
    #: rollout_dispatch="balanced": the job's groups this rank's engine ran and how many of them another engine
    #: owned under fixed shares (its TP group's first rank reports; None elsewhere and under "shares")
    balanced: tuple[int, int] | None = None
    #: an agent job (tools on the rollout ranks): the tool masks ``int8 [total tokens]``, each sample's other
    #: fields and the engine's AgentStats as a tuple (:mod:`~trl_nrollout.rollout.ranks.episodes`); else None
    tool_mask: np.ndarray | None = None
    episodes: list[dict] | None = None
    agent_stats: tuple | None = None
    #: a job with images: the engine's prompt ids (image placeholders expanded) of each group of the job this rank
    #: generated, by the group's index in the job (once a group); else None
    prompts: dict[int, list[int]] | None = None
    #: a partial job: the engine's counts and pool left in flight (:class:`~trl_nrollout.rollout.ranks.partial.
    #: PartialJob`'s ``report``; its TP group's first rank), else None
    partial: dict | None = None

    @classmethod
    def of(cls, completion_ids: list[list[int]], logprobs: list[list[float]], finish_reasons: list[str],
           gen_s: float, version: int, balanced: tuple[int, int] | None = None, extras=None,
           agent_stats: tuple | None = None, prompts: dict[int, list[int]] | None = None,
           partial: dict | None = None) -> JobResult:
        lengths = np.array([len(c) for c in completion_ids], dtype=np.int64)
        flat = [t for c in completion_ids for t in c]
        lps = [x for lp in logprobs for x in lp]
        mask, episodes = extras if extras is not None else (None, None)
        return cls(np.array(flat, dtype=np.int32), np.array(lps, dtype=np.float32), lengths, list(finish_reasons),
                   gen_s, version, balanced, mask, episodes, agent_stats, prompts, partial)

    def rows(self) -> list[tuple[list[int], list[float], str]]:
        """``(completion ids, log-probs, finish reason)`` of each sample."""
        ends = np.cumsum(self.lengths)
        starts = ends - self.lengths
        tokens, lps = self.tokens.tolist(), self.logprobs.tolist()
        return [(tokens[a:b], lps[a:b], f) for a, b, f in zip(starts.tolist(), ends.tolist(), self.finish_reasons)]

    def extras(self) -> list[dict | None]:
        """Each sample's tool mask and episode fields (an agent job), its group's fields (a partial job), or None."""
        return pack_extras(self.tool_mask, self.episodes, self.lengths)


def whole_groups(flat: list[list[int]], n: int, engine_index: int = 0) -> list[list[int]]:
    """An engine's prompts, one per group, from its samples' prompts ``flat`` (each repeated ``n`` times
    consecutively); a clear error (naming engine ``engine_index``) where they are not whole groups."""
    if len(flat) % n:
        raise ValueError(f"the {len(flat)} samples of engine {engine_index} are not whole groups of n={n}.")
    unique = flat[::n]
    for g, p in enumerate(unique):
        if any(flat[g * n + k] != p for k in range(n)):
            raise ValueError(
                f"samples {g * n}..{g * n + n - 1} of engine {engine_index} are not {n} copies of one "
                f"prompt: prompts must be repeated n={n} times consecutively (TRL's RepeatSampler order)."
            )
    return unique
