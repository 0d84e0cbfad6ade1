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
