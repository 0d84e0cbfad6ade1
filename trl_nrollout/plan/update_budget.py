"""The update's micro batches in ``trl-nrollout plan``: count-based (``ppo_micro_batch_size_per_device``) or
token-budgeted (``use_dynamic_bsz`` / ``ppo_max_token_len_per_device``, verl's names), with the default budget the
trainer takes when none is given (:func:`~trl_nrollout.plan.activations.default_update_token_budget`).

The options resolve as the trainer's config resolves them (``NRolloutConfig._resolve_dynamic_bsz``):
``use_dynamic_bsz`` None follows :func:`default_dynamic_bsz` (the trainer's rule); a budget with
``use_dynamic_bsz=False`` is a contradiction; with it on, the old-policy and reference passes take the same budget unless their own micro batches
are sized. Pure: no torch (a known model's dimensions come from :data:`~trl_nrollout.plan.models.KNOWN_CONFIGS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_nrollout.plan.activations import (
    DEFAULT_ACTIVATION_FRACTION,
    activation_bytes_per_token,
    default_update_token_budget,
)
from trl_nrollout.plan.cost import frozen_weight_bytes, trainer_state_bytes
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.memory import DEFAULT_MAX_COMPLETION_LENGTH, DEFAULT_MAX_PROMPT_LENGTH, fmt_bytes
from trl_nrollout.plan.packing_rules import MAX_PACKED_MASK_BYTES
from trl_nrollout.plan.readers import (
    PlanError,
    bool_option,
    device_of,
    dims_of,
    engine_utilization,
    lora_rank,
    rows_varlen,
    teacher_dims_of,
)
from trl_nrollout.plan.shapes import padfree_token_cap
from trl_nrollout.plan.workload import Workload

#: the log-prob passes' own sizes: any of them set keeps them off the update's budget (the config's rule)
LOG_PROB_SIZES = ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_device",
                  "log_prob_max_token_len_per_device")


@dataclass(frozen=True)
class UpdateBudget:
    """The update's token budget per device as ``plan`` shows it: ``tokens`` (None where it depends on a device the
    plan was not told), where it comes from (``source``), and the arithmetic of a default (``rows``). The trainer's
    own, resolved at launch, is :class:`~trl_nrollout.trainer.budgeted_update.DeviceTokenBudget`."""

    tokens: int | None
    source: str
    rows: tuple[tuple[str, str], ...] = ()


def dynamic_bsz(values: dict[str, Any]) -> tuple[bool, int | None]:
    """``(use_dynamic_bsz, explicit budget)`` of ``plan`` options, resolved as the trainer's config does; a
    :class:`PlanError` for a budget below 1 or set with ``use_dynamic_bsz=False``."""
    budget = values.get("ppo_max_token_len_per_device")
    use = bool_option(values, "use_dynamic_bsz")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise PlanError(f"ppo_max_token_len_per_device={budget!r} must be a whole number >= 1 (tokens per update micro "
                        "batch per device, at least the longest sample: max_prompt_length + max_completion_length).")
    if use is False and budget is not None:
        raise PlanError(f"use_dynamic_bsz=False with ppo_max_token_len_per_device={budget}: the budget only applies "
                        "to token-budgeted micro batches; remove one of them.")
    if use is None:
        use = default_dynamic_bsz(budget, values.get("train_batch_size"), values.get("ppo_micro_batch_size_per_device"))
    return use, budget


def default_dynamic_bsz(budget: int | None, train_batch_size: int | None, micro_per_device: int | None) -> bool:
    """``use_dynamic_bsz`` where it is not set, one rule for ``plan`` and the trainer's config: on with a budget
    (``ppo_max_token_len_per_device``), and on for verl's batch fields (``train_batch_size``) without an update micro
    batch (a rank's whole mini batch per forward is no default at reasoning lengths); TRL's batch fields keep TRL's
    count-based micro batches (``per_device_train_batch_size``)."""
    return budget is not None or (train_batch_size is not None and micro_per_device is None)


def longest_sample(values: dict[str, Any]) -> int:
    """``max_prompt_length + max_completion_length`` (their defaults where unset)."""
    prompt = values.get("max_prompt_length")
    completion = values.get("max_completion_length")
    return (DEFAULT_MAX_PROMPT_LENGTH if prompt is None else int(prompt)) + (
        DEFAULT_MAX_COMPLETION_LENGTH if completion is None else int(completion))


def trainer_memory_bytes(values: dict[str, Any], memory_gib: float, *, colocated: bool = True) -> int:
    """What a trainer may use of a device of ``memory_gib``: all of it on a device without an engine (rollout
    ranks' trainers) or while the engine sleeps (``vllm_enable_sleep_mode``), else what the engine leaves."""
    total = int(memory_gib * 2**30)
    if not colocated or values.get("vllm_enable_sleep_mode"):
        return total
    return int(total * (1 - engine_utilization(values)))


def update_budget(values: dict[str, Any], layout: RolloutLayout, *, state_bytes: int | None = None,
                  colocated: bool = True) -> UpdateBudget | None:
    """The update's token budget per device, or None with count-based micro batches (``use_dynamic_bsz`` off).

    A default (``use_dynamic_bsz`` without ``ppo_max_token_len_per_device``) needs the model (``--model``) and the
    device's memory (``--gpu-memory-gib`` or ``--device``'s profile); ``state_bytes``: the trainer's states per
    device (default: :func:`~trl_nrollout.plan.cost.trainer_state_bytes` of ``trainer_sharding`` and LoRA, twice
    with PPO's critic, plus the reference's and the teacher's weights where the trainers hold them:
    :func:`~trl_nrollout.plan.cost.frozen_weight_bytes`)."""
    use, budget = dynamic_bsz(values)
    if not use:
        return None
    if budget is not None:
        return UpdateBudget(budget, "ppo_max_token_len_per_device")
    longest = longest_sample(values)
    model = values.get("model_name_or_path")
    gib = values.get("gpu_memory_gib")
    if gib is None and values.get("device"):
        gib = device_of(values).memory_gib
    if not model or gib is None:
        return UpdateBudget(None, "default: from the model's size and the device's memory at launch (give --model and "
                                  f"--device or --gpu-memory-gib to see it; on a CPU max({longest}, 16384))")
    try:
        dims = dims_of(values)
    except PlanError as err:  # an unknown model offline: the layout still stands
        return UpdateBudget(None, f"default: from the model's size and the device's memory at launch ({err})")
    gc = bool_option(values, "gradient_checkpointing")
    gc = True if gc is None else gc
    sharding = values.get("trainer_sharding") or "none"
    frozen, held = 0, {}
    if state_bytes is None:
        kl = (bool(values.get("use_kl_loss")) or float(values.get("beta") or 0) > 0
              or bool(values.get("use_kl_in_reward")))
        states = Workload(prompt_len=0, completion_mean=0, completion_max=0, sharded=sharding in ("zero3", "fsdp"),
                          optimizer_sharded=sharding == "zero2", lora_r=lora_rank(values), kl=kl,
                          teacher=teacher_dims_of(values))
        critic = values.get("trainer") == "ppo" or values.get("adv_estimator") == "gae"
        # the frozen models the trainers hold beside the policy: the reference (a KL term) and a teacher
        held = dict(zip(("the reference model (a KL term)", "the teacher"),
                        frozen_weight_bytes(dims, states, layout.num_processes)))
        frozen = sum(held.values())
        state_bytes = int(trainer_state_bytes(dims, states, layout.num_processes) * (2 if critic else 1)) + frozen
    memory = trainer_memory_bytes(values, gib, colocated=colocated)
    free = values.get("padding_free") is not False and not rows_varlen(values)  # varlen rows: no mask, no cap
    cap = padfree_token_cap(longest, min(dims.dtype_bytes, 2)) if free else None
    tokens = default_update_token_budget(dims, device_memory_bytes=memory, state_bytes_per_device=state_bytes,
                                         longest_sample=longest, gradient_checkpointing=gc,
                                         dtype_bytes=min(dims.dtype_bytes, 2), max_tokens=cap)
    uncapped = default_update_token_budget(dims, device_memory_bytes=memory, state_bytes_per_device=state_bytes,
                                           longest_sample=longest, gradient_checkpointing=gc,
                                           dtype_bytes=min(dims.dtype_bytes, 2))
    per_token = activation_bytes_per_token(dims, dtype_bytes=min(dims.dtype_bytes, 2), gradient_checkpointing=gc)
    floor = " (the floor: the longest sample)" if tokens == longest else ""
    rows = [
        ("  activations per token", f"{fmt_bytes(per_token)} ({dims.name}, {dims.num_hidden_layers} layers, "
                                    f"gradient checkpointing {'on' if gc else 'off'})"),
        ("  memory for them", f"{DEFAULT_ACTIVATION_FRACTION:g} x ({fmt_bytes(memory)} for the trainer - states "
                              f"{fmt_bytes(state_bytes)}) -> {uncapped:,} tokens"
                              + (floor if tokens == uncapped else "")),
    ]
    if frozen:
        rows.insert(1, ("  frozen weights", f"{fmt_bytes(frozen)} per device of the states: "
                                            + " and ".join(name for name, b in held.items() if b)
                                            + ", held by the trainers"))
    if tokens < uncapped:
        rows.append(("  padding-free rows' mask", f"rows of {longest} tokens keep their block mask within "
                                                  f"{MAX_PACKED_MASK_BYTES >> 20} MiB up to {cap:,} real tokens -> "
                                                  f"{tokens:,}{floor} (beyond it the micro batch runs padded)"))
    rows = tuple(rows)
    return UpdateBudget(tokens, f"default: {DEFAULT_ACTIVATION_FRACTION:g} of the trainer's free memory over "
                                "activations per token, a multiple of 1024, at least the longest sample", rows)


def with_log_prob_budget(values: dict[str, Any], budget: UpdateBudget | None) -> dict[str, Any]:
    """``values`` with the log-prob passes on the update's budget where ``use_dynamic_bsz`` puts them (none of
    :data:`LOG_PROB_SIZES` set), as the trainer's config does."""
    if budget is None or budget.tokens is None or any(values.get(k) is not None for k in LOG_PROB_SIZES):
        return values
    return {**values, "log_prob_max_token_len_per_device": budget.tokens}


def check_update_budget(values: dict[str, Any], budget: UpdateBudget | None) -> None:
    """Every sample must fit one micro batch: a budget below the longest sample is an error with its fix."""
    if budget is None or budget.tokens is None:
        return
    longest = longest_sample(values)
    if budget.tokens < longest:
        raise PlanError(f"ppo_max_token_len_per_device={budget.tokens} is below the longest sample ({longest} tokens: "
                        f"max_prompt_length + max_completion_length); every sample must fit one micro batch: use "
                        f"ppo_max_token_len_per_device {longest} or more.")


def update_rows(values: dict[str, Any], layout: RolloutLayout, budget: UpdateBudget | None) -> list[tuple[str, str]]:
    """The update's micro-batch rule in words (``plan``'s table)."""
    free = values.get("padding_free") is not False
    rows_word = ("padding-free rows (real tokens end to end, rows as wide as the micro batch's longest sample) where "
                 "they save a tenth of the slots, else padded" if free else "padded")
    if budget is None:
        micro = layout.ppo_micro_batch_size_per_device
        return [("update micro batch", f"{micro} sequences per device per forward, {rows_word} (the rank's batch is "
                                       f"padded once to the step's longest sample); "
                                       f"{layout.mini_batch_samples_per_rank} / {micro} -> "
                                       f"{layout.gradient_accumulation_steps} per optimizer step")]
    size = "?" if budget.tokens is None else f"{budget.tokens:,}"
    unit = "real" if free else "padded"
    rows = [("update micro batch", f"dynamic (use_dynamic_bsz): <= {size} {unit} tokens per device per forward "
                                   f"({budget.source}); each optimizer step's {layout.mini_batch_samples_per_rank} "
                                   f"samples per rank cut into micro batches of even work, at least "
                                   f"gradient_accumulation_steps={layout.gradient_accumulation_steps}, the busiest "
                                   "rank's count on every rank")]
    return rows + list(budget.rows)
