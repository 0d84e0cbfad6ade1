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
    run_cmd([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", "--out", str(out)], timeout=400)
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
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


def test_sections_whose_modules_are_missing_are_skipped(tmp_path, monkeypatch):
    """A lent GPU machine has torch and transformers but not TRL: the sections that need TRL say so and are skipped,
    the others run, and the exit status is 0 when those pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    out = tmp_path / "report.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--only", "trainer", "passes_autocast"]) == 0
    report = json.loads(out.read_text())
    assert report["trainer"]["status"] == "skipped" and report["trainer"]["missing"] == ["trl"]
    assert report["passes_autocast"]["status"] == "ok" and "logprob_memory" not in report

