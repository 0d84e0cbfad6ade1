"""The log-prob stage of ``NRolloutGRPOTrainer``'s rollout step: the old-policy and reference passes over the
step's samples (micro-batched or token-budgeted, padding-free where it pays), and the rollout's own log-probs where
they stand in. A part: :meth:`LogProbStage.run` takes the step's ``Assignment`` and ``StepContext`` (and the policy
and reference models, which the trainer wraps only once training starts) and returns its ``LogProbs``."""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import Tensor

from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.passes.logprobs import SupportFn, compute_log_probs
from trl_nrollout.passes.ulysses import SPGroup
from trl_nrollout.plan.layout import MicroBatch, RolloutLayout
from trl_nrollout.trainer.forward_rules import ForwardRules
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.stages import Assignment, LogProbs, StepContext

logger = logging.getLogger(__name__)


class LogProbStage:
    """The old-policy and reference log-prob passes of a rollout step (see the module docstring). ``layout``: the
    rollout's layout (its ``old_log_prob`` / ``ref_log_prob`` micro batches); ``support``: the sampler's cut to
    replay (:func:`~trl_nrollout.trainer.forward_rules.sampling_support`; None: nothing cut); ``temperature``,
    ``beta``, ``pad_to_multiple_of``: TRL's; ``sp``: the Ulysses group (or None)."""

    def __init__(self, args: NRolloutConfig, accelerator: Any, layout: RolloutLayout, rules: ForwardRules,
                 metrics: Metrics, *, pad_token_id: int, temperature: float, beta: float,
                 pad_to_multiple_of: int | None, support: SupportFn | None, sp: SPGroup | None) -> None:
        self.args, self.accelerator, self.layout, self.rules, self.metrics = args, accelerator, layout, rules, metrics
        self.pad_token_id, self.temperature, self.beta = pad_token_id, temperature, beta
        self.pad_to_multiple_of, self.support, self.sp = pad_to_multiple_of, support, sp

    def run(self, assigned: Assignment, ctx: StepContext, model, ref_model) -> LogProbs:
        """The old-policy and reference log-prob passes over this rank's samples (micro-batched, token-budgeted as
        the layout says) with the policy ``model`` and the reference ``ref_model`` (None: PEFT's base model); the
        old-policy pass is skipped on-policy (one optimizer step per rollout) unless the KL is in the reward."""
        args = self.args
        on_policy = (self.layout.optimizer_steps_per_rollout == 1 and args.skip_old_log_prob_when_on_policy
                     and ctx.mode == "train")
        old = ref = mass = None
        support = self.support  # a truncating sampler: the pass also gives the mass it keeps
        t = time.perf_counter()
        # the KL in the reward and the teacher term need the student's own log-probs even on-policy
        if not on_policy or args.use_kl_in_reward or support is not None or args.teacher_model_name_or_path:
            old = self.log_probs(model, assigned.prompt_ids, assigned.completion_ids, self.layout.old_log_prob,
                                 assigned.mm, support=support)
            if support is not None:
                old, mass = old
        self.metrics.add(ctx.mode, "timing_s/old_log_prob", time.perf_counter() - t)
        t = time.perf_counter()
        if self.beta != 0.0 or args.use_kl_in_reward:
            ref = self.ref_log_probs(model, ref_model, assigned.prompt_ids, assigned.completion_ids, assigned.mm)
        self.metrics.add(ctx.mode, "timing_s/ref", time.perf_counter() - t)
        return LogProbs(old, ref, on_policy, mass)

    def log_probs(self, model, prompt_ids, completion_ids, micro: MicroBatch, mm=None, support=None
                  ) -> Tensor | tuple[Tensor, Tensor]:
        """One log-prob pass of ``model`` ``[B, C]``, cut into forwards as the layout's ``micro`` says (``mm``: a
        VLM's image tensors per sample); with ``support`` (:func:`~trl_nrollout.trainer.forward_rules.
        sampling_support`) also the log of the mass the sampler keeps at each token ``[B, C]``."""
        shared = self.rules.packing_allowed(model, images=mm is not None and any(mm))
        # under the trainer's autocast, as the update's forward (accelerate wraps only the top-level forward, which
        # the lean pass does not call): with bf16=True over float32 weights both run in bf16, so the first step's
        # ratio is exactly 1 and a KL against the policy's own weights is 0; the head as TRL's fused head runs it
        with self.accelerator.autocast():
            # under a token budget the count is a cap only where the user set one (verl: the budget replaces it)
            per_device = None if micro.max_token_len is not None and micro.source.startswith("default") else \
                micro.per_device
            out = compute_log_probs(model, prompt_ids, completion_ids, temperature=self.temperature,
                                    pad_token_id=self.pad_token_id, micro_batch_size=per_device,
                                    max_token_len=micro.max_token_len, mm_inputs=mm, shared_prompts=shared,
                                    head_fp32=bool(self.args.cast_lm_head_to_fp32),
                                    pad_to_multiple_of=self.pad_to_multiple_of, support=support,
                                    padding_free=mm is None and self.rules.padfree_allowed(model),
                                    sequence_parallel=self.sp)
        return out.logprobs if support is None else (out.logprobs, out.support_log_mass)

    def ref_log_probs(self, model, ref_model, prompt_ids, completion_ids, mm=None) -> Tensor:
        """The reference pass ``[B, C]``: ``ref_model``'s, or without one (PEFT) the policy ``model``'s base model
        (its adapter off)."""
        micro = self.layout.ref_log_prob
        if ref_model is not None:
            return self.log_probs(ref_model, prompt_ids, completion_ids, micro, mm)
        inner = self.accelerator.unwrap_model(model)  # PEFT: the base model is the reference
        with inner.disable_adapter():
            return self.log_probs(model, prompt_ids, completion_ids, micro, mm)


def build_reference(model, accelerator: Any, deepspeed: bool):
    """A reference model for the KL in the reward where TRL built none (``beta=0``): ``model``'s checkpoint loaded
    again in its dtype, prepared for evaluation (under DeepSpeed as TRL prepares its own reference)."""
    from trl.models import prepare_deepspeed
    from trl.trainer.utils import create_model_from_path, get_config_model_id

    ref = create_model_from_path(get_config_model_id(model.config), dtype=model.dtype)
    if deepspeed:
        return prepare_deepspeed(ref, accelerator)
    return accelerator.prepare_model(ref, evaluation_mode=True)
