"""The teacher term of on-policy distillation inside RL (``teacher_model_name_or_path``, ``teacher_kl_coef``), a
part of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer` (and PPO): :class:`TeacherTerm`.

After the log-prob passes, the teacher scores this rank's sampled tokens with the reference pass's machinery (the
same micro batches or token budget, padding-free rows where they pay, sharded as the reference is), and each token's
advantage loses ``teacher_kl_coef * (student - teacher)`` log-prob (:func:`~trl_nrollout.algos.distill.
teacher_advantages`). The student's log-probs are the old-policy pass's (it runs whenever a teacher is set), so a
stale sample of partial rollouts or rollout ranks is scored by the policy that trains on it and corrected by the
decoupled loss as its rewards are. Logged: ``distill/reverse_kl`` (the masked mean of ``student - teacher``) and
``timing_s/teacher``."""

from __future__ import annotations

import time
from typing import Any

from trl_nrollout.algos.distill import masked_mean, reverse_kl_estimate, teacher_advantages
from trl_nrollout.builtin import resolve_model
from trl_nrollout.trainer.logprob_stage import LogProbStage
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.stages import Assignment, LogProbs, StepContext, fit_width


class TeacherTerm:
    """The teacher model (prepared for evaluation) and the term's coefficient; :meth:`apply` adds the term to one
    rank's TRL batch."""

    def __init__(self, model, coef: float, passes: LogProbStage, metrics: Metrics) -> None:
        self.model, self.coef, self.passes, self.metrics = model, coef, passes, metrics

    @staticmethod
    def load(args, student, accelerator: Any, deepspeed: bool):
        """The teacher of ``args.teacher_model_name_or_path`` (None without one): loaded in the student's dtype,
        refused when its vocabulary differs from the student's, and prepared as TRL prepares a reference (loaded
        before the update's token budget, which counts its weights)."""
        if args.teacher_model_name_or_path is None:
            return None
        from trl.models import prepare_deepspeed
        from trl.trainer.utils import create_model_from_path

        teacher = create_model_from_path(resolve_model(args.teacher_model_name_or_path), dtype=student.dtype)
        check_vocabulary(args.teacher_model_name_or_path, teacher.config, student.config)
        teacher.eval()
        return (prepare_deepspeed(teacher, accelerator) if deepspeed
                else accelerator.prepare_model(teacher, evaluation_mode=True))

    @classmethod
    def build(cls, args, teacher, passes: LogProbStage, metrics: Metrics) -> TeacherTerm | None:
        """The term over the ``teacher`` :meth:`load` gave (None without one), with ``args.teacher_kl_coef``."""
        return None if teacher is None else cls(teacher, float(args.teacher_kl_coef), passes, metrics)

    def apply(self, batch: dict[str, Any], assigned: Assignment, logps: LogProbs, ctx: StepContext
              ) -> dict[str, Any]:
        """``batch`` (TRL's, this rank's ``[B, C]`` tensors) with the teacher's log-probs of the sampled tokens as
        ``teacher_per_token_logps`` and each sampled token's advantage less ``coef * (student - teacher)``
        (tool-output tokens, padding and masked truncated completions keep theirs)."""
        t = time.perf_counter()
        width = batch["completion_ids"].shape[1]
        device = batch["advantages"].device
        teacher = self.passes.log_probs(self.model, assigned.prompt_ids, assigned.completion_ids,
                                        self.passes.layout.ref_log_prob, assigned.mm)
        teacher = fit_width(teacher, width).to(device)
        if logps.old is None:
            raise RuntimeError("the teacher term needs the old-policy pass; it was skipped")
        student = fit_width(logps.old, width).to(device)
        mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
        batch["advantages"] = teacher_advantages(batch["advantages"], student, teacher, mask, self.coef)
        batch["teacher_per_token_logps"] = teacher
        self.metrics.add(ctx.mode, "distill/reverse_kl", masked_mean(reverse_kl_estimate(student, teacher, mask),
                                                                     mask))
        self.metrics.add(ctx.mode, "timing_s/teacher", time.perf_counter() - t)
        return batch


def check_vocabulary(name: str, teacher_config, student_config) -> None:
    """Refuse a teacher whose vocabulary is not the student's: the term compares log-probs of the same token ids.
    (Cross-tokenizer distillation would need the sampled text re-tokenized for the teacher and its tokens aligned
    with the student's, as NeMo-RL's cross-tokenizer distillation does; not built.)"""
    t, s = getattr(teacher_config, "vocab_size", None), getattr(student_config, "vocab_size", None)
    if t != s:
        raise ValueError(
            f"teacher_model_name_or_path={name!r} has a vocabulary of {t} tokens, the policy {s}: the teacher term "
            "compares the two models' log-probs of the same sampled token ids, so both must share one tokenizer. "
            "Use a teacher of the policy's family (same tokenizer), or drop teacher_model_name_or_path.")
