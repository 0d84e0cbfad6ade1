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
