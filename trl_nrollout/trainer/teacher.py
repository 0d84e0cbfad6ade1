"""The teacher term of on-policy distillation inside RL (``teacher_model_name_or_path``, ``teacher_kl_coef``), a
part of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer` (and PPO): :class:`TeacherTerm`.

After the log-prob passes, the teacher scores this rank's sampled tokens with the reference pass's machinery (the
same micro batches or token budget, padding-free rows where they pay, sharded as the reference is), and each token's
advantage loses ``teacher_kl_coef * (student - teacher)`` log-prob (:func:`~trl_nrollout.algos.distill.
teacher_advantages`). The student's log-probs are the old-policy pass's (it runs whenever a teacher is set), so a
stale sample of partial rollouts or rollout ranks is scored by the policy that trains on it and corrected by the
decoupled loss as its rewards are. Logged: ``distill/reverse_kl`` (the masked mean of ``student - teacher``) and
``timing_s/teacher``.

With ``teacher_backend="vllm"`` the teacher is not loaded in the trainer processes: a vLLM engine of its own
(:func:`start_teacher_engine`, the rollout's layout, beside the rollout engine) scores the sampled tokens with
``prompt_logprobs`` (the ``SCORES`` capability of :mod:`~trl_nrollout.rollout.engines.protocol`). vLLM scores given
tokens from the raw logits, whatever the request's temperature; at a sampling temperature ``T`` other than 1 the
engine serves a copy of the teacher whose output head is divided by ``T`` (:func:`scaled_head_teacher`: logits
``W h / T``, so its raw log-probs are the teacher's at ``T``)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from trl_nrollout.algos.distill import masked_mean, reverse_kl_estimate, teacher_advantages
from trl_nrollout.builtin import resolve_model
from trl_nrollout.errors import InputError
from trl_nrollout.rollout.engines.protocol import SCORES, RolloutEngine, has
from trl_nrollout.trainer.logprob_stage import LogProbStage
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.stages import Assignment, LogProbs, StepContext, fit_width


class TeacherTerm:
    """The teacher model (prepared for evaluation) or the engine that serves it (``engine``: one with ``SCORES``),
    and the term's coefficient; :meth:`apply` adds the term to one rank's TRL batch."""

    def __init__(self, model, coef: float, passes: LogProbStage, metrics: Metrics,
                 engine: RolloutEngine | None = None) -> None:
        if (model is None) == (engine is None):
            raise ValueError("a teacher term needs its teacher model or its engine (one of them)")
        if engine is not None and not has(engine, SCORES):
            raise ValueError(f"the teacher's engine ({type(engine).__name__}) cannot score given tokens (SCORES)")
        self.model, self.coef, self.passes, self.metrics, self.engine = model, coef, passes, metrics, engine

    @staticmethod
    def load(args, student, accelerator: Any, deepspeed: bool):
        """The teacher of ``args.teacher_model_name_or_path`` (None without one): loaded in the student's dtype,
        refused when its vocabulary differs from the student's, and prepared as TRL prepares a reference (loaded
        before the update's token budget, which counts its weights)."""
        if args.teacher_model_name_or_path is None or args.teacher_backend == "vllm":
            return None  # (teacher_backend='vllm': its engine, :func:`start_teacher_engine`, holds the weights)
        from trl.models import prepare_deepspeed
        from trl.trainer.utils import create_model_from_path

        teacher = create_model_from_path(resolve_model(args.teacher_model_name_or_path), dtype=student.dtype)
        check_vocabulary(args.teacher_model_name_or_path, teacher.config, student.config)
        teacher.eval()
        return (prepare_deepspeed(teacher, accelerator) if deepspeed
                else accelerator.prepare_model(teacher, evaluation_mode=True))

    @classmethod
    def build(cls, args, teacher, passes: LogProbStage, metrics: Metrics, engine: RolloutEngine | None = None
              ) -> TeacherTerm | None:
        """The term over the ``teacher`` :meth:`load` gave or the ``engine`` :func:`start_teacher_engine` started
        (None without either), with ``args.teacher_kl_coef``."""
        if teacher is None and engine is None:
            return None
        return cls(teacher, float(args.teacher_kl_coef), passes, metrics, engine=engine)

    def teacher_log_probs(self, assigned: Assignment) -> torch.Tensor:
        """The teacher's log-probs of this rank's sampled tokens ``[B, C]`` (0 past each completion's end): the
        reference pass's machinery over the teacher model, or its engine's ``prompt_logprobs``."""
        if self.engine is None:
            return self.passes.log_probs(self.model, assigned.prompt_ids, assigned.completion_ids,
                                         self.passes.layout.ref_log_prob, assigned.mm)
        if assigned.mm is not None and any(assigned.mm):  # (refused at the start: teacher_engine_refusal)
            raise InputError(teacher_engine_refusal("vllm", is_vlm=True) or "image samples")
        rows = self.engine.score_completions(assigned.prompt_ids, assigned.completion_ids)
        self.engine.sleep()  # its memory back to the trainer until the next step (vLLM's sleep mode; CPU: no-op)
        out = torch.zeros(len(rows), max((len(r) for r in rows), default=0))
        for i, row in enumerate(rows):
            out[i, :len(row)] = torch.tensor(row)
        return out

    def close(self) -> None:
        """Release the teacher's engine (if any)."""
        if self.engine is not None:
            self.engine.close()

    def apply(self, batch: dict[str, Any], assigned: Assignment, logps: LogProbs, ctx: StepContext
              ) -> dict[str, Any]:
        """``batch`` (TRL's, this rank's ``[B, C]`` tensors) with the teacher's log-probs of the sampled tokens as
        ``teacher_per_token_logps`` and each sampled token's advantage less ``coef * (student - teacher)``
        (tool-output tokens, padding and masked truncated completions keep theirs)."""
        t = time.perf_counter()
        width = batch["completion_ids"].shape[1]
        device = batch["advantages"].device
        teacher = fit_width(self.teacher_log_probs(assigned), width).to(device)
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


def teacher_engine_refusal(teacher_backend: str, *, is_vlm: bool) -> str | None:
    """Why ``teacher_backend`` cannot score this run's samples, said when the trainer is built, before any engine
    starts (None: it can). ``'vllm'`` scores text: a vision-language policy's samples can carry images (its
    dataset's, a tool's, an environment's), whose placeholder tokens the teacher's engine would need expanded and
    its image features computed as the policy's processor did; not built."""
    if teacher_backend != "vllm" or not is_vlm:
        return None
    return ("teacher_backend='vllm' with a vision-language policy (processing_class is a processor): its samples can "
            "carry images, and the teacher's engine scores text samples only (prompt_logprobs over token ids; the "
            "images' placeholder tokens and features are not handed to it). Use teacher_backend='trainer' (the "
            "teacher in the trainer processes scores image samples), or a text policy.")


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


def scaled_head_teacher(path: str, temperature: float, out: str, *, trust_remote_code: bool = False) -> str:
    """A copy of the teacher at ``path`` whose output head (weight and bias) is divided by ``temperature``, saved in
    ``out/temperature_<T>`` (kept where it is there already; the copy's folder is returned): its raw logits are the
    teacher's divided by ``T``, so an engine scoring from raw logits gives the teacher's log-probs at ``T``. A tied
    head is untied first (dividing the shared matrix would divide the embeddings too). Refused for a teacher whose
    logits are not a plain head over its decoder (soft-capping, a logit scale: ``T`` does not pass through them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_nrollout.passes.logprobs import plain_output_head

    folder = os.path.join(out, f"temperature_{temperature:g}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", trust_remote_code=trust_remote_code)
    head = plain_output_head(model)
    if head is None or not hasattr(head, "weight"):
        raise InputError(f"teacher_backend='vllm' with temperature={temperature}: the engine scores from raw logits, "
                         "so it serves the teacher with its output head divided by the temperature, but this "
                         "teacher's logits are not a plain head over its decoder (soft-capping or a logit scale), "
                         "which the temperature does not pass through. Set temperature=1.0, or "
                         "teacher_backend='trainer'.")
    with torch.no_grad():
        head.weight = torch.nn.Parameter(head.weight.detach() / temperature)  # a tensor of its own: untied
        if getattr(head, "bias", None) is not None:
            head.bias = torch.nn.Parameter(head.bias.detach() / temperature)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    os.makedirs(out, exist_ok=True)
    staging = f"{folder}.writing-{os.getpid()}"
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).save_pretrained(staging)
    try:
        os.replace(staging, folder)  # whole or absent: a later run reuses it
    except OSError:  # another node's process wrote it first (a shared file system): keep theirs
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise
    return folder


def start_teacher_engine(trainer) -> RolloutEngine | None:
    """The teacher's vLLM engine of ``teacher_backend="vllm"`` on this rank (None otherwise): the rollout's layout
    (``rollout_tp_size``), the rollout engine's lengths and memory options, sleep mode where vLLM has it, built
    beside the rollout engine (not replacing it); the teacher's vocabulary checked against the policy's first."""
    args = trainer.args
    if args.teacher_model_name_or_path is None or args.teacher_backend != "vllm":
        return None
    from transformers import AutoConfig

    from trl_nrollout.rollout.engines.build import VLLMEngineSettings, build_engine
    from trl_nrollout.rollout.engines.platform import vllm_available

    if not vllm_available():
        raise InputError("teacher_backend='vllm' serves the teacher on a vLLM engine, but vLLM is not installed: "
                         "install it, or set teacher_backend='trainer'.")
    path = resolve_model(args.teacher_model_name_or_path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=bool(args.trust_remote_code))
    student = trainer.accelerator.unwrap_model(trainer.model)
    check_vocabulary(args.teacher_model_name_or_path, config.get_text_config(), student.config)
    if args.temperature != 1.0:  # one copy per node, its local main process writes it first
        with trainer.accelerator.local_main_process_first():
            path = scaled_head_teacher(path, args.temperature, os.path.join(args.output_dir, "teacher_engine"),
                                       trust_remote_code=bool(args.trust_remote_code))
    max_len, expected = trainer.engine_setup.vllm_lengths()
    context = getattr(config.get_text_config(), "max_position_embeddings", None) or max_len
    acc = trainer.accelerator
    return build_engine(VLLMEngineSettings(
        path, trainer.layout, rank=acc.process_index, local_rank=acc.local_process_index, dtype=args.rollout_dtype,
        max_model_len=min(max_len, context), expected_len=min(expected, context),
        kv_cache_memory_bytes=args.rollout_kv_cache_memory_bytes,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization, enforce_eager=args.rollout_enforce_eager,
        enable_prefix_caching=args.rollout_enable_prefix_caching, enable_sleep_mode=args.vllm_enable_sleep_mode,
        seed=args.seed, trust_remote_code=bool(args.trust_remote_code), exclusive=False))
