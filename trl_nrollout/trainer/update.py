"""The policy update of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`, as a mixin: the loss of a micro batch
(verl's clipped policy loss over TRL's inputs, rollout correction, KL loss, entropy bonus, MoE router loss), the
policy's log-probs through TRL's fused head in the plain or the shared-prompt layout, the mini batch's loss
normalizers, and the update's timing.

It uses the trainer's TRL attributes (``args``, ``accelerator``, ``state``, ``epsilon_low``/``epsilon_high``,
``beta``, ``importance_sampling_level``, ``top_entropy_quantile``, ``aux_loss_enabled``, the entropy-bonus
controller's fields...) and its ``_metric`` and ``_tokenizer``.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial

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
    sampling_support_log_mass,
    vespo_weights,
)
from trl_nrollout.passes.logprobs import SupportFn
from trl_nrollout.passes.multimodal import collate
from trl_nrollout.passes.packing import (
    decide,
    mask_dtype,
    pack_shared_prompts,
    query_dtype,
    structural_reason,
)
from trl_nrollout.passes.padfree import (
    pack_rows,
    padfree_layout,
    prefix_lengths,
    rows_attention,
    rows_mask_dtype,
    unpad,
)
from trl_nrollout.passes.ulysses import (
    SPGroup,
    check_heads,
    install,
    new_sp_group,
    sharded_policy_logps,
    sp_loss_scale,
    sp_multiple,
)
from trl_nrollout.passes.varlen import register as register_varlen

logger = logging.getLogger(__name__)
register_varlen()  # attn_implementation="trl_nrollout_varlen" loads wherever the trainer is imported


class PolicyUpdate:
    """The update side of the trainer (a mixin placed before ``GRPOTrainer``)."""

    def _add_normalizers(self, chunks: list[dict], accum: int) -> list[dict]:
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

    # ------------------------------------------------------------------ what the engine's log-probs are over
    def _sampling_support(self) -> SupportFn | None:
        """The trainer's replay of the sampler's cut (top-k, top-p, min-p; TRL's options, or ``generation_kwargs``
        where they override them): a function giving the log of the probability mass the sampler keeps at each
        position (:func:`~trl_nrollout.algos.losses.sampling_support_log_mass`), or None where nothing is cut. The
        engines report each token's log-prob over the tokens they kept, renormalized (vLLM's
        ``processed_logprobs``; the HF engine records the same), while the trainer's log-probs are over the whole
        vocabulary: subtracting this mass puts the trainer's on the engine's support, so that the rollout
        correction and the mismatch metrics compare like with like (TRL issue 6789). The HF engine's decoding modes
        other than sampling (beams...) score their samples with the trainer's own pass: nothing to replay."""
        from trl_nrollout.rollout.hf_engine import _NOT_STEPWISE

        extra = dict(self.args.generation_kwargs or {})
        if self.rollout_backend == "hf" and any(k in _NOT_STEPWISE and v not in (None, 1, False)
                                                for k, v in extra.items()):
            return None
        top_k = extra.get("top_k", self.top_k) or 0
        top_p = extra.get("top_p", self.top_p)
        min_p = extra.get("min_p", self.min_p) or 0.0
        top_p = 1.0 if top_p is None else float(top_p)
        if not (top_k > 0 or top_p < 1.0 or min_p > 0.0):
            return None
        return partial(sampling_support_log_mass, top_k=int(top_k), top_p=top_p, min_p=float(min_p),
                       min_p_first=self.rollout_backend != "hf")  # vLLM cuts min-p first, generate() last

    def _note_corrections(self) -> None:
        """One line, on the main process, when the decoupled loss is on by default because samples can be older
        than the policy that trains on them (``decoupled_loss=None`` resolved by the config)."""
        args = self.args
        reason = getattr(args, "_stale_reason", None)
        if reason is None or not args.decoupled_loss or not self.accelerator.is_main_process:
            return
        bound = ("no upper bound" if args.rollout_is_threshold is None else
                 f"at most rollout_is_threshold={args.rollout_is_threshold:g}")
        logger.warning("%s: the decoupled PPO loss is on (decoupled_loss=None): the clip against the policy at the "
                       "update, each %s's loss times its importance weight of that policy over the one that sampled "
                       "it (rollout_is=%r, %s, mode %r); decoupled_loss=False turns it off.",
                       reason, args.rollout_is, args.rollout_is, bound, args.rollout_is_mode)

    # ------------------------------------------------------------------ sequence parallelism
    def _sequence_parallel_setup(self) -> SPGroup | None:
        """``sequence_parallel_size`` S > 1: the model's heads checked (a ValueError naming the option and the fix),
        this rank's Ulysses group made (every S consecutive ranks; the processes' rule is the layout's), and the
        policy's and the reference's attention wrapped (:func:`~trl_nrollout.passes.ulysses.install`). None at 1."""
        size = self.args.sequence_parallel_size
        if size == 1:
            return None
        models = [self.accelerator.unwrap_model(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))
        for model in models:
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            heads = cfg.num_attention_heads
            check_heads(heads, getattr(cfg, "num_key_value_heads", None) or heads, size)
        if self.aux_loss_enabled:
            raise ValueError(f"sequence_parallel_size={size} with a MoE router loss (output_router_logits): the "
                             "router's loss is not gathered over the group yet; set sequence_parallel_size=1 or "
                             "turn the router loss off.")
        for model in models:
            if (why := structural_reason(model.config, varlen=True)) is not None:  # the rows' rule: the same
                raise ValueError(f"sequence_parallel_size={size} runs padding-free rows, but {why}; use "
                                 "sequence_parallel_size=1.")
        sp = new_sp_group(size, seed=self.args.seed)
        for model in models:
            install(model)
        logger.info("sequence_parallel_size=%d: ranks %d..%d split each padding-free row (data-parallel rank %d of "
                    "%d).", size, sp.dp_rank * size, sp.dp_rank * size + size - 1, sp.dp_rank, sp.dp_size)
        return sp

    def _sp_forward(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
                    ) -> tuple[Tensor, Tensor, None]:
        """The update's forward under Ulysses: the micro batch as padding-free rows (one sample a unit), each row
        split over the group, TRL's fused head on this rank's shard, the log-probs and entropies ``[B, C]``
        gathered with gradient (every rank of the group returns the same)."""
        c = logits_to_keep
        completion_len = prefix_lengths(attention_mask[:, -c:])
        if completion_len is None:
            raise ValueError(f"sequence_parallel_size={self._sp.size}: a completion mask with holes cannot be laid "
                             "out as padding-free rows; use sequence_parallel_size=1.")
        prompts, completions = unpad(input_ids[:, :-c], attention_mask[:, :-c], input_ids[:, -c:], completion_len)
        config = self.accelerator.unwrap_model(model).config
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        with self.accelerator.autocast():
            queries = query_dtype(weights, input_ids.device.type)
        dtype = rows_mask_dtype(config, weights, queries, input_ids.device.type)  # None: varlen attention
        pk = pack_rows(prompts, completions, self._tokenizer.pad_token_id, mask_dtype=dtype,
                       pad_to_multiple_of=sp_multiple(self.pad_to_multiple_of, self._sp.size), completion_width=c)
        with self.accelerator.autocast():
            logps, entropy = sharded_policy_logps(model, pk, self._sp)
        return logps, entropy, None

    # ------------------------------------------------------------------ the update
    def training_step(self, model, inputs, num_items_in_batch):
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if getattr(self, "_sp", None) is not None:  # the backward's loss was scaled (sp_loss_scale): logged unscaled
            loss = loss / sp_loss_scale(self._sp.size)
        self._after_policy_step(self._trained_batch())
        self.step_clock.update_s += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:
            # training_step includes _prepare_inputs, hence the rollout when one ran: the clock keeps only the update
            metrics = self.step_clock.step_done(self._other_update_seconds(), self.layout.optimizer_steps_per_rollout)
            for name, value in metrics.items():
                self._metric("train", name, value)
        return loss

    def _trained_batch(self):
        """The micro step's batch the policy just trained on: what ``_prepare_inputs`` handed TRL's
        ``training_step`` (a TRL batch dict, or a :class:`BudgetedStep` of micro batches under a token budget);
        TRL's ``training_step`` has counted the step already."""
        return self._buffered_inputs[(self._step - 1) % self.args.steps_per_generation]

    def _after_policy_step(self, batch) -> None:
        """The update's hook for other models trained on the same micro step (PPO: the critic), after the policy's
        forward and backward and before the optimizer step; ``self.accelerator.sync_gradients`` says whether this
        micro step ends an accumulation. Nothing for GRPO."""

    def _other_update_seconds(self) -> float:
        """Seconds of this optimizer step's training_step spent on other models (PPO: the critic), which
        ``timing_s/update_actor`` leaves out; read once per optimizer step."""
        return 0.0

    def _policy_logps(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
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
        if getattr(self, "_sp", None) is not None:
            if mm is not None:
                raise ValueError(f"sequence_parallel_size={self._sp.size} with image prompts: a vision-language "
                                 "model's rows are not sharded yet; use sequence_parallel_size=1.")
            return self._sp_forward(model, input_ids, attention_mask, logits_to_keep)
        if mm is None and self._padfree_allowed(model, aux_loss=self.aux_loss_enabled):
            rows = self._padfree_forward(model, input_ids, attention_mask, logits_to_keep)
            if rows is not None:
                return rows
        if self._packing_allowed(model, images=mm is not None, aux_loss=self.aux_loss_enabled):
            packed = self._packed_forward(model, input_ids, attention_mask, logits_to_keep)
            if packed is not None:
                return packed
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
        if mm is None:
            extra["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        else:  # prompts are left-padded: each starts where its padding ends
            width = input_ids.shape[1] - logits_to_keep
            starts = (width - attention_mask[:, :width].sum(-1)).tolist()
            extra.update(collate(mm, input_ids.device, width=input_ids.shape[1], starts=starts))
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                        **extra)
        aux = out.aux_loss if self.aux_loss_enabled else None
        return out.log_probs[:, -logits_to_keep:], out.entropy[:, -logits_to_keep:], aux

    def _packed_forward(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
                        ) -> tuple[Tensor, Tensor, None] | None:
        """``shared_prompt_forward`` on a model that takes it (:meth:`_packing_allowed`): log-probs and entropies
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
                self._packing_notice(reason)
            return None
        pk = pack_shared_prompts(prompt_ids, attention_mask[:, :-logits_to_keep], completion_ids,
                                 self._tokenizer.pad_token_id, dtype=dtype, pad_to_multiple_of=self.pad_to_multiple_of)
        with self.accelerator.autocast():
            out = model(input_ids=pk.input_ids, attention_mask=pk.attention_mask, position_ids=pk.position_ids,
                        shift_labels=pk.shift_labels, fused_lm_head=True)
        return pk.gather(out.log_probs), pk.gather(out.entropy), None

    def _padfree_allowed(self, model, *, aux_loss: bool = False) -> bool:
        """Whether ``padding_free`` may lay ``model``'s forwards out as padding-free rows: not switched off, and the
        model takes a 4D block mask (the shared-prompt layout's rule; why not is said once)."""
        if self.args.padding_free is False:
            return False
        reason = structural_reason(self.accelerator.unwrap_model(model).config, aux_loss=aux_loss, varlen=True)
        if reason is not None and not getattr(self, "_padfree_notice_shown", False):
            self._padfree_notice_shown = True
            logger.log(logging.WARNING if self.args.padding_free else logging.INFO,
                       "padding_free%s is not used: %s; the padded forward runs.",
                       "=True" if self.args.padding_free else " (default)", reason)
        return reason is None

    def _rows_varlen(self, model) -> bool:
        """Whether ``model``'s padding-free rows run varlen attention (no mask: flash-attention, or SDPA on CUDA in
        half precision; :func:`~trl_nrollout.passes.padfree.rows_mask_dtype`)."""
        config = self.accelerator.unwrap_model(model).config
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        device = self.accelerator.device.type
        with self.accelerator.autocast():
            queries = query_dtype(weights, device)
        return rows_mask_dtype(config, weights, queries, device) is None

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
        pk = pack_rows(prompts, completions, self._tokenizer.pad_token_id, mask_dtype=dtype,
                       pad_to_multiple_of=self.pad_to_multiple_of, completion_width=c, units=units)
        if not getattr(self, "_padfree_said", False):
            self._padfree_said = True
            logger.info("padding_free: the update runs padding-free rows%s, %s (this micro batch: %d rows of %d "
                        "tokens instead of %d rows of %d).", " with each prompt once per group" if units else "",
                        "varlen attention" if dtype is None else "a block-diagonal mask",
                        pk.input_ids.shape[0], pk.input_ids.shape[1], input_ids.shape[0], input_ids.shape[1])
        with self.accelerator.autocast(), rows_attention(config, pk):
            out = model(input_ids=pk.input_ids, shift_labels=pk.shift_labels, fused_lm_head=True,
                        **pk.forward_kwargs())
        return pk.gather(out.log_probs), pk.gather(out.entropy), None

    def _packing_allowed(self, model, *, images: bool = False, aux_loss: bool = False) -> bool:
        """Whether ``shared_prompt_forward`` may pack ``model``'s forwards: not switched off, and the model takes
        the packed layout (:func:`~trl_nrollout.passes.packing.structural_reason`; why not is said once)."""
        if self.args.shared_prompt_forward is False:
            return False
        reason = structural_reason(self.accelerator.unwrap_model(model).config, images=images, aux_loss=aux_loss)
        if reason is not None:
            self._packing_notice(reason)
        return reason is None

    def _packing_notice(self, reason: str) -> None:
        """Say once why the shared-prompt layout is not used (a warning if the user asked for it explicitly)."""
        if self._packing_notice_shown:
            return
        self._packing_notice_shown = True
        explicit = self.args.shared_prompt_forward is True
        logger.log(logging.WARNING if explicit else logging.INFO,
                   "shared_prompt_forward%s is not used: %s; the plain forward runs.",
                   "=True" if explicit else " (default)", reason)

    def _entropy_bonus(self, entropies: Tensor, mask: Tensor, mode: str, micro_tokens: Tensor | None = None
                       ) -> Tensor:
        """TRL's entropy bonus, by TRL's rules (``entropy_coef``, ``use_adaptive_entropy``, ``entropy_target``...).

        The bonus is ``coef x`` the mean token entropy of the micro batch (scaled for gradient accumulation, like
        the policy loss). Adaptive: the coefficient of the previous optimizer step applies only while the measured
        entropy is at or below ``entropy_target``; at each optimizer step the window's entropy (all micro batches,
        all ranks, token-weighted) moves the coefficient up by ``entropy_coef_delta`` (entropy at or below the
        target) or down (above), within ``[entropy_coef_min, entropy_coef_max]``. The controller's state lives in
        TRL's attributes, so TRL's checkpoints save and restore it. Returns ``coef x mean entropy`` ``[]``.
        """
        args = self.args
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if micro_tokens is None:
            entropy_loss = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        else:  # re-cut under a token budget: each sample over the tokens of its count-based micro batch
            entropy_loss = ((entropies * mask).sum(-1) / micro_tokens.clamp(min=1.0)).sum() / accumulation
        adaptive = self.use_adaptive_entropy
        coef = self.entropy_coef if not adaptive or self._last_world_entropy <= args.entropy_target else 0.0
        if adaptive and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:  # the optimizer step: measure the window, move the coefficient
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                step = args.entropy_coef_delta if world_entropy <= args.entropy_target else -args.entropy_coef_delta
                self.entropy_coef = min(max(self.entropy_coef + step, args.entropy_coef_min), args.entropy_coef_max)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metric(mode, "entropy_coef", self.entropy_coef)
        return coef * entropy_loss

    def _entropy_threshold(self, entropies: Tensor, mask: Tensor, q: float) -> Tensor:
        """The ``q`` quantile of the response-token entropies of this micro step on all ranks (TRL's
        ``top_entropy_quantile``: the threshold of its high-entropy mask). ``entropies``, ``mask``: ``[B, T]``."""
        local = entropies.detach()[mask.bool()].float()
        sentinel = -1e9  # entropies are >= 0
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=sentinel)
        everything = self.accelerator.gather(padded)
        return entropy_quantile(everything[everything != sentinel], q).to(entropies.device)

    def _compute_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        logps, entropies, aux_loss = self._policy_logps(model, input_ids, attention_mask, logits_to_keep,
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
        if self.top_entropy_quantile < 1.0:
            threshold = self._entropy_threshold(entropies, mask, 1.0 - self.top_entropy_quantile)
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
        out = policy_loss(logps, old, adv, mask, clip_ratio_low=self.epsilon_low,
                          clip_ratio_high=self.epsilon_high, clip_ratio_c=args.clip_ratio_c,
                          ratio_level=self.importance_sampling_level, loss_agg_mode=args.loss_agg_mode,
                          loss_mode=args.policy_loss_mode, delta=args.delta,
                          sapo_temperature_pos=args.sapo_temperature_pos,
                          sapo_temperature_neg=args.sapo_temperature_neg, vespo_weight=vespo, token_mask=token_mask,
                          token_weights=weights, **agg)
        loss = out.loss
        if self.beta != 0.0:
            kl = kl_penalty(logps, inputs["ref_per_token_logps"], args.kl_loss_type)
            if args.use_bias_correction_kl:  # TRL's option: the KL of tokens sampled from the old policy, reweighted
                kl = kl * torch.exp(logps - old)
            kl_loss = agg_loss(kl, mask, args.loss_agg_mode, **agg)
            loss = loss + self.beta * kl_loss
            stats["actor/kl_loss"] = (kl.detach() * mask).sum() / n_tok
        if args.loss_agg_mode == "token-mean-micro":  # TRL's bnpo: this micro batch's mean, over the accumulation
            loss = loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)
        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropies, mask if entropy_mask is None else mask * entropy_mask, mode,
                                              micro_tokens)
        if aux_loss is not None:  # TRL's MoE router loss, router_aux_loss_coef (default: the model's own coefficient)
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            if micro_tokens is not None:  # this micro batch's share of its count-based micro batches' tokens
                accumulation = accumulation / (mask.sum(-1) / micro_tokens.clamp(min=1)).sum().clamp(min=1e-8)
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            stats["aux_loss"] = aux_loss.detach()
        ratio = torch.exp((logps - old).detach())
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
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
                f"the loss is {values['loss']} at step {self.state.global_step} (pg_loss={values['actor/pg_loss']}); "
                "check the rewards and the learning rate, or lower clip_ratio_c."
            )
        for name, value in values.items():
            if name != "loss":
                self._metric(mode, name, value)
        for trl_name, name in _TRL_METRIC_NAMES.items():  # TRL's names beside verl's (same values)
            if name in values:
                self._metric(mode, trl_name, values[name])
        if getattr(self, "_sp", None) is not None and mode == "train":
            # each rank's gradient is its share of its group's; the data-parallel mean divides by all S x D ranks
            loss = loss * sp_loss_scale(self._sp.size)
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
