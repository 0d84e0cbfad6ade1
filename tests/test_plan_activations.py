"""plan/activations.py: activation bytes per token checked against what autograd saves in real models built here, and
the default update token budget's properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.plan.activations import (
    BUDGET_ROUNDING,
    CPU_DEFAULT_TOKEN_BUDGET,
    activation_bytes_per_token,
    default_update_token_budget,
    layer_activation_bytes_per_token,
)
from trl_nrollout.plan.models import KNOWN_CONFIGS

#: the measurement is exact (both sides count the same tensors); the tolerance only absorbs a transformers release
#: that saves one more small tensor (a bias, a scale) per layer
TOLERANCE = 0.02


def _tiny(model_type: str, dtype: torch.dtype, *, layers: int = 3, checkpointing: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_type=model_type, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=100)
    config = AutoConfig.for_model(**fields)
    config._attn_implementation = "sdpa"  # CPU SDPA without a mask: the memory-efficient kernel (no L x L probs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    if checkpointing:  # reentrant: the checkpoint's inputs go through save_for_backward, so the hooks see them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return fields, model


def _saved_bytes(model, tokens: int) -> int:
    """Bytes of the distinct storages autograd saves for the backward of a forward over one row of ``tokens``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    ids = torch.randint(0, 100, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum()
    return sum(seen.values())


def _measured_per_token(model) -> float:
    """Saved bytes per token: the difference of two lengths, so that what does not grow with the row (weights'
    transposed copies on CPU, the vocabulary-sized head over 100 tokens) cancels."""
    short, long = 64, 160
    return (_saved_bytes(model, long) - _saved_bytes(model, short)) / (long - short)


@pytest.mark.parametrize(("model_type", "dtype"), [("llama", torch.bfloat16), ("llama", torch.float32),
                                                   ("qwen3", torch.bfloat16)])
def test_activation_bytes_match_what_autograd_saves(model_type, dtype):
    """The formula (two norms, q/k/v/out and the log-sum-exp, SwiGLU's four intermediates; Qwen3's per-head q/k
    norms) equals the bytes of the tensors a real Llama / Qwen3 saves for its backward, bf16 and float32."""
    fields, model = _tiny(model_type, dtype)
    measured = _measured_per_token(model)
    predicted = activation_bytes_per_token(fields, dtype_bytes=2 if dtype == torch.bfloat16 else 4)
    assert measured == pytest.approx(predicted, rel=TOLERANCE), (measured, predicted)


def test_activation_bytes_with_gradient_checkpointing():
    """With gradient checkpointing the forward keeps each layer's input (plus the once-per-forward tensors), and the
    backward adds one layer's full activations, which the hooks see as one layer's saved bytes."""
    fields, model = _tiny("llama", torch.bfloat16, checkpointing=True)
    kept = _measured_per_token(model)
    # the rotary table (cos, sin: 2 x b x head_dim per token) reaches each checkpoint as a tuple argument, held by
    # reference, not through save_for_backward: the hooks do not see it, the memory holds it
    kept += 2 * 2 * fields["head_dim"]
    predicted = activation_bytes_per_token(fields, dtype_bytes=2, gradient_checkpointing=True)
    assert kept + layer_activation_bytes_per_token(fields, dtype_bytes=2) == pytest.approx(predicted, rel=TOLERANCE)
    _, full = _tiny("llama", torch.bfloat16)
    assert _measured_per_token(full) > 2 * kept  # what checkpointing saves, measured


def test_llama_8b_figure_in_the_docstring():
    """The module docstring's worked figure (Llama-3.1-8B at 16 bits: 200,8xx B per layer and token)."""
    per_layer = layer_activation_bytes_per_token(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"])
    assert per_layer == 20 * 4096 + 4 * 1024 + 8 * 14336 + 4 * 32 + 8


# ---------------------------------------------------------------------------------------------- the default budget
dims = st.fixed_dictionaries({
    "hidden_size": st.sampled_from([256, 512, 1024, 2048, 4096]),
    "intermediate_size": st.integers(512, 32768),
    "num_hidden_layers": st.integers(1, 80),
    "num_attention_heads": st.sampled_from([4, 8, 16, 32]),
    "vocab_size": st.integers(1000, 200_000),
})


def _config(d: dict) -> dict:
    return {**d, "model_type": "llama", "num_key_value_heads": d["num_attention_heads"] // 2}


@settings(max_examples=200, deadline=None)
@given(d=dims, memory=st.integers(1 << 30, 200 << 30), extra=st.integers(0, 100 << 30),
       states=st.integers(0, 100 << 30), longest=st.integers(1, 70_000), ckpt=st.booleans())
def test_budget_grows_with_memory_and_respects_the_floor(d, memory, extra, states, longest, ckpt):
    config = _config(d)
    budget = default_update_token_budget(config, device_memory_bytes=memory, state_bytes_per_device=states,
                                         longest_sample=longest, gradient_checkpointing=ckpt)
    more = default_update_token_budget(config, device_memory_bytes=memory + extra, state_bytes_per_device=states,
                                       longest_sample=longest, gradient_checkpointing=ckpt)
    assert more >= budget >= longest
    assert budget == longest or budget % BUDGET_ROUNDING == 0
    # the budget's activations fit the fraction of what is left, unless the floor set it
    per_token = activation_bytes_per_token(config, gradient_checkpointing=ckpt)
    if budget > longest:
        assert budget * per_token <= 0.5 * (memory - states)
        assert (budget + BUDGET_ROUNDING) * per_token > 0.5 * (memory - states)  # rounded down, not further


@settings(max_examples=200, deadline=None)
@given(d=dims, grow=st.sampled_from(["hidden_size", "intermediate_size", "num_hidden_layers"]),
       memory=st.integers(1 << 30, 200 << 30), states=st.integers(0, 50 << 30), more_states=st.integers(0, 50 << 30),
       longest=st.integers(1, 70_000), ckpt=st.booleans())
def test_bigger_model_gets_no_larger_budget(d, grow, memory, states, more_states, longest, ckpt):
    small = _config(d)
    big = {**small, grow: small[grow] * 2}
    kwargs = dict(device_memory_bytes=memory, longest_sample=longest, gradient_checkpointing=ckpt)
    assert activation_bytes_per_token(big, gradient_checkpointing=ckpt) > activation_bytes_per_token(
        small, gradient_checkpointing=ckpt)
    assert (default_update_token_budget(big, state_bytes_per_device=states + more_states, **kwargs)
            <= default_update_token_budget(small, state_bytes_per_device=states, **kwargs))


def test_budget_on_a_cpu_and_when_states_fill_the_device():
    config = KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"]
    assert default_update_token_budget(config, device_memory_bytes=None, state_bytes_per_device=0,
                                       longest_sample=1000) == CPU_DEFAULT_TOKEN_BUDGET
    assert default_update_token_budget(config, device_memory_bytes=None, state_bytes_per_device=0,
                                       longest_sample=40_000) == 40_000
    assert default_update_token_budget(config, device_memory_bytes=80 << 30, state_bytes_per_device=90 << 30,
                                       longest_sample=4096) == 4096
    # checkpointing keeps a fraction of the activations: a budget several times larger on the same device
    kwargs = dict(device_memory_bytes=80 << 30, state_bytes_per_device=20 << 30, longest_sample=4096)
    assert (default_update_token_budget(config, gradient_checkpointing=True, **kwargs)
            > 4 * default_update_token_budget(config, **kwargs))


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(device_memory_bytes=0), "device_memory_bytes=0"),
    (dict(state_bytes_per_device=-1), "state_bytes_per_device=-1"),
    (dict(longest_sample=0), "longest_sample=0"),
    (dict(longest_sample=2.5), "longest_sample=2.5"),
    (dict(fraction=0.0), "fraction=0.0"),
    (dict(fraction=1.5), "fraction=1.5"),
    (dict(dtype_bytes=3), "dtype_bytes=3"),
])
def test_budget_bad_input(kwargs, words):
    args = dict(device_memory_bytes=80 << 30, state_bytes_per_device=0, longest_sample=1024, **{})
    args.update(kwargs)
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        default_update_token_budget(KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"], **args)


def test_budget_bad_config():
    with pytest.raises(ValueError, match="intermediate_size"):
        activation_bytes_per_token({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "vocab_size": 10})
    with pytest.raises(TypeError, match="config dict"):
        activation_bytes_per_token("Qwen/Qwen2.5-0.5B")  # type: ignore[arg-type]
