"""The trainers' side of partial rollouts on rollout ranks (``rollout_ranks`` with ``rollout_partial=True``).

The rollout ranks keep the groups in flight (:mod:`trl_nrollout.rollout.ranks.partial`); a trainer writes each
step's job with its groups' dataset rows and prompts (and top-up prompts for the pool), ``rollout_lookahead`` steps
ahead as for whole rollouts, and trains the groups that finished first, whichever step drew them: each comes back
with its row and prompt, scored here as the colocated pool's are. A checkpoint keeps the pool the rollout ranks
held after the step's own job (its snapshot travels with the answers of the jobs of the steps that save); the first
job after a resume carries it back.

:class:`RemoteRound` is the partial pool's round for this placement (chosen once when the trainer builds its pool,
:class:`~trl_nrollout.trainer.partial.PartialPool`); what it needs of the rollout-rank side is :class:`RankSide`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from accelerate.utils import gather_object

from trl_nrollout.passes.multimodal import prompt_images
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup
from trl_nrollout.rollout.episodes.tools import AgentStats
from trl_nrollout.rollout.partial.pool import top_up_candidates
from trl_nrollout.rollout.ranks.buckets import decode_job_images
from trl_nrollout.rollout.ranks.partial import PartialEntry, TopUp, partial_entry
from trl_nrollout.rollout.types import RolloutBatch
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.multiturn import Episode
from trl_nrollout.trainer.partial_envs import PoolEnvironments
from trl_nrollout.trainer.pool_host import PoolGroups, PoolHost, PromptEncoder, log_partial
from trl_nrollout.trainer.stages import Round, StepContext

logger = logging.getLogger(__name__)


@dataclass
class PartialJobParts:
    """A trainer's part of a partial job: its ``agent`` entry, and its groups' engine ids ``[G][P]`` and images
    (``[G]``, None for text)."""

    entry: PartialEntry
    ids: list[list[int]]
    images: list


@dataclass
class RankSide:
    """What the partial pool needs of the rollout-rank side of the trainer: ``engine`` (the
    :class:`~trl_nrollout.rollout.ranks.client.RemoteEngines`: ``run_job_episodes``, ``last_job``, ``partial_pools``),
    ``ahead_jobs(mode)`` (the next ``rollout_lookahead`` steps' jobs, written with the step's own),
    ``log_remote(mode)`` (the step's wait, staleness and transfer metrics), and with environments whose tool calls come
    home the ``env_prefix`` of their host (the store prefix the rollout ranks call; None without)."""

    engine: Any
    ahead_jobs: Callable[[str], list]
    log_remote: Callable[[str], None]
    env_prefix: str | None = None


def engine_prompts(prompts: list, encode_images: Callable[[list], Any], tokenize: Callable[[list], list[list[int]]]
                   ) -> tuple[list[list[int]], list]:
    """The engine's ids of ``prompts`` (image placeholders not expanded) and each prompt's images (None: text)."""
    enc = encode_images(prompts)
    if enc is None:
        return [list(p) for p in tokenize(prompts)], [None] * len(prompts)
    return [list(p) for p in enc.engine_ids], list(enc.images)


def saves_after(args, state, steps_per_rollout: float, step: int) -> bool:
    """Whether the trainers save a checkpoint after an optimizer step of the rollout of ``step`` (its job then
    answers the pool left in flight): ``save_strategy="steps"`` at each ``save_steps``-th step and the last;
    every rollout for the other strategies but ``"no"``. ``state``: TRL's ``TrainerState`` (``save_steps``,
    ``max_steps``); ``steps_per_rollout``: the layout's optimizer steps per rollout."""
    if args.save_strategy == "no":
        return False
    if args.save_strategy != "steps":
        return True
    every = int(getattr(state, "save_steps", 0) or args.save_steps)
    last = state.max_steps if state.max_steps and state.max_steps > 0 else None
    span = max(1, math.ceil(steps_per_rollout))
    return any(s % every == 0 or (last is not None and s >= last) for s in range(step + 1, step + span + 1))


class RemoteRound:
    """The partial pool's round with engines on rollout ranks (see the module docstring). ``agents``: endpoint
    agents or a ``rollout_func`` run there (their records come back), else engine groups (TRL tools when
    ``tools``)."""

    def __init__(self, args, layout, rank: int, main_process: bool, n: int, host: PoolHost, side: RankSide,
                 groups: PoolGroups, envs: PoolEnvironments, encoder: PromptEncoder, metrics: Metrics, clock, *,
                 tools: bool, agents: bool) -> None:
        self.args, self.layout, self.rank, self.main_process, self.n = args, layout, rank, main_process, n
        self.host, self.side, self.groups, self.envs = host, side, groups, envs
        self.encoder, self.metrics, self.clock = encoder, metrics, clock
        self.tools, self.agents = tools, agents
        self.made: dict[int, PartialJobParts] = {}  # step -> its part, made once (written ahead, then its own)

    def job(self, step: int, rows: list[dict], round_: int = 0) -> PartialJobParts:
        """This rank's part of a partial job of ``rows`` (one per group): its ``agent`` entry
        (:func:`~trl_nrollout.rollout.ranks.partial.partial_entry`: the groups' rows and prompts, top-up prompts
        drawn as DAPO draws, one more than ``rollout_partial_oversample`` of its groups, which the engines take while
        their pool is short, and the checkpoint's pool after a resume) and the groups' engine ids and images. With
        environments each group's ``n`` environments are drawn and reset here, and stay until it trains (their tool
        calls come home: the rank side serves them). A step's part is made once (its job written ahead and the
        step's own must be equal)."""
        made = self.made
        rows = [dict(r) for r in rows]
        if round_ == 0 and step in made and made[step].entry.rows == rows:
            return made[step]
        args, n = self.args, self.n
        prompts, ids, images, keys = self._groups(step, round_, rows, 0)
        count = top_up_candidates(len(rows), args.rollout_partial_oversample)
        extra = []
        if count:
            drawn = [dict(r) for r in self.host.draw_inputs(count)[::n]]
            texts, extra_ids, extra_images, extra_keys = self._groups(step, round_, drawn, len(rows))
            extra = [TopUp(r, p, i, im, k)
                     for r, p, i, im, k in zip(drawn, texts, extra_ids, extra_images, extra_keys or [None] * len(drawn))]
        restore = None
        if self.groups.restore:  # a resumed run's first job: the checkpoint's pool
            self.groups.restore = False
            restore = self.restored()
        entry = partial_entry(step, round_, rows, prompts, extra, max_staleness=args.max_staleness,
                              oversample=args.rollout_partial_oversample,
                              snapshot=saves_after(args, self.host.state(), self.layout.optimizer_steps_per_rollout,
                                                   step),
                              restore=restore, tools=self.tools, keys=keys,
                              host=self.side.env_prefix if keys is not None else None, agents=self.agents)
        parts = PartialJobParts(entry, ids, images)
        if round_ == 0:
            now = self.host.step()
            for old in [s for s in made if s < now]:
                del made[old]
            made[step] = parts
        return parts

    def _groups(self, step: int, round_: int, rows: list[dict], first: int
                ) -> tuple[list, list[list[int]], list, list[tuple] | None]:
        """New groups of ``rows``: their prompts, engine ids, images (None: text) and, with environments, their
        keys ``(step, round, rank, first + g)``, under which their ``n`` environments wait here (None without)."""
        host = self.host
        if not self.envs.enabled:
            prompts = host.start_episodes(rows)[0]
            return (prompts, *engine_prompts(prompts, host.encode_images, host.tokenize), None)
        prompts, ids, envs, images = self.envs.start_groups(rows, self.n)  # (an observation's images: with them)
        keys = [(step, round_, self.rank, first + g) for g in range(len(rows))]
        for key, row, group_envs in zip(keys, rows, envs):
            self.envs.hold(key, row, group_envs)
        return prompts, ids, images, keys

    def restored(self) -> list:
        """The checkpoint's pool for the first job after a resume: without environments, trainer rank 0's (the
        others hold none); with them, every trainer starts its own groups again with new environments (a checkpoint
        keeps no episodes)."""
        if not self.envs.enabled:
            return list(self.groups.groups)
        pool = [g for chunk in gather_object([list(self.groups.groups)]) for g in chunk if g.key[2] == self.rank]
        if not pool:
            return []
        prompts, ids, envs, _ = self.envs.start_groups([g.payload["row"] for g in pool], self.n)
        out = []
        for g, prompt, p, e in zip(pool, prompts, ids, envs):
            self.envs.hold(g.key, g.payload["row"], e)
            out.append(replace(g, prompt_ids=p, payload={**g.payload, "prompt": prompt},
                               samples=[s.restarted() for s in g.samples]))
        self.envs.note_restored(out)
        return out

    def round(self, ctx: StepContext, round_: int = 0) -> Round:
        """This rank's share of the job's first groups to finish, from the pools the rollout ranks keep; the next
        ``rollout_lookahead`` steps' jobs written ahead (round 0 of a training step)."""
        n, mode, host, step = ctx.n, ctx.mode, self.host, self.host.step()
        t0 = time.perf_counter()
        parts = self.job(step, ctx.inputs[::n], round_)
        entry, ids, images = parts.entry, parts.ids, parts.images
        step_job = round_ == 0
        engine = self.side.engine
        batch, fields = engine.run_job_episodes(
            [p for p in ids for _ in range(n)], n, host.sampling(mode, round_=round_), entry,
            ahead=self.side.ahead_jobs(mode) if step_job else (), step_job=step_job,
            images=[im for im in images for _ in range(n)] if any(im is not None for im in images) else None)
        if step_job:
            self.side.log_remote(mode)
            if self.main_process:  # the pool after this job, for a checkpoint after this step
                pools = getattr(engine, "partial_pools", [])
                self.groups.groups = [g for pool in pools if pool is not None for g in pool]
                self.groups.of_step = step if entry.snapshot else None
        inputs = [f["row"] for f in fields]
        sample_prompts = [f["prompt"] for f in fields]
        heads = fields[::n]
        reports = engine.last_job.get("partial") or []
        staleness = [step - (f["oldest"] if f["oldest"] is not None else step) for f in fields]
        every = [s for chunk in gather_object([staleness]) for s in chunk]
        per_engine = [[*r["counts"][:4], max(every, default=0), sum(every) / max(1, len(every)), r["counts"][4]]
                      for r in reports]
        log_partial(self.metrics, mode, per_engine, per_engine, [c for c, r in zip(per_engine, reports) if r["pool_of"]])
        if self.agents:  # agent= episodes (their records: every call's tokens, assembled here) or a rollout_func's
            records = [replace(f["record"], row=dict(f["row"])) for f in fields]  # (what it returned)
            idle = max((r.get("idle_s", 0.0) for r in reports), default=0.0)
            batch, episode = host.records_batch(records, sample_prompts, n, self.rank * len(inputs), mode,
                                                {"idle_s": idle}, time.perf_counter() - t0)
            self.clock.add(batch.num_completion_tokens, time.perf_counter() - t0)
            return host.round_of(inputs, sample_prompts, batch, episode, ctx, t0, rows=inputs)
        if entry.keys is not None:  # environments: those of the groups this rank trains, for the rewards
            self._env_rewards_of([tuple(f["key"]) for f in heads], entry, engine.last_job.get("partial") or [])
        prompt_ids, mm = self.encoder.trained([f["prompt"] for f in heads], batch.prompt_ids[::n],
                                              any(f["images"] for f in heads), n)
        batch = RolloutBatch(prompt_ids, batch.completion_ids, batch.logprobs, batch.finish_reasons,
                             batch.group_index)
        self.clock.add(batch.num_completion_tokens, time.perf_counter() - t0)
        if self.tools:  # tool episodes: their masks (0 on tool results), messages and counts
            host.log_agent_stats(mode, engine.last_job.get("agent_stats") or AgentStats())
            tool_images = decode_job_images([f.get("tool_images", []) for f in fields])  # (PNG bytes, in order)
            if any(tool_images):  # their forward: the prompt's images, then the tools'
                mm = self.encoder.episode_tensors(mm, [prompt_images(p) if isinstance(p, list) else []
                                                       for p in sample_prompts], tool_images)
            episode = Episode(tool_mask=[f["tool_mask"] for f in fields],
                              completions=[f["completions"] for f in fields], turns=[f["turns"] for f in fields],
                              tool_calls=[f["tool_calls"] for f in fields],
                              tool_failures=[f["tool_failures"] for f in fields],
                              mm=mm if any(m is not None for m in mm) else None)
        else:
            episode = Episode(mm=mm if any(m is not None for m in mm) else None)
        collected = host.round_of(inputs, sample_prompts, batch, episode, ctx, t0, rows=inputs)
        if entry.keys is not None:
            self.envs.release_keys([tuple(f["key"]) for f in heads])
        return collected

    def _env_rewards_of(self, keys: list[tuple], entry: PartialEntry, reports: list[dict]) -> None:
        """Before scoring a partial job with environments: the environments of the groups this rank trains (each
        its own: the rollout ranks split a job's finished groups by the trainer that drew them), sample for sample,
        as the reward functions' ``environments=``; this job's top-ups the engines did not take go back."""
        rank = self.rank
        if any(key[2] != rank for key in keys):
            raise RuntimeError(f"trainer {rank} received groups drawn by other trainers ({keys}): with "
                               "environment_factory a group must train where its environments live (a bug).")
        taken = {tuple(k) for r in reports for k in r.get("admitted", [])}
        self.envs.release_keys([tuple(e.key) for e in entry.extra if tuple(e.key) not in taken])
        rows = self.envs.rows
        self.envs.for_rewards([InFlightGroup(key, [], [None] * self.n, {"row": rows[key]}) for key in keys])

    def to_save(self) -> list:
        """The pool a checkpoint keeps with rollout ranks: trainer rank 0's snapshot of the step's own job (the
        others keep none); none, said in a warning, when the step's job did not answer one."""
        if not self.main_process:
            return []
        if self.groups.of_step is None:
            logger.warning("rollout_partial on rollout ranks: this checkpoint's step did not ask the rollout ranks for "
                           "their groups in flight (a save the trainer did not foresee from save_strategy): it keeps "
                           "none, and a resumed run starts with an empty pool.")
            return []
        return list(self.groups.groups)

    def close(self) -> None:
        """Nothing of its own to release (the rollout ranks close their pools)."""
