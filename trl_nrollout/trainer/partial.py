"""The trainer's side of partial rollouts (``rollout_partial=True``): the pool of groups in flight across steps.

Each step this rank's new prompts join its engine's pool (gathered over the TP group, so every rank of an engine
holds the same pool), samples staler than ``max_staleness`` start again, the engine runs the pool until the step's
groups have finished (:meth:`~trl_nrollout.rollout.vllm_group.VLLMEngineGroup.run_partial`), and the first groups
to finish train, this rank taking its share. The rest stays in the pool, saved in every checkpoint (one file per
rank), so a resumed run continues the samples that were in flight.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict

from accelerate.utils import gather_object

from trl_nrollout.dropin import UnsupportedTRLOption
from trl_nrollout.passes.multimodal import has_images
from trl_nrollout.rollout.agent_loop import AgentCallbacks, AgentSample, call_tools, split_tools
from trl_nrollout.rollout.partial import InFlightGroup, PartialSample, drop_stale, split_finished
from trl_nrollout.rollout.partial_agents import AgentPartialSample
from trl_nrollout.trainer.multiturn import Episode
from trl_nrollout.trainer.stages import Round, Sample, StepContext

#: the in-flight pool of a rank, in each checkpoint
POOL_FILE = "nrollout_partial_rank{rank}.json"


class PartialRollouts:
    """Mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: the partial-rollout step and its pool."""

    def _partial_refusal(self) -> str | None:
        """Why this trainer cannot roll out partially (None when it can)."""
        if self.rollout_backend != "vllm":
            return (f"rollout_partial=True needs vLLM engines, but this trainer generates with the "
                    f"{self.rollout_backend!r} engine; install vLLM (rollout_backend='vllm'), or set "
                    "rollout_partial=False.")
        if self.rollout_func is not None:
            return ("rollout_partial=True with rollout_func: the function generates whole samples itself, so the "
                    "trainer cannot stop its requests and continue them after a weight sync; set "
                    "rollout_partial=False, or use tools= (partial with rollout_multi_turn='requests').")
        if getattr(self, "environment_factories", None):
            return ("rollout_partial=True with environment_factory: an environment per sample would have to live "
                    "across steps and checkpoints, which is not built yet (tools= are partial); set "
                    "rollout_partial=False for environments.")
        if self.tools and self.args.rollout_multi_turn != "requests":
            return (f"rollout_partial=True with tools and rollout_multi_turn={self.args.rollout_multi_turn!r}: a turn "
                    "barrier waits for every sample's turn, while a partial rollout stops before its slowest "
                    "samples; set rollout_multi_turn='requests' (each sample's turns run as requests, its tools "
                    "while the others generate), or rollout_partial=False.")
        return None

    def _partial_round(self, ctx: StepContext, round_: int = 0) -> Round:
        """The step's groups from the pool: this rank's share of the ``target`` groups that finished first (the
        job's samples ``[G]``, gathered, and their rewards ``[G, F]``). ``round_`` > 0: one of DAPO's extra rounds
        (``filter_groups``), ``ctx.inputs`` then its fresh prompts; the filtered groups left the pool already, so
        their slots go to the pool's other groups and these new ones at once."""
        args, n, engine = self.args, ctx.n, self.rollout_engine
        version = self.state.global_step
        t0 = time.perf_counter()
        rows = ctx.inputs[::n]
        prompts, _ = self._start_episodes(rows)
        if has_images(prompts):
            raise UnsupportedTRLOption("rollout_partial=True with image prompts: partial rollouts are text-only "
                                       "for now; set rollout_partial=False for a vision-language dataset.")
        prompt_ids = self._tokenize_prompts(prompts)[0]
        rank = self.accelerator.process_index
        kind = AgentPartialSample if self.tools else PartialSample
        new = [InFlightGroup.fresh((version, round_, rank, g), list(ids), n,
                                   payload={"row": dict(row), "prompt": prompt}, sample=kind)
               for g, (ids, row, prompt) in enumerate(zip(prompt_ids, rows, prompts))]
        tp = len(engine.tp_ranks)
        target = len(rows) * tp  # the engine's share of the step's groups
        extra = partial_top_up(target, len(self._partial_pool), args.rollout_partial_oversample, tp,
                               engine.tp_ranks.index(rank))
        if extra:
            more = self._draw_inputs(extra)[::n]  # as DAPO's extra rounds draw them
            more_prompts, _ = self._start_episodes(more)
            more_ids = self._tokenize_prompts(more_prompts)[0]
            new += [InFlightGroup.fresh((version, round_, rank, len(rows) + g), list(ids), n,
                                        payload={"row": dict(row), "prompt": prompt}, sample=kind)
                    for g, (ids, row, prompt) in enumerate(zip(more_ids, more, more_prompts))]
        new = [g for chunk in engine.gather_tp(new) for g in chunk]  # the engine's new groups, rank order
        pool, restarted, dropped = drop_stale(self._partial_pool, version, args.max_staleness)
        sampling = self._sampling(ctx.mode, round_=round_)
        if self.tools:  # tool-calling episodes, turn after turn as requests (rollout/partial_agents.py)
            run, stats = engine.run_partial_agents(pool + new, target, sampling, version, self._partial_agent(),
                                                   args.tool_workers, owns=lambda g: g.key[2] == rank)
            self._log_agent_stats(ctx.mode, stats)
        else:
            run = engine.run_partial(pool + new, target, sampling, version)
        chosen, self._partial_pool = split_finished(run.groups, run.finish_order, target)
        engine.sleep()
        mine_at = engine.tp_ranks.index(rank) * len(rows)
        mine = chosen[mine_at:mine_at + len(rows)]
        t1 = time.perf_counter()
        gen_tokens = run.new_tokens // tp  # this rank's share of its engine's tokens, as a synchronous round counts
        self.generation_clock.add(gen_tokens, t1 - t0)

        inputs = [g.payload["row"] for g in mine for _ in range(n)]
        sample_prompts = [g.payload["prompt"] for g in mine for _ in range(n)]
        flat = [s for g in mine for s in g.samples]
        if self.tools:  # an episode: its turns and tool results (masked), its messages for the rewards
            episodes = [s.episode for s in flat]
            samples = [Sample(list(g.prompt_ids), e.completion_ids, e.logprobs, e.finish_reason, e.tool_mask)
                       for g in mine for e in (s.episode for s in g.samples)]
            completions = [e.messages for e in episodes]
            self._log_turns(ctx.mode, Episode(turns=[e.turns for e in episodes],
                                              tool_calls=[e.tool_calls for e in episodes],
                                              tool_failures=[e.tool_failures for e in episodes]))
        else:
            samples = [Sample(list(g.prompt_ids), s.token_ids, s.logprobs, s.finish_reason) for g in mine
                       for s in g.samples]
            completions = self._decode(sample_prompts, [s.completion_ids for s in samples])
        completion_ids = [s.completion_ids for s in samples]
        scores = self._score(inputs, sample_prompts, completions, completion_ids)
        t2 = time.perf_counter()
        table = None
        if self.log_completions:
            table = {"prompt": gather_object(sample_prompts), "completion": gather_object(list(completions)),
                     "images": None, "extra": scores.extra_logs}
        staleness = [version - (s.oldest_version() if s.oldest_version() is not None else version) for s in flat]
        counts = gather_object([[run.aborted, restarted, len(self._partial_pool), run.engine_steps,
                                 max(staleness), sum(staleness) / len(staleness), dropped]])
        per_engine = counts[::len(engine.tp_ranks)]  # one entry per engine (its TP ranks agree)
        self._metric(ctx.mode, "partial/aborted_samples", sum(c[0] for c in per_engine))
        self._metric(ctx.mode, "partial/restarted_samples", sum(c[1] for c in per_engine))
        self._metric(ctx.mode, "partial/pool_groups", sum(c[2] for c in per_engine))
        self._metric(ctx.mode, "partial/dropped_tokens", sum(c[6] for c in per_engine))
        self._metric(ctx.mode, "partial/engine_steps", max(c[3] for c in counts))
        self._metric(ctx.mode, "partial/staleness_max", max(c[4] for c in counts))
        self._metric(ctx.mode, "partial/staleness_mean", sum(c[5] for c in counts) / len(counts))
        return Round(gather_object(samples), scores.rewards, gen_s=t1 - t0, reward_s=t2 - t1,
                     gen_tokens=gen_tokens, table=table, rows=inputs)

    def _partial_agent(self) -> AgentCallbacks:
        """What the pool's tool-calling episodes need from the trainer: TRL's parser and tools (the same for every
        sample: environments are not partial), the tool results' tokens, the limits."""
        loop = getattr(self, "async_loop", None)
        sync, asyn = split_tools(list(self.tools or []))
        max_len = getattr(self.rollout_engine, "max_model_len", None) or self._context_length() or 1 << 30
        return AgentCallbacks(
            parse=self._parse_turn, run_tools=lambda i, calls: call_tools(calls, sync, asyn, loop=loop),
            suffix_ids=self._get_tool_suffix_ids, max_iterations=self.args.max_tool_calling_iterations,
            max_completion_length=self.args.max_completion_length, max_model_len=max_len)

    # ------------------------------------------------------------------ checkpoints
    def _save_partial_pool(self, folder: str) -> None:
        """This rank's pool as JSON (its groups' prompts, tokens, log-probs, versions and dataset rows)."""
        path = os.path.join(folder, POOL_FILE.format(rank=self.accelerator.process_index))
        try:
            text = json.dumps([asdict(g) for g in self._partial_pool])
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
            self._partial_pool = [_group(d) for d in json.load(fh)]


def partial_top_up(target: int, pooled: int, oversample: float, tp: int, tp_index: int) -> int:
    """Groups the rank at ``tp_index`` of its TP group draws beyond its own prompts this step, so that the engine
    holds ``ceil(target * (1 + oversample))`` groups in flight: its ``pooled`` groups carried over, the step's
    ``target`` new ones, and the rest split over the TP group's ranks (the first ones draw one more)."""
    need = max(0, math.ceil(target * (1 + oversample)) - pooled - target)
    return need // tp + (tp_index < need % tp)


def _group(d: dict) -> InFlightGroup:
    key = d["key"]
    return InFlightGroup(tuple(key) if isinstance(key, list) else key, list(d["prompt_ids"]),
                         [_sample(s) for s in d["samples"]], d["payload"], int(d["restarts"]))


def _sample(d: dict) -> PartialSample | AgentPartialSample:
    """A pool sample from its JSON: a tool-calling episode (it has ``episode``) or a single-turn sample."""
    if "episode" not in d:
        return PartialSample(**d)
    episode = None if d["episode"] is None else AgentSample(**d["episode"])
    return AgentPartialSample(**{**d, "episode": episode})
