"""``plan --predict`` says what does not fit (and exits 3 with the fix), ``--suggest`` searches the trainer's
sharding, LoRA and the update's micro batches, one engine memory default per placement, known models offline
(issue 50)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import ROOT
from trl_nrollout.cli import EXIT_DOES_NOT_FIT, main
from trl_nrollout.plan.cost import trainer_state_bytes
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.models import KNOWN_CONFIGS, model_dims
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION
from trl_nrollout.plan.workload import Workload

#: the issue's 7B example: 6 H100s, 3 engines of TP 2, 60 prompts x n = 12
ARTICLE = ["--num-processes", "6", "--rollout-tp-size", "2", "--train-batch-size", "60", "--rollout-n", "12",
           "--model", "Qwen/Qwen2.5-7B", "--device", "h100", "--no-memory"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------- --predict's verdict
def test_predict_exits_3_naming_the_trainers_memory_and_zero3(capsys):
    """The 7B example unsharded: the figures are printed with the limit each breaks marked, and the command exits 3
    saying the trainer binds first and the change that makes everything fit (ZeRO-3). The update is priced as the
    trainer runs it: verl's batch fields without a micro batch are token-budgeted (use_dynamic_bsz's default), so the
    AdamW states bind, not a rank's whole mini batch of activations."""
    code, out, err = run(capsys, *ARTICLE, "--predict")
    assert code == EXIT_DOES_NOT_FIT == 3
    assert re.search(r"memory check\s+trainer 114 GiB \(states 113 GiB \+ update activations 0.\d+ GiB\) vs 56 GiB "
                     r"\(what the engine leaves\): DOES NOT FIT", out)
    assert re.search(r"memory check\s+engine 10.6 GiB .* vs 24 GiB \(gpu_memory_utilization 0.3 x 80 GiB\): fits", out)
    assert "the trainer binds first (114 GiB > 56 GiB" in err
    assert "Fix: trainer_sharding zero3 (trl-nrollout train --accelerate_config zero3)" in err
    # the fix, applied, fits: exit 0
    code, out, err = run(capsys, *ARTICLE, "--predict", "--trainer-sharding", "zero3")
    assert code == 0 and err == "" and "DOES NOT FIT" not in out
    code, out, _ = run(capsys, *ARTICLE, "--predict", "--json")
    assert code == 3 and json.loads(out)["prediction"]["fits"] is False


def test_predict_names_the_engine_when_its_kv_cache_binds(capsys):
    """8k-token completions on the sharded, budgeted 7B: the engine's KV cache is over its 0.3 of the device; the fix
    is the max_num_seqs that fits, and it does."""
    flags = [*ARTICLE, "--predict", "--trainer-sharding", "zero3", "--use-dynamic-bsz", "--max-completion-length",
             "8192"]
    code, out, err = run(capsys, *flags)
    assert code == 3 and "the engine binds first (59.9 GiB > 24 GiB, gpu_memory_utilization 0.3 x 80 GiB)" in err
    seqs = re.search(r"Fix: max_num_seqs (\d+)", err).group(1)
    assert run(capsys, *flags, "--max-num-seqs", seqs)[0] == 0
    assert run(capsys, *flags, "--max-num-seqs", str(int(seqs) + 8))[0] == 3


def test_lora_on_one_24_gb_device_fits(capsys):
    """A 1.5B with LoRA on one 24 GB device: frozen bf16 weights and the adapters' AdamW states (3.2 GiB), where full
    training's 16 bytes per parameter (23 GiB) do not fit beside the engine; a recipe's use_peft means its lora_r."""
    flags = ["--num-processes", "1", "--train-batch-size", "8", "--rollout-n", "8", "--model",
             "Qwen/Qwen2.5-1.5B-Instruct", "--device", "l40s", "--gpu-memory-gib", "24", "--no-memory", "--predict",
             "--use-dynamic-bsz"]
    code, out, err = run(capsys, *flags)
    assert code == 3 and "the trainer binds first" in err
    code, out, err = run(capsys, *flags, "--lora-r", "16")
    assert code == 0 and "trainer 3.15 GiB (weights, grads, Adam)" in out
    dims = model_dims("Qwen/Qwen2.5-1.5B-Instruct")
    lora = Workload(prompt_len=1, completion_mean=1, completion_max=1, lora_r=16)
    full = Workload(prompt_len=1, completion_mean=1, completion_max=1)
    assert trainer_state_bytes(dims, lora) < 0.15 * trainer_state_bytes(dims, full)


def test_lora_parameters_are_pefts_all_linear_count():
    """The adapters' parameter count is PEFT's (target_modules="all-linear") on a model built here."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    peft = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert ModelDims.from_config_dict(fields).lora_parameters(8) == trainable


def test_the_documented_rollout_ranks_predict_answers(capsys):
    """The command docs/backends.md documents (8 processes, 2 rollout ranks, 60 prompts: a batch the colocated
    comparison cannot split over 8 engines) answers instead of exiting 2; the comparison is left out with the
    reason. A split whose trainers' micro batches do not fit (a rank's whole mini batch per forward, given) says so
    with the budget that does; without the micro batch, verl's batch fields are budgeted by default (the trainer's
    use_dynamic_bsz default) and the same split fits."""
    code, out, err = run(capsys, "--num-processes", "8", "--rollout-ranks", "2", "--train-batch-size", "60",
                         "--rollout-n", "12", "--model", "Qwen/Qwen2.5-7B-Instruct", "--device", "h100", "--no-memory",
                         "--predict", "--trainer-sharding", "zero3", "--use-dynamic-bsz")
    assert code == 0, err
    assert "the same 8 devices colocated are not compared: train_batch_size=60 is not divisible" in out
    assert "this recipe (rollout_lookahead=1)" in out
    split = ["--num-processes", "16", "--nnodes", "2", "--rollout-ranks", "8", "--rollout-tp-size", "2",
             "--train-batch-size", "64", "--rollout-n", "16", "--model", "Qwen/Qwen2.5-7B-Instruct", "--device", "h100",
             "--no-memory", "--predict", "--trainer-sharding", "zero3", "--max-prompt-length", "200",
             "--max-completion-length", "1024"]
    code, out, err = run(capsys, *split, "--ppo-micro-batch-size-per-device", "128")
    assert code == 3 and "the trainer binds first" in err and "the whole device" in err
    budget = re.search(r"Fix: use_dynamic_bsz \(its default budget here: ppo_max_token_len_per_device (\d+)\)",
                       err).group(1)
    code, out, err = run(capsys, *split)
    assert code == 0 and err == "" and f"dynamic (use_dynamic_bsz): <= {int(budget):,} real tokens" in out


# ---------------------------------------------------------------------------------------------- --suggest
def test_suggest_searches_sharding_and_the_update_budget_and_prints_the_command(capsys):
    """The 7B example: unsharded nothing fits (AdamW's states alone exceed a device); --suggest tries ZeRO-2 and
    ZeRO-3, the trainer's default budget and the engine's memory fraction and sleep mode, ranks what fits within
    each candidate's own engine share (the engine within its gpu_memory_utilization of the device, the trainer
    within what the engine leaves, or the whole device where the engine sleeps), names each candidate's accelerate
    config, and prints the command of the first: the shipped accelerate config, --config, the plan's own flags and
    the layout's, under the trainer's names."""
    code, out, _ = run(capsys, *ARTICLE, "--suggest", "--json")
    d = json.loads(out)
    assert code == 0 and d["ranked"]
    device = 80 * 2**30
    for c in d["ranked"]:
        o, p = c["options"], c["prediction"]
        assert o["trainer_sharding"] in ("zero2", "zero3") and o["accelerate_config"].endswith(
            f"{o['trainer_sharding']}.yaml")
        util = o.get("gpu_memory_utilization", COLOCATED_GPU_MEMORY_UTILIZATION)
        assert p["engine_bytes"] <= util * device
        assert p["trainer_bytes"] <= (1 if o.get("vllm_enable_sleep_mode") else 1 - util) * device
    assert {c["options"].get("gpu_memory_utilization") for c in d["ranked"]} == {0.3, 0.5, 0.7}
    assert any(c["options"].get("use_dynamic_bsz") for c in d["ranked"])
    assert not any(c["options"].get("trainer_sharding") == "none" for c in d["ranked"])
    assert any(c["options"].get("trainer_sharding") == "none" for c in d["refused"])
    code, out, _ = run(capsys, *ARTICLE, "--suggest")
    first = d["ranked"][0]["options"]
    line = next(x for x in out.splitlines() if x.startswith("run the first: "))
    assert line.startswith(f"run the first: trl-nrollout train --accelerate_config {first['trainer_sharding']} "
                           "--num_processes 6 --config YOUR_RECIPE.yaml ")
    for flag in ("--train_batch_size 60", "--model_name_or_path Qwen/Qwen2.5-7B",
                 f"--rollout_tp_size {first['rollout_tp_size']}", f"--rollout_n {first['rollout_n']}",
                 f"--rollout_max_num_seqs {first['max_num_seqs']}",
                 f"--vllm_gpu_memory_utilization {first['gpu_memory_utilization']}",
                 f"--vllm_enable_sleep_mode {str(first['vllm_enable_sleep_mode']).lower()}"):
        assert f" {flag} " in f"{line} ", flag
    if first.get("use_dynamic_bsz"):
        assert f" --ppo_max_token_len_per_device {first['ppo_max_token_len_per_device']}" in line
    assert "--device" not in line and "--num-processes" not in line  # the planner's own options stay out
    # a sharding the user fixed is the only one tried
    code, out, _ = run(capsys, *ARTICLE, "--suggest", "--json", "--trainer-sharding", "zero3")
    assert {c["options"].get("trainer_sharding") for c in json.loads(out)["ranked"]} == {None}


def test_a_recipes_accelerate_config_sets_the_trainer_sharding(tmp_path, capsys):
    """verl_article.yaml launches with a ZeRO-3 accelerate config: its plan prices a ZeRO-3 trainer (and fits)."""
    from trl_nrollout.plan.figures import plan_values, sharding_of

    assert plan_values(str(ROOT / "recipes/configs/verl_article.yaml"))["trainer_sharding"] == "zero3"
    assert [sharding_of(ROOT / "recipes/accelerate" / f) for f in ("ddp.yaml", "zero2.yaml", "zero3.yaml",
                                                                   "fsdp.yaml")] == ["none", "zero2", "zero3", "fsdp"]
    code, _, err = run(capsys, "--config", str(ROOT / "recipes/configs/verl_article.yaml"), "--predict", "--device",
                       "h100", "--no-memory")
    assert code == 0, err


# ---------------------------------------------------------------------------------------------- defaults, offline
def test_one_engine_memory_default_per_placement(capsys):
    """The plan's engine fraction is the trainer's: 0.3 beside a trainer, 0.9 on a rollout rank (the config's
    defaults), in --predict's check and in the memory table's KV budget."""
    from trl_nrollout.plan.readers import engine_utilization

    assert (COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION) == (0.3, 0.9)
    assert engine_utilization({}) == 0.3 and engine_utilization({}, rollout_ranks=True) == 0.9
    assert engine_utilization({"gpu_memory_utilization": 0.5}, rollout_ranks=True) == 0.5
    code, out, _ = run(capsys, "--num-processes", "2", "--train-batch-size", "4", "--rollout-n", "4", "--model",
                       "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory-gib", "24")
    assert "24 GiB x 0.3 - weights - sampler" in out
    code, out, _ = run(capsys, "--num-processes", "2", "--rollout-ranks", "1", "--train-batch-size", "4", "--rollout-n",
                       "4", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory-gib", "24")
    assert "24 GiB x 0.9 - weights - sampler" in out


def test_the_trainers_config_has_the_plans_engine_defaults(tmp_path):
    """NRolloutConfig's default vllm_gpu_memory_utilization is the plan's for each placement."""
    from trl_nrollout.config import NRolloutConfig

    cfg = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=4, rollout_n=4, report_to="none", bf16=False,
                         use_cpu=True)
    assert cfg.vllm_gpu_memory_utilization == COLOCATED_GPU_MEMORY_UTILIZATION


def _named_models() -> set[str]:
    """Hub ids the README, the docs and the recipes name (``owner/Model-1.5B...``)."""
    pattern = re.compile(r"\b(?:Qwen|meta-llama|mistralai|google|microsoft|deepseek-ai|HuggingFaceTB)/[A-Za-z0-9._-]+")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").rglob("*.yaml"),
             ROOT / "recipes/grpo.py"]
    return {m.rstrip(".") for f in files for m in pattern.findall(f.read_text())}


def test_every_model_the_docs_name_is_known_offline(capsys, monkeypatch):
    """Each hub id the README, docs and recipes name is in KNOWN_CONFIGS, and its plan (memory, --predict) answers
    under HF_HUB_OFFLINE=1 without importing torch."""
    names = _named_models()
    assert names and names <= set(KNOWN_CONFIGS), names - set(KNOWN_CONFIGS)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    had_torch = "torch" in sys.modules
    for name in sorted(names):
        code, out, err = run(capsys, "--num-processes", "8", "--train-batch-size", "8", "--rollout-n", "8", "--model",
                             name, "--device", "h100", "--predict", "--trainer-sharding", "zero3", "--use-dynamic-bsz")
        assert code in (0, 3) and "memory per engine" in out and "unavailable" not in err, (name, err)
    if not had_torch:
        assert "torch" not in sys.modules


def test_known_models_plan_without_torch_quickly():
    """The README's GPU command offline: memory and all, torch never imported, well under 3 s."""
    import subprocess

    code = ("import sys, time; t = time.perf_counter(); from trl_nrollout.cli import main; "
            "rc = main(['plan', '--config', 'recipes/configs/gsm8k_qwen.yaml', '--model-name-or-path', "
            "'Qwen/Qwen2.5-0.5B-Instruct', '--gpu-memory-gib', '24']); "
            "print('SECONDS', time.perf_counter() - t, 'torch' in sys.modules, rc, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    seconds, torch_imported, rc = proc.stderr.split("SECONDS")[1].split()
    assert rc == "0" and torch_imported == "False" and float(seconds) < 3.0, proc.stderr
    assert "memory per engine: Qwen/Qwen2.5-0.5B-Instruct" in proc.stdout


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes/configs").glob("*.yaml")))
def test_every_recipe_plans_offline(path, capsys, monkeypatch):
    """Every recipe in recipes/configs plans on 2 processes offline: its layout and, where it names a model, the
    memory, with no warning."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run(capsys, "--config", str(ROOT / path), "--num-processes", "2")
    assert code == 0 and err == "", err
    assert "rollout layout" in out




def test_plan_reads_trls_batch_fields_as_the_trainer_does(tmp_path, capsys):
    """A recipe of TRL's batch fields (no train_batch_size) plans the layout the trainer's config derives from them
    (NRolloutConfig's own layout, compared), including an optimizer step holding part of a group (TRL's
    "0.5 prompts = 2 samples"), and TRL's rule that a generation batch holds whole groups."""
    import yaml

    from trl_nrollout.config import NRolloutConfig

    cases = [dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4),
             dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=2,
                  num_generations=4),
             dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=4, num_iterations=2)]
    for fields in cases:
        recipe = tmp_path / "trl.yaml"
        recipe.write_text(yaml.safe_dump(fields))
        code, out, err = run(capsys, "--config", str(recipe), "--num-processes", "1", "--json")
        assert code == 0, err
        plan = json.loads(out)
        cfg = NRolloutConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, **fields)
        trainer = cfg.rollout_layout(1).to_dict()
        keys = ("train_batch_size", "rollout_n", "ppo_micro_batch_size_per_device", "gradient_accumulation_steps",
                "mini_batch_samples_per_rank", "optimizer_steps_per_rollout", "ppo_epochs")
        assert {k: plan[k] for k in keys} == {k: trainer[k] for k in keys}, fields
    recipe.write_text(yaml.safe_dump(dict(per_device_train_batch_size=3, num_generations=4)))
    code, _, err = run(capsys, "--config", str(recipe), "--num-processes", "1")
    assert code == 2 and "is not divisible by num_generations=4: groups would be split" in err


def test_an_unknown_hub_model_is_read_from_the_cache_before_the_network(monkeypatch):
    """A hub id the plan does not know: its config from the local Hub cache first (no network, no retries), the
    Hub only when the cache has none."""
    from transformers import AutoConfig

    from trl_nrollout.plan.memory import load_config_dict

    calls = []

    def fake(name, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        if kwargs.get("local_files_only") and name == "someone/uncached":
            raise OSError("not in the cache")
        return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, vocab_size=100)

    monkeypatch.setattr(AutoConfig, "from_pretrained", fake)
    assert load_config_dict("someone/cached")[0]["hidden_size"] == 64 and calls == [True]
    calls.clear()
    assert load_config_dict("someone/uncached")[0]["hidden_size"] == 64 and calls == [True, False]


def test_partial_rollouts_pool_is_in_the_kv_figures(capsys):
    """rollout_partial keeps (1 + rollout_partial_oversample) x an engine's share of groups in flight: the KV
    figures (the memory table and --predict's engine memory) count them; without it, the share alone."""
    flags = ["--num-processes", "2", "--train-batch-size", "8", "--rollout-n", "8", "--model",
             "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory-gib", "24", "--device", "h100", "--predict", "--json"]
    plain = json.loads(run(capsys, *flags)[1])
    pool = json.loads(run(capsys, *flags, "--rollout-partial")[1])
    triple = json.loads(run(capsys, *flags, "--rollout-partial", "--rollout-partial-oversample", "2")[1])
    kv = [d["memory"]["kv_bytes_per_gpu"] for d in (plain, pool, triple)]
    assert kv[1] == 2 * kv[0] and kv[2] == 3 * kv[0]
    step_kv = [d["prediction"]["step"]["details"]["kv_bytes"] for d in (plain, pool, triple)]
    assert step_kv[1] > step_kv[0] and step_kv[2] > step_kv[1]
    code, _, err = run(capsys, *flags, "--rollout-partial", "--rollout-partial-oversample", "-1")
    assert code == 2 and "rollout_partial_oversample=-1.0 must be >= 0" in err
