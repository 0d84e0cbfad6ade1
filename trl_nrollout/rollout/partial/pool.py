"""The pool step of partial rollouts (``rollout_partial=True``): one step for every episode kind and placement.

A partial rollout keeps groups in flight from step to step. Wherever the pool lives (on the trainers, colocated:
:mod:`trl_nrollout.trainer.pool_rounds`, the rounds of :mod:`trl_nrollout.trainer.partial`'s pool; on the rollout ranks:
:mod:`trl_nrollout.rollout.ranks.partial`), each step runs :func:`pool_step`:

1. **top-up**: the pool should hold ``ceil(target * (1 + oversample))`` groups once the step's ``target`` new groups
   have joined; the shortfall (:func:`top_up_count`) is what ``grow(need)`` adds beyond the step's own groups
   (drawn on the trainers, each drawing rank its share: :func:`top_up_share`; or taken from the top-up prompts a
   job carries);
2. **restart**: samples (an engine's pool) or episodes (live agents) older than ``max_staleness`` versions start
   again;
3. **run**: the new groups join and the pool runs until ``target`` groups have finished; the first to finish
   train, home by home where groups must train where they were drawn (environments), and the rest stay;
4. **counts** for the log (:class:`PoolCounts`).

What "run" means is the episode kind's part, passed in: :class:`EngineGroups` holds groups an engine samples
(single-turn: :func:`sampled_groups`; TRL tools / environments request by request: :func:`tool_groups`), and
:class:`LiveGroups` holds live endpoint agents or a ``rollout_func``'s groups (:func:`live_shares`;
:func:`live_balanced` with ``rollout_dispatch="balanced"``). The same runners serve
both placements, so a rollout rank runs the code the trainer would run colocated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trl_nrollout.rollout.axes import DispatchRule
from trl_nrollout.rollout.dispatch.balanced import drop_job_queue, job_counter, job_queue
from trl_nrollout.rollout.dispatch.shares import run_partial, run_partial_agents
from trl_nrollout.rollout.episodes.in_flight import (
    InFlightGroup,
    PartialRun,
    drop_stale,
    homes_done,
    split_finished,
    split_finished_by_home,
)
from trl_nrollout.rollout.types import SamplingOptions


def top_up_count(target: int, pooled: int, oversample: float) -> int:
    """The groups a pool adds beyond the step's ``target`` new ones so that it holds ``ceil(target * (1 +
    oversample))`` groups in flight, ``pooled`` of them carried over from earlier steps (0 when it holds enough).
    The one top-up rule of every pool."""
    return max(0, math.ceil(target * (1 + oversample)) - pooled - target)


def top_up_share(need: int, ways: int, index: int) -> int:
    """Rank ``index``'s share of ``need`` top-up groups that ``ways`` ranks draw for one pool (the first ranks draw
    one more)."""
    return need // ways + (index < need % ways)


def top_up_candidates(groups: int, oversample: float) -> int:
    """The top-up prompts a trainer sends with a job of its ``groups`` new groups, for pools it does not hold
    (rollout ranks, which take ``top_up_count`` of them, the rest unused): the most a pool's shortfall can be per
    group it draws (``ceil(groups * oversample)``), one more for the rounding; none without oversampling."""
    return math.ceil(groups * oversample) + 1 if oversample else 0


@dataclass(frozen=True)
class PoolStep:
    """One step of a pool: ``version`` (optimizer steps of the weights the engines hold: new tokens are tagged
    with it, staleness counts from it), ``max_staleness`` (the oldest token, or episode start, kept), ``target``
    (groups that finish and train this step, the pool's whole share of the job) and ``oversample``
    (``rollout_partial_oversample``)."""

    version: int
    max_staleness: int
    target: int
    oversample: float


@dataclass
class PoolCounts:
    """A pool step's counts for the log: ``aborted`` samples (or agent calls) stopped with their tokens kept,
    ``restarted`` samples (or episodes) started again, ``pool_groups`` left in flight, ``engine_steps`` taken,
    ``dropped`` tokens of the restarted samples (None where not counted: live agents)."""

    aborted: int
    restarted: int
    pool_groups: int
    engine_steps: int
    dropped: int | None

    def report(self) -> list:
        """``[aborted, restarted, pool groups, engine steps, dropped]``: what a rollout rank answers."""
        return [self.aborted, self.restarted, self.pool_groups, self.engine_steps, self.dropped]

    def row(self, staleness: list[int]) -> list:
        """The log row of one rank (:func:`~trl_nrollout.trainer.pool_host.log_partial`): the counts
        with the max and mean ``staleness`` (versions, one per sample trained) before ``dropped``."""
        return [self.aborted, self.restarted, self.pool_groups, self.engine_steps, max(staleness),
                sum(staleness) / len(staleness), self.dropped]


@dataclass
class PoolRun:
    """What running a pool did: ``chosen`` (the groups that train: the first to finish, home by home where the
    pool has homes), ``aborted``, ``engine_steps``, ``new_tokens``, the episode kind's ``stats`` (an
    :class:`~trl_nrollout.rollout.episodes.tools.AgentStats`, an endpoint's counts, or None), and, for an engine's
    pool, ``ran`` (the pool as it ran: carried groups, then the new ones) and ``engine_groups`` (indices into
    ``ran`` this engine ran, with a balanced queue); ``moved``: live agents on a balanced queue, the share of
    groups an engine other than their own ran (None elsewhere)."""

    chosen: list
    aborted: int
    engine_steps: int
    new_tokens: int = 0
    stats: Any = None
    ran: list = field(default_factory=list)
    engine_groups: list[int] = field(default_factory=list)
    moved: float | None = None


@dataclass
class PoolResult:
    """:func:`pool_step`'s answer: the groups that train (``chosen``, every home's, in home order), ``need`` (the
    top-up shortfall ``grow`` was given), the :class:`PoolRun` and the :class:`PoolCounts`."""

    chosen: list
    need: int
    run: PoolRun
    counts: PoolCounts


class GroupPool(Protocol):
    """A pool of groups in flight: how many it holds, restarting its stale ones, running it with new groups."""

    def __len__(self) -> int: ...

    def restart_stale(self, version: int, max_staleness: int) -> tuple[int, int | None]:
        """Start again what is older than ``max_staleness`` versions; returns ``(restarted, dropped tokens)``."""
        ...

    def run(self, new: list, target: int) -> PoolRun:
        """``new`` groups join; run until ``target`` groups have finished; they leave the pool."""
        ...


def pool_step(pool: GroupPool, step: PoolStep, grow: Callable[[int], list]) -> PoolResult:
    """One step of a partial rollout's pool (see the module docstring): ``grow(need)`` gives the step's new groups
    with ``need`` top-ups (:func:`top_up_count`; the caller takes its share, or its candidates), then stale groups
    start again, the pool runs until ``step.target`` groups have finished, and the counts are taken."""
    need = top_up_count(step.target, len(pool), step.oversample)
    new = grow(need)
    restarted, dropped = pool.restart_stale(step.version, step.max_staleness)
    run = pool.run(new, step.target)
    return PoolResult(run.chosen, need, run, PoolCounts(run.aborted, restarted, len(pool), run.engine_steps, dropped))


# ------------------------------------------------------------------------------------------ an engine's groups
#: runs an engine's pool (carried groups, then new ones) until ``target`` finish (``quota``: each home's count, or
#: None); returns the :class:`~trl_nrollout.rollout.episodes.in_flight.PartialRun` and the episode kind's stats (or None)
RunGroups = Callable[[list[InFlightGroup], int, "dict[int, int] | None"], "tuple[PartialRun, Any]"]


def group_home(g: InFlightGroup) -> int:
    """The rank that drew group ``g`` (its key's third field): where its environments live and where it trains."""
    return g.key[2]


class EngineGroups:
    """The :class:`GroupPool` of groups an engine samples (single-turn samples, TRL tool episodes request by
    request: :class:`~trl_nrollout.rollout.episodes.in_flight.InFlightGroup`): ``groups`` carried over, ``episodes`` how they
    run (:func:`sampled_groups`, :func:`tool_groups`). ``quota(new)``: where each group must train on its home
    (:func:`group_home`; environments), how many of its own groups each home trains this step (None: the first
    ``target`` to finish, whoever drew them). ``before_restart(groups)``: the pool before its staleness check (a
    resumed pool's groups given new environments); ``on_restart(before, after)``: after it (environments of the
    samples started again reset)."""

    def __init__(self, groups: list[InFlightGroup], episodes: RunGroups, *,
                 quota: Callable[[list[InFlightGroup]], dict[int, int]] | None = None,
                 before_restart: Callable[[list[InFlightGroup]], list[InFlightGroup]] | None = None,
                 on_restart: Callable[[list[InFlightGroup], list[InFlightGroup]], None] | None = None) -> None:
        self.groups = list(groups)
        self.episodes = episodes
        self.quota = quota
        self.before_restart = before_restart
        self.on_restart = on_restart

    def __len__(self) -> int:
        return len(self.groups)

    def restart_stale(self, version: int, max_staleness: int) -> tuple[int, int]:
        before = self.before_restart(self.groups) if self.before_restart is not None else self.groups
        self.groups, restarted, dropped = drop_stale(before, version, max_staleness)
        if self.on_restart is not None:
            self.on_restart(before, self.groups)
        return restarted, dropped

    def run(self, new: list[InFlightGroup], target: int) -> PoolRun:
        ran = self.groups + list(new)
        quota = self.quota(new) if self.quota is not None else None
        run, stats = self.episodes(ran, target, quota)
        if quota is not None:  # the homes in order, each its own first groups to finish: its share is its own
            chosen, self.groups = split_finished_by_home(run.groups, run.finish_order,
                                                         [group_home(g) for g in run.groups], quota)
            if len(chosen) != target:
                raise RuntimeError(f"a partial rollout with environments ended with {len(chosen)} of its {target} "
                                   "groups finished on their own ranks (a bug: the engine stops when each rank has "
                                   "its share).")
        else:
            chosen, self.groups = split_finished(run.groups, run.finish_order, target)
        return PoolRun(chosen, run.aborted, run.engine_steps, run.new_tokens, stats, ran, list(run.engine_groups))


def sampled_groups(engine, sampling: SamplingOptions, version: int,
                   home: Callable[[InFlightGroup], int] | None = None, rule: DispatchRule | None = None) -> RunGroups:
    """Single-turn groups on ``engine``: its own pool (``run_partial``), or with ``home`` (a group's home engine)
    the job's pool as the job-wide dispatch ``rule`` runs it (``rule.run_partial``: balanced,
    ``run_partial_balanced``)."""

    def run(groups: list[InFlightGroup], target: int, quota: dict[int, int] | None) -> tuple[PartialRun, None]:
        if home is None:
            return run_partial(engine, groups, target, sampling, version), None
        return rule.run_partial(engine, groups, target, sampling, version, [home(g) for g in groups]), None

    return run


def tool_groups(engine, sampling: SamplingOptions, version: int,
                callbacks: Callable[[list[InFlightGroup]], contextlib.AbstractContextManager], workers: int, *,
                owns: Callable[[InFlightGroup], bool], home: Callable[[InFlightGroup], int] | None = None,
                rule: DispatchRule | None = None) -> RunGroups:
    """TRL tool episodes (environments' too) on ``engine``, turn after turn as requests: its own pool
    (``run_partial_agents``; a group's tools on the rank ``owns`` names), or with ``home`` the job's pool as the
    job-wide dispatch ``rule`` runs it (``rule.run_partial_agents``: balanced, ``run_partial_agents_balanced``). ``callbacks(groups)``: a context around the run yielding the
    :class:`~trl_nrollout.rollout.episodes.tools.AgentCallbacks` of the pool's samples. With a quota the run stops once
    every home has its own groups finished."""

    def run(groups: list[InFlightGroup], target: int, quota: dict[int, int] | None):
        drawn_by = [group_home(g) for g in groups] if quota is not None else None
        with callbacks(groups) as agent:
            if home is not None:
                return rule.run_partial_agents(engine, groups, target, sampling, version,
                                               [home(g) for g in groups], agent, workers,
                                               quota=(drawn_by, quota) if quota is not None else None)
            return run_partial_agents(
                engine, groups, target, sampling, version, agent, workers, owns=owns,
                done=(lambda order: homes_done(drawn_by, order, quota)) if quota is not None else None)

    return run


def fixed_callbacks(agent) -> Callable[[list[InFlightGroup]], contextlib.AbstractContextManager]:
    """:func:`tool_groups`'s ``callbacks`` where every run uses ``agent`` as it is."""
    return lambda groups: contextlib.nullcontext(agent)


# ------------------------------------------------------------------------------------------ live agents
#: a new group of live agents: ``(key, dataset row, prompt)``
NewLive = tuple[tuple, dict, Any]
#: runs a pool of live agents with new groups until ``target`` finish
RunLive = Callable[[Any, list[NewLive], int], PoolRun]


class LiveGroups:
    """The :class:`GroupPool` of live endpoint agents or a ``rollout_func``'s groups
    (:class:`~trl_nrollout.rollout.partial.agent_pool.AgentPool`, ``n`` episodes a group): a stale group's episodes start
    again (none of its calls' tokens are counted as dropped); ``episodes`` runs it (:func:`live_shares`,
    :func:`live_balanced`)."""

    def __init__(self, pool, n: int, episodes: RunLive) -> None:
        self.pool = pool
        self.n = n
        self.episodes = episodes

    def __len__(self) -> int:
        return len(self.pool.groups)

    def restart_stale(self, version: int, max_staleness: int) -> tuple[int, None]:
        return self.pool.restart_stale(version, max_staleness, self.n), None

    def run(self, new: list[NewLive], target: int) -> PoolRun:
        return self.episodes(self.pool, new, target)


def live_shares(engine, sampling: SamplingOptions, n: int, version: int) -> RunLive:
    """Live agents on this rank's own pool: the new groups' agents start, and the pool's calls are served on
    ``engine`` until ``target`` of its groups have finished (:meth:`~trl_nrollout.rollout.partial.agent_pool.AgentPool.
    run`)."""

    def run(pool, new: list[NewLive], target: int) -> PoolRun:
        pool.add([k for k, _, _ in new], [r for _, r, _ in new], [p for _, _, p in new], n, version)
        chosen, stats = (pool.run(engine, sampling, target, version) if target
                         else ([], {"carried": 0, "engine_steps": 0, "idle_s": 0.0}))
        return PoolRun(chosen, stats["carried"], stats["engine_steps"], stats=stats)

    return run


def live_balanced(engine, sampling: SamplingOptions, n: int, version: int, rank: int,
                  engine_of: Callable[[int], int]) -> RunLive:
    """Live agents with ``rollout_dispatch="balanced"`` over several engines: every rank's new groups form one queue
    (:func:`~trl_nrollout.rollout.dispatch.balanced.job_queue`) that each rank's pool pulls from while
    it runs fewer episodes than its share of its engine's ``max_num_seqs`` plus a group; every pool serves until the
    job has as many finished groups as the ranks drew prompts (a job-wide count: a group's place in the job's finish
    order is its ticket, across steps). The first to finish train, rank ``r`` the ``r``-th share (their records
    gathered to it); a group nobody pulled joins its own rank's pool. ``engine_of(rank)``: a rank's engine.
    Collective over every rank. Returns this rank's groups, its endpoint's counts and ``moved``."""
    from trl_nrollout.rollout.partial.agent_pool import LiveGroup

    def run(pool, new: list[NewLive], target: int) -> PoolRun:
        job = engine.gather_job([(key, dict(row), prompt) for key, row, prompt in new])
        flat = [g for part in job for g in part]
        wanted = engine.gather_job(target)
        tickets = job_counter(engine, "agent_tickets")
        base = tickets(0)  # read before the gather below: no pool serves before every rank has
        before = sum(engine.gather_job(sum(g.finished is not None for g in pool.groups)))
        queue = job_queue(engine, [len(part) * n for part in job], n)
        capacity = engine.max_num_seqs
        room = -(-capacity // len(engine.tp_ranks)) + n  # this rank's share of its engine's batch, a group more
        claimed: list[int] = []

        def pull(running: int) -> None:
            if running < room and (got := list(queue.claim(max(1, -(-(room - running) // n))))):
                claimed.extend(got)
                pool.add([flat[g][0] for g in got], [flat[g][1] for g in got], [flat[g][2] for g in got], n, version)

        stats = pool.run_shared(engine, sampling, lambda: before + tickets(0) - base >= sum(wanted), pull,
                                lambda: tickets(1), version)
        every = engine.gather_job(claimed)  # every rank is past its last claim
        drop_job_queue(engine, queue)
        taken = {g for part in every for g in part}
        first = sum(len(part) for part in job[:rank])
        left = [flat[g] for g in range(first, first + len(job[rank])) if g not in taken]
        done = engine.gather_job([(g.finished, g.key, g.row, g.prompt, g.version, g.records)
                                  for g in pool.groups if g.finished is not None])
        order = sorted((x for part in done for x in part), key=lambda x: x[0])[:sum(wanted)]
        pool.take({x[1] for x in order})
        pool.add([g[0] for g in left], [g[1] for g in left], [g[2] for g in left], n, version)
        moved = sum(1 for r, part in enumerate(every) for g in part if engine_of(flat[g][0][2]) != engine_of(r))
        at = sum(wanted[:rank])
        chosen = [LiveGroup(key, row, prompt, records=list(records), version=v)
                  for _, key, row, prompt, v, records in order[at:at + target]]
        return PoolRun(chosen, stats["carried"], stats["engine_steps"], stats=stats,
                       moved=moved / max(1, len(taken)))

    return run
