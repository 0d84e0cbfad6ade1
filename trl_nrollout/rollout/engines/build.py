"""The one engine builder: :func:`build_engine` turns a typed settings value into an engine, the engine's class picked
by the settings' type (:data:`BUILDERS`). The trainer (``trainer/engines.py``), a rollout rank
(``trainer/rollout_ranks.py``, settings from the trainers' start message: :func:`rollout_rank_settings`) and
``calibrate`` all build through it. A new engine adds a settings dataclass and its builder here
(:func:`register_engine`) and implements :mod:`trl_nrollout.rollout.engines.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from torch import nn

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.engines.protocol import RolloutEngine
from trl_nrollout.rollout.engines.weight_sync import DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class VLLMEngineSettings:
    """A :class:`~trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup`'s arguments (its docstring says what each
    means); the defaults are its own."""

    model: str
    layout: RolloutLayout
    rank: int = 0
    local_rank: int | None = None
    dtype: str = "auto"
    max_model_len: int = 1024
    expected_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    enable_sleep_mode: bool = False
    seed: int = 0
    max_num_seqs: int | None = None
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    tokenizer: str | None = None
    seed_mode: str = "sample"
    trust_remote_code: bool = False
    dispatch: str = "shares"
    lora_rank: int | None = None
    exclusive: bool = True


@dataclass(frozen=True)
class HFEngineSettings:
    """An :class:`~trl_nrollout.rollout.engines.hf_engine.HFEngine`'s arguments: the training ``model`` itself (it generates
    with it), its pad and stop tokens, the prompts per ``generate`` call, the seed, TRL's generation context (a
    callable giving a context manager that yields the model to generate with), whether a prompt is scored once for
    its ``n`` samples, whether forwards are local inside the context, the prompt batches' padding multiple and this
    process's rank."""

    model: nn.Module
    pad_token_id: int
    eos_token_ids: list[int]
    batch_size: int = 64
    seed: int = 0
    generation_context: Callable[[], Any] | None = None
    shared_prompts: bool = False
    local_forwards: bool = False
    pad_to_multiple_of: int | None = None
    rank: int = 0


S = TypeVar("S")
#: settings type -> the function that builds its engine
BUILDERS: dict[type, Callable[[Any], RolloutEngine]] = {}


def register_engine(settings_type: type[S]) -> Callable[[Callable[[S], RolloutEngine]], Callable[[S], RolloutEngine]]:
    """Decorator: ``builder(settings)`` builds the engine of ``settings_type``'s settings."""

    def register(builder: Callable[[S], RolloutEngine]) -> Callable[[S], RolloutEngine]:
        BUILDERS[settings_type] = builder
        return builder

    return register


def build_engine(settings: VLLMEngineSettings | HFEngineSettings) -> RolloutEngine:
    """The engine ``settings`` describe (its class picked by the settings' type). Collective where the engine's
    start is (vLLM's process groups): every rank of the job calls it with its own settings."""
    builder = BUILDERS.get(type(settings))
    if builder is None:
        raise TypeError(f"no engine is registered for {type(settings).__name__} settings (known: "
                        f"{sorted(t.__name__ for t in BUILDERS)}); register one with register_engine.")
    return builder(settings)


def _arguments(settings: object) -> dict[str, Any]:
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


@register_engine(VLLMEngineSettings)
def _build_vllm(settings: VLLMEngineSettings) -> RolloutEngine:
    # (imported when an engine is built: the vLLM group's module imports the episode loops and vLLM's helpers)
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    kwargs = _arguments(settings)
    return VLLMEngineGroup(kwargs.pop("model"), kwargs.pop("layout"), **kwargs)


@register_engine(HFEngineSettings)
def _build_hf(settings: HFEngineSettings) -> RolloutEngine:
    from trl_nrollout.rollout.engines.hf_engine import HFEngine

    kwargs = _arguments(settings)
    return HFEngine(kwargs.pop("model"), **kwargs)


def rollout_rank_settings(message: dict, *, rollout_ranks: int, nodes: int, tp: int, rank: int, local_rank: int,
                          cpu: bool) -> VLLMEngineSettings:
    """A rollout rank's engine settings from the trainers' ``start`` message (:mod:`trl_nrollout.rollout.ranks.client`):
    the engines' layout over the ``rollout_ranks`` (``nodes`` nodes, TP ``tp``), ``max_num_seqs`` (the message's,
    else one engine's share of a job's samples, capped), the CPU KV cache's default for that share; ``rank`` is the
    rollout rank's role rank."""
    from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
    from trl_nrollout.rollout.engines.vllm_settings import _kv_bytes_default

    layout = RolloutLayout.build(num_processes=rollout_ranks, nnodes=nodes, rollout_tp_size=tp,
                                 train_batch_size=rollout_ranks, rollout_n=1,
                                 adv_estimator="reinforce_plus_plus")  # the engines' shape; sizes below
    per_engine = -(-message["job_samples"] // layout.num_engines)
    max_seqs = message["max_num_seqs"] or max(1, min(per_engine, DEFAULT_MAX_NUM_SEQS))
    kv = message["kv_cache_memory_bytes"]
    if kv is None and cpu:
        dtype = "float32" if message["dtype"] == "auto" else message["dtype"]
        kv = _kv_bytes_default(message["model"], min(max_seqs, per_engine), message["expected_len"],
                               message["max_model_len"], tp, dtype)
    return VLLMEngineSettings(
        message["model"], layout, rank=rank, local_rank=local_rank, dtype=message["dtype"],
        max_model_len=message["max_model_len"], expected_len=message["expected_len"], max_num_seqs=max_seqs,
        kv_cache_memory_bytes=kv, gpu_memory_utilization=message["gpu_memory_utilization"],
        enforce_eager=message["enforce_eager"], enable_prefix_caching=message["enable_prefix_caching"],
        enable_sleep_mode=message["enable_sleep_mode"], seed=message["seed"], seed_mode=message["seed_mode"],
        trust_remote_code=message["trust_remote_code"], lora_rank=message.get("lora_rank"),
        dispatch=message.get("dispatch", "shares"))
