"""The partial pool's rounds on colocated engines (``rollout_partial=True``, ``rollout_ranks=0``): one per episode
kind the engine runs, chosen once when the trainer builds its pool (:class:`~trl_nrollout.trainer.partial.
PartialPool`). Both run :func:`~trl_nrollout.rollout.partial.pool.pool_step` over their kind's pool:

- :class:`EngineRound`: groups the engine samples (single-turn samples, TRL tool episodes and environments request
  by request: :class:`~trl_nrollout.rollout.partial.pool.EngineGroups`), a pool per engine or, with
  ``rollout_dispatch="balanced"`` over several engines, the job's (see :mod:`trl_nrollout.trainer.partial`);
- :class:`LiveRound`: live endpoint agents or a ``rollout_func``'s groups (:class:`~trl_nrollout.rollout.partial.pool.
  LiveGroups`, :mod:`trl_nrollout.rollout.partial.agent_pool`), a pool per rank, mirrored into the pool's groups (rows
  only) so a checkpoint keeps them and a resumed run starts them again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from accelerate.utils import gather_object

from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.dispatch.agent_runs import start_endpoint
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample
from trl_nrollout.rollout.episodes.partial_tools import AgentPartialSample
from trl_nrollout.rollout.episodes.tools import AgentCallbacks, call_tools, split_tools
from trl_nrollout.rollout.partial.agent_pool import AgentPool
from trl_nrollout.rollout.partial.pool import (
    EngineGroups,
    LiveGroups,
    PoolStep,
    live_balanced,
    live_shares,
    pool_step,
    sampled_groups,
    tool_groups,
    top_up_share,
)
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.multiturn import Episode
from trl_nrollout.trainer.partial_envs import PoolEnvironments
from trl_nrollout.trainer.pool_host import PoolGroups, PoolHost, PromptEncoder, log_partial
from trl_nrollout.trainer.stages import Round, Sample, StepContext


@dataclass
class Colocated:
    """What a colocated round works with: the ``args``, this rank's ``engine`` (its TP group's), the ``layout``,
    this ``rank`` of ``world`` ranks, the trainer's ``host`` callables, the pool's ``groups``, its ``envs``, the
    scoring part, the prompt ``encoder``, the ``metrics`` sink, the ``clock`` of generated tokens, TRL's ``tools``
    (None: none), the async ``loop``, the ``tokenizer`` and ``log_completions``."""

    args: Any
    engine: Any
    layout: Any
    rank: int
    world: int
    host: PoolHost
    groups: PoolGroups
    envs: PoolEnvironments
    scoring: Any
    encoder: PromptEncoder
    metrics: Metrics
    clock: Any
    tools: list | None
    loop: Any
    tokenizer: Any
    log_completions: bool


class EngineRound:
    """A partial round of groups this rank's engine samples (see the module docstring)."""

    def __init__(self, on: Colocated) -> None:
        self.on = on
        self.rule = dispatch_rule(on.args.rollout_dispatch)

    def round(self, ctx: StepContext, round_: int = 0) -> Round:
        """The step's groups from the pool: this rank's share of the ``target`` groups that finished first (the
        job's samples ``[G]``, gathered, and their rewards ``[G, F]``). ``round_`` > 0: one of DAPO's extra rounds
        (``filter_groups``), ``ctx.inputs`` then its fresh prompts; the filtered groups left the pool already, so
        their slots go to the pool's other groups and these new ones at once."""
        on = self.on
        args, n, engine, host = on.args, ctx.n, on.engine, on.host
        version = host.step()
        t0 = time.perf_counter()
        rows = ctx.inputs[::n]
        rank = on.rank
        tp = len(engine.tp_ranks)
        # a job-wide dispatch rule (rollout_dispatch="balanced") with several engines: one pool for the job, the same
        # on every rank, whose groups every engine pulls from (rollout/dispatch/partial_queue.py); else a pool per
        # engine (its TP group's ranks)
        job = self.rule.job_wide and engine.balances_job
        counts = gather_object([len(rows)]) if job else [len(rows)] * tp
        gather = engine.gather_job if job else engine.gather_tp  # over the pool's ranks
        ways, index = (len(counts), rank) if job else (tp, engine.tp_ranks.index(rank))  # who draws top-ups
        target = sum(counts) if job else len(rows) * tp  # the pool's share of the step's groups

        def grow(need: int) -> list[InFlightGroup]:  # this rank's groups and its share of the top-ups, every rank's
            new = self._new_groups(rows, n, version, round_, 0)
            if extra := top_up_share(need, ways, index):  # drawn as DAPO draws
                new += self._new_groups(host.draw_inputs(extra)[::n], n, version, round_, len(rows))
            return [g for chunk in gather(new) for g in chunk]  # the pool's new groups, rank order

        pool = self._engine_pool(ctx, round_, job, counts, gather, version)
        result = pool_step(pool, PoolStep(version, args.max_staleness, target, args.rollout_partial_oversample), grow)
        chosen, run, on.groups.groups = result.chosen, result.run, pool.groups
        if on.tools:
            host.log_agent_stats(ctx.mode, run.stats)
        engine.sleep()
        mine_at = sum(counts[:rank]) if job else engine.tp_ranks.index(rank) * len(rows)
        mine = chosen[mine_at:mine_at + len(rows)]
        t1 = time.perf_counter()
        # this rank's share of its engine's tokens, as a synchronous round counts
        gen_tokens = run.new_tokens // tp
        on.clock.add(gen_tokens, t1 - t0)

        inputs = [g.payload["row"] for g in mine for _ in range(n)]
        sample_prompts = [g.payload["prompt"] for g in mine for _ in range(n)]
        flat = [s for g in mine for s in g.samples]
        mm_local = None  # a VLM's image tensors of this rank's samples, where they do not travel with them
        prompt_ids, mm = on.encoder.trained([g.payload["prompt"] for g in mine], [g.prompt_ids for g in mine],
                                            any(g.images for g in mine), n)
        if on.tools:  # an episode: its turns and tool results (masked), its messages for the rewards
            episodes = [s.episode for s in flat]
            if any(e.images for e in episodes):  # its tools' images: the tensors of all its images, in order
                mm = on.encoder.episode_tensors(mm, [g.images or [] for g in mine for _ in range(n)],
                                                [e.images for e in episodes])
            samples = [Sample(p, e.completion_ids, e.logprobs, e.finish_reason, e.tool_mask, mm=m)
                       for p, m, e in zip(prompt_ids, mm, episodes)]
            completions = [e.messages for e in episodes]
            host.log_turns(ctx.mode, Episode(turns=[e.turns for e in episodes],
                                             tool_calls=[e.tool_calls for e in episodes],
                                             tool_failures=[e.tool_failures for e in episodes]))
        else:
            samples = [Sample(p, s.token_ids, s.logprobs, s.finish_reason, mm=m)
                       for p, m, s in zip(prompt_ids, mm, (s for g in mine for s in g.samples))]
            completions = host.decode(sample_prompts, [s.completion_ids for s in samples])
        if not (args.balance_batch or args.filter_groups):  # image tensors stay here (see _one_round)
            mm_local = [s.mm for s in samples] if any(m is not None for m in mm) else None
            samples = [replace(s, mm=None) for s in samples]
        completion_ids = [s.completion_ids for s in samples]
        if envs := on.envs.enabled:  # the reward functions' environments=: those of the samples trained, in order
            on.envs.for_rewards(mine)
        scores = on.scoring.score(inputs, sample_prompts, completions, completion_ids, mode=ctx.mode,
                                  state=host.state(), environments=on.envs.current())
        if envs:
            on.envs.release(chosen)
        t2 = time.perf_counter()
        table = None
        if on.log_completions:
            table = {"prompt": gather_object(sample_prompts), "completion": gather_object(list(completions)),
                     "images": None, "extra": scores.extra_logs}
        staleness = [version - (s.oldest_version() if s.oldest_version() is not None else version) for s in flat]
        counts = gather_object([result.counts.row(staleness)])
        per_engine = counts[::len(engine.tp_ranks)]  # one entry per engine (its TP ranks agree)
        per_pool = counts[:1] if job else per_engine  # the job's pool is on every rank; else one per engine
        log_partial(on.metrics, ctx.mode, counts, per_engine, per_pool)
        return Round(gather_object(samples), scores.rewards, gen_s=t1 - t0, reward_s=t2 - t1,
                     gen_tokens=gen_tokens, table=table, rows=inputs, mm_local=mm_local)

    def _engine_pool(self, ctx: StepContext, round_: int, job: bool, counts: list[int], gather, version: int
                     ) -> EngineGroups:
        """This rank's engine's pool (``job``: the job's, the same on every rank) as the pool step runs it: its
        episodes (single-turn samples, or tool episodes with this trainer's tools), and with environments its homes
        (each rank trains its own groups: as many as it drew, ``counts``), a resumed pool's groups given new
        environments (the pool's ranks agreeing on them, over ``gather``) and restarted samples' environments reset."""
        on = self.on
        args, n, engine, rank = on.args, ctx.n, on.engine, on.rank
        envs = on.envs.enabled
        homed = envs and (len(engine.tp_ranks) > 1 or job)  # a pool of several ranks: a group trains where its envs live
        quota = dict(enumerate(counts)) if job else dict.fromkeys(engine.tp_ranks, counts[0])
        sampling = on.host.sampling(ctx.mode, round_=round_)
        home = (lambda g: on.layout.engine_of_rank(g.key[2])) if job else None
        if on.tools:  # tool-calling episodes, turn after turn as requests (rollout/episodes/partial_tools.py)

            @contextlib.contextmanager
            def callbacks(groups: list[InFlightGroup]):
                agent = self._partial_agent()
                if envs:  # each sample's tools are its environment's methods
                    agent = on.envs.agent(agent, groups, n)
                if not job:
                    yield agent
                    return
                # the job's episodes from one queue: with environments, each sample's tools run on its home rank
                with on.host.home_tools(envs, lambda i: groups[i // n].key[2], agent.run_tools) as run_tools:
                    yield replace(agent, run_tools=run_tools)

            episodes = tool_groups(engine, sampling, version, callbacks, args.tool_workers,
                                   owns=lambda g: g.key[2] == rank, home=home, rule=self.rule)
        else:
            episodes = sampled_groups(engine, sampling, version, home, rule=self.rule)

        def before_restart(pool: list[InFlightGroup]) -> list[InFlightGroup]:
            before = on.envs.restore_groups(pool, rank)
            if homed:  # each rank restarted its own groups after a resume: the pool's ranks agree on it again
                before = _agree(before, gather([g for g, old in zip(before, pool) if g is not old]))
            return before

        return EngineGroups(on.groups.groups, episodes, quota=(lambda new: quota) if homed else None,
                            before_restart=before_restart if envs else None,
                            on_restart=on.envs.reset_restarted if envs else None)

    def _new_groups(self, rows: list[dict], n: int, version: int, round_: int, first: int) -> list[InFlightGroup]:
        """The pool's new groups of this rank's dataset ``rows`` (one per prompt, ``n`` samples, keyed ``(version,
        round, rank, first + g)``): each with the prompt's engine ids (image placeholders not expanded) and its images."""
        on = self.on
        kind = AgentPartialSample if on.tools else PartialSample
        keys = [(version, round_, on.rank, first + g) for g in range(len(rows))]
        if on.envs.enabled:  # n environments per group, reset with its row (trainer/partial_envs.py)
            prompts, ids, envs, images = on.envs.start_groups(rows, n)
            on.envs.by_key.update(zip(keys, envs))
            return [InFlightGroup.fresh(key, p, n, payload={"row": dict(row), "prompt": prompt}, sample=kind,
                                        images=pics) for key, p, row, prompt, pics in zip(keys, ids, rows, prompts, images)]
        prompts, _ = on.host.start_episodes(rows)
        images = on.host.encode_images(prompts)  # None for text; refuses what images do not run with, a tokenizer
        ids = images.engine_ids if images is not None else on.host.tokenize(prompts)
        return [InFlightGroup.fresh(key, list(p), n, payload={"row": dict(row), "prompt": prompt}, sample=kind,
                                    images=images.images[g] if images is not None else None)
                for g, (key, p, row, prompt) in enumerate(zip(keys, ids, rows, prompts))]

    def _partial_agent(self) -> AgentCallbacks:
        """What the pool's tool-calling episodes need from the trainer: TRL's parser and tools (the same for every
        sample; with environments, :meth:`PoolEnvironments.agent` gives each sample its own), the tool results'
        tokens, the limits."""
        on = self.on
        loop = on.loop
        sync, asyn = split_tools(list(on.tools or []))
        max_len = getattr(on.engine, "max_model_len", None) or on.host.context_length() or 1 << 30
        return AgentCallbacks(
            parse=on.host.parse_turn, run_tools=lambda i, calls: call_tools(calls, sync, asyn, loop=loop),
            suffix_ids=on.host.suffix_ids, max_iterations=on.args.max_tool_calling_iterations,
            max_completion_length=on.args.max_completion_length, max_model_len=max_len, media=on.encoder.tool_media())

    def to_save(self) -> list[InFlightGroup]:
        """The pool a checkpoint keeps (with environments: without its episodes)."""
        return self.on.envs.to_save(self.on.groups.groups)

    def close(self) -> None:
        """Nothing of its own to release (the engine is the trainer's)."""


class LiveRound:
    """A partial round of live endpoint agents or a ``rollout_func``'s groups (see the module docstring)."""

    def __init__(self, on: Colocated) -> None:
        self.on = on
        self.rule = dispatch_rule(on.args.rollout_dispatch)
        self.pool: AgentPool | None = None

    def round(self, ctx: StepContext, round_: int = 0) -> Round:
        """The step's new groups (and ``rollout_partial_oversample``'s) join this rank's pool, stale groups start
        again, the pool runs until as many of its groups have finished as the rank drew prompts, and those train
        (the job's samples, gathered): the pool step of :func:`~trl_nrollout.rollout.partial.pool.pool_step`."""
        on = self.on
        args, n, mode, host = on.args, ctx.n, ctx.mode, on.host
        version, rank, engine = host.step(), on.rank, on.engine
        t0 = time.perf_counter()
        pool = self._live_pool()
        sampling = host.sampling(mode, round_=round_)
        pool.seed_with(sampling)
        if not pool.groups and on.groups.groups:  # restored from a checkpoint: its groups start again
            restored = list(on.groups.groups)
            pool.add([g.key for g in restored], [g.payload["row"] for g in restored],
                     [g.payload["prompt"] for g in restored], n, version)

        def grow(need: int) -> list[tuple]:  # this rank's rows and its top-ups (drawn as DAPO draws)
            rows = ctx.inputs[::n] + (host.draw_inputs(need)[::n] if need else [])
            prompts = host.start_episodes(rows)[0]
            return [((version, round_, rank, g), row, p) for g, (row, p) in enumerate(zip(rows, prompts))]

        balanced = self.rule.job_wide and engine.balances_job  # the job's queue (dispatch/balanced.py job_queue)
        episodes = (live_balanced(engine, sampling, n, version, rank, on.layout.engine_of_rank) if balanced
                    else live_shares(engine, sampling, n, version))
        step = pool_step(LiveGroups(pool, n, episodes),
                         PoolStep(version, args.max_staleness, len(ctx.inputs) // n, args.rollout_partial_oversample),
                         grow)
        if step.run.moved is not None:
            on.metrics.add(mode, "rollout/moved_groups", step.run.moved)
        engine.sleep()
        on.groups.groups = [InFlightGroup.fresh(g.key, [], n, payload={"row": g.row, "prompt": g.prompt})
                            for g in pool.groups]
        chosen, stats = step.chosen, step.run.stats
        inputs = [g.row for g in chosen for _ in range(n)]
        prompts = [g.prompt for g in chosen for _ in range(n)]
        records = [r for g in chosen for r in g.records]
        batch, episode = host.records_batch(records, prompts, n, rank * len(inputs), mode, stats,
                                            time.perf_counter() - t0)
        on.clock.add(batch.num_completion_tokens, time.perf_counter() - t0)
        counts = gather_object([step.counts.row([version - g.oldest for g in chosen])])  # (oldest token)
        log_partial(on.metrics, mode, counts, counts, counts)  # a pool per rank; its calls carried are its own
        return host.round_of(inputs, prompts, batch, episode, ctx, t0, rows=inputs)

    def _live_pool(self) -> AgentPool:
        """This rank's pool of agent episodes (or of a ``rollout_func``'s groups) in flight, with an endpoint of its
        own (started once)."""
        on = self.on
        if self.pool is None:
            self.pool = AgentPool(on.host.episode_runner(),
                                  start_endpoint(on.tokenizer, **on.host.endpoint_settings(on.engine.max_model_len)),
                                  on.rank, on.world)
        return self.pool

    def to_save(self) -> list[InFlightGroup]:
        """The pool a checkpoint keeps: its groups' rows and prompts (a resumed run starts them again)."""
        return self.on.envs.to_save(self.on.groups.groups)

    def close(self) -> None:
        """The live pool's endpoint and agents stop."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _agree(pool: list[InFlightGroup], every: list[list[InFlightGroup]]) -> list[InFlightGroup]:
    """``pool`` with each group replaced by its home rank's copy (``every``: each rank of the engine its own groups,
    as it holds them): after a resume each rank restarted its own groups' episodes with new environments."""
    by_key = {g.key: g for chunk in every for g in chunk}
    return [by_key.get(g.key, g) for g in pool]
