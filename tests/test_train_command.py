"""``trl-nrollout train``: the recipe (:mod:`trl_nrollout.recipe.run`) as a command of the installed package, with
the shipped recipes found by name, and the wheel carrying them (a ``pip install`` can run every documented recipe)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from trl_nrollout.errors import InputError


def test_shipped_recipes_resolve_by_name_and_a_file_wins():
    from trl_nrollout.recipe.run import packaged_recipe

    assert Path(packaged_recipe("gsm8k_qwen")).read_bytes() == (ROOT / "recipes/configs/gsm8k_qwen.yaml").read_bytes()
    assert packaged_recipe("verl_article.yaml") == packaged_recipe("verl_article")
    local = str(ROOT / "recipes/configs/ppo.yaml")
    assert packaged_recipe(local) == local
    with pytest.raises(InputError, match="nor a recipe shipped with trl-nrollout.*'gsm8k_qwen'"):
        packaged_recipe("gsm8k_qwne")


def test_train_dispatches_to_the_recipe_with_a_packaged_name(monkeypatch, tmp_path, capsys):
    """``trl-nrollout train --config ppo`` runs the recipe's own code: the shipped ``ppo`` recipe is read (its
    ``trainer: ppo`` picks the PPO trainer), the command line overrides it, and a mistake is the recipe's one-line
    error with exit status 2."""
    import trl_nrollout.recipe.run as run
    from trl_nrollout.cli import main

    built = []

    def stop_before_the_model(kind: str):
        built.append(kind)
        raise InputError("stopped before the model loads")

    monkeypatch.setattr(run, "_trainer_class", stop_before_the_model)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "ppo", "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]) == 2
    assert built == ["ppo"] and "error: stopped before the model loads" in capsys.readouterr().err
    assert main(["train", "--config", "ppo", "--max_stpes", "1"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err


@pytest.mark.fast
@pytest.mark.parametrize("argv,message", [
    (["--beta", "1.5"], "error: beta=1.5 must be in [0, 1] (TRL's generalized JSD"),
    (["--vllm_mode", "server"], "error: vllm_mode='server' is not supported by NRolloutDistillationTrainer"),
    (["--rollout_n", "4"], "sets 'rollout_n', which is not an option of the NRolloutDistillationConfig recipe"),
    (["--reward_funcs", "length"], "error: reward_funcs=['length'] with trainer: distill: on-policy distillation"),
    (["--teacher_model_name_or_path", ""], "error: trainer: distill needs a teacher: set teacher_model_name_or_path"),
    (["--trainer", "dpo"], "error: --trainer 'dpo': use one of ['grpo', 'ppo', 'distill']"),
])
def test_a_mistake_in_a_distillation_recipe_is_one_line(argv, message, tmp_path, capsys):
    """The distillation recipe's user errors are the recipe's one-line errors (exit 2, no traceback), before the
    student loads: TRL's beta rule, a refused TRL option, a GRPO option, the reward options, a missing teacher.
    Mutation tried: the reward options' check removed -> trains and exits 0 -> fails."""
    from trl_nrollout.cli import main

    code = main(["train", "--config", "distill_digits", "--output_dir", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_the_console_script_trains_a_shipped_recipe(tmp_path):
    """The installed ``trl-nrollout`` script, from a folder that is not the clone: one real step of the shipped
    ``default`` recipe (the built-in tiny model, the HF engine) and its summary."""
    script = Path(sys.executable).with_name("trl-nrollout")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([str(script), "train", "--config", "default", "--max_steps", "1", "--rollout_backend",
                           "hf", "--train_batch_size", "4", "--rollout_n", "4", "--output_dir", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 1 and summary["rollout_backend"] == "hf" and summary["train_batch_size"] == 4


@pytest.mark.slow
def test_the_console_script_distills_with_the_shipped_recipe(tmp_path):
    """``trl-nrollout train --config distill_digits``: the shipped distillation recipe (``trainer: distill``:
    NRolloutDistillationTrainer, the built-in student and long-tail teacher) trains 2 steps (TRL's generate samples
    here, to keep it short; the engine's sampling is tests/test_distill_dropin.py's) and the saved student is closer
    to the teacher than the student it started from: the mean KL(teacher || student) of the next-token distributions
    over fixed sequences (the starting student's seeded completions of fixed prompts) drops by over 10% (1.82 ->
    1.52 measured). Mutation tried: TRL's loss multiplied by 0 in ``NRolloutDistillationTrainer`` (a
    ``compute_loss`` override) -> fails (first at the logged ``loss_start``, 0.0). The run prints the quiet progress
    line (the loss in the bar) and writes report.png; mutation tried: the live callback not installed in the
    drop-in -> the Trainer prints a dict per step and the line has no loss -> fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, resolve_model

    script = Path(sys.executable).with_name("trl-nrollout")
    out = tmp_path / "distill"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([str(script), "train", "--config", "distill_digits", "--max_steps", "2",
                           "--rollout_backend", "hf", "--output_dir", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["trainer"] == "distill" and summary["steps"] == 2 and summary["rollout_backend"] == "hf"
    assert summary["loss_start"] > 0 and summary["teacher"] == "builtin:tiny-qwen2-longtail"
    # the quiet progress line (the loss in the bar's postfix, no printed dict per step) and report.png, as GRPO's
    bar = proc.stderr.replace("\r", "\n")
    last = [h["loss"] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h][-1]
    assert f"loss {last:.4f}" in bar and "2/2" in bar and "{'loss'" not in proc.stdout + bar
    assert summary["report"] == str((out / "report.png").resolve())
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # fixed token sequences: the starting student's sampled completions (seeded) of fixed prompts
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"), padding_side="left")
    prompts = tokenizer(digits_prompts(16, seed=7), return_tensors="pt", padding=True)
    start = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        ids = start.generate(**prompts, do_sample=True, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
    width = prompts["input_ids"].shape[1]
    mask = torch.cat([prompts["attention_mask"], torch.ones(len(ids), ids.shape[1] - width, dtype=torch.long)], 1)

    def divergence(student_path: str) -> float:
        """The mean KL(teacher || student) of the next-token distributions at the completions' positions."""
        models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
                  for p in (resolve_model("builtin:tiny-qwen2-longtail"), student_path)]
        with torch.no_grad():
            teacher, student = (m(ids, attention_mask=mask).logits[:, width - 1:-1].log_softmax(-1) for m in models)
        return float((teacher.exp() * (teacher - student)).sum(-1).mean())

    before, after = divergence(resolve_model("builtin:tiny-qwen2")), divergence(str(out))
    assert after < 0.9 * before, (before, after)


@pytest.mark.slow
def test_the_wheel_carries_the_recipes(tmp_path):
    """A wheel built from the clone holds every shipped recipe and accelerate config, and its installed copy (on
    its own on the path, run from elsewhere) resolves ``--config gsm8k_qwen`` to its own file."""
    src = tmp_path / "src"  # the clone's files the build reads, so that no earlier build's output is reused
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "trl_nrollout", src / "trl_nrollout", symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "recipes", src / "recipes", ignore=skip)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("trl_nrollout-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("configs", "accelerate"):
        for path in (ROOT / "recipes" / folder).glob("*.yaml"):
            assert f"trl_nrollout/recipes/{folder}/{path.name}" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    shutil.rmtree(tmp_path / "dist")
    found = subprocess.run([sys.executable, "-c", "from trl_nrollout.recipe.run import packaged_recipe; "
                            "print(packaged_recipe('gsm8k_qwen'))"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
    assert found.returncode == 0, found.stderr[-3000:]
    path = Path(found.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(site) and path.read_text() == (ROOT / "recipes/configs/gsm8k_qwen.yaml").read_text()


def test_train_launches_under_accelerate_with_a_shipped_config_by_name(monkeypatch, capsys):
    """``trl-nrollout train --accelerate_config zero3 --num_processes 8 ...`` (TRL's ``--accelerate_config``):
    accelerate's own parser gets the installed zero3.yaml as ``--config_file``, the launch flags, ``-m
    trl_nrollout.recipe.run`` and the recipe's words in order; a clone's ``recipes/accelerate/zero3.yaml`` run from
    elsewhere resolves to the same file; an unknown name is one error naming the shipped configs; without a launch
    flag nothing is launched."""
    import accelerate.commands.launch as accel

    from trl_nrollout.cli import main
    from trl_nrollout.recipe.launch import ACCELERATE_DIR, accelerate_argv, packaged_accelerate_config

    launched = []
    monkeypatch.setattr(accel, "launch_command", launched.append)
    monkeypatch.chdir(ROOT / "tests")  # not the clone's root: recipes/accelerate/ is not here
    argv = ["train", "--accelerate_config", "zero3", "--config", "gsm8k_qwen", "--num_processes=8", "--max_steps",
            "20", "--num_machines", "2", "--machine_rank", "1"]
    assert main(argv) == 0
    args = launched[0]
    assert Path(args.config_file) == ACCELERATE_DIR / "zero3.yaml" and args.config_file != "zero3"
    assert (args.num_processes, args.num_machines, args.machine_rank, args.module) == (8, 2, 1, True)
    assert args.training_script == "trl_nrollout.recipe.run"
    assert args.training_script_args == ["--config", "gsm8k_qwen", "--max_steps", "20"]
    assert packaged_accelerate_config("recipes/accelerate/zero3_cpu.yaml") == str(ACCELERATE_DIR / "zero3_cpu.yaml")
    assert packaged_accelerate_config("zero2.yaml") == str(ACCELERATE_DIR / "zero2.yaml")
    assert main(["train", "--accelerate_config", "zero4", "--config", "ppo"]) == 2
    err = capsys.readouterr().err
    assert "--accelerate_config 'zero4' is neither a file nor" in err and "'zero3'" in err and "'fsdp'" in err
    assert accelerate_argv(["--config", "ppo", "--max_steps", "1"]) is None
    assert main(["train", "--config", "ppo", "--num_processes"]) == 2
    assert "--num_processes needs a value" in capsys.readouterr().err and len(launched) == 1


def test_plan_takes_a_shipped_recipes_name_as_train_does(monkeypatch, capsys):
    """``trl-nrollout plan --config verl_article`` (the name the recipes' comments print) plans the shipped file,
    from a folder that is not the clone's root; a local file of that name would win (``packaged_recipe``'s rule)."""
    from trl_nrollout.cli import main

    monkeypatch.chdir(ROOT / "tests")
    assert main(["plan", "--config", "verl_article"]) == 0
    assert "6 / rollout_tp_size=2 = 3" in capsys.readouterr().out
    # a distillation recipe (trainer: distill): one completion per prompt, per_device_train_batch_size prompts a rank
    assert main(["plan", "--config", "distill_digits", "--num-processes", "2", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)
    assert (layout["rollout_n"], layout["train_batch_size"], layout["total_samples"]) == (1, 16, 16)
