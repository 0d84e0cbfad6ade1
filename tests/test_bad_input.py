"""A user's mistakes in the options, the recipe or the data: each meets one clear message naming the option, file or
row and the fix, before any model is loaded or engine started (the recipe's ``main`` is called as a user runs it,
with the trainer class replaced by a sentinel that fails the test if the run gets that far)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from trl_nrollout.errors import DatasetError, InputError
from trl_nrollout.trainer.checkpoints import ROLLOUT_STATE, TRAINER_STATE, resolve_resume


@pytest.fixture
def run_recipe(recipe, monkeypatch, tmp_path):
    """``run_recipe(*argv)``: the recipe's main with ``--output_dir tmp/out``; building a trainer fails the test."""
    built = []

    def sentinel(kind):
        built.append(kind)
        raise AssertionError("the recipe got as far as building the trainer (a model load and an engine start)")

    monkeypatch.setattr(recipe, "_trainer_class", sentinel)
    monkeypatch.chdir(tmp_path)

    def run(*argv: str):
        try:
            return recipe.main(["--output_dir", str(tmp_path / "out"), *argv])
        finally:
            assert built == [], "no trainer may be built for a mistake in the options or the data"
    return run


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_empty_prompt_is_refused_with_its_row(run_recipe, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "Write a number."}, {"prompt": ""}, {"prompt": "Count."}])
    with pytest.raises(DatasetError, match=r"d.jsonl': 1 empty prompt \(row 1, counting from 0\).*dataset.filter"):
        run_recipe("--dataset_name", data)


def test_an_empty_file_names_the_file_and_the_shape(run_recipe, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match=r"empty.jsonl' is an empty file.*one JSON object per line"):
        run_recipe("--dataset_name", str(tmp_path / "empty.jsonl"))


def test_a_malformed_json_line_is_named(run_recipe, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl', line 2: not valid JSON .*'prompt' column"):
        run_recipe("--dataset_name", str(tmp_path / "bad.jsonl"))
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(DatasetError, match=r"list.jsonl', line 2: a JSON list, not an object"):
        run_recipe("--dataset_name", str(tmp_path / "list.jsonl"))


def test_a_missing_prompt_column_names_the_columns(run_recipe, tmp_path):
    data = _jsonl(tmp_path / "q.jsonl", [{"question": "a"}, {"question": "b"}])
    with pytest.raises(DatasetError, match=r"no 'prompt' column \(\['question'\]\); set dataset_prompt_column"):
        run_recipe("--dataset_name", data)


@pytest.mark.parametrize("argv, match", [
    (["--temperature", "0"], r"temperature=0 \(greedy\) with rollout_n=8 gives 8 identical samples.*'grpo' "
                             r"advantages.*temperature > 0"),
    (["--max_completion_length", "0"], r"max_completion_length=0: each completion needs at least one token"),
    (["--reward_timeout_s", "0"], r"reward_timeout_s=0.0 must be > 0"),
    (["--reward_timeout_policy", "skip"], r"reward_timeout_policy='skip' is not one of \['error', 'none', 'zero'\]"),
    (["--lerning_rate", "0.1"], r"the command line sets 'lerning_rate'.*did you mean 'learning_rate'\?"),
    (["--do_eval", "true"], r"do_eval=True: this recipe loads no evaluation set"),
    (["--eval_strategy", "steps"], r"do_eval=True \(eval_strategy='steps' turns it on\)"),
    (["--trainer", "ppo"], r"NRolloutPPOConfig\(adv_estimator='grpo'\): the PPO trainer trains a critic"),
    (["--adv_estimator", "remax", "--filter_groups", "true"],
     r"adv_estimator='remax' with filter_groups=True: ReMax's greedy baselines .* set filter_groups=False"),
])
def test_invalid_options_are_refused_before_anything_loads(run_recipe, argv, match):
    with pytest.raises(InputError, match=match):
        run_recipe(*argv)


def test_a_typo_in_a_recipe_key_names_the_nearest_option(run_recipe, tmp_path):
    (tmp_path / "r.yaml").write_text("max_steps: 2\nrollout_nn: 4\n")
    with pytest.raises(InputError, match=r"the recipe sets 'rollout_nn'.*did you mean 'rollout_n'\?"):
        run_recipe("--config", str(tmp_path / "r.yaml"))


def test_an_unwritable_output_dir_is_refused_first(recipe, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(InputError, match=r"output_dir='.*a_file/out' cannot be written \(.*\); choose a folder"):
        recipe.main(["--output_dir", str(tmp_path / "a_file" / "out")])


def _checkpoint(folder: Path, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "nrollout_rank0.pt").write_bytes(b"")
    if complete:
        (folder / TRAINER_STATE).write_text("{}")
        (folder / ROLLOUT_STATE).write_text("{}")
    return folder


def test_resume_true_takes_the_last_complete_checkpoint(tmp_path):
    """``true`` skips a checkpoint that a killed run left half written; a path must be a complete checkpoint."""
    assert resolve_resume(None, tmp_path) is None and resolve_resume("false", tmp_path) is None
    with pytest.raises(InputError, match=r"resume_from_checkpoint='true'.*holds no checkpoint-N folder"):
        resolve_resume("true", tmp_path)
    two = _checkpoint(tmp_path / "checkpoint-2")
    _checkpoint(tmp_path / "checkpoint-10")
    last = _checkpoint(tmp_path / "checkpoint-12", complete=False)
    (last / TRAINER_STATE).write_text("{}")  # transformers' part saved, ours not yet
    assert resolve_resume("true", tmp_path) == str(tmp_path / "checkpoint-10")  # by step, not by name
    assert resolve_resume(True, tmp_path) == str(tmp_path / "checkpoint-10")
    assert resolve_resume(str(two), tmp_path) == str(two)
    with pytest.raises(InputError, match=r"checkpoint-12' is not a complete checkpoint \(no trainer_state.json or "
                                         r"nrollout_state.json\)"):
        resolve_resume(str(last), tmp_path)
    with pytest.raises(InputError, match=r"holds checkpoints \(checkpoint-2, checkpoint-10, checkpoint-12\)"):
        resolve_resume(str(tmp_path), tmp_path / "elsewhere")
    with pytest.raises(InputError, match=r"'nowhere' is not a folder"):
        resolve_resume("nowhere", tmp_path)


def test_the_recipe_checks_the_resume_target_before_loading(run_recipe, tmp_path):
    with pytest.raises(InputError, match=r"resume_from_checkpoint='true' resumes from the last checkpoint in "
                                         r"output_dir='.*out', but it holds no checkpoint-N folder"):
        run_recipe("--resume_from_checkpoint", "true")


def test_a_user_error_prints_one_line_and_exits_2(tmp_path):
    """As a command (plain python, and accelerate launch --quiet as `make demo` runs it): one line on stderr, no
    traceback, exit status 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    accelerate = str(Path(sys.executable).parent / "accelerate")
    for head in ([sys.executable], [accelerate, "launch", "--cpu", "--num_processes", "1", "--quiet"]):
        start = time.perf_counter()
        proc = subprocess.run([*head, str(ROOT / "recipes/grpo.py"), "--output_dir", str(tmp_path), "--temperature",
                               "0"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode in (1, 2) if head[0] == accelerate else proc.returncode == 2
        assert "Traceback" not in proc.stderr + proc.stdout
        assert [line for line in lines if "error" in line] == [lines[-1]]
        assert lines[-1].startswith("error: temperature=0 (greedy) with rollout_n=8")
        assert time.perf_counter() - start < 120  # imports only: no model, no engine


# ---------------------------------------------------------------------------------------------- reward functions
def test_a_reward_call_past_its_timeout_is_abandoned_and_the_wait_is_reported(caplog):
    """call_watched: a line every notice period while a reward function runs (with or without a limit), and
    RewardTimeout once reward_timeout_s passed, without waiting for the function (its thread is a daemon)."""
    import logging
    import threading

    from trl_nrollout.trainer.scoring import RewardTimeout, call_watched

    release = threading.Event()

    def stuck(**kwargs):
        release.wait(30)
        return [1.0]

    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        start = time.perf_counter()
        with pytest.raises(RewardTimeout, match="reward function 'judge' did not return within reward_timeout_s=0.5"):
            call_watched(stuck, {}, name="judge", samples=3, timeout_s=0.5, notice_every_s=0.15)
        assert time.perf_counter() - start < 2.0
        waiting = [r.getMessage() for r in caplog.records if "still waiting for reward function 'judge'" in r.getMessage()]
        assert len(waiting) >= 2 and "(3 samples); reward_timeout_s=0.5" in waiting[0]
        worker = [t for t in threading.enumerate() if t.name == "reward:judge"]
        assert worker and all(t.daemon for t in worker)  # never holds the process at exit
        release.set()
        caplog.clear()

        def slow(**kwargs):
            time.sleep(0.5)
            return [kwargs["x"]]

        assert call_watched(slow, {"x": 2.0}, name="slow", samples=1, timeout_s=None, notice_every_s=0.15) == [2.0]
        waiting = [r.getMessage() for r in caplog.records if "still waiting for reward function 'slow'" in r.getMessage()]
        assert len(waiting) >= 2 and "set reward_timeout_s to bound each call" in waiting[0]
        assert call_watched(slow, {"x": 3.0}, name="slow", samples=1, timeout_s=5, notice_every_s=10) == [3.0]

    def broken(**kwargs):
        raise KeyError("answer")

    with pytest.raises(KeyError, match="answer"):  # an error inside the worker reaches the caller as itself
        call_watched(broken, {}, name="broken", samples=1, timeout_s=5)


@pytest.mark.parametrize("values, match", [
    (["good", "bad"], r"reward function 'judge' returned 'good' \(str\) for sample 0 \(prompt='p0'\); a reward must "
                      r"be a number"),
    ([1.0, "0.5"], r"returned '0.5' \(str\) for sample 1"),
    ([1.0, [2.0]], r"returned \[2.0\] \(list\) for sample 1"),
    ("1.0", r"reward function 'judge' returned str '1.0'; it must return a list"),
    ([1.0], r"returned 1 rewards for 2 samples"),
])
def test_unusable_rewards_name_the_function_and_the_sample(values, match):
    from trl_nrollout.trainer.scoring import RewardFunctionError, as_rewards

    with pytest.raises(RewardFunctionError, match=match):
        as_rewards(values, "judge", ["p0", "p1"])
    assert as_rewards([1, None, True], "judge", ["a", "b", "c"]) == [1.0, None, 1.0]
