"""The rollout layout: pure arithmetic of engines, shares and micro batches.

Nothing here touches ``torch.distributed`` or a device: a :class:`RolloutLayout` is computed from plain numbers
and validated before any model is loaded. The trainer, the engine group and ``trl-nrollout plan`` all use this
one object, so what ``plan`` prints is what training does.

Vocabulary (verl's, mapped onto TRL in :mod:`trl_nrollout.config`):

- ``train_batch_size``: prompts per rollout step (verl ``data.train_batch_size``).
- ``rollout_n``: samples generated per prompt (verl ``actor_rollout_ref.rollout.n``, TRL ``num_generations``).
- ``rollout_tp_size``: ranks per vLLM engine (tensor parallel); ``num_processes / rollout_tp_size`` engines.
- ``ppo_mini_batch_size``: prompts per optimizer step (verl semantics, multiplied by ``rollout_n``).
- ``log_prob_micro_batch_size`` (global, normalized by the data-parallel size like verl's older releases) or
  ``log_prob_micro_batch_size_per_device``: sequences per forward of the old-policy log-prob pass; the
  ``ref_`` pair does the same for the reference pass.

Worked example (DESIGN.md): 6 processes, TP 2, 60 prompts, n 12 -> 3 engines of ranks (0,1),(2,3),(4,5),
20 prompts and 240 samples per engine, 720 samples, 120 samples per rank; a global log-prob micro batch of 48
gives 48 // 6 = 8 sequences per device per forward.

Every :class:`LayoutError` names the option, its value, the rule and a fix. The fixes are not guessed: each
suggested value is tried by building the layout again with it, and only values that give a valid layout are
offered (``LayoutError.fixes`` holds them as change dicts, e.g. ``{"train_batch_size": 48}``). When another
option is wrong too, so that no single change gives a valid layout, the offered values are those that at least
clear this rule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from trl_nrollout.plan.layout_rules import (  # noqa: F401 - LayoutError, divisors, nearest_multiples are public here
    Builder,
    LayoutError,
    _by_distance,
    _is_positive_int,
    _multiples_near,
    _render,
    divisors,
    nearest_multiples,
)

#: Estimators whose baseline is computed from the other samples of the same prompt: they need ``rollout_n >= 2``.
GROUP_ESTIMATORS = frozenset(
    {"grpo", "dr_grpo", "rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline", "gpg"}
)

#: Estimators that work with one sample per prompt (offered as a fix when ``rollout_n < 2``).
NON_GROUP_ESTIMATORS = ("reinforce_plus_plus", "remax")

@dataclass(frozen=True)
class MicroBatch:
    """How one log-prob pass (old policy or reference) is cut into forwards on one device.

    ``per_device`` is the number of sequences per forward; ``max_token_len`` (when set) replaces it by a token
    budget and micro batches are packed dynamically, so ``num_micro_batches`` is then an upper bound.
    """

    per_device: int
    num_micro_batches: int
    source: str  # how per_device was obtained, in words, for `plan`
    max_token_len: int | None = None


def _build(a: dict[str, Any], suggest: bool, cls: type | None = None) -> RolloutLayout:
    """Validate the arguments of :meth:`RolloutLayout.build` and compute the layout (see there)."""
    b = Builder(a, suggest, rebuild=lambda args: _build(args, suggest=False))
    notes: list[str] = []

    # ---------------------------------------------------------------- plain values
    for name in ("n_gpus_per_node", "num_processes"):
        b.positive(name, allow_none=True)
    for name in ("nnodes", "rollout_tp_size", "train_batch_size", "rollout_n", "ppo_epochs",
                 "sequence_parallel_size"):
        b.positive(name)
    for name in ("ppo_mini_batch_size", "ppo_mini_batch_samples", "ppo_micro_batch_size_per_device",
                 "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_device",
                 "ref_log_prob_micro_batch_size", "ref_log_prob_micro_batch_size_per_device",
                 "log_prob_max_token_len_per_device", "ref_log_prob_max_token_len_per_device"):
        b.positive(name, allow_none=True)
    est = a["adv_estimator"]
    b.step()
    if not isinstance(est, str) or not est:
        raise b.fail(f"adv_estimator={est!r} must be the name of an advantage estimator",
                     rule="estimator_name", option="adv_estimator", value=est,
                     candidates=[{"adv_estimator": "grpo"}])

    # ---------------------------------------------------------------- world size
    num_processes, n_gpus, nnodes = a["num_processes"], a["n_gpus_per_node"], a["nnodes"]
    b.step()
    if num_processes is not None and n_gpus is not None and num_processes != n_gpus * nnodes:
        raise b.fail(
            f"num_processes={num_processes} disagrees with n_gpus_per_node={n_gpus} x nnodes={nnodes} = "
            f"{n_gpus * nnodes}",
            rule="world_size_mismatch", option="num_processes", value=num_processes,
            candidates=[{"n_gpus_per_node": None}, {"num_processes": None}],
            render=lambda fx: "set only one of them: " + _render(fx, None),
        )
    b.step()
    if num_processes is not None and n_gpus is None and num_processes % nnodes:
        raise b.fail(
            f"num_processes={num_processes} cannot be split evenly over nnodes={nnodes}",
            rule="processes_per_node", option="num_processes", value=num_processes,
            candidates=[{"num_processes": m} for m in _multiples_near(num_processes, nnodes)],
        )
    if num_processes is None:
        num_processes = (1 if n_gpus is None else n_gpus) * nnodes
    world = num_processes
    gpus_per_node = n_gpus if n_gpus is not None else world // nnodes

    tp, n, sp = a["rollout_tp_size"], a["rollout_n"], a["sequence_parallel_size"]
    train_batch_size = a["train_batch_size"]

    b.step()
    if world % tp:
        if n_gpus is not None and a["num_processes"] is None:  # the world size was given per node
            world_cands = [{"n_gpus_per_node": g} for g in _by_distance(n_gpus, range(1, n_gpus + 4 * tp + 1))]
        else:
            world_cands = [{"num_processes": w, **({"n_gpus_per_node": None} if n_gpus is not None else {})}
                           for w in _multiples_near(world, tp)]

        def render_tp(fx: list[dict[str, Any]]) -> str:
            parts = []
            if tps := [str(c["rollout_tp_size"]) for c in fx if "rollout_tp_size" in c]:
                parts.append("use rollout_tp_size " + " or ".join(tps))
            if gpus := [str(c["n_gpus_per_node"]) for c in fx if c.get("n_gpus_per_node")]:
                parts.append("use n_gpus_per_node " + " or ".join(gpus))
            if procs := [str(c["num_processes"]) for c in fx if "num_processes" in c]:
                parts.append("use " + " or ".join(procs) + " processes")
            return ", or ".join(parts)

        raise b.fail(
            f"rollout_tp_size={tp} does not divide the {world} processes (each engine is one group of "
            f"rollout_tp_size consecutive ranks)",
            rule="tp_divides_world", option="rollout_tp_size", value=tp,
            candidates=[[{"rollout_tp_size": d} for d in _by_distance(tp, divisors(world))], world_cands],
            render=render_tp,
        )
    b.step()
    if nnodes > 1 and gpus_per_node % tp:
        raise b.fail(
            f"rollout_tp_size={tp} does not divide the {gpus_per_node} processes per node (nnodes={nnodes}): some "
            f"engines would span two nodes, and a vLLM engine's tensor-parallel all-reduces (every layer, every "
            f"token) must stay within a node",
            rule="tp_within_node", option="rollout_tp_size", value=tp,
            candidates=[{"rollout_tp_size": d} for d in _by_distance(tp, divisors(gpus_per_node))],
        )
    b.step()
    if world % sp:
        raise b.fail(
            f"sequence_parallel_size={sp} does not divide the {world} processes",
            rule="sp_divides_world", option="sequence_parallel_size", value=sp,
            candidates=[{"sequence_parallel_size": d} for d in _by_distance(sp, divisors(world))],
        )
    num_engines = world // tp
    dp = world // sp

    # ---------------------------------------------------------------- samples
    b.step()
    if est in GROUP_ESTIMATORS and n < 2:
        raise b.fail(
            f"rollout_n={n} but adv_estimator={est!r} computes its baseline from the other samples of the same "
            f"prompt, which needs rollout_n >= 2 (8 or more is usual)",
            rule="group_needs_n", option="rollout_n", value=n,
            candidates=[[{"rollout_n": k} for k in range(2, 65)],
                        [{"adv_estimator": e} for e in NON_GROUP_ESTIMATORS]],
        )
    b.step()
    if num_engines > train_batch_size:
        raise b.fail(
            f"train_batch_size={train_batch_size} prompts is fewer than the {num_engines} rollout engines "
            f"({world} processes / rollout_tp_size={tp}): some engines would idle",
            rule="engines_exceed_prompts", option="train_batch_size", value=train_batch_size,
            candidates=[[{"train_batch_size": num_engines * k} for k in range(1, 65)],
                        [{"rollout_tp_size": d} for d in divisors(world) if d > tp]],
        )
    b.step()
    if train_batch_size % num_engines:
        raise b.fail(
            f"train_batch_size={train_batch_size} is not divisible by the {num_engines} rollout engines "
            f"({world} processes / rollout_tp_size={tp})",
            rule="prompts_divide_engines", option="train_batch_size", value=train_batch_size,
            candidates=[{"train_batch_size": m} for m in _multiples_near(train_batch_size, num_engines)],
        )
    total = train_batch_size * n
    b.step()
    if total % dp:
        step = math.lcm(num_engines, dp // math.gcd(dp, n))
        raise b.fail(
            f"train_batch_size={train_batch_size} x rollout_n={n} = {total} samples cannot be split evenly over "
            f"the data-parallel size {dp} ({world} processes / sequence_parallel_size={sp})",
            rule="samples_divide_dp", option="train_batch_size", value=train_batch_size,
            candidates=[[{"train_batch_size": m} for m in _multiples_near(train_batch_size, step)],
                        [{"rollout_n": k} for k in _by_distance(n, range(1, n + 65))]],
        )
    samples_per_rank = total // dp

    # ---------------------------------------------------------------- optimizer steps
    mini = train_batch_size if a["ppo_mini_batch_size"] is None else a["ppo_mini_batch_size"]
    mini_cands = [{"ppo_mini_batch_size": d} for d in _by_distance(mini, divisors(train_batch_size))]
    mini_samples = a["ppo_mini_batch_samples"]
    b.step()
    if mini_samples is not None:  # TRL's layouts: an optimizer step may hold part of a group
        if a["ppo_mini_batch_size"] is not None and a["ppo_mini_batch_size"] * n != mini_samples:
            raise b.fail(
                f"ppo_mini_batch_samples={mini_samples} conflicts with ppo_mini_batch_size={a['ppo_mini_batch_size']} "
                f"prompts x rollout_n={n}; set only one of them",
                rule="mini_samples_conflict", option="ppo_mini_batch_samples", value=mini_samples,
                candidates=[{"ppo_mini_batch_samples": None}])
        if mini_samples % dp:  # it need not divide the step's samples: TRL's loop runs steps across two rollouts
            raise b.fail(
                f"ppo_mini_batch_samples={mini_samples} must split evenly over the {dp} data-parallel ranks (each "
                f"rank trains the same number of samples per optimizer step)",
                rule="mini_samples_divide", option="ppo_mini_batch_samples", value=mini_samples,
                candidates=[{"ppo_mini_batch_samples": m} for m in _multiples_near(mini_samples, dp)])
        mini = mini_samples // n if mini_samples % n == 0 else mini_samples / n
    elif train_batch_size % mini:
        raise b.fail(
            f"ppo_mini_batch_size={mini} prompts must divide train_batch_size={train_batch_size} (each optimizer "
            f"step takes an equal slice of the rollout)",
            rule="mini_divides_batch", option="ppo_mini_batch_size", value=mini, candidates=mini_cands,
        )
    b.step()
    if mini_samples is None and (mini * n) % dp:
        raise b.fail(
            f"ppo_mini_batch_size={mini} x rollout_n={n} = {mini * n} samples cannot be split evenly over the "
            f"{dp} data-parallel ranks (verl would silently round {mini * n} / {dp} down"
            f"{', to 0' if mini * n < dp else ''})",
            rule="mini_divides_dp", option="ppo_mini_batch_size", value=mini, candidates=mini_cands,
        )
    mini_per_rank = (mini_samples if mini_samples is not None else mini * n) // dp
    micro_opt = a["ppo_micro_batch_size_per_device"]
    micro = mini_per_rank if micro_opt is None else micro_opt
    b.step()
    if mini_per_rank % micro:
        raise b.fail(
            f"ppo_micro_batch_size_per_device={micro} does not divide the {mini_per_rank} samples each rank gets "
            f"per optimizer step ({mini_per_rank * dp} samples / {dp} ranks)",
            rule="micro_divides_mini", option="ppo_micro_batch_size_per_device", value=micro,
            candidates=[{"ppo_micro_batch_size_per_device": d} for d in _by_distance(micro, divisors(mini_per_rank))],
        )
    grad_accum = mini_per_rank // micro
    b.step()
    if samples_per_rank % micro:  # only where optimizer steps span rollouts: else implied by the rules above
        raise b.fail(
            f"ppo_micro_batch_size_per_device={micro} does not divide the {samples_per_rank} samples each rank gets "
            f"per rollout (its micro batches are cut from one rollout: TRL's steps_per_generation = samples per "
            f"rank / micro batch)",
            rule="micro_divides_rollout", option="ppo_micro_batch_size_per_device", value=micro,
            candidates=[{"ppo_micro_batch_size_per_device": d}
                        for d in _by_distance(micro, divisors(math.gcd(samples_per_rank, mini_per_rank)))])
    steps = Fraction(total * a["ppo_epochs"], mini_per_rank * dp)  # optimizer steps per rollout
    if total % (mini_per_rank * dp):
        notes.append(
            f"an optimizer step takes {mini_per_rank * dp} samples and a rollout makes {total}: some optimizer steps "
            f"run on from one pass over a rollout into the next (ppo_epochs={a['ppo_epochs']})"
            + (" or into the next rollout" if steps.denominator != 1 else "")
            + ", as TRL's loop runs them (a new rollout every steps_per_generation x num_iterations micro batches, "
              "whatever optimizer step it falls in); their losses are normalized by TRL's rule (the rollout's "
              "tokens x gradient_accumulation_steps / steps_per_generation).")

    # ---------------------------------------------------------------- log-prob passes
    old = _micro_batch(
        b, "log_prob", a["log_prob_micro_batch_size"], a["log_prob_micro_batch_size_per_device"],
        a["log_prob_max_token_len_per_device"], dp, samples_per_rank,
        default=(micro, "ppo_micro_batch_size_per_device"), notes=notes,
    )
    ref_size, ref_per_device = a["ref_log_prob_micro_batch_size"], a["ref_log_prob_micro_batch_size_per_device"]
    ref_tokens = a["ref_log_prob_max_token_len_per_device"]
    if ref_tokens is None and ref_size is None and ref_per_device is None:
        ref_tokens = a["log_prob_max_token_len_per_device"]  # the reference pass follows the old-policy pass
    ref = _micro_batch(
        b, "ref_log_prob", ref_size, ref_per_device, ref_tokens, dp, samples_per_rank,
        default=(old.per_device, "the old-policy pass"), notes=notes,
    )
    if n < 8 and est in GROUP_ESTIMATORS:
        notes.append(f"rollout_n={n}: group baselines are noisy below 8 samples per prompt.")
    return (cls or RolloutLayout)(
        num_processes=world,
        rollout_tp_size=tp,
        train_batch_size=train_batch_size,
        rollout_n=n,
        ppo_mini_batch_size=mini,
        ppo_micro_batch_size_per_device=micro,
        ppo_epochs=a["ppo_epochs"],
        sequence_parallel_size=sp,
        adv_estimator=est,
        num_engines=num_engines,
        engine_ranks=tuple(tuple(range(e * tp, (e + 1) * tp)) for e in range(num_engines)),
        prompts_per_engine=train_batch_size // num_engines,
        samples_per_engine=train_batch_size // num_engines * n,
        total_samples=total,
        data_parallel_size=dp,
        samples_per_rank=samples_per_rank,
        mini_batch_samples_per_rank=mini_per_rank,
        optimizer_steps_per_rollout=int(steps) if steps.denominator == 1 else float(steps),
        gradient_accumulation_steps=grad_accum,
        old_log_prob=old,
        ref_log_prob=ref,
        notes=tuple(notes),
    )


def _micro_batch(
    b: Builder,
    prefix: str,
    global_size: int | None,
    per_device: int | None,
    max_token_len: int | None,
    dp: int,
    samples_per_rank: int,
    default: tuple[int, str],
    notes: list[str],
) -> MicroBatch:
    """Resolve one pass's micro batch per device from its global / per-device / token-budget options."""
    g_name, d_name = f"{prefix}_micro_batch_size", f"{prefix}_micro_batch_size_per_device"
    b.step()
    if global_size is not None and per_device is not None:
        raise b.fail(
            f"{g_name}={global_size} and {d_name}={per_device} are both set; they say the same thing "
            f"({g_name} // data-parallel size {dp} = {global_size // dp} per device)",
            rule="micro_batch_both_set", option=g_name, value=global_size,
            candidates=[{g_name: None}, {d_name: None}],
            render=lambda fx: "keep only one: " + _render(fx, None),
        )
    b.step()
    if global_size is not None and global_size // dp == 0:
        raise b.fail(
            f"{g_name}={global_size} normalizes to {global_size} // {dp} data-parallel ranks = 0 sequences per "
            f"device (verl would loop forever on it)",
            rule="micro_batch_zero", option=g_name, value=global_size,
            candidates=[[{g_name: dp * k} for k in (1, 8)], [{d_name: 8, g_name: None}]],
            render=lambda fx: (
                f"use {g_name} >= {dp}: "
                + " or ".join(f"{c[g_name]} ({c[g_name] // dp} per device)" for c in fx if c.get(g_name))
                + (f", or set {d_name} instead" if any(c.get(d_name) for c in fx) else "")
            ),
        )
    if global_size is not None:
        size = global_size // dp
        source = f"{g_name}={global_size} // {dp} ranks"
        if global_size % dp:
            notes.append(
                f"{g_name}={global_size} is not a multiple of the data-parallel size {dp}: {global_size - size * dp} "
                f"of it is dropped ({size} per device); {size * dp} or {(size + 1) * dp} say what is done."
            )
    elif per_device is not None:
        size, source = per_device, d_name
    else:
        size, source = default[0], f"default: as {default[1]}"
    return MicroBatch(
        per_device=size,
        num_micro_batches=math.ceil(samples_per_rank / size),
        source=source,
        max_token_len=max_token_len,
    )


def _steps(value: int | float) -> str:
    """Optimizer steps per rollout in words: ``3``, or ``2.667 (8/3)`` where steps span rollouts."""
    if isinstance(value, int):
        return str(value)
    frac = Fraction(value).limit_denominator(10_000)
    return f"{value:.4g} ({frac.numerator}/{frac.denominator})"


@dataclass(frozen=True)
class RolloutLayout:
    """Validated arithmetic of one rollout step. Build it with :meth:`RolloutLayout.build`."""

    num_processes: int
    rollout_tp_size: int
    train_batch_size: int
    rollout_n: int
    ppo_mini_batch_size: int | float  # prompts; a fraction when an optimizer step holds part of a group (TRL's)
    ppo_micro_batch_size_per_device: int
    ppo_epochs: int
    sequence_parallel_size: int
    adv_estimator: str
    # derived
    num_engines: int
    engine_ranks: tuple[tuple[int, ...], ...]
    prompts_per_engine: int
    samples_per_engine: int
    total_samples: int
    data_parallel_size: int
    samples_per_rank: int
    mini_batch_samples_per_rank: int
    #: a fraction where optimizer steps span two rollouts (TRL's layouts, e.g. 18-sample steps over 24-sample rollouts)
    optimizer_steps_per_rollout: int | float
    gradient_accumulation_steps: int
    old_log_prob: MicroBatch
    ref_log_prob: MicroBatch
    notes: tuple[str, ...] = field(default=())

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        *,
        num_processes: int | None = None,
        n_gpus_per_node: int | None = None,
        nnodes: int = 1,
        rollout_tp_size: int = 1,
        train_batch_size: int,
        rollout_n: int,
        ppo_mini_batch_size: int | None = None,
        ppo_micro_batch_size_per_device: int | None = None,
        ppo_epochs: int = 1,
        ppo_mini_batch_samples: int | None = None,
        log_prob_micro_batch_size: int | None = None,
        log_prob_micro_batch_size_per_device: int | None = None,
        ref_log_prob_micro_batch_size: int | None = None,
        ref_log_prob_micro_batch_size_per_device: int | None = None,
        log_prob_max_token_len_per_device: int | None = None,
        ref_log_prob_max_token_len_per_device: int | None = None,
        sequence_parallel_size: int = 1,
        adv_estimator: str = "grpo",
    ) -> RolloutLayout:
        """Compute and validate a layout; raise :class:`LayoutError` on the first broken rule.

        Either ``num_processes`` or ``n_gpus_per_node`` (times ``nnodes``) gives the world size (``nnodes`` when
        neither is set, i.e. one process per node). ``ppo_mini_batch_size`` defaults to ``train_batch_size`` (one optimizer step per rollout);
        ``ppo_micro_batch_size_per_device`` defaults to the whole mini batch of a rank (no accumulation);
        ``ppo_mini_batch_samples`` counts the mini batch in samples instead, for TRL's layouts whose optimizer steps
        hold part of a group (e.g. 2 samples per step with n=4): advantages are computed over whole groups first;
        log-prob micro batches default to ``ppo_micro_batch_size_per_device``; the reference pass defaults to
        the old-policy pass's settings.
        """
        args = {k: v for k, v in locals().items() if k != "cls"}
        return _build(args, suggest=True, cls=cls)

    @property
    def mini_batch_samples(self) -> int:
        """Samples per optimizer step, all ranks."""
        return self.mini_batch_samples_per_rank * self.data_parallel_size

    @property
    def spans_rollouts(self) -> bool:
        """Whether some optimizer steps take micro batches of two rollouts (``optimizer_steps_per_rollout`` not a
        whole number: TRL's loop, which this trainer follows, then starts a rollout inside an optimizer step)."""
        return not float(self.optimizer_steps_per_rollout).is_integer()

    # ------------------------------------------------------------------ who does what
    def engine_of_rank(self, rank: int) -> int:
        """Index of the engine (TP group) that ``rank`` belongs to."""
        self._check_rank(rank)
        return rank // self.rollout_tp_size

    def engine_of_prompt(self, prompt: int) -> int:
        """Index of the engine that generates for prompt ``prompt`` of the step."""
        if not 0 <= prompt < self.train_batch_size:
            raise LayoutError(f"prompt={prompt} is outside 0..{self.train_batch_size - 1}.", option="prompt",
                              value=prompt, rule="prompt_range")
        return prompt // self.prompts_per_engine

    def engine_prompt_range(self, engine: int) -> range:
        """Indices, in the step's prompt list, of the prompts that ``engine`` generates for."""
        self._check_engine(engine)
        return range(engine * self.prompts_per_engine, (engine + 1) * self.prompts_per_engine)

    def engine_sample_range(self, engine: int) -> range:
        """Global sample indices produced by ``engine`` (its prompts' groups, contiguous, in prompt order)."""
        self._check_engine(engine)
        return range(engine * self.samples_per_engine, (engine + 1) * self.samples_per_engine)

    def rank_sample_range(self, rank: int) -> range:
        """Global sample indices that ``rank`` trains on (ranks of one sequence-parallel group share them)."""
        self._check_rank(rank)
        d = rank // self.sequence_parallel_size
        return range(d * self.samples_per_rank, (d + 1) * self.samples_per_rank)

    def sample_group(self, sample: int) -> int:
        """Prompt (group) index of a global sample index: samples of one prompt are contiguous."""
        if not 0 <= sample < self.total_samples:
            raise LayoutError(f"sample={sample} is outside 0..{self.total_samples - 1}.", option="sample",
                              value=sample, rule="sample_range")
        return sample // self.rollout_n

    def mini_batch_ranges(self, rank: int) -> list[range]:
        """Global sample indices of each optimizer step's share on ``rank`` (one epoch, in order); the last one is
        shorter where optimizer steps do not divide the rollout (:attr:`spans_rollouts`: the step goes on into the
        next pass or rollout)."""
        share = self.rank_sample_range(rank)
        m = self.mini_batch_samples_per_rank
        return [range(s, min(s + m, share.stop)) for s in range(share.start, share.stop, m)]

    def micro_batch_ranges(self, rank: int, ref: bool = False) -> list[range]:
        """Global sample indices of each forward of the old-policy (or, ``ref=True``, reference) log-prob pass
        on ``rank``, for fixed-size micro batches (the last one may be shorter)."""
        share = self.rank_sample_range(rank)
        size = (self.ref_log_prob if ref else self.old_log_prob).per_device
        return [range(s, min(s + size, share.stop)) for s in range(share.start, share.stop, size)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise LayoutError(f"rank={rank} is outside 0..{self.num_processes - 1}.", option="rank", value=rank,
                              rule="rank_range")

    def _check_engine(self, engine: int) -> None:
        if not 0 <= engine < self.num_engines:
            raise LayoutError(f"engine={engine} is outside 0..{self.num_engines - 1}.", option="engine",
                              value=engine, rule="engine_range")

    # ------------------------------------------------------------------ reporting
    def to_dict(self) -> dict:
        """All figures as plain JSON-able values; the keys ``plan --json`` prints."""
        d = asdict(self)
        d["engine_ranks"] = [list(r) for r in self.engine_ranks]
        d["log_prob_micro_batch_size_per_device"] = self.old_log_prob.per_device
        d["ref_log_prob_micro_batch_size_per_device"] = self.ref_log_prob.per_device
        d["notes"] = list(self.notes)
        return d

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the human-readable table, with the arithmetic spelled out."""
        w, tp, e = self.num_processes, self.rollout_tp_size, self.num_engines

        def group(r: tuple[int, ...]) -> str:
            return "(" + ",".join(map(str, r)) + ")" if len(r) <= 4 else f"({r[0]}..{r[-1]})"

        shown = self.engine_ranks if e <= 8 else self.engine_ranks[:4]
        ranks = ", ".join(group(r) for r in shown) + (f", ... ({e} groups)" if e > 8 else "")

        def mb(m: MicroBatch) -> str:
            if m.max_token_len is not None:
                return f"dynamic, <= {m.max_token_len} tokens per forward (at most {m.per_device} sequences)"
            return (f"{m.per_device} sequences per device per forward ({m.source}); "
                    f"{self.samples_per_rank} / {m.per_device} -> {m.num_micro_batches} forwards per pass")

        return [
            ("processes", f"{w}"),
            ("rollout engines", f"{w} / rollout_tp_size={tp} = {e}"),
            ("engine ranks", ranks),
            ("prompts per engine", f"{self.train_batch_size} / {e} = {self.prompts_per_engine}"),
            ("samples per engine", f"{self.prompts_per_engine} x n={self.rollout_n} = {self.samples_per_engine}"),
            ("samples per step", f"{e} x {self.samples_per_engine} = {self.total_samples}"),
            ("data-parallel size", f"{w} / sequence_parallel_size={self.sequence_parallel_size} = "
                                   f"{self.data_parallel_size}"),
            ("samples per training rank", f"{self.total_samples} / {self.data_parallel_size} = {self.samples_per_rank}"),
            ("mini batch", f"{self.ppo_mini_batch_size:g} prompts = {self.mini_batch_samples} samples = "
                           f"{self.mini_batch_samples_per_rank} per rank"),
            ("optimizer steps per rollout", f"{self.total_samples} / {self.mini_batch_samples} samples x "
                                            f"ppo_epochs={self.ppo_epochs} = {_steps(self.optimizer_steps_per_rollout)}"),
            ("gradient accumulation", f"{self.mini_batch_samples_per_rank} / micro {self.ppo_micro_batch_size_per_device}"
                                      f" = {self.gradient_accumulation_steps}"),
            ("old log-prob micro batch", mb(self.old_log_prob)),
            ("ref log-prob micro batch", mb(self.ref_log_prob)),
        ]

    def table(self) -> str:
        """The readable table ``trl-nrollout plan`` prints."""
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
