"""The search of ``trl-nrollout plan --suggest`` over the step's cost model (:mod:`trl_nrollout.plan.cost`):
every layout of the devices (TP sizes, ``rollout_n``, ``max_num_seqs``, trainer shardings, token budgets) predicted
and checked against the device's memory (:func:`memory_checks`, :func:`fits_memory`), ranked best
first (:func:`suggest`, each a :class:`Candidate`); and the launches split into trainers and rollout ranks
(:class:`SplitPrediction`, :func:`predict_split`, :func:`split_candidates`). Pure: no torch at import."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from trl_nrollout.plan.cost import StepPrediction, _gather_s, predict_step, trainer_state_bytes
from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.layout import LayoutError, RolloutLayout, divisors
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION
from trl_nrollout.plan.shapes import padfree_token_cap
from trl_nrollout.plan.workload import Workload


@dataclass(frozen=True)
class Candidate:
    """One layout the search tried: its options, its prediction (None when refused) and why it was refused."""

    options: dict[str, Any]
    prediction: StepPrediction | None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"options": self.options, "reason": self.reason,
                "prediction": None if self.prediction is None else self.prediction.to_dict()}


#: the trainer's sharding choices (``trainer_sharding``) and the accelerate config of this repository that gives each
SHARDING_CONFIGS = {"none": "recipes/accelerate/ddp.yaml", "zero2": "recipes/accelerate/zero2.yaml",
                    "zero3": "recipes/accelerate/zero3.yaml", "fsdp": "recipes/accelerate/fsdp.yaml",
                    "zero3_offload": "recipes/accelerate/zero3_offload.yaml"}


@dataclass(frozen=True)
class MemoryCheck:
    """One device memory limit of a prediction: what holds it (``what``: ``engine`` or ``trainer``), the bytes it
    needs (``used``) and may use (``limit``), and how both are made (``used_parts``, ``limit_parts``)."""

    what: str
    used: int
    limit: int
    used_parts: str
    limit_parts: str

    @property
    def fits(self) -> bool:
        return self.used <= self.limit

    @property
    def ratio(self) -> float:
        return self.used / max(self.limit, 1)

    def line(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"{self.what} {self.used / 2**30:.3g} GiB ({self.used_parts}) vs {self.limit / 2**30:.3g} GiB "
                f"({self.limit_parts}): {verdict}")


def memory_checks(prediction: StepPrediction, dev: DeviceProfile, gpu_memory_utilization: float,
                  sleep_mode: bool, *, colocated: bool = True) -> list[MemoryCheck]:
    """The engine's and the trainer's memory per device against what each may use: the engine
    ``gpu_memory_utilization`` of its device (vLLM reserves it at start); a trainer the rest of a device it shares
    with an engine, all of it where the engine sleeps while the trainer works (``vllm_enable_sleep_mode``) or where
    it has the device to itself (``colocated=False``: rollout ranks). The trainer needs its states and its largest
    update micro batch's activations."""
    total = dev.memory_gib * 2**30
    teacher = prediction.details.get("teacher_engine_bytes") or 0
    engine = MemoryCheck("engine", prediction.engine_bytes, int(total * gpu_memory_utilization),
                         "weights + KV cache" + (f" + the teacher's engine {teacher / 2**30:.3g} GiB" if teacher else ""),
                         f"gpu_memory_utilization {gpu_memory_utilization:g} x "
                                               f"{dev.memory_gib:g} GiB")
    if not colocated:
        room, where = total, "the whole device"
    elif sleep_mode:
        room, where = total, "the whole device: the engine sleeps"
    else:
        room, where = total * (1 - gpu_memory_utilization), "what the engine leaves"
    trainer = MemoryCheck("trainer", prediction.trainer_bytes, int(room),
                          f"states {prediction.train_bytes / 2**30:.3g} GiB + update activations "
                          f"{prediction.activation_bytes / 2**30:.3g} GiB", where)
    return [engine, trainer]


def fits_memory(prediction: StepPrediction, dev: DeviceProfile, gpu_memory_utilization: float,
                sleep_mode: bool, *, colocated: bool = True) -> str | None:
    """Why the prediction's memory does not fit the device (None: it fits): the first limit of
    :func:`memory_checks` it breaks, with the usual fixes."""
    for check in memory_checks(prediction, dev, gpu_memory_utilization, sleep_mode, colocated=colocated):
        if check.fits:
            continue
        if check.what == "engine":
            return (f"engine weights + KV cache {check.used / 2**30:.1f} GiB > {gpu_memory_utilization:g} x "
                    f"{dev.memory_gib:g} GiB" + ("" if colocated else " on a rollout rank")
                    + " (raise rollout_tp_size or lower max_num_seqs)")
        return (f"trainer states {prediction.train_bytes / 2**30:.1f} GiB + update activations "
                f"{prediction.activation_bytes / 2**30:.1f} GiB > the {check.limit / 2**30:.1f} GiB "
                + ("left beside the engine" if colocated and not sleep_mode else "of a trainer's device")
                + " (shard the trainer: ZeRO-3 / FSDP, LoRA, a smaller update micro batch"
                + (", or vllm_enable_sleep_mode)" if colocated and not sleep_mode else ", or more trainers)"))
    return None


def _caps(max_num_seqs_values: Sequence[int], samples_per_engine: int) -> list[int]:
    """The ``max_num_seqs`` values worth trying: each one below the engine's samples, and the smallest that covers
    them (larger ones run every sample at once just the same)."""
    caps = sorted(set(max_num_seqs_values))
    covering = [s for s in caps if s >= samples_per_engine]
    return [s for s in caps if s <= samples_per_engine or s == covering[0]]


def _tp_refusal(dims: ModelDims, tp: int) -> str | None:
    if dims.num_attention_heads % tp or (dims.num_key_value_heads % tp and tp % dims.num_key_value_heads):
        return (f"rollout_tp_size={tp} does not split {dims.num_attention_heads} attention heads / "
                f"{dims.num_key_value_heads} KV heads")
    return None


def default_budget(dims: ModelDims, layout: RolloutLayout, work: Workload, trainer_memory_bytes: int) -> int:
    """The trainer's default update token budget (:func:`~trl_nrollout.plan.activations.default_update_token_budget`)
    on a device that leaves the trainer ``trainer_memory_bytes``, beside ``work``'s states on ``layout``, capped
    where padding-free rows' masks outgrow their bound (:func:`~trl_nrollout.plan.shapes.padfree_token_cap`)."""
    from trl_nrollout.plan.activations import default_update_token_budget

    longest = math.ceil(work.row_width)
    states = trainer_state_bytes(dims, work, layout.data_parallel_size * layout.sequence_parallel_size) * (
        2 if work.critic else 1)
    queries = min(dims.dtype_bytes, 2)
    return default_update_token_budget(dims, device_memory_bytes=trainer_memory_bytes,
                                       state_bytes_per_device=int(states), longest_sample=longest,
                                       gradient_checkpointing=work.gradient_checkpointing, dtype_bytes=queries,
                                       max_tokens=padfree_token_cap(longest, queries)
                                       if work.padfree_rows and not work.varlen_rows else None)


def _shardings(work: Workload, shardings: Sequence[str] | None) -> list[tuple[str | None, Workload]]:
    """``work`` under each trainer sharding to try (None: ``work`` as it is, unnamed)."""
    if shardings is None:
        return [(None, work)]
    unknown = [x for x in shardings if x not in SHARDING_CONFIGS]
    if unknown:
        raise ValueError(f"trainer sharding {unknown} unknown: use {list(SHARDING_CONFIGS)}.")
    return [(x, replace(work, sharded=x in ("zero3", "fsdp", "zero3_offload"), optimizer_sharded=x == "zero2",
                        optimizer_offloaded=x == "zero3_offload")) for x in shardings]


def _teacher_placements(work: Workload) -> list[tuple[str | None, Workload]]:
    """``work`` with its teacher in each place it can run (``teacher_backend``: the trainer processes, or a vLLM
    engine of its own); ``[(None, work)]`` without a teacher."""
    if work.teacher is None:
        return [(None, work)]
    return [("trainer", replace(work, teacher_engine=False)), ("vllm", replace(work, teacher_engine=True))]


def suggest(dims: ModelDims, num_processes: int, train_batch_size: int, work: Workload, dev: DeviceProfile, *,
            n_values: Sequence[int], max_num_seqs_values: Sequence[int] = (64, 128, 256, 512, 1024),
            gpu_memory_utilization: float = COLOCATED_GPU_MEMORY_UTILIZATION, sleep_mode: bool = False,
            layout_extra: dict | None = None, rollout_gpu_memory_utilization: float | None = None,
            rollout_ranks: bool = False, lookahead: int = 1, local_world: int | None = None,
            shardings: Sequence[str] | None = None, try_dynamic_bsz: bool = False) -> list[Candidate]:
    """Every layout of ``num_processes`` devices and ``train_batch_size`` prompts over TP sizes, ``n_values`` and
    ``max_num_seqs_values``: the ones that fit ranked by predicted samples per second (best first), then the refused
    ones with their reasons. ``rollout_ranks``: also every split of the devices into trainers and rollout ranks
    (:func:`split_candidates`, generating ``lookahead`` steps ahead; ``local_world`` devices per node), whose
    engines take ``rollout_gpu_memory_utilization`` of their device (default: a dedicated device's 0.9, what the
    trainer gives them). ``shardings``: the trainer's sharding choices to try (:data:`SHARDING_CONFIGS`' keys; each
    candidate's options then name it and its accelerate config); None: only ``work``'s own. ``try_dynamic_bsz``:
    each layout also with token-budgeted update micro batches at the trainer's default budget
    (:func:`default_budget`; the options then say ``use_dynamic_bsz`` and the budget). With a teacher
    (``work.teacher``) each layout with the teacher in the trainer processes and on an engine of its own (the options
    say ``teacher_backend``)."""
    if num_processes < 1 or train_batch_size < 1:
        raise ValueError(f"num_processes={num_processes} and train_batch_size={train_batch_size} must be >= 1.")
    if not n_values:
        raise ValueError("n_values is empty: give at least one rollout_n.")
    fit, refused = [], []
    for tp in divisors(num_processes):
        why = _tp_refusal(dims, tp)
        if why:
            refused.append(Candidate({"rollout_tp_size": tp}, None, why))
            continue
        for n in n_values:
            kwargs = {**(layout_extra or {}), "num_processes": num_processes, "rollout_tp_size": tp,
                      "train_batch_size": train_batch_size, "rollout_n": n}
            try:
                layout = RolloutLayout.build(**kwargs)
            except LayoutError as err:
                refused.append(Candidate({"rollout_tp_size": tp, "rollout_n": n}, None, str(err).split("; ")[0]))
                continue
            for seqs in _caps(max_num_seqs_values, layout.samples_per_engine):
                for sharding, base in _shardings(work, shardings):
                    for teacher, w in _teacher_placements(base):
                        updates: list[int | None] = [work.update_token_budget]
                        if try_dynamic_bsz and work.update_token_budget is None:
                            room = dev.memory_gib * 2**30 * (1 if sleep_mode else 1 - gpu_memory_utilization)
                            updates.append(default_budget(dims, layout, w, int(room)))
                        for budget in updates:
                            options = {"rollout_tp_size": tp, "rollout_n": n, "max_num_seqs": seqs}
                            if sharding is not None:
                                options.update(trainer_sharding=sharding, accelerate_config=SHARDING_CONFIGS[sharding])
                            if budget is not None and budget != work.update_token_budget:
                                options.update(use_dynamic_bsz=True, ppo_max_token_len_per_device=budget)
                            elif try_dynamic_bsz and budget is None:  # the trainer's default would budget: say count
                                options["use_dynamic_bsz"] = False
                            if teacher is not None:
                                options["teacher_backend"] = teacher
                            if rollout_ranks:
                                options["rollout_ranks"] = 0
                            pred = predict_step(dims, layout, replace(w, max_num_seqs=seqs, update_token_budget=budget),
                                                dev)
                            why = fits_memory(pred, dev, gpu_memory_utilization, sleep_mode)
                            (refused if why else fit).append(Candidate(options, pred, why))
    if rollout_ranks:
        for c in split_candidates(dims, num_processes, train_batch_size, work, dev, n_values=n_values,
                                  max_num_seqs_values=max_num_seqs_values,
                                  gpu_memory_utilization=rollout_gpu_memory_utilization or ROLLOUT_RANK_GPU_MEMORY_UTILIZATION,
                                  layout_extra=layout_extra,
                                  lookahead=lookahead, local_world=local_world or num_processes):
            (refused if c.reason else fit).append(c)
    fit.sort(key=lambda c: -c.prediction.samples_per_s)
    return fit + refused


# ---------------------------------------------------------------------------------------------- rollout ranks
@dataclass(frozen=True)
class SplitPrediction:
    """A step with ``rollout_ranks``: the engines' generation (on the rollout ranks), the trainers' phases (on the
    others), the weight transfer between them, and the step they make synchronous (``sync_s``: generation, then
    the transfer, then training) and with ``rollout_lookahead >= 1`` (``pipelined_s``: generation of the next step
    beside training of this one, so the longer of the two, plus the transfer). Memory per device of each world."""

    generation_s: float
    train_s: float
    transfer_s: float
    sync_s: float
    pipelined_s: float
    samples: int
    engine_bytes: int
    train_bytes: int

    def step_s(self, staleness: int) -> float:
        return self.sync_s if staleness == 0 else self.pipelined_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def host_transfer_s(weight_bytes: float, receivers: int, cross_node: bool, dev: DeviceProfile,
                    gather_s: float = 0.0) -> float:
    """Seconds to move ``weight_bytes`` of the policy from trainer rank 0 to ``receivers`` rollout ranks as the
    launch does (:class:`~trl_nrollout.rollout.ranks.client.RemoteEngines`): trainer rank 0 gathers (``gather_s``) and
    copies each bucket to host memory (``host_rate``) while a thread broadcasts the previous one over gloo (host to
    host, a binomial tree: ``ceil(log2(receivers + 1))`` rounds at ``gloo_bw``, at most the node link's
    ``node_link_bw x link_eff`` when the rollout ranks are on another node: ``cross_node``), so the longer of the
    two; then each rollout rank copies the version to its device (``host_rate``); plus ``sync_s``."""
    rounds = max(1, math.ceil(math.log2(receivers + 1)))
    net = dev.gloo_bw
    if cross_node and dev.node_link_bw:
        net = min(net, dev.node_link_bw * dev.link_eff)
    to_host = gather_s + weight_bytes / dev.host_rate
    return dev.sync_s + max(to_host, rounds * weight_bytes / net) + weight_bytes / dev.host_rate


def predict_split(dims: ModelDims, engines: RolloutLayout, trainers: RolloutLayout, work: Workload,
                  dev: DeviceProfile, *, cross_node: bool = False) -> SplitPrediction:
    """:func:`~trl_nrollout.plan.cost.predict_step` for a launch split into ``engines`` (the rollout ranks' layout:
    their engines and each engine's share of the step's samples) and ``trainers`` (the trainers' layout). The
    transfer goes through host memory over gloo (:func:`host_transfer_s`; ``cross_node``: the rollout ranks sit
    on another node than trainer rank 0), after the trainers' gather of a sharded model."""
    gen = predict_step(dims, engines, work, dev)
    train = predict_step(dims, trainers, work, dev)
    train_s = sum(train.phases[p] for p in ("old_log_prob", "ref_log_prob", "teacher_log_prob", "update"))
    adapter = train.details.get("lora_sync") == "adapter"  # the adapter alone is gathered: no sharded-model gather
    transfer = host_transfer_s(train.details["weight_sync_bytes"], engines.num_processes, cross_node, dev,
                               0.0 if adapter else _gather_s(dims, trainers, work, dev))
    generation = gen.phases["generation"]
    return SplitPrediction(generation_s=generation, train_s=train_s, transfer_s=transfer,
                           sync_s=generation + transfer + train_s, pipelined_s=max(generation, train_s) + transfer,
                           samples=trainers.total_samples, engine_bytes=gen.engine_bytes,
                           train_bytes=train.train_bytes)


def split_candidates(dims: ModelDims, num_processes: int, train_batch_size: int, work: Workload,
                     dev: DeviceProfile, *, n_values: Sequence[int], max_num_seqs_values: Sequence[int],
                     gpu_memory_utilization: float, layout_extra: dict | None, lookahead: int,
                     local_world: int) -> list[Candidate]:
    """Every split of ``num_processes`` devices into trainers and ``rollout_ranks`` (a multiple of the engines'
    TP size, as the launch allows: :func:`~trl_nrollout.plan.roles.roles_refusal`), each TP size, ``n`` and
    ``max_num_seqs``, predicted by :func:`predict_split`: the step is the pipelined one with ``lookahead >= 1``
    (generation of the next step beside training), else the synchronous one. Memory per device: a rollout rank
    holds its engine (within ``gpu_memory_utilization``), a trainer its states (the whole device); the trainers'
    collectives cross the nodes' links only when the trainers span several nodes. The candidates' ``phases`` are
    the engines' generation and the trainers' phases; ``details`` say the split."""
    from trl_nrollout.plan.roles import roles_refusal

    extra = dict(layout_extra or {})
    out = []
    for tp in divisors(num_processes):
        if _tp_refusal(dims, tp):
            continue  # said once by the colocated search
        for ranks in range(tp, num_processes, tp):
            options = {"rollout_ranks": ranks, "rollout_tp_size": tp}
            why = roles_refusal(num_processes, ranks, local_world, tp)
            if why:
                out.append(Candidate(options, None, why))
                continue
            engines_n = ranks // tp
            busiest = -(-train_batch_size // engines_n)  # the engine with the most groups sets the time
            for n in n_values:
                try:
                    engines = RolloutLayout.build(num_processes=ranks, rollout_tp_size=tp,
                                                  train_batch_size=busiest * engines_n, rollout_n=n,
                                                  adv_estimator="reinforce_plus_plus")  # any n: trainers check it
                    trainers = RolloutLayout.build(**{**extra, "num_processes": num_processes - ranks,
                                                      "rollout_tp_size": 1, "train_batch_size": train_batch_size,
                                                      "rollout_n": n})
                except LayoutError as err:
                    out.append(Candidate({**options, "rollout_n": n}, None, str(err).split("; ")[0]))
                    continue
                trainer_nodes = max(1, -(-(num_processes - ranks) // local_world))  # the rollout ranks: the last
                for seqs in _caps(max_num_seqs_values, engines.samples_per_engine):
                    w = replace(work, max_num_seqs=seqs, nodes=trainer_nodes)
                    gen, train = predict_step(dims, engines, w, dev), predict_step(dims, trainers, w, dev)
                    split = predict_split(dims, engines, trainers, w, dev,
                                          cross_node=num_processes > local_world)
                    total = split.step_s(lookahead)
                    phases = {**train.phases, "generation": gen.phases["generation"]}
                    details = {**gen.details, "rollout_ranks": ranks, "trainers": num_processes - ranks,
                               "rollout_lookahead": lookahead, "sync_s": split.sync_s,
                               "pipelined_s": split.pipelined_s}
                    pred = StepPrediction(phases=phases, total_s=total, samples_per_s=split.samples / total,
                                          engine_bytes=split.engine_bytes, train_bytes=split.train_bytes,
                                          details=details, activation_bytes=train.activation_bytes)
                    why = fits_memory(pred, dev, gpu_memory_utilization, False, colocated=False)
                    out.append(Candidate({**options, "rollout_n": n, "max_num_seqs": seqs}, pred, why))
    return out
