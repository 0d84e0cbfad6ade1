"""The recipe's distillation route: a recipe with ``trainer: distill`` (or ``--trainer distill``) trains
:class:`~trl_nrollout.trainer.distillation.NRolloutDistillationTrainer` (TRL's ``DistillationTrainer``, the student
sampled on our engines) with the options of :class:`~trl_nrollout.config.distillation.NRolloutDistillationConfig`
(TRL's ``DistillationConfig`` fields and our engine options), e.g. the shipped ``recipes/configs/distill_digits.yaml``::

    trl-nrollout train --config distill_digits [--max_steps 2 ...]

:mod:`trl_nrollout.recipe.run` parses the recipe and the command line (the same parser, checks and one-line errors
as for GRPO) and hands the parsed options here; this module imports nothing of ``run`` (the launch's callbacks come
in as arguments). The recipe's reward options have no use in distillation (the teacher is the signal): set away from
their defaults they are an error naming them."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from trl_nrollout.builtin import resolve_model
from trl_nrollout.errors import InputError
from trl_nrollout.recipe.data import check_prompt_lengths, load_prompts
from trl_nrollout.recipe.report import write_report
from trl_nrollout.recipe.summary import write_summary

#: The recipe script's options that only a reward-trained run reads: (name, its default)
REWARD_ONLY = (("reward_funcs", ["digits"]), ("agent", None))


def check_distill_script_args(script_args: Any) -> None:
    """Refuse the recipe's reward options (``reward_funcs``, ``agent``) set away from their defaults: distillation
    trains on the teacher's distributions, so they would do nothing."""
    for name, default in REWARD_ONLY:
        value = getattr(script_args, name)
        if value != default:
            raise InputError(f"{name}={value!r} with trainer: distill: on-policy distillation trains the student "
                             "toward the teacher (teacher_model_name_or_path), no reward is computed. Remove "
                             f"{name}, or train GRPO with a teacher term (trainer: grpo, teacher_model_name_or_path "
                             "and teacher_kl_coef) to mix rewards and the teacher.")


def _teacher_of(args: Any) -> str:
    """The teacher the recipe names (``teacher_model_name_or_path``), built-in names resolved; an error without one."""
    if not args.teacher_model_name_or_path:
        raise InputError("trainer: distill needs a teacher: set teacher_model_name_or_path (a hub id, a local folder "
                         "or a built-in name such as builtin:tiny-qwen2-longtail) in the recipe or on the command "
                         "line (--teacher_model_name_or_path ...).")
    return resolve_model(args.teacher_model_name_or_path)


def _series(history: list[dict], key: str) -> list[float]:
    return [float(h[key]) for h in history if isinstance(h.get(key), int | float) and math.isfinite(h[key])]


def distill_summary(history: list[dict], *, steps: int, rollout_backend: str, checkpoint: str, wall_s: float,
                    extra: dict | None = None) -> dict:
    """The run summary of a distillation run: ``steps``, ``loss_start`` / ``loss_end`` (the first and last logged
    training losses: TRL's generalized JSD), ``gen_tokens_per_s`` (the mean of the logged engine throughput; 0 where
    TRL's generate sampled), ``rollout_backend``, ``checkpoint``, ``wall_s`` and ``extra``."""
    losses, speed = _series(history, "loss"), _series(history, "perf/gen_tokens_per_s")
    out = {"steps": int(steps), "loss_start": round(losses[0], 5) if losses else None,
           "loss_end": round(losses[-1], 5) if losses else None,
           "gen_tokens_per_s": round(sum(speed) / len(speed), 1) if speed else 0.0,
           "rollout_backend": rollout_backend, "checkpoint": checkpoint, "wall_s": round(wall_s, 1)}
    out.update(extra or {})
    return out


def train_distillation(script_args: Any, args: Any, *, peft_config: Any, resume: str | None, callbacks: list,
                       built: list) -> dict:
    """Train the distillation recipe: the dataset, the student and the teacher the recipe names, ``args`` an
    :class:`~trl_nrollout.config.distillation.NRolloutDistillationConfig`. ``built`` gets the trainer once it
    exists (the caller closes it on an error). Returns the summary (written as ``run_summary.json``, with
    ``log_history.json``, by the main process)."""
    from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

    check_distill_script_args(script_args)
    teacher = _teacher_of(args)  # before the data and the student: a missing teacher is the first thing to say
    dataset = load_prompts(script_args.dataset_name, split=script_args.dataset_split,
                           prompt_column=script_args.dataset_prompt_column, num_builtin=script_args.dataset_num_prompts,
                           seed=args.seed, config=script_args.dataset_config,
                           system_prompt=script_args.dataset_system_prompt)
    if script_args.max_prompt_length is not None:
        check_prompt_lengths(dataset["prompt"], resolve_model(script_args.model_name_or_path),
                             script_args.max_prompt_length, source=f"dataset_name={script_args.dataset_name!r}")
    trainer = NRolloutDistillationTrainer(resolve_model(script_args.model_name_or_path), teacher_model=teacher,
                                          args=args, train_dataset=dataset, callbacks=callbacks,
                                          peft_config=peft_config)
    built.append(trainer)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output_dir)
    history = trainer.state.log_history
    summary = distill_summary(
        history, steps=trainer.state.global_step, rollout_backend=trainer.rollout_backend,
        checkpoint=str(Path(args.output_dir).resolve()), wall_s=time.perf_counter() - start,
        extra={"trainer": "distill", "teacher": args.teacher_model_name_or_path, "beta": args.beta,
               "processes": trainer.accelerator.num_processes, "resumed_from": resume,
               "lora_r": script_args.lora_r if peft_config is not None else None})
    if trainer.accelerator.is_main_process:
        (Path(args.output_dir) / "log_history.json").write_text(json.dumps(history))
        report = write_report(history, Path(args.output_dir) / "report.png",
                              title=f"{script_args.model_name_or_path} taught by {args.teacher_model_name_or_path}")
        summary["report"] = str(report.resolve()) if report else "(pip install matplotlib for report.png)"
        write_summary(summary, args.output_dir)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    trainer.close()
    return summary
