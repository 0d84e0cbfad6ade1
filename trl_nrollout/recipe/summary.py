"""The end-of-run summary: printed and written as ``<output_dir>/run_summary.json``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def reward_start_end(rewards: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean reward over the first and the last ``fraction`` of the logged steps (at least one step each)."""
    if not rewards:
        return float("nan"), float("nan")
    k = max(1, math.ceil(len(rewards) * fraction))
    return _mean(rewards[:k]), _mean(rewards[-k:])


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


class RewardHistory(TrainerCallback):
    """Collects the mean reward of every logged training step (TRL logs it as ``reward``), the steps logged
    without one (``unscored_steps``: every reward function returned None for every sample, which TRL logs as
    None) and the step training started from (``start_step``: 0, or the checkpoint's step when resuming)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.unscored_steps: list[int] = []
        self.started = time.perf_counter()
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            value = logs["reward"]
            if value is None or (isinstance(value, float) and math.isnan(value)):
                self.unscored_steps.append(int(state.global_step))
            else:
                self.rewards.append(float(value))


def build_summary(*, steps: int, rewards: list[float], gen_tokens_per_s: float, rollout_backend: str,
                  checkpoint: str | None, wall_s: float, extra: dict | None = None) -> dict:
    """The summary dict: ``steps``, ``reward_start``, ``reward_end``, ``gen_tokens_per_s``, ``rollout_backend``,
    ``checkpoint``, ``wall_s`` and anything in ``extra``."""
    start, end = reward_start_end(rewards)
    out = {
        "steps": int(steps),
        "reward_start": None if math.isnan(start) else round(start, 4),  # None: no step was scored (JSON has no NaN)
        "reward_end": None if math.isnan(end) else round(end, 4),
        "gen_tokens_per_s": round(gen_tokens_per_s, 1),
        "rollout_backend": rollout_backend,
        "checkpoint": checkpoint,
        "wall_s": round(wall_s, 1),
    }
    out.update(extra or {})
    return out


def write_summary(summary: dict, output_dir: str | Path) -> Path:
    """Write ``run_summary.json`` into ``output_dir`` and print a short human-readable version."""
    path = Path(output_dir) / "run_summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    width = max(len(k) for k in summary)
    print("\n== run summary ==")
    for k, v in summary.items():
        print(f"{k.ljust(width)}  {v}")
    print(f"(written to {path})")
    return path
