"""GRPO (PPO, on-policy distillation) training from a YAML recipe, the code behind every way of launching one::

    trl-nrollout train [--config RECIPE] [--key value ...]                 # one process
    accelerate launch [--config_file A] -m trl_nrollout.recipe.run [--config RECIPE] [--key value ...]
    accelerate launch recipes/grpo.py [--config RECIPE] [--key value ...]   # from a clone (a wrapper of this)

``RECIPE`` is a local YAML file, the name of a recipe shipped with the package (``default``, ``gsm8k_qwen``,
``verl_article``...: the files of ``recipes/configs/``, installed with the package, see :func:`packaged_recipe`)
or a Hub reference (``hf://user/repo/config.yaml``; downloaded once, cached, and read from the cache under
``HF_HUB_OFFLINE=1``). With no ``--config`` it trains the embedded default (``default``): the built-in tiny Qwen2
model on the built-in ``digits`` task. Every option of ``NRolloutConfig`` (TRL's ``GRPOConfig`` plus verl's
rollout vocabulary) can be set in the recipe or on the command line (``--output_dir runs/x --max_steps 20``). At
the end a summary is printed and written as ``<output_dir>/run_summary.json``.

``--trainer ppo`` (or ``trainer: ppo`` in the recipe, as ``recipes/configs/ppo.yaml``) trains PPO with a critic
(``NRolloutPPOTrainer``; its options are ``NRolloutPPOConfig``'s: ``gamma``, ``lam``, ``cliprange_value``,
``critic_*``). One recipe script serves both: they share the data, rewards, summary, report and Hub recipes, and
differ only in the trainer class.

``--trainer distill`` (or ``trainer: distill``, as ``recipes/configs/distill_digits.yaml``) trains on-policy
distillation (``NRolloutDistillationTrainer``, TRL's ``DistillationTrainer`` with the student sampled on our engines;
its options are ``NRolloutDistillationConfig``'s: ``teacher_model_name_or_path``, ``beta``, ...; no rewards): the
same parsing and one-line errors, then :mod:`trl_nrollout.recipe.distill` trains.

What transformers leaves to scripts, this one does: ``--resume_from_checkpoint PATH`` (or ``true``: the last
complete and readable checkpoint in ``output_dir``; a damaged one is skipped with a warning; ``auto``: that one if
any, else afresh) resumes, and a run that ``accelerate launch --max_restarts N`` restarted (a process died) resumes
as under ``auto`` when the option is unset; ``--push_to_hub true`` pushes the trained model at the end (its
save, then a push naming the dataset in the model card), as TRL's scripts do; ``do_eval`` / ``do_predict`` are refused (the recipe loads no evaluation set). SIGTERM (a scheduler's
preemption) finishes the step, saves a checkpoint and ends the run; resume it with ``--resume_from_checkpoint
true``. A mistake in the options, the recipe or the data (a ``reward_funcs`` entry that does not import included) is one
message on stderr (no traceback) and exit status 2, before a model is loaded wherever the check needs no model.
"""

from __future__ import annotations

import difflib
import json
import logging
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml
from transformers import TrainerCallback

from trl_nrollout.builtin import resolve_model
from trl_nrollout.config.checks import agent_dependencies_refusal, lora_sync_refusal
from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.errors import InputError
from trl_nrollout.plan.recipe_file import read_recipe
from trl_nrollout.recipe.data import check_prompt_lengths, load_prompts
from trl_nrollout.recipe.hub import parse_hub_ref, resolve_config
from trl_nrollout.recipe.report import end_progress_bars, write_report
from trl_nrollout.recipe.rewards import resolve_import, resolve_reward
from trl_nrollout.recipe.summary import RewardHistory, build_summary, write_summary
from trl_nrollout.recipe.trust import enforce_recipe_trust, parse_recipe_command
from trl_nrollout.rollout.engines.platform import launch_nodes
from trl_nrollout.trainer.checkpoints import check_output_dir, elastic_restarts, resolve_resume
from trl_nrollout.trainer.scoring import RewardFunctionError

logger = logging.getLogger(__name__)

#: The recipes shipped with the package (``recipes/`` of the repository, reached through the package's
#: ``trl_nrollout/recipes`` link and installed as package data): ``configs/*.yaml`` and ``accelerate/*.yaml``.
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "configs" / "default.yaml"
#: Recipe keys that describe the launch, not the training (read by tools, ignored here).
LAUNCH_KEYS = ("accelerate_config", "num_processes", "n_gpus_per_node", "nnodes")
#: ``--trainer`` / the recipe's ``trainer``: which trainer and config class train.
TRAINERS = ("grpo", "ppo", "distill")
#: The recipe's defaults of options whose TRL default does not suit it (a recipe or the command line sets them):
#: ``disable_dropout`` (TRL: false): the engines sample without dropout, so the trainer's log-probs must be taken
#: without it too, or they disagree with the engines' for the same tokens.
RECIPE_DEFAULTS = {"disable_dropout": True}
#: What ``--help`` says the listed options are, per trainer.
HELP_CONFIGS = {"grpo": "NRolloutConfig's (TRL's GRPOConfig and verl's rollout vocabulary)",
                "ppo": "NRolloutPPOConfig's (TRL's GRPOConfig, verl's rollout vocabulary and the critic's)",
                "distill": "NRolloutDistillationConfig's (TRL's DistillationConfig and our engine options; the "
                           "recipe's reward options do not apply)"}
#: The words asking for the options list.
HELP_FLAGS = ("-h", "--help")


def _config_class(kind: str):
    """The config class of ``--trainer kind`` (imports no trainer: options are checked before the heavy imports)."""
    if kind not in TRAINERS:
        raise InputError(f"--trainer {kind!r}: use one of {list(TRAINERS)} (grpo: group advantages, no critic; "
                         "ppo: a critic and GAE; distill: on-policy distillation from a teacher).")
    if kind == "distill":
        from trl_nrollout.config.distillation import NRolloutDistillationConfig

        return NRolloutDistillationConfig
    if kind == "ppo":
        from trl_nrollout.trainer.ppo import NRolloutPPOConfig

        return NRolloutPPOConfig
    return NRolloutConfig


def _trainer_class(kind: str):
    if kind == "ppo":
        from trl_nrollout.trainer.ppo import NRolloutPPOTrainer

        return NRolloutPPOTrainer
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    return NRolloutGRPOTrainer


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
        "help": "Reward functions: built-ins (digits, short_answer, format, length, exact_answer, math_answer) or "
                "'package.module:function' paths. Weights: reward_weights."})
    agent: str | None = field(default=None, metadata={
        "help": "An agent 'package.module:function' (sync or async, given an OpenAI client and the dataset row; "
                "docs/agents.md) trained through the trainer's OpenAI-compatible endpoint; its returned number is "
                "the reward unless reward_funcs names others (the default digits reward is then not used). Needs "
                "the agents extra: pip install \"trl-nrollout[agents]\" (openai, fastapi, uvicorn)."})
    # LoRA, with TRL's ModelConfig names (`trl grpo --use_peft ...`)
    use_peft: bool = field(default=False, metadata={
        "help": "Train LoRA adapters instead of the whole model (needs `peft`). The engines receive the merged "
                "weights; a KL loss or KL in the reward uses the base model (adapters off) as the reference; "
                "the output folder holds the adapter."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank, an integer >= 1 (with use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha, > 0; the adapters' scale is lora_alpha / "
                                                          "lora_r (with use_peft)."})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA dropout, in [0, 1) (with use_peft). 0 by default: the engines sample without dropout, so "
                "dropout in training makes the trainer's log-probs disagree with theirs (the recipe also defaults "
                "disable_dropout to true)."})
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Longest prompt in tokens (after the chat template), the length `trl-nrollout plan` prices: a longer "
                "prompt in the dataset is an error naming its rows, before the model loads (TRL 1.16 does not "
                "truncate prompts). None: no check."})
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
                raise InputError(f"{', '.join(stray)} set without use_peft: add --use_peft true (LoRA), or remove "
                                 "them.")
            return None
        for name, ok, rule in (
                ("lora_r", isinstance(self.lora_r, int) and self.lora_r >= 1, "an integer >= 1 (the adapters' rank)"),
                ("lora_alpha", self.lora_alpha > 0, "a number > 0 (the adapters' scale is lora_alpha / lora_r)"),
                ("lora_dropout", 0 <= self.lora_dropout < 1, "in [0, 1) (0: no dropout, the default)")):
            if not ok:  # checked here: PEFT's own check is a traceback after the model loaded
                raise InputError(f"{name}={getattr(self, name)!r}: LoRA's {name} must be {rule}; set --{name} "
                                 f"{lora[name]} (the default) or another such value, or drop --use_peft to train "
                                 "the whole model.")
        from trl import ModelConfig
        from trl.trainer.utils import get_peft_config

        return get_peft_config(ModelConfig(model_name_or_path=self.model_name_or_path, use_peft=True,
                                           **{k: getattr(self, k) for k in lora}))


def packaged_recipe(value: str) -> str:
    """``value`` as a recipe path: a file that exists, or an ``hf://`` reference, as is; else the name of a
    packaged recipe (``gsm8k_qwen`` or ``gsm8k_qwen.yaml``) as its installed file. Anything else is returned
    unchanged (the recipe reader then names the missing file)."""
    if parse_hub_ref(value) is not None or Path(value).expanduser().is_file():
        return value
    name = value if value.endswith((".yaml", ".yml")) else f"{value}.yaml"
    packaged = RECIPES_DIR / "configs" / name
    if "/" not in value and packaged.is_file():
        return str(packaged)
    if "/" not in value:
        shipped = sorted(p.stem for p in (RECIPES_DIR / "configs").glob("*.yaml"))
        raise InputError(f"--config {value!r}: no such file, nor a recipe shipped with trl-nrollout ({shipped}).")
    return value


def _resolve_recipe(argv: list[str]) -> tuple[list[str], str]:
    """The command line for TRL's parser and the trainer kind: the recipe script's own options taken off in one
    parse (:func:`~trl_nrollout.recipe.trust.parse_recipe_command`), the default recipe put in when none is given, a
    Hub reference turned into a cached local file, and the keys TRL's parser does not know (the launch's, the
    trainer's) dropped.

    A recipe from the Hub is data, not code: it may not enable ``trust_remote_code`` nor import reward modules
    unless this command line says ``--trust-remote-code`` / ``--allow-reward-module M`` (see
    :mod:`trl_nrollout.recipe.trust`); it is refused before anything beyond the recipe is downloaded."""
    command = parse_recipe_command(argv)
    value = packaged_recipe(command.config or "default")
    path = resolve_config(value)
    data = read_recipe(path)
    if parse_hub_ref(value) is not None:
        enforce_recipe_trust(data, value, trust_remote_code=command.trust_remote_code,
                             allow_reward_modules=list(command.allow_reward_modules))
    trainer = command.trainer or data.get("trainer") or "grpo"  # the command line wins over the recipe
    if any(k in data for k in (*LAUNCH_KEYS, "trainer")):
        data = {k: v for k, v in data.items() if k not in (*LAUNCH_KEYS, "trainer")}
        tmp = Path(tempfile.mkdtemp(prefix="trl_nrollout_recipe_")) / path.name
        tmp.write_text(yaml.safe_dump(data))
        path = tmp
    return ["--config", str(path), *command.rest], trainer


class SaveAndStopOnSignal(TrainerCallback):
    """SIGTERM (a scheduler's preemption, ``kill``): finish the current step, save a checkpoint and stop, on every
    rank alike (the ranks agree at each step's end, so none is left in a collective the others skipped)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.stopped_at: int | None = None
        self._previous = None

    def _receive(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name

    def on_train_begin(self, args, state, control, **kwargs):
        # here, not earlier: the engines are built, and nothing they install replaces this handler
        self._previous = signal.signal(signal.SIGTERM, self._receive)

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def on_step_end(self, args, state, control, **kwargs):
        import torch
        import torch.distributed as dist

        stop = self.signal is not None
        if dist.is_available() and dist.is_initialized():
            from accelerate import PartialState

            flag = torch.tensor([int(stop)], device=PartialState().device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            self.signal = self.signal or "SIGTERM"  # another rank received it
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control


def _parse(argv: list[str], config_cls) -> tuple[ScriptArguments, NRolloutConfig]:
    """TRL's parser over the recipe and the command line; an unknown key (in either) is an error naming the closest
    valid option, found before any option is validated."""
    from trl import TrlParser  # after trl_nrollout, whose import filters TRL's known import-time warnings

    parser = TrlParser((ScriptArguments, config_cls))
    parser.set_defaults(**RECIPE_DEFAULTS)  # below the recipe's values and the command line's
    known = sorted({s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"help"})
    recipe = read_recipe(argv[argv.index("--config") + 1]) if "--config" in argv else None
    line = [t[2:].split("=", 1)[0] for i, t in enumerate(argv)
            if t.startswith("--") and t != "--config" and (i == 0 or argv[i - 1] != "--config")]
    for where, keys, prefix_ok in (("the recipe", [k for k in (recipe or {}) if k != "env"], False),
                                   ("the command line", line, True)):  # argparse takes unique prefixes
        for key in keys:
            if key in known or (prefix_ok and sum(k.startswith(key) for k in known) == 1):
                continue
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
            raise InputError(f"{where} sets {key!r}, which is not an option of the {config_cls.__name__} recipe"
                             + (f": did you mean {close[0]!r}?" if close else "; `trl-nrollout train --help` "
                                "lists them."))
    return parser.parse_args_and_config(argv)


def _check_script_fields(args: NRolloutConfig) -> None:
    """TrainingArguments fields that transformers leaves to scripts and this one does not act on: refused."""
    for name in ("do_eval", "do_predict"):
        if getattr(args, name):
            why = (f" (eval_strategy={args.eval_strategy.value!r} turns it on)" if name == "do_eval"
                   and str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" else "")
            raise InputError(f"{name}=True{why}: this recipe loads no evaluation set, so it would do nothing. Remove "
                             f"it (and eval_strategy), or evaluate in your own script with the trainer's "
                             "eval_dataset (NRolloutGRPOTrainer(..., eval_dataset=...)).")


def main(argv: list[str] | None = None) -> dict:
    """Train as the recipe and the command line say; return the run summary. Every check that needs no model runs
    before the model loads (options, resume, output folder, data). Whether it returns or raises, it leaves nothing
    running in the process: the trainer's engines closed, the process group parsing the options started destroyed
    (a caller that runs the recipe in its own process, as the tests do, then starts its next run afresh)."""
    built: list = []  # the trainer, once built
    try:
        return _train(argv, built)
    except BaseException:
        end_progress_bars()  # the error's message on a line of its own, not after the bar's
        if built:
            try:
                built[0].close()
            except Exception as err:  # noqa: BLE001 - the run's own error is the one to raise
                logger.warning("closing the trainer after the run's error failed too: %s", err)
        _release_distributed()
        raise


def _release_distributed() -> None:
    """Destroy the default process group and accelerate's state (a clean exit: no live gloo threads; a next run in
    this process starts afresh)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)


def _train(argv: list[str] | None, built: list) -> dict:
    """:func:`main`'s run; ``built`` gets the trainer once it exists."""
    argv, kind = _resolve_recipe(list(sys.argv[1:] if argv is None else argv))
    config_cls = _config_class(kind)
    script_args, training_args = _parse(argv, config_cls)
    peft_config = script_args.peft_config()
    _check_script_fields(training_args)
    if (why := lora_sync_refusal(training_args, peft=peft_config is not None, how="--use_peft true")) is not None:
        raise InputError(why)  # before the model loads (the trainer would say it after)
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir, elastic_restarts())
    check_output_dir(training_args.output_dir)
    if kind == "distill":  # NRolloutDistillationTrainer (recipe/distill.py): no rewards, a teacher
        from trl_nrollout.recipe.distill import train_distillation

        summary = train_distillation(script_args, training_args, peft_config=peft_config, resume=resume,
                                     callbacks=[SaveAndStopOnSignal()], built=built)
        _release_distributed()
        return summary
    # every name the recipe imports (reward_funcs 'module:function'), before the data and the model: a reference
    # that does not resolve is an InputError (the one-line error, exit 2), not a traceback after the model loads
    if script_args.agent and (why := agent_dependencies_refusal("--agent")) is not None:  # before its imports
        raise InputError(why)
    agent = resolve_import(script_args.agent, "agent") if script_args.agent else None
    embedded = read_recipe(DEFAULT_RECIPE)  # its rewards (digits and short_answer, weighed) are defaults too
    defaults = (next(f.default_factory() for f in fields(script_args) if f.name == "reward_funcs"),
                embedded.get("reward_funcs"))
    replaced = agent is not None and script_args.reward_funcs in defaults  # the agent's reward is the run's
    names = [] if replaced else script_args.reward_funcs
    weights = training_args.reward_weights
    if weights is not None and weights == embedded.get("reward_weights") and len(weights) != len(names or [agent]):
        training_args.reward_weights = None  # the embedded default's, for its two rewards: not for other ones
    reward_funcs = [resolve_reward(r) for r in names]

    dataset = load_prompts(script_args.dataset_name, split=script_args.dataset_split,
                           prompt_column=script_args.dataset_prompt_column,
                           num_builtin=script_args.dataset_num_prompts, seed=training_args.seed,
                           config=script_args.dataset_config, system_prompt=script_args.dataset_system_prompt)
    if script_args.max_prompt_length is not None:
        check_prompt_lengths(dataset["prompt"], resolve_model(script_args.model_name_or_path),
                             script_args.max_prompt_length, source=f"dataset_name={script_args.dataset_name!r}")
    history = RewardHistory()
    stopper = SaveAndStopOnSignal()
    trainer = _trainer_class(kind)(
        model=resolve_model(script_args.model_name_or_path),
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        callbacks=[history, stopper],
        peft_config=peft_config,
        **({"agent": agent} if agent is not None else {}),
    )
    built.append(trainer)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    if getattr(trainer, "is_rollout_rank", False):  # rollout_ranks: this process generated for the trainers
        trainer.close()
        return {"rollout_rank": True, **trainer.stats}
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
               "trainer": kind, "lora_r": script_args.lora_r if peft_config is not None else None,
               "sequence_parallel_size": getattr(getattr(trainer, "_sp", None), "size", 1),  # the groups that ran
               "resumed_from": resume, "restarts": elastic_restarts(), "steps_trained": trainer.state.global_step - history.start_step,
               "stopped_by": stopper.signal, "unscored_steps": history.unscored_steps,
               **trainer.truncated_steps.summary()},
    )
    if trainer.accelerator.is_main_process:
        out = Path(training_args.output_dir)
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        report = write_report(trainer.state.log_history, out / "report.png",
                              title=f"{script_args.model_name_or_path} on {script_args.dataset_name}")
        summary["report"] = str(report.resolve()) if report else "(pip install matplotlib for report.png)"
        write_summary(summary, training_args.output_dir)
        if stopper.signal:
            print(f"{stopper.signal} received: stopped after step {stopper.stopped_at} with a checkpoint; resume with "
                  f"--resume_from_checkpoint true --output_dir {training_args.output_dir}")
    if training_args.push_to_hub:  # as TRL's scripts: the trained model, with its model card
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    trainer.close()
    _release_distributed()
    return summary


def wants_help(argv: list[str]) -> bool:
    """Whether the command line asks for the options list (``-h`` / ``--help`` anywhere, as argparse reads them)."""
    return any(word in HELP_FLAGS for word in argv)


def _help_trainer(argv: list[str]) -> str:
    """The trainer whose options ``--help`` lists: ``--trainer`` on the command line, else a local recipe's
    ``trainer`` key, else GRPO (a recipe that cannot be read is left to the run to report)."""
    try:
        command = parse_recipe_command([w for w in argv if w not in HELP_FLAGS])
        if command.trainer:
            return command.trainer if command.trainer in TRAINERS else "grpo"
        if command.config and parse_hub_ref(command.config) is None:
            kind = read_recipe(packaged_recipe(command.config)).get("trainer", "grpo")
            return kind if kind in TRAINERS else "grpo"
    except Exception:  # noqa: BLE001 - --help lists the options whatever else the command line holds
        pass
    return "grpo"


def recipe_help(argv: list[str], prog: str, launch: dict[str, str] | None = None) -> str:
    """What ``--help`` prints: every option of the recipe (TRL's parser over :class:`ScriptArguments` and the
    trainer's config class, the recipe's defaults shown), then the recipe script's own options and, for
    ``trl-nrollout train``, ``launch``: the ``accelerate launch`` flags it takes (flag -> help)."""
    from argparse import SUPPRESS

    from trl import TrlParser

    from trl_nrollout.recipe.trust import ALLOW_FLAG, TRUST_FLAG

    kind = _help_trainer(argv)
    shipped = ", ".join(sorted(p.stem for p in (RECIPES_DIR / "configs").glob("*.yaml")))
    parser = TrlParser(
        (ScriptArguments, _config_class(kind)), prog=prog, conflict_handler="resolve",
        usage="%(prog)s " + ("[--accelerate_config NAME --num_processes N ...] " if launch else "")
              + "[--config RECIPE] [--trainer grpo|ppo|distill] [--OPTION VALUE ...]",
        description=f"Train {kind.upper()} from a recipe: every option below can be set in the recipe (a YAML file: "
                    "option: value) or on the command line (--option value, which wins). Without --config the "
                    f"embedded default trains (the built-in tiny model on the built-in digits task). The options "
                    f"listed are {HELP_CONFIGS[kind]} and the recipe's own (model, data, rewards, LoRA); "
                    + "; ".join(f"--trainer {k} --help lists {k.upper()}'s" for k in TRAINERS if k != kind) + ".",
        epilog="Shipped recipes (--config NAME): " + shipped + ". Every option, with its verl name where it "
               "has one: docs/configuration.md.")
    parser.set_defaults(**RECIPE_DEFAULTS)
    own = parser.add_argument_group("the recipe script's own options")
    own.add_argument("--config", metavar="RECIPE", default=SUPPRESS,
                     help=f"The recipe: a YAML file, a shipped recipe's name ({shipped}) or hf://user/repo/file.yaml "
                          "(downloaded once, cached). Default: default (the embedded default).")
    own.add_argument("--trainer", choices=TRAINERS, default=SUPPRESS,
                     help="grpo (group advantages, no critic), ppo (a critic and GAE) or distill (on-policy "
                          "distillation: the student toward teacher_model_name_or_path, TRL's DistillationTrainer "
                          "with our engines; no rewards). Default: the recipe's trainer key, else grpo.")
    own.add_argument(TRUST_FLAG, action="store_true", default=SUPPRESS,
                     help="Let a Hub recipe's trust_remote_code settings apply (a local recipe's always do).")
    own.add_argument(ALLOW_FLAG, metavar="MODULE", action="append", default=SUPPRESS,
                     help="Let a Hub recipe import reward functions from MODULE (repeatable, or comma-separated).")
    if launch:
        group = parser.add_argument_group("launch under accelerate (without these: one process)")
        for flag, text in launch.items():
            group.add_argument(flag, metavar="VALUE", default=SUPPRESS, help=text)
    return parser.format_help()


def _prog() -> str:
    """How this process was started, for the usage line: ``python -m trl_nrollout.recipe.run`` or the script's
    name (``grpo.py``)."""
    script = Path(sys.argv[0] if sys.argv and sys.argv[0] else "grpo.py")
    return "python -m trl_nrollout.recipe.run" if script.parts[-3:] == ("trl_nrollout", "recipe", "run.py") \
        else script.name


#: Errors that are the user's to fix (options, recipe, data, a reward function): a message, not a traceback.
USER_ERRORS = (InputError, RewardFunctionError)


def cli(argv: list[str] | None = None, prog: str | None = None) -> int:
    """:func:`main` as a command: ``-h`` / ``--help`` prints the options list (:func:`recipe_help`; ``prog``
    names the command in it, default: how this process was started) and trains nothing; a user's mistake is
    printed as one message on stderr and gives exit status 2; a bug keeps its traceback."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        if os.environ.get("RANK", "0") == "0":  # once per launch
            print(recipe_help(argv, prog or _prog()))
        return 0
    try:
        main(argv)
    except USER_ERRORS as err:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") or os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
