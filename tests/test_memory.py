"""KV-cache and weight estimates checked against hand arithmetic."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.memory import (
    DEFAULT_N_VALUES,
    ModelShape,
    check_model_fits_layout,
    count_parameters,
    dtype_bytes,
    estimate_kv,
    estimate_memory,
    fmt_bytes,
    kv_bytes_per_token,
    kv_heads_per_gpu,
    load_config_dict,
    load_model_shape,
    weights_bytes_per_gpu,
)

EXAMPLE = RolloutLayout.build(num_processes=6, rollout_tp_size=2, train_batch_size=60, rollout_n=12,
                              log_prob_micro_batch_size=48)

# A 7B Qwen2 (Qwen2-7B's config.json, trimmed).
QWEN2_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "dtype": "bfloat16",
}


# ---------------------------------------------------------------------------------------------- bytes per token
def test_7b_qwen2_bytes_per_token():
    assert kv_bytes_per_token(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2) == 57344
    shape = ModelShape.from_config_dict(QWEN2_7B)
    assert (shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, shape.dtype) == (28, 4, 128, "bfloat16")
    kv = estimate_kv(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2, prompt_len=1, response_len=0,
                     prompts_per_engine=1, n=1)
    assert kv.bytes_per_token == kv.bytes_per_token_per_gpu == 57344


def test_kv_heads_split_over_tp_at_least_one():
    assert [kv_heads_per_gpu(4, tp) for tp in (1, 2, 4, 8)] == [4, 2, 1, 1]
    kv8 = estimate_kv(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2, prompt_len=16, response_len=16,
                      prompts_per_engine=2, n=2, tp_size=8)
    assert kv8.bytes_per_token_per_gpu == 57344 // 4  # one head per GPU (replicated)
    assert kv8.bytes_per_engine == 8 * kv8.bytes_per_gpu


def test_config_fallbacks_and_dtypes():
    no_gqa = ModelShape.from_config_dict({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512})
    assert no_gqa.num_key_value_heads == 8 and no_gqa.head_dim == 64 and no_gqa.dtype == "bfloat16"
    explicit = ModelShape.from_config_dict({**QWEN2_7B, "head_dim": 256, "num_key_value_heads": None,
                                            "torch_dtype": "float16", "dtype": None})
    assert explicit.head_dim == 256 and explicit.num_key_value_heads == 28 and explicit.dtype_bytes == 2
    assert ModelShape.from_config_dict(QWEN2_7B, dtype="torch.float32").dtype_bytes == 4
    assert ModelShape.from_config_dict(QWEN2_7B, dtype="auto").dtype == "bfloat16"
    nested = ModelShape.from_config_dict({"model_type": "llava", "dtype": "float16",
                                          "text_config": {k: v for k, v in QWEN2_7B.items() if k != "dtype"}})
    assert nested.num_hidden_layers == 28 and nested.dtype == "float16"
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config_dict({"hidden_size": 8})
    with pytest.raises(ValueError, match="not a known dtype"):
        dtype_bytes("int3")
    assert dtype_bytes("fp8") == 1 and dtype_bytes("BF16") == 2


# ---------------------------------------------------------------------------------------------- per engine, per GPU
def test_tiny_model_against_hand_arithmetic(tiny_model_path):
    config, where = load_config_dict("builtin:tiny-qwen2")
    assert where == tiny_model_path
    shape = ModelShape.from_config_dict(config, num_parameters=None)
    # builtin:tiny-qwen2: 2 layers, 4 heads, 2 KV heads, hidden 128 -> head_dim 32, float32.
    assert (shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, shape.dtype_bytes) == (2, 2, 32, 4)
    mem = estimate_memory(shape, EXAMPLE, max_prompt_length=100, max_completion_length=60, max_num_seqs=256)
    kv = mem.kv
    assert kv.bytes_per_token == 2 * 2 * 2 * 32 * 4 == 1024
    assert kv.bytes_per_token_per_gpu == 512  # 2 KV heads over tp 2 -> 1 per GPU
    assert kv.tokens_per_sequence == 160 and kv.blocks_per_sequence == 10  # ceil(160 / 16)
    assert kv.bytes_per_sequence == 10 * 16 * 1024
    assert kv.concurrent_sequences == 240 and kv.groups_in_flight == 20
    assert kv.shared_prompt_blocks == 6  # 100 // 16 full prompt blocks; the partial 7th is per sample
    assert kv.blocks == 240 * 10
    assert kv.blocks_shared == 20 * 6 + 240 * (10 - 6)
    assert kv.bytes_per_gpu == 2400 * 16 * 512 == 19_660_800
    assert kv.bytes_per_gpu_shared == 1080 * 16 * 512
    assert kv.bytes_per_engine == 2 * kv.bytes_per_gpu and kv.bytes_per_engine_shared == 2 * kv.bytes_per_gpu_shared
    assert kv.saved_bytes_per_gpu == (240 - 20) * 6 * 16 * 512
    assert mem.weights_bytes_per_gpu is None


def test_parameter_count_on_meta_device(tiny_model_path):
    shape = load_model_shape("builtin:tiny-qwen2")
    v, h, i, layers, kv_dim = 384, 128, 256, 2, 2 * 32
    per_layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * i + 2 * h  # q(+bias) k v(+bias) o, mlp, norms
    assert shape.num_parameters == v * h + layers * per_layer + h == 345_216  # tied embeddings counted once
    assert weights_bytes_per_gpu(shape.num_parameters, 4, 2) == 345_216 * 4 // 2
    assert count_parameters(QWEN2_7B) == 7_615_616_512  # Qwen2-7B, exactly


def test_kv_grows_linearly_with_n():
    def at(n, cap=None):
        return estimate_kv(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2, prompt_len=1000,
                           response_len=2000, prompts_per_engine=20, n=n, tp_size=2, max_num_seqs=cap)

    one = at(1)
    block_gpu = 16 * one.bytes_per_token_per_gpu
    for n in range(1, 17):
        e = at(n)
        assert e.bytes_per_gpu == n * one.bytes_per_gpu
        assert e.bytes_per_engine == n * one.bytes_per_engine
        # with sharing: a fixed prompt part per group plus a per-sample part
        assert e.bytes_per_gpu_shared == 20 * (62 + n * (188 - 62)) * block_gpu  # 1000 // 16 = 62, ceil(3000/16) = 188
        # prefix sharing saves exactly the (n - 1) extra copies of each prompt's full blocks
        assert e.saved_bytes_per_gpu == 20 * (n - 1) * 62 * block_gpu
    capped = at(16, cap=256)
    assert capped.concurrent_sequences == 256 and capped.groups_in_flight == 16
    assert capped.bytes_per_gpu == 256 * 188 * block_gpu


def test_prompt_exactly_on_block_boundary_is_shared_entirely():
    e = estimate_kv(num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, prompt_len=32, response_len=0,
                    prompts_per_engine=3, n=4)
    assert e.blocks == 12 * 2 and e.blocks_shared == 3 * 2  # the whole prompt is shared: 2 blocks per group
    assert e.saved_bytes_per_gpu == 3 * 3 * 2 * 16 * 2  # 3 groups x 3 extra copies x 2 blocks x 16 tokens x 2 B (K, V)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 256), st.integers(0, 4096), st.integers(0, 4096),
       st.integers(1, 64), st.integers(1, 32), st.sampled_from([1, 2, 4, 8]), st.one_of(st.none(), st.integers(1, 512)))
def test_kv_arithmetic_properties(layers, kvh, hd, prompt, resp, prompts, n, tp, cap):
    e = estimate_kv(num_layers=layers, num_kv_heads=kvh, head_dim=hd, dtype_bytes=2, prompt_len=prompt,
                    response_len=resp, prompts_per_engine=prompts, n=n, tp_size=tp, max_num_seqs=cap)
    assert e.concurrent_sequences == (prompts * n if cap is None else min(prompts * n, cap))
    assert e.groups_in_flight == min(prompts, math.ceil(e.concurrent_sequences / n))
    assert (e.blocks_per_sequence - 1) * 16 < e.tokens_per_sequence <= e.blocks_per_sequence * 16 or prompt + resp == 0
    block = 16 * e.bytes_per_token_per_gpu
    assert e.saved_bytes_per_gpu == (e.concurrent_sequences - e.groups_in_flight) * (prompt // 16) * block
    assert 0 <= e.bytes_per_gpu_shared <= e.bytes_per_gpu
    if kvh % tp == 0 or tp % kvh == 0:  # what vLLM accepts: the GPUs of an engine hold every head
        assert e.bytes_per_token_per_gpu * min(kvh, tp) == e.bytes_per_token


def test_invalid_numbers():
    with pytest.raises(ValueError, match="n=0"):
        estimate_kv(num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, prompt_len=1, response_len=1,
                    prompts_per_engine=1, n=0)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        estimate_kv(num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, prompt_len=1, response_len=1,
                    prompts_per_engine=1, n=1, max_num_seqs=0)
    with pytest.raises(ValueError, match="must not be negative"):
        estimate_kv(num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, prompt_len=-1, response_len=1,
                    prompts_per_engine=1, n=1)


# ---------------------------------------------------------------------------------------------- the report
def test_estimate_memory_report_and_gpu_budget():
    shape = ModelShape.from_config_dict(QWEN2_7B, num_parameters=7_615_616_512, name="qwen2-7b")
    mem = estimate_memory(shape, EXAMPLE, max_prompt_length=1024, max_completion_length=2048,
                          gpu_memory_gib=80, gpu_memory_utilization=0.5)
    assert [e.n for e in mem.kv_vs_n] == sorted({*DEFAULT_N_VALUES, 12})
    assert mem.weights_bytes_per_gpu == 7_615_616_512  # 2 bytes / tp 2
    # vLLM's sampler: 240 concurrent sequences (max_num_seqs 1024 does not bind) x 152,064 vocab x 20 B
    assert mem.sampler_bytes_per_gpu == 240 * 152064 * 20
    assert mem.kv_budget_bytes_per_gpu == 40 * 2**30 - 7_615_616_512 - 240 * 152064 * 20
    capped = estimate_memory(shape, EXAMPLE, max_num_seqs=64)
    assert capped.sampler_bytes_per_gpu == 64 * 152064 * 20 and "sampler buffers" in capped.table()
    # 240 sequences x 192 blocks x 16 x 28,672 B per GPU = 19.7 GiB; shared prefix: 13.7 GiB -> fits in 32.9 GiB
    assert mem.kv.bytes_per_gpu == 240 * 192 * 16 * 28672
    assert mem.fits(mem.kv) is True
    d = mem.to_dict()
    json.dumps(d)
    assert d["kv_bytes_per_token"] == 57344 and d["kv_heads_per_gpu"] == 2 and d["kv_fits"] is True
    assert [row["n"] for row in d["kv_vs_n"]] == [1, 4, 8, 12, 16]
    table = mem.table()
    assert "57,344 B" in table and "KV cache vs n" in table and "fits" in table
    small = estimate_memory(shape, EXAMPLE, max_prompt_length=1024, max_completion_length=2048, gpu_memory_gib=16,
                            gpu_memory_utilization=0.9)
    assert small.fits(small.kv) is False and "does NOT fit" in small.table()
    assert estimate_memory(shape, EXAMPLE).to_dict()["kv_fits"] is None


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.50 KiB" and fmt_bytes(3 * 2**30) == "3.00 GiB"


def test_model_must_split_over_tp_and_sp():
    shape = ModelShape(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    check_model_fits_layout(shape, EXAMPLE)  # tp 2 splits 4 heads and 2 KV heads
    base = dict(num_processes=6, train_batch_size=60, rollout_n=12)
    for kwargs, option in [({"rollout_tp_size": 3}, "rollout_tp_size"),
                           ({"rollout_tp_size": 1, "sequence_parallel_size": 3}, "sequence_parallel_size")]:
        lay = RolloutLayout.build(**base, **kwargs)
        with pytest.raises(LayoutError) as info:
            check_model_fits_layout(shape, lay)
        err = info.value
        assert str(err).startswith(f"{option}={kwargs[option]}") and err.option == option and err.fixes
        for change in err.fixes:
            assert str(change[option]) in str(err)
            check_model_fits_layout(shape, RolloutLayout.build(**{**base, **kwargs, **change}))


# ---------------------------------------------------------------------------------------------- loaders
def test_load_config_from_folder_file_and_errors(tmp_path, tiny_model_path):
    config, where = load_config_dict(tiny_model_path)
    assert config["num_hidden_layers"] == 2 and where == tiny_model_path
    (tmp_path / "cfg.json").write_text(json.dumps(QWEN2_7B))
    config, _ = load_config_dict(str(tmp_path / "cfg.json"))
    assert config["num_key_value_heads"] == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without a config.json"):
        load_config_dict(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a built-in model"):
        load_config_dict("builtin:nope")
    shape = load_model_shape(str(tmp_path / "cfg.json"), dtype="float16", count_params=False)
    assert shape.num_parameters is None and shape.dtype == "float16"
