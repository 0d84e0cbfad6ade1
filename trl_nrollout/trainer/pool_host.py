"""What the partial pool's rounds share (``rollout_partial=True``): the trainer's callables they use, bound once
when the trainer builds the pool (:class:`PoolHost`), the pool's groups carried from step to step
(:class:`PoolGroups`), the prompts a trained group's samples train on (:class:`PromptEncoder`) and the partial
metrics (:func:`log_partial`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl_nrollout.passes.multimodal import encode_prompts, engine_suffix_ids, image_tensors
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup
from trl_nrollout.rollout.episodes.tool_images import TurnMedia
from trl_nrollout.rollout.types import SamplingOptions
from trl_nrollout.trainer.metrics import Metrics


@dataclass
class PoolHost:
    """The trainer's side that the pool's rounds call, each a callable bound once (no reference to the trainer is
    kept by the pool's code; the trainer's other parts answer through them):

    - ``step()``: the optimizer step now (TRL's ``state.global_step``), the version of what the engines sample;
    - ``state()``: TRL's ``TrainerState`` now (``save_steps``, ``max_steps``; the reward functions get it);
    - ``sampling(mode, round_=0, step=None)``: the :class:`~trl_nrollout.rollout.types.SamplingOptions` of a rollout;
    - ``draw_inputs(count)``: ``count`` fresh prompts of the training set (DAPO's draw), each ``n`` times;
    - ``start_episodes(rows, busy=None)``: the prompts (and tools) of new episodes of ``rows``;
    - ``tokenize(prompts)``: their engine ids ``[B][P]``; ``encode_images(prompts)``: the processor's encoding where
      a prompt has images (None for text);
    - ``decode(prompts, completion_ids)``: completions as the reward functions read them;
    - ``round_of(inputs, prompts, batch, episode, ctx, t0, rows=)``: a scored :class:`~trl_nrollout.trainer.stages.
      Round` of a rollout batch; ``records_batch(records, prompts, n, offset, mode, stats, wall)``: what trains of
      finished endpoint-agent or ``rollout_func`` records;
    - ``log_agent_stats(mode, stats)``, ``log_turns(mode, episode)``: tool episodes' metrics;
    - ``parse_turn(i, ids, prefix)``, ``suffix_ids(...)``: TRL's parser and tool results' tokens;
    - ``home_tools(envs, home, run_tools)``: a context running each sample's tools on its home rank;
    - ``episode_runner()``: what runs this trainer's endpoint episodes; ``endpoint_settings(max_model_len)``: an
      endpoint's keywords; ``context_length()``: the engine's context when it names none."""

    step: Callable[[], int]
    state: Callable[[], Any]
    sampling: Callable[..., SamplingOptions]
    draw_inputs: Callable[[int], list[dict]]
    start_episodes: Callable[..., tuple[list, list]]
    tokenize: Callable[[list], list[list[int]]]
    encode_images: Callable[[list], Any]
    decode: Callable[[list, list[list[int]]], list]
    round_of: Callable[..., Any]
    records_batch: Callable[..., tuple]
    log_agent_stats: Callable[[str, Any], None]
    log_turns: Callable[[str, Any], None]
    parse_turn: Callable[..., dict]
    suffix_ids: Callable[..., list[int]]
    home_tools: Callable[..., Any]
    episode_runner: Callable[[], Any]
    endpoint_settings: Callable[[int], dict]
    context_length: Callable[[], int | None]


@dataclass
class PoolGroups:
    """The pool's groups carried from step to step (``groups``: an engine's groups as they run; live agents' and the
    rollout ranks' mirrored as rows and prompts), ``restore``: a checkpoint's pool waits to go back to the rollout
    ranks with the first job; ``of_step``: the step whose job answered ``groups`` (rollout ranks; None: no
    snapshot for a checkpoint)."""

    groups: list[InFlightGroup] = field(default_factory=list)
    restore: bool = False
    of_step: int | None = None


@dataclass
class PromptEncoder:
    """The prompts a trained group's samples train on: text groups' engine ids, or image groups encoded again by
    the ``processor`` (placeholders expanded, their tensors), as the synchronous round encodes them. ``vlm``: the
    processor is a vision-language model's (tool episodes then carry the images their tools return)."""

    processor: Any
    tools: list | None
    chat_template: Any
    chat_template_kwargs: Any
    vlm: bool = False

    def tool_media(self) -> TurnMedia | None:
        """What a pool's tool episodes need to carry their tools' images (the results' tokens with the placeholders
        unexpanded, for the engine); None for a text model (a tool's image is then refused)."""
        if not self.vlm:
            return None
        return TurnMedia([], [], lambda messages: engine_suffix_ids(
            self.processor, messages, chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs))

    def episode_tensors(self, prompt_mm: list, prompt_images: list[list], tool_images: list[list]) -> list:
        """Per sample, the image tensors its forward takes: its prompt's (``prompt_mm``) or, where its tools returned
        images (``tool_images``), those of all its images in order (``prompt_images`` first)."""
        return [image_tensors(self.processor, list(p) + list(t)) if t else m
                for m, p, t in zip(prompt_mm, prompt_images, tool_images, strict=True)]

    def trained(self, prompts: list, ids: list[list[int]], images: bool, n: int) -> tuple[list[list[int]], list]:
        """Per sample of groups of ``prompts`` (``n`` samples each; ``ids``: each group's engine ids): the prompt ids
        the model trains on and its image tensors (None for text)."""
        if not images:
            return [list(p) for p in ids for _ in range(n)], [None] * (len(ids) * n)
        enc = encode_prompts(self.processor, list(prompts), tools=self.tools, chat_template=self.chat_template,
                             chat_template_kwargs=self.chat_template_kwargs)
        return ([list(enc.ids[j]) for j in range(len(ids)) for _ in range(n)],
                [enc.mm[j] for j in range(len(ids)) for _ in range(n)])


def log_partial(metrics: Metrics, mode: str, counts: list[list], per_engine: list[list], per_pool: list[list]) -> None:
    """A partial round's metrics from every rank's ``[aborted, restarted, pool groups, engine steps, staleness max,
    staleness mean, dropped tokens (None: not counted)]``: aborted samples summed over ``per_engine`` (one entry per
    engine), restarts, pool size and dropped tokens over ``per_pool`` (one entry per pool), the rest over every
    rank."""
    metrics.add(mode, "partial/aborted_samples", sum(c[0] for c in per_engine))
    metrics.add(mode, "partial/restarted_samples", sum(c[1] for c in per_pool))
    metrics.add(mode, "partial/pool_groups", sum(c[2] for c in per_pool))
    if per_pool and per_pool[0][6] is not None:
        metrics.add(mode, "partial/dropped_tokens", sum(c[6] for c in per_pool))
    metrics.add(mode, "partial/engine_steps", max(c[3] for c in counts))
    metrics.add(mode, "partial/staleness_max", max(c[4] for c in counts))
    metrics.add(mode, "partial/staleness_mean", sum(c[5] for c in counts) / len(counts))
