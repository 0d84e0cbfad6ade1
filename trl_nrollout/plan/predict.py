"""``plan --predict`` and ``plan --suggest`` as a library: ``plan`` options -> the model, the workload and the
device of the cost model (:mod:`trl_nrollout.plan.cost`), and their tables. No torch at import, none for a known
model or a local config."""

from __future__ import annotations

from typing import Any

from trl_nrollout.plan.cost import (
    PHASES,
    ModelDims,
    StepPrediction,
    Workload,
    predict_split,
    predict_step,
    predict_vs_n,
)
from trl_nrollout.plan.cost import suggest as search
from trl_nrollout.plan.devices import DeviceProfile, load_profile, with_memory
from trl_nrollout.plan.figures import LAYOUT_KEYS, PlanError
from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.memory import (
    DEFAULT_MAX_COMPLETION_LENGTH,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_PROMPT_LENGTH,
)

SHARDING = ("none", "zero3", "fsdp")


def device_of(values: dict[str, Any]) -> DeviceProfile:
    name = values.get("device")
    if not name:
        raise PlanError("--predict and --suggest need a device: pass --device h100 (or a100-40gb, a100-80gb, h200, "
                        "l40s, a saved profile, a profile JSON), or measure this machine with --calibrate.")
    try:
        return with_memory(load_profile(str(name)), values.get("gpu_memory_gib"))
    except ValueError as err:
        raise PlanError(str(err)) from None


def dims_of(values: dict[str, Any]) -> ModelDims:
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


def workload_of(values: dict[str, Any]) -> tuple[Workload, list[str]]:
    """The workload of ``plan`` options, and notes on what was assumed."""
    notes = []
    prompt_max = values.get("max_prompt_length")
    if prompt_max is None:
        prompt_max = DEFAULT_MAX_PROMPT_LENGTH
        notes.append(f"max_prompt_length not set: {prompt_max} assumed.")
    completion_max = values.get("max_completion_length")
    if completion_max is None:
        completion_max = DEFAULT_MAX_COMPLETION_LENGTH
        notes.append(f"max_completion_length not set: {completion_max} assumed.")
    prompt = values.get("prompt_tokens_mean")
    if prompt is None:
        prompt = prompt_max
        notes.append("prompt_tokens_mean not set: every prompt assumed max_prompt_length long.")
    completion = values.get("completion_tokens_mean")
    if completion is None:
        completion = completion_max
        notes.append("completion_tokens_mean not set: every completion assumed to run to max_completion_length "
                     "(an upper bound; give the mean your task's completions reach).")
    sharding = values.get("trainer_sharding") or "none"
    if sharding not in SHARDING:
        raise PlanError(f"trainer_sharding={sharding!r} must be one of {list(SHARDING)}.")
    kl = bool(values.get("use_kl_loss")) or float(values.get("beta") or 0) > 0
    try:
        work = Workload(prompt_len=float(prompt), completion_mean=float(completion), completion_max=int(completion_max),
                        max_num_seqs=int(values.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS), kl=kl,
                        sharded=sharding != "none",
                        critic=values.get("trainer") == "ppo" or values.get("adv_estimator") == "gae",
                        nodes=int(values.get("nnodes") or 1))
    except ValueError as err:
        raise PlanError(str(err)) from None
    return work, notes


def prediction_rows(pred: StepPrediction) -> list[tuple[str, str]]:
    d = pred.details
    rows = [(f"  {phase}", f"{pred.phases[phase]:.3g} s") for phase in PHASES]
    rows += [("  step", f"{pred.total_s:.3g} s -> {pred.samples_per_s:.3g} samples/s"),
             ("  decode", f"{d['decode_steps']:.0f} engine steps x {d['decode_step_s'] * 1e3:.3g} ms "
                          f"({d['mean_running']:.0f} sequences running on average, {d['decode_bound']}-bound)"),
             ("  memory per device", f"engine {pred.engine_bytes / 2**30:.3g} GiB (weights + KV), trainer "
                                     f"{pred.train_bytes / 2**30:.3g} GiB (weights, grads, Adam)")]
    return rows


def predict(values: dict[str, Any], layout: RolloutLayout, n_values: tuple[int, ...]) -> dict[str, Any]:
    """The prediction of ``layout`` and how it grows with ``n`` (JSON-ready), with its table lines."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values)
    pred = predict_step(dims, layout, work, dev)
    kwargs = {k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None}
    table = predict_vs_n(dims, kwargs, work, dev, sorted({*n_values, layout.rollout_n}))
    base = dict(table).get(layout.rollout_n, pred).total_s
    lines = [f"predicted step: {dims.name} ({dims.num_parameters / 1e9:.3g}B params, {dims.dtype}) on {dev.name}"]
    width = max(len(k) for k, _ in prediction_rows(pred))
    lines += [f"{k.ljust(width)}  {v}" for k, v in prediction_rows(pred)]
    lines += ["", f"predicted step vs n ({layout.train_batch_size} prompts per step):",
              "   n  step (s)  vs this n  generation (s)  update (s)  samples/s"]
    for n, p in table:
        lines.append(f"{n:>4}  {p.total_s:>8.3g}  {p.total_s / base:>8.2f}x  {p.phases['generation']:>14.3g}  "
                     f"{p.phases['update']:>10.3g}  {p.samples_per_s:>9.3g}")
    lines += [f"note: {n}" for n in notes] + [f"device: {dev.source}" if dev.source else ""]
    return {"json": {"device": dev.to_dict(), "model": {"name": dims.name, "num_parameters": dims.num_parameters},
                     "workload": work.__dict__, "step": pred.to_dict(),
                     "vs_n": [{"n": n, **p.to_dict()} for n, p in table], "notes": notes},
            "lines": [line for line in lines if line != ""]}


def suggest(values: dict[str, Any], n_values: tuple[int, ...], top: int = 10, rollout_ranks: bool = False
            ) -> dict[str, Any]:
    """The layouts that fit, ranked by predicted samples/s, and the refused ones with reasons (JSON-ready), with
    their table lines. ``rollout_ranks``: also the launches split into trainers and rollout ranks (generating
    ``max_staleness`` steps ahead, default 1)."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values)
    world = values.get("num_processes") or (values.get("n_gpus_per_node") or 0) * (values.get("nnodes") or 1)
    prompts = values.get("train_batch_size")
    if not world or not prompts:
        raise PlanError("--suggest needs the devices and the prompts per step: pass --num-processes (or "
                        "--n-gpus-per-node and --nnodes) and --train-batch-size.")
    util = values.get("gpu_memory_utilization") or 0.5
    extra = {k: values[k] for k in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_device",
                                    "log_prob_micro_batch_size_per_device",
                                    "ref_log_prob_micro_batch_size_per_device") if values.get(k) is not None}
    staleness = values.get("max_staleness")
    staleness = 1 if staleness is None else int(staleness)
    nnodes = int(values.get("nnodes") or 1)
    local = int(values.get("n_gpus_per_node") or max(1, int(world) // nnodes))
    try:
        found = search(dims, int(world), int(prompts), work, dev, n_values=n_values, gpu_memory_utilization=util,
                       sleep_mode=bool(values.get("vllm_enable_sleep_mode")), layout_extra=extra,
                       rollout_ranks=rollout_ranks, max_staleness=staleness, local_world=local)
    except ValueError as err:
        raise PlanError(str(err)) from None
    fit = [c for c in found if c.reason is None]
    refused = [c for c in found if c.reason is not None]
    lines = [f"layouts for {dims.name} on {world} x {dev.name}, {prompts} prompts per step, ranked by predicted "
             f"samples/s ({len(fit)} fit, {len(refused)} refused):",
             "rank  tp  n   max_num_seqs  step (s)  samples/s  generation (s)  engine GiB  trainer GiB"
             + ("  trainers + rollout ranks" if rollout_ranks else "")]
    for i, c in enumerate(fit[:top], 1):
        p, o = c.prediction, c.options
        split = ""
        if rollout_ranks:
            r = o.get("rollout_ranks", 0)
            split = (f"  {int(world) - r} + {r} (max_staleness={staleness})" if r
                     else "  colocated (every process both)")
        lines.append(f"{i:>4}  {o['rollout_tp_size']:>2}  {o['rollout_n']:<3} {o['max_num_seqs']:>12}  "
                     f"{p.total_s:>8.3g}  {p.samples_per_s:>9.3g}  {p.phases['generation']:>14.3g}  "
                     f"{p.engine_bytes / 2**30:>10.3g}  {p.train_bytes / 2**30:>11.3g}{split}")
    if refused:
        lines.append("refused:")
        seen = set()
        for c in refused:
            key = (tuple(sorted(c.options.items())), c.reason)
            if key not in seen:
                seen.add(key)
                lines.append(f"  {', '.join(f'{k}={v}' for k, v in c.options.items())}: {c.reason}")
    lines += [f"note: {n}" for n in notes]
    return {"json": {"device": dev.name, "ranked": [c.to_dict() for c in fit],
                     "refused": [c.to_dict() for c in refused], "notes": notes}, "lines": lines,
            "fit": fit, "refused": refused}



def predict_rollout_ranks(values: dict[str, Any], trainers: RolloutLayout, split: dict[str, Any]) -> dict[str, Any]:
    """``plan --predict`` with ``rollout_ranks``: the engines' generation on the rollout ranks, the trainers' phases,
    the transfer, and the step synchronous and pipelined (``max_staleness``), beside the same devices colocated
    (every process trains and generates) for comparison. ``split``: the figures of
    :func:`~trl_nrollout.plan.figures.split_rollout_ranks`."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values)
    engines_n, tp = split["engines"], split["rollout_tp_size"]
    prompts, n = trainers.train_batch_size, trainers.rollout_n
    busiest = -(-prompts // engines_n)  # the engine with the most groups sets the generation time
    if busiest * engines_n != prompts:
        notes.append(f"{prompts} prompts over {engines_n} engines: the busiest engine's {busiest} set the time.")
    try:
        engines = RolloutLayout.build(num_processes=split["rollout_ranks"], rollout_tp_size=tp,
                                      train_batch_size=busiest * engines_n, rollout_n=n,
                                      adv_estimator=values.get("adv_estimator") or "grpo")
        colocated = RolloutLayout.build(**{**{k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None},
                                           "num_processes": split["processes"], "rollout_tp_size": tp, "nnodes": 1,
                                           "n_gpus_per_node": None})
    except LayoutError as err:
        raise PlanError(str(err)) from None
    pred = predict_split(dims, engines, trainers, work, dev)
    together = predict_step(dims, colocated, work, dev)
    staleness = split["max_staleness"]
    step = pred.step_s(staleness)
    rows = [(f"generation (rollout ranks, {engines_n} engines)", f"{pred.generation_s:.3g} s"),
            ("training (old/ref passes, update)", f"{pred.train_s:.3g} s"),
            ("weight transfer", f"{pred.transfer_s:.3g} s"),
            ("step, synchronous (max_staleness=0)", f"{pred.sync_s:.3g} s"),
            ("step, pipelined (max_staleness>=1)", f"{pred.pipelined_s:.3g} s"),
            (f"this recipe (max_staleness={staleness})", f"{step:.3g} s -> {pred.samples / step:.3g} samples/s"),
            (f"the same {split['processes']} devices colocated",
             f"{together.total_s:.3g} s -> {together.samples_per_s:.3g} samples/s"),
            ("memory per device", f"engine {pred.engine_bytes / 2**30:.3g} GiB, trainer "
                                  f"{pred.train_bytes / 2**30:.3g} GiB")]
    width = max(len(k) for k, _ in rows)
    lines = [f"predicted step: {dims.name} ({dims.num_parameters / 1e9:.3g}B params, {dims.dtype}) on {dev.name}, "
             f"{split['trainers']} trainers + {split['rollout_ranks']} rollout ranks"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in notes] + ([f"device: {dev.source}"] if dev.source else [])
    return {"json": {"device": dev.to_dict(), "model": {"name": dims.name, "num_parameters": dims.num_parameters},
                     "workload": work.__dict__, "split": pred.to_dict(), "step_s": step,
                     "colocated": together.to_dict(), "notes": notes},
            "lines": lines}
