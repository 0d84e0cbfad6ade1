"""``plan --predict`` and ``plan --suggest`` as a library: ``plan`` options -> the model, the workload and the
device of the cost model (:mod:`trl_nrollout.plan.cost`), and their tables. No torch at import, none for a known
model or a local config."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trl_nrollout.plan.cost import PHASES, StepPrediction, predict_step, predict_vs_n
from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.figures import LAYOUT_KEYS, pool_factor
from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.memory import (
    DEFAULT_MAX_COMPLETION_LENGTH,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_PROMPT_LENGTH,
)
from trl_nrollout.plan.readers import (
    PlanError,
    device_of,
    dims_of,
    engine_utilization,
    lora_rank,
    rows_varlen,
    teacher_dims_of,
)
from trl_nrollout.plan.search import memory_checks, predict_split
from trl_nrollout.plan.search import suggest as search
from trl_nrollout.plan.shapes import padfree_token_cap
from trl_nrollout.plan.update_budget import UpdateBudget
from trl_nrollout.plan.workload import Workload

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trl_nrollout.plan.search import Candidate

SHARDING = ("none", "zero2", "zero3", "fsdp", "zero3_offload")
#: the shardings ``--suggest`` tries when none is given (FSDP is priced as ZeRO-3: the same gathers and splits)
SEARCHED_SHARDING = ("none", "zero2", "zero3")
#: tried by ``--suggest`` where none of those fits: the optimizer offloaded to host memory (slower steps)
OFFLOAD_SHARDING = ("zero3_offload",)
#: the engine's memory fractions ``--suggest`` tries beside the trainer's default (verl's tuning guide: raise it, with
#: the engine sleeping while the trainer works, until the trainer no longer fits)
SEARCHED_UTILIZATION = (0.5, 0.7)


def workload_of(values: dict[str, Any], budget: UpdateBudget | None = None) -> tuple[Workload, list[str]]:
    """The workload of ``plan`` options, and notes on what was assumed. ``budget``: the update's token budget
    (:func:`~trl_nrollout.plan.update_budget.update_budget`; None: count-based micro batches)."""
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
    lora = lora_rank(values)
    try:
        work = Workload(prompt_len=float(prompt), completion_mean=float(completion), completion_max=int(completion_max),
                        max_num_seqs=int(values.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS), kl=kl,
                        sharded=sharding in ("zero3", "fsdp", "zero3_offload"), optimizer_sharded=sharding == "zero2",
                        optimizer_offloaded=sharding == "zero3_offload", lora_r=lora,
                        critic=values.get("trainer") == "ppo" or values.get("adv_estimator") == "gae",
                        nodes=int(values.get("nnodes") or 1), padfree_rows=values.get("padding_free") is not False,
                        varlen_rows=rows_varlen(values),
                        update_token_budget=None if budget is None else budget.tokens,
                        gradient_checkpointing=values.get("gradient_checkpointing") is not False,
                        pool_factor=pool_factor(values), partial=bool(values.get("rollout_partial")),
                        teacher=teacher_dims_of(values), teacher_engine=values.get("teacher_backend") == "vllm",
                        temperature=float(values.get("temperature") or 1.0),
                        lora_sync="adapter" if lora is not None and lora_sync_mode(values) == "adapter" else "merged")
    except ValueError as err:
        raise PlanError(str(err)) from None
    return work, notes


def lora_sync_mode(values: dict[str, Any]) -> str:
    """``rollout_lora_sync`` of ``plan`` options (the trainer's default ``"auto"`` when not set)."""
    mode = values.get("rollout_lora_sync") or "auto"
    if mode not in ("merged", "adapter", "auto"):
        raise PlanError(f"rollout_lora_sync={mode!r} must be 'merged', 'adapter' or 'auto' (the trainer's default: "
                        "the cheaper step of the two, priced).")
    return mode


def resolve_lora_sync(values: dict[str, Any], dims: ModelDims, layout: RolloutLayout, work: Workload,
                      dev: DeviceProfile, split: tuple[RolloutLayout, dict[str, Any]] | None = None
                      ) -> tuple[Workload, str | None]:
    """``work`` with ``rollout_lora_sync="auto"`` decided as the trainer decides it (the cheaper step,
    :func:`~trl_nrollout.plan.lora.price_lora_sync`), and the note saying why; unchanged without LoRA or with
    an explicit mode. ``split``: rollout ranks (the engines' layout and the split's figures), ``layout`` then the
    trainers'."""
    if work.lora_r is None or lora_sync_mode(values) != "auto":
        return work, None
    from trl_nrollout.plan.lora import price_lora_sync

    if split is None:
        price = price_lora_sync(dims, layout, work, dev)
    else:
        price = price_lora_sync(dims, layout, work, dev, engines=split[0], cross_node=split[1].get("cross_node", False),
                                staleness=split[1]["rollout_lookahead"])
    return replace(work, lora_sync=price.choice), price.reason() + "."


def verdict(values: dict[str, Any], dims: ModelDims, layout: RolloutLayout | None, work: Workload,
            dev: DeviceProfile, pred: StepPrediction, *, colocated: bool = True) -> dict[str, Any]:
    """Whether ``pred`` fits ``dev``'s memory (:func:`~trl_nrollout.plan.search.memory_checks`, the rule ``--suggest``
    applies), each limit's line, the one that binds first (the largest share over its limit), and a fix that makes
    every limit fit, found by pricing the usual changes one at a time."""
    util = engine_utilization(values, rollout_ranks=not colocated)
    sleep = bool(values.get("vllm_enable_sleep_mode"))
    checks = memory_checks(pred, dev, util, sleep, colocated=colocated)
    failing = sorted((c for c in checks if not c.fits), key=lambda c: -c.ratio)
    out: dict[str, Any] = {"fits": not failing, "checks": [c.__dict__ for c in checks],
                           "lines": [c.line() for c in checks], "binds": failing[0].what if failing else None,
                           "fix": None}
    if not failing:
        return out

    if layout is None:  # a split launch: a budgeted update where the trainers' states leave room, else the search
        first = failing[0]
        trainer = next(c for c in checks if c.what == "trainer")
        per_token = pred.activation_bytes / max(pred.details.get("update_slots_per_forward", 0.0), 1.0)
        tokens = None
        if (not trainer.fits and pred.activation_bytes and work.update_token_budget is None
                and all(c.fits for c in failing if c.what != "trainer")):
            from trl_nrollout.plan.activations import default_update_token_budget

            longest = math.ceil(work.row_width)
            if pred.train_bytes + longest * per_token <= trainer.limit:
                tokens = default_update_token_budget(dims, device_memory_bytes=trainer.limit,
                                                     state_bytes_per_device=pred.train_bytes, longest_sample=longest,
                                                     gradient_checkpointing=work.gradient_checkpointing,
                                                     dtype_bytes=min(dims.dtype_bytes, 2),
                                                     max_tokens=padfree_token_cap(longest, min(dims.dtype_bytes, 2))
                                                     if work.padfree_rows and not work.varlen_rows else None)
        out["fix"] = (f"use_dynamic_bsz (its default budget here: ppo_max_token_len_per_device {tokens})" if tokens
                      else "run `trl-nrollout plan --suggest --suggest-rollout-ranks` with these options (it searches "
                           "the splits, TP, max_num_seqs and the trainers' sharding)")
        out["message"] = (f"this layout does not fit {dev.name}'s {dev.memory_gib:g} GiB: the {first.what} binds "
                          f"first ({first.used / 2**30:.3g} GiB > {first.limit / 2**30:.3g} GiB, "
                          f"{first.limit_parts}). Fix: {out['fix']}.")
        return out

    def fits(w: Workload, u: float = util, sl: bool = sleep) -> bool:
        return all(c.fits for c in memory_checks(predict_step(dims, layout, w, dev), dev, u, sl, colocated=colocated))

    fixes = []
    if any(c.what == "engine" for c in failing):
        kv, weights = pred.details["kv_bytes"], pred.details["engine_weight_bytes"]
        running = max(1.0, min(layout.samples_per_engine, work.max_num_seqs))
        room = dev.memory_gib * 2**30 * util - weights
        seqs = int(room // (kv / running)) if room > 0 else 0
        if seqs >= 1 and fits(replace(work, max_num_seqs=seqs)):
            fixes.append(f"max_num_seqs {seqs} (rollout_max_num_seqs: the KV cache of fewer sequences at once)")
        for tp in (t for t in (2, 4, 8) if t > layout.rollout_tp_size and layout.num_processes % t == 0):
            try:
                bigger = RolloutLayout.build(**{**{k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None},
                                                "rollout_tp_size": tp})
            except LayoutError:
                continue
            if all(c.fits for c in memory_checks(predict_step(dims, bigger, work, dev), dev, util, sleep,
                                                 colocated=colocated)):
                fixes.append(f"rollout_tp_size {tp}")
                break
    if any(c.what == "trainer" for c in failing):
        trainer_room = next(c for c in checks if c.what == "trainer").limit
        per_token = pred.activation_bytes / max(pred.details["update_slots_per_forward"], 1.0)

        def budget_for(w: Workload, room: float) -> int | None:  # the trainer's default budget beside w's states
            from trl_nrollout.plan.activations import default_update_token_budget
            from trl_nrollout.plan.shapes import padfree_token_cap

            longest = math.ceil(w.row_width)
            states = predict_step(dims, layout, w, dev).train_bytes
            if states + longest * per_token > room:
                return None
            return default_update_token_budget(
                dims, device_memory_bytes=int(room), state_bytes_per_device=states, longest_sample=longest,
                gradient_checkpointing=w.gradient_checkpointing, dtype_bytes=min(dims.dtype_bytes, 2),
                max_tokens=padfree_token_cap(longest, min(dims.dtype_bytes, 2))
                if w.padfree_rows and not w.varlen_rows else None)

        steps: list[tuple[str, Workload, bool]] = [("", work, sleep)]
        if not work.sharded:
            steps.append(("trainer_sharding zero3 (trl-nrollout train --accelerate_config zero3)",
                          replace(work, sharded=True, optimizer_sharded=False), sleep))
        found = None
        for label, w, sl in steps:
            if label and fits(w, sl=sl):
                found = label
                break
            room = dev.memory_gib * 2**30 if sl or not colocated else trainer_room
            tokens = budget_for(w, room)
            if tokens is not None and fits(replace(w, update_token_budget=tokens), sl=sl):
                found = " with ".join(x for x in (label, f"use_dynamic_bsz (its default budget here: "
                                                         f"ppo_max_token_len_per_device {tokens})") if x)
                break
            if colocated and not sl:
                tokens = budget_for(w, dev.memory_gib * 2**30)
                w2 = w if tokens is None else replace(w, update_token_budget=tokens)
                if fits(w2, sl=True):
                    found = " with ".join(x for x in (label, "" if tokens is None else
                                                      f"use_dynamic_bsz (ppo_max_token_len_per_device {tokens})",
                                                      "vllm_enable_sleep_mode true") if x)
                    break
        if found:
            fixes.append(found)
    first = failing[0]
    out["fix"] = ("; or ".join(fixes) if fixes else
                  "no single change fits it: run `trl-nrollout plan --suggest` with these options (it searches TP, "
                  "max_num_seqs, n and the trainer's sharding), or use more or larger devices")
    out["message"] = (f"this layout does not fit {dev.name}'s {dev.memory_gib:g} GiB: the {first.what} binds first "
                      f"({first.used / 2**30:.3g} GiB > {first.limit / 2**30:.3g} GiB, {first.limit_parts})"
                      + "".join(f"; the {c.what} too ({c.used / 2**30:.3g} > {c.limit / 2**30:.3g} GiB)"
                                for c in failing[1:])
                      + f". Fix: {out['fix']}.")
    return out


def prediction_rows(pred: StepPrediction) -> list[tuple[str, str]]:
    d = pred.details
    rows = [(f"  {phase}", f"{pred.phases[phase]:.3g} s") for phase in PHASES
            if phase != "teacher_log_prob" or pred.phases[phase] > 0]  # the teacher's row only with a teacher
    rows += [("  step", f"{pred.total_s:.3g} s -> {pred.samples_per_s:.3g} samples/s"),
             ("  decode", f"{d['decode_steps']:.0f} engine steps x {d['decode_step_s'] * 1e3:.3g} ms "
                          f"({d['mean_running']:.0f} sequences running on average, {d['decode_bound']}-bound)"),
             ("  update forwards", f"{d['update_forwards_per_epoch']:.0f} per rank per epoch, "
                                   f"{d['update_slots_per_forward']:,.0f} token slots each ("
                                   + ("shared-prompt rows" if d.get("update_packed") else
                                      "padding-free rows" if d.get("update_padfree") else "padded rows") + ")"),
             *([("  sequence parallel", f"{d['sequence_parallel_size']} ranks per group (Ulysses): each computes and "
                                        f"holds 1/{d['sequence_parallel_size']} of its group's tokens; all-to-alls "
                                        f"{d['all_to_all_s']:.3g} s per step")]
               if d.get("sequence_parallel_size", 1) > 1 else []),
             ("  weight sync", f"{d['weight_sync_bytes'] / 2**20:,.1f} MiB per sync ("
                               + ("the LoRA adapter: the engines serve it" if d.get("lora_sync") == "adapter" else
                                  "full weights, the LoRA adapter merged in" if d.get("lora_sync") else "full weights")
                               + ")"),
             ("  memory per device", f"engine {pred.engine_bytes / 2**30:.3g} GiB (weights + KV), trainer "
                                     f"{pred.train_bytes / 2**30:.3g} GiB (weights, grads, Adam"
                                     + "".join(f"; the {who}'s weights {d[key] / 2**30:.3g} GiB"
                                               for who, key in (("reference", "ref_weight_bytes"),
                                                                ("teacher", "teacher_weight_bytes")) if d.get(key))
                                     + ") + "
                                     f"{pred.activation_bytes / 2**30:.3g} GiB (update activations)")]
    return rows


def predict(values: dict[str, Any], layout: RolloutLayout, n_values: tuple[int, ...],
            budget: UpdateBudget | None = None) -> dict[str, Any]:
    """The prediction of ``layout`` and how it grows with ``n`` (JSON-ready), with its table lines. ``budget``: the
    update's token budget (:func:`~trl_nrollout.plan.update_budget.update_budget`)."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values, budget)
    work, why = resolve_lora_sync(values, dims, layout, work, dev)
    notes += [why] if why else []
    pred = predict_step(dims, layout, work, dev)
    kwargs = {k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None}
    table = predict_vs_n(dims, kwargs, work, dev, sorted({*n_values, layout.rollout_n}))
    base = dict(table).get(layout.rollout_n, pred).total_s
    fit = verdict(values, dims, layout, work, dev, pred)
    lines = [f"predicted step: {dims.name} ({dims.num_parameters / 1e9:.3g}B params, {dims.dtype}) on {dev.name}"]
    rows = prediction_rows(pred) + [("  memory check", line) for line in fit["lines"]]
    width = max(len(k) for k, _ in rows)
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", f"predicted step vs n ({layout.train_batch_size} prompts per step):",
              "   n  step (s)  vs this n  generation (s)  update (s)  samples/s"]
    for n, p in table:
        lines.append(f"{n:>4}  {p.total_s:>8.3g}  {p.total_s / base:>8.2f}x  {p.phases['generation']:>14.3g}  "
                     f"{p.phases['update']:>10.3g}  {p.samples_per_s:>9.3g}")
    lines += [f"note: {n}" for n in notes] + [f"device: {dev.source}" if dev.source else ""]
    return {"json": {"device": dev.to_dict(), "model": {"name": dims.name, "num_parameters": dims.num_parameters},
                     "workload": work.__dict__, "step": pred.to_dict(),
                     "vs_n": [{"n": n, **p.to_dict()} for n, p in table], "notes": notes,
                     "fits": fit["fits"], "memory": fit},
            "lines": [line for line in lines if line != ""], "fits": fit["fits"], "message": fit.get("message")}


def suggest(values: dict[str, Any], n_values: tuple[int, ...], top: int = 10, rollout_ranks: bool = False
            ) -> dict[str, Any]:
    """The layouts that fit, ranked by predicted samples/s, and the refused ones with reasons (JSON-ready), with
    their table lines. ``rollout_ranks``: also the launches split into trainers and rollout ranks (generating
    ``rollout_lookahead`` steps ahead, default 1)."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values)
    if work.lora_r is not None and lora_sync_mode(values) == "auto":
        notes.append("rollout_lora_sync='auto' is searched as merged weights; --predict prices both for a layout.")
    world = values.get("num_processes") or (values.get("n_gpus_per_node") or 0) * (values.get("nnodes") or 1)
    prompts = values.get("train_batch_size")
    if not world or not prompts:
        raise PlanError("--suggest needs the devices and the prompts per step: pass --num-processes (or "
                        "--n-gpus-per-node and --nnodes) and --train-batch-size.")
    util = engine_utilization(values)
    shardings = SEARCHED_SHARDING if not values.get("trainer_sharding") else None
    extra = {k: values[k] for k in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_device",
                                    "log_prob_micro_batch_size_per_device", "ref_log_prob_micro_batch_size_per_device",
                                    "sequence_parallel_size") if values.get(k) is not None}
    ahead = values.get("rollout_lookahead")
    ahead = 1 if ahead is None else int(ahead)
    nnodes = int(values.get("nnodes") or 1)
    local = int(values.get("n_gpus_per_node") or max(1, int(world) // nnodes))
    # the engine's memory fraction and sleep mode are searched too where the recipe leaves them to the trainer
    utils = (util,) if values.get("gpu_memory_utilization") is not None else tuple(sorted({util, *SEARCHED_UTILIZATION}))
    sleeps = ((bool(values["vllm_enable_sleep_mode"]),) if values.get("vllm_enable_sleep_mode") is not None
              else (False, True))

    def run(tried: Sequence[str] | None, more: dict | None = None) -> list[Candidate]:
        found: list[Candidate] = []
        for i, (u, sleep) in enumerate((u, s) for u in utils for s in sleeps):
            try:
                part = search(dims, int(world), int(prompts), work, dev, n_values=n_values, gpu_memory_utilization=u,
                              sleep_mode=sleep, layout_extra={**extra, **(more or {})},
                              rollout_ranks=rollout_ranks and i == 0, lookahead=ahead, local_world=local,
                              shardings=tried,
                              try_dynamic_bsz=not any(values.get(k) is not None for k in (
                                  "ppo_micro_batch_size_per_device", "use_dynamic_bsz", "ppo_max_token_len_per_device")))
            except ValueError as err:
                raise PlanError(str(err)) from None
            for c in part:
                if c.options.get("rollout_ranks"):
                    continue  # a split launch: its engines own their devices (searched once, above)
                if len(utils) > 1:
                    c.options["gpu_memory_utilization"] = u
                if len(sleeps) > 1:
                    c.options["vllm_enable_sleep_mode"] = sleep
            found += part
        fit_first, seen = [], set()
        for c in sorted((c for c in found if c.reason is None), key=lambda c: -c.prediction.samples_per_s):
            # the same layout at a larger engine share or with sleep mode, where that changes nothing (a KV cache
            # that fits either way): the smallest share, awake, only
            key = (tuple(sorted((k, v) for k, v in c.options.items()
                                if k not in ("gpu_memory_utilization", "vllm_enable_sleep_mode"))),
                   round(c.prediction.total_s, 9), c.prediction.engine_bytes, c.prediction.trainer_bytes)
            if key not in seen:
                seen.add(key)
                fit_first.append(c)
        return fit_first + [c for c in found if c.reason is not None]

    found = run(shardings)
    if shardings is not None and not any(c.reason is None for c in found):  # sharding alone fits nothing
        found = [c for c in run(OFFLOAD_SHARDING) if c.reason is None] + found
        notes.append("no layout fits with the trainer sharded on its devices alone: tried ZeRO-3 with the optimizer "
                     "offloaded to host memory (zero3_offload: slower optimizer steps, host memory per device "
                     "12 bytes per trained parameter / data-parallel size).")
    if not any(c.reason is None for c in found) and not values.get("sequence_parallel_size"):
        for sp in (s for s in (2, 4, 8) if int(world) % s == 0 and dims.num_attention_heads % s == 0):
            tried = [c for c in run(shardings, {"sequence_parallel_size": sp}) if c.reason is None]
            if shardings is not None and not tried:
                tried = [c for c in run(OFFLOAD_SHARDING, {"sequence_parallel_size": sp}) if c.reason is None]
            if tried:  # a sample's activations split over sp ranks (Ulysses): the smallest sp that fits
                for c in tried:
                    c.options["sequence_parallel_size"] = sp
                found = tried + found
                notes.append(f"no layout fits with whole samples on each device: sequence_parallel_size={sp} (Ulysses: "
                             f"each sample's tokens split over {sp} ranks, its activations 1/{sp} per device) fits.")
                break
    fit = [c for c in found if c.reason is None]
    refused = [c for c in found if c.reason is not None]
    lines = [f"layouts for {dims.name} on {world} x {dev.name}, {prompts} prompts per step, ranked by predicted "
             f"samples/s ({len(fit)} fit, {len(refused)} refused):",
             "rank  tp  n   max_num_seqs           sharding  update micro batch  step (s)  samples/s  generation (s)  "
             "engine GiB  trainer GiB  engine share"
             + ("  trainers + rollout ranks" if rollout_ranks else "")]
    def share(o: dict) -> str:  # the engine's memory fraction, and whether it sleeps while the trainer works
        if o.get("rollout_ranks"):
            return "own devices"
        u = o.get("gpu_memory_utilization", util)
        sleeping = o.get("vllm_enable_sleep_mode", bool(values.get("vllm_enable_sleep_mode")))
        return f"{u:.2f}" + (" sleep" if sleeping else "")

    for i, c in enumerate(fit[:top], 1):
        p, o = c.prediction, c.options
        split = ""
        if rollout_ranks:
            r = o.get("rollout_ranks", 0)
            split = (f"  {int(world) - r} + {r} (rollout_lookahead={ahead})" if r
                     else "  colocated (every process both)")
        shard = (o.get("trainer_sharding") or values.get("trainer_sharding") or "none") + (
            f" sp{o['sequence_parallel_size']}" if o.get("sequence_parallel_size", 1) > 1 else "")
        update = (f"<= {o['ppo_max_token_len_per_device']} tokens" if o.get("use_dynamic_bsz") else
                  f"<= {work.update_token_budget} tokens" if work.update_token_budget else "count")
        lines.append(f"{i:>4}  {o['rollout_tp_size']:>2}  {o['rollout_n']:<3} {o['max_num_seqs']:>12}  "
                     f"{shard:>17}  {update:>18}  {p.total_s:>8.3g}  {p.samples_per_s:>9.3g}  {p.phases['generation']:>14.3g}  "
                     f"{p.engine_bytes / 2**30:>10.3g}  {p.trainer_bytes / 2**30:>11.3g}  {share(o):>12}{split}")
    if fit:
        lines.append("run the first: " + launch_command(values, fit[0].options, int(world)))
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



#: plan option -> the trainer's option of the same meaning, where the names differ
TRAIN_NAMES = {"max_num_seqs": "rollout_max_num_seqs", "dtype": "rollout_dtype",
               "gpu_memory_utilization": "vllm_gpu_memory_utilization"}
#: plan options that only describe the machine or the workload to the planner: no training option carries them
PLAN_ONLY = ("num_processes", "n_gpus_per_node", "nnodes", "gpu_memory_gib", "device", "prompt_tokens_mean",
             "completion_tokens_mean", "trainer_sharding")


def train_flags(options: dict[str, Any]) -> list[str]:
    """``--name value`` of the trainer's options for plan ``options`` (plan names mapped to the trainer's;
    ``lora_r`` -> ``--use_peft true --lora_r R``; the planner's machine and workload options left out)."""
    flags: list[str] = []
    for key, value in options.items():
        if key.startswith("_") or key in PLAN_ONLY or value is None:
            continue
        if key == "lora_r":
            flags += ["--use_peft", "true", "--lora_r", str(value)]
            continue
        if key == "rollout_ranks" and not value:
            continue
        flags += [f"--{TRAIN_NAMES.get(key, key)}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def launch_command(values: dict[str, Any], options: dict[str, Any], world: int) -> str:
    """The command that runs a suggested layout: ``trl-nrollout train`` under accelerate with the shipped accelerate
    config of its trainer sharding by name (``--accelerate_config zero3``: ``accelerate launch --config_file
    recipes/accelerate/zero3.yaml -m trl_nrollout.recipe.run``, found where the package is installed), the recipe
    (``--config``), then the options the plan's command line gave (``values["_flags"]``) and the layout's, under the
    trainer's names, so that training resolves what was planned. Planned without a recipe, the command names
    ``--config YOUR_RECIPE.yaml`` (the dataset and rewards: ``train`` without one runs the built-in CPU default)."""
    sharding = options.get("trainer_sharding") or values.get("trainer_sharding") or "none"
    from trl_nrollout.plan.search import SHARDING_CONFIGS

    layout = {k: v for k, v in options.items() if k in (
        "rollout_tp_size", "rollout_n", "max_num_seqs", "rollout_ranks", "use_dynamic_bsz",
        "ppo_max_token_len_per_device", "sequence_parallel_size", "gpu_memory_utilization", "vllm_enable_sleep_mode")}
    given = {k: v for k, v in (values.get("_flags") or {}).items() if k not in layout}
    config = values.get("_config") or "YOUR_RECIPE.yaml"
    name = SHARDING_CONFIGS[sharding].rsplit("/", 1)[-1].removesuffix(".yaml")  # a shipped config, by name
    flags = " ".join(train_flags({**given, **layout}))
    return f"trl-nrollout train --accelerate_config {name} --num_processes {world} --config {config} {flags}"


def predict_rollout_ranks(values: dict[str, Any], trainers: RolloutLayout, split: dict[str, Any],
                          budget: UpdateBudget | None = None) -> dict[str, Any]:
    """``plan --predict`` with ``rollout_ranks``: the engines' generation on the rollout ranks, the trainers' phases,
    the transfer, and the step synchronous and pipelined (``rollout_lookahead``), beside the same devices colocated
    (every process trains and generates) for comparison. ``split``: the figures of
    :func:`~trl_nrollout.plan.figures.split_rollout_ranks`."""
    dims, dev = dims_of(values), device_of(values)
    work, notes = workload_of(values, budget)
    engines_n, tp = split["engines"], split["rollout_tp_size"]
    prompts, n = trainers.train_batch_size, trainers.rollout_n
    busiest = -(-prompts // engines_n)  # the engine with the most groups sets the generation time
    if busiest * engines_n != prompts:
        notes.append(f"{prompts} prompts over {engines_n} engines: the busiest engine's {busiest} set the time.")
    try:
        engines = RolloutLayout.build(num_processes=split["rollout_ranks"], rollout_tp_size=tp,
                                      train_batch_size=busiest * engines_n, rollout_n=n,
                                      adv_estimator=values.get("adv_estimator") or "grpo")
    except LayoutError as err:
        raise PlanError(str(err)) from None
    try:  # the comparison only: a batch the split shares may not split over every device's engine
        colocated = RolloutLayout.build(**{**{k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None},
                                           "num_processes": split["processes"], "rollout_tp_size": tp, "nnodes": 1,
                                           "n_gpus_per_node": None})
    except LayoutError as err:
        colocated = None
        notes.append(f"the same {split['processes']} devices colocated are not compared: "
                     f"{str(err).split('; ')[0]}.")
    work, why = resolve_lora_sync(values, dims, trainers, work, dev, split=(engines, split))
    notes += [why] if why else []
    pred = predict_split(dims, engines, trainers, work, dev, cross_node=split.get("cross_node", False))
    together = None if colocated is None else predict_step(dims, colocated, work, dev)
    trained = predict_step(dims, trainers, work, dev)
    fit = verdict(values, dims, None, work, dev, StepPrediction(
        phases={}, total_s=0.0, samples_per_s=0.0, engine_bytes=pred.engine_bytes, train_bytes=trained.train_bytes,
        activation_bytes=trained.activation_bytes, details=trained.details), colocated=False)
    ahead = split["rollout_lookahead"]
    step = pred.step_s(ahead)
    rows = [(f"generation (rollout ranks, {engines_n} engines)", f"{pred.generation_s:.3g} s"),
            ("training (old/ref passes, update)", f"{pred.train_s:.3g} s"),
            ("weight transfer", f"{pred.transfer_s:.3g} s (device -> host, gloo "
                                + ("over the node link" if split.get("cross_node") else "on the node")
                                + " -> rollout ranks' devices)"),
            ("step, synchronous (rollout_lookahead=0)", f"{pred.sync_s:.3g} s"),
            ("step, pipelined (rollout_lookahead>=1)", f"{pred.pipelined_s:.3g} s"),
            (f"this recipe (rollout_lookahead={ahead})", f"{step:.3g} s -> {pred.samples / step:.3g} samples/s"),
            *([] if together is None else [(f"the same {split['processes']} devices colocated",
                                             f"{together.total_s:.3g} s -> {together.samples_per_s:.3g} samples/s")]),
            ("memory per device", f"engine {pred.engine_bytes / 2**30:.3g} GiB, trainer "
                                  f"{pred.train_bytes / 2**30:.3g} GiB"),
            *[("memory check", line.replace("engine ", "engine (a rollout rank) ", 1)
               .replace("trainer ", "trainer (a trainer's device) ", 1)) for line in fit["lines"]]]
    width = max(len(k) for k, _ in rows)
    lines = [f"predicted step: {dims.name} ({dims.num_parameters / 1e9:.3g}B params, {dims.dtype}) on {dev.name}, "
             f"{split['trainers']} trainers + {split['rollout_ranks']} rollout ranks"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in notes] + ([f"device: {dev.source}"] if dev.source else [])
    return {"json": {"device": dev.to_dict(), "model": {"name": dims.name, "num_parameters": dims.num_parameters},
                     "workload": work.__dict__, "split": pred.to_dict(), "step_s": step,
                     "colocated": None if together is None else together.to_dict(), "notes": notes,
                     "fits": fit["fits"], "memory": fit},
            "lines": lines, "fits": fit["fits"], "message": fit.get("message")}
