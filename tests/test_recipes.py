"""Every shipped recipe is valid before anything runs (`plan`, the recipe parser) and every CPU recipe trains:
each estimator family and loss option is reachable from a recipe."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, run_cmd

RECIPES = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
CPU_RECIPES = [r for r in RECIPES if yaml.safe_load(r.read_text()).get("use_cpu")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_plan_accepts_every_recipe(recipe, capsys):
    from trl_nrollout.cli import main

    assert main(["plan", "--config", str(recipe), "--no-memory", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    data = yaml.safe_load(recipe.read_text())
    assert plan["total_samples"] == data["train_batch_size"] * data["rollout_n"]


def test_the_verl_article_recipe_is_the_worked_example(capsys):
    from trl_nrollout.cli import main

    main(["plan", "--config", str(ROOT / "recipes/configs/verl_article.yaml"), "--no-memory", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_engines"] == 3 and plan["engine_ranks"] == [[0, 1], [2, 3], [4, 5]]
    assert plan["prompts_per_engine"] == 20 and plan["samples_per_engine"] == 240 and plan["total_samples"] == 720
    assert plan["log_prob_micro_batch_size_per_device"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in CPU_RECIPES if r.stem != "default"], ids=lambda p: p.stem)
def test_cpu_recipes_train(recipe, tmp_path):
    accelerate = str(Path(sys.executable).parent / "accelerate")
    run_cmd([accelerate, "launch", "--cpu", "--num_processes", "1", str(ROOT / "recipes/grpo.py"), "--config",
             str(recipe), "--output_dir", str(tmp_path), "--max_steps", "2", "--rollout_backend", "hf"],
            timeout=400, env={"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["adv_estimator"] == yaml.safe_load(recipe.read_text())["adv_estimator"]
    history = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in h and "reward" in h]
    assert history and all(abs(h["loss"]) < 1e6 for h in history)
