"""The ``plan`` options read and checked, one place for the readers every part of ``plan`` shares (the figures,
``--predict`` / ``--suggest``, the update's budget): :class:`PlanError`, the device and the model of the options,
the LoRA rank, whether rows run varlen attention, the engines' memory fraction. It imports no other module of
``plan``'s figures, predictions or budgets, so that those import it and not each other. No torch at import."""

from __future__ import annotations

from typing import Any

from trl_nrollout.plan.devices import DeviceProfile, load_profile, with_memory
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION


class PlanError(Exception):
    """A user error in the plan options (the CLI reports it as ``trl-nrollout: error: <message>``, exit 2)."""


def bool_option(values: dict[str, Any], key: str) -> bool | None:
    """``values[key]``: None (not set), or a bool; a :class:`PlanError` for anything else."""
    value = values.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise PlanError(f"{key}={value!r} must be true or false.")


def device_of(values: dict[str, Any]) -> DeviceProfile:
    """The device profile of ``plan`` options (``device``, its memory overridden by ``gpu_memory_gib``)."""
    name = values.get("device")
    if not name:
        raise PlanError("--predict and --suggest need a device: pass --device h100 (or a100-40gb, a100-80gb, h200, "
                        "l40s, a saved profile, a profile JSON), or measure this machine with --calibrate.")
    try:
        return with_memory(load_profile(str(name)), values.get("gpu_memory_gib"))
    except ValueError as err:
        raise PlanError(str(err)) from None


def dims_of(values: dict[str, Any]) -> ModelDims:
    """The model's dimensions of ``plan`` options (``model_name_or_path``, ``dtype``)."""
    from trl_nrollout.plan.models import model_dims

    model = values.get("model_name_or_path")
    if not model:
        raise PlanError("--predict and --suggest need a model: pass --model (a hub id, a local folder or a builtin: "
                        "name) or set model_name_or_path in the recipe.")
    dtype = values.get("dtype")
    try:
        return model_dims(str(model), dtype=None if dtype in (None, "auto") else dtype)
    except (OSError, ValueError) as err:
        raise PlanError(f"model_name_or_path={model!r}: {err}") from None


def teacher_dims_of(values: dict[str, Any]) -> ModelDims | None:
    """The teacher's dimensions of ``plan`` options (``teacher_model_name_or_path``, in the policy's ``dtype``, as
    the trainer loads it); None without a teacher."""
    teacher = values.get("teacher_model_name_or_path")
    if not teacher:
        return None
    from trl_nrollout.plan.models import model_dims

    dtype = values.get("dtype")
    try:
        return model_dims(str(teacher), dtype=None if dtype in (None, "auto") else dtype)
    except (OSError, ValueError) as err:
        raise PlanError(f"teacher_model_name_or_path={teacher!r}: {err}") from None


def rows_varlen(values: dict[str, Any]) -> bool:
    """Whether the trainer's padding-free rows run varlen attention for ``plan`` options: padding-free, a device whose
    profile says so (:attr:`~trl_nrollout.plan.devices.DeviceProfile.varlen_attention`: CUDA), half precision
    (``bf16``, TRL's default on a GPU, not switched off)."""
    if values.get("padding_free") is False or not values.get("device") or values.get("bf16") is False:
        return False
    try:
        return device_of(values).varlen_attention
    except PlanError:
        return False


def lora_rank(values: dict[str, Any]) -> int | None:
    """The LoRA rank a recipe trains with: ``--lora-r``, or the recipe's ``use_peft`` (TRL's ModelConfig; its
    ``lora_r``, default 16); None: full training."""
    r = values.get("lora_r")
    if values.get("use_peft") and r is None:
        r = 16
    if r is None or values.get("use_peft") is False:
        return None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PlanError(f"lora_r={r!r} must be a whole number >= 1 (the LoRA adapters' rank, e.g. 16).")
    return r


def engine_utilization(values: dict[str, Any], *, rollout_ranks: bool = False) -> float:
    """The engines' memory fraction: ``gpu_memory_utilization`` where given, else the trainer's default for where
    the engines live (:data:`~trl_nrollout.plan.roles.COLOCATED_GPU_MEMORY_UTILIZATION` beside a trainer,
    :data:`~trl_nrollout.plan.roles.ROLLOUT_RANK_GPU_MEMORY_UTILIZATION` on a rollout rank)."""
    util = values.get("gpu_memory_utilization")
    if util is None:
        return ROLLOUT_RANK_GPU_MEMORY_UTILIZATION if rollout_ranks else COLOCATED_GPU_MEMORY_UTILIZATION
    if not 0 < util <= 1:
        raise PlanError(f"gpu_memory_utilization={util!r} must be in (0, 1], e.g. "
                        f"{COLOCATED_GPU_MEMORY_UTILIZATION} beside a trainer.")
    return float(util)
