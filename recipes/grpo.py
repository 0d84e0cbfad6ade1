"""GRPO (or PPO) training from a YAML recipe: ``accelerate launch recipes/grpo.py [--config RECIPE] [--key value ...]``.

``RECIPE`` is a local YAML file or a Hub reference (``hf://user/repo/config.yaml``; downloaded once, cached, and
read from the cache under ``HF_HUB_OFFLINE=1``). With no arguments it trains the embedded default
(``recipes/configs/default.yaml``): the built-in tiny Qwen2 model on the built-in ``digits`` task. Every option of
``NRolloutConfig`` (TRL's ``GRPOConfig`` plus verl's rollout vocabulary) can be set in the recipe or on the
command line (``--output_dir runs/x --max_steps 20``). At the end a summary is printed and written as
``<output_dir>/run_summary.json``.

``--trainer ppo`` (or ``trainer: ppo`` in the recipe, as ``recipes/configs/ppo.yaml``) trains PPO with a critic
(``NRolloutPPOTrainer``; its options are ``NRolloutPPOConfig``'s: ``gamma``, ``lam``, ``cliprange_value``,
``critic_*``). One recipe script serves both: they share the data, rewards, summary, report and Hub recipes, and
differ only in the trainer class.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from trl_nrollout.builtin import resolve_model
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.data import load_prompts
from trl_nrollout.hub import parse_hub_ref, resolve_config
from trl_nrollout.recipe_trust import enforce_recipe_trust, split_trust_flags
from trl_nrollout.report import write_report
from trl_nrollout.rewards import resolve_reward
from trl_nrollout.rollout.platform import launch_nodes
from trl_nrollout.summary import RewardHistory, build_summary, write_summary
from trl_nrollout.trainer import NRolloutGRPOTrainer

DEFAULT_RECIPE = Path(__file__).resolve().parent / "configs" / "default.yaml"
#: Recipe keys that describe the launch, not the training (read by tools, ignored here).
LAUNCH_KEYS = ("accelerate_config", "num_processes", "n_gpus_per_node", "nnodes")
#: ``--trainer`` / the recipe's ``trainer``: which trainer and config class train.
TRAINERS = ("grpo", "ppo")


def _trainer_classes(kind: str):
    if kind not in TRAINERS:
        raise SystemExit(f"--trainer {kind!r}: use one of {list(TRAINERS)} (grpo: group advantages, no critic; "
                         "ppo: a critic and GAE).")
    if kind == "ppo":
        from trl_nrollout.ppo import NRolloutPPOConfig, NRolloutPPOTrainer

        return NRolloutPPOTrainer, NRolloutPPOConfig
    return NRolloutGRPOTrainer, NRolloutConfig


def _pop_trainer(argv: list[str]) -> tuple[list[str], str | None]:
    """Take ``--trainer X`` (or ``--trainer=X``) off the command line."""
    for i, arg in enumerate(argv):
        if arg == "--trainer" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if arg.startswith("--trainer="):
            return argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
    return argv, None


@dataclass
class ScriptArguments:
    """What to train on, beside the trainer's own options."""

    model_name_or_path: str = field(
        default="builtin:tiny-qwen2",
        metadata={"help": "A hub id, a local folder, or a built-in model such as 'builtin:tiny-qwen2'."},
    )
    dataset_name: str = field(default="builtin:digits", metadata={
        "help": "'builtin:digits', a hub dataset id, a local json/jsonl/csv/parquet file or a dataset folder."})
    dataset_config: str | None = field(default=None, metadata={
        "help": "Configuration (subset) of a hub dataset or a dataset folder, e.g. 'main' for openai/gsm8k."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompts."})
    dataset_system_prompt: str | None = field(default=None, metadata={
        "help": "When set, each text prompt becomes a chat: this system message, then the prompt as the user's "
                "(the model's chat template applies)."})
    dataset_num_prompts: int = field(default=512, metadata={"help": "Prompts generated for 'builtin:digits'."})
    reward_funcs: list[str] = field(default_factory=lambda: ["digits"], metadata={
        "help": "Reward functions: built-ins (digits, format, length, exact_answer, math_answer) or "
                "'package.module:function' paths. Weights: reward_weights."})
    # LoRA, with TRL's ModelConfig names (`trl grpo --use_peft ...`)
    use_peft: bool = field(default=False, metadata={
        "help": "Train LoRA adapters instead of the whole model (needs `peft`). The engines receive the merged "
                "weights; a KL loss or KL in the reward uses the base model (adapters off) as the reference; "
                "the output folder holds the adapter."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (with use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (with use_peft)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout (with use_peft)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Modules given adapters, e.g. q_proj v_proj, or all-linear (with use_peft; default: PEFT's "
                "choice for the architecture)."})

    def peft_config(self):
        """The ``LoraConfig`` that ``use_peft`` asks for (TRL's ``get_peft_config``), or None; ``lora_*`` options
        set without ``use_peft`` are an error (they would do nothing)."""
        lora = {f.name: f.default for f in fields(self) if f.name.startswith("lora_")}  # name -> default
        if not self.use_peft:
            stray = [f"{k}={getattr(self, k)!r}" for k, v in lora.items() if getattr(self, k) != v]
            if stray:
                raise SystemExit(f"{', '.join(stray)} set without use_peft: add --use_peft true (LoRA), or remove "
                                 "them.")
            return None
        from trl import ModelConfig
        from trl.trainer.utils import get_peft_config

        return get_peft_config(ModelConfig(model_name_or_path=self.model_name_or_path, use_peft=True,
                                           **{k: getattr(self, k) for k in lora}))


def _resolve_recipe(argv: list[str]) -> tuple[list[str], str]:
    """Put the default recipe in when none is given; turn a Hub reference into a cached local file; drop the
    launch-only keys the argument parser does not know.

    A recipe from the Hub is data, not code: it may not enable ``trust_remote_code`` nor import reward modules
    unless this command line says ``--trust-remote-code`` / ``--allow-reward-module M`` (see
    :mod:`trl_nrollout.recipe_trust`); it is refused before anything beyond the recipe is downloaded."""
    argv, trust_remote_code, allowed_modules = split_trust_flags(argv)
    argv, trainer = _pop_trainer(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            value = argv[i + 1] if arg == "--config" else arg.split("=", 1)[1]
            rest = argv[i + 2:] if arg == "--config" else argv[i + 1:]
            before = argv[:i]
            break
    else:
        value, before, rest = str(DEFAULT_RECIPE), [], argv
    path = resolve_config(value)
    data = yaml.safe_load(path.read_text()) or {}
    if parse_hub_ref(value) is not None:
        enforce_recipe_trust(data, value, trust_remote_code=trust_remote_code, allow_reward_modules=allowed_modules)
    trainer = trainer or data.get("trainer") or "grpo"  # the command line wins over the recipe
    if any(k in data for k in (*LAUNCH_KEYS, "trainer")):
        data = {k: v for k, v in data.items() if k not in (*LAUNCH_KEYS, "trainer")}
        tmp = Path(tempfile.mkdtemp(prefix="trl_nrollout_recipe_")) / path.name
        tmp.write_text(yaml.safe_dump(data))
        path = tmp
    return [*before, "--config", str(path), *rest], trainer


def main(argv: list[str] | None = None) -> dict:
    argv, kind = _resolve_recipe(list(sys.argv[1:] if argv is None else argv))
    trainer_cls, config_cls = _trainer_classes(kind)
    from trl import TrlParser  # after trl_nrollout, whose import filters TRL's known import-time warnings

    parser = TrlParser((ScriptArguments, config_cls))
    script_args, training_args = parser.parse_args_and_config(argv)
    peft_config = script_args.peft_config()

    dataset = load_prompts(script_args.dataset_name, split=script_args.dataset_split,
                           prompt_column=script_args.dataset_prompt_column,
                           num_builtin=script_args.dataset_num_prompts, seed=training_args.seed,
                           config=script_args.dataset_config, system_prompt=script_args.dataset_system_prompt)
    history = RewardHistory()
    trainer = trainer_cls(
        model=resolve_model(script_args.model_name_or_path),
        reward_funcs=[resolve_reward(r) for r in script_args.reward_funcs],
        args=training_args,
        train_dataset=dataset,
        callbacks=[history],
        peft_config=peft_config,
    )
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(training_args.output_dir)
    summary = build_summary(
        steps=trainer.state.global_step,
        rewards=history.rewards,
        gen_tokens_per_s=trainer.generation_clock.tokens_per_s,
        rollout_backend=trainer.rollout_backend,
        checkpoint=str(Path(training_args.output_dir).resolve()),
        wall_s=time.perf_counter() - start,
        extra={"gen_tokens_per_s_with_warmup": round(trainer.generation_clock.tokens_per_s_with_warmup, 1),
               "processes": trainer.accelerator.num_processes,
               "nnodes": launch_nodes(trainer.accelerator.num_processes),
               "engine_ranks": [list(r) for r in trainer.layout.engine_ranks],
               "train_batch_size": training_args.train_batch_size,
               "rollout_n": training_args.rollout_n, "adv_estimator": training_args.adv_estimator,
               "trainer": kind, "lora_r": script_args.lora_r if peft_config is not None else None},
    )
    if trainer.accelerator.is_main_process:
        out = Path(training_args.output_dir)
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        report = write_report(trainer.state.log_history, out / "report.png",
                              title=f"{script_args.model_name_or_path} on {script_args.dataset_name}")
        summary["report"] = str(report.resolve()) if report else "(pip install matplotlib for report.png)"
        write_summary(summary, training_args.output_dir)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    trainer.close()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a clean exit: no rank left with live gloo threads
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
