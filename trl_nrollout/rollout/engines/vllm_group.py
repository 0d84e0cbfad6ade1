"""``VLLMEngineGroup``: verl's rollout stage without Ray, one vLLM engine per tensor-parallel group of ranks.

Every accelerate process builds its part of one vLLM ``LLM`` with ``distributed_executor_backend=
"external_launcher"``: consecutive ranks form a TP group (``RolloutLayout.engine_ranks``), so there are
``world / rollout_tp_size`` engines. For a rollout, each rank hands in its own prompts; the prompts of a TP
group are gathered so that every rank of the engine calls ``generate`` with the same inputs; the engine samples
``n`` completions per prompt with vLLM's native ``n`` (one request per prompt: its KV cache is computed once and
shared by the ``n`` samples); each rank keeps the samples of its own prompts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.engines.cpu_shm import use_cpu_shm_identity
from trl_nrollout.rollout.engines.platform import ensure_dist_env, is_cpu_platform, prepare_vllm_environment
from trl_nrollout.rollout.engines.protocol import ABORT, ADAPTERS, BALANCED, BUCKETS, REQUESTS, SCORES
from trl_nrollout.rollout.engines.requests import EngineLoop
from trl_nrollout.rollout.engines.vllm_process import (
    LIVE_ENGINES,
    barrier_scope,
    close_live_engines,
    exchange_objects,
    forget_stale_vllm_groups,
    keep_default_process_group,
    on_rollout_rank,
    release_vllm_groups,
    restore_env,
    vllm_prompts,
)
from trl_nrollout.rollout.engines.vllm_settings import (
    check_prompt_length,
    completion_logprobs,
    engine_kwargs,
    prompt_logprob_params,
    vllm_sampling_params,
)
from trl_nrollout.rollout.engines.vllm_weights import EngineWeights
from trl_nrollout.rollout.engines.weight_sync import (
    DEFAULT_BUCKET_BYTES,
)
from trl_nrollout.rollout.seeds import SEED_MODES, engine_seed, numpy_seeded, prompt_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions, whole_groups

logger = logging.getLogger(__name__)
_SLEEP_NOTICE_SHOWN = False
_PULL_GROUPS = 0  # engine groups built in this process with a balanced dispatch (the same count on every rank)


class VLLMEngineGroup(EngineWeights):
    """The rollout engines of a job. Build it on every rank, with the same arguments.

    Args:
        model: local folder or hub id of the model (the engine loads its own copy of the weights).
        layout: the job's :class:`RolloutLayout` (engines, TP groups, shares).
        rank: this process's global rank; ``local_rank``: its rank on its node (vLLM's external launcher reads
            both from ``RANK``/``LOCAL_RANK``; they are set from these when the launcher did not).
        dtype: engine dtype (``"auto"`` follows the checkpoint; float32 on CPU for exact log-prob agreement).
        max_model_len: longest prompt + completion the engine accepts (a longer request is a clear error).
        expected_len: typical prompt + completion length, for the CPU KV-cache default (default: max_model_len).
        kv_cache_memory_bytes: KV-cache size per rank; default on CPU: enough for all of this engine's samples.
        gpu_memory_utilization: fraction of GPU memory vLLM may use (CUDA; always passed).
        enable_prefix_caching: share full prompt blocks across requests (on by default).
        enforce_eager: no CUDA graphs / compilation (always on for CPU).
        enable_sleep_mode: vLLM sleep mode around training (CUDA only).
        seed: engine seed; the same seed and inputs give the same samples.
        max_num_seqs: sequences the engine runs at once (default: its samples, capped; see :func:`engine_kwargs`).
        weight_bucket_bytes: bound of the extra memory a weight sync uses.
        trust_remote_code: load a checkpoint that ships its own model code (the user's choice for the policy).
        lora_rank: serve LoRA adapters of at most this rank (``rollout_lora_sync="adapter"``): the engine holds the
            base once and :meth:`load_adapter` hands it each new adapter version; None: no LoRA (full weights).
        exclusive: release the engines of earlier trainers in this process first (the default); False for an
            engine that lives beside this trainer's rollout engine (a teacher's, ``teacher_backend="vllm"``).
    """

    #: what it can do beyond the core (:mod:`trl_nrollout.rollout.engines.protocol`)
    capabilities = frozenset({ADAPTERS, REQUESTS, ABORT, BALANCED, BUCKETS, SCORES})
    lora_rank: int | None = None
    lora_request = None  # the adapter version every request uses (None: the base weights alone)
    #: set by a driver above for a span: :meth:`generate_expanded` hands its calls to it (``BALANCED``)
    generate_hook: Callable[..., RolloutBatch] | None = None
    _adapter_id = 0

    def __init__(
        self,
        model: str,
        layout: RolloutLayout,
        *,
        rank: int = 0,
        local_rank: int | None = None,
        dtype: str = "auto",
        max_model_len: int = 1024,
        expected_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        max_num_seqs: int | None = None,
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        tokenizer: str | None = None,
        seed_mode: str = "sample",
        trust_remote_code: bool = False,
        dispatch: str = "shares",
        lora_rank: int | None = None,
        exclusive: bool = True,
    ) -> None:
        if seed_mode not in SEED_MODES:
            raise ValueError(f"seed_mode={seed_mode!r} is not one of {SEED_MODES} (rollout_seed_mode).")
        job_wide = dispatch_rule(dispatch, option="dispatch (rollout_dispatch)").job_wide
        prepare_vllm_environment()
        if exclusive:  # a new trainer releases the previous one's engines
            close_live_engines()
        forget_stale_vllm_groups()
        self.llm = None
        self.layout = layout
        self.rank = rank
        self.engine_index = layout.engine_of_rank(rank)
        self.tp_ranks = layout.engine_ranks[self.engine_index]
        self.cpu = is_cpu_platform()
        self.weight_bucket_bytes = weight_bucket_bytes
        self.max_model_len = max_model_len
        self.seed_mode = seed_mode
        self.dispatch = dispatch
        self._asleep: set[str] = set()
        self._tp_group = None
        self.lora_rank = lora_rank
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if dist_on else 1
        if world != layout.num_processes:
            raise ValueError(
                f"the layout was computed for num_processes={layout.num_processes} but {world} processes are "
                f"running; build the RolloutLayout from the launcher's process count."
            )
        self._dist = dist_on and world > 1
        self._owns_process_group = not dist_on  # else accelerate's (or the user's): close() must leave it alive
        if dist_on and layout.rollout_tp_size > 1:
            # every rank creates every group (a collective), then keeps its own
            for ranks in layout.engine_ranks:
                g = torch.distributed.new_group(list(ranks), backend="gloo")
                if rank in ranks:
                    self._tp_group = g
        # a job-wide dispatch rule (rollout_dispatch="balanced") with several engines: the job's queue lives in the process group's store, and
        # the samples go home over a gloo group of every rank (pickled lists: no device copies on an NCCL job)
        self._world_group = None
        self._store = None
        self._pull_calls = 0
        if job_wide and dist_on and layout.num_engines > 1:
            self._world_group = torch.distributed.new_group(list(range(world)), backend="gloo")
            self._store = torch.distributed.distributed_c10d._get_default_store()
            global _PULL_GROUPS
            _PULL_GROUPS += 1
            self._pull_prefix = f"trl_nrollout/dispatch/{_PULL_GROUPS}"
        ensure_dist_env(rank, rank if local_rank is None else local_rank)
        kwargs = engine_kwargs(
            model, layout, cpu=self.cpu, dtype=dtype, max_model_len=max_model_len, expected_len=expected_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode, seed=seed, max_num_seqs=max_num_seqs, tokenizer=tokenizer,
            trust_remote_code=trust_remote_code, lora_rank=lora_rank)
        self.enable_sleep_mode = enable_sleep_mode and not self.cpu
        self.local_rank = rank if local_rank is None else local_rank
        from vllm import LLM

        start = time.perf_counter()
        if self.cpu and len(self.tp_ranks) > 1:  # segments named after this run (first rank's pid), not shared
            use_cpu_shm_identity(self.gather_tp(os.getpid())[0], self.tp_ranks, self.tp_ranks.index(self.rank))
        launcher_local_world = os.environ.get("LOCAL_WORLD_SIZE")
        try:
            self.llm = LLM(**kwargs)
        finally:
            # vLLM's CPU platform sets LOCAL_WORLD_SIZE to the engine's TP size while it builds the engine; the
            # launcher's value (processes per node) is what the job's layout and a later trainer read
            restore_env("LOCAL_WORLD_SIZE", launcher_local_world)
        self.startup_s = time.perf_counter() - start
        self.engine_kwargs = kwargs
        LIVE_ENGINES.add(self)

    @property
    def dtype(self) -> str:
        """The engine's weights' dtype (vLLM's model config, e.g. ``torch.bfloat16``)."""
        return str(self.llm.llm_engine.model_config.dtype)

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep)

    @property
    def tp_group(self):
        """The gloo process group of this engine's TP ranks (None at TP 1 or in one process)."""
        return self._tp_group

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once (vLLM's ``max_num_seqs``; its default where unset)."""
        return int(self.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)

    # ------------------------------------------------------------------ generation
    def gather_tp(self, obj) -> list:
        """``obj`` of every rank of this rank's TP group, in rank order (``[obj]`` at TP=1). Collective over the
        TP group."""
        if self._tp_group is None:
            return [obj]
        out = [None] * len(self.tp_ranks)
        torch.distributed.all_gather_object(out, obj, group=self._tp_group)
        return out

    def barrier_before_generate(self) -> None:
        """TP > 1 on GPUs: the ranks meet before the engine's own TP collectives, so that no training collective
        still in flight (a LoRA gradient all-reduce, a ZeRO gather) interleaves with them (TRL does the same for LoRA
        + TP > 1, its issue #3671; we do it for every model: one barrier per rollout). Where the barrier is, by
        :func:`barrier_scope`: the whole default group when the engines share the trainers' devices, the engine's
        own TP group on rollout ranks (no training collective there: a barrier over every rollout rank would make
        the engines start each job in lockstep), none on CPU (the TP gather over gloo already orders the ranks)."""
        scope = barrier_scope(self.layout.rollout_tp_size, self.cpu, self._dist, on_rollout_rank())
        if scope is None:
            return
        nccl = torch.distributed.get_backend() == "nccl"  # device_ids is an NCCL-only argument
        if scope == "world":
            torch.distributed.barrier(**({"device_ids": [self.local_rank]} if nccl else {}))
        else:
            torch.distributed.barrier(group=self._tp_group)

    @contextlib.contextmanager
    def engine_rng(self, seed: int | None) -> Iterator[None]:
        """``seed_mode="engine"`` with a seed: the call samples from the process's default generators (CPU and
        this rank's GPU, which vLLM's sampler draws from for unseeded requests, and NumPy's global generator, from
        which vLLM's Model Runner V2 draws unseeded requests' seeds on CUDA) seeded from ``seed`` and the engine's
        index (the same on every rank of a TP group, so their samples agree; other engines draw other numbers); the
        caller's generator states are restored afterwards. Otherwise nothing."""
        if seed is None or self.seed_mode != "engine":
            yield
            return
        devices = [torch.cuda.current_device()] if not self.cpu and torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), numpy_seeded(engine_seed(seed, self.engine_index)):
            torch.manual_seed(engine_seed(seed, self.engine_index))
            yield

    def check_prompt_length(self, longest: int, max_tokens: int) -> None:
        """A prompt of ``longest`` tokens that leaves no room for ``max_tokens`` would be cut short silently by vLLM
        (or rejected with its own message): refuse it here with the options that fix it."""
        check_prompt_length(longest, max_tokens, self.max_model_len)

    def sampling_params(self, n: int, sampling: SamplingOptions):
        """vLLM's ``SamplingParams`` for a request of ``n`` samples (:func:`vllm_sampling_params`)."""
        return vllm_sampling_params(n, sampling)

    def request_prompt(self, ids: Sequence[int], images: list | None = None):
        """A request's prompt: token ids, with ``images`` (``multi_modal_data``) where it has any."""
        return vllm_prompts([ids], [images] if images else None)[0]

    def request_loop(self, stream: bool = False) -> EngineLoop:
        """A request loop on this rank's engine whose requests use the current adapter version (if any); the engine
        made ready first (:meth:`ready`: a clear error if it was closed, woken if it sleeps)."""
        self.ready()
        return EngineLoop(self.llm, stream=stream, lora_request=self.lora_request)

    def ready(self) -> None:
        """Before generating: a clear error if the engine was closed, and the engine woken if it sleeps."""
        if self.llm is None:
            raise RuntimeError(
                "this rollout engine was closed (trainer.close(), or a newer trainer in this process replaced it: "
                "vLLM runs one engine per process); build a new trainer to generate again."
            )
        if self.sleeping:
            self.wake_up()

    def generate_engine(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingOptions,
                        group_offset: int = 0, images: Sequence[list] | None = None) -> RolloutBatch:
        """Run this rank's engine on ``prompts`` (the same on every rank of the TP group): ``n`` samples each.

        ``images``: per prompt, its images (vLLM's ``multi_modal_data``; the prompt then holds the image
        placeholders unexpanded, and the returned ``prompt_ids`` are vLLM's, expanded)."""

        self.ready()
        self.check_prompt_length(max((len(p) for p in prompts), default=0), sampling.max_tokens)
        start = time.perf_counter()
        if sampling.seed is None or self.seed_mode == "engine":
            params = self.sampling_params(n, replace(sampling, seed=None))
        else:  # vLLM seeds sample k of a request with seed + k: prompt seeds n apart never share a seed
            params = [self.sampling_params(n, replace(sampling, seed=prompt_seed(sampling.seed, group_offset + g, n)))
                      for g in range(len(prompts))]
        loop = self.request_loop()
        with self.engine_rng(sampling.seed):  # what LLM.generate does, through the same calls
            requests = [loop.add(p, params[g] if isinstance(params, list) else params)
                        for g, p in enumerate(vllm_prompts(prompts, images))]
            loop.run()
        gen_s = time.perf_counter() - start
        prompt_ids, completion_ids, logprobs, reasons, groups = [], [], [], [], []
        for g, (prompt, rid) in enumerate(zip(prompts, requests)):
            engine_prompt = loop.prompt_ids(rid) if images is not None else list(prompt)
            for sample in loop.request(rid):
                prompt_ids.append(list(engine_prompt))
                completion_ids.append(sample.token_ids)
                logprobs.append(sample.logprobs)
                reasons.append(sample.finish_reason)
                groups.append(group_offset + g)
        return RolloutBatch(prompt_ids, completion_ids, logprobs, reasons, groups, timings={"generate_s": gen_s})

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingOptions,
                 group_offset: int | None = None) -> RolloutBatch:
        """Generate ``n`` samples for each of this rank's ``prompts``; return this rank's samples.

        The prompts of the TP group are gathered (rank order), the engine generates for all of them, and this
        rank keeps the samples of its own prompts. ``group_offset`` (the global index of this rank's first
        prompt) defaults to ``rank * len(prompts)``, right when every rank has the same number of prompts.
        """
        offset = self.rank * len(prompts) if group_offset is None else group_offset
        return self.generate_expanded([list(p) for p in prompts for _ in range(n)], n, sampling,
                                      sample_offset=offset * n)

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = None, images: list[list] | None = None,
                          mm: list | None = None) -> RolloutBatch:
        """TRL's form: this rank's prompts already repeated ``n`` times (groups contiguous; a group may span the
        ranks of one TP group). Returns one sample per entry, in the same order. ``images``: per sample, the
        images of its prompt (see :meth:`generate_engine`; ``mm``, the processor's tensors, is the HF engine's form).
        While a driver has set :attr:`generate_hook` (``rollout/dispatch/balanced.py``'s ``balanced_calls``: a
        balanced rollout, every rank's call one collective), the call is the hook's."""
        if mm is not None:
            raise ValueError("the vLLM engine expands images itself: pass them as images=, not mm= tensors.")
        hook = self.generate_hook
        if hook is not None:
            self.generate_hook = None  # (with one engine, the balanced driver comes back here)
            try:
                return hook(sample_prompts, n, sampling, sample_offset=sample_offset, images=images)
            finally:
                self.generate_hook = hook
        self.barrier_before_generate()
        per_rank = self.gather_tp([list(p) for p in sample_prompts])
        flat = [p for chunk in per_rank for p in chunk]
        # images travel with their prompts; every rank of the group takes part in the gather (some may have none)
        flat_images = None
        if self.gather_tp(images is not None) != [False] * len(per_rank):
            local = images if images is not None else [[] for _ in sample_prompts]
            flat_images = [imgs for chunk in self.gather_tp(local) for imgs in chunk]
        unique = whole_groups(flat, n, self.engine_index)
        mine = self.tp_ranks.index(self.rank)
        first = sum(len(c) for c in per_rank[:mine])
        offset = self.rank * len(sample_prompts) if sample_offset is None else sample_offset
        batch = self.generate_engine(unique, n, sampling, group_offset=(offset - first) // n,
                                     images=None if flat_images is None else flat_images[::n])
        return batch.slice(first, first + len(sample_prompts))

    def score_completions(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
                          ) -> list[list[float]]:
        """``SCORES``: each completion token's log-prob under this engine's weights, given its prompt and the
        completion's tokens before it (vLLM's ``prompt_logprobs`` over prompt + completion: the raw logits,
        temperature 1), ``[B][C_i]``. The TP group's samples are gathered and scored together (collective over the
        TP group); this rank's are returned."""
        self.ready()
        per_rank = self.gather_tp([(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids, strict=True)])
        flat = [s for chunk in per_rank for s in chunk]
        first = sum(len(c) for c in per_rank[:self.tp_ranks.index(self.rank)])
        self.check_prompt_length(max((len(p) + len(c) for p, c in flat), default=0), 1)
        outputs = self.llm.generate(vllm_prompts([p + c for p, c in flat]), prompt_logprob_params(), use_tqdm=False,
                                    lora_request=self.lora_request)
        scores = [completion_logprobs(out.prompt_logprobs, len(p), c) for (p, c), out in zip(flat, outputs)]
        return scores[first:first + len(prompt_ids)]

    def generate_turns(self, contexts: list[list[int]], budgets: list[int], sampling: SamplingOptions,
                       sample_offset: int = 0, sample_ids: list[int] | None = None,
                       num_samples: int | None = None, images: list[list] | None = None,
                       mm: list | None = None) -> RolloutBatch:
        """One more turn of multi-turn samples: one sample per context (prompt + turns so far + tool results), each
        with its own token budget (``max_tokens``). Collective over the TP group: every rank calls it, possibly with
        no contexts. Returns this rank's samples in order. ``images``: per context, its images in order (the
        context then holds their placeholders unexpanded; the returned ``prompt_ids`` are vLLM's, expanded).

        Seeds (``rollout_seed_mode="sample"``) come from the call's seed, the engine's index and each sample's place
        in the engine: ``sample_ids[k]``, the index of context ``k``'s sample among this rank's ``num_samples``
        (ranks of a TP group in rank order), as ``rollout/dispatch/shares.py``'s ``run_agents`` seeds the same turn, so both multi-turn modes draw
        the same numbers for a sample; without ``sample_ids``, its place among the call's contexts
        (``sample_offset`` is not needed: the step seed changes every turn)."""
        if mm is not None:
            raise ValueError("the vLLM engine expands images itself: pass them as images=, not mm= tensors.")
        self.barrier_before_generate()
        ids = list(range(len(contexts))) if sample_ids is None else list(sample_ids)
        count = len(contexts) if num_samples is None else int(num_samples)
        pics = images if images is not None else [[] for _ in contexts]
        per_rank = self.gather_tp(([(list(c), int(b), int(i), list(p)) for c, b, i, p in zip(contexts, budgets, ids, pics)],
                                   count))
        before = [sum(c for _, c in per_rank[:r]) for r in range(len(per_rank))]
        flat = [(ctx, budget, before[r] + i) for r, (chunk, _) in enumerate(per_rank) for ctx, budget, i, _ in chunk]
        flat_images = [p for chunk, _ in per_rank for *_, p in chunk]
        total = sum(c for _, c in per_rank)
        mine = self.tp_ranks.index(self.rank)
        first = sum(len(chunk) for chunk, _ in per_rank[:mine])
        if not flat:
            return RolloutBatch([], [], [], [], [])
        self.ready()
        from vllm.inputs import TokensPrompt

        for ctx, budget, _ in flat:
            self.check_prompt_length(len(ctx), budget)
        offset = self.engine_index * total  # the same on every rank of the TP group (their sampling must agree)
        per_request = sampling.seed is not None and self.seed_mode == "sample"
        params = [self.sampling_params(1, replace(sampling, max_tokens=budget, seed=prompt_seed(sampling.seed, offset + s, 1)
                                                   if per_request else None))
                  for _, budget, s in flat]
        loop = self.request_loop()
        with self.engine_rng(sampling.seed):
            requests = [loop.add(self.request_prompt(ctx, pics) if pics else TokensPrompt(prompt_token_ids=ctx), p)
                        for (ctx, _, _), pics, p in zip(flat, flat_images, params)]
            loop.run()
        done = [loop.request(rid)[0] for rid in requests]
        seen = [loop.prompt_ids(rid) if pics else ctx for (ctx, _, _), pics, rid in zip(flat, flat_images, requests)]
        batch = RolloutBatch(seen, [d.token_ids for d in done], [d.logprobs for d in done],
                             [d.finish_reason for d in done], list(range(len(flat))))
        return batch.slice(first, first + len(contexts))

    # ------------------------------------------------------------------ the job's collectives (BALANCED)
    @property
    def balances_job(self) -> bool:
        """Whether this engine pulls from a job-wide queue (``rollout_dispatch="balanced"`` over several engines in
        one process group): :meth:`gather_job`, :meth:`exchange_job` and :attr:`job_store` then span the job."""
        return self._world_group is not None

    def gather_job(self, obj) -> list:
        """``obj`` of every rank of the job, in rank order (``[obj]`` with one engine: see :meth:`gather_tp`).
        Collective over every rank."""
        if self._world_group is None:
            return self.gather_tp(obj)
        out: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj, group=self._world_group)
        return out

    def exchange_job(self, parts: list) -> list:
        """``parts[r]`` (picklable; None sends nothing) to rank ``r`` of the job, from every rank at once: what each
        rank sent this one (:func:`exchange_objects`). Only while :attr:`balances_job`."""
        return exchange_objects(parts, self._world_group)

    @property
    def job_store(self):
        """The process group's key-value store (``add``, ``delete_key``) every rank of the job reaches. Only while
        :attr:`balances_job`."""
        return self._store

    def job_key(self, name: str | None = None) -> str:
        """A key in :attr:`job_store` of this engine group: ``name``'s (the same at every call), or a fresh one for
        one collective call (every rank calls it in the same order, so the ranks agree on it)."""
        if name is not None:
            return f"{self._pull_prefix}/{name}"
        self._pull_calls += 1
        return f"{self._pull_prefix}/{self._pull_calls}"

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Shut the engine down now (frees its memory and its process groups), not at interpreter exit."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            # vLLM's shutdown tears down its distributed state, including torch's default process group; when
            # that group is accelerate's (a multi-process job), only vLLM's own groups are released
            with contextlib.nullcontext() if self._owns_process_group else keep_default_process_group():
                llm.llm_engine.engine_core.shutdown()
        except Exception as err:  # noqa: BLE001 - best effort at teardown
            logger.debug("vLLM engine shutdown: %s", err)
        if self._owns_process_group:
            release_vllm_groups()
        self.llm = None
        LIVE_ENGINES.discard(self)

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free weights and KV cache while the trainer runs (vLLM sleep mode, CUDA); a no-op on CPU.

        Level 1: the weights are kept in host memory, because the same weights may generate again within a step
        (DAPO's extra rounds, ReMax's greedy pass) without a sync in between.
        """
        global _SLEEP_NOTICE_SHOWN
        if not self.enable_sleep_mode:
            if not _SLEEP_NOTICE_SHOWN:
                logger.info("vLLM sleep mode is %s: engines keep their memory during training.",
                               "not available on CPU" if self.cpu else "off (enable_sleep_mode=False)")
                _SLEEP_NOTICE_SHOWN = True
            return
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what :meth:`sleep` freed: ``tags`` (``"weights"``, ``"kv_cache"``) or everything still asleep."""
        if not self._asleep:
            return
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
        self._asleep -= wanted
