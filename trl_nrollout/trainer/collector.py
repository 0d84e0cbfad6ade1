"""The rollout collector: one rollout of this rank's samples, whatever the episode kind and placement.

The trainer builds one :class:`RolloutCollector` in ``__init__`` (:meth:`RolloutCollector.of`), with the episode kind
chosen once from the options and the trainer's ``tools`` / ``rollout_func`` / ``agent`` (:func:`choose_episode_kind`,
the table :data:`KINDS`); each rollout is then

    episodes started (environments reset) -> prompts tokenized and checked (kinds that take tokens)
    -> kind.run(EpisodeJob) -> (RolloutBatch, Episode) -> the engine sleeps, the generation clock counts

The rollout-rank placement's calls (the part :class:`~trl_nrollout.trainer.rollout_ranks.RolloutRankPlacement`) come in as callables (:class:`Placement`);
None where the engines are colocated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from accelerate.utils import gather_object

from trl_nrollout.config.trl_options import UnsupportedTRLOption
from trl_nrollout.passes.multimodal import EncodedPrompts, encode_prompts, has_images
from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.agents import (
    AgentRecords,
    EndpointAgents,
    endpoint_settings,
    episode_runner,
    remote_agent_episodes,
)
from trl_nrollout.trainer.episodes import (
    Episode,
    EpisodeJob,
    EpisodeKind,
    RolloutFunc,
    SingleTurn,
    log_dispatch,
)
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.multiturn import (
    IMAGE_REFUSALS,
    HomeToolCalls,
    Limits,
    ToolRequests,
    ToolTurns,
    TRLTools,
    image_refusal,
)


@dataclass(frozen=True)
class Placement:
    """Where the engines live: with rollout ranks, their calls (the part ``RolloutRankPlacement``): a single-turn
    job (``generate``), whole tool episodes request by request (``request_turns``), and an agent job's entry, the
    jobs written ahead and the step's log (``agent_job``, ``ahead_jobs``, ``log_remote``). ``remote=False``:
    colocated, none of them is called."""

    remote: bool = False
    generate: Callable[..., RolloutBatch] | None = None
    request_turns: Callable[..., tuple[RolloutBatch, Episode, list]] | None = None
    agent_job: Callable | None = None
    ahead_jobs: Callable | None = None
    log_remote: Callable | None = None


@dataclass(frozen=True)
class KindParts:
    """What an episode kind may be built from: the options ``args``, the ``engine`` (``vllm``: a vLLM engine), TRL's
    tool machinery ``tools``, the user's ``agent`` and ``rollout_func`` (``func_trainer``: what TRL's contract hands
    it), this ``rank``, the ``metrics`` sink, the ``placement``, and the shared pieces built once (``limits``,
    ``home``, ``records``, ``log_dispatch``, ``runner``, ``settings``)."""

    args: Any
    rollout_engine: Any
    vllm: bool
    tools: TRLTools
    agent: Callable | None
    rollout_func: Callable | None
    func_trainer: Any
    rank: int
    metrics: Metrics
    placement: Placement
    limits: Limits
    home: HomeToolCalls
    records: AgentRecords
    log_dispatch: Callable[..., None]
    runner: Callable[[], Any]
    settings: Callable[[], dict]
    encode_images: Callable[[list], EncodedPrompts | None] | None = None


def single_turn(p: KindParts) -> SingleTurn:
    """The single-turn kind over the parts (other kinds build on it: a first turn)."""
    return SingleTurn(p.rollout_engine, dispatch_rule(p.args.rollout_dispatch), p.vllm, p.log_dispatch,
                      p.placement.generate if p.placement.remote else None)


def _agents(p: KindParts) -> EndpointAgents:
    remote = None
    if p.placement.remote:
        remote = partial(remote_agent_episodes, p.rollout_engine, p.placement.agent_job, p.placement.ahead_jobs,
                         p.placement.log_remote)
    return EndpointAgents(p.rollout_engine, p.records, p.runner, p.tools.tokenizer, p.settings,
                          rule=dispatch_rule(p.args.rollout_dispatch),
                          rank=p.rank, log_dispatch=p.log_dispatch, remote=remote)


#: the episode kinds, first match wins: (name, when, build). A new kind is a class with ``run(job)`` and a row here.
KINDS: list[tuple[str, Callable[[KindParts], bool], Callable[[KindParts], EpisodeKind]]] = [
    ("endpoint agents", lambda p: p.agent is not None or (
        p.rollout_func is not None and p.args.rollout_multi_turn == "requests"), _agents),
    ("rollout_func", lambda p: p.rollout_func is not None, lambda p: RolloutFunc(
        p.func_trainer, p.rollout_engine, dispatch_rule(p.args.rollout_dispatch), p.args.max_completion_length,
        p.args.rollout_is is not None, p.log_dispatch, encode_images=p.encode_images)),
    ("tool requests", lambda p: bool(p.tools.tools) and p.args.rollout_multi_turn == "requests", lambda p: ToolRequests(
        p.tools, p.rollout_engine, p.limits, dispatch_rule(p.args.rollout_dispatch), p.rank, p.metrics, p.home, p.log_dispatch,
        p.placement.request_turns if p.placement.remote else None)),
    ("tool turns", lambda p: bool(p.tools.tools), lambda p: ToolTurns(single_turn(p), p.tools, p.rollout_engine, p.limits, p.rank)),
    ("single-turn", lambda p: True, single_turn),
]


def choose_episode_kind(parts: KindParts) -> EpisodeKind:
    """The trainer's episode kind: the first row of :data:`KINDS` whose condition holds."""
    return next(build for _, when, build in KINDS if when(parts))(parts)


@dataclass(frozen=True)
class ImagePrompts:
    """The processor's ids and image tensors of prompts with images (``processor``: TRL's processing class;
    ``is_vlm``: it is a processor, not a tokenizer; ``tools``: the trainer's (their schemas are rendered);
    ``refusal``: what the trainer runs that images do not run with, ``multiturn.IMAGE_REFUSALS``' key, or None)."""

    processor: Any
    is_vlm: bool
    tools: list | None
    chat_template: Any
    chat_template_kwargs: dict | None
    refusal: str | None = None

    def encode(self, prompts: list) -> EncodedPrompts | None:
        """This rank's prompts encoded when any has an image (else None)."""
        if not has_images(prompts):
            return None
        if self.refusal is not None:
            raise UnsupportedTRLOption(
                f"the prompts hold images and the trainer runs {self.refusal}: {IMAGE_REFUSALS[self.refusal]}; images "
                "run with tools= and environment_factory= (turn by turn, or request by request; colocated or on "
                "rollout ranks; partial rollouts colocated, and with tools= on rollout ranks). Use that, "
                "trl.GRPOTrainer, or prompts without images.")
        if not self.is_vlm:
            raise ValueError(
                "the prompts hold images but processing_class is a tokenizer, not a processor: a vision-language "
                "model needs its processor (pass processing_class=AutoProcessor.from_pretrained(model), or leave "
                "it None and the trainer loads it).")
        return encode_prompts(self.processor, prompts, tools=self.tools, chat_template=self.chat_template,
                              chat_template_kwargs=self.chat_template_kwargs)


class RolloutCollector:
    """One rollout of this rank's samples with the trainer's episode ``kind`` (see the module).

    Collaborators: the ``engine``; ``start(inputs, step_job) -> (prompts, tools)`` (the episodes started,
    environments reset, maybe ahead with rollout ranks) and ``names()`` (each sample's environment, TRL's
    ``_batch_environments``, which its tokenization reads); ``tokenize`` (TRL's ``_tokenize_prompts``), ``images``
    (:class:`ImagePrompts`); ``vllm`` (check the prompts' length on every rank first); the generation ``clock``; this
    ``rank``."""

    def __init__(self, kind: EpisodeKind, engine, *, start: Callable, names: Callable[[], list | None],
                 tokenize: Callable, images: ImagePrompts, vllm: bool, clock, rank: int) -> None:
        self.kind, self.rollout_engine, self.start, self.names, self.tokenize = kind, engine, start, names, tokenize
        self.images, self.vllm, self.clock, self.rank = images, vllm, clock, rank

    @classmethod
    def of(cls, trainer, placement: Placement) -> RolloutCollector:
        """The collector of a built trainer (its engine started): its handles read once, the kind chosen once."""
        args, engine, rank = trainer.args, trainer.rollout_engine, trainer.accelerator.process_index
        metrics, vllm = Metrics(trainer._metrics), trainer.rollout_backend == "vllm"
        tools, setup = TRLTools.of(trainer), trainer.engine_setup
        max_len = lambda: getattr(engine, "max_model_len", None) or setup.context_length() or 1 << 30  # noqa: E731
        images = ImagePrompts(trainer.processing_class, trainer._is_vlm, trainer.tools, trainer.chat_template,
                              trainer.chat_template_kwargs, image_refusal(
                                  tools=trainer.tools, rollout_func=trainer.rollout_func, args=args,
                                  environment_factory=getattr(trainer, "environment_factories", None)))
        records = AgentRecords(trainer._tokenizer, trainer._tokenize_prompts, trainer.rollout_func is not None,
                               args.max_completion_length, metrics, rank, trainer.accelerator.is_main_process,
                               tools.processor, images.encode)
        parts = KindParts(
            args, engine, vllm, tools, trainer.agent, trainer.rollout_func, trainer, rank, metrics, placement,
            Limits(args.seed, args.max_tool_calling_iterations, args.max_completion_length, max_len, args.tool_workers),
            HomeToolCalls(engine, rank, args.tool_workers, metrics), records,
            partial(_log_dispatch, metrics, engine, trainer.layout.rollout_tp_size),
            runner=lambda: episode_runner(trainer.agent, trainer.rollout_func, trainer, args, trainer.num_generations,
                                          engine.max_model_len, trainer.tools),
            settings=lambda: endpoint_settings(args, setup.model_path(), engine.max_model_len,
                                               None if placement.remote else tools.processor),
            encode_images=images.encode)
        collector = cls(choose_episode_kind(parts), engine, start=trainer._start_step_episodes,
                        names=lambda: getattr(trainer, "_batch_environments", None), tokenize=trainer._tokenize_prompts,
                        images=images, vllm=vllm, clock=trainer.generation_clock, rank=rank)
        collector.parts = parts  # (the trainer's delegates for the other rollout paths read the shared pieces)
        return collector

    def run(self, inputs: list[dict], n: int, sampling: SamplingOptions, mode: str, step: int, step_job: bool = False
            ) -> tuple[RolloutBatch, list, Episode]:
        """Generate for this rank's samples ``inputs`` ``[B]`` (TRL's order: each prompt repeated ``n`` times) at
        optimizer ``step``. Returns the batch, the prompts (text or messages) per sample and what the episodes add
        (tool masks, messages, reward kwargs)."""
        prompts, tools = self.start(inputs, step_job)  # environments reset (or were, ahead)
        job = EpisodeJob(inputs, prompts, tools, n, sampling, mode, self.rank * len(inputs), step, step_job,
                         names=self.names())
        if self.kind.tokenized:
            images = self.images.encode(prompts)
            prompt_ids = images.ids if images is not None else self.tokenize(prompts)[0]
            if self.vllm:  # a too-long prompt on one rank: every rank stops with the error, none hangs
                longest = max(gather_object([max((len(p) for p in prompt_ids), default=0)]))
                self.rollout_engine.check_prompt_length(longest, sampling.max_tokens)
            job = replace(job, prompt_ids=prompt_ids, images=images)
        start = time.perf_counter()
        batch, episode = self.kind.run(job)
        # right after generation: rewards and the log-prob passes run without the engine's weights and KV cache
        self.rollout_engine.sleep()
        self.clock.add(batch.num_completion_tokens, time.perf_counter() - start)
        return batch, prompts, episode

    def close(self) -> None:
        """Release what the kind holds (an agents' endpoint)."""
        close = getattr(self.kind, "close", None)
        if close is not None:
            close()


def _log_dispatch(metrics: Metrics, engine, tp_size: int, mode: str, pulled, samples_per_rank: int, n: int) -> None:
    log_dispatch(metrics, engine, mode, pulled, samples_per_rank, n, tp_size)
