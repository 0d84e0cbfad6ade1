"""What the trainer measures of a run as it goes, on each process: where an optimizer step's time goes
(:class:`StepClock`), the engines' generated tokens per second (:class:`GenerationClock`) and the rollouts whose
every completion was truncated (:class:`TruncatedSteps`). The recipe's end-of-run summary
(:mod:`trl_nrollout.recipe.summary`) reads them; they live here, below the recipe, because the trainer keeps them."""

from __future__ import annotations

import time


class StepClock:
    """Where one optimizer step's wall time goes, on this process: the rollout (``_prepare_inputs``), the update
    (``training_step`` less the rollout it ran) and the tokens of this rank's last rollout (the step's throughput).
    TRL's loop calls ``training_step`` once per micro step and runs a rollout in some of them; :meth:`step_done`
    closes the optimizer step."""

    def __init__(self) -> None:
        self.rollout_s = 0.0
        self.update_s = 0.0
        #: prompt + completion tokens of this rank's samples in the last rollout (kept until the next one)
        self.rollout_tokens = 0
        self.last_end = time.perf_counter()

    def step_done(self, other_s: float, steps_per_rollout: int) -> dict[str, float]:
        """The step's timing metrics (``other_s``: update seconds spent on other models, e.g. PPO's critic); the
        clock starts the next step."""
        now = time.perf_counter()
        step_s = now - self.last_end
        metrics = {"timing_s/update_actor": self.update_s - self.rollout_s - other_s, "timing_s/step": step_s,
                   "perf/throughput": self.rollout_tokens / max(1, steps_per_rollout) / max(step_s, 1e-9)}
        self.update_s, self.rollout_s, self.last_end = 0.0, 0.0, now
        return metrics


class GenerationClock:
    """Accumulates generated tokens and the wall time spent generating them (per process).

    The first call is the engine's warm-up (first scheduling, kernel selection, allocations):
    :attr:`tokens_per_s` leaves it out (when there is more than one call), :attr:`tokens_per_s_with_warmup`
    counts everything."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.calls = 0
        self.first_tokens = 0
        self.first_seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if self.calls == 0:
            self.first_tokens, self.first_seconds = int(tokens), float(seconds)
        self.calls += 1
        self.tokens += int(tokens)
        self.seconds += float(seconds)

    @property
    def tokens_per_s_with_warmup(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Steady throughput: every call but the first (all calls when there is only one)."""
        seconds = self.seconds - self.first_seconds
        if self.calls < 2 or seconds <= 0:
            return self.tokens_per_s_with_warmup
        return (self.tokens - self.first_tokens) / seconds


class TruncatedSteps:
    """The training rollouts whose every completion hit ``max_completion_length`` (TRL says so only in the
    ``completions/clipped_ratio`` metric): such a step learns from rewards of unfinished answers (or, with
    ``mask_truncated_completions``, from nothing). :meth:`observe` returns the warning to give the first time (once
    per run), :meth:`summary` the figures of ``run_summary.json``."""

    def __init__(self) -> None:
        self.all_truncated = 0  # rollouts whose every completion was cut
        self.max_fraction = 0.0  # the largest fraction of a rollout's completions cut
        self.warned = False

    def observe(self, step: int, truncated: int, total: int, max_completion_length: int,
                masked: bool = False) -> str | None:
        """Count one rollout of ``total`` completions, ``truncated`` of them cut at ``max_completion_length``,
        trained at optimizer step ``step``; the warning text when it is the run's first rollout cut everywhere,
        else None."""
        if total <= 0:
            return None
        fraction = truncated / total
        self.max_fraction = max(self.max_fraction, fraction)
        if truncated < total:
            return None
        self.all_truncated += 1
        if self.warned:
            return None
        self.warned = True
        loss = ("mask_truncated_completions=True leaves none of them in the loss: the step trains on nothing" if masked
                else "their rewards judge answers cut off before they end")
        return (f"step {step}: all {total} completions of the rollout ({fraction:.0%}) hit "
                f"max_completion_length={max_completion_length} and were truncated; {loss}. Raise "
                f"max_completion_length, or ask for shorter answers. Said once; run_summary.json counts such "
                f"steps (all_truncated_steps) and the largest truncated fraction (max_truncated_fraction).")

    def summary(self) -> dict:
        """``all_truncated_steps`` (rollouts cut everywhere) and ``max_truncated_fraction`` (of any rollout)."""
        return {"all_truncated_steps": self.all_truncated, "max_truncated_fraction": round(self.max_fraction, 4)}
