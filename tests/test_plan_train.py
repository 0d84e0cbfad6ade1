"""``plan`` and ``train`` read one recipe the same way (issue 63): the layout, the batch and micro-batch fields, the
update's token budget and ``use_dynamic_bsz``'s default, and the engine's settings under the trainer's names
(``rollout_max_num_seqs``, ``rollout_dtype``, ``vllm_gpu_memory_utilization``), on generated recipes; and
``--suggest``'s printed command, parsed by the recipe as ``train`` parses it, resolves to the layout it planned."""

from __future__ import annotations

import shlex

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_nrollout.cli import main
from trl_nrollout.plan.figures import PlanError, build_layout, plan_values
from trl_nrollout.plan.layout import LayoutError
from trl_nrollout.plan.update_budget import dynamic_bsz

LAYOUT_KEYS = ("train_batch_size", "rollout_n", "ppo_micro_batch_size_per_device", "gradient_accumulation_steps",
               "mini_batch_samples_per_rank", "optimizer_steps_per_rollout", "ppo_epochs", "total_samples",
               "ppo_mini_batch_size", "log_prob_micro_batch_size_per_device", "ref_log_prob_micro_batch_size_per_device")


@st.composite
def recipes(draw) -> dict:
    """A recipe of verl's batch fields or of TRL's, with or without the update's budget, ``use_dynamic_bsz`` and
    the engine's settings under the trainer's names; invalid combinations included (both sides must refuse them)."""
    if draw(st.booleans()):
        n = draw(st.sampled_from([2, 4, 8]))
        recipe = {"train_batch_size": draw(st.integers(1, 8)), "rollout_n": n}
        if draw(st.booleans()):
            recipe["ppo_mini_batch_size"] = draw(st.sampled_from([1, 2, 4]))
        if draw(st.booleans()):
            recipe["ppo_micro_batch_size_per_device"] = draw(st.sampled_from([1, 2, 4, 8]))
    else:
        recipe = {"per_device_train_batch_size": draw(st.sampled_from([2, 4, 8])),
                  "gradient_accumulation_steps": draw(st.integers(1, 3)),
                  "num_generations": draw(st.sampled_from([2, 4]))}
    if draw(st.booleans()):
        recipe["ppo_max_token_len_per_device"] = draw(st.sampled_from([1024, 4096]))
    if draw(st.booleans()):
        recipe["use_dynamic_bsz"] = draw(st.booleans())
    if draw(st.booleans()):
        recipe["rollout_max_num_seqs"] = draw(st.sampled_from([16, 64]))
    if draw(st.booleans()):
        recipe["rollout_dtype"] = draw(st.sampled_from(["bfloat16", "float32"]))
    return recipe


def _plan_side(path) -> dict | str:
    try:
        values = plan_values(str(path))
        layout = build_layout(values).to_dict()
        use, budget = dynamic_bsz(values)
    except (PlanError, LayoutError) as err:
        return f"refused: {err}"
    return {**{k: layout[k] for k in LAYOUT_KEYS}, "use_dynamic_bsz": use, "budget": budget,
            "max_num_seqs": values.get("max_num_seqs"), "dtype": values.get("dtype", "auto")}


def _train_side(recipe: dict, tmp_path) -> dict | str:
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    try:
        cfg = NRolloutConfig(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True, **recipe)
        layout = cfg.rollout_layout(1).to_dict()
    except (InputError, LayoutError, ValueError) as err:
        return f"refused: {err}"
    return {**{k: layout[k] for k in LAYOUT_KEYS}, "use_dynamic_bsz": cfg.use_dynamic_bsz,
            "budget": cfg.ppo_max_token_len_per_device, "max_num_seqs": cfg.rollout_max_num_seqs,
            "dtype": cfg.rollout_dtype}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recipe=recipes())
def test_plan_resolves_a_recipe_as_the_trainers_config_does(recipe, tmp_path):
    """For a generated recipe on one process, plan's resolved values equal NRolloutConfig's: the layout and micro
    batches, ``use_dynamic_bsz`` (its default included: on for verl's fields without a micro batch), the budget and
    the engine settings; a recipe one side refuses, the other refuses too. Fails when plan's default of
    ``use_dynamic_bsz`` is "a budget was given" (as it was), or when plan does not read ``rollout_max_num_seqs``."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    plan, train = _plan_side(path), _train_side(recipe, tmp_path)
    if isinstance(plan, str) or isinstance(train, str):
        assert isinstance(plan, str) and isinstance(train, str), (recipe, plan, train)
        return
    assert plan == train, recipe


def test_suggests_command_trains_the_layout_it_planned(tmp_path, capsys, recipe):
    """``plan --config R --suggest`` with a flag given on its command line: the printed "run the first" command
    names the recipe, carries the flag (``--max-completion-length``, under the trainer's name) and the chosen
    layout (TP, n, max_num_seqs, the budget, the engine's memory fraction and sleep mode); parsed by the recipe as
    ``train`` parses it, the trainer's config is that layout. Fails when the command drops ``--config`` or the
    plan's own flags (as it did)."""
    path = tmp_path / "cot.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "train_batch_size": 8,
                                    "rollout_n": 8, "report_to": "none", "output_dir": str(tmp_path / "out"),
                                    "use_cpu": True, "bf16": False}))
    code = main(["plan", "--config", str(path), "--num-processes", "1", "--device", "h100",
                 "--max-completion-length", "4096", "--max-prompt-length", "256", "--suggest"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("run the first: "))
    argv = shlex.split(line.removeprefix("run the first: "))
    assert argv[:2] == ["trl-nrollout", "train"] and argv[argv.index("--config") + 1] == str(path)
    assert argv[argv.index("--max_completion_length") + 1] == "4096"
    # what train does with it: the launch's flags go to accelerate, the rest to the recipe
    launch = {"--accelerate_config", "--num_processes"}
    rest = [a for i, a in enumerate(argv[2:]) if a not in launch and argv[2:][i - 1] not in launch]
    resolved, kind = recipe._resolve_recipe(rest)
    script, cfg = recipe._parse(resolved, recipe._config_class(kind))
    assert script.max_prompt_length == 256  # the recipe's check of the prompts plan priced
    planned = dict(zip(argv[::2], argv[1::2], strict=False)) | dict(zip(argv[1::2], argv[2::2], strict=False))
    assert cfg.max_completion_length == 4096
    assert cfg.rollout_tp_size == int(planned["--rollout_tp_size"])
    assert cfg.rollout_n == int(planned["--rollout_n"])
    assert cfg.rollout_max_num_seqs == int(planned["--rollout_max_num_seqs"])
    if "--ppo_max_token_len_per_device" in planned:
        assert cfg.use_dynamic_bsz and cfg.ppo_max_token_len_per_device == int(planned["--ppo_max_token_len_per_device"])
    if "--vllm_gpu_memory_utilization" in planned:
        assert cfg.vllm_gpu_memory_utilization == pytest.approx(float(planned["--vllm_gpu_memory_utilization"]))
    if "--vllm_enable_sleep_mode" in planned:
        assert cfg.vllm_enable_sleep_mode == (planned["--vllm_enable_sleep_mode"] == "true")


def test_planned_without_a_recipe_the_command_asks_for_one(capsys):
    """Planned from flags only, the command names a recipe to write (``--config YOUR_RECIPE.yaml``) instead of
    running ``train``'s built-in CPU default, and carries the model and sizes given."""
    code = main(["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--num-processes", "2", "--train-batch-size", "8",
                 "--rollout-n", "4", "--device", "h100", "--suggest"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("run the first: "))
    assert "--config YOUR_RECIPE.yaml" in line
    assert "--model_name_or_path Qwen/Qwen2.5-0.5B-Instruct" in line and "--train_batch_size 8" in line


def test_suggest_searches_the_engines_memory_fraction_and_sleep_mode(capsys):
    """At long completions the engine's memory fraction and sleep mode decide the step: --suggest tries 0.3, 0.5 and
    0.7 with and without sleep mode (the recipe's own value where it sets one) and can rank a larger fraction first."""
    import json

    args = ["--model", "Qwen/Qwen2.5-7B-Instruct", "--num-processes", "8", "--train-batch-size", "64", "--rollout-n",
            "8", "--max-completion-length", "16384", "--max-prompt-length", "1024", "--completion-tokens-mean", "8000",
            "--device", "h100", "--suggest", "--json"]
    assert main(["plan", *args]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    tried = {(c["options"].get("gpu_memory_utilization"), c["options"].get("vllm_enable_sleep_mode")) for c in ranked}
    assert {u for u, _ in tried} >= {0.5, 0.7} and {s for _, s in tried} == {False, True}
    first = ranked[0]["options"]
    assert first["gpu_memory_utilization"] > 0.3 or first["vllm_enable_sleep_mode"]
    assert main(["plan", *args, "--gpu-memory-utilization", "0.3"]) == 0
    fixed = json.loads(capsys.readouterr().out)["ranked"]
    assert all("gpu_memory_utilization" not in c["options"] for c in fixed)
    assert ranked[0]["prediction"]["total_s"] < fixed[0]["prediction"]["total_s"]


def test_the_recipe_refuses_prompts_longer_than_max_prompt_length(tiny_model_path):
    """``max_prompt_length``, the plan's key, is the recipe's too: a dataset prompt longer (in tokens, after the chat
    template) is an error naming the rows and the longest, before the model loads; within it, nothing is said."""
    from trl_nrollout.errors import DatasetError
    from trl_nrollout.recipe.data import check_prompt_lengths

    prompts = ["one two", [{"role": "user", "content": "three " * 40}], "four"]
    with pytest.raises(DatasetError, match=r"1 prompt longer than max_prompt_length=20 tokens \(rows 1,"):
        check_prompt_lengths(prompts, tiny_model_path, 20)
    check_prompt_lengths(prompts, tiny_model_path, 400)
    with pytest.raises(ValueError, match="max_prompt_length=0 must be a whole number"):
        check_prompt_lengths(prompts, tiny_model_path, 0)


def test_the_recipe_checks_max_prompt_length_before_the_model_loads(recipe, tmp_path, monkeypatch):
    """The recipe runs the check on its dataset (the embedded default's digit prompts are longer than 2 tokens) and
    stops before any model is built. Fails when the recipe does not call the check."""
    from trl_nrollout.errors import DatasetError

    monkeypatch.setattr(recipe, "_trainer_class", lambda kind: pytest.fail("the model was to be loaded"))
    with pytest.raises(DatasetError, match="longer than max_prompt_length=2 tokens"):
        recipe.main(["--max_prompt_length", "2", "--output_dir", str(tmp_path / "out"), "--max_steps", "1"])


def test_the_readmes_gsm8k_trainer_figures_are_the_planners(capsys):
    """The README's GPU section quotes the trainer's memory for gsm8k_qwen.yaml as `plan --predict --device h100`
    prints it (issue 63: the README said 4-6 GiB where the planner says 8)."""
    import re

    from tests.conftest import ROOT

    code = main(["plan", "--config", str(ROOT / "recipes/configs/gsm8k_qwen.yaml"), "--model-name-or-path",
                 "Qwen/Qwen2.5-0.5B-Instruct", "--max-prompt-length", "256", "--gpu-memory-gib", "80",
                 "--gpu-memory-utilization", "0.35", "--predict", "--device", "h100", "--no-memory"])
    out = capsys.readouterr().out
    assert code == 0
    states, acts = re.search(r"trainer ([\d.]+) GiB \(weights, grads, Adam\) \+ ([\d.]+) GiB \(update activations\)",
                             out).groups()
    readme = (ROOT / "README.md").read_text()
    assert f"{states} GiB for the 0.5 B weights, gradients and\nAdamW states, plus {acts} GiB" in readme
