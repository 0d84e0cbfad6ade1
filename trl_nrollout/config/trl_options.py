"""Drop-in means drop-in: every option TRL's ``GRPOConfig`` adds (and every ``GRPOTrainer`` argument) is honored
with TRL's meaning, mapped onto a verl option, or refused at construction. None is silently ignored.

:data:`TRL_OPTIONS` is the one table: ``name -> (status, neutral value, text)``. ``status``:

- ``"honored"``: the option does what it does in TRL (TRL's own code still runs for it, or ours reads it);
- ``"mapped"``: our code reads it through a verl option (the text names it);
- ``"refused"``: our rollout stage does not implement it; any value other than the neutral one (TRL's default,
  at which TRL behaves as we do) raises :class:`UnsupportedTRLOption` naming the option, the value, why, and what
  to use instead.

docs/migrating.md's table is generated from it (``scripts/gen_config_docs.py``) and a test walks every field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trl_nrollout.builtin import resolve_model
from trl_nrollout.errors import InputError

#: TRL's loss_type -> (our policy_loss_mode, loss_agg_mode). TRL 1.16's normalizers, per micro batch: grpo/sapo the
#: mean over sequences of each token mean, bnpo the micro batch's token mean (divided by the accumulation steps),
#: dr_grpo the token sum / (sequences x max_completion_length), luspo the mean over sequences of each token sum,
#: dapo/cispo/vespo the token sum / the optimizer step's tokens.
TRL_LOSS_TYPES: dict[str, tuple[str, str]] = {
    "dapo": ("vanilla", "token-mean"),
    "grpo": ("vanilla", "seq-mean-token-mean"),
    "bnpo": ("vanilla", "token-mean-micro"),
    "dr_grpo": ("vanilla", "seq-mean-token-sum-norm"),
    "luspo": ("vanilla", "seq-mean-token-sum"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "vespo": ("vespo", "token-mean"),
}

_ANY = object()  # no neutral value: the option is honored or mapped, whatever its value

#: name -> (status, neutral value for refused options, what we do / why / what instead)
TRL_OPTIONS: dict[str, tuple[str, Any, str]] = {
    # ---------------------------------------------------------------- models and data (TRL's __init__ runs)
    "model_init_kwargs": ("honored", _ANY, "TRL loads the policy (and reference, reward models) with them."),
    "trust_remote_code": ("honored", _ANY, "TRL passes it when loading models."),
    "disable_dropout": ("honored", _ANY, "TRL's __init__ disables dropout in the models."),
    "cast_lm_head_to_fp32": ("honored", _ANY, "TRL's __init__ casts the head; our fused-head forward uses it."),
    "shuffle_dataset": ("honored", _ANY, "TRL's sampler."),
    "chat_template_kwargs": ("honored", _ANY, "TRL's prompt tokenization, which our rollout calls."),
    "sync_ref_model": ("honored", _ANY, "TRL's SyncRefModelCallback (TR-DPO) on the reference model."),
    "ref_model_mixup_alpha": ("honored", _ANY, "TRL's SyncRefModelCallback."),
    "ref_model_sync_steps": ("honored", _ANY, "TRL's SyncRefModelCallback."),
    "reward_weights": ("honored", _ANY, "Weights of the reward functions in the summed reward."),
    "num_generations_eval": ("honored", _ANY, "Samples per prompt in evaluation."),
    "max_completion_length": ("honored", _ANY, "The engines' max_tokens; also the Dr. GRPO length norm."),
    "temperature": ("honored", _ANY, "Sampling, and the log-prob passes (logits / temperature)."),
    "top_p": ("honored", _ANY, "Sampling."),
    "top_k": ("honored", _ANY, "Sampling (0: off)."),
    "min_p": ("honored", _ANY, "Sampling (None: off)."),
    "repetition_penalty": ("honored", _ANY, "Sampling."),
    "ds3_gather_for_generation": ("honored", _ANY, "HF engine under ZeRO-3; the vLLM engines sync in buckets."),
    "vllm_enable_sleep_mode": ("honored", _ANY, "vLLM sleep mode around training (CUDA)."),
    "vllm_gpu_memory_utilization": ("honored", _ANY, "Fraction of GPU memory each vLLM engine may use."),
    "entropy_coef": ("honored", _ANY, "Entropy bonus weight: coef x the micro batch's mean token entropy (TRL's)."),
    "use_adaptive_entropy": ("honored", _ANY, "TRL's adaptive entropy coefficient (same controller, same state)."),
    "entropy_coef_min": ("honored", _ANY, "Lower bound of the adaptive coefficient."),
    "entropy_coef_max": ("honored", _ANY, "Upper bound of the adaptive coefficient."),
    "entropy_coef_delta": ("honored", _ANY, "Step of the adaptive coefficient per optimizer step."),
    "entropy_target": ("honored", _ANY, "Entropy the adaptive controller steers towards."),
    "use_bias_correction_kl": ("honored", _ANY, "With beta != 0: the per-token KL is multiplied by the "
                                                "importance ratio, as in TRL."),
    "router_aux_loss_coef": ("honored", _ANY, "A MoE model's router load-balancing loss is added as in TRL "
                                              "(None: the model's own coefficient; 0.0: none)."),
    "mask_truncated_completions": ("honored", _ANY, "Completions cut at max_completion_length are masked out of "
                                                    "the loss (their tokens count in no normalizer)."),
    "max_tool_calling_iterations": ("honored", _ANY, "Tool rounds per sample (None: until the completion budget "
                                                     "ends)."),
    "log_multimodal": ("honored", _ANY, "With log_completions: the prompts' images in the completions table."),
    # ---------------------------------------------------------------- mapped onto verl's vocabulary
    "num_generations": ("mapped", _ANY, "rollout_n"),
    "generation_batch_size": ("mapped", _ANY, "train_batch_size x rollout_n"),
    "steps_per_generation": ("mapped", _ANY, "samples per rank / ppo_micro_batch_size_per_device"),
    "num_iterations": ("mapped", _ANY, "ppo_epochs"),
    "epsilon": ("mapped", _ANY, "clip_ratio_low"),
    "epsilon_high": ("mapped", _ANY, "clip_ratio_high"),
    "importance_sampling_level": ("mapped", _ANY, "ratio_level"),
    "beta": ("mapped", _ANY, "use_kl_loss + kl_loss_coef (a plain GRPOConfig keeps TRL's k3 estimator)"),
    "vllm_tensor_parallel_size": ("mapped", _ANY, "rollout_tp_size"),
    "vllm_max_model_length": ("mapped", _ANY, "rollout_max_model_len"),
    "use_vllm": ("mapped", _ANY, "rollout_backend ('vllm' when True; our engine group, not TRL's)"),
    "scale_rewards": ("mapped", _ANY, "'group'/True: norm_adv_by_std_in_grpo=True; 'none'/False: False "
                                      "(Dr. GRPO); 'batch': adv_estimator_kwargs std_scope='batch'"),
    "vllm_importance_sampling_correction": ("mapped", _ANY, "rollout_is (with use_vllm=True, as in TRL)"),
    "vllm_importance_sampling_mode": ("mapped", _ANY, "rollout_is ('token'/'sequence') + rollout_is_mode "
                                                      "('mask'/'truncate')"),
    "vllm_importance_sampling_clip_max": ("mapped", _ANY, "rollout_is_threshold"),
    "vllm_importance_sampling_cap": ("mapped", _ANY, "rollout_is_threshold (TRL's deprecated alias)"),
    "vllm_importance_sampling_clip_min": ("mapped", _ANY, "rollout_is_threshold_lower"),
    "loss_type": ("mapped", _ANY, "policy_loss_mode + loss_agg_mode: " + ", ".join(
        f"{k}: {m}/{a}" for k, (m, a) in TRL_LOSS_TYPES.items())),
    # ---------------------------------------------------------------- refused (not implemented by our stage)
    "multi_objective_aggregation": ("honored", _ANY, "'sum_then_normalize' (weighted sum, then the estimator) or "
                                                     "'normalize_then_sum' (GDPO: each reward normalized in its group, "
                                                     "weighted sum, normalized over the batch), as in TRL."),
    "top_entropy_quantile": ("honored", _ANY, "Only the top-rho entropy tokens of the step (all ranks) carry the "
                                              "policy loss and the entropy bonus, as in TRL."),
    "delta": ("honored", _ANY, "Two-sided clip: the unclipped ratio is capped at delta (INTELLECT-2), as in TRL."),
    "sapo_temperature_neg": ("honored", _ANY, "SAPO's temperature for non-positive advantages (loss_type='sapo')."),
    "sapo_temperature_pos": ("honored", _ANY, "SAPO's temperature for positive advantages (loss_type='sapo')."),
    "vespo_k_pos": ("honored", _ANY, "VESPO's gamma-weight shape (loss_type='vespo')."),
    "vespo_lambda_pos": ("honored", _ANY, "VESPO's gamma-weight decay (loss_type='vespo')."),
    "vespo_k_neg": ("honored", _ANY, "VESPO's gamma-weight shape for negative advantages (loss_type='vespo')."),
    "vespo_lambda_neg": ("honored", _ANY, "VESPO's gamma-weight decay for negative advantages (loss_type='vespo')."),
    "off_policy_mask_threshold": ("honored", _ANY, "DeepSeek-V3.2's off-policy sequence mask (negative advantage and "
                                                   "mean sampler/policy KL above it), against the engine's log-probs."),
    "pad_to_multiple_of": ("honored", _ANY, "Prompt and completion tensors, generate()'s prompt batches and every "
                           "log-prob, critic and training forward are padded to a multiple of it, as TRL pads."),
    "generation_kwargs": ("honored", _ANY, "Passed to the engine's sampler as TRL passes them: vLLM SamplingParams "
                                           "fields on the vLLM engine, generate() arguments on the HF engine (n, "
                                           "max_tokens, seed, logprobs are ours: an error names the option to use)."),
    "cache_implementation": ("honored", _ANY, "The HF engine's generate() cache (as TRL; each prompt is then "
                             "prefilled once per sample, not once for its n samples); no effect on vLLM, as in TRL."),
    "log_completions": ("honored", _ANY, "TRL's completions table (prompts, completions, each reward, advantages, "
                                         "log_extra columns): printed, saved as parquet, sent to wandb/trackio."),
    "num_completions_to_print": ("honored", _ANY, "Rows of the printed completions table."),
    "log_unique_prompts": ("honored", _ANY, "One row per prompt in the wandb/trackio table."),
    "log_completions_hub_repo": ("honored", _ANY, "TRL pushes the completions parquet files to this dataset repo."),
    "vllm_mode": ("mapped", _ANY, "'colocate' is rollout_ranks=0; 'server' (TRL's separate `trl vllm-serve`) maps "
                                  "onto rollout_ranks: processes of the same launch that only generate (set it; an "
                                  "error says so otherwise)"),
    "vllm_model_impl": ("refused", "vllm", "our engines use vLLM's own model implementations"),
    "vllm_structured_outputs_regex": ("honored", _ANY, "vLLM's structured outputs on our vLLM engines; with the HF "
                                                       "engine, an error (TRL ignores it there)."),
    "vllm_server_base_url": ("refused", None, "no server: rollout_ranks generate inside the launch (vllm_mode)"),
    "vllm_server_host": ("refused", "0.0.0.0", "no server: rollout_ranks generate inside the launch (vllm_mode)"),
    "vllm_server_port": ("refused", 8000, "no server: rollout_ranks generate inside the launch (vllm_mode)"),
    "vllm_server_timeout": ("refused", 240.0, "no server: rollout_ranks generate inside the launch (vllm_mode)"),
    "vllm_group_port": ("refused", 51216, "no server: rollout_ranks generate inside the launch (vllm_mode)"),
    "use_transformers_continuous_batching": ("refused", False, "generation is ours (rollout_backend)"),
    "transformers_continuous_batching_config": ("refused", None, "generation is ours (rollout_backend)"),
    "use_transformers_paged": ("refused", False, "generation is ours (rollout_backend)"),
}

#: GRPOTrainer constructor arguments beyond the model/data ones, all honored: name -> what our stage does.
TRAINER_ARGS: dict[str, str] = {
    "tools": "Multi-turn tool calling on our engines, turn by turn for all samples (tool results masked out of the "
             "loss; groups stay n samples).",
    "environment_factory": "One environment per sample (TRL's pool, reset per episode); its methods are the "
                           "sample's tools; reward functions get environments=.",
    "rollout_func": "Your generation instead of ours (it may call trainer.rollout_engine); prompt_ids, "
                    "completion_ids, logprobs, env_mask and extra reward fields as in TRL.",
}


class UnsupportedTRLOption(InputError):
    """A TRL option our rollout stage does not implement was set; the message says why and what to use."""


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(neutral, float) and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) == neutral
    return value == neutral


def check_trl_options(values: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedTRLOption` for the first refused option whose value is not its neutral one."""
    for name, (status, neutral, why) in TRL_OPTIONS.items():
        if status != "refused" or name not in values:
            continue
        value = values[name]
        if not _same(value, neutral):
            raise UnsupportedTRLOption(
                f"{name}={value!r} is not supported by NRolloutGRPOTrainer: {why}. Remove it (TRL's default "
                f"{neutral!r} is what our rollout stage does), or use trl.GRPOTrainer for this option."
            )


def options_table() -> list[tuple[str, str, str]]:
    """(option, status, what) rows for docs/migrating.md."""
    rows = []
    for name, (status, neutral, text) in TRL_OPTIONS.items():
        if status == "refused":
            rows.append((name, f"refused unless {neutral!r}", text))
        elif status == "mapped":
            rows.append((name, "mapped", text))
        else:
            rows.append((name, "honored", text))
    rows += [(f"{name}= (trainer)", "honored", what) for name, what in TRAINER_ARGS.items()]
    return rows


def drop_in_arguments(model: Any, args: Any, config_cls: type, convert: Callable[[Any], Any], run_name: str
                      ) -> tuple[Any, Any]:
    """The drop-in trainers' arguments as they train with them: ``model`` with a built-in name
    (``builtin:tiny-qwen2``) resolved to its local folder; ``args`` as a ``config_cls``: None -> its defaults with
    ``output_dir="<model's name>-NRollout-<run_name>"`` (TRL's naming), a ``config_cls`` as is, another config (a
    plain TRL one) converted by ``convert`` with the same settings."""
    if isinstance(model, str):
        model = resolve_model(model)
    if args is None:
        name = model.split("/")[-1] if isinstance(model, str) else "model"
        args = config_cls(output_dir=f"{name}-NRollout-{run_name}")
    elif not isinstance(args, config_cls):
        args = convert(args)
    return model, args
