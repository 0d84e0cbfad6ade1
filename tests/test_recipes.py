"""Every shipped recipe is valid before anything runs (`plan`, the recipe parser) and every CPU recipe trains:
each estimator family and loss option is reachable from a recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from trl_nrollout.errors import InputError

RECIPES = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
CPU_RECIPES = [r for r in RECIPES if yaml.safe_load(r.read_text()).get("use_cpu")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_plan_accepts_every_recipe(recipe, capsys):
    from trl_nrollout.cli import main

    assert main(["plan", "--config", str(recipe), "--no-memory", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    data = yaml.safe_load(recipe.read_text())
    if data.get("trainer") == "distill":  # one completion per prompt, per_device_train_batch_size prompts a rank
        assert plan["total_samples"] == data["per_device_train_batch_size"] * data["gradient_accumulation_steps"]
        return
    assert plan["total_samples"] == data["train_batch_size"] * data["rollout_n"]


def test_the_verl_article_recipe_is_the_worked_example(capsys):
    from trl_nrollout.cli import main

    main(["plan", "--config", str(ROOT / "recipes/configs/verl_article.yaml"), "--no-memory", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_engines"] == 3 and plan["engine_ranks"] == [[0, 1], [2, 3], [4, 5]]
    assert plan["prompts_per_engine"] == 20 and plan["samples_per_engine"] == 240 and plan["total_samples"] == 720
    assert plan["log_prob_micro_batch_size_per_device"] == 8


#: what each CPU recipe exists for, as its logged steps show it (beyond its options reaching the trainer)
RECIPE_METRICS = {"dapo": ("dynamic_sampling/rounds", "clip_ratio/high_mean"),
                  "reinforce_pp": ("actor/reward_kl_penalty",),  # its KL in the reward
                  "ppo": ("critic/vf_loss", "critic/values/mean")}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in CPU_RECIPES if r.stem != "default"  # (distill: test_train_command)
                                    and yaml.safe_load(r.read_text()).get("trainer") != "distill"], ids=lambda p: p.stem)
def test_cpu_recipes_train(recipe, tmp_path, monkeypatch):
    """Every CPU recipe trains two steps (in this process: ``main`` is what `accelerate launch recipes/grpo.py`
    calls; test_trainer runs `make demo` through the real launcher), with each of its options on the trainer's
    config as the recipe says (the estimator family and loss options are reachable from a recipe), and the metrics
    its estimator or option logs in every step. Mutation tried: the recipe's YAML values not applied (only the
    command line) -> the config comparison fails."""
    from tests.conftest import load_recipe

    recipe_main = load_recipe()
    built = []
    make = recipe_main._trainer_class

    def capturing(kind):
        cls = make(kind)

        def build(*args, **kwargs):
            built.append(cls(*args, **kwargs))
            return built[-1]
        return build

    monkeypatch.setattr(recipe_main, "_trainer_class", capturing)
    recipe_main.main(["--config", str(recipe), "--output_dir", str(tmp_path), "--max_steps", "2",
                      "--rollout_backend", "hf"])
    data = yaml.safe_load(recipe.read_text())
    args = built[0].args
    fields = {k: v for k, v in data.items() if k in type(args).__dataclass_fields__
              and k not in ("output_dir", "max_steps", "rollout_backend", "report_to")}  # (transformers: 'none' -> [])
    assert {k: getattr(args, k) for k in fields} == fields  # every option of the recipe reached the trainer
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["adv_estimator"] == data["adv_estimator"]
    history = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in h and "reward" in h]
    assert history and all(abs(h["loss"]) < 1e6 for h in history)  # (ppo_mini_batch_size: 2 steps, 1 rollout)
    for key in RECIPE_METRICS.get(recipe.stem, ()):
        assert all(key in h for h in history), f"{recipe.stem}: {key} not logged"


def _gsm8k_like(folder: Path) -> Path:
    """A local dataset shaped like the hub's openai/gsm8k: a `main` configuration, `question` / `answer` columns,
    answers ending in `#### <number>` (as the real ones do)."""
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"Tom has {a} + {b} = {a + b} apples.\n#### {a + b}"} for a in range(2, 10) for b in (3, 5)]
    (folder / "main").mkdir(parents=True)
    (folder / "main" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                      "    path: main/train.jsonl\n---\n")
    return folder


@pytest.mark.slow
@pytest.mark.vllm
def test_gsm8k_recipe_loads_and_trains_on_local_stand_ins(recipe, tmp_path):
    """recipes/configs/gsm8k_qwen.yaml, offline: the real recipe with only the model and the dataset replaced by
    local stand-ins of the same shape (the built-in Qwen2 model; a GSM8K-shaped dataset with its `main` config),
    and the sizes cut for a CPU. Its dataset config, prompt column, system prompt (chat prompts through the model's
    chat template) and math_answer reward against `#### N` answers all run."""
    data = _gsm8k_like(tmp_path / "gsm8k")
    from trl_nrollout.recipe.data import load_prompts

    ds = load_prompts(str(data), config="main", prompt_column="question", system_prompt="Solve it.")
    assert ds[0]["prompt"][0] == {"role": "system", "content": "Solve it."} and ds[0]["prompt"][1]["role"] == "user"
    from trl_nrollout.recipe.rewards import math_answer_reward

    assert math_answer_reward(["<answer>5</answer>", "<answer>6</answer>"], answer=[ds[0]["answer"]] * 2) == \
        [1.0, 0.0]  # ds[0]: 2 + 3
    out = tmp_path / "run"
    recipe.main(["--config", str(ROOT / "recipes/configs/gsm8k_qwen.yaml"), "--model_name_or_path",
                 "builtin:tiny-qwen2", "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "2",
                 "--train_batch_size", "8", "--rollout_n", "4", "--ppo_mini_batch_size", "8",
                 "--ppo_micro_batch_size_per_device", "16", "--max_completion_length", "16", "--use_cpu", "true",
                 "--bf16", "false", "--gradient_checkpointing", "false", "--save_strategy", "no"])
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollout_backend"] == "vllm"
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    assert all("rewards/math_answer_reward/mean" in h for h in history)


def test_the_recipe_picks_the_trainer_from_the_command_line_or_the_recipe(recipe):
    grpo = recipe
    ppo = str(ROOT / "recipes/configs/ppo.yaml")
    argv, kind = grpo._resolve_recipe(["--config", ppo, "--max_steps", "2"])
    assert kind == "ppo" and argv[-2:] == ["--max_steps", "2"]
    assert "trainer" not in yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())  # not a config field
    assert grpo._resolve_recipe(["--config", ppo, "--trainer", "grpo"])[1] == "grpo"  # the command line wins
    assert grpo._resolve_recipe(["--trainer=ppo"])[1] == "ppo"  # the embedded default recipe, trained by PPO
    assert grpo._resolve_recipe([])[1] == "grpo"
    assert grpo._trainer_class("ppo").__name__ == "NRolloutPPOTrainer"
    assert grpo._config_class("ppo").__name__ == "NRolloutPPOConfig"
    with pytest.raises(InputError, match="--trainer 'sac': use one of"):
        grpo._config_class("sac")


@pytest.mark.slow
@pytest.mark.vllm
def test_the_recipe_trains_lora_with_trls_options(recipe, tmp_path):
    """`--use_peft true --lora_r 4 --lora_target_modules q_proj v_proj` (TRL's ModelConfig names): the adapters train
    with a KL loss against the base model, the vLLM engine gets the merged weights (its log-probs are the
    trainer's; LoRA dropout off, which would make the training forward differ), and the output folder holds the
    adapter as configured."""
    recipe.main(["--output_dir", str(tmp_path), "--max_steps", "3", "--use_peft", "true", "--lora_r", "4",
                 "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj", "--lora_dropout", "0",
                 "--use_kl_loss", "true", "--kl_loss_coef", "0.01", "--use_cpu", "true"])
    adapter = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert not (tmp_path / "model.safetensors").exists()  # the adapter, not a full copy of the model
    steps = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "reward" in h]
    assert len(steps) == 3 and max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 1e-4
    assert steps[0]["actor/kl_loss"] < 1e-5 < steps[-1]["actor/kl_loss"]  # the base model is the reference


def test_lora_options_without_use_peft_are_an_error(recipe):
    grpo = recipe
    with pytest.raises(InputError, match="lora_r=8, lora_target_modules=.*set without use_peft: add --use_peft"):
        grpo.main(["--lora_r", "8", "--lora_target_modules", "all-linear", "--max_steps", "1"])
    assert grpo.ScriptArguments().peft_config() is None
    config = grpo.ScriptArguments(use_peft=True, lora_r=8, lora_target_modules=["all-linear"]).peft_config()
    assert (config.r, config.lora_alpha, config.target_modules, config.bias) == (8, 32, "all-linear", "none")


@pytest.mark.slow
def test_push_to_hub_pushes_the_trained_model_at_the_end(recipe, tmp_path, monkeypatch):
    """`push_to_hub: true` is acted on by scripts, not by Trainer.train: as TRL's scripts, the recipe saves the model
    (which pushes it, transformers' save_model) and then pushes with the dataset named for the model card, both
    after training. The Hub itself is replaced by a recorder (no network here)."""
    from transformers import Trainer

    import trl_nrollout.trainer.grpo as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, token=None: calls.append(("init", None)))
    monkeypatch.setattr(Trainer, "push_to_hub", lambda self, **kw: calls.append(("push", self.state.global_step,
                                                                                   kw)))
    summary = recipe.main(["--output_dir", str(tmp_path), "--max_steps", "1", "--push_to_hub", "true",
                           "--hub_model_id", "someone/tiny-digits", "--dataset_num_prompts", "16"])
    assert summary["steps"] == 1
    assert calls[-1] == ("push", 1, {"dataset_name": "builtin:digits"})
    assert all(c[1] == 1 for c in calls if c[0] == "push")  # after the training step, not before


@pytest.mark.slow
@pytest.mark.vllm
def test_the_recipe_trains_twice_in_one_process_on_vllm(recipe, tmp_path):
    """``main`` twice in one process (a notebook, a sweep, these tests): the first run's engine releases vLLM's process
    groups with the default group it created, so the second engine starts (it used to fail on the first run's
    groups, and rollout_backend='auto' then fell back to the HF engine)."""
    for run in ("first", "second"):
        summary = recipe.main(["--output_dir", str(tmp_path / run), "--max_steps", "1", "--train_batch_size", "8",
                               "--use_cpu", "true", "--save_strategy", "no"])
        assert summary["steps"] == 1 and summary["rollout_backend"] == "vllm", (run, summary)
