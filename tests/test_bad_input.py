"""A user's mistakes in the options, the recipe or the data: each meets one clear message naming the option, file or
row and the fix, before any model is loaded or engine started (the recipe's ``main`` is called as a user runs it,
with the trainer class replaced by a sentinel that fails the test if the run gets that far)."""

from __future__ import annotations

import json
import os
import re
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
    # NaN, inf and negative numbers: torch's optimizer found learning_rate=nan only after the model loaded
    (["--learning_rate", "nan"], r"learning_rate=nan must be a finite number >= 0; set learning_rate to such a "
                                 r"number, e.g. 1e-06 \(the default\)"),
    (["--learning_rate", "inf"], r"learning_rate=inf must be a finite number >= 0"),
    (["--learning_rate=-1e-5"], r"learning_rate=-1e-05 must be a finite number >= 0"),
    (["--beta", "nan"], r"beta=nan must be a finite number >= 0 \(0: no KL loss\)"),
    (["--epsilon", "-0.2"], r"epsilon=-0.2 must be a finite number >= 0"),
    (["--max_grad_norm", "inf"], r"max_grad_norm=inf must be a finite number >= 0 \(0: no clipping\)"),
    (["--weight_decay", "-0.1"], r"weight_decay=-0.1 must be a finite number >= 0"),
    (["--temperature", "nan"], r"temperature=nan must be a finite number; set temperature to such a number"),
    (["--adam_beta2", "1.0"], r"adam_beta2=1.0 must be a finite number in \[0, 1\)"),
    (["--reward_weights", "1.0", "nan"], r"reward_weights=\[1.0, nan\] holds nan: each value must be a finite "
                                         r"number"),
    # an option without effect in the run's combination is said, not ignored
    (["--tool_workers", "4"], r"tool_workers=4 sets how many samples' tool calls run at once with "
                              r"rollout_multi_turn='requests' \(or rollout_partial=True\), but "
                              r"rollout_multi_turn='turns' .* would do nothing"),
])
def test_invalid_options_are_refused_before_anything_loads(run_recipe, argv, match):
    with pytest.raises(InputError, match=match):
        run_recipe(*argv)


def test_requests_turns_without_tools_is_refused_before_the_model_loads(recipe, tmp_path, monkeypatch):
    """rollout_multi_turn='requests' changes how tool turns run; the recipe passes no tools (nor does a trainer built
    without tools= / environment_factory=), so it would do nothing: the trainer refuses it before loading the model
    (the model loader fails the test if it gets that far)."""
    import trl_nrollout.trainer.grpo as trainer_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the option was refused")

    monkeypatch.setattr(trainer_module.GRPOTrainer, "__init__", no_load)
    with pytest.raises(InputError, match=r"rollout_multi_turn='requests' changes how samples with tool calls advance "
                                         r".* no tools= and no environment_factory=.* would do nothing"):
        recipe.main(["--output_dir", str(tmp_path), "--rollout_multi_turn", "requests", "--max_steps", "1"])


# ---------------------------------------------------------------------------------------------- reward references
def _modules(folder: Path) -> None:
    (folder / "my_rewards.py").write_text("WEIGHT = 2\n\ndef exact_reward(completions, **kw):\n"
                                          "    return [0.0] * len(completions)\n")
    (folder / "needs_dep.py").write_text("import nosuchdependency_xyz\n")
    (folder / "bad_syntax.py").write_text("def f(:\n")
    (folder / "raises_at_import.py").write_text("CONFIG = {}\nKEY = CONFIG['missing']\n")


@pytest.mark.parametrize("spec, match", [
    ("nosuch.module:f", r"reward_funcs entry 'nosuch.module:f': no module named 'nosuch' on Python's path\. Check "
                        r"the spelling; .* e\.g\. PYTHONPATH="),
    ("my_rewards:exact_rewrd", r"module 'my_rewards' has no function 'exact_rewrd'; did you mean "
                               r"my_rewards:exact_reward\?"),
    ("my_rewards:nothing_like_it", r"has no function 'nothing_like_it'; its functions: \['exact_reward'\]"),
    ("my_rewards:WEIGHT", r"my_rewards\.WEIGHT is a int, not a function"),
    ("needs_dep:f", r"module 'needs_dep' was found but importing it failed: No module named "
                    r"'nosuchdependency_xyz'\. Install what it imports"),
    ("bad_syntax:f", r"importing module 'bad_syntax' raised SyntaxError: .*bad_syntax\.py, line 1"),
    ("raises_at_import:f", r"importing module 'raises_at_import' raised KeyError: 'missing' \(.*raises_at_import\.py, "
                           r"line 2\)"),
    ("my_rewards:", r"'my_rewards:' is neither a built-in reward .* nor an import path 'package.module:function'"),
])
def test_a_reward_function_that_does_not_resolve_is_refused_before_the_data(run_recipe, tmp_path, monkeypatch,
                                                                            spec, match):
    """Every reward_funcs reference the recipe imports by name is resolved with the other options, before the data
    and the model: a reference that does not resolve is an InputError (the one-line error), not a traceback."""
    _modules(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InputError, match=match):
        run_recipe("--reward_funcs", "digits", spec, "--dataset_name", str(tmp_path / "no_such_data.jsonl"))


def test_a_reward_reference_error_is_the_recipes_one_line_and_exit_2(recipe, tmp_path, capsys):
    """From the command line (the recipe's ``cli``, what ``python recipes/grpo.py`` runs): ``error:`` and the message
    on one line of stderr, exit status 2, no traceback (it was a ValueError traceback, exit 1)."""
    code = recipe.cli(["--output_dir", str(tmp_path), "--reward_funcs", "nosuch.module:f"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [err.splitlines()[-1]]
    assert err.startswith("error: reward_funcs entry 'nosuch.module:f': no module named 'nosuch'")


def test_a_typo_in_a_recipe_key_names_the_nearest_option(run_recipe, tmp_path):
    (tmp_path / "r.yaml").write_text("max_steps: 2\nrollout_nn: 4\n")
    with pytest.raises(InputError, match=r"the recipe sets 'rollout_nn'.*did you mean 'rollout_n'\?"):
        run_recipe("--config", str(tmp_path / "r.yaml"))


def test_an_unwritable_output_dir_is_refused_first(recipe, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(InputError, match=r"output_dir='.*a_file/out' cannot be written \(.*\); choose a folder"):
        recipe.main(["--output_dir", str(tmp_path / "a_file" / "out")])


def _checkpoint(folder: Path, complete: bool = True) -> Path:
    import torch

    folder.mkdir(parents=True)
    torch.save({"prompt_rng": torch.Generator().get_state()}, folder / "nrollout_rank0.pt")
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


def test_a_checkpoint_file_cut_short_is_named_with_why(tmp_path):
    """damaged_file reads headers, not tensors: a safetensors file shorter than its header says, a torch.save archive
    without its end (zip directory), an empty .pt, a state JSON cut mid-way, an index naming a shard that is not
    there; the first damaged file in path order, with why. The real run (test_dropin) truncates a real checkpoint."""
    import torch
    from safetensors.torch import save_file

    from trl_nrollout.trainer.checkpoints import damaged_file

    folder = _checkpoint(tmp_path / "checkpoint-1")
    save_file({"w": torch.ones(64, 64)}, folder / "model.safetensors")
    torch.save({"state": torch.ones(64)}, folder / "optimizer.pt")
    assert damaged_file(folder) is None

    def cut(name: str, keep: int | None = None) -> tuple[Path, str]:
        path = folder / name
        size = path.stat().st_size
        os.truncate(path, size // 2 if keep is None else keep)
        found = damaged_file(folder)
        assert found is not None and found[0] == path, found
        return found

    assert re.fullmatch(r"it holds \d+ bytes but its header describes \d+ \(it was cut short\)",
                        cut("model.safetensors")[1])
    (folder / "model.safetensors").unlink()
    assert "is not a complete torch.save archive" in cut("nrollout_rank0.pt")[1]
    assert cut("nrollout_rank0.pt", keep=0)[1] == "it is empty (0 bytes)"
    (folder / "nrollout_rank0.pt").unlink()
    assert "is not a complete torch.save archive" in cut("optimizer.pt")[1]
    (folder / "optimizer.pt").unlink()
    (folder / TRAINER_STATE).write_text('{"global_step": 1, "log_hi')
    assert damaged_file(folder)[1].startswith("it is not valid JSON")
    (folder / TRAINER_STATE).write_text("{}")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1-of-2.safetensors"}}))
    assert damaged_file(folder)[1] == "it maps weights to model-1-of-2.safetensors, which is missing"


def test_the_recipe_checks_the_resume_target_before_loading(run_recipe, tmp_path):
    with pytest.raises(InputError, match=r"resume_from_checkpoint='true' resumes from the last checkpoint in "
                                         r"output_dir='.*out', but it holds no checkpoint-N folder"):
        run_recipe("--resume_from_checkpoint", "true")


def test_a_user_error_prints_one_line_and_exits_2(tmp_path):
    """As a command (plain python, and accelerate launch --quiet as `make demo` runs it): one line on stderr, no
    traceback, exit status 2; the option's error comes before any model is touched (the model's folder named does
    not exist: a check run after loading it would end with the missing model's error instead, whatever the time)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    accelerate = str(Path(sys.executable).parent / "accelerate")
    for head in ([sys.executable], [accelerate, "launch", "--cpu", "--num_processes", "1", "--quiet"]):
        # the model's folder does not exist: the option's error comes first, before any model or engine is touched
        proc = subprocess.run([*head, str(ROOT / "recipes/grpo.py"), "--output_dir", str(tmp_path), "--temperature",
                               "0", "--model_name_or_path", str(tmp_path / "no_model_here")], capture_output=True,
                              text=True, env=env, timeout=300, cwd=tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode in (1, 2) if head[0] == accelerate else proc.returncode == 2
        assert "Traceback" not in proc.stderr + proc.stdout
        assert [line for line in lines if "error" in line] == [lines[-1]]
        assert lines[-1].startswith("error: temperature=0 (greedy) with rollout_n=8")


# ---------------------------------------------------------------------------------------------- reward functions
def test_a_reward_call_past_its_timeout_is_abandoned_and_the_wait_is_reported(caplog):
    """call_watched: a line every notice period while a reward function runs (with or without a limit), and
    RewardTimeout once reward_timeout_s passed, without waiting for the function (its thread is a daemon)."""
    import logging
    import threading

    from trl_nrollout.trainer.scoring import RewardTimeout, call_watched

    release, returned = threading.Event(), threading.Event()

    def stuck(**kwargs):
        release.wait(30)
        returned.set()
        return [1.0]

    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        with pytest.raises(RewardTimeout, match="reward function 'judge' did not return within reward_timeout_s=0.5"):
            call_watched(stuck, {}, name="judge", samples=3, timeout_s=0.5, notice_every_s=0.15)
        # raised while the function still runs (not after it: it returns only once released), with one notice per
        # period of the 0.5 s at most (waiting for the function would log one every 0.15 s for 30 s)
        assert not returned.is_set()
        waiting = [r.getMessage() for r in caplog.records if "still waiting for reward function 'judge'" in r.getMessage()]
        assert 2 <= len(waiting) <= 3 and "(3 samples); reward_timeout_s=0.5" in waiting[0]
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


def test_generation_kwargs_from_the_command_line_are_json(tmp_path):
    """``--generation_kwargs '{"min_tokens": 5}'`` (the command line gives a string) is read as the JSON object it
    is, before the reserved-keys check (which saw the string's characters and refused 'n'); a string that is not a
    JSON object is refused naming the option and the form. Mutation: drop the JSON parse -> "sets 'n'" error."""
    from transformers import HfArgumentParser

    from trl_nrollout import NRolloutConfig

    parser = HfArgumentParser(NRolloutConfig)
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses([*base, "--generation_kwargs", '{"min_tokens": 5}'])
    assert args.generation_kwargs == {"min_tokens": 5}
    with pytest.raises(InputError, match=r"generation_kwargs='\{min_tokens: 5\}' is not JSON"):
        parser.parse_args_into_dataclasses([*base, "--generation_kwargs", "{min_tokens: 5}"])
    with pytest.raises(InputError, match="must be a JSON object"):
        parser.parse_args_into_dataclasses([*base, "--generation_kwargs", "[1, 2]"])


def test_resume_auto_and_a_restarted_launch_take_the_last_checkpoint_or_start_afresh(tmp_path, monkeypatch):
    """``auto`` (verl's ``resume_mode: auto``) is the last complete checkpoint when there is one and a fresh start
    when there is none (where ``true`` is an error); a run restarted by its launcher (torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` > 0, ``accelerate launch --max_restarts``) with the option unset resumes as under
    ``auto``, and ``false`` still starts afresh. Mutation tried: the restart count ignored -> the restarted run
    starts afresh, the fourth assertion fails."""
    from trl_nrollout.trainer.checkpoints import elastic_restarts

    assert resolve_resume("auto", tmp_path) is None and resolve_resume(None, tmp_path, restarts=1) is None
    _checkpoint(tmp_path / "checkpoint-2")
    _checkpoint(tmp_path / "checkpoint-4", complete=False)  # the restart killed it while saving
    assert resolve_resume("auto", tmp_path) == str(tmp_path / "checkpoint-2")
    assert resolve_resume(None, tmp_path, restarts=1) == str(tmp_path / "checkpoint-2")
    assert resolve_resume(None, tmp_path, restarts=0) is None and resolve_resume("false", tmp_path, restarts=1) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_restarts() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    assert elastic_restarts() == 0
