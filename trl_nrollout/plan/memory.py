"""KV-cache and weight memory of the rollout engines, estimated from the model's config before anything loads.

The arithmetic is pure (plain numbers in, a frozen dataclass out); :func:`load_model_shape` is the thin loader
that reads a config from a local folder, a ``builtin:`` name or a hub id, and counts parameters by building
the model on the ``meta`` device (exact, allocates nothing).

What vLLM keeps per generated sequence (paged attention, blocks of :data:`VLLM_BLOCK_SIZE` tokens):

- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes. For a 7B Qwen2 (28 layers,
  4 KV heads, head_dim 128, bf16): 2 x 28 x 4 x 128 x 2 = 57,344 bytes.
- Each GPU of a tensor-parallel engine holds ``max(1, kv_heads // tp)`` KV heads (vLLM replicates heads when
  ``tp`` exceeds their number), so per-GPU bytes per token shrink with ``tp`` down to one head.
- A sequence takes ``ceil((prompt + response) / 16)`` blocks. The ``n`` samples of one prompt share its *full*
  prompt blocks (``prompt // 16``; vLLM's prefix caching, and its native ``n``); the partial last prompt block
  and the response blocks are per sample.
- An engine runs ``min(samples per engine, max_num_seqs)`` sequences at once; its KV grows linearly with ``n``.

Figures are worst cases: every prompt at ``max_prompt_length``, every completion at ``max_completion_length``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trl_nrollout.plan.layout import RolloutLayout

#: Tokens per KV-cache block in vLLM's paged attention (its default on GPUs).
VLLM_BLOCK_SIZE = 16
#: Our engines' default cap on ``max_num_seqs`` (sequences an engine runs at once; vLLM's own default on large GPUs).
#: Engines with more samples run them in waves: vLLM schedules the rest as sequences finish.
DEFAULT_MAX_NUM_SEQS = 1024
#: Bytes per ``[sequence, vocab]`` entry of vLLM's sampler at one step (worst case): the float32 logits, the float32
#: log-softmax of ``processed_logprobs``, and top-p/top-k's sorted values (float32) with their int64 indices.
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 8
#: The ``n`` values of the KV-vs-n table.
DEFAULT_N_VALUES = (1, 4, 8, 12, 16)
#: Lengths assumed when a recipe gives none (verl's ``max_prompt_length`` / ``max_response_length`` defaults).
DEFAULT_MAX_PROMPT_LENGTH = 512
DEFAULT_MAX_COMPLETION_LENGTH = 512

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``, ``"fp8"``...)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not a known dtype; use one of {sorted(DTYPE_BYTES)}.")
    return DTYPE_BYTES[key]


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


# ---------------------------------------------------------------------------------------------- pure arithmetic
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token in every layer: ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_heads_per_gpu(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each GPU of a ``tp_size`` engine holds: split evenly, at least one (vLLM replicates)."""
    return max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class KVEstimate:
    """KV cache of one engine for one ``n``. Blocks are counted per GPU (every rank of an engine holds the same
    blocks, each with its share of the KV heads); bytes are given per GPU and per engine (all its GPUs)."""

    n: int
    prompts_per_engine: int
    samples_per_engine: int
    max_num_seqs: int | None
    concurrent_sequences: int  # min(samples_per_engine, max_num_seqs)
    groups_in_flight: int  # prompts whose samples run at once: ceil(concurrent / n), at most prompts_per_engine
    tp_size: int
    block_size: int
    bytes_per_token: int  # whole model (all KV heads)
    bytes_per_token_per_gpu: int
    prompt_len: int
    response_len: int
    tokens_per_sequence: int
    blocks_per_sequence: int
    shared_prompt_blocks: int  # full prompt blocks, shared by the n samples of a prompt
    bytes_per_sequence: int  # whole model, block-rounded
    blocks: int  # per GPU, no sharing
    blocks_shared: int  # per GPU, prompt prefix shared across a prompt's samples
    bytes_per_gpu: int
    bytes_per_gpu_shared: int
    bytes_per_engine: int
    bytes_per_engine_shared: int

    @property
    def saved_bytes_per_gpu(self) -> int:
        """What prefix sharing saves on each GPU."""
        return self.bytes_per_gpu - self.bytes_per_gpu_shared

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saved_bytes_per_gpu": self.saved_bytes_per_gpu}


def estimate_kv(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    prompt_len: int,
    response_len: int,
    prompts_per_engine: int,
    n: int,
    tp_size: int = 1,
    max_num_seqs: int | None = None,
    block_size: int = VLLM_BLOCK_SIZE,
) -> KVEstimate:
    """KV cache of one engine generating ``n`` samples for each of its ``prompts_per_engine`` prompts.

    ``max_num_seqs=None`` means no cap on concurrent sequences. With a cap, the samples of a prompt are assumed to
    be scheduled together (vLLM's native ``n`` forks them at once), so ``ceil(concurrent / n)`` prompts share.
    """
    for name, v in [("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("dtype_bytes", dtype_bytes), ("prompts_per_engine", prompts_per_engine), ("n", n),
                    ("tp_size", tp_size), ("block_size", block_size)]:
        if v < 1:
            raise ValueError(f"{name}={v} must be at least 1.")
    if prompt_len < 0 or response_len < 0:
        raise ValueError(f"prompt_len={prompt_len} and response_len={response_len} must not be negative.")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1 (or None for no cap).")

    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    per_token_gpu = kv_bytes_per_token(num_layers, kv_heads_per_gpu(num_kv_heads, tp_size), head_dim, dtype_bytes)
    samples = prompts_per_engine * n
    concurrent = samples if max_num_seqs is None else min(samples, max_num_seqs)
    groups = min(prompts_per_engine, math.ceil(concurrent / n))
    tokens = prompt_len + response_len
    blocks_per_seq = math.ceil(tokens / block_size)
    shared = prompt_len // block_size
    blocks = concurrent * blocks_per_seq
    blocks_shared = groups * shared + concurrent * (blocks_per_seq - shared)
    block_bytes_gpu = block_size * per_token_gpu
    return KVEstimate(
        n=n,
        prompts_per_engine=prompts_per_engine,
        samples_per_engine=samples,
        max_num_seqs=max_num_seqs,
        concurrent_sequences=concurrent,
        groups_in_flight=groups,
        tp_size=tp_size,
        block_size=block_size,
        bytes_per_token=per_token,
        bytes_per_token_per_gpu=per_token_gpu,
        prompt_len=prompt_len,
        response_len=response_len,
        tokens_per_sequence=tokens,
        blocks_per_sequence=blocks_per_seq,
        shared_prompt_blocks=shared,
        bytes_per_sequence=blocks_per_seq * block_size * per_token,
        blocks=blocks,
        blocks_shared=blocks_shared,
        bytes_per_gpu=blocks * block_bytes_gpu,
        bytes_per_gpu_shared=blocks_shared * block_bytes_gpu,
        bytes_per_engine=blocks * block_bytes_gpu * tp_size,
        bytes_per_engine_shared=blocks_shared * block_bytes_gpu * tp_size,
    )


def weights_bytes_per_gpu(num_parameters: int, dtype_bytes: int, tp_size: int = 1) -> int:
    """Engine weights on each GPU: ``num_parameters * dtype_bytes / tp_size`` (norms and biases that vLLM
    replicates are ignored: a fraction of a percent)."""
    return math.ceil(num_parameters * dtype_bytes / tp_size)


# ---------------------------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's config."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    num_parameters: int | None = None
    name: str = ""
    vocab_size: int | None = None

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @classmethod
    def from_config_dict(
        cls, config: dict[str, Any], *, dtype: str | None = None, num_parameters: int | None = None, name: str = ""
    ) -> ModelShape:
        """Read a ``config.json``-style dict. ``num_key_value_heads`` falls back to ``num_attention_heads`` (no
        GQA), ``head_dim`` to ``hidden_size // num_attention_heads``; a multimodal config's ``text_config`` is
        used when the top level has no layers. ``dtype`` (``None`` or ``"auto"``: the config's ``dtype`` /
        ``torch_dtype``, else bfloat16) is the engine's dtype."""
        cfg = config
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], **{k: config[k] for k in ("dtype", "torch_dtype") if k in config
                                             and k not in cfg["text_config"]}}
        try:
            layers = cfg["num_hidden_layers"]
            heads = cfg["num_attention_heads"]
        except KeyError as err:
            raise ValueError(
                f"the model config{' of ' + name if name else ''} has no {err.args[0]!r}; the KV estimate needs "
                f"num_hidden_layers, num_attention_heads and num_key_value_heads or hidden_size."
            ) from None
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if dtype in (None, "auto"):
            dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
        dtype_bytes(dtype)  # validate early
        return cls(num_hidden_layers=int(layers), num_attention_heads=int(heads),
                   num_key_value_heads=int(kv_heads), head_dim=int(head_dim), dtype=dtype,
                   num_parameters=num_parameters, name=name,
                   vocab_size=int(cfg["vocab_size"]) if cfg.get("vocab_size") else None)


def check_model_fits_layout(shape: ModelShape, layout: RolloutLayout) -> None:
    """vLLM splits attention heads over the engine's ranks, and Ulysses sequence parallelism splits them over the
    sequence-parallel group: raise :class:`~trl_nrollout.plan.layout.LayoutError` (with a fix) when they cannot."""
    from trl_nrollout.plan.layout import LayoutError, divisors

    heads, kv = shape.num_attention_heads, shape.num_key_value_heads

    def tp_ok(t: int) -> bool:
        return heads % t == 0 and (kv % t == 0 or t % kv == 0)

    tp = layout.rollout_tp_size
    if not tp_ok(tp):
        world, prompts = layout.num_processes, layout.train_batch_size
        ok = [t for t in divisors(world) if tp_ok(t) and prompts % (world // t) == 0]
        ok = sorted(ok, key=lambda t: (abs(t - tp), t))[:2]
        fix = f"use rollout_tp_size {' or '.join(map(str, sorted(ok)))}" if ok else "use another rollout_tp_size"
        raise LayoutError(
            f"rollout_tp_size={tp} cannot split the model's {heads} attention heads and {kv} KV heads (vLLM needs "
            f"num_attention_heads % tp == 0 and num_key_value_heads % tp == 0 or tp % num_key_value_heads == 0); "
            f"{fix}.",
            option="rollout_tp_size", value=tp, rule="tp_splits_heads",
            fixes=[{"rollout_tp_size": t} for t in sorted(ok)],
        )
    sp = layout.sequence_parallel_size
    if heads % sp:
        ok = [s for s in divisors(layout.num_processes) if heads % s == 0
              and (layout.train_batch_size * layout.rollout_n) % (layout.num_processes // s) == 0]
        ok = sorted(sorted(ok, key=lambda s: (abs(s - sp), s))[:2])
        raise LayoutError(
            f"sequence_parallel_size={sp} does not divide the model's {heads} attention heads (Ulysses splits "
            f"heads over the sequence-parallel group); use sequence_parallel_size {' or '.join(map(str, ok))}.",
            option="sequence_parallel_size", value=sp, rule="sp_splits_heads",
            fixes=[{"sequence_parallel_size": s} for s in ok],
        )


# ---------------------------------------------------------------------------------------------- one report
@dataclass(frozen=True)
class MemoryEstimate:
    """The memory section of ``trl-nrollout plan``: the KV cache at the layout's ``n``, a KV-vs-n table and the
    engine weights per GPU (and, given a GPU size, whether it fits)."""

    model: ModelShape
    kv: KVEstimate
    kv_vs_n: tuple[KVEstimate, ...]
    weights_bytes_per_gpu: int | None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def sampler_bytes_per_gpu(self) -> int | None:
        """vLLM's sampler at one step: ``[concurrent sequences, vocab]`` entries of
        :data:`SAMPLER_BYTES_PER_LOGIT` bytes, on every GPU of the engine (the logits are gathered whole); this
        is what ``max_num_seqs`` bounds. None when the vocabulary size is unknown."""
        if self.model.vocab_size is None:
            return None
        return self.kv.concurrent_sequences * self.model.vocab_size * SAMPLER_BYTES_PER_LOGIT

    @property
    def kv_budget_bytes_per_gpu(self) -> int | None:
        """What vLLM can give the KV cache on one GPU: ``gpu_memory x utilization - weights - sampler buffers``
        (activations and CUDA graphs take a little more in practice)."""
        if self.gpu_memory_gib is None or self.weights_bytes_per_gpu is None:
            return None
        util = 1.0 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        return int(self.gpu_memory_gib * 2**30 * util) - self.weights_bytes_per_gpu - (self.sampler_bytes_per_gpu or 0)

    def fits(self, kv: KVEstimate) -> bool | None:
        budget = self.kv_budget_bytes_per_gpu
        return None if budget is None else kv.bytes_per_gpu_shared <= budget

    def to_dict(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "model": asdict(self.model),
            "block_size": kv.block_size,
            "max_prompt_length": kv.prompt_len,
            "max_completion_length": kv.response_len,
            "max_num_seqs": kv.max_num_seqs,
            "kv_bytes_per_token": kv.bytes_per_token,
            "kv_bytes_per_token_per_gpu": kv.bytes_per_token_per_gpu,
            "kv_heads_per_gpu": kv_heads_per_gpu(self.model.num_key_value_heads, kv.tp_size),
            "tokens_per_sequence": kv.tokens_per_sequence,
            "blocks_per_sequence": kv.blocks_per_sequence,
            "kv_bytes_per_sequence": kv.bytes_per_sequence,
            "concurrent_sequences": kv.concurrent_sequences,
            "kv_bytes_per_engine": kv.bytes_per_engine,
            "kv_bytes_per_engine_shared_prefix": kv.bytes_per_engine_shared,
            "kv_bytes_per_gpu": kv.bytes_per_gpu,
            "kv_bytes_per_gpu_shared_prefix": kv.bytes_per_gpu_shared,
            "prefix_sharing_saves_bytes_per_gpu": kv.saved_bytes_per_gpu,
            "num_parameters": self.model.num_parameters,
            "weights_bytes_per_gpu": self.weights_bytes_per_gpu,
            "vocab_size": self.model.vocab_size,
            "sampler_bytes_per_gpu": self.sampler_bytes_per_gpu,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_budget_bytes_per_gpu": self.kv_budget_bytes_per_gpu,
            "kv_fits": self.fits(kv),
            "kv_vs_n": [
                {"n": e.n, "samples_per_engine": e.samples_per_engine, "concurrent_sequences": e.concurrent_sequences,
                 "kv_bytes_per_gpu": e.bytes_per_gpu, "kv_bytes_per_gpu_shared_prefix": e.bytes_per_gpu_shared,
                 "kv_bytes_per_engine": e.bytes_per_engine, "fits": self.fits(e)}
                for e in self.kv_vs_n
            ],
            "notes": list(self.notes),
        }

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows with the arithmetic spelled out."""
        m, kv = self.model, self.kv
        heads_gpu = kv_heads_per_gpu(m.num_key_value_heads, kv.tp_size)
        cap = "no cap" if kv.max_num_seqs is None else f"max_num_seqs={kv.max_num_seqs}"
        rows = [
            ("KV bytes per token", f"2 x {m.num_hidden_layers} layers x {m.num_key_value_heads} KV heads x "
                                   f"head_dim {m.head_dim} x {m.dtype_bytes} B = {kv.bytes_per_token:,} B"),
            ("  per GPU", f"{heads_gpu} KV head(s) per GPU at rollout_tp_size={kv.tp_size} -> "
                          f"{kv.bytes_per_token_per_gpu:,} B"),
            ("tokens per sequence", f"{kv.prompt_len} prompt + {kv.response_len} completion = "
                                    f"{kv.tokens_per_sequence} -> {kv.blocks_per_sequence} blocks of {kv.block_size}"),
            ("KV per sequence", f"{kv.blocks_per_sequence} blocks x {kv.block_size} tokens x {kv.bytes_per_token:,} B = "
                                f"{fmt_bytes(kv.bytes_per_sequence)}"),
            ("concurrent sequences", f"min({kv.samples_per_engine} samples per engine, {cap}) = "
                                     f"{kv.concurrent_sequences} ({kv.groups_in_flight} prompt groups)"),
            ("KV per engine", f"{fmt_bytes(kv.bytes_per_engine)}; prompt prefix shared: "
                              f"{fmt_bytes(kv.bytes_per_engine_shared)}"),
            ("KV per GPU", f"{kv.blocks:,} blocks = {fmt_bytes(kv.bytes_per_gpu)}; prompt prefix shared "
                           f"({kv.shared_prompt_blocks} full prompt blocks per group): {kv.blocks_shared:,} blocks = "
                           f"{fmt_bytes(kv.bytes_per_gpu_shared)} (saves {fmt_bytes(kv.saved_bytes_per_gpu)})"),
        ]
        if self.weights_bytes_per_gpu is not None and m.num_parameters is not None:
            rows.append(("weights per GPU", f"{m.num_parameters:,} params x {m.dtype_bytes} B / "
                                            f"tp {kv.tp_size} = {fmt_bytes(self.weights_bytes_per_gpu)}"))
        if self.sampler_bytes_per_gpu is not None:
            rows.append(("sampler buffers", f"{kv.concurrent_sequences} concurrent sequences x vocab "
                                            f"{m.vocab_size:,} x {SAMPLER_BYTES_PER_LOGIT} B = "
                                            f"{fmt_bytes(self.sampler_bytes_per_gpu)} (bounded by max_num_seqs)"))
        budget = self.kv_budget_bytes_per_gpu
        if budget is not None:
            util = 1.0 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
            verdict = "fits" if self.fits(kv) else "does NOT fit: vLLM will preempt or cap concurrency"
            rows.append(("KV budget per GPU", f"{self.gpu_memory_gib:g} GiB x {util:g} - weights - sampler = "
                                              f"{fmt_bytes(budget)}; KV (shared prefix) {verdict}"))
        return rows

    def kv_vs_n_table(self) -> str:
        """How the KV cache per GPU grows with ``n`` (same prompts per engine)."""
        head = ["n", "samples/engine", "concurrent", "KV per GPU", "shared prefix", "KV per engine"]
        if self.kv_budget_bytes_per_gpu is not None:
            head.append("fits")
        body = []
        capped = False
        for e in self.kv_vs_n:
            cap = "*" if e.concurrent_sequences < e.samples_per_engine else ""
            capped = capped or bool(cap)
            row = [str(e.n), str(e.samples_per_engine), f"{e.concurrent_sequences}{cap}", fmt_bytes(e.bytes_per_gpu),
                   fmt_bytes(e.bytes_per_gpu_shared), fmt_bytes(e.bytes_per_engine)]
            if self.kv_budget_bytes_per_gpu is not None:
                row.append("yes" if self.fits(e) else "no")
            body.append(row)
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]]
        if capped:
            lines.append(f"* capped by max_num_seqs={self.kv.max_num_seqs}: the other samples wait for a free slot.")
        return "\n".join(lines)

    def table(self) -> str:
        m = self.model
        title = (f"memory per engine: {m.name or 'model'} ({m.num_hidden_layers} layers, {m.num_attention_heads} "
                 f"heads, {m.num_key_value_heads} KV heads, head_dim {m.head_dim}, {m.dtype})")
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [title, *(f"{k.ljust(width)}  {v}" for k, v in rows)]
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", f"KV cache vs n ({self.kv.prompts_per_engine} prompts per engine, "
                      f"{self.kv.tokens_per_sequence} tokens per sequence):", self.kv_vs_n_table()]
        return "\n".join(lines)


def estimate_memory(
    shape: ModelShape,
    layout: RolloutLayout,
    *,
    max_prompt_length: int = DEFAULT_MAX_PROMPT_LENGTH,
    max_completion_length: int = DEFAULT_MAX_COMPLETION_LENGTH,
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS,
    n_values: Sequence[int] = DEFAULT_N_VALUES,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float | None = None,
    block_size: int = VLLM_BLOCK_SIZE,
    notes: Iterable[str] = (),
    pool_factor: float = 1.0,
) -> MemoryEstimate:
    """The memory estimate of ``layout``'s engines for a model of shape ``shape`` (see the module docstring).
    ``pool_factor``: the groups an engine keeps in flight per group of its share (partial rollouts: ``1 +
    rollout_partial_oversample``)."""
    if pool_factor < 1:
        raise ValueError(f"pool_factor={pool_factor} must be >= 1 (groups in flight per group of the engine's share).")
    pool = math.ceil(layout.prompts_per_engine * pool_factor - 1e-9)

    def at(n: int) -> KVEstimate:
        return estimate_kv(
            num_layers=shape.num_hidden_layers, num_kv_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
            dtype_bytes=shape.dtype_bytes, prompt_len=max_prompt_length, response_len=max_completion_length,
            prompts_per_engine=pool, n=n, tp_size=layout.rollout_tp_size,
            max_num_seqs=max_num_seqs, block_size=block_size,
        )

    values = sorted({*n_values, layout.rollout_n})
    weights = (None if shape.num_parameters is None
               else weights_bytes_per_gpu(shape.num_parameters, shape.dtype_bytes, layout.rollout_tp_size))
    return MemoryEstimate(
        model=shape, kv=at(layout.rollout_n), kv_vs_n=tuple(at(n) for n in values),
        weights_bytes_per_gpu=weights, gpu_memory_gib=gpu_memory_gib,
        gpu_memory_utilization=gpu_memory_utilization, notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------- thin loaders
def load_config_dict(name_or_path: str) -> tuple[dict[str, Any], str]:
    """The config of a ``builtin:`` name, a local folder (or ``config.json`` file) or a hub id, as a dict, with
    where it was read from. Local files are read as JSON (no transformers import); hub ids go through
    ``transformers.AutoConfig``, the local Hub cache first, then the network (models the plan knows offline never
    get here: :data:`~trl_nrollout.plan.models.KNOWN_CONFIGS`)."""
    from trl_nrollout.builtin import is_builtin, resolve_model

    location = resolve_model(name_or_path) if is_builtin(name_or_path) else name_or_path
    path = Path(location)
    if path.is_dir() and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), str(path)
    if path.is_file() and path.suffix == ".json":
        return json.loads(path.read_text()), str(path)
    if path.is_dir():
        raise ValueError(f"model_name_or_path={name_or_path!r} is a folder without a config.json.")
    from transformers import AutoConfig

    try:  # the Hub cache first: a model read before answers without the network (and without its retries offline)
        return AutoConfig.from_pretrained(location, local_files_only=True).to_dict(), location
    except OSError:
        pass
    return AutoConfig.from_pretrained(location).to_dict(), location


def count_parameters(config: dict[str, Any] | str) -> int:
    """Exact parameter count of the causal LM of ``config`` (a config dict with ``model_type``, or a local folder
    / hub id), built on the ``meta`` device: no memory is allocated and no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, str):
        cfg = AutoConfig.from_pretrained(config)
    else:
        kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "architectures")}
        cfg = AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def load_model_shape(name_or_path: str, *, dtype: str | None = None, count_params: bool = True) -> ModelShape:
    """:class:`ModelShape` of a ``builtin:`` name, local folder or hub id; ``count_params`` builds the model on
    the ``meta`` device to count its parameters (a model type transformers does not know leaves it ``None``)."""
    config, location = load_config_dict(name_or_path)
    params = None
    if count_params:
        try:
            params = count_parameters(location if Path(location).is_dir() else config)
        except Exception:  # an architecture transformers cannot build: the KV figures still hold
            params = None
    return ModelShape.from_config_dict(config, dtype=dtype, num_parameters=params, name=name_or_path)
