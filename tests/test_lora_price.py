"""``rollout_lora_sync="auto"`` by price (:mod:`trl_nrollout.plan.lora`): the cost model prices a LoRA step with
merged-weight sync and with the engines serving the adapter, and ``auto`` takes the cheaper; ``plan --predict``
says which and why. Pure: datasheet profiles and known model configs (no download, no engine)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.plan.cost import predict_step
from trl_nrollout.plan.devices import PROFILES, DeviceProfile, datasheet_profile
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.lora import price_lora_sync
from trl_nrollout.plan.models import model_dims
from trl_nrollout.plan.workload import Workload
from trl_nrollout.rollout.engines.weight_sync import AUTO_ADAPTER_MAX_FRACTION, choose_lora_sync

SEVEN_B = "Qwen/Qwen2.5-7B-Instruct"


def _work(r: int, **kw) -> Workload:
    return Workload(prompt_len=256, completion_mean=512, completion_max=1024, lora_r=r, **kw)


@settings(max_examples=60, deadline=None)
@given(slowdown=st.floats(1.0, 30.0), rank=st.sampled_from([8, 16, 64, 128]),
       processes=st.sampled_from([1, 8]), device=st.sampled_from(["h100", "l40s"]))
def test_auto_takes_the_cheaper_step_and_the_price_adds_up(slowdown, rank, processes, device):
    """The choice is the mode whose predicted step is shorter, and the two steps differ by exactly the generation
    the LoRA kernels add less the sync they save (nothing else in the step depends on the mode)."""
    dims = model_dims(SEVEN_B)
    dev = replace(PROFILES[device], lora_gen_slowdown=slowdown)
    layout = RolloutLayout.build(num_processes=processes, train_batch_size=8 * processes, rollout_n=8)
    price = price_lora_sync(dims, layout, _work(rank), dev)
    merged = predict_step(dims, layout, _work(rank), dev).total_s
    adapter = predict_step(dims, layout, _work(rank, lora_sync="adapter"), dev).total_s
    assert price.merged_s == pytest.approx(merged) and price.adapter_s == pytest.approx(adapter)
    assert price.choice == ("adapter" if adapter < merged else "merged")
    assert adapter - merged == pytest.approx(price.generation_added_s - price.sync_saved_s, rel=1e-9, abs=1e-9)
    assert price.sync_saved_s > 0 and price.generation_added_s >= 0


def test_the_choice_flips_with_the_kernels_price_not_with_the_bytes():
    """Same model, same adapter (rank 16: 0.5% of a 7B's bytes, far under the size rule's quarter), same layout: a
    device whose LoRA kernels cost nothing takes the adapter, one whose kernels double the generation takes merged
    weights. A rule by bytes alone gives the adapter both times."""
    dims = model_dims(SEVEN_B)
    layout = RolloutLayout.build(num_processes=8, train_batch_size=64, rollout_n=8)
    free = price_lora_sync(dims, layout, _work(16), replace(PROFILES["h100"], lora_gen_slowdown=1.0))
    dear = price_lora_sync(dims, layout, _work(16), replace(PROFILES["h100"], lora_gen_slowdown=2.0))
    assert dims.lora_parameters(16) < AUTO_ADAPTER_MAX_FRACTION * dims.num_parameters
    assert (free.choice, dear.choice) == ("adapter", "merged")
    # the trainer's rule follows the price where one is given, the size rule where none is
    kw = dict(adapter=dims.lora_parameters(16) * 2, model=dims.num_parameters * 2)
    assert choose_lora_sync("auto", **kw, refusal=None, priced=dear.choice) == "merged"
    assert choose_lora_sync("auto", **kw, refusal=None) == "adapter"
    assert choose_lora_sync("auto", **kw, refusal="DoRA", priced="adapter") == "merged"  # engines cannot serve it


def test_adapter_sync_moves_the_adapters_bytes_and_generates_at_the_slowdown():
    """The prediction with adapter sync: the weight sync's bytes are the adapter's (rank r on every linear layer, or
    the trainer's own adapter's bytes when given), no sharded-model gather, and the generation is the merged one's
    times the device's slowdown at that rank."""
    dims = model_dims(SEVEN_B)
    dev = replace(PROFILES["h100"], lora_gen_slowdown=1.5, lora_gen_rank=16)
    layout = RolloutLayout.build(num_processes=8, train_batch_size=64, rollout_n=8)
    merged = predict_step(dims, layout, _work(32, sharded=True), dev)
    adapter = predict_step(dims, layout, _work(32, sharded=True, lora_sync="adapter"), dev)
    assert merged.details["weight_sync_bytes"] == dims.num_parameters * dims.dtype_bytes
    assert adapter.details["weight_sync_bytes"] == dims.lora_parameters(32) * dims.dtype_bytes
    assert adapter.phases["generation"] == pytest.approx(merged.phases["generation"] * 2.0)  # 1 + 0.5 x 32 / 16
    assert adapter.phases["weight_sync"] == pytest.approx(dev.sync_s + adapter.details["weight_sync_bytes"]
                                                          / dev.weight_sync_bw)
    own = predict_step(dims, layout, _work(32, lora_sync="adapter", lora_adapter_bytes=12345), dev)
    assert own.details["weight_sync_bytes"] == 12345


def test_rollout_ranks_price_the_transfer_of_the_adapter():
    """On rollout ranks the merged step moves the model through host memory over gloo each step; the adapter's
    transfer is its bytes', so a 7B on H100s with a few-percent LoRA slowdown takes the adapter there."""
    dims = model_dims(SEVEN_B)
    dev = replace(PROFILES["h100"], lora_gen_slowdown=1.05)
    trainers = RolloutLayout.build(num_processes=4, train_batch_size=64, rollout_n=8)
    engines = RolloutLayout.build(num_processes=4, train_batch_size=64, rollout_n=8)
    price = price_lora_sync(dims, trainers, _work(16), dev, engines=engines, staleness=0)
    assert price.choice == "adapter" and price.sync_saved_s > 1.0  # 15 GB over gloo at 5 GB/s: seconds


def test_a_profile_checks_its_lora_figures():
    with pytest.raises(ValueError, match="lora_gen_slowdown=0.5 must be >= 1"):
        replace(PROFILES["h100"], lora_gen_slowdown=0.5)
    with pytest.raises(ValueError, match="lora_gen_rank=0 must be > 0"):
        replace(PROFILES["h100"], lora_gen_rank=0)
    assert DeviceProfile.from_dict(PROFILES["h100"].to_dict()) == PROFILES["h100"]


@pytest.mark.parametrize(("name", "memory", "profile"), [
    ("NVIDIA H100 80GB HBM3", 79.6, "h100"), ("NVIDIA H200", 139.8, "h200"), ("NVIDIA A100-SXM4-80GB", 79.2,
                                                                             "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40gb"), ("NVIDIA L40S", 44.5, "l40s"), ("NVIDIA GeForce RTX 4090", 24, None)])
def test_a_gpu_torch_names_finds_its_datasheet(name, memory, profile):
    got = datasheet_profile(name, memory)
    assert (got.name if got else None) == profile


def test_plan_predict_says_what_auto_chose(tmp_path, capsys):
    """`plan --predict --lora-r 16` prices rollout_lora_sync='auto' as the trainer does and says why; an explicit mode
    is priced as given; the weight sync's row gives the bytes."""
    from trl_nrollout.cli import main

    base = ["plan", "--model", SEVEN_B, "--num-processes", "8", "--train-batch-size", "64", "--rollout-n", "8",
            "--predict", "--no-memory", "--lora-r", "16", "--max-prompt-length", "512", "--max-completion-length",
            "1024", "--gpu-memory-gib", "141"]
    outs = {}
    for slowdown in (1.0, 3.0):
        profile = tmp_path / f"dev{slowdown}.json"
        profile.write_text(json.dumps(replace(PROFILES["h100"], name="x", lora_gen_slowdown=slowdown).to_dict()))
        assert main([*base, "--device", str(profile), "--json"]) == 0
        outs[slowdown] = json.loads(capsys.readouterr().out)["prediction"]
    assert outs[1.0]["workload"]["lora_sync"] == "adapter" and outs[3.0]["workload"]["lora_sync"] == "merged"
    assert any("rollout_lora_sync='auto' -> 'merged'" in n for n in outs[3.0]["notes"])
    assert main([*base, "--device", "h100", "--rollout-lora-sync", "adapter"]) == 0
    out = capsys.readouterr().out
    assert "weight sync" in out and "MiB per sync (the LoRA adapter: the engines serve it)" in out
    assert "rollout_lora_sync='auto'" not in out
    assert main([*base, "--device", "h100", "--rollout-lora-sync", "lora"]) != 0
    assert "rollout_lora_sync='lora' must be 'merged', 'adapter' or 'auto'" in capsys.readouterr().err


def test_the_config_checks_the_device_option(tmp_path):
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert NRolloutConfig(**common, rollout_lora_sync_device="h100").rollout_lora_sync_device == "h100"
    with pytest.raises(InputError, match="rollout_lora_sync_device='tpu-v9'.*not a known profile.*--calibrate"):
        NRolloutConfig(**common, rollout_lora_sync_device="tpu-v9")
    with pytest.raises(InputError, match="rollout_lora_sync_device='h100' prices rollout_lora_sync='auto'.*'merged'"):
        NRolloutConfig(**common, rollout_lora_sync="merged", rollout_lora_sync_device="h100")


def priced_workload(trainer, monkeypatch) -> Workload:
    """The workload ``trainer``'s ``rollout_lora_sync='auto'`` prices (its engine set-up's ``_lora_sync_priced``) on an
    H100 as torch would name it (this machine has no GPU: the device's properties are the one stand-in; the price is
    the plan's own function, its input captured)."""
    import torch

    import trl_nrollout.plan.lora as lora_module
    from trl_nrollout.rollout.engines.weight_sync import adapter_bytes

    seen = []
    real = lora_module.price_lora_sync
    monkeypatch.setattr(lora_module, "price_lora_sync", lambda dims, layout, work, dev, **kw: seen.append(work)
                        or real(dims, layout, work, dev, **kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type(
        "Props", (), {"name": "NVIDIA H100 80GB HBM3", "total_memory": 80 * 2**30})())
    inner = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.engine_setup._lora_sync_priced(inner, adapter_bytes(inner)[0]) in ("adapter", "merged")
    return seen[0]


@pytest.mark.slow
def test_lora_pricing_asks_which_frozen_passes_run(tmp_path, monkeypatch):
    """``rollout_lora_sync='auto'`` prices the step with the passes that really run, not with ``beta > 0``: a LoRA
    GRPO policy with beta=0 and the KL in the reward runs a reference pass (the base with the adapter off), so the
    priced workload has one (``kl``); a GRPO policy with a teacher prices the teacher's forward (its dimensions); the
    distillation drop-in, whose ``beta`` is the JSD's interpolation (0.5), holds no reference but a teacher.
    Mutation: the old ``kl=args.beta > 0`` and no teacher -> every case fails."""
    from peft import LoraConfig

    from trl_nrollout import (
        NRolloutConfig,
        NRolloutDistillationConfig,
        NRolloutDistillationTrainer,
        NRolloutGRPOTrainer,
    )
    from trl_nrollout.builtin import digits_dataset, digits_reward

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    common = dict(use_cpu=True, report_to="none", max_steps=1, save_strategy="no", rollout_backend="hf",
                  max_completion_length=8)
    grpo = dict(per_device_train_batch_size=4, num_generations=2, **common)
    kl_in_reward = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], peft_config=lora,
                                       train_dataset=digits_dataset(8), args=NRolloutConfig(
                                           output_dir=str(tmp_path / "a"), beta=0.0, use_kl_in_reward=True, **grpo))
    work = priced_workload(kl_in_reward, monkeypatch)
    assert work.kl and work.teacher is None
    teacher = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], peft_config=lora,
                                  train_dataset=digits_dataset(8), args=NRolloutConfig(
                                      output_dir=str(tmp_path / "b"), beta=0.0, **grpo,
                                      teacher_model_name_or_path="builtin:tiny-qwen2-longtail"))
    work = priced_workload(teacher, monkeypatch)
    assert not work.kl and work.teacher is not None and work.teacher.num_parameters > 0
    distill = NRolloutDistillationTrainer("builtin:tiny-qwen2", teacher_model="builtin:tiny-qwen2-longtail",
                                          peft_config=lora, train_dataset=digits_dataset(8),
                                          args=NRolloutDistillationConfig(output_dir=str(tmp_path / "c"), beta=0.5,
                                                                          per_device_train_batch_size=4, **common))
    work = priced_workload(distill, monkeypatch)
    assert not work.kl and work.teacher is not None
