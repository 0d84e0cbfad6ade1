"""The trainer's side of partial rollouts (``rollout_partial=True``): the pool of groups in flight across steps.

Each step this rank's new prompts join its engine's pool (gathered over the TP group, so every rank of an engine
holds the same pool), samples staler than ``max_staleness`` start again, the engine runs the pool until the step's
groups have finished (:func:`~trl_nrollout.rollout.dispatch.shares.run_partial`), and the first groups
to finish train, this rank taking its share. The rest stays in the pool, saved in every checkpoint (one file per
rank), so a resumed run continues the samples that were in flight.

With ``rollout_dispatch="balanced"`` and several engines the pool is the job's (every rank's new prompts gathered
over every rank, so every rank holds the same pool): its unfinished groups form one queue the engines pull from
(:func:`~trl_nrollout.rollout.dispatch.balanced.run_partial_balanced`), the job's first groups to
finish train, rank ``r`` taking the ``r``-th share of them. Tool-calling episodes too
(:func:`~trl_nrollout.rollout.dispatch.balanced.run_partial_agents_balanced`): a group's turns and
tools run on the engine that pulled it (its first rank's tools: ``tools=`` are the same on every rank), and every
engine's groups, episodes and masks included, reach every rank afterwards.

Image prompts: a group holds its prompt's engine ids (placeholders not expanded) and its images, sent with every
request of the group, a continued sample's included; when it trains, the processor encodes its prompt again (the
expanded ids and the image tensors the model trains on). A checkpoint's pool keeps the images: a PIL image in the
JSON is written as ``{"__image_png__": <base64 PNG>}`` (lossless) and read back as a PIL image.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import time
from dataclasses import asdict, replace

from accelerate.utils import gather_object

from trl_nrollout.passes.multimodal import encode_prompts
from trl_nrollout.rollout.axes import machine_refusal
from trl_nrollout.rollout.partial import InFlightGroup, PartialSample
from trl_nrollout.rollout.partial_tool_episodes import AgentPartialSample
from trl_nrollout.rollout.pool import (
    EngineGroups,
    PoolStep,
    pool_step,
    sampled_groups,
    tool_groups,
    top_up_share,
)
from trl_nrollout.rollout.tool_episodes import AgentCallbacks, AgentSample, call_tools, split_tools
from trl_nrollout.trainer.multiturn import Episode
from trl_nrollout.trainer.partial_envs import PartialEnvironments
from trl_nrollout.trainer.stages import Round, Sample, StepContext

logger = logging.getLogger(__name__)

#: the in-flight pool of a rank, in each checkpoint
POOL_FILE = "nrollout_partial_rank{rank}.json"


class PartialRollouts(PartialEnvironments):
    """Mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: the partial-rollout step and its pool
    (with ``environment_factory``, its environments: :class:`PartialEnvironments`)."""

    def _check_partial(self) -> None:
        """``rollout_partial=True`` on this trainer: refused with the reason (:meth:`_partial_refusal`), or noted
        once where it changes how an option acts (tool episodes run request by request under ``'turns'``)."""
        from trl_nrollout.config.trl_options import UnsupportedTRLOption

        if (why := self._partial_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        if self.tools and self.args.rollout_multi_turn == "turns" and self.accelerator.is_main_process:
            logger.info("rollout_partial=True: the training steps' tool episodes run request by request (a partial "
                        "rollout has no turn barrier: it stops before its slowest samples); rollout_multi_turn='turns' "
                        "applies to whole rollouts (evaluation).")

    def _partial_refusal(self) -> str | None:
        """Why this trainer cannot roll out partially (None when it can)."""
        if self.rollout_backend != "vllm":
            return machine_refusal("rollout_partial=True", "rollout_partial=False", auto=True)
        return None

    def _partial_round(self, ctx: StepContext, round_: int = 0) -> Round:
        """The step's groups from the pool: this rank's share of the ``target`` groups that finished first (the
        job's samples ``[G]``, gathered, and their rewards ``[G, F]``). ``round_`` > 0: one of DAPO's extra rounds
        (``filter_groups``), ``ctx.inputs`` then its fresh prompts; the filtered groups left the pool already, so
        their slots go to the pool's other groups and these new ones at once."""
        if self._on_rollout_ranks:  # the pools live on the rollout ranks (trainer/remote_partial.py)
            return self._remote_partial_round(ctx, round_)
        if self.agent is not None or self.rollout_func is not None:  # a pool of live agents, or of a rollout_func's
            return self._agent_partial_round(ctx, round_)  # groups (rollout/func_pool.py), trainer/agents.py
        args, n, engine = self.args, ctx.n, self.rollout_engine
        version = self.state.global_step
        t0 = time.perf_counter()
        rows = ctx.inputs[::n]
        rank = self.accelerator.process_index
        tp = len(engine.tp_ranks)
        # rollout_dispatch="balanced" with several engines: one pool for the job, the same on every rank, whose
        # groups every engine pulls from (rollout/partial_queue.py); else a pool per engine (its TP group's ranks)
        job = args.rollout_dispatch == "balanced" and engine.balances_job
        counts = gather_object([len(rows)]) if job else [len(rows)] * tp
        gather = engine.gather_job if job else engine.gather_tp  # over the pool's ranks
        ways, index = (len(counts), rank) if job else (tp, engine.tp_ranks.index(rank))  # who draws top-ups
        target = sum(counts) if job else len(rows) * tp  # the pool's share of the step's groups

        def grow(need: int) -> list[InFlightGroup]:  # this rank's groups and its share of the top-ups, every rank's
            new = self._new_groups(rows, n, version, round_, rank, 0)
            if extra := top_up_share(need, ways, index):  # drawn as DAPO draws
                new += self._new_groups(self._draw_inputs(extra)[::n], n, version, round_, rank, len(rows))
            return [g for chunk in gather(new) for g in chunk]  # the pool's new groups, rank order

        pool = self._engine_pool(ctx, round_, job, counts, gather)
        result = pool_step(pool, PoolStep(version, args.max_staleness, target, args.rollout_partial_oversample), grow)
        chosen, run, self._partial_pool = result.chosen, result.run, pool.groups
        if self.tools:
            self._log_agent_stats(ctx.mode, run.stats)
        engine.sleep()
        mine_at = sum(counts[:rank]) if job else engine.tp_ranks.index(rank) * len(rows)
        mine = chosen[mine_at:mine_at + len(rows)]
        t1 = time.perf_counter()
        # this rank's share of its engine's tokens, as a synchronous round counts
        gen_tokens = run.new_tokens // tp
        self.generation_clock.add(gen_tokens, t1 - t0)

        inputs = [g.payload["row"] for g in mine for _ in range(n)]
        sample_prompts = [g.payload["prompt"] for g in mine for _ in range(n)]
        flat = [s for g in mine for s in g.samples]
        mm_local = None  # a VLM's image tensors of this rank's samples, where they do not travel with them
        if self.tools:  # an episode: its turns and tool results (masked), its messages for the rewards
            episodes = [s.episode for s in flat]
            samples = [Sample(list(g.prompt_ids), e.completion_ids, e.logprobs, e.finish_reason, e.tool_mask)
                       for g in mine for e in (s.episode for s in g.samples)]
            completions = [e.messages for e in episodes]
            self._log_turns(ctx.mode, Episode(turns=[e.turns for e in episodes],
                                              tool_calls=[e.tool_calls for e in episodes],
                                              tool_failures=[e.tool_failures for e in episodes]))
        else:
            prompt_ids, mm = self._trained_prompts([g.payload["prompt"] for g in mine], [g.prompt_ids for g in mine],
                                                   any(g.images for g in mine), n)
            samples = [Sample(p, s.token_ids, s.logprobs, s.finish_reason, mm=m)
                       for p, m, s in zip(prompt_ids, mm, (s for g in mine for s in g.samples))]
            completions = self._decode(sample_prompts, [s.completion_ids for s in samples])
            if not (args.balance_batch or args.filter_groups):  # image tensors stay here (see _one_round)
                mm_local = [s.mm for s in samples] if any(m is not None for m in mm) else None
                samples = [replace(s, mm=None) for s in samples]
        completion_ids = [s.completion_ids for s in samples]
        if envs := self._has_environments:  # the reward functions' environments=: those of the samples trained, in order
            self._envs_for_rewards(mine)
        scores = self.scoring.score(inputs, sample_prompts, completions, completion_ids, mode=ctx.mode,
                                    state=self.state, environments=getattr(self, "environments", None))
        if envs:
            self._release_envs(chosen)
        t2 = time.perf_counter()
        table = None
        if self.log_completions:
            table = {"prompt": gather_object(sample_prompts), "completion": gather_object(list(completions)),
                     "images": None, "extra": scores.extra_logs}
        staleness = [version - (s.oldest_version() if s.oldest_version() is not None else version) for s in flat]
        counts = gather_object([result.counts.row(staleness)])
        per_engine = counts[::len(engine.tp_ranks)]  # one entry per engine (its TP ranks agree)
        per_pool = counts[:1] if job else per_engine  # the job's pool is on every rank; else one per engine
        self._log_partial(ctx.mode, counts, per_engine, per_pool)
        return Round(gather_object(samples), scores.rewards, gen_s=t1 - t0, reward_s=t2 - t1,
                     gen_tokens=gen_tokens, table=table, rows=inputs, mm_local=mm_local)

    def _engine_pool(self, ctx: StepContext, round_: int, job: bool, counts: list[int], gather) -> EngineGroups:
        """This rank's engine's pool (``job``: the job's, the same on every rank) as the pool step runs it: its
        episodes (single-turn samples, or tool episodes with this trainer's tools), and with environments its homes
        (each rank trains its own groups: as many as it drew, ``counts``), a resumed pool's groups given new
        environments (the pool's ranks agreeing on them, over ``gather``) and restarted samples' environments reset."""
        args, n, engine = self.args, ctx.n, self.rollout_engine
        version, rank = self.state.global_step, self.accelerator.process_index
        envs = self._has_environments
        homed = envs and (len(engine.tp_ranks) > 1 or job)  # a pool of several ranks: a group trains where its envs live
        quota = dict(enumerate(counts)) if job else dict.fromkeys(engine.tp_ranks, counts[0])
        sampling = self._sampling(ctx.mode, round_=round_)
        home = (lambda g: self.layout.engine_of_rank(g.key[2])) if job else None
        if self.tools:  # tool-calling episodes, turn after turn as requests (rollout/partial_tool_episodes.py)

            @contextlib.contextmanager
            def callbacks(groups: list[InFlightGroup]):
                agent = self._partial_agent()
                if envs:  # each sample's tools are its environment's methods
                    agent = self._env_agent(agent, groups, n)
                if not job:
                    yield agent
                    return
                # the job's episodes from one queue: with environments, each sample's tools run on its home rank
                with self._home_tools(envs, lambda i: groups[i // n].key[2], agent.run_tools) as run_tools:
                    yield replace(agent, run_tools=run_tools)

            episodes = tool_groups(engine, sampling, version, callbacks, args.tool_workers,
                                   owns=lambda g: g.key[2] == rank, home=home)
        else:
            episodes = sampled_groups(engine, sampling, version, home)

        def before_restart(pool: list[InFlightGroup]) -> list[InFlightGroup]:
            before = self._restore_env_groups(pool, rank)
            if homed:  # each rank restarted its own groups after a resume: the pool's ranks agree on it again
                before = _agree(before, gather([g for g, old in zip(before, pool) if g is not old]))
            return before

        return EngineGroups(self._partial_pool, episodes, quota=(lambda new: quota) if homed else None,
                            before_restart=before_restart if envs else None,
                            on_restart=self._reset_restarted if envs else None)

    def _log_partial(self, mode: str, counts: list[list], per_engine: list[list], per_pool: list[list]) -> None:
        """A partial round's metrics from every rank's ``[aborted, restarted, pool groups, engine steps, staleness
        max, staleness mean, dropped tokens (None: not counted)]``: aborted samples summed over ``per_engine`` (one
        entry per engine), restarts, pool size and dropped tokens over ``per_pool`` (one entry per pool), the rest
        over every rank."""
        self._metric(mode, "partial/aborted_samples", sum(c[0] for c in per_engine))
        self._metric(mode, "partial/restarted_samples", sum(c[1] for c in per_pool))
        self._metric(mode, "partial/pool_groups", sum(c[2] for c in per_pool))
        if per_pool and per_pool[0][6] is not None:
            self._metric(mode, "partial/dropped_tokens", sum(c[6] for c in per_pool))
        self._metric(mode, "partial/engine_steps", max(c[3] for c in counts))
        self._metric(mode, "partial/staleness_max", max(c[4] for c in counts))
        self._metric(mode, "partial/staleness_mean", sum(c[5] for c in counts) / len(counts))

    def _new_groups(self, rows: list[dict], n: int, version: int, round_: int, rank: int, first: int
                    ) -> list[InFlightGroup]:
        """The pool's new groups of this rank's dataset ``rows`` (one per prompt, ``n`` samples, keyed ``(version,
        round, rank, first + g)``): each with the prompt's engine ids (image placeholders not expanded) and its images."""
        kind = AgentPartialSample if self.tools else PartialSample
        keys = [(version, round_, rank, first + g) for g in range(len(rows))]
        if self._has_environments:  # n environments per group, reset with its row (trainer/partial_envs.py)
            prompts, ids, envs = self._start_env_groups(rows, n)
            self._partial_envs.update(zip(keys, envs))
            return [InFlightGroup.fresh(key, p, n, payload={"row": dict(row), "prompt": prompt}, sample=kind)
                    for key, p, row, prompt in zip(keys, ids, rows, prompts)]
        prompts, _ = self._start_episodes(rows)
        images = self._encode_images(prompts)  # None for text; refuses images with tools or a plain tokenizer
        ids = images.engine_ids if images is not None else self._tokenize_prompts(prompts)[0]
        return [InFlightGroup.fresh(key, list(p), n, payload={"row": dict(row), "prompt": prompt}, sample=kind,
                                    images=images.images[g] if images is not None else None)
                for g, (key, p, row, prompt) in enumerate(zip(keys, ids, rows, prompts))]

    def _trained_prompts(self, prompts: list, ids: list[list[int]], images: bool, n: int
                         ) -> tuple[list[list[int]], list]:
        """Per sample of groups of ``prompts`` (``n`` samples each; ``ids``: each group's engine ids): the prompt ids
        the model trains on and its image tensors. Text groups' are their ids (None); groups with ``images`` are
        encoded again by the processor (placeholders expanded, their tensors), as the synchronous round encodes
        them."""
        if not images:
            return [list(p) for p in ids for _ in range(n)], [None] * (len(ids) * n)
        enc = encode_prompts(self.processing_class, list(prompts), tools=self.tools,
                             chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs)
        return ([list(enc.ids[j]) for j in range(len(ids)) for _ in range(n)],
                [enc.mm[j] for j in range(len(ids)) for _ in range(n)])

    def _partial_agent(self) -> AgentCallbacks:
        """What the pool's tool-calling episodes need from the trainer: TRL's parser and tools (the same for every
        sample; with environments, :meth:`_env_agent` gives each sample its own), the tool results' tokens, the
        limits."""
        loop = getattr(self, "async_loop", None)
        sync, asyn = split_tools(list(self.tools or []))
        max_len = getattr(self.rollout_engine, "max_model_len", None) or self.engine_setup.context_length() or 1 << 30
        return AgentCallbacks(
            parse=self._parse_turn, run_tools=lambda i, calls: call_tools(calls, sync, asyn, loop=loop),
            suffix_ids=self._get_tool_suffix_ids, max_iterations=self.args.max_tool_calling_iterations,
            max_completion_length=self.args.max_completion_length, max_model_len=max_len)

    # ------------------------------------------------------------------ checkpoints
    def _save_partial_pool(self, folder: str) -> None:
        """This rank's pool as JSON (its groups' prompts, tokens, log-probs, versions, dataset rows and images)."""
        path = os.path.join(folder, POOL_FILE.format(rank=self.accelerator.process_index))
        try:
            text = pool_to_json(self._remote_pool_to_save() if self._on_rollout_ranks else self._pool_to_save(self._partial_pool))
        except TypeError as err:
            raise TypeError(f"rollout_partial=True saves the samples in flight with their dataset rows, and a row "
                            f"holds a value JSON cannot write ({err}); keep the dataset's columns to text and "
                            "numbers, or set rollout_partial=False.") from None
        with open(path, "w") as fh:
            fh.write(text)

    def _load_partial_pool(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, POOL_FILE.format(rank=self.accelerator.process_index))
        if not os.path.isfile(path):
            return
        with open(path) as fh:
            self._partial_pool = pool_from_json(fh.read())
        self._pool_to_restore = True  # rollout ranks: the first job carries it back to them
        self._note_restored_pool(self._partial_pool)


#: how a PIL image is written in a pool's JSON (a lossless PNG, base64)
IMAGE_KEY = "__image_png__"


def _image_to_json(value):
    """``json.dumps``'s ``default``: a PIL image as ``{IMAGE_KEY: base64 PNG}``; anything else is JSON's error."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {IMAGE_KEY: base64.b64encode(buffer.getvalue()).decode("ascii")}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _image_from_json(d: dict):
    """``json.loads``'s ``object_hook``: the PIL image of ``{IMAGE_KEY: ...}`` (pixels and mode as saved)."""
    if len(d) == 1 and IMAGE_KEY in d:
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(d[IMAGE_KEY])))
        image.load()
        return image
    return d


def pool_to_json(groups: list[InFlightGroup]) -> str:
    """A pool as JSON text: every group's fields, PIL images (prompt messages, dataset rows, ``images``) as PNGs."""
    return json.dumps([asdict(g) for g in groups], default=_image_to_json)


def pool_from_json(text: str) -> list[InFlightGroup]:
    """The pool :func:`pool_to_json` wrote, images read back as PIL images."""
    return [_group(d) for d in json.loads(text, object_hook=_image_from_json)]


def _group(d: dict) -> InFlightGroup:
    key = d["key"]
    return InFlightGroup(tuple(key) if isinstance(key, list) else key, list(d["prompt_ids"]),
                         [_sample(s) for s in d["samples"]], d["payload"], int(d["restarts"]), d.get("images"))


def _sample(d: dict) -> PartialSample | AgentPartialSample:
    """A pool sample from its JSON: a tool-calling episode (it has ``episode``) or a single-turn sample."""
    if "episode" not in d:
        return PartialSample(**d)
    episode = None if d["episode"] is None else AgentSample(**d["episode"])
    return AgentPartialSample(**{**d, "episode": episode})


def _agree(pool: list[InFlightGroup], every: list[list[InFlightGroup]]) -> list[InFlightGroup]:
    """``pool`` with each group replaced by its home rank's copy (``every``: each rank of the engine its own groups,
    as it holds them): after a resume each rank restarted its own groups' episodes with new environments."""
    by_key = {g.key: g for chunk in every for g in chunk}
    return [by_key.get(g.key, g) for g in pool]
