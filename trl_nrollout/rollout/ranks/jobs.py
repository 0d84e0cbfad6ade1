"""A rollout rank's jobs, by kind: the table :data:`JOB_KINDS` (the type of a job's ``agent`` entry -> what runs
its slice on the rollout rank) that :func:`~trl_nrollout.rollout.ranks.serve.serve` looks a job up in.

A job's kind is the type of the entry it carries (``message["agent"]``, pickled): ``None`` for single-turn samples
(:func:`single_turn_job`, below), :class:`TurnEntry` for one more turn of tool episodes whose tools run on the
trainers (:func:`turn_job`, below), :class:`~trl_nrollout.rollout.ranks.episodes.EpisodeJob` for whole
episodes on the rollout ranks and :class:`~trl_nrollout.rollout.ranks.partial.PartialEntry` for a partial job's
groups in flight, each registered (:func:`job_kind`) where its entry is defined. A new kind of job is a new entry
type and one registered handler; ``serve`` does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trl_nrollout.rollout.axes import DispatchRule, dispatch_rule
from trl_nrollout.rollout.bridge import RolloutRankError
from trl_nrollout.rollout.ranks.buckets import job_slice
from trl_nrollout.rollout.ranks.state import RankState
from trl_nrollout.rollout.types import RolloutBatch


@dataclass
class RankJob:
    """One job as rollout rank ``rank`` (of ``ranks``) runs it: the trainers' ``message`` (its ``prompts``, each
    group's once; ``n``; ``sampling``; the entry), this rank's engine and :class:`RankState`, its slice ``[start,
    stop)`` of the job's samples and their images (per sample, its group's; None for text)."""

    message: dict
    engine: Any
    state: RankState
    rank: int
    ranks: int
    start: int
    stop: int
    images: list | None

    @property
    def entry(self) -> Any:
        """The job's entry (its kind: :data:`JOB_KINDS`)."""
        return self.message.get("agent")

    @property
    def rule(self) -> DispatchRule:
        """The start message's dispatch rule (``rollout_dispatch``)."""
        return dispatch_rule(self.state.dispatch)

    @property
    def balanced(self) -> bool:
        """A job-wide dispatch rule (``rollout_dispatch="balanced"``): the engines pull the job's groups from one
        queue."""
        return self.rule.job_wide

    def prompts(self) -> list[list[int]]:
        """The prompt of each sample of this rank's slice."""
        groups, n = self.message["prompts"], self.message["n"]
        return [groups[i // n] for i in range(self.start, self.stop)]

    def slices(self) -> list[tuple[int, int]]:
        """Every rollout rank's slice of the job's samples (rank order)."""
        groups, n = self.message["prompts"], self.message["n"]
        tp = self.engine.layout.rollout_tp_size
        return [job_slice(len(groups) * n, n, self.ranks, tp, q) for q in range(self.ranks)]


@dataclass
class JobDone:
    """What a job's handler gives back: this rank's ``batch``; a balanced queue's pull stats (``pulled``: serve
    counts the groups an engine other than their own ran) or those counts already made (``balanced``: ``(groups,
    moved)``); each sample's ``extras`` (tool masks and fields), the engine's ``agent_stats`` (a tuple), a partial
    job's ``partial`` report; ``expanded``: the answer names each image group's prompt as the engine expanded it."""

    batch: RolloutBatch
    pulled: Any = None
    balanced: tuple | None = None
    extras: Any = None
    agent_stats: tuple | None = None
    partial: dict | None = None
    expanded: bool = True


#: the type of a job's entry -> what runs a rollout rank's slice of it (:func:`job_kind` registers)
JOB_KINDS: dict[type, Callable[[RankJob], JobDone]] = {}


def job_kind(entry: type) -> Callable:
    """Register the decorated function as the handler of jobs whose entry is an ``entry`` (``type(None)``: none)."""
    def register(handler: Callable[[RankJob], JobDone]) -> Callable[[RankJob], JobDone]:
        JOB_KINDS[entry] = handler
        return handler
    return register


def run_job(job: RankJob) -> JobDone:
    """Run this rank's slice of ``job`` with its kind's handler."""
    handler = JOB_KINDS.get(type(job.entry))
    if handler is None:
        raise RolloutRankError(f"a job of unknown kind {type(job.entry).__name__!r} from the trainers (a version "
                               f"mismatch? known: {sorted(k.__name__ for k in JOB_KINDS)})")
    return handler(job)


@dataclass(frozen=True)
class TurnEntry:
    """The entry of a tool turn's job (tools on the trainers, one more turn here): per sample (one per context, the
    job's ``n`` is 1) its token ``budgets`` and its place in the job (``sample_ids``: its seed's)."""

    budgets: list[int]
    sample_ids: list[int]


@job_kind(type(None))
def single_turn_job(job: RankJob) -> JobDone:
    """Single-turn samples: this rank's slice of the job (or the groups its engine pulls from the job's queue)."""
    engine, n, sampling = job.engine, job.message["n"], job.message["sampling"]
    if job.balanced:  # the rule's driver over the job's queue (its pull stats for serve's counts)
        batch, pulled = job.rule.generate(engine, job.prompts(), n, sampling, images=job.images)
        return JobDone(batch, pulled=pulled)
    if job.stop > job.start or engine.layout.rollout_tp_size > 1:
        return JobDone(engine.generate_expanded(job.prompts(), n, sampling, sample_offset=job.start,
                                                images=job.images))
    return JobDone(RolloutBatch([], [], [], [], []))


@job_kind(TurnEntry)
def turn_job(job: RankJob) -> JobDone:
    """A tool turn: one sample per context of this rank's slice, each with its budget and its images (the job's
    ``n`` is 1: a context's images are its own; the answer names each context as the engine expanded it)."""
    entry: TurnEntry = job.entry
    start, stop = job.start, job.stop
    return JobDone(job.engine.generate_turns(job.message["prompts"][start:stop], entry.budgets[start:stop],
                                             job.message["sampling"], sample_ids=entry.sample_ids[start:stop],
                                             num_samples=0, images=job.images))
