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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

#: Estimators whose baseline is computed from the other samples of the same prompt: they need ``rollout_n >= 2``.
GROUP_ESTIMATORS = frozenset(
    {"grpo", "dr_grpo", "rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline", "gpg"}
)


class LayoutError(ValueError):
    """An invalid rollout layout. The message names the option, the value, the rule and a fix."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_multiples(value: int, base: int) -> list[int]:
    """The positive multiples of ``base`` closest to ``value`` (one below and one above, when they exist).

    >>> nearest_multiples(50, 3)
    [48, 51]
    """
    below = (value // base) * base
    above = below + base
    return [m for m in (below, above) if m > 0 and m != value] or [base]


def _fmt_options(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name}={value!r} must be a positive integer; set it to 1 or more.")


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


@dataclass(frozen=True)
class RolloutLayout:
    """Validated arithmetic of one rollout step. Build it with :meth:`RolloutLayout.build`."""

    num_processes: int
    rollout_tp_size: int
    train_batch_size: int
    rollout_n: int
    ppo_mini_batch_size: int
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
    optimizer_steps_per_rollout: int
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

        Either ``num_processes`` or ``n_gpus_per_node`` (times ``nnodes``) gives the world size.
        ``ppo_mini_batch_size`` defaults to ``train_batch_size`` (one optimizer step per rollout);
        ``ppo_micro_batch_size_per_device`` defaults to the whole mini batch of a rank (no accumulation);
        log-prob micro batches default to ``ppo_micro_batch_size_per_device``; the reference pass defaults to
        the old-policy pass's settings.
        """
        if num_processes is None and n_gpus_per_node is None:
            num_processes = 1
        if num_processes is not None and n_gpus_per_node is not None:
            if num_processes != n_gpus_per_node * nnodes:
                raise LayoutError(
                    f"num_processes={num_processes} disagrees with n_gpus_per_node={n_gpus_per_node} x "
                    f"nnodes={nnodes} = {n_gpus_per_node * nnodes}; set only one of them."
                )
        if num_processes is None:
            _check_positive("n_gpus_per_node", n_gpus_per_node)
            _check_positive("nnodes", nnodes)
            num_processes = n_gpus_per_node * nnodes  # type: ignore[operator]
        for name, value in [
            ("num_processes", num_processes),
            ("rollout_tp_size", rollout_tp_size),
            ("train_batch_size", train_batch_size),
            ("rollout_n", rollout_n),
            ("ppo_epochs", ppo_epochs),
            ("sequence_parallel_size", sequence_parallel_size),
        ]:
            _check_positive(name, value)
        for name, value in [
            ("ppo_mini_batch_size", ppo_mini_batch_size),
            ("ppo_micro_batch_size_per_device", ppo_micro_batch_size_per_device),
            ("log_prob_micro_batch_size", log_prob_micro_batch_size),
            ("log_prob_micro_batch_size_per_device", log_prob_micro_batch_size_per_device),
            ("ref_log_prob_micro_batch_size", ref_log_prob_micro_batch_size),
            ("ref_log_prob_micro_batch_size_per_device", ref_log_prob_micro_batch_size_per_device),
            ("log_prob_max_token_len_per_device", log_prob_max_token_len_per_device),
            ("ref_log_prob_max_token_len_per_device", ref_log_prob_max_token_len_per_device),
        ]:
            _check_positive(name, value, allow_none=True)

        world, tp, n = num_processes, rollout_tp_size, rollout_n
        if world % tp:
            ok_tp = [d for d in divisors(world)]
            raise LayoutError(
                f"rollout_tp_size={tp} does not divide the {world} processes (each engine is one group of "
                f"rollout_tp_size consecutive ranks); use rollout_tp_size {_fmt_options(ok_tp)}, or "
                f"{_fmt_options(nearest_multiples(world, tp))} processes."
            )
        if world % sequence_parallel_size:
            raise LayoutError(
                f"sequence_parallel_size={sequence_parallel_size} does not divide the {world} processes; "
                f"use {_fmt_options(divisors(world))}."
            )
        num_engines = world // tp
        if adv_estimator in GROUP_ESTIMATORS and n < 2:
            raise LayoutError(
                f"rollout_n={n} but adv_estimator={adv_estimator!r} computes its baseline from the other "
                f"samples of the same prompt, which needs rollout_n >= 2; use rollout_n 2 or more (8 or more "
                f"is usual), or a non-group estimator such as 'reinforce_plus_plus' or 'remax'."
            )
        if num_engines > train_batch_size:
            raise LayoutError(
                f"train_batch_size={train_batch_size} prompts is fewer than the {num_engines} rollout engines "
                f"({world} processes / rollout_tp_size={tp}): some engines would idle; use train_batch_size "
                f"{num_engines} or a multiple of it, or a larger rollout_tp_size "
                f"({_fmt_options([d for d in divisors(world) if world // d <= train_batch_size][:3])})."
            )
        if train_batch_size % num_engines:
            raise LayoutError(
                f"train_batch_size={train_batch_size} is not divisible by the {num_engines} rollout engines "
                f"({world} processes / rollout_tp_size={tp}); use "
                f"{_fmt_options(nearest_multiples(train_batch_size, num_engines))}."
            )
        dp = world // sequence_parallel_size
        total = train_batch_size * n
        if total % dp:
            # smallest change of train_batch_size keeping divisibility by engines and samples by dp
            step = math.lcm(num_engines, dp // math.gcd(dp, n))
            raise LayoutError(
                f"train_batch_size={train_batch_size} x rollout_n={n} = {total} samples cannot be split evenly "
                f"over the data-parallel size {dp} ({world} processes / sequence_parallel_size="
                f"{sequence_parallel_size}); use train_batch_size {_fmt_options(nearest_multiples(train_batch_size, step))}."
            )
        samples_per_rank = total // dp

        mini = train_batch_size if ppo_mini_batch_size is None else ppo_mini_batch_size
        if mini > train_batch_size or train_batch_size % mini:
            ok = [d for d in divisors(train_batch_size) if (d * n) % dp == 0]
            raise LayoutError(
                f"ppo_mini_batch_size={mini} prompts must divide train_batch_size={train_batch_size} (each "
                f"optimizer step takes an equal slice of the rollout); use one of {ok}."
            )
        if (mini * n) % dp:
            ok = [d for d in divisors(train_batch_size) if (d * n) % dp == 0]
            raise LayoutError(
                f"ppo_mini_batch_size={mini} x rollout_n={n} = {mini * n} samples normalize to "
                f"{mini * n} / {dp} data-parallel ranks, which is not a whole number (verl would silently "
                f"round it, to 0 when it is below {dp}); use ppo_mini_batch_size one of {ok}."
            )
        mini_per_rank = mini * n // dp
        micro = mini_per_rank if ppo_micro_batch_size_per_device is None else ppo_micro_batch_size_per_device
        if mini_per_rank % micro:
            raise LayoutError(
                f"ppo_micro_batch_size_per_device={micro} does not divide the {mini_per_rank} samples each rank "
                f"gets per optimizer step (ppo_mini_batch_size={mini} x rollout_n={n} / {dp} ranks); use one "
                f"of {divisors(mini_per_rank)}."
            )
        grad_accum = mini_per_rank // micro

        old = _micro_batch(
            "log_prob", log_prob_micro_batch_size, log_prob_micro_batch_size_per_device,
            log_prob_max_token_len_per_device, dp, samples_per_rank, default=(micro, "ppo_micro_batch_size_per_device"),
        )
        ref_default_tokens = (
            ref_log_prob_max_token_len_per_device
            if ref_log_prob_max_token_len_per_device is not None
            else (log_prob_max_token_len_per_device
                  if ref_log_prob_micro_batch_size is None and ref_log_prob_micro_batch_size_per_device is None
                  else None)
        )
        ref = _micro_batch(
            "ref_log_prob", ref_log_prob_micro_batch_size, ref_log_prob_micro_batch_size_per_device,
            ref_default_tokens, dp, samples_per_rank, default=(old.per_device, "the old-policy pass"),
        )
        notes: list[str] = []
        if n < 8 and adv_estimator in GROUP_ESTIMATORS:
            notes.append(f"rollout_n={n}: group baselines are noisy below 8 samples per prompt.")
        return cls(
            num_processes=world,
            rollout_tp_size=tp,
            train_batch_size=train_batch_size,
            rollout_n=n,
            ppo_mini_batch_size=mini,
            ppo_micro_batch_size_per_device=micro,
            ppo_epochs=ppo_epochs,
            sequence_parallel_size=sequence_parallel_size,
            adv_estimator=adv_estimator,
            num_engines=num_engines,
            engine_ranks=tuple(tuple(range(e * tp, (e + 1) * tp)) for e in range(num_engines)),
            prompts_per_engine=train_batch_size // num_engines,
            samples_per_engine=train_batch_size // num_engines * n,
            total_samples=total,
            data_parallel_size=dp,
            samples_per_rank=samples_per_rank,
            mini_batch_samples_per_rank=mini_per_rank,
            optimizer_steps_per_rollout=(train_batch_size // mini) * ppo_epochs,
            gradient_accumulation_steps=grad_accum,
            old_log_prob=old,
            ref_log_prob=ref,
            notes=tuple(notes),
        )

    # ------------------------------------------------------------------ who does what
    def engine_of_rank(self, rank: int) -> int:
        """Index of the engine (TP group) that ``rank`` belongs to."""
        self._check_rank(rank)
        return rank // self.rollout_tp_size

    def engine_prompt_range(self, engine: int) -> range:
        """Indices, in the step's prompt list, of the prompts that ``engine`` generates for."""
        return range(engine * self.prompts_per_engine, (engine + 1) * self.prompts_per_engine)

    def engine_sample_range(self, engine: int) -> range:
        """Global sample indices produced by ``engine`` (its prompts' groups, contiguous, in prompt order)."""
        return range(engine * self.samples_per_engine, (engine + 1) * self.samples_per_engine)

    def rank_sample_range(self, rank: int) -> range:
        """Global sample indices that ``rank`` trains on (ranks of one sequence-parallel group share them)."""
        self._check_rank(rank)
        d = rank // self.sequence_parallel_size
        return range(d * self.samples_per_rank, (d + 1) * self.samples_per_rank)

    def sample_group(self, sample: int) -> int:
        """Prompt (group) index of a global sample index: samples of one prompt are contiguous."""
        return sample // self.rollout_n

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise LayoutError(f"rank={rank} is outside 0..{self.num_processes - 1}.")

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
        ranks = ", ".join("(" + ",".join(map(str, r)) + ")" for r in self.engine_ranks)
        if len(self.engine_ranks) > 8:
            ranks = ", ".join("(" + ",".join(map(str, r)) + ")" for r in self.engine_ranks[:4]) + ", ..."

        def mb(m: MicroBatch) -> str:
            if m.max_token_len is not None:
                return f"dynamic, <= {m.max_token_len} tokens per forward (at most {m.per_device} sequences)"
            return f"{m.per_device} sequences per forward ({m.source}); {m.num_micro_batches} forwards per pass"

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
            ("mini batch", f"{self.ppo_mini_batch_size} prompts = {self.ppo_mini_batch_size * self.rollout_n} "
                           f"samples = {self.mini_batch_samples_per_rank} per rank"),
            ("optimizer steps per rollout", f"{self.train_batch_size} / {self.ppo_mini_batch_size} x "
                                            f"ppo_epochs={self.ppo_epochs} = {self.optimizer_steps_per_rollout}"),
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


def _micro_batch(
    prefix: str,
    global_size: int | None,
    per_device: int | None,
    max_token_len: int | None,
    dp: int,
    samples_per_rank: int,
    default: tuple[int, str],
) -> MicroBatch:
    """Resolve one pass's micro batch per device from its global / per-device / token-budget options."""
    g_name, d_name = f"{prefix}_micro_batch_size", f"{prefix}_micro_batch_size_per_device"
    if global_size is not None and per_device is not None:
        raise LayoutError(
            f"{g_name}={global_size} and {d_name}={per_device} are both set; they say the same thing "
            f"({g_name} // data-parallel size {dp} = {global_size // dp}); keep only {d_name}."
        )
    if global_size is not None:
        size = global_size // dp
        if size == 0:
            raise LayoutError(
                f"{g_name}={global_size} normalizes to {global_size} // {dp} data-parallel ranks = 0 sequences "
                f"per device (verl would loop forever on it); use {g_name} >= {dp} (e.g. {dp * 8} for 8 per "
                f"device) or set {d_name} instead."
            )
        source = f"{g_name}={global_size} // {dp} ranks"
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
