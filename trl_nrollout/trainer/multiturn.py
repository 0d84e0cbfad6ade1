"""TRL's agentic interfaces on our engine group: ``tools``, ``environment_factory`` and ``rollout_func``.

TRL's ``__init__`` still sets everything up (tool schemas in the chat template, the response parser, the environment
pool, the async event loop); :class:`TRLTools` holds those handles for the episodes. Two episode kinds
(:mod:`trl_nrollout.trainer.episodes`) run TRL's tools on our engines: :class:`ToolTurns` turn by turn
(:func:`~trl_nrollout.rollout.episodes.tools.run_tool_turns`, collective over ranks) and :class:`ToolRequests` request
by request (no turn barrier). ``rollout_func`` is :class:`~trl_nrollout.trainer.episodes.RolloutFunc`.

- ``tools``: functions the model may call (TRL's format: the chat template renders their schemas, the tokenizer's
  response parser reads the calls). A sample's turn that calls tools gets their results and goes on.
- ``environment_factory``: one environment per sample (TRL's pool), ``reset(**row)`` at the start of an episode
  (a returned observation is appended to the prompt); its public methods are that sample's tools; reward
  functions get ``environments=``; ``get_reward`` becomes a reward function (TRL's ``__init__`` adds it).
- ``rollout_func(prompts, trainer)``: the user's own generation (it may use ``trainer.rollout_engine``); returns
  ``prompt_ids``, ``completion_ids``, ``logprobs`` and optionally ``env_mask`` (0 for tokens not trained on) and
  extra per-sample fields, which reward functions receive as keyword arguments.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from accelerate.utils import gather_object
from trl.chat_template_utils import parse_response

from trl_nrollout.passes.multimodal import (
    IMAGE_COLUMNS,
    EncodedPrompts,
    attach_images,
    check_expansion,
    dataset_images,
    engine_suffix_ids,
    image_tensors,
)
from trl_nrollout.rollout.axes import DispatchRule, machine_refusal
from trl_nrollout.rollout.episodes.home_tools import HomeTools
from trl_nrollout.rollout.episodes.tool_images import TurnMedia
from trl_nrollout.rollout.episodes.tools import (
    AgentCallbacks,
    AgentStats,
    Turns,
    call_tools,
    collect_turns,
    run_tool_turns,
    split_tools,
)
from trl_nrollout.rollout.seeds import step_seed
from trl_nrollout.rollout.types import RolloutBatch
from trl_nrollout.trainer.episodes import Episode, EpisodeJob, SingleTurn

__all__ = ["Episode", "TRLTools", "ToolTurns", "ToolRequests", "HomeToolCalls", "check_images", "image_refusal",
           "IMAGE_REFUSALS", "check_tool_workers",
           "request_turns_refusal", "log_turns", "log_agent_stats"]


def _environment_tools(environment: Any) -> list:
    """An environment's public methods (TRL's rule: not ``reset``, ``get_reward`` or ``_private``), bound to it."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


#: what images (image prompts, or a tool's content blocks) do not run with yet, and why (the refusal table's rows)
IMAGE_REFUSALS = {
    "rollout_ranks": "environment episodes on rollout ranks carry images turn by turn and request by request, not "
                     "yet in partial rollouts (rollout_partial=True; tools= do)",
}


def image_refusal(*, tools=None, rollout_func=None, environment_factory=None, args=None) -> str | None:
    """Why images cannot run with this trainer's episodes (None: they can: tools and environments turn by turn, or
    request by request from fixed shares or a balanced queue, and so on rollout ranks; partial rollouts colocated,
    and of tools= on rollout ranks; a rollout_func everywhere)."""
    if environment_factory is not None and getattr(args, "rollout_ranks", 0) and getattr(args, "rollout_partial",
                                                                                         False):
        return "rollout_ranks"
    return None


def check_images(columns: list[str] | None, *, tools=None, rollout_func=None, environment_factory=None,
                 args=None) -> None:
    """Image prompts run with tools and environments (TRL's loop, a tool's images included) and a rollout_func
    (TRL's contract); with partial environment episodes on rollout ranks they are refused (:data:`IMAGE_REFUSALS`),
    never trained as if the images were absent."""
    from trl_nrollout.config.trl_options import UnsupportedTRLOption

    found = sorted(set(IMAGE_COLUMNS) & set(columns or []))
    why = image_refusal(tools=tools, rollout_func=rollout_func, environment_factory=environment_factory, args=args)
    if found and why:
        raise UnsupportedTRLOption(
            f"the dataset has image column(s) {found} (image prompts) and the trainer was given "
            f"tools/environment_factory and {why}: "
            f"{IMAGE_REFUSALS[why]}. Images run with tools= and environment_factory= (turn by turn, or request by "
            "request; colocated or on rollout ranks; partial rollouts, environments' colocated); use that, or "
            "trl.GRPOTrainer for this combination, or drop the image columns.")


def check_tool_workers(args, tools=None, environment_factory=None, rollout_func=None) -> None:
    """``tool_workers`` set on a trainer without ``tools=`` or ``environment_factory=`` (a rollout_func's or an
    agent's calls run no tools of ours) would do nothing: an error naming the option and the fix. Likewise
    ``rollout_multi_turn='requests'`` without tools, environments or a ``rollout_func``."""
    from trl_nrollout.errors import InputError

    default = next(f.default for f in fields(args) if f.name == "tool_workers")
    if args.tool_workers != default and not tools and environment_factory is None:
        raise InputError(f"tool_workers={args.tool_workers} sets how many samples' tool calls run at once, but this "
                         "trainer has no tools= and no environment_factory=: it would do nothing. Pass the tools to "
                         "NRolloutGRPOTrainer, or remove tool_workers.")
    if args.rollout_multi_turn == "requests" and not tools and environment_factory is None and rollout_func is None:
        raise InputError(  # no option is silently ignored
            "rollout_multi_turn='requests' changes how samples with tool calls advance (no turn barrier), but "
            "this trainer has no tools= and no environment_factory=: every sample is a single turn, so it would "
            "do nothing. Pass tools= or environment_factory= to NRolloutGRPOTrainer, or remove "
            "rollout_multi_turn (the recipe, trl-nrollout train / -m trl_nrollout.recipe.run, passes no tools: "
            "train with tools from your own script, see "
            "docs/tools.md).")


def _blocks(content: str | list) -> list:
    """Message content as typed blocks (``[{"type": "text", "text": ...}]`` for plain text)."""
    return content if isinstance(content, list) else [{"type": "text", "text": content}]



def request_turns_refusal(rollout_backend: str) -> str | None:
    """Why ``rollout_multi_turn='requests'`` cannot run on the ``rollout_backend`` engine (None: it can)."""
    if rollout_backend != "vllm":
        return machine_refusal("rollout_multi_turn='requests'", "rollout_multi_turn='turns'", auto=True)
    return None


@dataclass(frozen=True)
class Started:
    """A rollout's episodes started: the prompts ``[B]`` (an environment's observation appended), each sample's
    (sync, async) tools; with ``environment_factory``, each sample's environment and its name (TRL's
    ``environments`` and ``_batch_environments``, which the trainer keeps: TRL's tokenization and reward calls read
    them there), else None."""

    prompts: list
    tools: list
    environments: list | None = None
    names: list | None = None


@dataclass(frozen=True)
class TRLTools:
    """TRL's tool machinery as its ``__init__`` built it (read once): the ``tokenizer`` and its response parser, the
    ``tools``, the environments' factories, pool (shared, grown in place), each environment's tools, the tools bound
    to no environment, whether ``environment_factory`` is a dict (``multi``), TRL's event ``loop`` for async tools
    and ``suffix_ids`` (a tool result's tokens)."""

    tokenizer: Any
    tools: list | None
    factories: dict | None
    pool: dict | None
    env_tools: dict | None
    standalone: list | None
    multi: bool
    loop: Any
    suffix_ids: Callable
    #: a vision-language model's processor (None for a text model), TRL's chat template (None: the processor's) and
    #: its kwargs: tool results with images (:meth:`engine_suffix`, :meth:`image_tensors`)
    processor: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict | None = None

    @classmethod
    def of(cls, trainer) -> TRLTools:
        """The handles of a built ``GRPOTrainer`` (TRL sets them in its ``__init__``)."""
        factories = getattr(trainer, "environment_factories", None)
        return cls(trainer._tokenizer, trainer.tools, factories, getattr(trainer, "_environment_pool", None),
                   getattr(trainer, "_env_tools", None), getattr(trainer, "_standalone_tools", None),
                   bool(getattr(trainer, "_multi_environment", False)), getattr(trainer, "async_loop", None),
                   trainer._get_tool_suffix_ids, trainer.processing_class if trainer._is_vlm else None,
                   trainer.chat_template, trainer.chat_template_kwargs)

    def engine_suffix(self, tool_messages: list[dict]) -> list[int]:
        """Tool results' tokens with image placeholders unexpanded (an engine that expands them itself takes
        these; :attr:`suffix_ids` gives the processor's expansion)."""
        return engine_suffix_ids(self.processor, tool_messages, chat_template=self.chat_template,
                                 chat_template_kwargs=self.chat_template_kwargs)

    def image_tensors(self, images: list) -> dict:
        """The processor's image tensors of one sample's images (TRL's ``image_processor`` call)."""
        return image_tensors(self.processor, images)

    def media(self, prompt_ids: list[list[int]], images: EncodedPrompts | None) -> TurnMedia | None:
        """The images of a multi-turn rollout of prompts ``prompt_ids`` (``images``: their encoding, None for text
        prompts); None for a text model."""
        if self.processor is None:
            return None
        if images is None:
            return TurnMedia([[] for _ in prompt_ids], [list(p) for p in prompt_ids], self.engine_suffix)
        return TurnMedia(list(images.images), list(images.engine_ids), self.engine_suffix)

    def episode_mm(self, tool_images: list[list], media: TurnMedia | None, images: EncodedPrompts | None
                   ) -> list | None:
        """Per sample, the image tensors the trainer's forward takes: its prompt's (shared with its group) or, where
        its tools returned images (``tool_images``, per sample), those of all its images in order; None where no
        sample has any."""
        if media is None or (images is None and not any(tool_images)):
            return images.mm if images is not None else None
        prompt_mm = images.mm if images is not None else [None] * len(tool_images)
        return [self.image_tensors(list(media.prompt_images[i]) + list(tool)) if tool else prompt_mm[i]
                for i, tool in enumerate(tool_images)]

    def start(self, inputs: list[dict], held: set[int]) -> Started:
        """The prompts of this rank's samples, with one environment per sample drawn from TRL's pool and reset
        (a returned observation is appended to the prompt's last message), and each sample's tools (sync, async).
        ``held``: ids of pool environments not to draw (a partial rollout's episodes in flight, steps written
        ahead)."""
        factories = self.factories
        if factories is None:
            prompts = attach_images([x["prompt"] for x in inputs], dataset_images(inputs))
            return Started(prompts, [split_tools(list(self.tools or []))] * len(inputs))
        prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]
        names = [x.get("environment") if self.multi else None for x in inputs]
        unknown = sorted({n for n in names if n not in factories}, key=str)
        if unknown:  # TRL's words (users and tests match them), then the others and a fix
            others = f" (also {unknown[1:]!r})" if len(unknown) > 1 else ""
            raise ValueError(f"Example has `environment={unknown[0]!r}`, which is not among the environments passed "
                             f"to `environment_factory`. Expected one of: {list(factories)}.{others} Fix the "
                             "dataset's `environment` column, or add the factory to environment_factory.")
        taken: Counter = Counter()
        environments = []
        for name in names:
            pool = self.pool[name]
            while taken[name] < len(pool) and id(pool[taken[name]]) in held:
                taken[name] += 1
            if taken[name] == len(pool):
                pool.append(factories[name]())
            environments.append(pool[taken[name]])
            taken[name] += 1
        tools = [split_tools(list(self.standalone) + _environment_tools(env)) for env in environments]
        for i, (env, row) in enumerate(zip(environments, inputs)):
            observation = env.reset(**self.reset_kwargs(row))
            if observation is None:
                continue
            last = prompts[i][-1]
            content = last["content"]
            if isinstance(content, list) or isinstance(observation, list):  # typed content blocks
                content = _blocks(content) + _blocks(observation)
            else:
                content = content + observation
            prompts[i] = prompts[i][:-1] + [{**last, "content": content}]
        prompts = attach_images(prompts, dataset_images(inputs))  # after the observations, as TRL does
        return Started(prompts, tools, environments, names)

    def reset_kwargs(self, row: dict) -> dict:
        """What an environment's ``reset`` gets for a dataset ``row`` (TRL's rule: the row, less ``environment``
        where ``environment_factory`` is a dict)."""
        return {k: v for k, v in row.items() if k != "environment"} if self.multi else row

    def parse(self, names: list | None, i: int, ids: list[int], prefix: list[int]) -> dict:
        """Sample ``i``'s assistant message from its turn's token ids (TRL's parser, with its prompt's tools;
        ``names``: each sample's environment)."""
        tools = self.env_tools[names[i]] if self.factories is not None else self.tools
        return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)


class HomeToolCalls:
    """Tool calls that go home: as an engine pulling other ranks' groups runs them, with environments and several
    engines each sample's calls run on its ``home(i)`` rank, where its environment lives
    (:class:`~trl_nrollout.rollout.episodes.home_tools.HomeTools`, served from a thread until every engine is done). One per
    trainer: every rank numbers its hosts alike. ``metrics``: the sink of ``tools/calls_sent_home``."""

    def __init__(self, engine, rank: int, workers: int, metrics) -> None:
        self.rollout_engine, self.rank, self.workers, self.metrics = engine, rank, workers, metrics
        self.calls = 0

    @contextlib.contextmanager
    def __call__(self, envs: bool, home, run_tools, mode: str):
        """``run_tools`` as the engines run it (with environments, ``envs``, on several engines: sent home); every
        rank enters and leaves it together (around the engines' collective run)."""
        if not envs or not self.rollout_engine.balances_job:
            yield run_tools
            return
        self.calls += 1
        store = torch.distributed.distributed_c10d._get_default_store()
        host = HomeTools(store, f"nr_home_tools/{self.calls}", self.rank, home, run_tools, self.workers)
        with host:
            yield host.run
        sent = sum(gather_object([host.sent]))  # every rank's calls sent to another rank (all ranks are here)
        self.metrics.add(mode, "tools/calls_sent_home", sent)


def log_agent_stats(metrics, mode: str, stats: AgentStats) -> None:
    """How much the engine overlapped tools (means over ranks): ``tools/overlap`` the share of engine steps
    taken while a tool ran, ``tools/engine_idle_s`` the seconds the engine waited with nothing to run,
    ``tools/call_seconds`` the tool calls' summed seconds. Collective."""
    every = gather_object([(stats.engine_steps, stats.steps_with_tools, stats.idle_s, stats.tool_s)])
    steps = sum(e[0] for e in every)
    metrics.add(mode, "tools/overlap", sum(e[1] for e in every) / steps if steps else 0.0)
    metrics.add(mode, "tools/engine_idle_s", sum(e[2] for e in every) / len(every))
    metrics.add(mode, "tools/call_seconds", sum(e[3] for e in every) / len(every))


def log_turns(metrics, mode: str, episode: Episode) -> None:
    """verl's ``num_turns/*`` and TRL's ``tools/call_frequency`` / ``tools/failure_frequency`` (all ranks)."""
    if not episode.turns:
        return
    stats = gather_object([(t, c, f) for t, c, f in zip(episode.turns, episode.tool_calls, episode.tool_failures)])
    turns = torch.tensor([s[0] for s in stats], dtype=torch.float32)
    calls = sum(s[1] for s in stats)
    metrics.add(mode, "num_turns/mean", turns.mean().item())
    metrics.add(mode, "num_turns/min", turns.min().item())
    metrics.add(mode, "num_turns/max", turns.max().item())
    metrics.add(mode, "tools/call_frequency", calls / max(1, len(stats)))
    metrics.add(mode, "tools/failure_frequency", sum(s[2] for s in stats) / calls if calls else 0.0)


def _episode(turns: Turns) -> Episode:
    return Episode(tool_mask=turns.tool_mask, completions=turns.completions, turns=turns.turns,
                   tool_calls=turns.tool_calls, tool_failures=turns.tool_failures)


@dataclass(frozen=True)
class Limits:
    """A tool episode's limits: ``seed`` (the run's, for later turns' seeds), ``max_iterations`` (tool calling
    rounds), ``max_completion_length``, ``max_model_len`` (the engine's context, read when an episode runs) and
    ``workers`` (samples whose tools run at once)."""

    seed: int
    max_iterations: int | None
    max_completion_length: int | None
    max_model_len: Callable[[], int]
    workers: int

    def turn_seed(self, job: EpisodeJob, turn: int) -> int | None:
        """A later turn's seed (None where the sampling has none): the same after a resume."""
        return None if job.sampling.seed is None else step_seed(self.seed, job.step, turn, f"{job.mode}/turn")


@dataclass(frozen=True)
class ToolTurns:
    """TRL's tools / environments turn by turn: the ``first`` turn as single-turn samples, then every sample that
    called tools gets their results and its next turn, all ranks' turns in step (collective over ranks)."""

    first: SingleTurn
    tools: TRLTools
    rollout_engine: Any
    limits: Limits
    rank: int
    tokenized: bool = True

    def run(self, job: EpisodeJob) -> tuple[RolloutBatch, Episode]:
        first, _ = self.first.run(job)
        loop, width = self.tools.loop, max(1, len(first))
        media = self.tools.media(first.prompt_ids, job.images)

        def generate(contexts, budgets, turn, samples, views=None):
            kw: dict = {}
            if views is not None and any(v.images for v in views):  # the prompts' and the tools' images
                if self.first.vllm:  # vLLM expands the placeholders itself
                    expanded, contexts = contexts, [v.engine_context for v in views]
                    kw["images"] = [v.images for v in views]
                else:
                    kw["mm"] = [self.tools.image_tensors(v.images) if v.images else None for v in views]
            out = self.rollout_engine.generate_turns(contexts, budgets, replace(job.sampling, seed=self.limits.turn_seed(
                job, turn)), sample_offset=self.rank * width, sample_ids=samples, num_samples=len(first), **kw)
            if "images" in kw:
                check_expansion(out.prompt_ids, expanded)
            return out

        turns = run_tool_turns(
            first, parse=lambda i, ids, prefix: self.tools.parse(job.names, i, ids, prefix),
            run_tools=lambda i, calls: call_tools(calls, *job.tools[i], loop=loop),
            suffix_ids=self.tools.suffix_ids, generate=generate,
            any_rank=lambda flag: any(gather_object([flag])), max_iterations=self.limits.max_iterations,
            max_completion_length=self.limits.max_completion_length, max_model_len=self.limits.max_model_len(),
            media=media)
        batch = RolloutBatch(first.prompt_ids, turns.completion_ids, turns.logprobs, turns.finish_reasons,
                             first.group_index)
        episode = _episode(turns)
        episode.mm = self.tools.episode_mm(turns.images, media, job.images)
        return batch, episode


@dataclass(frozen=True)
class ToolRequests:
    """TRL's tools / environments request by request (``rollout_multi_turn='requests'``): each sample from its first
    turn to its end without a turn barrier (the dispatch ``rule``'s ``run_agents``: ``rollout/dispatch/shares.py``'s
    ``run_agents``, a balanced queue's ``run_agents_balanced``), a sample's tools running while the others
    generate. With rollout ranks the episodes run
    there, tools included (``remote_request_turns``: the placement's call, None when colocated). ``home``: where an
    environment's calls run (:class:`HomeToolCalls`); ``log_dispatch``: a balanced rollout's spread."""

    tools: TRLTools
    rollout_engine: Any
    limits: Limits
    rule: DispatchRule
    rank: int
    metrics: Any
    home: HomeToolCalls
    log_dispatch: Callable[..., None]
    remote_request_turns: Callable[..., tuple[RolloutBatch, Episode, list]] | None = None
    tokenized: bool = True

    def run(self, job: EpisodeJob) -> tuple[RolloutBatch, Episode]:
        n, mode, sampling = job.n, job.mode, job.sampling
        if self.remote_request_turns is not None:  # whole episodes on the rollout ranks, images with them
            batch, episode, tool_images = self.remote_request_turns(job.prompt_ids, n, sampling, mode, job.step_job,
                                                                    job.images)
            episode.mm = self.tools.episode_mm(tool_images, self.tools.media(job.prompt_ids, job.images), job.images)
            return batch, episode
        loop, tools, limits = self.tools.loop, job.tools, self.limits
        media = self.tools.media(job.prompt_ids, job.images)  # (a queue's driver reads it at each sample's place)
        agent = AgentCallbacks(
            parse=lambda i, ids, prefix: self.tools.parse(job.names, i, ids, prefix),
            run_tools=lambda i, calls: call_tools(calls, *tools[i], loop=loop), suffix_ids=self.tools.suffix_ids,
            max_iterations=limits.max_iterations, max_completion_length=limits.max_completion_length,
            max_model_len=limits.max_model_len(), media=media)
        prompts = [list(p) for p in job.prompt_ids]
        run_tools = agent.run_tools
        home_calls = contextlib.nullcontext(run_tools)
        if self.rule.job_wide:  # episodes run on whichever engine pulled their group
            envs = self.tools.factories is not None
            if envs and self.rollout_engine.balances_job:  # job-wide sample indices
                counts = gather_object([len(prompts)])
                first = sum(counts[:self.rank])
                ends = [sum(counts[:r + 1]) for r in range(len(counts))]
                names = gather_object(list(job.names))
                agent = replace(agent, parse=lambda i, ids, prefix: self.tools.parse(names, i, ids, prefix),
                                run_tools=lambda i, calls: call_tools(calls, *tools[i - first], loop=loop))
                home = lambda i: next(r for r, end in enumerate(ends) if i < end)  # noqa: E731
            elif envs:  # one engine: its queue is this rank's samples, each with its environment's tools
                home = None
            else:  # tools= are the same on every rank: any engine runs them
                shared = split_tools(list(self.tools.tools or []))
                agent = replace(agent, run_tools=lambda i, calls: call_tools(calls, *shared, loop=loop))
                home = None
            home_calls = self.home(envs, home, agent.run_tools, mode)
        with home_calls as run_tools:
            samples, groups, stats, pulled = self.rule.run_agents(
                self.rollout_engine, prompts, n, sampling, lambda r: limits.turn_seed(job, r),
                replace(agent, run_tools=run_tools), limits.workers, sample_offset=job.offset,
                images=job.images)
        if pulled is not None:  # groups pulled from a queue: the engines' spread
            self.log_dispatch(mode, pulled, len(prompts), n)
        turns = collect_turns(samples)
        log_agent_stats(self.metrics, mode, stats)
        batch = RolloutBatch([s.prompt_ids for s in samples], turns.completion_ids, turns.logprobs,
                             turns.finish_reasons, groups)
        episode = _episode(turns)
        episode.mm = self.tools.episode_mm(turns.images, media, job.images)
        return batch, episode
