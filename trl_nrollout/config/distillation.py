"""``NRolloutDistillationConfig``: TRL's ``DistillationConfig`` with the options of our engine group, for
:class:`~trl_nrollout.trainer.distillation.NRolloutDistillationTrainer`.

The engine options are :class:`~trl_nrollout.config.options.NRolloutConfig`'s own fields (the same names, defaults
and help: :func:`_shared` copies each definition, so the two configs cannot drift), checked by the same rules where
they apply. Every field ``DistillationConfig`` adds to ``TrainingArguments`` (or declares again) is classified in :data:`DISTILL_OPTIONS`
(honored, mapped onto one of ours, or refused at construction away from its neutral value), which
``docs/distillation.md`` renders (``scripts/gen_config_docs.py``) and a test walks against TRL's actual fields.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from trl import DistillationConfig

from trl_nrollout.config.checks import check_engine_options
from trl_nrollout.config.options import VLLM_ENGINE_OPTIONS, NRolloutConfig
from trl_nrollout.config.trl_options import UnsupportedTRLOption, _same
from trl_nrollout.errors import InputError
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION
from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.seeds import SEED_MODES

_ANY = object()  # no neutral value: honored or mapped whatever its value
_SERVER = "no server: our engine group lives in the trainer processes (vllm_mode='colocate')"

#: DistillationConfig field -> (status, neutral value of a refused one, what we do / why / what instead)
DISTILL_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "learning_rate": ("honored", _ANY, "TRL's default (1e-6), TRL's optimizer."),
    "model_init_kwargs": ("honored", _ANY, "TRL's __init__ loads the student with them."),
    "trust_remote_code": ("honored", _ANY, "TRL loads both models with it; our engines load the student with it."),
    "teacher_model_name_or_path": ("honored", _ANY, "The teacher, where teacher_model= is not given (TRL's trainer "
                                                    "reads it only in its CLI script); builtin: names resolve."),
    "teacher_model_revision": ("honored", _ANY, "TRL's __init__ loads the teacher at it."),
    "teacher_model_init_kwargs": ("honored", _ANY, "TRL's __init__ loads the teacher with them."),
    "disable_dropout": ("honored", _ANY, "TRL's __init__ disables dropout in the student."),
    "remove_unused_columns": ("honored", _ANY, "TRL's data pipeline (the raw prompt column)."),
    "max_completion_length": ("honored", _ANY, "The engine's max_tokens per call, as TRL's vLLM path."),
    "ds3_gather_for_generation": ("honored", _ANY, "TRL's generate under ZeRO-3 (rollout_backend='hf'); our vLLM "
                                                   "engine gets the weights in buckets (weight_sync_bucket_mb)."),
    "shuffle_dataset": ("honored", _ANY, "TRL's sampler."),
    "pad_to_multiple_of": ("honored", _ANY, "TRL's prompt and completion tensors."),
    "temperature": ("honored", _ANY, "Sampling on the engine, and TRL's loss (both distributions / temperature)."),
    "top_p": ("honored", _ANY, "Sampling on the engine."),
    "top_k": ("honored", _ANY, "Sampling on the engine (0: off)."),
    "min_p": ("honored", _ANY, "Sampling on the engine (None: off)."),
    "generation_kwargs": ("honored", _ANY, "vLLM SamplingParams fields on our vLLM engine (others refused naming "
                                           "them), generate() arguments with rollout_backend='hf', as TRL."),
    "chat_template_kwargs": ("honored", _ANY, "TRL's prompt tokenization, which our sampling takes."),
    "repetition_penalty": ("honored", _ANY, "Sampling on the engine."),
    "cache_implementation": ("honored", _ANY, "TRL's generate (rollout_backend='hf'); no effect on vLLM, as in TRL."),
    "use_vllm": ("mapped", _ANY, "rollout_backend ('vllm' when True: our engine group, not TRL's VLLMGeneration)"),
    "vllm_mode": ("refused", "colocate", _SERVER),
    "vllm_model_impl": ("refused", "vllm", "our engines use vLLM's own model implementations"),
    "vllm_enable_sleep_mode": ("honored", _ANY, "vLLM sleep mode while the student trains (CUDA)."),
    "vllm_structured_outputs_regex": ("honored", _ANY, "vLLM's structured outputs on our vLLM engine; with "
                                                       "rollout_backend='hf' an error (TRL ignores it there)."),
    "vllm_server_base_url": ("refused", None, _SERVER),
    "vllm_server_host": ("refused", "0.0.0.0", _SERVER),
    "vllm_server_port": ("refused", 8000, _SERVER),
    "vllm_server_timeout": ("refused", 240.0, _SERVER),
    "vllm_group_port": ("refused", 51216, _SERVER),
    "vllm_gpu_memory_utilization": ("honored", _ANY, "Fraction of GPU memory each engine may use."),
    "vllm_max_model_length": ("mapped", _ANY, "rollout_max_model_len"),
    "vllm_tensor_parallel_size": ("mapped", _ANY, "rollout_tp_size"),
    "beta": ("honored", _ANY, "TRL's generalized JSD (0: forward KL, 0.5: JSD, 1: reverse KL), TRL's code."),
    "max_tool_calling_iterations": ("honored", _ANY, "TRL's tool loop; each turn samples on our engine."),
    "log_completions": ("honored", _ANY, "TRL's completions table."),
    "num_completions_to_print": ("honored", _ANY, "TRL's completions table."),
    "log_unique_prompts": ("honored", _ANY, "TRL's completions table."),
}

#: DistillationTrainer constructor arguments beyond the model / data / callbacks ones: name -> what happens here
DISTILL_TRAINER_ARGS: dict[str, str] = {
    "teacher_model": "TRL's: loaded and prepared by TRL's __init__; its forward in TRL's loss runs as our reference "
                     "pass (padding-free rows, ref_log_prob_max_token_len_per_device's budget).",
    "peft_config": "TRL wraps the student; the engine gets merged weights or the adapter (rollout_lora_sync).",
    "quantization_config": "TRL loads the student with it (QLoRA).",
    "tools": "TRL's tool loop; every turn of it samples on our engine (rollout_tp_size=1).",
}

#: NRolloutConfig's engine options that the distillation config shares (same names, defaults, help and checks)
ENGINE_OPTIONS = ("rollout_backend", "rollout_tp_size", "rollout_dtype", "rollout_max_model_len",
                  "rollout_max_num_seqs", "rollout_kv_cache_memory_bytes", "rollout_enforce_eager",
                  "rollout_enable_prefix_caching", "rollout_seed_mode", "weight_sync_bucket_mb", "rollout_lora_sync",
                  "rollout_lora_sync_device", "rollout_dispatch", "ref_log_prob_max_token_len_per_device",
                  "padding_free")


def _shared(name: str) -> Any:
    """A ``field()`` with NRolloutConfig's default and help for ``name`` (one definition for both configs)."""
    source = next(f for f in fields(NRolloutConfig) if f.name == name)
    if source.default is MISSING:  # every engine option has a plain default
        raise TypeError(f"{name} has no plain default to share")
    return field(default=source.default, metadata=dict(source.metadata))


@dataclass
class NRolloutDistillationConfig(DistillationConfig):
    """Configuration of :class:`~trl_nrollout.trainer.distillation.NRolloutDistillationTrainer`: every
    ``DistillationConfig`` option (:data:`DISTILL_OPTIONS` says what each does here) plus the engine options of
    :class:`~trl_nrollout.config.options.NRolloutConfig` (:data:`ENGINE_OPTIONS`)."""

    rollout_backend: str = _shared("rollout_backend")
    rollout_tp_size: int = _shared("rollout_tp_size")
    rollout_dtype: str = _shared("rollout_dtype")
    rollout_max_model_len: int | None = _shared("rollout_max_model_len")
    rollout_max_num_seqs: int | None = _shared("rollout_max_num_seqs")
    rollout_kv_cache_memory_bytes: int | None = _shared("rollout_kv_cache_memory_bytes")
    rollout_enforce_eager: bool = _shared("rollout_enforce_eager")
    rollout_enable_prefix_caching: bool = _shared("rollout_enable_prefix_caching")
    rollout_seed_mode: str | None = _shared("rollout_seed_mode")
    weight_sync_bucket_mb: int = _shared("weight_sync_bucket_mb")
    rollout_lora_sync: str = _shared("rollout_lora_sync")
    rollout_lora_sync_device: str | None = _shared("rollout_lora_sync_device")
    rollout_dispatch: str = _shared("rollout_dispatch")
    ref_log_prob_max_token_len_per_device: int | None = _shared("ref_log_prob_max_token_len_per_device")
    padding_free: bool | None = _shared("padding_free")

    # what the engine set-up (trainer/engines.py) reads of a GRPO config and distillation does not have: no rollout
    # ranks, no partial rollouts (class attributes, not options)
    rollout_ranks = 0
    rollout_lookahead = 0
    rollout_partial = False
    _default_gpu_memory_utilization = COLOCATED_GPU_MEMORY_UTILIZATION
    vllm_engine_settings = NRolloutConfig.vllm_engine_settings  # the vLLM options set away from their defaults

    def __post_init__(self) -> None:
        check_distill_options({f.name: getattr(self, f.name) for f in fields(DistillationConfig)})
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not 0 <= self.beta <= 1:
            raise InputError(f"beta={self.beta!r} must be in [0, 1] (TRL's generalized JSD: 0 forward KL, 0.5 JSD, 1 "
                             "reverse KL); set beta to a number in that range, e.g. 0.5.")
        self._map_trl_options()
        self._check_engine_options()
        super().__post_init__()

    def _map_trl_options(self) -> None:
        """TRL's vLLM fields onto ours: ``use_vllm`` -> ``rollout_backend``, ``vllm_tensor_parallel_size`` ->
        ``rollout_tp_size``, ``vllm_max_model_length`` -> ``rollout_max_model_len`` (a conflict is an error). TRL's
        ``use_vllm`` is then False: TRL's own vLLM client is never built, our engine samples."""
        if self.use_vllm:
            if self.rollout_backend == "hf":
                raise InputError("use_vllm=True asks for vLLM, but rollout_backend='hf' generates with transformers; "
                                 "remove one of them (use_vllm=True is rollout_backend='vllm' here).")
            self.rollout_backend = "vllm"
        self.use_vllm = False
        for theirs, ours, neutral in (("vllm_tensor_parallel_size", "rollout_tp_size", 1),
                                      ("vllm_max_model_length", "rollout_max_model_len", None)):
            value, mine = getattr(self, theirs), getattr(self, ours)
            if value != neutral and mine != neutral and value != mine:
                raise InputError(f"{theirs}={value} conflicts with {ours}={mine} (the same setting: TRL's name and "
                                 f"ours); set only one of them.")
            if value != neutral:
                setattr(self, ours, value)
            setattr(self, theirs, getattr(self, ours) if getattr(self, ours) is not None else neutral)

    def _check_engine_options(self) -> None:
        """The engine options' rules (NRolloutConfig's, where they apply to one colocated engine group)."""
        for name, allowed in (("rollout_backend", ["auto", "vllm", "hf"]), ("rollout_seed_mode", [None, *SEED_MODES])):
            if getattr(self, name) not in allowed:
                raise InputError(f"{name}={getattr(self, name)!r} is not one of {allowed}; pick one of them.")
        check_engine_options(self)  # rollout_lora_sync (and its device), rollout_max_num_seqs, weight_sync_bucket_mb
        if dispatch_rule(self.rollout_dispatch).job_wide:  # (an unknown name: refused with the registered ones)
            raise UnsupportedTRLOption(
                f"rollout_dispatch={self.rollout_dispatch!r} is not built for NRolloutDistillationTrainer: TRL's "
                "distillation samples one completion per prompt, in calls its tool loop makes per rank, which a "
                "job-wide queue's collectives do not follow. Use rollout_dispatch='shares' (each engine its "
                "own ranks' prompts), or NRolloutGRPOTrainer with a teacher term for balanced dispatch.")
        budget = self.ref_log_prob_max_token_len_per_device
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise InputError(f"ref_log_prob_max_token_len_per_device={budget!r} must be a whole number >= 1 (the "
                             "teacher's tokens per forward, at least the longest prompt + completion), or None (one "
                             "forward per micro batch); e.g. 4096.")
        if self.padding_free not in (None, True, False):
            raise InputError(f"padding_free={self.padding_free!r} must be None (on where the teacher takes it), True "
                             "or False.")
        tp = self.rollout_tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InputError(f"rollout_tp_size={self.rollout_tp_size!r} must be a whole number >= 1 (ranks per "
                             "engine); e.g. 1.")
        if self.rollout_backend == "hf":
            unused = self.vllm_engine_settings()
            if unused:
                raise InputError(f"rollout_backend='hf' generates with transformers (TRL's generate), which has no "
                                 f"use for {', '.join(unused)}: they configure the vLLM engines. Remove them, or "
                                 "set rollout_backend='vllm'.")
            if self.rollout_seed_mode not in (None, "engine"):  # (rollout_lora_sync: check_engine_options)
                raise InputError(f"rollout_seed_mode={self.rollout_seed_mode!r} configures the vLLM engines; "
                                 "rollout_backend='hf' generates with TRL's generate, which it cannot change. Remove "
                                 "rollout_seed_mode, or set rollout_backend='vllm'.")

    def rollout_layout(self, num_processes: int, nnodes: int = 1) -> RolloutLayout:
        """The engines' layout over ``num_processes`` trainers: ``processes / rollout_tp_size`` engines, one sample
        per prompt, the generation batch (``per_device_train_batch_size x processes x gradient_accumulation_steps``
        prompts) split over them."""
        prompts = self.per_device_train_batch_size * num_processes * self.gradient_accumulation_steps
        return RolloutLayout.build(num_processes=num_processes, nnodes=nnodes, rollout_tp_size=self.rollout_tp_size,
                                   train_batch_size=prompts, rollout_n=1, adv_estimator="reinforce_plus_plus")


def check_distill_options(values: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedTRLOption` for the first refused ``DistillationConfig`` option whose value is not its
    neutral one (the option, the value, why, and the fix)."""
    for name, (status, neutral, why) in DISTILL_OPTIONS.items():
        if status == "refused" and name in values and not _same(values[name], neutral):
            raise UnsupportedTRLOption(
                f"{name}={values[name]!r} is not supported by NRolloutDistillationTrainer: {why}. Remove it (TRL's "
                f"default {neutral!r} is what our engines do), or use trl.DistillationTrainer for this option.")


def distill_options_table() -> list[tuple[str, str, str]]:
    """(option, status, what) rows for docs/distillation.md: every DistillationConfig field, then the trainer's
    arguments, then the engine options it adds."""
    rows = []
    for name, (status, neutral, text) in DISTILL_OPTIONS.items():
        rows.append((name, f"refused unless {neutral!r}" if status == "refused" else status, text))
    rows += [(f"{name}= (trainer)", "honored", what) for name, what in DISTILL_TRAINER_ARGS.items()]
    helps = {f.name: f.metadata.get("help", "") for f in fields(NRolloutConfig)}
    notes = {"rollout_dispatch": " Only 'shares' here: 'balanced' is refused (the config says why).",
             "rollout_backend": " 'hf' here is TRL's own generate.",
             "ref_log_prob_max_token_len_per_device": " Here the teacher's forward in the loss (None: one forward per "
                                                      "micro batch).",
             "padding_free": " Here the teacher's forward in the loss."}
    rows += [(name, "ours", helps[name].split(". ")[0].rstrip(".") + "." + notes.get(name, ""))
             for name in ENGINE_OPTIONS]
    return rows


__all__ = ["DISTILL_OPTIONS", "DISTILL_TRAINER_ARGS", "ENGINE_OPTIONS", "NRolloutDistillationConfig",
           "VLLM_ENGINE_OPTIONS", "check_distill_options", "distill_options_table"]
