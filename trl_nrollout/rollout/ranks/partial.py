"""Partial rollouts on rollout ranks (``rollout_ranks`` with ``rollout_partial=True``): the rollout ranks keep the
groups in flight from job to job.

A colocated partial rollout keeps each engine's pool on its trainer (:mod:`trl_nrollout.trainer.partial`). With
rollout ranks the trainers write a step's job ``rollout_lookahead`` steps ahead, before the job that precedes it has
answered, so the pool lives where the engines do: each rollout rank keeps its engine's pool (fixed shares) or the
job's pool (``rollout_dispatch="balanced"``, the same on every rollout rank) in its state between jobs. A job's
``agent`` entry (the job's episode entry, a :class:`PartialEntry`) carries what a group needs to train
wherever and whenever it finishes: each prompt's dataset row and prompt.

One job on a rollout rank (:func:`run_partial_job`):

1. its engine's new groups (fixed shares: the groups of its engine's ranks' slices; balanced: every group of the
   job), keyed ``(step, round, index in the job)``, and top-ups from the entry's ``extra`` prompts while the pool
   holds fewer than ``ceil(target * (1 + rollout_partial_oversample))`` groups;
2. samples whose oldest token is more than ``max_staleness`` versions older than the weights the engine holds start
   again (:func:`~trl_nrollout.rollout.episodes.in_flight.drop_stale`): on rollout ranks the weights are already up to
   ``rollout_lookahead`` steps behind the step a job trains, so a trained token is at most
   ``rollout_lookahead + max_staleness`` versions old;
3. the engine runs the pool until as many groups have finished as the job placed on it, the rest stop with their
   tokens kept (:func:`~trl_nrollout.rollout.dispatch.shares.run_partial`, or
   ``run_partial_balanced``; tool episodes, ``rollout_multi_turn="requests"``: ``run_partial_agents`` /
   ``run_partial_agents_balanced`` with the script's ``tools=`` on the rollout rank, an episode's tool mask and
   messages answered with it);
4. the rank answers its share of the first groups to finish (in the job's place of its own slice), each sample with
   its group's row, prompt, prompt ids and oldest version; its TP group's first rank adds the engine's counts and,
   when the trainers will save a checkpoint after this job's step (``snapshot``), the pool left in flight.

A checkpoint keeps that snapshot (the pool after the step's own job: the jobs written ahead of it run again after a
resume, from the same rows); the first job after a resume carries it back (``restore``), dealt over the engines.

Environments (``environment_factory``) stay on the trainers: a group's ``n`` environments wait on the trainer that
drew it (its key's third field), its tool calls go home to that trainer's tool server, a sample started again has
its environment reset there (:data:`RESET_ENV`), and the engines run until every trainer has as many of its own
groups finished as it drew, so that each trainer trains its own. ``agent=`` groups are live agents: each rollout
rank keeps a pool of them on an endpoint of its own (:func:`run_partial_agent_job`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import astuple, dataclass, field, replace
from typing import Any

import numpy as np

from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample
from trl_nrollout.rollout.episodes.partial_tools import AgentPartialSample
from trl_nrollout.rollout.partial.pool import (
    EngineGroups,
    LiveGroups,
    PoolStep,
    fixed_callbacks,
    live_shares,
    pool_step,
    sampled_groups,
    tool_groups,
)
from trl_nrollout.rollout.ranks.episodes import (
    episode_extras,
    home_call,
    partial_env_agent,
    rank_endpoint,
    rank_runner,
    tool_callbacks,
)
from trl_nrollout.rollout.ranks.jobs import JobDone, RankJob, job_kind
from trl_nrollout.rollout.types import RolloutBatch

#: the fields a group's first sample carries for every sample of it (:func:`group_fields`)
GROUP_FIELDS = ("row", "prompt", "prompt_ids", "images", "key")
#: an ``agent=`` job's entry's list fields, joined over the trainers in rank order
#: (:func:`~trl_nrollout.rollout.ranks.client.job_agent`; a partial job's: :meth:`PartialEntry.join`)
JOINED = ("rows", "prompts")
#: the call that asks a trainer to reset a partial group's sample's environment (the sample started again)
RESET_ENV = [{"__reset_environment__": True}]


@dataclass
class TopUp:
    """A top-up prompt of a partial job (the engines take it only while their pool is short): its dataset ``row``,
    ``prompt``, engine ``ids`` ``[P]``, ``images`` (None: text) and, with environments, its group's ``key``
    (``(step, round, trainer rank, index)``; None without)."""

    row: dict
    prompt: Any
    ids: list[int]
    images: list | None = None
    key: tuple | None = None


@dataclass
class PartialEntry:
    """The ``agent`` entry of a partial job (it travels pickled in the job's message to the rollout ranks). A
    trainer's: ``rows`` and ``prompts`` (its dataset rows and prompts, one per group, in the job's order),
    ``extra`` (its :class:`TopUp` prompts), ``max_staleness`` (the restart bound) and ``oversample``
    (``rollout_partial_oversample``), ``snapshot`` (answer the pool left in flight, for a checkpoint), ``restore``
    (a checkpoint's pool, the first job after a resume) and ``tools`` (the groups are tool-calling episodes, request
    by request, with the rollout ranks' ``tools=``). With environments: each group's ``keys`` (``(step, round,
    trainer rank, index)``: its environments wait on that trainer, and it trains there) and the trainer's tool
    server's store prefix ``host`` (the job's: every trainer's, rank order, in ``hosts``). ``agents``: the groups
    are ``agent=`` episodes or a ``rollout_func``'s (:func:`run_partial_agent_job`). The job's entry is the
    trainers' joined (:meth:`join`)."""

    step: int
    round_: int
    rows: list[dict]
    prompts: list
    extra: list[TopUp]
    max_staleness: int
    oversample: float
    snapshot: bool
    restore: list = field(default_factory=list)
    tools: bool = False
    keys: list[tuple] | None = None
    host: str | None = None
    agents: bool = False
    hosts: list[str] | None = None

    @classmethod
    def join(cls, entries: list[PartialEntry]) -> PartialEntry:
        """The job's entry from the trainers' (rank order): rows, prompts, top-ups, the restored pool and keys
        joined, each trainer's after those of the trainers before it; with environments every trainer's ``host``."""
        first = entries[0]
        return replace(first, rows=[r for e in entries for r in e.rows], prompts=[p for e in entries for p in e.prompts],
                       extra=[x for e in entries for x in e.extra], restore=[g for e in entries for g in e.restore],
                       keys=None if first.keys is None else [k for e in entries for k in e.keys],
                       hosts=None if first.host is None else [e.host for e in entries])


def partial_entry(step: int, round_: int, rows: list[dict], prompts: list, extra: list[TopUp], *,
                  max_staleness: int, oversample: float, snapshot: bool, restore: list | None = None,
                  tools: bool = False, keys: list[tuple] | None = None, host: str | None = None,
                  agents: bool = False) -> PartialEntry:
    """A trainer's :class:`PartialEntry` (its lists copied)."""
    return PartialEntry(step, round_, [dict(r) for r in rows], list(prompts), list(extra), max_staleness, oversample,
                        snapshot, list(restore or []), tools, None if keys is None else list(keys), host, agents)


@dataclass
class PartialJob:
    """What a rollout rank answers for a partial job: its share of the finished groups as a batch ``[samples]``,
    each sample's fields (its oldest version; a group's first sample also its group's row, prompt, prompt ids and
    whether its prompt has images: :func:`group_fields` fills them in for the others; tool episodes add their
    fields, their tools' images as ``tool_images``) and, on the
    reporting rank of a pool, ``report``: ``{"engine", "counts": [aborted, restarted, pool groups, engine steps,
    dropped tokens], "pool_of": whether it speaks for a pool, "pool": the groups in flight or None}``."""

    batch: RolloutBatch
    fields: list[dict]
    report: dict | None
    #: tool episodes: the samples' tool masks (``int8 [total tokens]``) and the engine's AgentStats as a tuple
    mask: np.ndarray | None = None
    agent_stats: tuple | None = None
    #: balanced: the pool's groups this engine ran and how many of them another engine's share placed (its TP
    #: group's first rank; else None), as :class:`~trl_nrollout.rollout.types.JobResult`'s ``balanced``
    pulled: tuple[int, int] | None = None


def _group(key: tuple, ids: list[int], n: int, row: dict, prompt, home: int, images, tools: bool) -> InFlightGroup:
    """A new group of the pool: its ``n`` samples not started (tool episodes: :class:`AgentPartialSample`), its row,
    prompt and ``home`` engine (balanced: whose seeds it draws) in its payload."""
    return InFlightGroup.fresh(key, ids, n, payload={"row": row, "prompt": prompt, "home": home}, images=images,
                               sample=AgentPartialSample if tools else PartialSample)


def run_partial_job(engine, message: dict, state: dict, slices: list[tuple[int, int]], rank: int,
                    balanced: bool) -> PartialJob:
    """Rollout rank ``rank``'s side of a partial job (see the module docstring): the pool step
    (:func:`~trl_nrollout.rollout.partial.pool.pool_step`) the trainers run colocated, on this rank's engine's pool.
    ``slices``: every rollout rank's ``[start, stop)`` of the job's samples (its share under fixed shares);
    ``state``: the rank's state between jobs (its pool under ``"partial_pool"``, the weights' ``"version"``);
    ``balanced``: one pool for the job, on every rollout rank."""
    entry: PartialEntry = message["agent"]
    n, sampling = message["n"], message["sampling"]
    ids, pics = message["prompts"], message.get("images")
    tp = engine.layout.rollout_tp_size
    engines = len(slices) // tp
    home_of = {g: r // tp for r, (a, b) in enumerate(slices) for g in range(a // n, b // n)}
    mine = range(len(ids)) if balanced else [g for r, (a, b) in enumerate(slices) if r // tp == rank // tp
                                             for g in range(a // n, b // n)]
    step, round_, tools, keys, hosts = entry.step, entry.round_, entry.tools, entry.keys, entry.hosts
    new = [_group(tuple(keys[g]) if keys else (step, round_, g), ids[g], n, entry.rows[g], entry.prompts[g],
                  home_of[g], pics[g] if pics else None, tools) for g in mine]
    pool = state.partial_pool if state.partial_pool is not None else []
    if entry.restore:  # the first job after a resume: the checkpoint's pool, dealt over the engines
        pool = list(entry.restore) if balanced else list(entry.restore[rank // tp::engines])
    target = len(new)
    extra = entry.extra if balanced else entry.extra[rank // tp::engines]
    admitted: list[TopUp] = []

    def grow(need: int) -> list[InFlightGroup]:  # the job's groups of this engine and the top-ups it takes
        admitted.extend(extra[:need])
        return new + [_group(tuple(e.key) if keys else (step, round_, len(ids) + k), e.ids, n, e.row, e.prompt,
                             rank // tp, e.images, tools) for k, e in enumerate(admitted)]

    version = state.version
    speaks = rank == 0 if balanced else rank % tp == 0  # for the pool (balanced: the job's, on every rank)
    home = (lambda g: g.payload["home"] % engines) if balanced else None  # (a resumed pool of more engines)
    if tools:  # tool episodes: turn after turn as requests, their tools on each engine's first rank (or home)
        agent, workers = tool_callbacks(state, bool(hosts))
        callbacks = ((lambda groups: contextlib.nullcontext(partial_env_agent(agent, state, groups, n, hosts)))
                     if hosts else fixed_callbacks(agent))
        episodes = tool_groups(engine, sampling, version, callbacks, workers, owns=lambda g: rank % tp == 0,
                               home=home, rule=dispatch_rule(state.dispatch))
    else:
        episodes = sampled_groups(engine, sampling, version, home, rule=dispatch_rule(state.dispatch))
    # environments: a group trains where they live, each trainer its own groups (as many as it drew here), and a
    # sample started again starts its environment again, on the trainer that holds it
    on_restart = (lambda before, after: _reset_restarted(state, before, after, hosts)) if hosts and speaks else None
    quota = (lambda added: dict(sorted(Counter(g.key[2] for g in added[:target]).items()))) if hosts else None
    groups = EngineGroups(pool, episodes, quota=quota, on_restart=on_restart)
    result = pool_step(groups, PoolStep(version, entry.max_staleness, target, entry.oversample), grow)
    chosen, run, state.partial_pool = result.chosen, result.run, groups.groups
    first = slices[rank][0] // n if balanced else sum((b - a) // n for r, (a, b) in enumerate(slices)
                                                      if r // tp == rank // tp and r < rank)
    share = chosen[first:first + (slices[rank][1] - slices[rank][0]) // n]
    samples = [s.episode if tools else s for g in share for s in g.samples]
    batch = RolloutBatch([list(g.prompt_ids) for g in share for _ in g.samples],
                         [s.completion_ids if tools else s.token_ids for s in samples],
                         [s.logprobs for s in samples], [s.finish_reason for s in samples], list(range(len(samples))))
    fields = [{"oldest": s.oldest_version(), **({"row": g.payload["row"], "prompt": g.payload["prompt"],
                                                  "prompt_ids": list(g.prompt_ids), "images": bool(g.images),
                                                  "key": g.key}
                                                 if k == 0 else {})}
              for g in share for k, s in enumerate(g.samples)]
    mask = None
    if tools:  # each episode's tool mask (one flat array) and what the rewards need; its tools' images (PNG bytes)
        mask, episode_fields = episode_extras(samples)  # as "tool_images" ("images" says the group's prompt has some)
        fields = [{**f, **{"tool_images" if k == "images" else k: v for k, v in e.items()}}
                  for f, e in zip(fields, episode_fields)]
    report = None
    if rank % tp == 0:  # the engine's counts; the pool's (balanced: the job's, the same on every rank) once
        keeps = rank == 0 or not balanced
        report = {"engine": rank // tp, "counts": result.counts.report(), "pool_of": keeps,
                  "pool": list(state.partial_pool) if entry.snapshot and keeps else None,
                  "admitted": [tuple(e.key) for e in admitted] if keys else []}
    pulled = None
    if balanced and rank % tp == 0:
        pulled = (len(run.engine_groups), sum(1 for i in run.engine_groups if home(run.ran[i]) != rank // tp))
    return PartialJob(batch, fields, report, mask, None if run.stats is None else astuple(run.stats), pulled)


def run_partial_agent_job(engine, message: dict, state: dict, slices: list[tuple[int, int]], rank: int
                          ) -> PartialJob:
    """Rollout rank ``rank``'s side of a partial job of ``agent=`` episodes: the pool step
    (:func:`~trl_nrollout.rollout.partial.pool.pool_step`) the trainers run colocated, on the pool of live agents it keeps
    between jobs (:class:`~trl_nrollout.rollout.partial.agent_pool.AgentPool`, on an endpoint of its own, with the script's
    agent, or its rollout_func group by group: :func:`rank_runner`; each rank of a TP engine its own pool, their
    calls exchanged): its slice's groups join, with top-ups while it is short; groups that started more than
    ``max_staleness`` versions before the weights it holds start again; the pool runs until as many groups as its
    slice holds have finished, and their episodes' records are answered (the rows stay with the trainers' fields),
    each sample with its group's fields."""
    from trl_nrollout.rollout.partial.agent_pool import AgentPool

    entry: PartialEntry = message["agent"]
    n, sampling = message["n"], message["sampling"]
    if state.agent_pool is None:
        state.agent_pool = AgentPool(rank_runner(state, engine), rank_endpoint(state.agent), rank, len(slices))
    pool: AgentPool = state.agent_pool
    pool.seed_with(sampling)
    version, ranks = state.version, len(slices)
    step, round_, ids = entry.step, entry.round_, message["prompts"]
    if entry.restore:  # the first job after a resume: the checkpoint's groups start again, dealt over the ranks
        restored = entry.restore[rank::ranks]
        pool.add([tuple(g.key) for g in restored], [g.payload["row"] for g in restored],
                 [g.payload["prompt"] for g in restored], n, version)
    mine = list(range(slices[rank][0] // n, slices[rank][1] // n))

    def grow(need: int) -> list[tuple]:  # this rank's groups of the job and the top-ups it takes
        extra = [(rank + ranks * k, e) for k, e in enumerate(entry.extra[rank::ranks])][:need]
        return ([((step, round_, g), entry.rows[g], entry.prompts[g]) for g in mine]
                + [((step, round_, len(ids) + j), e.row, e.prompt) for j, e in extra])

    result = pool_step(LiveGroups(pool, n, live_shares(engine, sampling, n, version)),
                       PoolStep(version, entry.max_staleness, len(mine), entry.oversample), grow)
    chosen, stats = result.chosen, result.run.stats
    func = state.agent.func is not None  # a rollout_func's groups: what it returned travels, not its calls
    records = [replace(r, row={}, calls=[] if func else r.calls)  # (the rows travel in the group's fields)
               for g in chosen for r in g.records]
    batch = RolloutBatch([[] for _ in records], [[] for _ in records], [[] for _ in records], ["stop"] * len(records),
                         list(range(len(records))))
    fields = []
    for i, g in enumerate(chosen):
        for k, r in enumerate(records[i * n:(i + 1) * n]):
            fields.append({"oldest": g.oldest, "record": r,
                           **({"row": g.row, "prompt": g.prompt, "prompt_ids": [], "images": False, "key": g.key}
                              if k == 0 else {})})
    left = [InFlightGroup.fresh(g.key, [], n, payload={"row": g.row, "prompt": g.prompt}) for g in pool.groups]
    report = {"engine": rank, "counts": result.counts.report(), "pool_of": True,
              "pool": left if entry.snapshot else None, "admitted": [], "idle_s": stats["idle_s"]}
    return PartialJob(batch, fields, report)


def close_agent_pool(state: dict) -> None:
    """Close the rollout rank's pool of live agents, if it has one (its episodes end; a later job starts anew)."""
    pool, state.agent_pool = state.agent_pool, None
    if pool is not None:
        pool.close()


def _reset_restarted(state: dict, before: list[InFlightGroup], after: list[InFlightGroup], hosts: list[str]) -> None:
    """Every sample :func:`~trl_nrollout.rollout.episodes.in_flight.drop_stale` started again has its environment reset on the
    trainer that holds it (:data:`RESET_ENV`, sent home as a call)."""
    from trl_nrollout.plan.roles import TRAIN

    roles = state.bridge.roles
    for old, new in zip(before, after):
        for k, (a, b) in enumerate(zip(old.samples, new.samples)):
            if a is not b:
                t = new.key[2]
                home_call(state, hosts[t], (roles.global_rank(TRAIN, t), ("group", new.key), k), RESET_ENV)


def group_fields(fields: list[dict]) -> list[dict]:
    """Each sample's fields of :class:`PartialJob` with its group's (carried on the group's first sample only)."""
    out, group = [], {}
    for f in fields:
        group = {k: f[k] for k in GROUP_FIELDS if k in f} or group
        out.append({**f, **group})
    return out


@job_kind(PartialEntry)
def partial_job(job: RankJob) -> JobDone:
    """A partial job (groups in flight from job to job, :data:`~trl_nrollout.rollout.ranks.jobs.JOB_KINDS`): the
    pool step of ``agent=`` episodes or a ``rollout_func``'s groups (:func:`run_partial_agent_job`), else of
    single-turn or tool episodes (:func:`run_partial_job`). Its prompts are the groups' as the trainers encode them
    (they train wherever they finish): the answer names no expanded prompt."""
    entry: PartialEntry = job.entry
    slices = job.slices()
    done = (run_partial_agent_job(job.engine, job.message, job.state, slices, job.rank) if entry.agents
            else run_partial_job(job.engine, job.message, job.state, slices, job.rank, job.balanced))
    return JobDone(done.batch, balanced=done.pulled, extras=(done.mask, done.fields), agent_stats=done.agent_stats,
                   partial=done.report, expanded=False)
