"""Training activation memory per token, and the default token budget of an update micro batch.

Pure arithmetic (no torch): the trainer calls :func:`default_update_token_budget` when ``use_dynamic_bsz`` is on and
no ``ppo_max_token_len_per_device`` is given (verl's ``ppo_max_token_len_per_gpu``), and ``trl-nrollout plan`` prints
the same figure, so the plan and the run agree.

What a decoder's forward keeps for its backward, per token (bytes; ``b`` the activations' dtype bytes, ``h`` the
hidden size, ``I`` the MLP's intermediate size, ``q = heads x head_dim``, ``kv = kv_heads x head_dim``), counted
tensor by tensor from what autograd saves in a Hugging Face Llama / Qwen / Mistral layer (the test
``tests/test_plan_activations.py`` counts the same with ``torch.autograd.graph.saved_tensors_hooks`` on a model built
locally and finds it exactly):

- each of the layer's two RMSNorms: its input in float32 (``4h``: the norm upcasts; a float32 model saves the input
  itself), ``1 / rms`` (4), the normalized input in the model's dtype (``b h``, for the weight's gradient) and the
  norm's output (``b h``, the input the next projections save): ``4h + 2bh + 4``;
- attention with a memory-efficient kernel (SDPA's flash / memory-efficient kernels, flash-attention; no ``L x L``
  probabilities): the queries, keys and values after the rotary embedding and the output, which is also the output
  projection's input (``b (2q + 2kv)``), and the log-sum-exp per head (``4 x heads``, float32);
- Qwen3's per-head norms of the queries and keys (``q_norm`` / ``k_norm``, :data:`~trl_nrollout.plan.dims.QK_NORM`)
  add their float32 inputs, ``1 / rms`` per head and the normalized values: ``(4 + b)(q + kv) + 4 (heads +
  kv_heads)``;
- a gated MLP (SwiGLU: gate, up, down): the gate's output (for SiLU), SiLU's output and the up projection's (for the
  product), the product (the down projection's input): ``4bI``; an ungated MLP (GELU: up, down) ``2bI``; a mixture of
  experts the same for each of the token's experts (``k x 4b I_expert``, plus a shared expert) and its router logits
  (``4 x experts``).

So a layer keeps ``2 (4h + 2bh + 4) + b (2q + 2kv) + 4 heads + 4bI`` bytes per token: at 16 bits with ``q = h``
that is ``20h + 4kv + 8I + 4 heads + 8`` (Llama-3.1-8B: 200,840 B, so 6.4 MB per token over its 32 layers). Once
per forward: the final norm (``4h + 2bh + 4``), the rotary table (``2 b head_dim``) and the token ids (8).
The output head is left out: TRL's fused LM head and our log-prob passes (``chunked_token_logprobs``) compute the
logits a chunk of rows at a time, so the vocabulary adds a bounded block, not bytes per token; a trainer that keeps
whole ``[tokens, V]`` float32 logits adds up to ``6V`` per scored token, which the default budget's ``fraction``
leaves room for (Llama-3.1-8B: 0.77 MB against the layers' 6.4 MB).

With gradient checkpointing a layer keeps only its input (``b h`` per token: the residual stream) during the
forward, and the backward recomputes one layer at a time, so the peak is every layer's input plus one layer's full
activations (and the once-per-forward tensors).

An eager attention (``attn_implementation="eager"``, or SDPA's math kernel under an arbitrary mask) also keeps the
``L x L`` attention probabilities per head: quadratic in the row's length, not counted here.
"""

from __future__ import annotations

import math
from typing import Any

from trl_nrollout.plan.dims import ModelDims

#: the token budget's granularity: budgets are rounded down to a multiple of it
BUDGET_ROUNDING = 1024
#: the default budget where the device's memory is unknown (a CPU): a run's host memory is rarely the limit there,
#: time is, and 16k tokens of a small model's activations take a few GiB (the built-in models': under 100 MiB)
CPU_DEFAULT_TOKEN_BUDGET = 16384
#: the default share of the device memory left after the trainer's states that the update's activations may use: the
#: rest holds the gradient buffers' temporaries, the logits' chunks, the allocator's fragmentation and the
#: log-prob passes' own micro batches
DEFAULT_ACTIVATION_FRACTION = 0.5


def _dims(config: dict[str, Any] | ModelDims) -> ModelDims:
    if isinstance(config, ModelDims):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a model config dict (config.json's fields) or a ModelDims, not "
                        f"{type(config).__name__}.")
    return ModelDims.from_config_dict(config)


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes={dtype_bytes!r} must be 1, 2 or 4 (the activations' bytes per element: 2 for "
                         "bf16 / fp16, 4 for float32).")


def norm_bytes_per_token(hidden_size: int, dtype_bytes: int = 2) -> int:
    """One RMSNorm's saved bytes per token: its float32 input (``4h``), ``1/rms`` (4), the normalized input and the
    output in the model's dtype (``2 b h``)."""
    return 4 * hidden_size + 2 * dtype_bytes * hidden_size + 4


def layer_activation_bytes_per_token(config: dict[str, Any] | ModelDims, *, dtype_bytes: int = 2) -> int:
    """Bytes one decoder layer keeps per token for its backward (two norms, attention with a memory-efficient
    kernel, the MLP); see the module docstring."""
    _check_dtype_bytes(dtype_bytes)
    d = _dims(config)
    b = dtype_bytes
    q = d.num_attention_heads * d.head_dim
    kv = d.num_key_value_heads * d.head_dim
    attention = b * (2 * q + 2 * kv) + 4 * d.num_attention_heads
    if d.qk_norm:  # per-head RMSNorms of the queries and keys: float32 input, 1/rms per head, normalized
        attention += (4 + b) * (q + kv) + 4 * (d.num_attention_heads + d.num_key_value_heads)
    per_mlp = (4 if d.gated_mlp else 2) * b
    if d.num_experts:
        mlp = (d.experts_per_token * per_mlp * d.moe_intermediate_size
               + per_mlp * d.shared_expert_intermediate_size + 4 * d.num_experts)
    else:
        mlp = per_mlp * d.intermediate_size
    return 2 * norm_bytes_per_token(d.hidden_size, b) + attention + mlp


def activation_bytes_per_token(config: dict[str, Any] | ModelDims, *, dtype_bytes: int = 2,
                               gradient_checkpointing: bool = False) -> int:
    """Training activation memory per token of a decoder's forward and backward (bytes).

    Args:
        config: the model's ``config.json`` as a dict (``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``; ``num_key_value_heads``, ``head_dim``
            and the experts' fields where the model has them), or its :class:`~trl_nrollout.plan.dims.ModelDims`.
        dtype_bytes: bytes per element of the activations (2: bf16 / fp16; 4: float32).
        gradient_checkpointing: each layer keeps its input only, one layer's full activations live at a time.

    Returns:
        ``layers x layer_bytes + once`` without checkpointing, ``layers x b h + layer_bytes + once`` with it, where
        ``layer_bytes`` is :func:`layer_activation_bytes_per_token` and ``once`` the final norm, the rotary table and
        the token ids. A micro batch of ``T`` real tokens (padding-free) keeps ``T x`` this.
    """
    _check_dtype_bytes(dtype_bytes)
    d = _dims(config)
    layer = layer_activation_bytes_per_token(d, dtype_bytes=dtype_bytes)
    once = norm_bytes_per_token(d.hidden_size, dtype_bytes) + 2 * dtype_bytes * d.head_dim + 8
    if gradient_checkpointing:
        return d.num_hidden_layers * dtype_bytes * d.hidden_size + layer + once
    return d.num_hidden_layers * layer + once


def default_update_token_budget(config: dict[str, Any] | ModelDims, *, device_memory_bytes: int | None,
                                state_bytes_per_device: int, longest_sample: int,
                                gradient_checkpointing: bool = False, dtype_bytes: int = 2,
                                fraction: float = DEFAULT_ACTIVATION_FRACTION, max_tokens: int | None = None) -> int:
    """The default token budget of one update micro batch per device (``ppo_max_token_len_per_device``, verl's
    ``ppo_max_token_len_per_gpu``): real tokens (prompt + completion, padding-free) per forward and backward.

    ``floor(fraction x (device_memory_bytes - state_bytes_per_device) / activation_bytes_per_token)`` rounded down
    to a multiple of :data:`BUDGET_ROUNDING`, and never below ``longest_sample``: every sample must fit one micro batch
    (a sample is not split across micro batches), so a device too small for the longest sample's activations gets
    that floor and the run's memory, not the budget, is what has to change (``plan --predict`` says so). Where the
    device memory is unknown (``device_memory_bytes=None``: a CPU) the budget is ``max(longest_sample,``
    :data:`CPU_DEFAULT_TOKEN_BUDGET` ``)``.

    Args:
        config: the model's config dict or :class:`~trl_nrollout.plan.dims.ModelDims`.
        device_memory_bytes: the device's memory (bytes), or None (unknown: a CPU).
        state_bytes_per_device: what the trainer's states take on the device (weights, gradients, optimizer states,
            their shard when sharded), bytes.
        longest_sample: the longest sample's tokens (prompt + completion; e.g. ``max_prompt_length +
            max_completion_length``).
        gradient_checkpointing, dtype_bytes: as :func:`activation_bytes_per_token`.
        fraction: the share of the memory left after the states that activations may take, in (0, 1].
        max_tokens: a cap from elsewhere (None: none), applied before the floor: e.g. the most real tokens whose
            padding-free rows' block mask stays within its bound
            (:func:`~trl_nrollout.plan.shapes.padfree_token_cap`), beyond which the trainer runs the micro batch padded
            (samples x the longest: several times the tokens the budget meant).

    Returns:
        tokens per micro batch per device.
    """
    if device_memory_bytes is not None and (isinstance(device_memory_bytes, bool) or device_memory_bytes <= 0):
        raise ValueError(f"device_memory_bytes={device_memory_bytes!r} must be a positive number of bytes, or None "
                         "for a device whose memory is unknown (a CPU).")
    if state_bytes_per_device < 0:
        raise ValueError(f"state_bytes_per_device={state_bytes_per_device!r} must be >= 0 (the trainer's weights, "
                         "gradients and optimizer states on one device, in bytes).")
    if isinstance(longest_sample, bool) or int(longest_sample) != longest_sample or longest_sample < 1:
        raise ValueError(f"longest_sample={longest_sample!r} must be a whole number of tokens >= 1 (the longest "
                         "prompt + completion, e.g. max_prompt_length + max_completion_length).")
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"max_tokens={max_tokens!r} must be a whole number of tokens >= 1, or None for no cap.")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]: the share of the memory left after the trainer's "
                         f"states that activations may use (default {DEFAULT_ACTIVATION_FRACTION}).")
    per_token = activation_bytes_per_token(config, dtype_bytes=dtype_bytes,
                                           gradient_checkpointing=gradient_checkpointing)
    longest = int(longest_sample)
    cap = math.inf if max_tokens is None else int(max_tokens)
    if device_memory_bytes is None:
        return max(longest, int(min(CPU_DEFAULT_TOKEN_BUDGET, cap)))
    room = max(0.0, float(device_memory_bytes) - float(state_bytes_per_device))
    tokens = int(min(fraction * room // per_token, cap))
    return max(longest, tokens // BUDGET_ROUNDING * BUDGET_ROUNDING)
