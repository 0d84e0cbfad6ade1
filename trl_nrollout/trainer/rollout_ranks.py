"""The trainer with ``rollout_ranks``: engines on processes of their own (:mod:`trl_nrollout.rollout.ranks`).

On a trainer rank, :class:`RolloutRanks` (a mixin of the GRPO trainer) replaces the colocated engine by
:class:`~trl_nrollout.rollout.remote.RemoteEngines` and feeds it the prompts of the next ``rollout_lookahead`` steps,
read ahead from TRL's own data loader (:meth:`RolloutRanks.get_batch_samples`), so the engines generate step
``k + s`` while the trainers train step ``k``. On a rollout rank, the trainer class gives a
:class:`RolloutRankWorker` instead: the user's script runs unchanged on every process, and ``train()`` there serves
the trainers' jobs until they finish.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections import deque
from typing import Any

from trl_nrollout.config.trl_options import UnsupportedTRLOption
from trl_nrollout.passes.multimodal import EncodedPrompts, check_expansion
from trl_nrollout.rollout.engine_protocol import JOBS, has
from trl_nrollout.rollout.rank_state import RankState
from trl_nrollout.rollout.ranks import Bridge, RolloutRankError, current_bridge
from trl_nrollout.rollout.remote import RemoteEngines
from trl_nrollout.rollout.remote_partial import RESET_ENV
from trl_nrollout.rollout.remote_serve import serve
from trl_nrollout.rollout.remote_tool_episodes import agent_settings, env_tool_schemas
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.remote_partial import engine_prompts

logger = logging.getLogger(__name__)


class RolloutRanks:
    """Mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: the trainers' side of rollout ranks (with
    ``rollout_partial``, the pool part's round: :class:`~trl_nrollout.trainer.remote_partial.RemoteRound`)."""

    @property
    def _has_environments(self) -> bool:
        return getattr(self, "environment_factories", None) is not None

    def _engine_prompts(self, prompts: list) -> tuple[list[list[int]], list]:
        """The engine's ids of ``prompts`` (image placeholders not expanded) and each prompt's images (None: text)."""
        return engine_prompts(prompts, self._encode_images, lambda p: self._tokenize_prompts(p)[0])

    def _start_remote_engines(self) -> RemoteEngines:
        """Start the rollout ranks' engines (the start message), then send them the initial weights."""
        setup = self.engine_setup  # the part: its refusals, lengths and weight push
        if (refusal := setup.vllm_refusal()) is not None:
            raise UnsupportedTRLOption(f"rollout_ranks={self.args.rollout_ranks} generates with vLLM, which cannot "
                                       f"serve this run: {refusal}.")
        args = self.args
        max_len, expected = setup.vllm_lengths()
        bridge = current_bridge()
        settings = dict(
            model=setup.model_path(), dtype=args.rollout_dtype, max_model_len=max_len, expected_len=expected,
            max_num_seqs=args.rollout_max_num_seqs, kv_cache_memory_bytes=args.rollout_kv_cache_memory_bytes,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, enforce_eager=args.rollout_enforce_eager,
            enable_prefix_caching=args.rollout_enable_prefix_caching, enable_sleep_mode=False,
            seed=args.seed, seed_mode=args.rollout_seed_mode or "sample",
            trust_remote_code=setup.trusts_remote_code(), job_samples=self.layout.total_samples,
            lookahead=args.rollout_lookahead, lora_rank=setup.engine_lora_rank(), dispatch=args.rollout_dispatch)
        if self._remote_agents or self.agent is not None or self._grouped_func:  # episodes run there: what they need
            settings["agent"] = agent_settings(
                self.processing_class, self.chat_template, self.chat_template_kwargs, seed=args.seed,
                max_iterations=args.max_tool_calling_iterations, max_completion_length=args.max_completion_length,
                max_model_len=max_len, workers=args.tool_workers)
            if self.agent is not None or self._grouped_func:  # an endpoint on each rollout rank (its context)
                settings["agent"]["endpoint"] = self._endpoint_settings(max_len)
                settings["agent"]["timeout"] = args.agent_timeout_s
                settings["agent"]["max_running"] = args.agent_max_concurrent
            if self._grouped_func:  # the rollout ranks' own rollout_func, checked as here
                settings["agent"]["func"] = {"n": self.num_generations, "limit": args.max_completion_length,
                                             "need_logprobs": args.rollout_is is not None}
            if self._remote_agents and self._has_environments:  # their calls come home (_serve_env_tools)
                settings["agent"]["env_tools"] = env_tool_schemas(self._env_tools)
                self._serve_env_tools(bridge)
        if args.vllm_enable_sleep_mode:
            logger.warning("vllm_enable_sleep_mode=True has no use with rollout_ranks=%d: the engines' devices hold "
                           "nothing else, so they stay awake (and keep their KV cache) between jobs.",
                           args.rollout_ranks)
        settings["weight_sync_delta"] = args.weight_sync_delta  # what the sender does; the receivers read frames
        engines = RemoteEngines(bridge, settings, max_model_len=max_len, bucket_bytes=args.weight_sync_bucket_mb << 20)
        setup.push_weights(engines, self.model, version=0)  # the base once, then the adapter ("adapter" sync)
        atexit.register(engines.close)  # the rollout ranks close their engines; trainer rank 0 waits for them
        self._ahead: deque = deque()  # TRL's batches read ahead of the training loop
        self._env_ahead: dict = {}  # step -> its episodes started ahead (environments reset), see _episodes_ahead
        self._ahead_iter = None
        self._handed = self._consumed = 0  # batches handed to the loop / prepared, in the epoch's order
        self._held: dict = {}
        return engines

    @property
    def _remote(self) -> bool:
        return has(getattr(self, "rollout_engine", None), JOBS)

    @property
    def _remote_agents(self) -> bool:
        """Tool episodes run request by request on the rollout ranks (``rollout_multi_turn="requests"``, or a partial
        rollout's: it has no turn barrier)."""
        return bool(self.args.rollout_ranks and self.tools
                    and (self.args.rollout_multi_turn == "requests" or self.args.rollout_partial))

    @property
    def _grouped_func(self) -> bool:
        """A ``rollout_func`` runs group by group (``rollout_partial``, or ``rollout_multi_turn="requests"``): on the
        rollout ranks, as ``agent=`` episodes run there (:func:`~trl_nrollout.rollout.remote_tool_episodes.rank_runner`)."""
        return self.rollout_func is not None and bool(self.args.rollout_partial
                                                      or self.args.rollout_multi_turn == "requests")

    def _agent_job(self, mode: str, step: int, rows: list[dict]) -> dict | None:
        """The ``agent`` entry of a job whose samples are whole tool episodes (the step and mode seed their turns
        as the colocated loop's; with environments, where their calls go home) or ``agent=`` episodes (with this
        rank's ``rows``, TRL's, each ``n`` times: the trainers' entries are joined in rank order), or None for
        single-turn jobs (a partial job's: :meth:`~trl_nrollout.trainer.remote_partial.RemoteRound.job`)."""
        if self.agent is not None or self._grouped_func:
            return {"step": step, "mode": mode, "rows": [dict(row) for row in rows]}
        if not self._remote_agents or self.args.rollout_multi_turn != "requests":  # (partial's: the pool's job)
            return None
        if not self._has_environments:
            return {"step": step, "mode": mode}
        key = ("step", step) if rows else self._env_key  # rows: a job written ahead (_episodes_ahead keyed it)
        names = self._env_ahead[step][4] if rows else self._batch_environments
        return {"step": step, "mode": mode, "env": (self._env_host.prefix, key), "names": list(names)}

    # ------------------------------------------------------------------ environments' tools for the rollout ranks
    def _serve_env_tools(self, bridge: Bridge) -> None:
        """Request-level episodes with environments run on the rollout ranks, while their environments stay here
        (the reward functions read them): their tool calls come home through the launch's store
        (:class:`~trl_nrollout.rollout.home_tools.HomeTools`), served from a thread for the trainer's life; call
        ``(this rank, key, k)`` runs on the ``k``-th sample's tools of the episodes registered under ``key``
        (:meth:`_episodes_ahead`, :meth:`_start_step_episodes`)."""
        from trl_nrollout.rollout.home_tools import HomeTools
        from trl_nrollout.rollout.tool_episodes import call_tools

        loop = getattr(self, "async_loop", None)
        self._env_registry: dict = {}
        RolloutRanks._hosts += 1  # one prefix per trainer: a script may build several in turn
        def local(i: tuple, calls: list[dict]):
            if calls == RESET_ENV:  # a partial group's sample started again (trainer/remote_partial.py)
                self.partial_pool.reset_env(i[1][1], i[2])
                return [], 0
            return call_tools(calls, *self._env_registry[i[1]][i[2]], loop=loop)

        host = HomeTools(bridge.store, f"env_tools/{RolloutRanks._hosts}", bridge.rank, lambda i: i[0], local,
                         self.args.tool_workers, idle_poll_s=0.05)  # (all run long: at most 20 looks a second idle)
        self._env_host = host.__enter__()
        atexit.register(host.close)

    #: environments' tool servers started in this process (their store prefixes)
    _hosts = 0

    def _remote_generate(self, prompt_ids: list[list[int]], images: EncodedPrompts | None, n: int, sampling,
                         offset: int, mode: str, step_job: bool):
        """This rank's samples (``prompt_ids``: each prompt ``n`` times) from the rollout ranks, the next
        ``rollout_lookahead`` steps' jobs written ahead (``step_job``: the step's own job, maybe written steps ago).
        With ``images``: the engine's ids (placeholders not expanded) and each group's images travel; the engine
        expands them, and its expansion must be the processor's (``prompt_ids``), as on colocated engines."""
        batch = self.rollout_engine.generate_expanded(
            images.engine_ids if images is not None else [list(p) for p in prompt_ids], n, sampling,
            sample_offset=offset, ahead=self._ahead_jobs(mode) if step_job else (), step_job=step_job,
            images=images.images if images is not None else None)
        if images is not None:
            check_expansion(batch.prompt_ids, prompt_ids)
        if step_job:
            self._log_remote(mode)
        return batch

    def _remote_request_turns(self, prompt_ids: list[list[int]], n: int, sampling, mode: str, step_job: bool):
        """:meth:`_request_turns` with engines on rollout ranks: each sample's whole episode (its turns, its tools)
        runs on a rollout rank as part of a job, the next ``rollout_lookahead`` steps' jobs written ahead as for
        single-turn samples. Returns the batch and its :class:`~trl_nrollout.trainer.multiturn.Episode` (tool
        masks, messages, counts) as the colocated loop gives them."""
        from trl_nrollout.rollout.tool_episodes import AgentStats
        from trl_nrollout.trainer.multiturn import Episode

        batch, extras = self.rollout_engine.run_job_episodes(
            [list(p) for p in prompt_ids], n, sampling, self._agent_job(mode, self.state.global_step, []),
            ahead=self._ahead_jobs(mode) if step_job else (), step_job=step_job)
        if step_job:
            self._log_remote(mode)
        self._log_agent_stats(mode, self.rollout_engine.last_job.get("agent_stats") or AgentStats())
        return batch, Episode(tool_mask=[e["tool_mask"] for e in extras],
                              completions=[e["completions"] for e in extras], turns=[e["turns"] for e in extras],
                              tool_calls=[e["tool_calls"] for e in extras],
                              tool_failures=[e["tool_failures"] for e in extras])

    # ------------------------------------------------------------------ reading the data ahead
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' hook that takes a step's batches from the epoch's iterator: with rollout ranks, batches
        read ahead (:meth:`_next_generation_inputs`) are handed out first, in their order, so the training loop
        sees exactly the batches it would have read."""
        if not self._remote:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if epoch_iterator is not self._ahead_iter:  # a new epoch: what was read ahead of the last one was used
            self._ahead_iter = epoch_iterator
            self._ahead.clear()
            self._handed = self._consumed = 0
            self._held = {}
        batches = []
        for _ in range(num_batches):
            if self._ahead:
                item = self._ahead.popleft()
            else:
                try:
                    item = next(epoch_iterator)
                except StopIteration:
                    break
            self._held[self._handed] = item
            self._handed += 1
            batches.append(item)
        self._held = {i: b for i, b in self._held.items() if i >= self._consumed - 1}
        return batches, self._get_num_items_in_batch(batches, device)

    def _count_batch(self) -> None:
        """One batch of the epoch's iterator reached ``_prepare_inputs`` (train mode)."""
        if self._remote:
            self._consumed += 1

    def _next_generation_inputs(self, steps: int) -> list[list[dict]]:
        """The TRL rows of this rank's next ``steps`` generations (fewer at the end of the epoch): TRL generates on
        every ``steps_per_generation * num_iterations``-th batch, so those batches of the epoch's iterator are read
        ahead (and handed to the training loop later, unchanged)."""
        if self._ahead_iter is None or steps == 0:
            return []
        every = self.args.steps_per_generation * self.num_iterations
        current = self._consumed - 1  # the batch being prepared, in the epoch's order
        out = []
        for k in range(1, steps + 1):
            index = current + k * every
            if index < self._handed:  # already handed to the loop (a generation shorter than an optimizer step)
                out.append(self._held[index])
                continue
            while len(self._ahead) <= index - self._handed:
                try:
                    self._ahead.append(next(self._ahead_iter))
                except StopIteration:
                    return out
            out.append(self._ahead[index - self._handed])
        return out

    def _ahead_jobs(self, mode: str) -> list[tuple[list[list[int]], Any, dict | None, list | None]]:
        """This rank's prompt ids, sampling options, agent entry (:meth:`_agent_job`) and images (per sample, or
        None; the ids then hold the image placeholders unexpanded, as the engine takes them) of the next
        ``rollout_lookahead`` generations."""
        if mode != "train" or not self.args.rollout_lookahead:
            return []
        jobs = []
        steps_per_rollout = self.layout.optimizer_steps_per_rollout
        last = self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None
        n = self.num_generations
        for k, rows in enumerate(self._next_generation_inputs(self.args.rollout_lookahead), start=1):
            step = self.state.global_step + k * steps_per_rollout
            if last is not None and step >= last:  # the run ends before that step: nothing to generate for it
                break
            if self.args.rollout_partial:  # groups for the rollout ranks' pools (trainer/remote_partial.py)
                part = self.partial_pool.job(step, rows[::n])
                pics = [im for im in part.images for _ in range(n)]
                jobs.append(([list(p) for p in part.ids for _ in range(n)], self._sampling(mode, step=step),
                             part.entry, pics if any(im is not None for im in pics) else None))
                continue
            ids, images = self._engine_prompts(self._episodes_ahead(step, rows))
            jobs.append((ids, self._sampling(mode, step=step), self._agent_job(mode, step, rows),
                         images if any(im is not None for im in images) else None))
        return jobs

    # ------------------------------------------------------------------ environments of steps written ahead
    def _held_ahead(self) -> set[int]:
        """Ids of the environments that steps written ahead hold (not to be drawn or reset by another step)."""
        return {id(env) for entry in self.__dict__.get("_env_ahead", {}).values() for env in entry[3]}

    def _episodes_ahead(self, step: int, rows: list[dict]) -> list:
        """The prompts of training step ``step``'s samples (``rows``, TRL's, ``n`` per prompt), its job written
        now. With ``environment_factory`` the step's environments are reset now, with its rows: environments of
        its own (past those the live step and the other steps written ahead hold), kept for the step's rollout
        (:meth:`_start_step_episodes`), so that a step's episodes start where its first turns were generated and no
        live episode's environment is reset under it. A step already started ahead keeps its environments."""
        if not self._has_environments:
            return self._start_episodes(rows)[0]
        held = self._env_ahead.get(step)
        if held is not None and held[0] == rows:
            return held[1]
        live = self.environments, self._batch_environments
        busy = self._held_ahead() | {id(env) for env in live[0] or ()}
        if held is not None:
            busy -= {id(env) for env in held[3]}
        prompts, tools = self._start_episodes(rows, busy=busy)
        self._env_ahead[step] = (rows, prompts, tools, self.environments, self._batch_environments)
        if "_env_registry" in self.__dict__:  # the job's tool calls come home to these (_serve_env_tools)
            self._env_registry[("step", step)] = tools
        self.environments, self._batch_environments = live  # the live step's, for its tools and rewards
        return prompts

    def _start_step_episodes(self, inputs: list[dict], step_job: bool) -> tuple[list, list]:
        """:meth:`_start_episodes` for a rollout: a training step's own episodes when they were started ahead with
        its job (:meth:`_episodes_ahead`, rollout ranks with environments; the same rows), else new ones, past the
        environments steps written ahead hold."""
        ahead = self.__dict__.get("_env_ahead")
        registry = self.__dict__.get("_env_registry")
        if not self._has_environments or (not ahead and registry is None):
            return self._start_episodes(inputs)
        step = self.state.global_step
        held = ahead.pop(step, None) if step_job else None
        for old in [s for s in ahead if s < step]:  # an epoch's end or a changed batch: never trained
            del ahead[old]
        if registry is not None:  # earlier rollouts' episodes have ended: their tools are not called again
            for key in [k for k in registry if k[0] == "call" or k[1] < step]:
                del registry[key]
        if held is not None and held[0] == inputs:
            _, prompts, tools, self.environments, self._batch_environments = held
            self._env_key = ("step", step)
            return prompts, tools
        prompts, tools = self._start_episodes(inputs, busy=self._held_ahead())
        if registry is not None:  # a rollout of its own (the first step, evaluation, DAPO's rounds)
            self._env_calls = self.__dict__.get("_env_calls", 0) + 1
            self._env_key = ("call", self._env_calls)
            registry[self._env_key] = tools
        return prompts, tools

    def _log_remote(self, mode: str) -> None:
        """The step's view of the rollout ranks: how long the trainers waited for the samples, how stale they
        were, and the last weight transfer's seconds and bytes (trainer rank 0 measures; the others log 0)."""
        info = self.rollout_engine.last_job
        self._metric(mode, "rollout/wait_s", info["wait_s"])
        self._metric(mode, "rollout/staleness", self.state.global_step - info["version"])
        if info.get("moved_groups") is not None:  # rollout_dispatch="balanced" on the rollout ranks
            self._metric(mode, "rollout/moved_groups", info["moved_groups"])
        transfer = self.rollout_engine.last_transfer
        if transfer.get("seconds") is not None:
            self._metric(mode, "weight_sync/transfer_s", transfer["seconds"])
            self._metric(mode, "weight_sync/transfer_mb", transfer["bytes"] / 2**20)
            if transfer.get("delta"):  # weight_sync_delta: the bytes that crossed, against the whole version's
                Metrics(self._metrics).add(mode, "weight_sync/transfer_sent_mb", transfer["wire_bytes"] / 2**20)

    # ------------------------------------------------------------------ the end of train() / evaluate()
    def train(self, *args, **kwargs):
        self._nr_training = True
        try:
            result = super().train(*args, **kwargs)
        finally:
            self._nr_training = False
        if self._remote:
            self.rollout_engine.end()  # the rollout ranks' train() returns
        return result

    def evaluate(self, *args, **kwargs):
        result = super().evaluate(*args, **kwargs)
        if self._remote and not getattr(self, "_nr_training", False):
            self.rollout_engine.end()
        return result


class RolloutRankWorker:
    """What ``NRolloutGRPOTrainer(...)`` gives on a rollout rank: ``train()`` and ``evaluate()`` serve the trainers'
    jobs until they return (so the same script runs on every process); saving, pushing and logging are the
    trainers' (no-ops here). Anything else a trainer has is not here: the error says so."""

    _NO_OPS = ("save_model", "save_state", "push_to_hub", "log_metrics", "save_metrics", "create_model_card",
               "add_callback", "remove_callback", "log")

    def __init__(self, args, model=None, processing_class=None, tools=None, agent=None, rollout_func=None) -> None:
        self.args = args
        self.bridge: Bridge = current_bridge()
        # rollout_multi_turn="requests": the episodes' tools; agent=: the user's agent (run here, on the endpoint);
        # a rollout_func run group by group (partial, or rollout_multi_turn="requests"): run here, as agents are
        self._state = RankState(tools=list(tools or []), user_agent=agent, user_func=rollout_func, user_args=args)
        self.model = model
        self.processing_class = processing_class
        self.is_rollout_rank = True
        self.stats: dict = {}

    def _build_engine(self, settings: dict):
        """This rollout rank's engine, from the trainers' start message ``settings``."""
        from trl_nrollout.rollout.build import build_engine, rollout_rank_settings

        roles = self.bridge.roles
        return build_engine(rollout_rank_settings(
            settings, rollout_ranks=roles.rollout_ranks, nodes=max(1, roles.rollout_ranks // roles.role_local_world(
                self.bridge.rank)), tp=self.args.rollout_tp_size, rank=roles.role_rank(self.bridge.rank),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")), cpu=_is_cpu()))

    def _serve(self) -> dict:
        if self._state.stopped:
            return self.stats
        stats = serve(self.bridge, self._build_engine, self._state)
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0) + v
        return stats

    def train(self, *args, **kwargs):
        """Serve the trainers' weights and jobs until their ``train()`` returns; returns what this rank did."""
        return self._serve()

    def evaluate(self, *args, **kwargs) -> dict:
        self._serve()
        return {}

    def close(self) -> None:
        """Serve until the trainers' stop (they close their side when they are done); nothing to wait for when
        they already ended (an error there stopped them: theirs is the message to read)."""
        if not self._state.stopped:
            with contextlib.suppress(RolloutRankError):
                self._serve()

    def __getattr__(self, name: str):
        if name in RolloutRankWorker._NO_OPS:
            return lambda *a, **k: None
        raise AttributeError(
            f"{name!r}: this process is a rollout rank (rollout_ranks={self.args.rollout_ranks}): it generates for "
            "the trainers and has no model to train, save or evaluate; guard trainer-only code with "
            "`if not getattr(trainer, 'is_rollout_rank', False):`.")


def _is_cpu() -> bool:
    from trl_nrollout.rollout.platform import is_cpu_platform

    return is_cpu_platform()
