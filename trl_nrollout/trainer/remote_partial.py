"""The trainers' side of partial rollouts on rollout ranks (``rollout_ranks`` with ``rollout_partial=True``).

The rollout ranks keep the groups in flight (:mod:`trl_nrollout.rollout.remote_partial`); a trainer writes each
step's job with its groups' dataset rows and prompts (and top-up prompts for the pool), ``rollout_lookahead`` steps
ahead as for whole rollouts, and trains the groups that finished first, whichever step drew them: each comes back
with its row and prompt, scored here as the colocated pool's are. A checkpoint keeps the pool the rollout ranks
held after the step's own job (its snapshot travels with the answers of the jobs of the steps that save); the first
job after a resume carries it back.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from accelerate.utils import gather_object

from trl_nrollout.rollout.partial import InFlightGroup
from trl_nrollout.rollout.pool import top_up_candidates
from trl_nrollout.rollout.remote_partial import PartialEntry, TopUp, partial_entry
from trl_nrollout.rollout.tool_episodes import AgentStats, split_tools
from trl_nrollout.rollout.types import RolloutBatch
from trl_nrollout.trainer.multiturn import Episode
from trl_nrollout.trainer.stages import Round, StepContext

logger = logging.getLogger(__name__)


@dataclass
class PartialJobParts:
    """A trainer's part of a partial job: its ``agent`` entry, and its groups' engine ids ``[G][P]`` and images
    (``[G]``, None for text)."""

    entry: PartialEntry
    ids: list[list[int]]
    images: list


class RemotePartialRollouts:
    """Mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: partial rollouts whose pools live on the
    rollout ranks (the trainer's part ``rollout_ranks``, a
    :class:`~trl_nrollout.trainer.rollout_ranks.RolloutRankPlacement`, writes their jobs)."""

    def _engine_prompts(self, prompts: list) -> tuple[list[list[int]], list]:
        """The engine's ids of ``prompts`` (image placeholders not expanded) and each prompt's images (None: text)."""
        enc = self._encode_images(prompts)
        if enc is None:
            return [list(p) for p in self._tokenize_prompts(prompts)[0]], [None] * len(prompts)
        return [list(p) for p in enc.engine_ids], list(enc.images)

    def _saves_after(self, step: int) -> bool:
        """Whether the trainers save a checkpoint after an optimizer step of the rollout of ``step`` (its job then
        answers the pool left in flight): ``save_strategy="steps"`` at each ``save_steps``-th step and the last;
        every rollout for the other strategies but ``"no"``."""
        args = self.args
        if args.save_strategy == "no":
            return False
        if args.save_strategy != "steps":
            return True
        every = int(getattr(self.state, "save_steps", 0) or args.save_steps)
        last = self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None
        span = max(1, math.ceil(self.layout.optimizer_steps_per_rollout))
        return any(s % every == 0 or (last is not None and s >= last) for s in range(step + 1, step + span + 1))

    def _partial_job(self, step: int, rows: list[dict], round_: int = 0) -> PartialJobParts:
        """This rank's part of a partial job of ``rows`` (one per group): its ``agent`` entry
        (:func:`~trl_nrollout.rollout.remote_partial.partial_entry`: the groups' rows and prompts, top-up prompts
        drawn as DAPO draws, one more than ``rollout_partial_oversample`` of its groups, which the engines take while
        their pool is short, and the checkpoint's pool after a resume) and the groups' engine ids and images. With
        environments each group's ``n`` environments are drawn and reset here, and stay until it trains (their tool
        calls come home: ``RolloutRankPlacement.serve_env_tools``). A step's part is made once (its job written ahead and the
        step's own must be equal)."""
        made = self.__dict__.setdefault("_partial_entries", {})
        rows = [dict(r) for r in rows]
        if round_ == 0 and step in made and made[step].entry.rows == rows:
            return made[step]
        args, n = self.args, self.num_generations
        prompts, ids, images, keys = self._partial_groups(step, round_, rows, 0)
        count = top_up_candidates(len(rows), args.rollout_partial_oversample)
        extra = []
        if count:
            drawn = [dict(r) for r in self._draw_inputs(count)[::n]]
            texts, extra_ids, extra_images, extra_keys = self._partial_groups(step, round_, drawn, len(rows))
            extra = [TopUp(r, p, i, im, k)
                     for r, p, i, im, k in zip(drawn, texts, extra_ids, extra_images, extra_keys or [None] * len(drawn))]
        restore = None
        if self.__dict__.pop("_pool_to_restore", False):  # a resumed run's first job: the checkpoint's pool
            restore = self._restored_pool()
        entry = partial_entry(step, round_, rows, prompts, extra, max_staleness=args.max_staleness,
                              oversample=args.rollout_partial_oversample, snapshot=self._saves_after(step),
                              restore=restore, tools=bool(self.tools), keys=keys,
                              host=self.rollout_ranks.env_host.prefix if keys is not None else None,
                              agents=self.agent is not None or self.rollout_func is not None)
        parts = PartialJobParts(entry, ids, images)
        if round_ == 0:
            for old in [s for s in made if s < self.state.global_step]:
                del made[old]
            made[step] = parts
        return parts

    def _partial_groups(self, step: int, round_: int, rows: list[dict], first: int
                        ) -> tuple[list, list[list[int]], list, list[tuple] | None]:
        """New groups of ``rows``: their prompts, engine ids, images (None: text) and, with environments, their
        keys ``(step, round, rank, first + g)``, under which their ``n`` environments wait here (None without)."""
        if not self._has_environments:
            prompts = self._start_episodes(rows)[0]
            return (prompts, *self._engine_prompts(prompts), None)
        prompts, ids, envs = self._start_env_groups(rows, self.num_generations)
        rank = self.accelerator.process_index
        keys = [(step, round_, rank, first + g) for g in range(len(rows))]
        for key, row, group_envs in zip(keys, rows, envs):
            self._hold_env_group(key, row, group_envs)
        return prompts, ids, [None] * len(rows), keys

    def _hold_env_group(self, key: tuple, row: dict, envs: list) -> None:
        """Group ``key``'s environments wait here, their tools registered for the rollout ranks' calls."""
        from trl_nrollout.trainer.multiturn import _environment_tools

        self._partial_envs[key] = envs
        self.__dict__.setdefault("_partial_env_rows", {})[key] = row
        self.rollout_ranks.env_registry[("group", key)] = [split_tools(list(self._standalone_tools) + _environment_tools(env))
                                              for env in envs]

    def _release_env_groups(self, keys: list[tuple]) -> None:
        """The groups' environments go back to TRL's pool (trained, or top-ups the engines did not take)."""
        for key in keys:
            self._partial_envs.pop(key, None)
            self.__dict__.get("_partial_env_rows", {}).pop(key, None)
            self.rollout_ranks.env_registry.pop(("group", key), None)

    def _reset_env(self, key: tuple, k: int) -> None:
        """A rollout rank started sample ``k`` of group ``key`` again (too stale): its environment starts again."""
        self._partial_envs[key][k].reset(**self._reset_kwargs(self._partial_env_rows[key]))

    def _restored_pool(self) -> list:
        """The checkpoint's pool for the first job after a resume: without environments, trainer rank 0's (the
        others hold none); with them, every trainer starts its own groups again with new environments (a checkpoint
        keeps no episodes)."""
        if not self._has_environments:
            return list(self._partial_pool)
        rank = self.accelerator.process_index
        pool = [g for chunk in gather_object([list(self._partial_pool)]) for g in chunk if g.key[2] == rank]
        if not pool:
            return []
        prompts, ids, envs = self._start_env_groups([g.payload["row"] for g in pool], self.num_generations)
        out = []
        for g, prompt, p, e in zip(pool, prompts, ids, envs):
            self._hold_env_group(g.key, g.payload["row"], e)
            out.append(replace(g, prompt_ids=p, payload={**g.payload, "prompt": prompt},
                               samples=[s.restarted() for s in g.samples]))
        self._note_restored_pool(out)
        return out

    def _remote_partial_round(self, ctx: StepContext, round_: int = 0) -> Round:
        """:meth:`~trl_nrollout.trainer.partial.PartialRollouts._partial_round` with engines on rollout ranks: this
        rank's share of the job's first groups to finish, from the pools the rollout ranks keep; the next
        ``rollout_lookahead`` steps' jobs written ahead (round 0 of a training step)."""
        n, mode, step = ctx.n, ctx.mode, self.state.global_step
        t0 = time.perf_counter()
        parts = self._partial_job(step, ctx.inputs[::n], round_)
        entry, ids, images = parts.entry, parts.ids, parts.images
        step_job = round_ == 0
        engine = self.rollout_engine
        batch, fields = engine.run_job_episodes(
            [p for p in ids for _ in range(n)], n, self._sampling(mode, round_=round_), entry,
            ahead=self.rollout_ranks.ahead_jobs(mode) if step_job else (), step_job=step_job,
            images=[im for im in images for _ in range(n)] if any(im is not None for im in images) else None)
        if step_job:
            self.rollout_ranks.log_job(mode)
            if self.accelerator.is_main_process:  # the pool after this job, for a checkpoint after this step
                pools = getattr(engine, "partial_pools", [])
                self._partial_pool = [g for pool in pools if pool is not None for g in pool]
                self._pool_of_step = step if entry.snapshot else None
        inputs = [f["row"] for f in fields]
        sample_prompts = [f["prompt"] for f in fields]
        heads = fields[::n]
        reports = engine.last_job.get("partial") or []
        staleness = [step - (f["oldest"] if f["oldest"] is not None else step) for f in fields]
        every = [s for chunk in gather_object([staleness]) for s in chunk]
        per_engine = [[*r["counts"][:4], max(every, default=0), sum(every) / max(1, len(every)), r["counts"][4]]
                      for r in reports]
        self._log_partial(mode, per_engine, per_engine, [c for c, r in zip(per_engine, reports) if r["pool_of"]])
        if self.agent is not None or self.rollout_func is not None:  # agent= episodes (their records: every call's
            records = [replace(f["record"], row=dict(f["row"])) for f in fields]  # tokens, assembled here) or a
            idle = max((r.get("idle_s", 0.0) for r in reports), default=0.0)  # rollout_func's (what it returned)
            batch, episode = self._records_batch(records, sample_prompts, n,
                                                 self.accelerator.process_index * len(inputs), mode,
                                                 {"idle_s": idle}, time.perf_counter() - t0)
            self.generation_clock.add(batch.num_completion_tokens, time.perf_counter() - t0)
            return self._round_of(inputs, sample_prompts, batch, episode, ctx, t0, rows=inputs)
        if entry.keys is not None:  # environments: those of the groups this rank trains, for the rewards
            self._env_rewards_of([tuple(f["key"]) for f in heads], entry, engine.last_job.get("partial") or [])
        prompt_ids, mm = self._trained_prompts([f["prompt"] for f in heads], batch.prompt_ids[::n],
                                               any(f["images"] for f in heads), n)
        batch = RolloutBatch(prompt_ids, batch.completion_ids, batch.logprobs, batch.finish_reasons,
                             batch.group_index)
        self.generation_clock.add(batch.num_completion_tokens, time.perf_counter() - t0)
        if self.tools:  # tool episodes: their masks (0 on tool results), messages and counts
            self._log_agent_stats(mode, engine.last_job.get("agent_stats") or AgentStats())
            episode = Episode(tool_mask=[f["tool_mask"] for f in fields],
                              completions=[f["completions"] for f in fields], turns=[f["turns"] for f in fields],
                              tool_calls=[f["tool_calls"] for f in fields],
                              tool_failures=[f["tool_failures"] for f in fields])
        else:
            episode = Episode(mm=mm if any(m is not None for m in mm) else None)
        collected = self._round_of(inputs, sample_prompts, batch, episode, ctx, t0, rows=inputs)
        if entry.keys is not None:
            self._release_env_groups([tuple(f["key"]) for f in heads])
        return collected

    def _env_rewards_of(self, keys: list[tuple], entry: PartialEntry, reports: list[dict]) -> None:
        """Before scoring a partial job with environments: the environments of the groups this rank trains (each
        its own: the rollout ranks split a job's finished groups by the trainer that drew them), sample for sample,
        as the reward functions' ``environments=``; this job's top-ups the engines did not take go back."""
        rank = self.accelerator.process_index
        if any(key[2] != rank for key in keys):
            raise RuntimeError(f"trainer {rank} received groups drawn by other trainers ({keys}): with "
                               "environment_factory a group must train where its environments live (a bug).")
        taken = {tuple(k) for r in reports for k in r.get("admitted", [])}
        self._release_env_groups([tuple(e.key) for e in entry.extra if tuple(e.key) not in taken])
        rows = self._partial_env_rows
        self._envs_for_rewards([InFlightGroup(key, [], [None] * self.num_generations, {"row": rows[key]})
                                for key in keys])

    def _remote_pool_to_save(self) -> list:
        """The pool a checkpoint keeps with rollout ranks: trainer rank 0's snapshot of the step's own job (the
        others keep none); none, said in a warning, when the step's job did not answer one."""
        if not self.accelerator.is_main_process:
            return []
        if getattr(self, "_pool_of_step", None) is None:
            logger.warning("rollout_partial on rollout ranks: this checkpoint's step did not ask the rollout ranks for "
                           "their groups in flight (a save the trainer did not foresee from save_strategy): it keeps "
                           "none, and a resumed run starts with an empty pool.")
            return []
        return list(self._partial_pool)
