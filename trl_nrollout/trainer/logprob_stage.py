"""The log-prob stage of ``NRolloutGRPOTrainer``'s rollout step: the old-policy and reference passes over the
step's samples (micro-batched or token-budgeted, padding-free where it pays), and the rollout's own log-probs where
they stand in. A mixin: ``_log_prob_passes`` takes the step's ``Assignment`` and returns its ``LogProbs``."""

from __future__ import annotations

import logging
import time

from torch import Tensor

from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.plan.layout import MicroBatch
from trl_nrollout.trainer.stages import Assignment, LogProbs, StepContext

logger = logging.getLogger(__name__)


class LogProbStage:
    """The old-policy and reference log-prob passes of a rollout step (see the module docstring)."""

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
                                    padding_free=mm is None and self._padfree_allowed(model),
                                    sequence_parallel=getattr(self, "_sp", None))
        return out.logprobs if support is None else (out.logprobs, out.support_log_mass)

    def _ref_log_probs(self, prompt_ids, completion_ids, mm=None) -> Tensor:
        micro = self.layout.ref_log_prob
        if self.ref_model is not None:
            return self._log_probs(self.ref_model, prompt_ids, completion_ids, micro, mm)
        inner = self.accelerator.unwrap_model(self.model)  # PEFT: the base model is the reference
        with inner.disable_adapter():
            return self._log_probs(self.model, prompt_ids, completion_ids, micro, mm)
