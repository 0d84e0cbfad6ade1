"""How :class:`~trl_nrollout.config.NRolloutConfig` maps its two vocabularies (verl's batch fields and TRL's) onto
each other in its ``__post_init__`` (see the mapping in :mod:`trl_nrollout.config.options`), TRL options given new meaning
(``vllm_mode="server"`` -> rollout ranks...), the split of the launch into trainers and rollout ranks, and the
defaults that depend on other options (the token budget, the decoupled loss). A mixin of the config (no fields)."""

from __future__ import annotations

import os

from trl_nrollout.config.checks import rollout_ranks_refusal, stale_sample_reason
from trl_nrollout.config.trl_options import TRL_LOSS_TYPES
from trl_nrollout.errors import InputError
from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.update_budget import default_dynamic_bsz
from trl_nrollout.rollout.bridge import current_bridge, split_world
from trl_nrollout.rollout.seeds import HF_SAMPLE_SEEDS

_TRL_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8,
                 "num_iterations": 1, "epsilon": 0.2, "beta": 0.0}


class ConfigDerivation:
    """How :class:`~trl_nrollout.config.NRolloutConfig` derives one vocabulary's fields from the other's (see the module docstring)."""

    def _resolve_dynamic_bsz(self) -> None:
        """``use_dynamic_bsz`` None -> on exactly when a budget is given; a budget with it off is a contradiction;
        the log-prob passes follow an explicit budget unless they have their own size."""
        budget = self.ppo_max_token_len_per_device
        if budget is not None and budget < 1:
            raise InputError(f"ppo_max_token_len_per_device={budget} must be >= 1 (tokens per update micro batch per "
                             "device, at least the longest sample: max_prompt_length + max_completion_length).")
        if self.use_dynamic_bsz is False and budget is not None:
            raise InputError(f"use_dynamic_bsz=False with ppo_max_token_len_per_device={budget}: the budget only "
                             "applies to token-budgeted micro batches; remove one of them.")
        if self.use_dynamic_bsz is None:  # the rule plan applies too
            self.use_dynamic_bsz = default_dynamic_bsz(budget, self.train_batch_size,
                                                       self.ppo_micro_batch_size_per_device)
        passes_sized = any(getattr(self, name) is not None for name in (
            "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_device"))
        if self.use_dynamic_bsz and budget is not None and not passes_sized:
            self.log_prob_max_token_len_per_device = budget

    def _split_rollout_ranks(self) -> None:
        """``rollout_ranks``: refuse what cannot run on rollout ranks, then split the launch (see
        :mod:`trl_nrollout.rollout.bridge`)."""
        if not self.rollout_ranks and not self.weight_sync_delta:
            return
        why = rollout_ranks_refusal(self)
        if why:
            raise InputError(why)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and current_bridge() is None:
            raise InputError(
                f"rollout_ranks={self.rollout_ranks} needs a launch of several processes (some train, "
                f"{self.rollout_ranks} generate) but this is a single process; run it with `accelerate launch "
                f"--num_processes {self.rollout_ranks + 1} ...` (more to train), or set rollout_ranks=0.")
        split_world(self.rollout_ranks, self.rollout_tp_size, self.rollout_rank_timeout_s,
                    group_timeout_s=float(self.ddp_timeout or 1800))

    def _map_trl_options(self) -> None:
        """TRL options with a verl twin (see :mod:`trl_nrollout.config.trl_options`); a conflicting pair is an error."""
        def twin(trl_name: str, trl_value, verl_name: str, verl_default) -> None:
            current = getattr(self, verl_name)
            if current != verl_default and current != trl_value:
                raise InputError(f"{trl_name}={trl_value!r} conflicts with {verl_name}={current!r}; set only one.")
            setattr(self, verl_name, trl_value)

        if self.vllm_tensor_parallel_size != 1:
            twin("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size, "rollout_tp_size", 1)
        if self.vllm_max_model_length is not None:
            twin("vllm_max_model_length", self.vllm_max_model_length, "rollout_max_model_len", None)
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if scale not in ("group", "none", "batch"):
            raise InputError(f"scale_rewards={self.scale_rewards!r} is not one of 'group', 'batch', 'none' (or "
                             "True/False); pick one of them.")
        if scale != "group":
            if self.adv_estimator != "grpo":
                raise InputError(f"scale_rewards={self.scale_rewards!r} applies to adv_estimator='grpo' only (here "
                                 f"{self.adv_estimator!r}); remove it.")
            if scale == "none":
                twin("scale_rewards", False, "norm_adv_by_std_in_grpo", True)
            else:
                self.adv_estimator_kwargs = {**(self.adv_estimator_kwargs or {}), "std_scope": "batch"}
        if self.loss_type not in TRL_LOSS_TYPES:
            raise InputError(f"loss_type={self.loss_type!r} is not one of {list(TRL_LOSS_TYPES)}; pick one of them.")
        if self.loss_type != "dapo":  # TRL's default is our default (vanilla, token-mean)
            for verl_name, value, default in zip(("policy_loss_mode", "loss_agg_mode"), TRL_LOSS_TYPES[self.loss_type],
                                                 ("vanilla", "token-mean")):
                if getattr(self, verl_name) not in (default, value):
                    raise InputError(f"loss_type={self.loss_type!r} means {verl_name}={value!r}, which conflicts with "
                                     f"{verl_name}={getattr(self, verl_name)!r}; set only one of them.")
                setattr(self, verl_name, value)
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise InputError(f"multi_objective_aggregation={self.multi_objective_aggregation!r} is not one of "
                             "'sum_then_normalize', 'normalize_then_sum'; pick one of them.")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.adv_estimator != "grpo":
            raise InputError(f"multi_objective_aggregation='normalize_then_sum' (GDPO) computes the advantages itself, "
                             f"so it needs adv_estimator='grpo' (here {self.adv_estimator!r}); remove one of them.")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.use_kl_in_reward:
            raise InputError("multi_objective_aggregation='normalize_then_sum' (GDPO) normalizes the reward functions' "
                             "outputs, with no place for a KL penalty in the reward; set use_kl_in_reward=False (a KL "
                             "loss, beta > 0, works with it).")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise InputError(f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1] (1.0: every token; "
                             "0.2: the 20% of tokens with the highest entropy).")
        if self.rollout_backend == "hf" and self.rollout_seed_mode == "sample":
            raise InputError(HF_SAMPLE_SEEDS)
        unused = self.vllm_engine_settings() if self.rollout_backend == "hf" else []
        if unused:
            raise InputError(
                f"rollout_backend='hf' (transformers generate) has no use for {', '.join(unused)}: "
                "they configure the vLLM engines. Remove them, or generate with vLLM (rollout_backend='vllm', or "
                "'auto' where vLLM is installed).")
        if self.use_vllm:  # TRL's vLLM generation: our engine group, with TRL's rollout correction when asked
            if self.rollout_backend == "hf":
                raise InputError("use_vllm=True conflicts with rollout_backend='hf'; set only one.")
            self.rollout_backend = "vllm"
            if self.vllm_importance_sampling_correction and self.rollout_is is None:
                level, _, mode = self.vllm_importance_sampling_mode.partition("_")
                if level not in ("token", "sequence") or mode not in ("mask", "truncate"):
                    raise InputError(
                        f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not one of "
                        "'token_mask', 'token_truncate', 'sequence_mask', 'sequence_truncate'.")
                self.rollout_is, self.rollout_is_mode = level, mode
                cap = self.vllm_importance_sampling_cap
                upper = cap if cap is not None else self.vllm_importance_sampling_clip_max
                self.rollout_is_threshold = None if upper is None else float(upper)
                lower = self.vllm_importance_sampling_clip_min
                self.rollout_is_threshold_lower = None if lower is None else float(lower)

    def _resolve_decoupled_loss(self) -> None:
        """``decoupled_loss=None``: on where a sample can be older than the policy that trains on it
        (:func:`stale_sample_reason`, kept in ``_stale_reason`` for the trainer's log line), off elsewhere; on, it
        weights each token by ``rollout_is='token'`` unless ``rollout_is`` is set."""
        reason = stale_sample_reason(self.rollout_ranks, self.rollout_partial, self.max_staleness, self.rollout_lookahead)
        if self.decoupled_loss is None:
            self.decoupled_loss = reason is not None
            self._stale_reason = reason
        if self.decoupled_loss and self.rollout_is is None:
            self.rollout_is = "token"

    def _layout_kwargs(self, world: int) -> dict:
        return dict(  # with rollout_ranks the trainers hold no engine: their layout has none to split
            num_processes=world, rollout_tp_size=1 if self.rollout_ranks else self.rollout_tp_size, train_batch_size=self.train_batch_size,
            rollout_n=self.rollout_n, ppo_mini_batch_size=self.ppo_mini_batch_size,
            ppo_mini_batch_samples=self.ppo_mini_batch_samples,
            ppo_micro_batch_size_per_device=self.ppo_micro_batch_size_per_device, ppo_epochs=self.ppo_epochs or 1,
            log_prob_micro_batch_size=self.log_prob_micro_batch_size,
            log_prob_micro_batch_size_per_device=self.log_prob_micro_batch_size_per_device,
            ref_log_prob_micro_batch_size=self.ref_log_prob_micro_batch_size,
            ref_log_prob_micro_batch_size_per_device=self.ref_log_prob_micro_batch_size_per_device,
            log_prob_max_token_len_per_device=self.log_prob_max_token_len_per_device,
            ref_log_prob_max_token_len_per_device=self.ref_log_prob_max_token_len_per_device,
            sequence_parallel_size=self.sequence_parallel_size, adv_estimator=self.adv_estimator,
        )

    def _derive_trl_fields(self, world: int) -> None:
        if self.rollout_n is None:
            self.rollout_n = self.num_generations
        layout = RolloutLayout.build(**self._layout_kwargs(world))
        sp = layout.sequence_parallel_size
        if layout.ppo_micro_batch_size_per_device % sp:
            raise InputError(
                f"sequence_parallel_size={sp}: a sequence-parallel group's micro batch of "
                f"{layout.ppo_micro_batch_size_per_device} samples does not split into TRL's per-device batches of "
                f"the group's {sp} ranks; make ppo_micro_batch_size_per_device a multiple of {sp}.")
        derived = {
            "num_generations": layout.rollout_n,
            # TRL counts its batch over every process; a sequence-parallel group of S shares one micro batch
            "per_device_train_batch_size": layout.ppo_micro_batch_size_per_device // sp,
            "gradient_accumulation_steps": layout.gradient_accumulation_steps,
            "num_iterations": layout.ppo_epochs,
        }
        for name, value in derived.items():
            current = getattr(self, name)
            if current != value and current != _TRL_DEFAULTS.get(name):
                raise InputError(
                    f"{name}={current} conflicts with the verl settings, which give {name}={value} "
                    f"(train_batch_size={self.train_batch_size}, rollout_n={layout.rollout_n}, "
                    f"ppo_mini_batch_size={layout.ppo_mini_batch_size}, {world} processes); remove {name} from the "
                    f"config or drop train_batch_size and use TRL's fields only."
                )
            setattr(self, name, value)
        if self.generation_batch_size not in (None, layout.total_samples):
            raise InputError(
                f"generation_batch_size={self.generation_batch_size} conflicts with train_batch_size="
                f"{self.train_batch_size} x rollout_n={layout.rollout_n} = {layout.total_samples}; remove it."
            )
        self.generation_batch_size = None
        steps = layout.samples_per_rank // layout.ppo_micro_batch_size_per_device
        if self.steps_per_generation not in (None, steps):
            raise InputError(
                f"steps_per_generation={self.steps_per_generation} conflicts with the verl settings, which give "
                f"{steps} (samples per rank {layout.samples_per_rank} / ppo_micro_batch_size_per_device "
                f"{layout.ppo_micro_batch_size_per_device}); remove steps_per_generation."
            )
        self.steps_per_generation = steps
        if isinstance(layout.ppo_mini_batch_size, int):  # a fraction of a prompt stays in ppo_mini_batch_samples
            self.ppo_mini_batch_size = layout.ppo_mini_batch_size
        self.ppo_micro_batch_size_per_device = layout.ppo_micro_batch_size_per_device
        self.ppo_epochs = layout.ppo_epochs

    def _derive_verl_fields(self, world: int) -> None:
        if self.rollout_n is not None and self.rollout_n != self.num_generations:
            if self.num_generations != _TRL_DEFAULTS["num_generations"]:
                raise InputError(f"rollout_n={self.rollout_n} conflicts with num_generations={self.num_generations}; "
                                 "set only one.")
            self.num_generations = self.rollout_n
        n = self.num_generations
        micro = self.per_device_train_batch_size
        if self.generation_batch_size is not None:
            samples = self.generation_batch_size
        else:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            samples = micro * world * steps
        if samples % n:
            raise LayoutError(
                f"generation_batch_size={samples} samples (per_device_train_batch_size={micro} x {world} processes "
                f"x steps_per_generation) is not divisible by num_generations={n}: groups would be split (TRL's rule "
                f"too: generation_batch_size must be divisible by num_generations); use a per_device_train_batch_size "
                f"or steps_per_generation that makes it a multiple of {n}, or set train_batch_size (prompts) instead."
            )
        mini_samples = micro * world * self.gradient_accumulation_steps
        self.rollout_n = n
        self.train_batch_size = samples // n
        # TRL accepts optimizer steps holding part of a group, or spanning two rollouts (its loop starts a rollout
        # every steps_per_generation x num_iterations micro batches, inside an optimizer step or not): count them in
        # samples
        if mini_samples % n or samples % mini_samples:
            self.ppo_mini_batch_size, self.ppo_mini_batch_samples = None, mini_samples
        else:
            self.ppo_mini_batch_size = mini_samples // n
        self.ppo_micro_batch_size_per_device = micro
        self.ppo_epochs = self.num_iterations
        RolloutLayout.build(**self._layout_kwargs(world))  # validate (engines, micro batches, ...)
