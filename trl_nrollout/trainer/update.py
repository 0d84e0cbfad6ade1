"""The policy update of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`, as a part (:class:`PolicyUpdate`)
the trainer builds once and hands TRL's update hooks to: the loss of a micro batch (verl's clipped policy loss over
TRL's inputs, rollout correction, KL loss, entropy bonus, MoE router loss), the policy's log-probs through TRL's
fused head in the plain, the shared-prompt, the padding-free or the sequence-parallel layout, the mini batch's loss
normalizers, and the update's timing.

Its collaborators come in explicitly: the config, the accelerator, the :class:`ForwardRules` shared with the other
parts, the :class:`~trl_nrollout.trainer.metrics.Metrics` sink, TRL's loss settings (:class:`LossConfig`) and its
entropy controller (:class:`EntropyControl`), the step clock; TRL's loop position comes with each call
(:class:`MicroStep`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather
from torch import Tensor

from trl_nrollout.algos.losses import (
    agg_loss,
    entropy_quantile,
    high_entropy_mask,
    kl_penalty,
    off_policy_sequence_mask,
    policy_loss,
    rollout_is_weights,
    vespo_weights,
)
from trl_nrollout.passes.multimodal import collate
from trl_nrollout.passes.packing import decide, mask_dtype, pack_shared_prompts, query_dtype
from trl_nrollout.passes.padfree import (
    pack_rows,
    padfree_layout,
    prefix_lengths,
    rows_attention,
    rows_mask_dtype,
    unpad,
)
from trl_nrollout.passes.ulysses import SPGroup, sharded_policy_logps, sp_loss_scale, sp_multiple
from trl_nrollout.passes.varlen import register as register_varlen
from trl_nrollout.trainer.clocks import StepClock
from trl_nrollout.trainer.forward_rules import ForwardRules
from trl_nrollout.trainer.metrics import Metrics

logger = logging.getLogger(__name__)
register_varlen()  # attn_implementation="trl_nrollout_varlen" loads wherever the trainer is imported


@dataclass(frozen=True)
class LossConfig:
    """TRL's loss settings the update reads (set by ``GRPOTrainer.__init__`` from the config and the model):
    ``epsilon_low`` / ``epsilon_high`` (the clip), ``beta`` (the KL loss), ``importance_sampling_level``,
    ``top_entropy_quantile``, a MoE router loss (``aux_loss_enabled``, ``router_aux_loss_coef``)."""

    epsilon_low: float
    epsilon_high: float
    beta: float
    importance_sampling_level: str
    top_entropy_quantile: float
    aux_loss_enabled: bool
    router_aux_loss_coef: float


@dataclass
class EntropyControl:
    """TRL's entropy bonus controller (``entropy_coef``, ``use_adaptive_entropy``...): the coefficient, whether it
    adapts, whether the bonus runs at all, the entropy measured at the last optimizer step and the current window's
    ``[sum, tokens]`` ``[2]``. TRL's checkpoints save ``coef`` and ``last_world_entropy`` through the trainer's
    attributes of those names, which the trainer copies from and to this controller."""

    coef: float
    adaptive: bool
    enabled: bool
    last_world_entropy: float = float("inf")
    window: Tensor | None = None

    def trl_state(self) -> tuple[float, float]:
        """``(coef, last_world_entropy)``: what TRL's ``entropy_coef`` and ``_last_world_entropy`` hold."""
        return self.coef, self.last_world_entropy

    def restore(self, coef: float, last_world_entropy: float) -> None:
        """Take TRL's attributes back (a checkpoint's, once TRL restored them)."""
        self.coef, self.last_world_entropy = coef, last_world_entropy


@dataclass(frozen=True)
class MicroStep:
    """Where TRL's loop is when a micro batch's loss runs: ``mode`` ("train" or "eval"), ``accumulation`` (the
    optimizer step's micro steps, TRL's ``current_gradient_accumulation_steps``; 1 in eval) and ``global_step``."""

    mode: str
    accumulation: float
    global_step: int


class PolicyUpdate:
    """The policy update, a part of the trainer (see the module docstring): built once with its collaborators, the
    policy model handed to each call (the wrapped one appears only after ``accelerator.prepare``)."""

    def __init__(self, args: Any, accelerator: Any, rules: ForwardRules, metrics: Metrics, loss: LossConfig,
                 entropy: EntropyControl, *, pad_token_id: int, pad_to_multiple_of: int | None,
                 sp: SPGroup | None, step_clock: StepClock, steps_per_rollout: int) -> None:
        self.args, self.accelerator, self.rules, self.metrics = args, accelerator, rules, metrics
        self.cfg, self.entropy = loss, entropy
        self.pad_token_id, self.pad_to_multiple_of, self.sp = pad_token_id, pad_to_multiple_of, sp
        self.step_clock, self.steps_per_rollout = step_clock, steps_per_rollout
        self.padfree_said = False

    def add_normalizers(self, chunks: list[dict], accum: int) -> list[dict]:
        """Attach to each micro batch the token and sequence counts of its whole mini batch (all ranks), divided by
        the number of ranks (whose gradients are averaged; the micro losses of one optimizer step are summed, as
        TRL's ``loss_is_scaled_for_ga`` says): token-mean over a mini batch then equals the mean over its tokens
        however it is split.

        Where the ``accum`` micro batches of an optimizer step do not tile the rollout's chunks (TRL's layouts whose
        optimizer steps span two rollouts, or the end of one pass over a rollout and the start of the next, e.g.
        ``gradient_accumulation_steps=3``, ``steps_per_generation=4``), a mini batch's tokens are not all known when
        its first micro batch runs: every micro batch then takes TRL's normalizer, the rollout's tokens (all ranks)
        times ``accum / len(chunks)``, the mean tokens of ``accum`` micro batches (:func:`mini_batch_normalizers`)."""
        world = self.accelerator.num_processes
        counts = torch.tensor([[loss_mask(c).sum().item(), c["completion_mask"].shape[0]] for c in chunks],
                              dtype=torch.float64, device=self.accelerator.device)
        counts = gather(counts.unsqueeze(0)).view(world, len(chunks), 2).sum(0).cpu()
        dev = self.accelerator.device
        for c, (tokens, seqs) in zip(chunks, mini_batch_normalizers(counts.tolist(), accum)):
            # at least one: a mini batch whose tokens are all masked (mask_truncated_completions) has a zero loss
            c["mb_tokens"] = torch.tensor(max(tokens, 1.0) / world, device=dev)
            c["mb_seqs"] = torch.tensor(max(seqs, 1.0) / world, device=dev)
        return chunks

    # ------------------------------------------------------------------ sequence parallelism
    def _sp_forward(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
                    ) -> tuple[Tensor, Tensor, None]:
        """The update's forward under Ulysses: the micro batch as padding-free rows (one sample a unit), each row
        split over the group, TRL's fused head on this rank's shard, the log-probs and entropies ``[B, C]``
        gathered with gradient (every rank of the group returns the same)."""
        c = logits_to_keep
        completion_len = prefix_lengths(attention_mask[:, -c:])
        if completion_len is None:
            raise ValueError(f"sequence_parallel_size={self.sp.size}: a completion mask with holes cannot be laid "
                             "out as padding-free rows; use sequence_parallel_size=1.")
        prompts, completions = unpad(input_ids[:, :-c], attention_mask[:, :-c], input_ids[:, -c:], completion_len)
        config = self.accelerator.unwrap_model(model).config
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        with self.accelerator.autocast():
            queries = query_dtype(weights, input_ids.device.type)
        dtype = rows_mask_dtype(config, weights, queries, input_ids.device.type)  # None: varlen attention
        pk = pack_rows(prompts, completions, self.pad_token_id, mask_dtype=dtype,
                       pad_to_multiple_of=sp_multiple(self.pad_to_multiple_of, self.sp.size), completion_width=c)
        with self.accelerator.autocast():
            logps, entropy = sharded_policy_logps(model, pk, self.sp)
        return logps, entropy, None

    # ------------------------------------------------------------------ the update
    def stepped(self, loss: Tensor, seconds: float, boundary: bool, other_seconds: Callable[[], float]) -> Tensor:
        """After TRL's ``training_step`` of one micro step (``seconds`` of it, the other models' updates included):
        the loss to log (unscaled where Ulysses scaled the backward's: :func:`sp_loss_scale`), the step clock moved
        and, at an optimizer step (``boundary``), its figures logged, less ``other_seconds()`` (PPO: the critic)."""
        if self.sp is not None:  # the backward's loss was scaled (sp_loss_scale): logged unscaled
            loss = loss / sp_loss_scale(self.sp.size)
        self.step_clock.update_s += seconds
        if boundary:
            # training_step includes _prepare_inputs, hence the rollout when one ran: the clock keeps only the update
            for name, value in self.step_clock.step_done(other_seconds(), self.steps_per_rollout).items():
                self.metrics.add("train", name, value)
        return loss

    def policy_logps(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                      mm: list | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Log-probs and entropies ``[B, C]`` of the completion tokens, with gradient, through TRL's fused LM head,
        and a MoE model's router load-balancing loss ``[]`` when TRL's ``aux_loss_enabled`` says so (else None).

        Unlike TRL's own pass, positions are counted from each sequence's first real token (``position_ids``
        from the mask), as the engines and :func:`~trl_nrollout.passes.logprobs.compute_log_probs` count them, so a
        left-padded prompt scores the same as an unpadded one for every position scheme (RoPE is shift-invariant
        only up to rounding; learned absolute positions are not at all).

        ``mm``: per sample, a vision-language model's image tensors (TRL's ``forward_kwargs``); the model then
        places its positions itself, as in TRL, and its vision tower is trained.
        """
        if self.sp is not None:
            if mm is not None:
                raise ValueError(f"sequence_parallel_size={self.sp.size} with image prompts: a vision-language "
                                 "model's rows are not sharded yet; use sequence_parallel_size=1.")
            return self._sp_forward(model, input_ids, attention_mask, logits_to_keep)
        if mm is None and self.rules.padfree_allowed(model, aux_loss=self.cfg.aux_loss_enabled):
            rows = self._padfree_forward(model, input_ids, attention_mask, logits_to_keep)
            if rows is not None:
                return rows
        if self.rules.packing_allowed(model, images=mm is not None, aux_loss=self.cfg.aux_loss_enabled):
            packed = self._packed_forward(model, input_ids, attention_mask, logits_to_keep)
            if packed is not None:
                return packed
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        extra = {"output_router_logits": True} if self.cfg.aux_loss_enabled else {}
        if mm is None:
            extra["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        else:  # prompts are left-padded: each starts where its padding ends
            width = input_ids.shape[1] - logits_to_keep
            starts = (width - attention_mask[:, :width].sum(-1)).tolist()
            extra.update(collate(mm, input_ids.device, width=input_ids.shape[1], starts=starts))
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                        **extra)
        aux = out.aux_loss if self.cfg.aux_loss_enabled else None
        return out.log_probs[:, -logits_to_keep:], out.entropy[:, -logits_to_keep:], aux

    def _packed_forward(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
                        ) -> tuple[Tensor, Tensor, None] | None:
        """``shared_prompt_forward`` on a model that takes it (:meth:`ForwardRules.packing_allowed`): log-probs and entropies
        ``[B, C]`` from the packed layout (:mod:`trl_nrollout.passes.packing`), or None where this micro batch runs the
        plain forward (a mask over its bound is said once)."""
        config = self.accelerator.unwrap_model(model).config
        prompt_ids = input_ids[:, :-logits_to_keep]
        completion_ids = input_ids[:, -logits_to_keep:]
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        dtype = mask_dtype(config, weights)
        with self.accelerator.autocast():  # the queries' dtype is the forward's, under the trainer's autocast
            queries = query_dtype(weights, input_ids.device.type)
        pack, reason = decide(prompt_ids, attention_mask[:, :-logits_to_keep], completion_ids, input_ids.shape[1],
                              dtype, queries)
        if not pack:
            if reason is not None:
                self.rules.packing_notice(reason)
            return None
        pk = pack_shared_prompts(prompt_ids, attention_mask[:, :-logits_to_keep], completion_ids,
                                 self.pad_token_id, dtype=dtype, pad_to_multiple_of=self.pad_to_multiple_of)
        with self.accelerator.autocast():
            out = model(input_ids=pk.input_ids, attention_mask=pk.attention_mask, position_ids=pk.position_ids,
                        shift_labels=pk.shift_labels, fused_lm_head=True)
        return pk.gather(out.log_probs), pk.gather(out.entropy), None

    def _padfree_forward(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
                         ) -> tuple[Tensor, Tensor, None] | None:
        """Log-probs and entropies ``[B, C]`` from padding-free rows (:mod:`trl_nrollout.passes.padfree`): the micro
        batch's real tokens end to end in rows as long as its longest sample, through TRL's fused head; None where
        the padded forward runs (too little padding to save, completions with masked holes, a mask over its
        bound)."""
        c = logits_to_keep
        completion_len = prefix_lengths(attention_mask[:, -c:])
        if completion_len is None:
            return None
        prompts, completions = unpad(input_ids[:, :-c], attention_mask[:, :-c], input_ids[:, -c:], completion_len)
        config = self.accelerator.unwrap_model(model).config
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        with self.accelerator.autocast():
            queries = query_dtype(weights, input_ids.device.type)
        dtype = rows_mask_dtype(config, weights, queries, input_ids.device.type)  # None: varlen attention
        shared = self.args.shared_prompt_forward is not False  # a group's prompt once, its completions behind it
        fits, units = padfree_layout([p.numel() for p in prompts], completion_len.tolist(), input_ids.shape[1],
                                     dtype, queries, prompts=prompts if shared else None,
                                     pad_to_multiple_of=self.pad_to_multiple_of,
                                     hidden_size=getattr(config, "hidden_size", None) or 4096)
        if not fits:
            return None
        pk = pack_rows(prompts, completions, self.pad_token_id, mask_dtype=dtype,
                       pad_to_multiple_of=self.pad_to_multiple_of, completion_width=c, units=units)
        if not getattr(self, "_padfree_said", False):
            self.padfree_said = True
            logger.info("padding_free: the update runs padding-free rows%s, %s (this micro batch: %d rows of %d "
                        "tokens instead of %d rows of %d).", " with each prompt once per group" if units else "",
                        "varlen attention" if dtype is None else "a block-diagonal mask",
                        pk.input_ids.shape[0], pk.input_ids.shape[1], input_ids.shape[0], input_ids.shape[1])
        with self.accelerator.autocast(), rows_attention(config, pk):
            out = model(input_ids=pk.input_ids, shift_labels=pk.shift_labels, fused_lm_head=True,
                        **pk.forward_kwargs())
        return pk.gather(out.log_probs), pk.gather(out.entropy), None

    def _entropy_bonus(self, entropies: Tensor, mask: Tensor, step: MicroStep, micro_tokens: Tensor | None = None
                       ) -> Tensor:
        """TRL's entropy bonus, by TRL's rules (``entropy_coef``, ``use_adaptive_entropy``, ``entropy_target``...).

        The bonus is ``coef x`` the mean token entropy of the micro batch (scaled for gradient accumulation, like
        the policy loss). Adaptive: the coefficient of the previous optimizer step applies only while the measured
        entropy is at or below ``entropy_target``; at each optimizer step the window's entropy (all micro batches,
        all ranks, token-weighted) moves the coefficient up by ``entropy_coef_delta`` (entropy at or below the
        target) or down (above), within ``[entropy_coef_min, entropy_coef_max]``. The controller's state is
        :class:`EntropyControl` (TRL's checkpoints save it through the trainer). Returns ``coef x mean entropy``
        ``[]``.
        """
        args, ctl, mode = self.args, self.entropy, step.mode
        accumulation = step.accumulation
        if micro_tokens is None:
            entropy_loss = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        else:  # re-cut under a token budget: each sample over the tokens of its count-based micro batch
            entropy_loss = ((entropies * mask).sum(-1) / micro_tokens.clamp(min=1.0)).sum() / accumulation
        adaptive = ctl.adaptive
        coef = ctl.coef if not adaptive or ctl.last_world_entropy <= args.entropy_target else 0.0
        if adaptive and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
            ctl.window = stats if ctl.window is None else ctl.window + stats
            if self.accelerator.sync_gradients:  # the optimizer step: measure the window, move the coefficient
                total = self.accelerator.reduce(ctl.window, reduction="sum")
                world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                delta = args.entropy_coef_delta if world_entropy <= args.entropy_target else -args.entropy_coef_delta
                ctl.coef = min(max(ctl.coef + delta, args.entropy_coef_min), args.entropy_coef_max)
                ctl.last_world_entropy = world_entropy
                ctl.window = None
        if mode == "train" and self.accelerator.sync_gradients:
            self.metrics.add(mode, "entropy_coef", ctl.coef)
        return coef * entropy_loss

    def _entropy_threshold(self, entropies: Tensor, mask: Tensor, q: float) -> Tensor:
        """The ``q`` quantile of the response-token entropies of this micro step on all ranks (TRL's
        ``top_entropy_quantile``: the threshold of its high-entropy mask). ``entropies``, ``mask``: ``[B, T]``."""
        local = entropies.detach()[mask.bool()].float()
        sentinel = -1e9  # entropies are >= 0
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=sentinel)
        everything = self.accelerator.gather(padded)
        return entropy_quantile(everything[everything != sentinel], q).to(entropies.device)

    def loss(self, model, inputs: dict, step: MicroStep) -> Tensor:
        """The loss of one micro batch ``inputs`` (TRL's batch with the normalizers of :meth:`add_normalizers`) at
        ``step``, its metrics logged: verl's clipped policy loss with the rollout correction, TRL's masks, the KL
        loss, the entropy bonus and a MoE router loss."""
        args, mode = self.args, step.mode
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        logps, entropies, aux_loss = self.policy_logps(model, input_ids, attention_mask, logits_to_keep,
                                                        inputs.get("mm_inputs"))
        mask = loss_mask(inputs).to(logps.dtype)  # completion tokens, less tool results (multi-turn)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        agg = dict(num_tokens=inputs["mb_tokens"], num_seqs=inputs["mb_seqs"])
        if args.loss_agg_mode == "seq-mean-token-sum-norm":
            agg["norm_length"] = args.max_completion_length
        micro_tokens = inputs.get("micro_tokens")  # [B] under a token budget: each sample's count-based micro batch
        if micro_tokens is not None and args.loss_agg_mode == "token-mean-micro":
            agg["row_tokens"] = micro_tokens

        # rollout / trainer mismatch: drift metrics always, importance weights when asked (the decoupled loss of
        # stale samples: the clip against ``old``, the proximal policy, times the weight of ``old`` over the engine's
        # behaviour policy). With a truncating sampler the engine's log-probs are over the tokens it kept: the
        # trainer's are put on that support (less the log of the mass kept) wherever the two are compared.
        rollout = inputs["sampling_per_token_logps"]
        n_tok = mask.sum().clamp(min=1)
        # metrics stay on the device until one host transfer at the end (no sync per metric on a GPU)
        stats: dict[str, Tensor] = {}
        support = inputs.get("sampling_support_log_mass")
        old_cmp, logps_cmp = (old, logps) if support is None else (old - support, logps - support)
        if support is not None:
            stats["rollout_corr/sampling_kept_mass"] = (support.exp() * mask).sum() / n_tok
        diff = ((old_cmp - rollout) * mask).detach().abs()
        stats["rollout_corr/logprob_abs_diff_mean"] = diff.sum() / n_tok
        stats["rollout_corr/logprob_abs_diff_max"] = diff.amax() if diff.numel() else diff.sum()  # 0 when all masked
        stats["rollout_corr/kl"] = (kl_penalty(rollout, old_cmp, "k3") * mask).sum() / n_tok
        adv = inputs["advantages"]  # [B, T] from our estimators; [B] (one per sample) from a TRL-style subclass
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        weights = None
        if args.rollout_is is not None:
            weights = rollout_is_weights(old_cmp, rollout, mask, level=args.rollout_is, mode=args.rollout_is_mode,
                                         upper=args.rollout_is_threshold, lower=args.rollout_is_threshold_lower)
            full = weights.expand_as(mask)
            if args.rollout_is_mode == "mask":
                stats["rollout_corr/masked_fraction"] = ((full == 0) * mask).sum() / n_tok
            stats["rollout_corr/is_weight_mean"] = (full * mask).sum() / n_tok
        # TRL's token masks: the top-rho entropy tokens of the step, DeepSeek-V3.2's off-policy sequence mask
        entropy_mask = None
        if self.cfg.top_entropy_quantile < 1.0:
            threshold = self._entropy_threshold(entropies, mask, 1.0 - self.cfg.top_entropy_quantile)
            entropy_mask = high_entropy_mask(entropies, mask, threshold)
        token_mask = entropy_mask
        if args.off_policy_mask_threshold is not None:
            keep = off_policy_sequence_mask(adv, logps_cmp, rollout, mask, args.off_policy_mask_threshold)
            token_mask = keep if token_mask is None else token_mask * keep
            stats["off_policy_mask/dropped_fraction"] = (1 - keep).mean()
        vespo = None
        if args.policy_loss_mode == "vespo":
            vespo = vespo_weights(adv, logps, old, mask, log_is_weight=None if weights is None else weights.log(),
                                  k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
                                  lambda_neg=args.vespo_lambda_neg)
        out = policy_loss(logps, old, adv, mask, clip_ratio_low=self.cfg.epsilon_low,
                          clip_ratio_high=self.cfg.epsilon_high, clip_ratio_c=args.clip_ratio_c,
                          ratio_level=self.cfg.importance_sampling_level, loss_agg_mode=args.loss_agg_mode,
                          loss_mode=args.policy_loss_mode, delta=args.delta,
                          sapo_temperature_pos=args.sapo_temperature_pos,
                          sapo_temperature_neg=args.sapo_temperature_neg, vespo_weight=vespo, token_mask=token_mask,
                          token_weights=weights, **agg)
        loss = out.loss
        if self.cfg.beta != 0.0:
            kl = kl_penalty(logps, inputs["ref_per_token_logps"], args.kl_loss_type)
            if args.use_bias_correction_kl:  # TRL's option: the KL of tokens sampled from the old policy, reweighted
                kl = kl * torch.exp(logps - old)
            kl_loss = agg_loss(kl, mask, args.loss_agg_mode, **agg)
            loss = loss + self.cfg.beta * kl_loss
            stats["actor/kl_loss"] = (kl.detach() * mask).sum() / n_tok
        if args.loss_agg_mode == "token-mean-micro":  # TRL's bnpo: this micro batch's mean, over the accumulation
            loss = loss / step.accumulation
        if self.entropy.enabled:
            loss = loss - self._entropy_bonus(entropies, mask if entropy_mask is None else mask * entropy_mask, step,
                                              micro_tokens)
        if aux_loss is not None:  # TRL's MoE router loss, router_aux_loss_coef (default: the model's own coefficient)
            accumulation = step.accumulation
            if micro_tokens is not None:  # this micro batch's share of its count-based micro batches' tokens
                accumulation = accumulation / (mask.sum(-1) / micro_tokens.clamp(min=1)).sum().clamp(min=1e-8)
            loss = loss + self.cfg.router_aux_loss_coef * aux_loss / accumulation
            stats["aux_loss"] = aux_loss.detach()
        ratio = torch.exp((logps - old).detach())
        low = ((ratio < 1 - self.cfg.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.cfg.epsilon_high) & (adv > 0)).float()
        stats["clip_ratio/low_mean"] = (low * mask).sum() / n_tok
        stats["clip_ratio/high_mean"] = (high * mask).sum() / n_tok
        stats["clip_ratio/region_mean"] = ((low + high).clamp(max=1) * mask).sum() / n_tok
        stats["actor/pg_loss"] = out.loss.detach()
        stats["actor/pg_clipfrac"] = out.clipfrac.detach()
        stats["actor/pg_clipfrac_lower"] = out.clipfrac_lower.detach()
        stats["actor/ppo_kl"] = out.approx_kl.detach()
        stats["actor/entropy"] = (entropies.detach() * mask).sum() / n_tok
        values = dict(zip([*stats, "loss"], torch.stack([v.float() for v in [*stats.values(), loss.detach()]]).tolist()))
        if not math.isfinite(values["loss"]):  # checked on the values already fetched: no extra sync
            raise FloatingPointError(
                f"the loss is {values['loss']} at step {step.global_step} (pg_loss={values['actor/pg_loss']}); "
                "check the rewards and the learning rate, or lower clip_ratio_c."
            )
        for name, value in values.items():
            if name != "loss":
                self.metrics.add(mode, name, value)
        for trl_name, name in _TRL_METRIC_NAMES.items():  # TRL's names beside verl's (same values)
            if name in values:
                self.metrics.add(mode, trl_name, values[name])
        if self.sp is not None and mode == "train":
            # each rank's gradient is its share of its group's; the data-parallel mean divides by all S x D ranks
            loss = loss * sp_loss_scale(self.sp.size)
        return loss


#: TRL's metric names for the same values as ours (both are logged, so either dashboard keeps working).
_TRL_METRIC_NAMES = {
    "sampling/sampling_logp_difference/mean": "rollout_corr/logprob_abs_diff_mean",
    "sampling/sampling_logp_difference/max": "rollout_corr/logprob_abs_diff_max",
    "policy_loss": "actor/pg_loss", "entropy": "actor/entropy", "kl": "actor/kl_loss",
}


def mini_batch_normalizers(counts: list[list[float]], accum: int) -> list[tuple[float, float]]:
    """The (tokens, sequences) each micro batch of a rollout normalizes its loss by, from ``counts``, the (tokens,
    sequences) of each of the rollout's micro batches (all ranks) in the order TRL's loop trains them, ``accum``
    of them per optimizer step (``gradient_accumulation_steps``).

    When ``accum`` divides the number of micro batches, each optimizer step takes ``accum`` consecutive ones: each
    micro batch gets its own step's totals. Otherwise TRL's loop runs optimizer steps across the end of the rollout
    (into the next pass over it, or the next rollout), whose micro batches are not known yet: each micro batch gets
    TRL's normalizer, the rollout's totals times ``accum / len(counts)`` (TRL's ``num_items_in_batch x
    gradient_accumulation_steps / steps_per_generation``)."""
    k = len(counts)
    if k % accum:
        tokens = sum(c[0] for c in counts) * accum / k
        seqs = sum(c[1] for c in counts) * accum / k
        return [(tokens, seqs)] * k
    out = []
    for i in range(k):
        window = counts[(i // accum) * accum:(i // accum + 1) * accum]
        out.append((sum(c[0] for c in window), sum(c[1] for c in window)))
    return out


def loss_mask(inputs: dict) -> Tensor:
    """The tokens the loss counts ``[B, C]``: the completion's, less tool-response tokens (``tool_mask``)."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
