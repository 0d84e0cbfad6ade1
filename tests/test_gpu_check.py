"""scripts/gpu_check.py (the training-side GPU checks) runs end to end on the CPU in --dry-run mode: the same code
paths at small sizes, so the script a lent GPU will run is known to work before the GPU's minutes are spent."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT, run_cmd


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    run_cmd([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", "--no-launches", "--out", str(out)],
            timeout=400)
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert all(report[k] == {"status": "skipped", "missing": ["--no-launches"], "seconds": 0.0}
               for k in ("lora_vllm", "rollout_rank", "sharded_budgets"))  # their judges: test_the_launch_sections_...
    prec = report["logprob_precision"]
    assert prec["status"] == "ok" and prec["all_finite"]
    assert 0 < prec["bf16_vs_fp32_max_abs"] < 0.1  # bf16 rounding, not a wrong token or position
    assert prec["lean_vs_full_bf16_max_abs"] < 1e-2
    rows = report["logprob_memory"]["rows"]
    assert [r["n"] for r in rows] == [4, 8, 12]
    assert [r["forwards"] for r in rows] == [r["samples"] // report["logprob_memory"]["micro_batch"] for r in rows]
    packing = report["packing"]
    assert packing["status"] == "ok" and packing["all_finite"] and packing["grads_finite"]
    assert packing["logprob_max_abs_diff"] < 0.1 and packing["grad_rel_diff"] < 0.05  # bf16 rounding only
    assert packing["packed_tokens"] < packing["plain_tokens"]
    trainer = report["trainer"]
    assert trainer["status"] == "ok" and trainer["steps"] == 3 and trainer["losses_finite"]
    assert abs(trainer["reward_kl_penalty"][0]) < 1e-6 < trainer["reward_kl_penalty"][-1]
    autocast = report["passes_autocast"]
    assert autocast["status"] == "ok" and autocast["autocast_pass_vs_update_max_abs"] < autocast[
        "fp32_pass_vs_update_max_abs"]
    prefill = report["prefill_once"]
    assert prefill["status"] == "ok" and prefill["same_samples"] and prefill["shared_samples"] > 0
    rates = report["training_rates"]  # plan --calibrate's training side, without vLLM
    assert rates["status"] == "ok" and 0 < rates["mfu_train"] <= 1 and 0 < rates["mfu_attention"] <= 1
    assert rates["seconds_per_pair"] > 0 and rates["optimizer_bw"] > 0 and rates["profile"] is None  # no named CPU
    assert report["padding_free"]["status"] == "ok"  # its numbers: test_sections_whose_modules_are_missing...
    # issue 62's GPU paths: Ulysses on a one-rank group (gloo here, nccl on the GPU), the scored-rows head's memory,
    # the tied-head refusal
    sp = report["sp_nccl"]
    assert sp["status"] == "ok", sp
    assert report["budgets"]["status"] == "ok", report["budgets"]
    tied = report["tied_head"]
    assert tied["status"] == "ok" and tied["shared_accepted"] and tied["untied_accepted"], tied


@pytest.mark.slow  # padding_free runs flex_attention in a child process
def test_sections_whose_modules_are_missing_are_skipped(tmp_path, monkeypatch):
    """A lent GPU machine has torch and transformers but not TRL: the sections that need TRL say so and are skipped,
    the others run, and the exit status is 0 when those pass. ``padding_free`` (issue 45) runs there alone: packed
    rows give the padded layout's log-probs under SDPA and eager (float32), the packed rows without their block mask
    do not (the negative control), flash-attention is reported unavailable on the CPU, and the long-tailed batch
    costs packed rows fewer slots than padded ones. Mutations: the block mask dropped from the packed layout (the
    equality fails), the control given the mask (it no longer differs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    real = importlib.util.find_spec
    # the lent GPU machine has torch and transformers, neither of these (DeepSpeed is not hidden: accelerate and
    # transformers, imported meanwhile, would keep a DeepSpeed-less state for the tests after this one)
    hidden = ("trl", "vllm")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    out = tmp_path / "report.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--only", "trainer", "passes_autocast",
                           "padding_free", "lora_vllm", "rollout_rank", "sharded_budgets"]) == 0
    report = json.loads(out.read_text())
    assert report["trainer"]["status"] == "skipped" and report["trainer"]["missing"] == ["trl"]
    assert {k: report[k]["missing"] for k in ("lora_vllm", "rollout_rank", "sharded_budgets")} == {
        "lora_vllm": ["trl", "vllm"], "rollout_rank": ["trl", "vllm"], "sharded_budgets": ["trl"]}
    assert all(report[k]["status"] == "skipped" for k in ("lora_vllm", "rollout_rank", "sharded_budgets"))
    assert report["passes_autocast"]["status"] == "ok" and "logprob_memory" not in report
    pf = report["padding_free"]
    assert pf["status"] == "ok", pf
    eq = pf["equality"]
    assert set(eq) >= {"sdpa", "eager"} and all(v["finite"] and v["tokens"] > 20 for v in eq.values())
    assert eq["sdpa"]["max_abs_diff"] < 1e-4 and eq["eager"]["max_abs_diff"] < 1e-4
    assert pf["sdpa_without_mask_max_abs_diff"] > 1e-2 > 100 * eq["sdpa"]["max_abs_diff"]  # the mask matters
    assert pf["unavailable"]["flash_attention_2"] == "no CUDA device"
    speed = pf["speed"]
    assert speed["tailed_max"] > 2 * speed["tailed_mean"]  # a long tail, against uniform lengths of equal tokens
    for layout in ("padded", "packed"):
        assert speed[layout]["tailed_over_uniform"] > 0
    memory = pf["memory"]
    assert memory["packed"]["one_long_slots"] < memory["padded"]["one_long_slots"]
    assert memory["packed"]["short_peak_mib"] is None and memory["goal_packed_ok"] is None  # no CUDA allocator



def _gpu_section(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gpu_section_{name}", ROOT / "scripts/gpu_sections" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launch_sections_pass_what_they_exist_for_and_fail_the_defects():
    """The pass criteria of the sections that start engines and launches (``lora_vllm``, ``rollout_rank``,
    ``sharded_budgets``; run on the CPU by hand: ``python scripts/gpu_check.py --dry-run --only SECTION``, each
    about a minute, too long for the suite), on figures as the runs report them: a good run passes; an engine left on
    the base adapter, a sync of the whole model, a run that is not one step off, a version that did not travel, a
    ZeRO-3 budget that counted the partitioned parameters (0, item 4), a peak over the plan's bytes each fail, naming
    the defect: each defective run is a mutation of the good one that its judge must fail."""
    lora = _gpu_section("lora_vllm")
    step = {"rollout_corr/logprob_abs_diff_mean": 2e-5, "rollout_corr/logprob_abs_diff_max": 1e-4,
            "weight_sync/mb": 0.2, "actor/kl_loss": 0.0, "loss": 0.1}
    good = {"lora_sync": "adapter", "adapter_mb": 0.2, "steps": 3,
            "per_step": [dict(step, **{"weight_sync/mb": 1.5}), step, dict(step, **{"actor/kl_loss": 3e-4})]}
    assert lora.judge(good, "cpu") == {"status": "ok"}
    stale = dict(good, per_step=[dict(s, **{"rollout_corr/logprob_abs_diff_mean": 0.3}) for s in good["per_step"]])
    assert "does not sample from the adapter" in lora.judge(stale, "cpu")["why"]
    assert lora.judge(stale, "cuda")["status"] == "failed"  # 0.3 is over bf16 rounding too
    whole = dict(good, per_step=[dict(s, **{"weight_sync/mb": 1.5}) for s in good["per_step"]])
    assert "not the adapter's bytes" in lora.judge(whole, "cpu")["why"]
    assert "chose lora_sync='merged'" in lora.judge(dict(good, lora_sync="merged"), "cpu")["why"]

    ranks = _gpu_section("rollout_rank")
    run = [{"rollout/staleness": lag, "loss": 0.1, "reward": 0.5, "rollout_corr/logprob_abs_diff_mean": 1e-7,
            "weight_sync/transfer_mb": mb} for lag, mb in ((0, 1.5), (1, 1.5), (1, 1.5), (1, None))]
    assert ranks.judge(run, "cuda", 4) == {"status": "ok"}
    assert "not one step off" in ranks.judge([dict(h, **{"rollout/staleness": 0}) for h in run], "cuda", 4)["why"]
    assert "did not travel" in ranks.judge([dict(h, **{"weight_sync/transfer_mb": None}) for h in run], "cuda",
                                           4)["why"]
    assert "synchronous first step" in ranks.judge(
        [dict(run[0], **{"rollout_corr/logprob_abs_diff_mean": 0.2})] + run[1:], "cuda", 4)["why"]

    budgets = _gpu_section("sharded_budgets")
    got = {"params_counted": 300, "steps": 2, "peak_gib": 3.0, "plan_gib": 4.0, "peak_over_plan": 0.75}
    assert budgets.judge(got, 300, 2, cuda=True) == {"status": "ok"}
    assert "counted 0 parameters of 300" in budgets.judge(dict(got, params_counted=0), 300, 2, cuda=True)["why"]
    assert "over the plan" in budgets.judge(dict(got, peak_gib=5.0, peak_over_plan=1.25), 300, 2, cuda=True)["why"]
    assert budgets.judge({"params_counted": 300, "steps": 1}, 300, 1, cuda=False) == {"status": "ok"}  # no peak


# ------------------------------------------------------------------ plan --calibrate on an accelerator (issue 44)
def test_calibration_trainer_runs_train_on_the_accelerator_in_its_precision():
    """``plan --calibrate``'s GRPO runs: on the CPU only where there is no accelerator, bfloat16 where the device
    has it (they ran with use_cpu=True on CUDA: the trainer's costs of a CPU run beside a GPU's measurements).
    Shown failing with the old arguments (use_cpu=True, bf16 whenever CUDA is there)."""
    from trl_nrollout.plan.measure import bf16_supported, trainer_device_args

    assert trainer_device_args("cpu", False) == {"use_cpu": True, "bf16": False}
    assert trainer_device_args("cpu", True) == {"use_cpu": True, "bf16": False}  # float32, as the CPU's measurements
    assert trainer_device_args("cuda", True) == {"use_cpu": False, "bf16": True}
    assert trainer_device_args("cuda", False) == {"use_cpu": False, "bf16": False}  # a GPU without bfloat16
    assert trainer_device_args("xpu", True) == {"use_cpu": False, "bf16": True}
    assert bf16_supported("cpu") is False


def test_calibration_timings_synchronize_the_models_device_before_each_clock_read(monkeypatch):
    """Every clock read of the training measurements (forward + backward, and the optimizer step, which was timed
    without one) comes right after a synchronize of the model's device: on a GPU the step's kernels are then
    timed, not their launch. A CPU run, the clock and the synchronize observed. Shown failing with the optimizer
    step timed as before (``on`` left at its default: nothing of the model's synchronized)."""
    import types

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_nrollout.plan import measure as calibrate
    from trl_nrollout.plan.dims import ModelDims

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    events: list = []
    real_sync, real_time = calibrate.synchronize, calibrate.time

    def sync(*where):
        events.append(("sync", where))
        real_sync(*where)

    def clock():
        events.append(("clock",))
        return real_time.perf_counter()

    monkeypatch.setattr(calibrate, "synchronize", sync)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=clock, strftime=real_time.strftime))
    rates = calibrate.measure_training(model, ModelDims.from_config_dict(model.config.to_dict(), dtype="float32"),
                                       1e10, "cpu", long=64, vocab=64)
    assert rates["optimizer_bw"] > 0
    clocks = [i for i, e in enumerate(events) if e[0] == "clock"]
    assert len(clocks) == 2 * (3 * 3 + 3)  # three shapes and the optimizer step, three timed repeats each
    assert all(events[i - 1] == ("sync", (model,)) for i in clocks), [events[i - 1] for i in clocks]


def test_synchronize_waits_for_the_accelerator_the_tensors_are_on(monkeypatch):
    """:func:`~trl_nrollout.plan.measure.synchronize` waits for each accelerator its arguments are on, once, and
    not for the CPU. There is no GPU here: ``torch.accelerator.synchronize`` is replaced by a recorder (a mock only
    for the GPU), given a CUDA device beside CPU tensors and a CPU module."""
    import torch

    from trl_nrollout.plan.measure import synchronize

    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(device))
    synchronize(torch.zeros(2), torch.nn.Linear(2, 2), "cpu")
    assert calls == []
    synchronize(torch.device("cuda", 1), "cuda:1", torch.zeros(2))
    assert calls == [torch.device("cuda", 1)]
