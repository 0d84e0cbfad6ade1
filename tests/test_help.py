"""The first hour of a user: ``--help`` / ``-h`` of every entry point lists the options; options that would do nothing
or crash later (``rollout_lora_sync`` without LoRA, ``--lora_r 0``, ``--agent`` without the ``agents`` extra) are
refused before the model loads; dropout that makes the trainer disagree with the engine is off in the recipe and
warned about in the drop-in class; an error during training starts a line of its own, not the progress bar's."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT
from trl_nrollout.errors import InputError

BIN = Path(sys.executable).parent
#: every command a user types that parses options: (command, options its help must list)
ENTRY_POINTS = {
    "trl-nrollout": ([str(BIN / "trl-nrollout")], ["plan", "recipe", "train"]),
    "trl-nrollout plan": ([str(BIN / "trl-nrollout"), "plan"], ["--rollout-n", "--train-batch-size", "--predict"]),
    "trl-nrollout recipe": ([str(BIN / "trl-nrollout"), "recipe"], ["push", "pull"]),
    "trl-nrollout recipe push": ([str(BIN / "trl-nrollout"), "recipe", "push"], ["--dry-run", "repo_id"]),
    "trl-nrollout recipe pull": ([str(BIN / "trl-nrollout"), "recipe", "pull"], ["--out", "ref"]),
    "trl-nrollout train": ([str(BIN / "trl-nrollout"), "train"],
                           ["--rollout_n", "--learning_rate", "--config", "--agent", "--accelerate_config"]),
    "recipes/grpo.py": ([sys.executable, "recipes/grpo.py"], ["--rollout_n", "--learning_rate", "--config"]),
    "-m trl_nrollout.recipe.run": ([sys.executable, "-m", "trl_nrollout.recipe.run"],
                                   ["--rollout_n", "--learning_rate", "--use_peft"]),
    # a TRL script with GRPOConfig swapped for NRolloutConfig, parsed by TRL's usual TrlParser
    "TrlParser((NRolloutConfig,))": ([sys.executable, "-c", "from trl import TrlParser; from trl_nrollout import "
                                      "NRolloutConfig; TrlParser((NRolloutConfig,)).parse_args_and_config()"],
                                     ["--rollout_n", "--learning_rate", "--rollout_lora_sync"]),
}


def _help(command: list[str], flag: str) -> tuple[str, subprocess.CompletedProcess]:
    proc = subprocess.run([*command, flag], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return flag, proc


def test_help_of_every_entry_point_lists_the_options():
    """``--help`` and ``-h`` of every command (run as a user types them) exit 0 and print the options list. Fails
    when a help string holds a bare ``%`` (argparse's ``TypeError: %o format``), or when an entry point's ``--help``
    reaches the recipe's unknown-option check ("sets 'help', which is not an option")."""
    runs = [(name, *pair) for name, pair in ENTRY_POINTS.items() for flag in ("--help", "-h")
            for pair in [(pair[0], flag)]]
    with ThreadPoolExecutor(max_workers=4) as pool:  # a few at a time: each one that imports TRL takes seconds
        results = list(pool.map(lambda r: (r[0], *_help(r[1], r[2])), runs))
    for name, flag, proc in results:
        out = proc.stdout
        assert proc.returncode == 0, f"{name} {flag}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert "usage:" in out, f"{name} {flag} printed no usage:\n{out[-2000:]}\n{proc.stderr[-2000:]}"
        for option in ENTRY_POINTS[name][1]:
            assert option in out, f"{name} {flag} does not list {option}:\n{out[-3000:]}"
    train = dict(((n, f), p) for n, f, p in results)[("trl-nrollout train", "--help")].stdout
    assert "usage: trl-nrollout train" in train and '"trl-nrollout[agents]"' in " ".join(train.split())


# ---------------------------------------------------------------------------------------------- in process
def test_every_option_help_survives_argparse_formatting():
    """Every field's help of the recipe's parsers (GRPO and PPO, TRL's options included) formats: argparse reads a
    help string as a %-format, so a bare % (the "6-7% of" that crashed every --help) raises here."""
    from trl import TrlParser

    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.recipe.run import ScriptArguments
    from trl_nrollout.trainer.ppo import NRolloutPPOConfig

    for config in (NRolloutConfig, NRolloutPPOConfig):
        parser = TrlParser((ScriptArguments, config))
        text = parser.format_help()
        assert "--rollout_n" in text and "--learning_rate" in text
        for action in parser._actions:  # and each one alone, so a failure names the option
            if action.help:
                parser._get_formatter()._expand_help(action)


def test_recipe_help_in_process(capsys):
    """The recipe's ``-h`` (the function every entry point calls): its options, the recipe script's own, the launch
    flags for ``train``, the recipe's defaults (disable_dropout true), PPO's options with ``--trainer ppo``; and
    nothing trains (exit 0)."""
    from trl_nrollout.cli import main
    from trl_nrollout.recipe.launch import LAUNCH_FLAGS
    from trl_nrollout.recipe.run import cli

    assert cli(["-h"], prog="grpo.py") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: grpo.py") and "--rollout_n" in out and "--trust-remote-code" in out
    assert re.search(r"--disable-dropout \[DISABLE_DROPOUT\] [^(]*\(default: True\)", " ".join(out.split()))
    assert "--accelerate_config" not in out
    assert main(["train", "--max_steps", "3", "-h"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in LAUNCH_FLAGS)
    assert cli(["--trainer", "ppo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--critic_learning_rate" in out and "Train PPO" in out
    assert cli(["--config", "ppo", "--help"]) == 0  # the shipped recipe's trainer: ppo
    assert "--critic_learning_rate" in capsys.readouterr().out
    # distillation: its config's options (TRL's DistillationConfig and our engine options), by --trainer or by the
    # shipped recipe's trainer key, and the reward options said not to apply
    for argv in (["--trainer", "distill", "-h"], ["--config", "distill_digits", "--help"]):
        assert main(["train", *argv]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "Train DISTILL" in out and "NRolloutDistillationConfig's" in out and "do not apply" in out
        for option in ("--beta", "--teacher_model_name_or_path", "--rollout_tp_size", "--temperature"):
            assert option in out, (argv, option)
        assert "--rollout_n" not in out and "--critic_learning_rate" not in out


# ---------------------------------------------------------------------------------------------- dropout
def _recipe_args(argv: list[str]):
    from trl_nrollout.recipe.run import _parse, _resolve_recipe

    argv, kind = _resolve_recipe(argv)
    from trl_nrollout.recipe.run import _config_class

    return _parse(argv, _config_class(kind))


def test_the_recipe_trains_without_dropout_by_default(tmp_path):
    """The recipe's defaults: disable_dropout true (TRL's is false) and lora_dropout 0, so the trainer's log-probs
    are the engine's distribution; a recipe or the command line still sets them."""
    script, args = _recipe_args(["--output_dir", str(tmp_path)])
    assert args.disable_dropout is True and script.lora_dropout == 0.0
    script, args = _recipe_args(["--output_dir", str(tmp_path), "--use_peft", "true"])
    assert script.peft_config().lora_dropout == 0.0
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\ndisable_dropout: false\n")
    assert _recipe_args(["--config", str(recipe)])[1].disable_dropout is False
    assert _recipe_args(["--output_dir", str(tmp_path), "--disable_dropout", "false"])[1].disable_dropout is False


def test_dropout_notice_names_the_active_dropout_and_the_fix(tiny_model_path):
    """The drop-in's warning reads the built policy: a LoRA adapter's lora_dropout and a config's attention_dropout
    are found (each with its fix); after TRL's disable_dropout (every nn.Dropout at p=0) nothing is left to say."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import disable_dropout_in_model

    from trl_nrollout.config.checks import dropout_notice

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert dropout_notice(model) is None  # the built-in model has no dropout
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.05))
    notice = dropout_notice(peft)
    assert "lora_dropout.default (p=0.05)" in notice and "disable_dropout=True" in notice
    disable_dropout_in_model(peft)
    assert dropout_notice(peft) is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attention_dropout=0.1)
    notice = dropout_notice(model)
    assert "attention_dropout=0.1" in notice and "disable_dropout does not reach it" in notice


def _trainer_kwargs(tmp_path, **config):
    from trl_nrollout.builtin import digits_dataset, digits_reward
    from trl_nrollout.config import NRolloutConfig

    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_completion_length=4,
                          max_steps=1, save_strategy="no", train_batch_size=2, rollout_n=2, **config)
    return dict(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args, train_dataset=digits_dataset(4))


def test_the_dropin_trainer_warns_once_about_dropout(tmp_path, caplog):
    """NRolloutGRPOTrainer keeps TRL's default (disable_dropout=False) but says, once at start, that a LoRA adapter
    with lora_dropout makes its log-probs disagree with the engine's; with disable_dropout=True it says nothing."""
    from peft import LoraConfig

    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.1)
    with caplog.at_level(logging.WARNING, logger="trl_nrollout"):
        trainer = NRolloutGRPOTrainer(**_trainer_kwargs(tmp_path, rollout_backend="hf"),
                                      peft_config=LoraConfig(**lora))
        trainer.close()
    said = [r.getMessage() for r in caplog.records if "trains with dropout" in r.getMessage()]
    assert len(said) == 1 and "lora_dropout" in said[0] and "disable_dropout=True" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_nrollout"):
        trainer = NRolloutGRPOTrainer(**_trainer_kwargs(tmp_path, rollout_backend="hf", disable_dropout=True),
                                      peft_config=LoraConfig(**lora))
        trainer.close()
    assert not [r for r in caplog.records if "trains with dropout" in r.getMessage()]


def test_the_dropin_trainer_refuses_rollout_lora_sync_without_an_adapter(tmp_path):
    """rollout_lora_sync='adapter' on a policy with no adapter would do nothing: an error naming the fix, raised
    before the engines start."""
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    with pytest.raises(InputError, match=r"rollout_lora_sync='adapter' says how a LoRA adapter.*no adapter.*"
                                         r"peft_config="):
        NRolloutGRPOTrainer(**_trainer_kwargs(tmp_path, rollout_backend="vllm", rollout_lora_sync="adapter"))


# ---------------------------------------------------------------------------------------------- agents extra
def test_agent_dependencies_are_the_agents_extra(monkeypatch):
    """The modules checked are the ``agents`` extra of pyproject.toml; one missing is an error naming it and the
    pip command (installed, nothing to say)."""
    from trl_nrollout.config.checks import AGENT_MODULES, agent_dependencies_refusal

    line = re.search(r"^agents = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # no tomllib on 3.10
    assert sorted(re.split(r"[<>=\[ ]", e.strip(' "'))[0] for e in line.split(",")) == sorted(AGENT_MODULES)
    assert agent_dependencies_refusal() is None
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now fails, as where it is not installed
    why = agent_dependencies_refusal("--agent")
    assert "uvicorn is not installed" in why and 'pip install "trl-nrollout[agents]"' in why and "--agent" in why


def test_agent_without_the_extra_fails_before_the_model_loads(monkeypatch, tmp_path, recipe):
    """``--agent`` without fastapi (the endpoint's server) installed: the recipe's one-line error naming the extra,
    before the data and the model load (not a ModuleNotFoundError at the first rollout); the drop-in trainer's
    ``agent=`` likewise, at its first line."""
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.setattr(recipe, "resolve_model", lambda name: pytest.fail("the model loaded"))
    monkeypatch.setattr(recipe, "load_prompts", lambda *a, **k: pytest.fail("the data loaded"))
    with pytest.raises(InputError, match=r'--agent trains.*fastapi is not installed.*trl-nrollout\[agents\]'):
        recipe.main(["--output_dir", str(tmp_path), "--agent", "tests.assets.agent_train:agent"])
    with pytest.raises(InputError, match=r'agent= trains.*fastapi is not installed.*trl-nrollout\[agents\]'):
        NRolloutGRPOTrainer(**_trainer_kwargs(tmp_path, rollout_backend="hf"), agent=lambda client, row: 1.0)


# ---------------------------------------------------------------------------------------------- mistyped options
@pytest.mark.parametrize("argv, match", [
    (["--rollout_lora_sync", "adapter"], r"rollout_lora_sync='adapter' says how a LoRA adapter reaches the engines.*"
                                         r"Train LoRA \(--use_peft true\), or remove it"),
    (["--rollout_lora_sync_device", "h100"], r"rollout_lora_sync_device='h100' says.*--use_peft true"),
    (["--use_peft", "true", "--lora_r", "0"], r"lora_r=0: LoRA's lora_r must be an integer >= 1.*--lora_r 16 \(the "
                                              r"default\).*drop --use_peft"),
    (["--use_peft", "true", "--lora_alpha", "0"], r"lora_alpha=0: .* must be a number > 0"),
    (["--use_peft", "true", "--lora_dropout", "1.5"], r"lora_dropout=1.5: .* must be in \[0, 1\)"),
])
def test_mistyped_lora_options_fail_before_the_model_loads(monkeypatch, tmp_path, recipe, argv, match):
    """An option that would do nothing (rollout_lora_sync without LoRA) or crash in PEFT after the model loaded
    (lora_r 0): the recipe's error naming the option, the value, the rule and the fix, before anything loads."""
    monkeypatch.setattr(recipe, "resolve_model", lambda name: pytest.fail("the model loaded"))
    monkeypatch.setattr(recipe, "load_prompts", lambda *a, **k: pytest.fail("the data loaded"))
    with pytest.raises(InputError, match=match):
        recipe.main(["--output_dir", str(tmp_path / "out"), *argv])


@pytest.mark.slow
def test_an_error_during_training_starts_its_own_line(tmp_path, recipe, capsys):
    """A reward function that raises at the first step: the progress bar's line is ended before the recipe's
    ``error:`` message, which starts a line (not ``0/2 [00:02<?, ?it/s]error: ...``)."""
    code = recipe.cli(["--output_dir", str(tmp_path), "--max_steps", "2", "--rollout_backend", "hf",
                       "--reward_funcs", "tests.assets.rewards_for_tests:raises_on_long"])
    err = capsys.readouterr().err
    assert code == 2 and "it/s]" in err, err[-2000:]  # the bar was drawn, and the run failed
    assert re.search(r"(^|\n)error: reward function 'raises_on_long' raised ZeroDivisionError", err), err[-2000:]
    assert not re.search(r"\]error:", err), err[-2000:]


# ---------------------------------------------------------------------------------------------- the embedded default
def test_short_answer_rewards_an_answer_that_ends():
    """``short_answer``: 1.0 for some text within 8 tokens (it ended: the default's max_completion_length is 16),
    0.0 for a completion cut at max_completion_length or an empty one; the embedded default weighs it with digits."""
    from trl_nrollout.builtin import SHORT_ANSWER_TOKENS, short_answer_reward
    from trl_nrollout.plan.recipe_file import read_recipe
    from trl_nrollout.recipe.run import DEFAULT_RECIPE

    assert short_answer_reward(["12", "1234567890123456", "", [{"role": "assistant", "content": "7"}]],
                               completion_ids=[[5, 6, 2], list(range(16)), [2], [9, 2]]) == [1.0, 0.0, 0.0, 1.0]
    assert short_answer_reward(["1"], completion_ids=[list(range(SHORT_ANSWER_TOKENS + 1))]) == [0.0]
    default = read_recipe(DEFAULT_RECIPE)
    assert default["reward_funcs"] == ["digits", "short_answer"] and default["reward_weights"] == [0.5, 0.5]
    assert default["max_completion_length"] > SHORT_ANSWER_TOKENS  # within it, an answer of 8 tokens ended


def test_the_default_rewards_weights_go_with_its_rewards(monkeypatch, tmp_path, recipe):
    """The embedded default weighs its two rewards 0.5 each; a command line naming other reward functions (or an
    agent, whose reward replaces them) trains without those weights instead of failing on their count."""
    seen: dict = {}

    def stop_at_the_trainer(kind):
        def build(**kwargs):
            seen.update(kwargs)
            raise InputError("stopped at the trainer")
        return build

    monkeypatch.setattr(recipe, "_trainer_class", stop_at_the_trainer)
    for argv, weights, names in (([], [0.5, 0.5], ["digits_reward", "short_answer_reward"]),
                                 (["--reward_funcs", "digits"], None, ["digits_reward"]),
                                 (["--reward_funcs", "digits", "length", "--reward_weights", "0.5", "0.5"],
                                  [0.5, 0.5], ["digits_reward", "length_reward"])):
        with pytest.raises(InputError, match="stopped at the trainer"):
            recipe.main(["--output_dir", str(tmp_path / "out"), *argv])
        assert seen["args"].reward_weights == weights and [f.__name__ for f in seen["reward_funcs"]] == names
