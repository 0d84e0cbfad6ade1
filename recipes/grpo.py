"""GRPO training from a YAML recipe: ``accelerate launch recipes/grpo.py [--config recipe.yaml] [--key value ...]``.

With no arguments it trains the embedded default (``recipes/configs/default.yaml``): the built-in tiny Qwen2
model on the built-in ``digits`` task. Every training option of TRL's ``GRPOConfig`` can be set in the recipe or
overridden on the command line (``--output_dir runs/x --max_steps 20``). At the end a summary is printed and
written as ``<output_dir>/run_summary.json``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer, TrlParser

from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model
from trl_nrollout.summary import GenerationTimerMixin, RewardHistory, build_summary, write_summary

DEFAULT_RECIPE = Path(__file__).resolve().parent / "configs" / "default.yaml"


@dataclass
class ScriptArguments:
    """What to train on, beside the trainer's own options."""

    model_name_or_path: str = field(
        default="builtin:tiny-qwen2",
        metadata={"help": "A hub id, a local folder, or a built-in model such as 'builtin:tiny-qwen2'."},
    )
    dataset_name: str = field(
        default="builtin:digits", metadata={"help": "'builtin:digits' (the built-in task) or a hub id / path."}
    )
    dataset_num_prompts: int = field(default=512, metadata={"help": "Prompts generated for 'builtin:digits'."})


class TimedGRPOTrainer(GenerationTimerMixin, GRPOTrainer):
    """TRL's GRPOTrainer with its generation time measured (for the run summary)."""


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEFAULT_RECIPE), *argv]
    parser = TrlParser((ScriptArguments, GRPOConfig))
    script_args, training_args = parser.parse_args_and_config(argv)

    model_path = resolve_model(script_args.model_name_or_path)
    if script_args.dataset_name == "builtin:digits":
        dataset = digits_dataset(script_args.dataset_num_prompts, seed=training_args.seed)
    else:
        from datasets import load_dataset

        dataset = load_dataset(script_args.dataset_name, split="train")

    history = RewardHistory()
    trainer = TimedGRPOTrainer(
        model=model_path,
        reward_funcs=[digits_reward],
        args=training_args,
        train_dataset=dataset,
        callbacks=[history],
    )
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(training_args.output_dir)
    clock = getattr(trainer, "generation_clock", None)
    summary = build_summary(
        steps=trainer.state.global_step,
        rewards=history.rewards,
        gen_tokens_per_s=clock.tokens_per_s if clock else float("nan"),
        rollout_backend="hf",
        checkpoint=str(Path(training_args.output_dir).resolve()),
        wall_s=time.perf_counter() - start,
    )
    if trainer.accelerator.is_main_process:
        write_summary(summary, training_args.output_dir)
    return summary


if __name__ == "__main__":
    main()
