"""The trainer with ``rollout_ranks``: engines on processes of their own (:mod:`trl_nrollout.rollout.bridge`).

On a trainer rank, :class:`RolloutRankPlacement` (a part the trainer builds once: :meth:`RolloutRankPlacement.of`)
replaces the colocated engine by :class:`~trl_nrollout.rollout.ranks.client.RemoteEngines` and feeds it the prompts of the
next ``rollout_lookahead`` steps, read ahead from TRL's own data loader (:meth:`RolloutRankPlacement.batch_samples`,
behind the trainer's ``get_batch_samples``), so the engines generate step ``k + s`` while the trainers train step
``k``. On a rollout rank, the trainer class gives a :class:`RolloutRankWorker` instead: the user's script runs
unchanged on every process, and ``train()`` there serves the trainers' jobs until they finish.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trl_nrollout.config.trl_options import UnsupportedTRLOption
from trl_nrollout.passes.multimodal import EncodedPrompts, check_expansion
from trl_nrollout.rollout.bridge import ROLLOUT, Bridge, RolloutRankError, current_bridge
from trl_nrollout.rollout.ranks.client import RemoteEngines
from trl_nrollout.rollout.ranks.episodes import EpisodeJob, agent_settings, env_tool_schemas
from trl_nrollout.rollout.ranks.partial import RESET_ENV
from trl_nrollout.rollout.ranks.serve import serve
from trl_nrollout.rollout.ranks.state import FuncSettings, RankState
from trl_nrollout.rollout.types import SamplingOptions
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.remote_partial import engine_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankCalls:
    """What the placement asks of the trainer's other parts, handed in once as callables (never the trainer):
    ``state`` (-> TRL's ``TrainerState``: ``train()`` builds a new one), ``sampling`` (mode, step= -> the sampling
    options), ``start_episodes`` (rows, busy= -> prompts, tools: environments drawn and reset), ``engine_prompts``
    (prompts -> the engine's ids, images), ``partial_job`` (step, rows -> the partial pool's part of a job),
    ``reset_env`` (group key, k: a partial group's sample started again), ``log_agent_stats`` (mode, AgentStats),
    ``live_environments`` (-> the live step's environments and their names) and ``set_live_environments``."""

    state: Callable[[], Any]
    sampling: Callable[..., SamplingOptions]
    start_episodes: Callable[..., tuple[list, list]]
    engine_prompts: Callable[[list], tuple[list[list[int]], list]]
    partial_job: Callable[[int, list[dict]], Any]
    reset_env: Callable[[tuple, int], None]
    log_agent_stats: Callable[[str, Any], None]
    live_environments: Callable[[], tuple[Any, Any]]
    set_live_environments: Callable[[Any, Any], None]


class RolloutRankPlacement:
    """The trainers' side of rollout ranks, a part of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`
    (built only with ``rollout_ranks``): the engines on the rollout ranks (``engines``), the look-ahead of jobs over
    TRL's batches read ahead, each generation's job, and the tool servers of the environments that stay here. Its
    collaborators: the config, the layout, the :class:`Metrics` sink and :class:`RankCalls`; what the episodes run
    on the rollout ranks need is fixed when it is built (``environments``: ``environment_factory`` is set;
    ``agents``: ``agent=`` episodes or a ``rollout_func`` run group by group there; ``request_tools``: tool
    episodes run there request by request, ``rollout_multi_turn="requests"`` or a partial rollout's).

    The partial pool (:mod:`trl_nrollout.trainer.remote_partial`) uses ``engines``, :meth:`ahead_jobs`,
    :meth:`log_job`, ``env_registry`` (group keys' tools, for the calls that come home) and ``env_host``."""

    #: environments' tool servers started in this process (their store prefixes)
    _hosts = 0

    def __init__(self, args, layout, metrics: Metrics, calls: RankCalls, *, num_generations: int,
                 environments: bool, agents: bool, request_tools: bool) -> None:
        self.args, self.layout, self.metrics, self.calls = args, layout, metrics, calls
        self.num_generations = num_generations
        self.environments, self.agents, self.request_tools = environments, agents, request_tools
        self.engines: RemoteEngines | None = None  # (started by start())
        self.ahead: deque = deque()  # TRL's batches read ahead of the training loop
        self.env_ahead: dict = {}  # step -> its episodes started ahead (environments reset), see episodes_ahead
        self.ahead_iter = None
        self.handed = self.consumed = 0  # batches handed to the loop / prepared, in the epoch's order
        self.held: dict = {}
        self.env_registry: dict | None = None  # key -> the samples' tools the rollout ranks' calls run on
        self.env_host = None  # their server (serve_env_tools)
        self.env_key: tuple | None = None  # the live rollout's key in env_registry
        self.env_calls = 0  # rollouts of their own registered (the first step, evaluation, DAPO's rounds)
        self.in_train = False  # inside the trainer's train()

    @classmethod
    def of(cls, trainer) -> RolloutRankPlacement:
        """The part over a built trainer's handles, read once, its engines started (:meth:`start`)."""
        args = trainer.args
        grouped_func = trainer.rollout_func is not None and bool(args.rollout_partial
                                                                 or args.rollout_multi_turn == "requests")
        request_tools = bool(args.rollout_ranks and trainer.tools
                             and (args.rollout_multi_turn == "requests" or args.rollout_partial))
        calls = RankCalls(
            state=lambda: trainer.state, sampling=trainer._sampling, start_episodes=trainer._start_episodes,
            engine_prompts=lambda prompts: engine_prompts(prompts, trainer._encode_images,
                                                          lambda p: trainer._tokenize_prompts(p)[0]),
            partial_job=lambda step, rows: trainer.partial_pool.job(step, rows),  # (the pool: built after this part)
            reset_env=lambda key, k: trainer.partial_pool.reset_env(key, k),
            log_agent_stats=trainer._log_agent_stats,
            live_environments=lambda: (trainer.environments, trainer._batch_environments),
            set_live_environments=lambda envs, names: (setattr(trainer, "environments", envs),
                                                       setattr(trainer, "_batch_environments", names)))
        part = cls(args, trainer.layout, Metrics(trainer._metrics), calls, num_generations=trainer.num_generations,
                   environments=getattr(trainer, "environment_factories", None) is not None, agents=trainer.agent is not None or grouped_func,
                   request_tools=request_tools)
        part.start(trainer.engine_setup, trainer.model, trainer.processing_class, trainer.chat_template,
                   trainer.chat_template_kwargs, trainer._endpoint_settings,
                   trainer._env_tools if request_tools and part.environments else None,
                   grouped_func=grouped_func, loop=getattr(trainer, "async_loop", None))
        return part

    def start(self, setup, model, processing_class, chat_template: str | None, chat_template_kwargs: dict | None,
              endpoint_settings: Callable[[int], dict], env_tools: dict | None, *, grouped_func: bool,
              loop=None) -> RemoteEngines:
        """Start the rollout ranks' engines (the start message), then send them the initial weights. ``setup``:
        the trainer's :class:`~trl_nrollout.trainer.engines.EngineSetup` (its refusals, lengths and weight push);
        ``endpoint_settings(max_model_len)``: an ``agent=`` endpoint's keywords; ``env_tools``: the environments'
        tools (their calls come home: :meth:`serve_env_tools`), or None; ``loop``: TRL's async loop for them."""
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
        if self.request_tools or self.agents:  # episodes run there: what they need
            episodes = settings["agent"] = agent_settings(
                processing_class, chat_template, chat_template_kwargs, seed=args.seed,
                max_iterations=args.max_tool_calling_iterations, max_completion_length=args.max_completion_length,
                max_model_len=max_len, workers=args.tool_workers)
            if self.agents:  # an endpoint on each rollout rank (its context)
                episodes.endpoint = endpoint_settings(max_len)
                episodes.timeout = args.agent_timeout_s
                episodes.max_running = args.agent_max_concurrent
            if grouped_func:  # the rollout ranks' own rollout_func, checked as here
                episodes.func = FuncSettings(self.num_generations, args.max_completion_length,
                                             args.rollout_is is not None)
            if self.request_tools and self.environments:  # their calls come home (serve_env_tools)
                episodes.env_tools = env_tool_schemas(env_tools)
                self.serve_env_tools(bridge, loop)
        if args.vllm_enable_sleep_mode:
            logger.warning("vllm_enable_sleep_mode=True has no use with rollout_ranks=%d: the engines' devices hold "
                           "nothing else, so they stay awake (and keep their KV cache) between jobs.",
                           args.rollout_ranks)
        settings["weight_sync_delta"] = args.weight_sync_delta  # what the sender does; the receivers read frames
        engines = RemoteEngines(bridge, settings, max_model_len=max_len, bucket_bytes=args.weight_sync_bucket_mb << 20)
        setup.push_weights(engines, model, version=0)  # the base once, then the adapter ("adapter" sync)
        atexit.register(engines.close)  # the rollout ranks close their engines; trainer rank 0 waits for them
        self.engines = engines
        return engines

    def agent_job(self, mode: str, step: int, rows: list[dict]) -> EpisodeJob | None:
        """The ``agent`` entry of a job whose samples are whole tool episodes (the step and mode seed their turns
        as the colocated loop's; with environments, where their calls go home) or ``agent=`` episodes (with this
        rank's ``rows``, TRL's, each ``n`` times: the trainers' entries are joined in rank order), or None for
        single-turn jobs (a partial job's: :meth:`~trl_nrollout.trainer.remote_partial.RemoteRound.job`)."""
        if self.agents:
            return EpisodeJob(step, mode, rows=[dict(row) for row in rows])
        if not self.request_tools or self.args.rollout_multi_turn != "requests":  # (partial's: the pool's job)
            return None
        if not self.environments:
            return EpisodeJob(step, mode)
        key = ("step", step) if rows else self.env_key  # rows: a job written ahead (episodes_ahead keyed it)
        names = self.env_ahead[step][4] if rows else self.calls.live_environments()[1]
        return EpisodeJob(step, mode, envs=[(self.env_host.prefix, key)], sizes=[len(names)], names=list(names))

    # ------------------------------------------------------------------ environments' tools for the rollout ranks
    def serve_env_tools(self, bridge: Bridge, loop=None) -> None:
        """Request-level episodes with environments run on the rollout ranks, while their environments stay here
        (the reward functions read them): their tool calls come home through the launch's store
        (:class:`~trl_nrollout.rollout.episodes.home_tools.HomeTools`), served from a thread for the trainer's life; call
        ``(this rank, key, k)`` runs on the ``k``-th sample's tools of the episodes registered under ``key``
        (:meth:`episodes_ahead`, :meth:`start_step_episodes`)."""
        from trl_nrollout.rollout.episodes.home_tools import HomeTools
        from trl_nrollout.rollout.episodes.tools import call_tools

        registry = self.env_registry = {}
        reset_env = self.calls.reset_env
        RolloutRankPlacement._hosts += 1  # one prefix per trainer: a script may build several in turn
        def local(i: tuple, calls: list[dict]):
            if calls == RESET_ENV:  # a partial group's sample started again (trainer/remote_partial.py)
                reset_env(i[1][1], i[2])
                return [], 0
            return call_tools(calls, *registry[i[1]][i[2]], loop=loop)

        host = HomeTools(bridge.store, f"env_tools/{RolloutRankPlacement._hosts}", bridge.rank, lambda i: i[0], local,
                         self.args.tool_workers, idle_poll_s=0.05)  # (all run long: at most 20 looks a second idle)
        self.env_host = host.__enter__()
        atexit.register(host.close)

    # ------------------------------------------------------------------ a generation's job
    def generate(self, prompt_ids: list[list[int]], images: EncodedPrompts | None, n: int, sampling,
                 offset: int, mode: str, step_job: bool):
        """This rank's samples (``prompt_ids``: each prompt ``n`` times) from the rollout ranks, the next
        ``rollout_lookahead`` steps' jobs written ahead (``step_job``: the step's own job, maybe written steps ago).
        With ``images``: the engine's ids (placeholders not expanded) and each group's images travel; the engine
        expands them, and its expansion must be the processor's (``prompt_ids``), as on colocated engines."""
        batch = self.engines.generate_expanded(
            images.engine_ids if images is not None else [list(p) for p in prompt_ids], n, sampling,
            sample_offset=offset, ahead=self.ahead_jobs(mode) if step_job else (), step_job=step_job,
            images=images.images if images is not None else None)
        if images is not None:
            check_expansion(batch.prompt_ids, prompt_ids)
        if step_job:
            self.log_job(mode)
        return batch

    def request_turns(self, prompt_ids: list[list[int]], n: int, sampling, mode: str, step_job: bool,
                      images: EncodedPrompts | None = None):
        """The trainer's ``_request_turns`` with engines on rollout ranks: each sample's whole episode (its turns,
        its tools) runs on a rollout rank as part of a job, the next ``rollout_lookahead`` steps' jobs written ahead
        as for single-turn samples. ``images``: the prompts' encoding (the job then carries the engine's ids and
        each group's images once, as :meth:`generate`'s). Returns the batch (its prompts ``prompt_ids``, the
        processor's), its :class:`~trl_nrollout.trainer.multiturn.Episode` (tool masks, messages, counts) as the
        colocated loop gives them, and per sample the images its tools returned (in order; empty: none)."""
        from dataclasses import replace

        from trl_nrollout.rollout.episodes.tools import AgentStats
        from trl_nrollout.rollout.ranks.buckets import decode_job_images
        from trl_nrollout.trainer.multiturn import Episode

        batch, extras = self.engines.run_job_episodes(
            images.engine_ids if images is not None else [list(p) for p in prompt_ids], n, sampling,
            self.agent_job(mode, self.calls.state().global_step, []),
            ahead=self.ahead_jobs(mode) if step_job else (), step_job=step_job,
            images=images.images if images is not None else None)
        if images is not None:  # the rollout ranks' samples hold the engine's ids: the trainer's forward takes these
            batch = replace(batch, prompt_ids=[list(p) for p in prompt_ids])
        if step_job:
            self.log_job(mode)
        self.calls.log_agent_stats(mode, self.engines.last_job.get("agent_stats") or AgentStats())
        tool_images = decode_job_images([e.get("images", []) for e in extras])
        return batch, Episode(tool_mask=[e["tool_mask"] for e in extras],
                              completions=[e["completions"] for e in extras], turns=[e["turns"] for e in extras],
                              tool_calls=[e["tool_calls"] for e in extras],
                              tool_failures=[e["tool_failures"] for e in extras]), tool_images

    # ------------------------------------------------------------------ reading the data ahead
    def batch_samples(self, epoch_iterator, num_batches: int) -> list:
        """transformers' ``get_batch_samples`` (less the count of items): a step's batches from the epoch's
        iterator, those read ahead (:meth:`next_generation_inputs`) handed out first, in their order, so the
        training loop sees exactly the batches it would have read."""
        if epoch_iterator is not self.ahead_iter:  # a new epoch: what was read ahead of the last one was used
            self.ahead_iter = epoch_iterator
            self.ahead.clear()
            self.handed = self.consumed = 0
            self.held = {}
        batches = []
        for _ in range(num_batches):
            if self.ahead:
                item = self.ahead.popleft()
            else:
                try:
                    item = next(epoch_iterator)
                except StopIteration:
                    break
            self.held[self.handed] = item
            self.handed += 1
            batches.append(item)
        self.held = {i: b for i, b in self.held.items() if i >= self.consumed - 1}
        return batches

    def count_batch(self) -> None:
        """One batch of the epoch's iterator reached the trainer's ``_prepare_inputs`` (train mode)."""
        self.consumed += 1

    def next_generation_inputs(self, steps: int) -> list[list[dict]]:
        """The TRL rows of this rank's next ``steps`` generations (fewer at the end of the epoch): TRL generates on
        every ``steps_per_generation * num_iterations``-th batch, so those batches of the epoch's iterator are read
        ahead (and handed to the training loop later, unchanged)."""
        if self.ahead_iter is None or steps == 0:
            return []
        every = self.args.steps_per_generation * self.args.num_iterations
        current = self.consumed - 1  # the batch being prepared, in the epoch's order
        out = []
        for k in range(1, steps + 1):
            index = current + k * every
            if index < self.handed:  # already handed to the loop (a generation shorter than an optimizer step)
                out.append(self.held[index])
                continue
            while len(self.ahead) <= index - self.handed:
                try:
                    self.ahead.append(next(self.ahead_iter))
                except StopIteration:
                    return out
            out.append(self.ahead[index - self.handed])
        return out

    def ahead_jobs(self, mode: str) -> list[tuple[list[list[int]], Any, Any, list | None]]:
        """This rank's prompt ids, sampling options, agent entry (:meth:`agent_job`) and images (per sample, or
        None; the ids then hold the image placeholders unexpanded, as the engine takes them) of the next
        ``rollout_lookahead`` generations."""
        if mode != "train" or not self.args.rollout_lookahead:
            return []
        jobs = []
        steps_per_rollout = self.layout.optimizer_steps_per_rollout
        state = self.calls.state()
        last = state.max_steps if state.max_steps and state.max_steps > 0 else None
        n = self.num_generations
        for k, rows in enumerate(self.next_generation_inputs(self.args.rollout_lookahead), start=1):
            step = state.global_step + k * steps_per_rollout
            if last is not None and step >= last:  # the run ends before that step: nothing to generate for it
                break
            if self.args.rollout_partial:  # groups for the rollout ranks' pools (trainer/remote_partial.py)
                part = self.calls.partial_job(step, rows[::n])
                pics = [im for im in part.images for _ in range(n)]
                jobs.append(([list(p) for p in part.ids for _ in range(n)], self.calls.sampling(mode, step=step),
                             part.entry, pics if any(im is not None for im in pics) else None))
                continue
            ids, images = self.calls.engine_prompts(self.episodes_ahead(step, rows))
            jobs.append((ids, self.calls.sampling(mode, step=step), self.agent_job(mode, step, rows),
                         images if any(im is not None for im in images) else None))
        return jobs

    # ------------------------------------------------------------------ environments of steps written ahead
    def held_ahead(self) -> set[int]:
        """Ids of the environments that steps written ahead hold (not to be drawn or reset by another step)."""
        return {id(env) for entry in self.env_ahead.values() for env in entry[3]}

    def episodes_ahead(self, step: int, rows: list[dict]) -> list:
        """The prompts of training step ``step``'s samples (``rows``, TRL's, ``n`` per prompt), its job written
        now. With ``environment_factory`` the step's environments are reset now, with its rows: environments of
        its own (past those the live step and the other steps written ahead hold), kept for the step's rollout
        (:meth:`start_step_episodes`), so that a step's episodes start where its first turns were generated and no
        live episode's environment is reset under it. A step already started ahead keeps its environments."""
        if not self.environments:
            return self.calls.start_episodes(rows)[0]
        held = self.env_ahead.get(step)
        if held is not None and held[0] == rows:
            return held[1]
        live = self.calls.live_environments()
        busy = self.held_ahead() | {id(env) for env in live[0] or ()}
        if held is not None:
            busy -= {id(env) for env in held[3]}
        prompts, tools = self.calls.start_episodes(rows, busy=busy)
        self.env_ahead[step] = (rows, prompts, tools, *self.calls.live_environments())
        if self.env_registry is not None:  # the job's tool calls come home to these (serve_env_tools)
            self.env_registry[("step", step)] = tools
        self.calls.set_live_environments(*live)  # the live step's, for its tools and rewards
        return prompts

    def start_step_episodes(self, inputs: list[dict], step_job: bool) -> tuple[list, list]:
        """The trainer's ``_start_episodes`` for a rollout: a training step's own episodes when they were started
        ahead with its job (:meth:`episodes_ahead`, with environments; the same rows), else new ones, past the
        environments steps written ahead hold."""
        ahead, registry = self.env_ahead, self.env_registry
        if not self.environments or (not ahead and registry is None):
            return self.calls.start_episodes(inputs)
        step = self.calls.state().global_step
        held = ahead.pop(step, None) if step_job else None
        for old in [s for s in ahead if s < step]:  # an epoch's end or a changed batch: never trained
            del ahead[old]
        if registry is not None:  # earlier rollouts' episodes have ended: their tools are not called again
            for key in [k for k in registry if k[0] == "call" or k[1] < step]:
                del registry[key]
        if held is not None and held[0] == inputs:
            _, prompts, tools, envs, names = held
            self.calls.set_live_environments(envs, names)
            self.env_key = ("step", step)
            return prompts, tools
        prompts, tools = self.calls.start_episodes(inputs, busy=self.held_ahead())
        if registry is not None:  # a rollout of its own (the first step, evaluation, DAPO's rounds)
            self.env_calls += 1
            self.env_key = ("call", self.env_calls)
            registry[self.env_key] = tools
        return prompts, tools

    def log_job(self, mode: str) -> None:
        """The step's view of the rollout ranks: how long the trainers waited for the samples, how stale they
        were, and the last weight transfer's seconds and bytes (trainer rank 0 measures; the others log 0)."""
        info = self.engines.last_job
        add = self.metrics.add
        add(mode, "rollout/wait_s", info["wait_s"])
        add(mode, "rollout/staleness", self.calls.state().global_step - info["version"])
        if info.get("moved_groups") is not None:  # rollout_dispatch="balanced" on the rollout ranks
            add(mode, "rollout/moved_groups", info["moved_groups"])
        transfer = self.engines.last_transfer
        if transfer.get("seconds") is not None:
            add(mode, "weight_sync/transfer_s", transfer["seconds"])
            add(mode, "weight_sync/transfer_mb", transfer["bytes"] / 2**20)
            if transfer.get("delta"):  # weight_sync_delta: the bytes that crossed, against the whole version's
                add(mode, "weight_sync/transfer_sent_mb", transfer["wire_bytes"] / 2**20)

    # ------------------------------------------------------------------ the end of train() / evaluate()
    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the trainer's ``train()``: when it returns, the rollout ranks' ``train()`` returns too (not
        after an error: the trainers' error stops them)."""
        self.in_train = True
        try:
            yield
        finally:
            self.in_train = False
        self.engines.end()

    def evaluated(self) -> None:
        """After the trainer's ``evaluate()``: outside ``train()``, the rollout ranks' ``evaluate()`` returns."""
        if not self.in_train:
            self.engines.end()


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
        from trl_nrollout.rollout.engines.build import build_engine, rollout_rank_settings

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


def rank_worker(args: tuple, kwargs: dict) -> RolloutRankWorker | None:
    """What ``NRolloutGRPOTrainer(*args, **kwargs)`` gives on a rollout rank of a launch with ``rollout_ranks``: a
    :class:`RolloutRankWorker` (serving until the trainers' stop, also at exit); None on a trainer rank."""
    config = kwargs.get("args", args[2] if len(args) > 2 else None)
    bridge = current_bridge()
    if bridge is None or bridge.role != ROLLOUT or not getattr(config, "rollout_ranks", 0):
        return None
    worker = RolloutRankWorker(config, kwargs.get("model", args[0] if args else None),
                               kwargs.get("processing_class"), kwargs.get("tools"), kwargs.get("agent"),
                               kwargs.get("rollout_func"))
    atexit.register(worker.close)  # until the trainers' stop (they close their side at exit)
    return worker


def _is_cpu() -> bool:
    from trl_nrollout.rollout.engines.platform import is_cpu_platform

    return is_cpu_platform()
