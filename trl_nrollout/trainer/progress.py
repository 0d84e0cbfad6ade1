"""The live progress line of a run: :class:`LiveProgressCallback` replaces the Trainer's progress callback;
instead of printing every step's ~35 metrics as a dict under the bar, it shows the few that tell how training goes
in the bar's postfix, updated in place (step, reward +- std, response length, generated tokens/s, seconds per
step; a distillation run's loss, the divergence, where no reward is logged). Every metric still goes to ``report_to`` and ``log_history``. The trainer adds it; the recipe's report
(:mod:`trl_nrollout.recipe.report`) plots the same logs at the end."""

from __future__ import annotations

import math
from collections.abc import Mapping

from transformers.trainer_callback import ProgressCallback


def _fmt(value: float, unit: str = "") -> str:
    if value >= 10_000:
        return f"{value / 1000:.1f}k{unit}"
    if value >= 100:
        return f"{value:.0f}{unit}"
    return f"{value:.3g}{unit}"


def finite_number(value) -> bool:
    """A finite number (not None, which TRL logs for a metric no sample had, nor NaN)."""
    return isinstance(value, int | float) and math.isfinite(value)


def live_line(logs: Mapping[str, float]) -> str:
    """The postfix of the progress bar for one step's logs (keys that are missing are left out)."""
    parts = []
    if "reward" in logs:
        std = logs.get("reward_std")
        if not finite_number(logs["reward"]):  # every reward function declined every sample (TRL logs None)
            parts.append("reward unscored")
        else:
            parts.append(f"reward {logs['reward']:.3f}" + (f"±{std:.3f}" if finite_number(std) else ""))
    if "response_length/mean" in logs:
        parts.append(f"len {logs['response_length/mean']:.1f}")
    if "perf/gen_tokens_per_s" in logs:
        parts.append(f"gen {_fmt(logs['perf/gen_tokens_per_s'])} tok/s")
    if "timing_s/step" in logs:
        parts.append(f"step {logs['timing_s/step']:.2f}s")
    elif finite_number(logs.get("step_time")):  # TRL's own figure (the distillation trainer's)
        parts.append(f"step {logs['step_time']:.2f}s")
    if "loss" in logs and isinstance(logs["loss"], int | float) and not math.isfinite(logs["loss"]):
        parts.append(f"loss {logs['loss']}")
    elif "reward" not in logs and finite_number(logs.get("loss")):  # distillation: its loss is the divergence
        parts.insert(0, f"loss {logs['loss']:.4f}")
    return " | ".join(parts)


class LiveProgressCallback(ProgressCallback):
    """The Trainer's progress bar, with the step's key figures in its postfix instead of a printed dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "train_runtime" in logs:  # the final summary dict: the run summary says it better
            return
        line = live_line(logs)
        if line:
            self.training_bar.set_postfix_str(line, refresh=True)
