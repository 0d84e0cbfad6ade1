"""PPO with a critic on the same rollout stage: ``NRolloutPPOTrainer`` and ``NRolloutPPOConfig``.

Everything of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer` is reused: engines, layout, rewards, log-prob
passes, policy loss. Added, as verl's PPO (``adv_estimator: gae`` with ``critic.*``):

- a critic (:mod:`trl_nrollout.passes.critic`), initialized from the policy (or ``critic_model_name_or_path``, e.g. a
  reward model) with a fresh scalar head, and its own AdamW optimizer and learning rate;
- after the log-prob passes, the critic's values of every completion token (micro-batched like them), GAE
  advantages and returns (``gamma``, ``lam``) over the whole job;
- after the policy's forward and backward on each micro step, the update's hook (``_after_policy_step``) trains the
  critic on the same micro batches: its clipped value loss (``cliprange_value``), normalized like the policy's (the
  micro losses of one optimizer step add up to the mini batch's loss); the critic steps with the policy's optimizer
  steps; during the first ``critic_warmup`` steps only the critic trains (verl);
- verl's metric names: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/values/mean``,
  ``critic/returns/mean``, ``critic/vf_explained_var``, ``critic/grad_norm``, and ``timing_s/values``,
  ``timing_s/update_critic``;
- the critic and its optimizer are saved in each checkpoint (``checkpoint-N/critic``) and restored on resume.

Under DDP (or one process) the critic is replicated and its gradients are averaged across processes before each
step; under DeepSpeed ZeRO-2/3 it gets its own DeepSpeed engine with the policy's ZeRO settings (two engines in one
accelerate process, as OpenRLHF runs its actor and critic), built on first use once the policy's config is
resolved. FSDP is refused for now.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import torch

from trl_nrollout.algos.losses import LOSS_AGG_MODES, explained_variance, value_loss
from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.config.trl_options import UnsupportedTRLOption
from trl_nrollout.errors import InputError
from trl_nrollout.passes.budget import BudgetedStep
from trl_nrollout.passes.critic import build_critic, compute_values, critic_values
from trl_nrollout.passes.distributed import is_zero3, synced_count
from trl_nrollout.passes.logprobs import pack_by_tokens, split_by_count
from trl_nrollout.passes.padfree import budget_count, budgeted_parts
from trl_nrollout.passes.ulysses import sp_loss_scale
from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer
from trl_nrollout.trainer.stages import Advantages, Assignment, LogProbs, Round, StepContext, fit_width
from trl_nrollout.trainer.update import loss_mask

CRITIC_DIR = "critic"


@dataclass
class NRolloutPPOConfig(NRolloutConfig):
    """:class:`NRolloutConfig` for PPO with a critic (verl's ``algorithm.adv_estimator: gae`` and ``critic.*``).

    ``num_generations`` (``rollout_n``) defaults to 1 here, as in classic PPO; TRL's rule that GRPO needs two or
    more samples per prompt does not apply.
    """

    adv_estimator: str = field(default="gae", metadata={
        "help": "Advantage estimator; 'gae' (the critic's generalized advantage estimation) for PPO."})
    num_generations: int | None = field(default=1, metadata={
        "help": "Samples per prompt (verl rollout.n); 1 is normal for PPO."})
    gamma: float = field(default=1.0, metadata={"help": "GAE discount (verl algorithm.gamma)."})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda (verl algorithm.lam)."})
    cliprange_value: float = field(default=0.5, metadata={
        "help": "Value clipping: new values stay within +- this of the rollout's (verl critic.cliprange_value)."})
    critic_model_name_or_path: str | None = field(default=None, metadata={
        "help": "Where the critic starts: a model or reward model (default: the policy's weights, new head)."})
    critic_learning_rate: float = field(default=1e-5, metadata={"help": "The critic's AdamW learning rate."})
    critic_weight_decay: float = field(default=0.0, metadata={"help": "The critic's AdamW weight decay."})
    critic_warmup: int = field(default=0, metadata={
        "help": "Optimizer steps during which only the critic trains (verl trainer.critic_warmup)."})
    critic_ppo_micro_batch_size_per_device: int | None = field(default=None, metadata={
        "help": "Sequences per critic forward in the update and the value pass (default: the policy's micro batch "
                "for the update, the old-log-prob pass's for values); must divide per_device_train_batch_size."})
    critic_ppo_max_token_len_per_device: int | None = field(default=None, metadata={
        "help": "Token budget per critic forward (replaces the count-based split; verl "
                "critic.ppo_max_token_len_per_gpu)."})
    critic_loss_agg_mode: str = field(default="token-mean", metadata={
        "help": "How the value loss is reduced (verl critic.loss_agg_mode), as loss_agg_mode."})
    critic_max_grad_norm: float | None = field(default=None, metadata={
        "help": "Gradient clipping of the critic (default: max_grad_norm)."})

    def __post_init__(self) -> None:
        if self.adv_estimator != "gae":
            raise InputError(f"NRolloutPPOConfig(adv_estimator={self.adv_estimator!r}): the PPO trainer trains a critic "
                             "for GAE; use adv_estimator='gae', or NRolloutConfig with NRolloutGRPOTrainer for "
                             "critic-free estimators.")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{name}={value} must be in [0, 1] (1.0: no discount).")
        if self.cliprange_value <= 0:
            raise InputError(f"cliprange_value={self.cliprange_value} must be > 0 (verl's default is 0.5).")
        modes = [m for m in LOSS_AGG_MODES if m != "token-mean-micro"]  # TRL's bnpo is a policy-loss mode only
        if self.critic_loss_agg_mode not in modes:
            raise InputError(f"critic_loss_agg_mode={self.critic_loss_agg_mode!r} is not one of {modes}; pick one "
                             "(verl's default is 'token-mean').")
        if self.critic_warmup < 0:
            raise InputError(f"critic_warmup={self.critic_warmup} must be >= 0 (optimizer steps).")
        for name in ("critic_ppo_micro_batch_size_per_device", "critic_ppo_max_token_len_per_device"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name}={value} must be >= 1 (or None).")
        super().__post_init__()
        micro = self.critic_ppo_micro_batch_size_per_device
        if micro is not None and self.per_device_train_batch_size % micro:
            raise InputError(
                f"critic_ppo_micro_batch_size_per_device={micro} must divide the policy's micro batch "
                f"(per_device_train_batch_size={self.per_device_train_batch_size}): the critic trains on the same "
                f"samples, in smaller pieces; use a divisor of {self.per_device_train_batch_size}.")

    def _trl_post_init(self) -> None:
        """TRL's ``GRPOConfig`` refuses ``num_generations < 2`` (GRPO's group baseline); PPO's GAE needs no group.
        Its checks run with ``num_generations`` set to the whole generation batch (which they accept), then 1 is
        restored."""
        if self.num_generations != 1:
            return super()._trl_post_init()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        samples = self.per_device_train_batch_size * world * (self.steps_per_generation or 1)
        if samples < 2:
            raise InputError(f"a rollout step of {samples} sample: PPO needs at least 2 (raise train_batch_size).")
        self.num_generations = samples
        try:
            super()._trl_post_init()
        finally:
            self.num_generations = 1
            self.rollout_n = 1


class NRolloutPPOTrainer(NRolloutGRPOTrainer):
    """PPO with a learned value function on trl_nrollout's rollout stage (see the module's docstring).

    ``critic_model``: a ready critic (an ``AutoModelForTokenClassification`` with one label) instead of building
    one from ``args.critic_model_name_or_path`` or the policy.
    """

    def __init__(self, model, reward_funcs=None, args: NRolloutPPOConfig | None = None, *, critic_model=None,
                 **kwargs) -> None:
        if args is None:
            name = model.split("/")[-1] if isinstance(model, str) else "model"
            args = NRolloutPPOConfig(output_dir=f"{name}-NRollout-PPO")
        elif not isinstance(args, NRolloutPPOConfig):
            raise TypeError(f"NRolloutPPOTrainer needs an NRolloutPPOConfig (got {type(args).__name__}): the critic's "
                            "options (gamma, lam, cliprange_value, critic_*) live there.")
        super().__init__(model, reward_funcs, args, **kwargs)
        if self.is_fsdp_enabled:
            raise UnsupportedTRLOption(
                "NRolloutPPOTrainer's critic under FSDP is not supported yet (the critic would not be sharded); run "
                "PPO with DDP or DeepSpeed ZeRO-2/3, or NRolloutGRPOTrainer (no critic) under FSDP.")
        if self._is_vlm:
            raise UnsupportedTRLOption("NRolloutPPOTrainer with a vision-language model: the critic has no image "
                                       "path yet; use NRolloutGRPOTrainer for images.")
        if critic_model is None:  # in the policy's dtype: bf16 checkpoint weights get float32 masters, as the policy
            policy = self.accelerator.unwrap_model(self.model)
            dtype = next((p.dtype for p in policy.parameters() if p.is_floating_point()), None)
            critic_model = build_critic(args.critic_model_name_or_path or self.engine_setup.model_path(),
                                        seed=args.seed, dtype=dtype)
        if args.gradient_checkpointing:  # as the policy (TRL's default: on); a 7B critic's activations need it too
            critic_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False})
            critic_model.config.use_cache = False
        self.critic = critic_model.to(self.accelerator.device)
        self.critic.train()
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=args.critic_learning_rate,
                                                  weight_decay=args.critic_weight_decay)
        self._critic_time = self._critic_logged_time = 0.0
        self._critic_ds = None  # the critic's own DeepSpeed engine (ZeRO-2/3), built once the policy's is

    def _critic_engine(self):
        """Under DeepSpeed: the critic's DeepSpeed engine, built on first use from the policy's resolved config
        (same ZeRO stage and precision; the critic's optimizer, no scheduler); None otherwise."""
        if not self.is_deepspeed_enabled or self._critic_ds is not None:
            return self._critic_ds
        import deepspeed

        args: NRolloutPPOConfig = self.args
        config = _without_auto(copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config))
        for key in ("optimizer", "scheduler", "train_batch_size"):
            config.pop(key, None)
        limit = args.critic_max_grad_norm if args.critic_max_grad_norm is not None else args.max_grad_norm
        config.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
                      gradient_accumulation_steps=args.gradient_accumulation_steps,
                      gradient_clipping=float(limit or 0.0), zero_allow_untested_optimizer=True)
        optimizer = self.critic_optimizer
        offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        if offload not in (None, "none") and config.get("zero_force_ds_cpu_optimizer", True):
            # ZeRO-Offload steps the optimizer on the CPU and refuses a torch optimizer there; map it onto
            # DeepSpeed's CPU Adam exactly as accelerate maps the policy's
            from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

            optimizer = map_pytorch_optim_to_deepspeed(optimizer)
        self._critic_ds, self.critic_optimizer, _, _ = deepspeed.initialize(
            model=self.critic, optimizer=optimizer, config=config)
        return self._critic_ds

    # ------------------------------------------------------------------ values and GAE (the advantage stage)
    def _advantages(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext) -> Advantages:
        """GAE over the critic's values: the critic's value pass (:meth:`_critic_value_pass`), then the advantage
        stage's estimator with them over the whole job; the job's mean value and return are logged."""
        args: NRolloutPPOConfig = self.args
        split = sum(1 for s in collected.samples if s.segments)  # the job's: every rank raises alike
        if split:
            raise InputError(
                f"agent=: {split} episode(s) of this step split (their agent edited its message history, so its calls "
                "are not one token sequence), and NRolloutPPOTrainer's critic estimates GAE along one sequence per "
                "episode. Keep the agent's history append-only (send back the messages the endpoint returned), or "
                "train it with NRolloutGRPOTrainer, which trains each call of a split episode with its episode's "
                "advantage.")
        width = max(max(len(s.completion_ids) for s in collected.samples), 1)
        values = self._critic_value_pass(assigned, len(collected), width, ctx.mode)
        adv = self.advantage_stage.estimate(collected, assigned, logps, ctx, values=values, gamma=args.gamma,
                                            lam=args.lam)
        mask = adv.response_mask
        self._metric(ctx.mode, "critic/values/mean", float((values * mask).sum() / mask.sum().clamp(min=1)))
        self._metric(ctx.mode, "critic/returns/mean", float((adv.returns * mask).sum() / mask.sum().clamp(min=1)))
        return adv

    def _critic_value_pass(self, assigned: Assignment, num_samples: int, width: int, mode: str) -> torch.Tensor:
        """The critic's values of this rank's samples (micro-batched like the log-prob passes), assembled into the
        job's ``[num_samples, width]`` (each sample is some rank's: a sum over the ranks), on the CPU."""
        args: NRolloutPPOConfig = self.args
        start = time.perf_counter()
        micro = self.layout.old_log_prob
        critic = self._critic_engine() or self.critic
        with self.accelerator.autocast():  # the precision the critic trains in (bf16=True: bf16 autocast)
            budget = args.critic_ppo_max_token_len_per_device or micro.max_token_len
            count = args.critic_ppo_micro_batch_size_per_device or (
                None if budget is not None and micro.source.startswith("default") else micro.per_device)
            local = compute_values(critic, assigned.prompt_ids, assigned.completion_ids,
                                   pad_token_id=self._tokenizer.pad_token_id, micro_batch_size=count,
                                   max_token_len=budget, pad_to_multiple_of=self.pad_to_multiple_of,
                                   padding_free=self.forward_rules.padfree_allowed(self.critic),
                                   shared_prompts=args.shared_prompt_forward is not False,
                                   sequence_parallel=getattr(self, "_sp", None))
        job = torch.zeros(num_samples, width, device=local.device)
        if local.numel():
            job[torch.as_tensor(assigned.mine, device=local.device), :local.shape[1]] = local
        if self.accelerator.num_processes > 1:
            job = self.accelerator.reduce(job, reduction="sum")
            if getattr(self, "_sp", None) is not None:  # each sample on every rank of its sequence-parallel group
                job = job / self._sp.size
        self._metric(mode, "timing_s/values", time.perf_counter() - start)
        return job.cpu()

    def _trl_batch(self, assigned: Assignment, logps: LogProbs, adv: Advantages, ctx: StepContext) -> dict:
        """TRL's batch, with the critic's values at the rollout (``old_values``) and the GAE returns of this rank's
        samples ``[B, C]``, which the critic's update takes."""
        out = super()._trl_batch(assigned, logps, adv, ctx)
        dev, c_max = out["completion_ids"].device, out["completion_ids"].shape[1]
        out["old_values"] = fit_width(adv.values[assigned.mine], c_max).to(dev)
        out["returns"] = fit_width(adv.returns[assigned.mine], c_max).to(dev)
        return out

    # ------------------------------------------------------------------ the update
    def training_step(self, model, inputs, num_items_in_batch):
        if self.state.global_step >= self.args.critic_warmup:
            return super().training_step(model, inputs, num_items_in_batch)
        # critic warm-up (verl): the rollout and the critic's update run, the policy's gradient is not computed
        model.train()
        self._after_policy_step(self._prepare_inputs(inputs))
        self._critic_logged_time = 0.0  # no actor update to keep it out of
        self._step += 1
        if self._step % self.current_gradient_accumulation_steps == 0:  # the step's clock, without an actor update
            metrics = self.step_clock.step_done(0.0, self.layout.optimizer_steps_per_rollout)
            for name in ("timing_s/step", "perf/throughput"):
                self._metric("train", name, metrics[name])
        return torch.zeros((), device=self.accelerator.device)

    def _after_policy_step(self, batch) -> None:
        """The critic's update on the micro step the policy trained on: each of its micro batches (one, or a token
        budget's several), the critic's optimizer step with the last one where the micro step ends an
        accumulation (the Trainer's boundary: the policy's optimizer step is the critic's)."""
        parts = batch.parts if isinstance(batch, BudgetedStep) else [batch]
        boundary = self.accelerator.sync_gradients
        for i, part in enumerate(parts):
            self._critic_update(part, boundary=boundary and i == len(parts) - 1)

    def _critic_update(self, inputs: dict, boundary: bool) -> None:
        """The critic's value loss on one training micro batch (in critic micro batches), backward, and an
        optimizer step where ``boundary`` (the end of an accumulation; gradients averaged over the processes)."""
        args: NRolloutPPOConfig = self.args
        start = time.perf_counter()
        mask = loss_mask(inputs)
        rows = mask.shape[0]
        lengths = (inputs["prompt_mask"].sum(-1) + inputs["completion_mask"].sum(-1)).tolist()
        padding_free = self.forward_rules.padfree_allowed(self.critic)
        budget = args.critic_ppo_max_token_len_per_device
        sp = getattr(self, "_sp", None)  # Ulysses: the group's rows split over its ranks, budgets per device
        if sp is not None and budget is not None:
            budget *= sp.size
        if budget is not None and padding_free and args.critic_ppo_micro_batch_size_per_device is None:
            hidden = getattr(self.critic.config, "hidden_size", None) or 4096  # real tokens, even work
            pieces = budgeted_parts(lengths, budget, budget_count(lengths, budget), hidden)
        elif budget is not None:
            pieces = pack_by_tokens(lengths, budget, args.critic_ppo_micro_batch_size_per_device)
        else:
            pieces = split_by_count(rows, args.critic_ppo_micro_batch_size_per_device or rows)
        agg = dict(num_tokens=inputs["mb_tokens"], num_seqs=inputs["mb_seqs"])
        if args.critic_loss_agg_mode == "seq-mean-token-sum-norm":
            agg["norm_length"] = args.max_completion_length
        mode = "train"
        engine = self._critic_engine()
        critic = engine or self.critic
        # ZeRO-3 gathers in every forward and backward: every rank runs as many pieces (extra ones weigh 0)
        count = synced_count(len(pieces), mask.device, engine is not None and is_zero3(self.critic))
        for k in range(count):
            idx = pieces[k] if k < len(pieces) else pieces[0][:1]
            sel = torch.as_tensor(idx, device=mask.device)
            with self.accelerator.autocast():
                vpreds = critic_values(critic, inputs["prompt_ids"][sel], inputs["prompt_mask"][sel],
                                       inputs["completion_ids"][sel], inputs["completion_mask"][sel],
                                       padding_free=padding_free, pad_token_id=self._tokenizer.pad_token_id,
                                       pad_to_multiple_of=self.pad_to_multiple_of,
                                       shared_prompts=args.shared_prompt_forward is not False, sequence_parallel=sp)
            m = mask[sel].to(vpreds.dtype) * (1.0 if k < len(pieces) else 0.0)
            loss, clipfrac = value_loss(vpreds, inputs["returns"][sel], inputs["old_values"][sel], m,
                                        args.cliprange_value, args.critic_loss_agg_mode, **agg)
            # Ulysses: each rank's gradients are its shard's part, so the mean over all ranks is the groups' mean
            scaled = loss * sp_loss_scale(sp.size) if sp is not None else loss
            if engine is None:
                scaled.backward()
            else:  # DeepSpeed reduces the gradients at the boundary and steps there (clipping, zero_grad)
                engine.set_gradient_accumulation_boundary(is_boundary=boundary and k == count - 1)
                engine.backward(scaled, scale_wrt_gas=False)
                engine.step()
            if k >= len(pieces):
                continue
            with torch.no_grad():
                n = m.sum().clamp(min=1)
                self._metric(mode, "critic/vf_loss", loss.item())
                self._metric(mode, "critic/vf_clipfrac", clipfrac.item())
                self._metric(mode, "critic/vpred_mean", float((vpreds * m).sum() / n))
                self._metric(mode, "critic/vf_explained_var",
                             explained_variance(vpreds, inputs["returns"][sel], m).item())
        if boundary:
            self._critic_step(mode)
        self._critic_time += time.perf_counter() - start
        if boundary:
            self._metric(mode, "timing_s/update_critic", self._critic_time)
            self._critic_logged_time, self._critic_time = self._critic_time, 0.0

    def _other_update_seconds(self) -> float:
        seconds, self._critic_logged_time = self._critic_logged_time, 0.0
        return seconds

    def _critic_step(self, mode: str) -> None:
        """The critic's optimizer step (DeepSpeed already took it in its own ``step``: only metrics then)."""
        self._metric(mode, "critic/lr", self.critic_optimizer.param_groups[0]["lr"])
        if self._critic_ds is not None:
            norm = self._critic_ds.get_global_grad_norm()
            if norm is not None:
                self._metric(mode, "critic/grad_norm", float(norm))
            return
        params = [p for p in self.critic.parameters() if p.grad is not None]
        world = self.accelerator.num_processes
        if world > 1 and params:  # replicated critic: average the gradients (the loss is normalized for a mean)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            torch.distributed.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        limit = self.args.critic_max_grad_norm if self.args.critic_max_grad_norm is not None else self.args.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, limit) if limit and params else torch.zeros(())
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        self._metric(mode, "critic/grad_norm", float(norm))

    # ------------------------------------------------------------------ checkpoints
    def _save_rollout_state(self, folder: str) -> None:
        """The critic and its optimizer (``checkpoint-N/critic``), beside the rollout stage's own state."""
        super()._save_rollout_state(folder)
        folder = os.path.join(folder, CRITIC_DIR)
        if self._critic_engine() is not None:  # every rank writes its shards (collective)
            self._critic_ds.save_checkpoint(folder, tag="critic")
            return
        if self.accelerator.is_main_process:
            os.makedirs(folder, exist_ok=True)
            self.critic.save_pretrained(folder)
            torch.save(self.critic_optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, CRITIC_DIR)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{checkpoint} has no {CRITIC_DIR}/ folder: it was not saved by "
                                    "NRolloutPPOTrainer, so the critic cannot resume from it.")
        if self._critic_engine() is not None:
            path, _ = self._critic_ds.load_checkpoint(folder, tag="critic")
            if path is None:
                raise FileNotFoundError(f"{folder} holds no DeepSpeed checkpoint of the critic (saved without "
                                        "DeepSpeed?); resume with the launch that saved it.")
            return
        from safetensors.torch import load_file

        state = load_file(os.path.join(folder, "model.safetensors"), device=str(self.accelerator.device))
        missing, unexpected = self.critic.load_state_dict(state, strict=False)
        tied = {k for k in missing if "embed" in k or "lm_head" in k}
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"the critic checkpoint in {folder} does not match the critic: missing "
                               f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}.")
        self.critic_optimizer.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True,
                                                         map_location=self.accelerator.device))


def _without_auto(config):
    """A DeepSpeed config with every value still ``"auto"`` dropped (DeepSpeed's defaults apply to those)."""
    if isinstance(config, dict):
        return {k: _without_auto(v) for k, v in config.items() if v != "auto"}
    return config
