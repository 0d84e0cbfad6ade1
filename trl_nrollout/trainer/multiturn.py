"""TRL's agentic interfaces on our engine group: ``tools``, ``environment_factory`` and ``rollout_func``.

A mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`. TRL's ``__init__`` still sets everything up (tool
schemas in the chat template, the response parser, the environment pool, the async event loop); generation turn by
turn is :func:`~trl_nrollout.rollout.tool_episodes.run_tool_turns` on our engines, collective over ranks.

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
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from accelerate.utils import gather_object
from trl.chat_template_utils import parse_response

from trl_nrollout.passes.multimodal import IMAGE_COLUMNS, attach_images, dataset_images
from trl_nrollout.rollout.axes import machine_refusal
from trl_nrollout.rollout.dispatch.balanced import balanced_calls, run_agents_balanced
from trl_nrollout.rollout.dispatch.shares import run_agents
from trl_nrollout.rollout.engine_protocol import BALANCED, has
from trl_nrollout.rollout.func_pool import check_output, samples_batch
from trl_nrollout.rollout.home_tools import HomeTools
from trl_nrollout.rollout.seeds import step_seed
from trl_nrollout.rollout.tool_episodes import (
    AgentCallbacks,
    AgentStats,
    Turns,
    call_tools,
    collect_turns,
    run_tool_turns,
    split_tools,
)
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions


@dataclass
class Episode:
    """What a rollout produced beyond the token ids: per-sample tool masks, messages and counts (multi-turn), extra
    reward kwargs (``rollout_func``). Empty for a plain single-turn rollout."""

    tool_mask: list[list[int]] | None = None
    completions: list | None = None
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)
    extra_fields: dict[str, list] = field(default_factory=dict)
    mm: list | None = None  # a VLM's image tensors per sample (trl_nrollout.passes.multimodal)
    #: per sample, an agent's split episode's later calls (``trainer.stages.Sample``s; empty: none); None: no agent
    segments: list[tuple] | None = None
    #: per sample, an agent's episode laid out (``rollout.agent_episodes.Assembled``), for the logs; None: no agent
    assembled: list | None = None


def _environment_tools(environment: Any) -> list:
    """An environment's public methods (TRL's rule: not ``reset``, ``get_reward`` or ``_private``), bound to it."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def check_images(columns: list[str] | None, *, tools=None, rollout_func=None, environment_factory=None) -> None:
    """Images with tools, environments or a custom rollout function are not supported (TRL's tool-returned images
    and per-environment processors): refuse the combination, never train as if the images were absent."""
    from trl_nrollout.config.trl_options import UnsupportedTRLOption

    found = sorted(set(IMAGE_COLUMNS) & set(columns or []))
    agentic = [name for name, value in (("tools", tools), ("rollout_func", rollout_func),
                                        ("environment_factory", environment_factory)) if value]
    if found and agentic:
        raise UnsupportedTRLOption(
            f"the dataset has image column(s) {found} (image prompts) and the trainer was given {agentic}: images in "
            "multi-turn or custom rollouts are not supported by NRolloutGRPOTrainer (single-turn image prompts "
            "are). Use trl.GRPOTrainer for this combination, or drop the image columns or the tools.")


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


class MultiTurnRollout:
    """Mixin: episodes (environments), tool turns and custom rollout functions on the trainer's engines."""

    def _start_episodes(self, inputs: list[dict], busy: set[int] | None = None) -> tuple[list, list]:
        """The prompts of this rank's samples, with one environment per sample drawn from TRL's pool and reset
        (a returned observation is appended to the prompt's last message), and each sample's tools (sync, async).
        ``busy``: ids of pool environments not to draw (None: those a partial rollout's episodes in flight hold,
        trainer/partial_envs.py, so that an evaluation's episodes never reset them)."""
        factories = getattr(self, "environment_factories", None)
        if factories is None:
            prompts = attach_images([x["prompt"] for x in inputs], dataset_images(inputs))
            return prompts, [split_tools(list(self.tools or []))] * len(inputs)
        prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]
        names = [x.get("environment") if self._multi_environment else None for x in inputs]
        unknown = sorted({n for n in names if n not in factories}, key=str)
        if unknown:  # TRL's words (users and tests match them), then the others and a fix
            others = f" (also {unknown[1:]!r})" if len(unknown) > 1 else ""
            raise ValueError(f"Example has `environment={unknown[0]!r}`, which is not among the environments passed "
                             f"to `environment_factory`. Expected one of: {list(factories)}.{others} Fix the "
                             "dataset's `environment` column, or add the factory to environment_factory.")
        self._batch_environments = names  # TRL's _tokenize_prompts renders each prompt with its environment's tools
        taken: Counter = Counter()
        self.environments = []
        held = busy if busy is not None else {id(env) for envs in self.__dict__.get("_partial_envs_by_key", {}).values()
                                               for env in envs}
        for name in names:
            pool = self._environment_pool[name]
            while taken[name] < len(pool) and id(pool[taken[name]]) in held:
                taken[name] += 1
            if taken[name] == len(pool):
                pool.append(factories[name]())
            self.environments.append(pool[taken[name]])
            taken[name] += 1
        tools = [split_tools(list(self._standalone_tools) + _environment_tools(env)) for env in self.environments]
        for i, (env, row) in enumerate(zip(self.environments, inputs)):
            observation = env.reset(**self._reset_kwargs(row))
            if observation is None:
                continue
            last = prompts[i][-1]
            content = last["content"]
            if isinstance(content, list) or isinstance(observation, list):  # typed content blocks
                content = _blocks(content) + _blocks(observation)
            else:
                content = content + observation
            prompts[i] = prompts[i][:-1] + [{**last, "content": content}]
        return prompts, tools

    def _reset_kwargs(self, row: dict) -> dict:
        """What an environment's ``reset`` gets for a dataset ``row`` (TRL's rule: the row, less ``environment``
        where ``environment_factory`` is a dict)."""
        return {k: v for k, v in row.items() if k != "environment"} if self._multi_environment else row

    def _parse_turn(self, i: int, ids: list[int], prefix: list[int]) -> dict:
        """Sample ``i``'s assistant message from its turn's token ids (TRL's parser, with its prompt's tools)."""
        if getattr(self, "environment_factories", None) is not None:
            tools = self._env_tools[self._batch_environments[i]]
        else:
            tools = self.tools
        return parse_response(self._tokenizer, ids, prefix=prefix, tools=tools)

    def _tool_turns(self, first: RolloutBatch, sampling: SamplingOptions, mode: str, tools: list) -> Turns:
        """Continue ``first`` turn by turn on the engine while samples call tools (see ``run_tool_turns``);
        ``tools``: each sample's (sync, async) tools, from :meth:`_start_episodes`."""
        loop = getattr(self, "async_loop", None)
        rank, width = self.accelerator.process_index, max(1, len(first))

        def generate(contexts, budgets, turn, samples):
            seed = None if sampling.seed is None else step_seed(self.args.seed, self.state.global_step, turn,
                                                                f"{mode}/turn")
            return self.rollout_engine.generate_turns(contexts, budgets, replace(sampling, seed=seed),
                                                      sample_offset=rank * width, sample_ids=samples,
                                                      num_samples=len(first))

        max_len = getattr(self.rollout_engine, "max_model_len", None) or self.engine_setup.context_length() or 1 << 30
        iterations = self.args.max_tool_calling_iterations
        return run_tool_turns(
            first, parse=self._parse_turn,
            run_tools=lambda i, calls: call_tools(calls, *tools[i], loop=loop),
            suffix_ids=self._get_tool_suffix_ids, generate=generate,
            any_rank=lambda flag: any(gather_object([flag])), max_iterations=iterations,
            max_completion_length=self.args.max_completion_length, max_model_len=max_len)

    def _request_turns_refusal(self) -> str | None:
        """Why ``rollout_multi_turn='requests'`` cannot run with this trainer (None: it can)."""
        if self.rollout_backend != "vllm":
            return machine_refusal("rollout_multi_turn='requests'", "rollout_multi_turn='turns'", auto=True)
        return None

    def _request_turns(self, prompt_ids: list[list[int]], n: int, sampling: SamplingOptions, mode: str, tools: list,
                       offset: int, step_job: bool = False) -> tuple[RolloutBatch, Episode]:
        """This rank's samples (prompts repeated n times) from their first turn to their end without a turn barrier
        (``rollout/dispatch/shares.py``'s ``run_agents``): a sample's tools run while the others generate. With rollout ranks
        the episodes run there, tools included (:meth:`~trl_nrollout.trainer.rollout_ranks.RolloutRankPlacement.request_turns`; ``step_job``: this is
        a training step's own job, maybe written steps ahead)."""
        if self._on_rollout_ranks:
            return self._remote_request_turns(prompt_ids, n, sampling, mode, step_job)
        loop = getattr(self, "async_loop", None)
        max_len = getattr(self.rollout_engine, "max_model_len", None) or self.engine_setup.context_length() or 1 << 30
        agent = AgentCallbacks(
            parse=self._parse_turn, run_tools=lambda i, calls: call_tools(calls, *tools[i], loop=loop),
            suffix_ids=self._get_tool_suffix_ids, max_iterations=self.args.max_tool_calling_iterations,
            max_completion_length=self.args.max_completion_length, max_model_len=max_len)

        def turn_seed(round_: int) -> int | None:
            if sampling.seed is None:
                return None
            return step_seed(self.args.seed, self.state.global_step, round_, f"{mode}/turn")

        prompts = [list(p) for p in prompt_ids]
        if self.args.rollout_dispatch == "balanced":  # episodes run on whichever engine pulled their group
            envs = getattr(self, "environment_factories", None) is not None
            if envs and self.rollout_engine.balances_job:  # job-wide sample indices
                counts = gather_object([len(prompts)])
                first = sum(counts[:self.accelerator.process_index])
                ends = [sum(counts[:r + 1]) for r in range(len(counts))]
                names = gather_object(list(self._batch_environments))
                agent = replace(agent, parse=lambda i, ids, prefix: parse_response(
                    self._tokenizer, ids, prefix=prefix, tools=self._env_tools[names[i]]),
                    run_tools=lambda i, calls: call_tools(calls, *tools[i - first], loop=loop))
                home = lambda i: next(r for r, end in enumerate(ends) if i < end)  # noqa: E731
            elif envs:  # one engine: its queue is this rank's samples, each with its environment's tools
                home = None
            else:  # tools= are the same on every rank: any engine runs them
                shared = split_tools(list(self.tools or []))
                agent = replace(agent, run_tools=lambda i, calls: call_tools(calls, *shared, loop=loop))
                home = None
            with self._home_tools(envs, home, agent.run_tools) as run_tools:
                samples, groups, stats, pulled = run_agents_balanced(self.rollout_engine,
                    prompts, n, sampling, turn_seed, replace(agent, run_tools=run_tools), self.args.tool_workers)
            self._log_dispatch(mode, pulled, len(prompts), n)
        else:
            samples, groups, stats = run_agents(self.rollout_engine,
                prompts, n, sampling, turn_seed, agent, self.args.tool_workers, sample_offset=offset)
        turns = collect_turns(samples)
        self._log_agent_stats(mode, stats)
        batch = RolloutBatch([s.prompt_ids for s in samples], turns.completion_ids, turns.logprobs,
                             turns.finish_reasons, groups)
        return batch, Episode(tool_mask=turns.tool_mask, completions=turns.completions, turns=turns.turns,
                              tool_calls=turns.tool_calls, tool_failures=turns.tool_failures)

    @contextlib.contextmanager
    def _home_tools(self, envs: bool, home, run_tools):
        """``run_tools`` as an engine pulling other ranks' groups runs them: with environments (``envs``) and
        several engines, each sample's calls run on its ``home(i)`` rank, where its environment lives
        (:class:`~trl_nrollout.rollout.home_tools.HomeTools`, served from a thread here until every engine is done);
        else ``run_tools`` itself. Every rank enters and leaves it together (around the engines' collective run)."""
        if not envs or not self.rollout_engine.balances_job:
            yield run_tools
            return
        self._home_tools_calls = getattr(self, "_home_tools_calls", 0) + 1
        store = torch.distributed.distributed_c10d._get_default_store()
        host = HomeTools(store, f"nr_home_tools/{self._home_tools_calls}", self.accelerator.process_index, home,
                         run_tools, self.args.tool_workers)
        with host:
            yield host.run
        sent = sum(gather_object([host.sent]))  # every rank's calls sent to another rank (all ranks are here)
        self._metric("train" if self.model.training else "eval", "tools/calls_sent_home", sent)

    def _log_agent_stats(self, mode: str, stats: AgentStats) -> None:
        """How much the engine overlapped tools (means over ranks): ``tools/overlap`` the share of engine steps
        taken while a tool ran, ``tools/engine_idle_s`` the seconds the engine waited with nothing to run,
        ``tools/call_seconds`` the tool calls' summed seconds."""
        every = gather_object([(stats.engine_steps, stats.steps_with_tools, stats.idle_s, stats.tool_s)])
        steps = sum(e[0] for e in every)
        self._metric(mode, "tools/overlap", sum(e[1] for e in every) / steps if steps else 0.0)
        self._metric(mode, "tools/engine_idle_s", sum(e[2] for e in every) / len(every))
        self._metric(mode, "tools/call_seconds", sum(e[3] for e in every) / len(every))

    def _custom_rollout(self, prompts: list, n: int) -> tuple[RolloutBatch, Episode]:
        """TRL's ``rollout_func(prompts, trainer)``: the user generates; we check and adopt what it returns. With
        ``rollout_dispatch="balanced"`` on colocated vLLM engines, each of its ``trainer.rollout_engine.
        generate_expanded`` calls is a balanced rollout (the call's groups of every rank in one queue; every rank
        makes the same calls), logged as the trainer's own. (With ``rollout_multi_turn='requests'`` the function runs
        group by group: :meth:`AgentRollouts._agent_rollout`.)"""
        if self.args.rollout_dispatch == "balanced" and has(self.rollout_engine, BALANCED):
            with balanced_calls(self.rollout_engine) as calls:
                output = self.rollout_func(prompts, self)
            mode = "train" if self.model.training else "eval"
            for pulled, samples, call_n in calls:
                self._log_dispatch(mode, pulled, samples, call_n)
        else:
            output = self.rollout_func(prompts, self)
        samples = check_output(output, len(prompts), n, self.args.max_completion_length,
                               self.args.rollout_is is not None)
        batch, masks, extra = samples_batch(samples, n, self.accelerator.process_index * len(prompts))
        return batch, Episode(tool_mask=masks, extra_fields=extra)

    def _log_turns(self, mode: str, episode: Episode) -> None:
        """verl's ``num_turns/*`` and TRL's ``tools/call_frequency`` / ``tools/failure_frequency`` (all ranks)."""
        if not episode.turns:
            return
        stats = gather_object([(t, c, f) for t, c, f in zip(episode.turns, episode.tool_calls, episode.tool_failures)])
        turns = torch.tensor([s[0] for s in stats], dtype=torch.float32)
        calls = sum(s[1] for s in stats)
        self._metric(mode, "num_turns/mean", turns.mean().item())
        self._metric(mode, "num_turns/min", turns.min().item())
        self._metric(mode, "num_turns/max", turns.max().item())
        self._metric(mode, "tools/call_frequency", calls / max(1, len(stats)))
        self._metric(mode, "tools/failure_frequency", sum(s[2] for s in stats) / calls if calls else 0.0)
