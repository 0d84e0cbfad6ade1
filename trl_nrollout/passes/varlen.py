"""Varlen attention for padding-free rows: each sequence of a packed row attends to itself only, by its boundaries
(``cu_seqlens``), not by an ``L x L`` mask.

A padding-free row under SDPA or eager attention needs a block-diagonal causal mask (:mod:`.padfree`): the kernel
then computes every query-key pair of the row and masks most of them away, and the mask itself costs ``L^2`` bytes.
Varlen kernels take the sequences' starts instead and compute each sequence's causal pairs only:

- a model loaded with flash-attention (``attn_implementation="flash_attention_2"`` / ``"flash_attention_3"`` or a
  hub kernel) runs its own varlen kernel when the forward is given ``cu_seq_lens_q/k`` and ``max_length_q/k``
  (transformers' padding-free path; :func:`varlen_kwargs` makes them);
- :data:`VARLEN_NAME` (``"trl_nrollout_varlen"``), registered with transformers when this module is imported, is a
  varlen attention for every model whose attention is SDPA: on CUDA in half precision it calls PyTorch's own
  flash-attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, no extra package), elsewhere it runs SDPA
  once per sequence (causal, no mask). Without boundaries (generation, a padded forward) it is SDPA.

The trainer runs a model's SDPA forwards of padding-free rows through :data:`VARLEN_NAME` on CUDA in half precision
(:func:`packed_attention`); a user may also load a model with ``attn_implementation="trl_nrollout_varlen"``.
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
#: PyTorch's varlen kernel raised once in this process (said once): every later call runs SDPA per sequence.
_KERNEL_FAILED: list[BaseException] = []
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


def torch_varlen_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether PyTorch's own varlen kernel runs here: CUDA, half precision, and a torch that has it."""
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _torch_varlen() is not None


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names of PyTorch's varlen function (read once: it runs in every layer of every forward)."""
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _flash_varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scale: float | None
                  ) -> Tensor:
    """PyTorch's varlen kernel, causal: ``query`` ``[T, H, D]``, ``key``/``value`` ``[T, H_kv, D]`` -> ``[T, H, D]``."""
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
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("varlen_attention: queries and keys must share their sequences (no cache).")
    if dropout:
        raise ValueError(f"varlen_attention: attention dropout ({dropout}) is not supported; set the model's "
                         "attention_dropout to 0.")
    batch, heads, length, dim = query.shape
    if torch_varlen_runs(query.device.type, query.dtype) and not _KERNEL_FAILED:
        flat = [x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value)]
        longest = max_length_q if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        try:
            out = _flash_varlen(*flat, cu_seq_lens_q.to(torch.int32), int(longest), scaling)
            return out.reshape(batch, length, heads, dim), None
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:  # a head size, a GPU it lacks
            _KERNEL_FAILED.append(err)
            logger.warning("PyTorch's varlen attention kernel failed here (%s: %s); padding-free rows run one SDPA "
                           "per sequence instead (the same result, more kernel launches).", type(err).__name__, err)
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
    :data:`VARLEN_NAME`, or SDPA swapped for :data:`VARLEN_NAME` where PyTorch's varlen kernel runs: CUDA, half
    precision ``queries``), else ``"mask"`` (a block-diagonal mask: SDPA, eager)."""
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
