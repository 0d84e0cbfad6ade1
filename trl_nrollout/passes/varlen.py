"""Varlen attention for padding-free rows: each sequence of a packed row attends to itself only, by its boundaries
(``cu_seqlens``), not by an ``L x L`` mask.

A padding-free row under SDPA or eager attention needs a block-diagonal causal mask (:mod:`.padfree`): the kernel
then computes every query-key pair of the row and masks most of them away, and the mask itself costs ``L^2`` bytes.
Varlen kernels take the sequences' starts instead and compute each sequence's causal pairs only:

- a model loaded with flash-attention (``attn_implementation="flash_attention_2"`` / ``"flash_attention_3"`` or a
  hub kernel) runs its own varlen kernel when the forward is given ``cu_seq_lens_q/k`` and ``max_length_q/k``
  (transformers' padding-free path; :func:`varlen_kwargs` makes them);
- :data:`VARLEN_NAME` (``"trl_nrollout_varlen"``), registered with transformers when this module is imported, is a
  varlen attention for every model whose attention is SDPA: on CUDA (Ampere or later) in half precision it calls
  PyTorch's own flash-attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, no extra package), elsewhere
  it runs SDPA once per sequence (causal, no mask). Without boundaries (generation, a padded forward) it is SDPA.
  Whether the kernel runs a model's head shape is probed once, at the first forward (a tiny call, forward and
  backward); the real forwards catch nothing, so an out-of-memory error is raised as such.

The trainer runs a model's SDPA forwards of padding-free rows through :data:`VARLEN_NAME` on CUDA (compute
capability 8.0 or later) in half precision (:func:`packed_attention`); a user may also load a model with
``attn_implementation="trl_nrollout_varlen"``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)
#: the smallest CUDA compute capability PyTorch's flash-attention varlen kernel runs on (Ampere): it refuses older
#: GPUs (T4 7.5, V100 7.0), whose rows therefore take the block mask (:func:`packed_attention`).
MIN_CAPABILITY = (8, 0)
#: the probe's decisions (:func:`_kernel_decision`): ``(device, dtype, query heads, key heads, head size)`` -> whether
#: PyTorch's varlen kernel runs there, forward and backward. Taken once per key, never changed afterwards.
_PROBED: dict[tuple, bool] = {}
#: the errors by which the probe learns that the kernel does not run (a head size, a GPU, a build it lacks); an
#: out-of-memory error is NOT one of them (it is a RuntimeError: re-raised before these are caught).
_REFUSALS = (RuntimeError, NotImplementedError, TypeError, ValueError)
#: the attention implementation registered with transformers by this module.
VARLEN_NAME = "trl_nrollout_varlen"
#: the model's own varlen kernels (transformers' flash-attention integrations).
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "kernels-community/flash-attn",
                   "kernels-community/flash-attn2", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3")
#: attention implementations that separate a packed row's sequences by ``cu_seqlens`` (no mask).
VARLEN_ATTENTION = (VARLEN_NAME, *FLASH_ATTENTION)


def cu_seqlens(position_ids: Tensor) -> tuple[Tensor, int]:
    """The sequences of packed rows ``position_ids`` ``[R, L]`` (positions restart at 0 with each sequence, and with
    each row) as cumulative starts over the flattened ``R x L`` tokens: ``cu`` ``[N + 1]`` int32 (``0, end_0, ...,
    R x L``) and the longest sequence's length."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("cu_seqlens: packed positions must start at 0 (each sequence's positions from 0).")
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_kwargs(position_ids: Tensor) -> dict:
    """The forward's keyword arguments that make a varlen attention (transformers' flash-attention path, or
    :data:`VARLEN_NAME`) separate the sequences of packed rows ``position_ids`` ``[R, L]``."""
    cu, longest = cu_seqlens(position_ids)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.cache
def _torch_varlen():
    """PyTorch's varlen flash-attention function, or None where this torch has none (looked up once)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def torch_varlen_runs(device_type: str, dtype: torch.dtype, device: torch.device | int | None = None) -> bool:
    """Whether PyTorch's own varlen kernel can run here: CUDA on a GPU of compute capability
    :data:`MIN_CAPABILITY` (8.0, Ampere) or later (its flash-attention kernel refuses a T4 or a V100), half
    precision, and a torch that has it. ``device``: the CUDA device asked about (default: the current one). Whether
    it runs a given head size is the probe's to say (:func:`_kernel_decision`)."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or _torch_varlen() is None:
        return False
    if not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= MIN_CAPABILITY


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names of PyTorch's varlen function (read once: it runs in every layer of every forward)."""
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _call_kernel(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scale: float | None
                 ) -> Tensor:
    """PyTorch's varlen kernel, causal: ``query`` ``[T, H, D]``, ``key``/``value`` ``[T, H_kv, D]``, ``cu``
    ``[N + 1]`` int32 -> ``[T, H, D]``."""
    fn = _torch_varlen()
    params = _varlen_params()
    extra: dict = {"scale": scale}
    if "window_size" in params:  # torch >= 2.10: causal as a window of (everything before, nothing after)
        extra["window_size"] = (-1, 0)
    else:  # torch 2.9: a flag
        extra["is_causal"] = True
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return fn(query, key, value, cu, cu, longest, longest, **extra)


def _flash_varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scale: float | None
                  ) -> Tensor:
    """The forward's call of the kernel (:func:`_call_kernel`; a name of its own, apart from the probe's, so that
    ``scripts/gpu_check.py`` counts the forwards' calls only). Nothing is caught: an error here (an out-of-memory
    error) is the caller's."""
    return _call_kernel(query, key, value, cu, longest, scale)


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether PyTorch's varlen kernel runs on ``device`` for ``dtype`` and this head shape: one tiny call (two
    sequences, 3 tokens), forward and backward. A refusal (:data:`_REFUSALS`: a head size, a GPU, a build it lacks)
    is said once and answers False; an out-of-memory error is raised. The probe draws no random numbers (the
    run's RNG is untouched) and saves its tensors outside any saved-tensor hooks in force (a checkpointed layer's
    forward, whose recompute will not probe, must save what its recompute saves)."""
    tokens = 3

    def make(h: int, shift: float) -> Tensor:
        x = torch.arange(tokens * h * dim, device=device, dtype=torch.float32).reshape(tokens, h, dim)
        return ((x * 0.37 + shift).remainder(2.0) - 1.0).to(dtype).requires_grad_()

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            qkv = (make(heads, 0.0), make(kv_heads, 0.5), make(kv_heads, 1.0))
            cu = torch.tensor([0, 1, tokens], dtype=torch.int32, device=device)
            out = _call_kernel(*qkv, cu, 2, None)
            torch.autograd.grad(out.float().sum(), qkv)
    except torch.OutOfMemoryError:
        raise
    except _REFUSALS as err:
        logger.warning("PyTorch's varlen attention kernel does not run on %s for %s, %d query heads, %d key heads "
                       "of size %d (%s: %s); padding-free rows run one SDPA per sequence instead (the same result, "
                       "more kernel launches).", device, dtype, heads, kv_heads, dim, type(err).__name__, err)
        return False
    return True


def _kernel_decision(query: Tensor, key: Tensor) -> bool:
    """Whether a forward of ``query`` ``[B, H, L, D]``, ``key`` ``[B, H_kv, L, D]`` runs PyTorch's varlen kernel:
    where it can (:func:`torch_varlen_runs`: CUDA, Ampere or later, half precision) and its probe on this device,
    dtype and head shape passed (:func:`_probe`). Decided at the first forward of each shape and kept
    (:data:`_PROBED`): every later layer, forward and checkpointed recompute takes the same path, and a failure
    of the real forward (an out-of-memory error) is raised, never turned into a fallback."""
    shape_key = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
    decided = _PROBED.get(shape_key)
    if decided is None:
        decided = torch_varlen_runs(query.device.type, query.dtype, query.device) and _probe(*shape_key)
        _PROBED[shape_key] = decided
    return decided


def _sdpa_per_sequence(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """Causal SDPA once per sequence: ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]`` ->
    ``[1, H, T, D]``; each sequence's pairs only, no mask."""
    gqa = key.shape[1] != query.shape[1]
    bounds = cu.tolist()
    out = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                          scale=scale, enable_gqa=gqa)
           for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out, dim=2)


def varlen_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, cu_seq_lens_q: Tensor | None = None,
                     cu_seq_lens_k: Tensor | None = None, max_length_q: int | None = None,
                     max_length_k: int | None = None, **kwargs) -> tuple[Tensor, None]:
    """A transformers attention function (``ALL_ATTENTION_FUNCTIONS[VARLEN_NAME]``): ``query`` ``[B, H, L, D]``,
    ``key``/``value`` ``[B, H_kv, L, D]`` -> ``[B, L, H, D]``. Given ``cu_seq_lens_q`` (over the flattened ``B x L``
    tokens, equal to ``cu_seq_lens_k``: :func:`varlen_kwargs`), each sequence attends causally to itself; without it,
    SDPA with the mask as given. Without boundaries but with packed ``position_ids`` ``[B, L]`` (each row's
    positions from 0, restarting with each sequence: a data collator's flattened rows) and no mask, the boundaries
    are read from the positions, as transformers' flash-attention does."""
    position_ids = kwargs.pop("position_ids", None)
    if (cu_seq_lens_q is None and attention_mask is None and position_ids is not None
            and query.shape[2] == key.shape[2] == position_ids.shape[-1] and not bool(position_ids[..., 0].any())):
        cu_seq_lens_q, max_length_q = cu_seqlens(position_ids.expand(query.shape[0], -1))
        cu_seq_lens_k = cu_seq_lens_q
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k,
                                                                                         cu_seq_lens_q):
        raise ValueError("varlen_attention: queries and keys must share their sequences (no cache).")
    if dropout:
        raise ValueError(f"varlen_attention: attention dropout ({dropout}) is not supported; set the model's "
                         "attention_dropout to 0.")
    batch, heads, length, dim = query.shape
    if _kernel_decision(query, key):
        flat = [x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value)]
        longest = max_length_q if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        out = _flash_varlen(*flat, cu_seq_lens_q.to(torch.int32), int(longest), scaling)
        return out.reshape(batch, length, heads, dim), None
    flat = [x.transpose(0, 1).reshape(1, x.shape[1], batch * length, dim) for x in (query, key, value)]
    out = _sdpa_per_sequence(*flat, cu_seq_lens_q, scaling)  # [1, H, B*L, D]
    return out.reshape(heads, batch, length, dim).permute(1, 2, 0, 3).contiguous(), None


def varlen_mask(*, attention_mask: Tensor | None = None, **kwargs) -> Tensor | bool | None:
    """The mask function of :data:`VARLEN_NAME`: none without a padding mask (packed rows come with their
    boundaries, a single sequence is causal), else SDPA's mask (a padded batch runs SDPA)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register :data:`VARLEN_NAME` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(VARLEN_NAME, varlen_attention)
    AttentionMaskInterface.register(VARLEN_NAME, varlen_mask)


def attention_of(config) -> str:
    """The model's attention implementation (transformers' default, SDPA, when the config does not say); under
    Ulysses (:func:`~trl_nrollout.passes.ulysses.install`) the one it wraps."""
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    if attn == "trl_nrollout_ulysses":
        return getattr(config, "_ulysses_inner", None) or "sdpa"
    return attn


def packed_attention(config, device_type: str, queries: torch.dtype) -> str:
    """How padding-free rows of a model run: ``"varlen"`` by sequence boundaries (the model's flash-attention or
    :data:`VARLEN_NAME`, or SDPA swapped for :data:`VARLEN_NAME` where PyTorch's varlen kernel runs: CUDA on
    an Ampere or later GPU, half precision ``queries``), else ``"mask"`` (a block-diagonal mask: SDPA, eager)."""
    attn = attention_of(config)
    if attn in VARLEN_ATTENTION or (attn == "sdpa" and torch_varlen_runs(device_type, queries)):
        return "varlen"
    return "mask"


@contextlib.contextmanager
def varlen_forward(config) -> Iterator[None]:
    """Within it, a model of ``config`` whose attention is SDPA runs :data:`VARLEN_NAME` (its flash-attention, or
    an explicit varlen implementation, is kept). The switch stays after the context: gradient checkpointing
    recomputes each layer's forward during the backward, after the forward's context has ended, and a recompute
    with SDPA would ignore the rows' boundaries (attending across sequences, or failing torch's check that the
    recomputation saved what the forward saved). :data:`VARLEN_NAME` without boundaries is SDPA (a padded batch,
    generation, one sequence), so every other forward of the model computes what it computed before."""
    if attention_of(config) == "sdpa":
        register()
        if getattr(config, "_attn_implementation", None) == "trl_nrollout_ulysses":  # Ulysses wraps it: its inner
            config._ulysses_inner = VARLEN_NAME
        else:
            config._attn_implementation = VARLEN_NAME
    yield
