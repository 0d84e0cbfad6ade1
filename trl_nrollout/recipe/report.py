"""What a user sees of a run: one live progress line per step, and at the end ``report.png``.

- :class:`LiveProgressCallback` replaces the Trainer's progress callback: instead of printing every step's ~35
  metrics as a dict under the bar, it shows the few that tell how training goes in the bar's postfix, updated in
  place (step, reward +- std, response length, generated tokens/s, seconds per step). Every metric still goes to
  ``report_to`` and ``log_history``.
- :func:`write_report` plots the run from its log history (matplotlib): reward (mean +- std) and response length
  over steps, and the time of each phase of a step, stacked.
- :func:`end_progress_bars` ends the bar's line when a run stops with an error (its message then starts a line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from transformers.trainer_callback import ProgressCallback

#: Phases of a step, in order, as logged under ``timing_s/<phase>``.
PHASES = ("weight_sync", "gen", "reward", "old_log_prob", "ref", "adv", "update_actor")


def _fmt(value: float, unit: str = "") -> str:
    if value >= 10_000:
        return f"{value / 1000:.1f}k{unit}"
    if value >= 100:
        return f"{value:.0f}{unit}"
    return f"{value:.3g}{unit}"


def _number(value) -> bool:
    """A finite number (not None, which TRL logs for a metric no sample had, nor NaN)."""
    return isinstance(value, int | float) and math.isfinite(value)


def live_line(logs: Mapping[str, float]) -> str:
    """The postfix of the progress bar for one step's logs (keys that are missing are left out)."""
    parts = []
    if "reward" in logs:
        std = logs.get("reward_std")
        if not _number(logs["reward"]):  # every reward function declined every sample (TRL logs None)
            parts.append("reward unscored")
        else:
            parts.append(f"reward {logs['reward']:.3f}" + (f"±{std:.3f}" if _number(std) else ""))
    if "response_length/mean" in logs:
        parts.append(f"len {logs['response_length/mean']:.1f}")
    if "perf/gen_tokens_per_s" in logs:
        parts.append(f"gen {_fmt(logs['perf/gen_tokens_per_s'])} tok/s")
    if "timing_s/step" in logs:
        parts.append(f"step {logs['timing_s/step']:.2f}s")
    if "loss" in logs and isinstance(logs["loss"], int | float) and not math.isfinite(logs["loss"]):
        parts.append(f"loss {logs['loss']}")
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


def end_progress_bars() -> None:
    """Close the progress bars still open (a run stopped by an error): each ends its line, so what is printed next
    (the error) starts on a line of its own instead of after the bar's ``0/2 [00:02<?, ?it/s]``."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # tqdm.auto's bars (the Trainer's) are tqdm's too
        bar.close()


def _series(history: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for h in history:
        if key in h and "step" in h and _number(h[key]):  # an unscored step (None) leaves a gap
            xs.append(int(h["step"]))
            ys.append(float(h[key]))
    return xs, ys


def write_report(history: Sequence[Mapping], path: str | Path, title: str = "") -> Path | None:
    """Plot a run's log history into ``path`` (PNG). Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h for h in history if "reward" in h]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xs, reward = _series(steps, "reward")
    _, std = _series(steps, "reward_std")
    ax = axes[0]
    ax.plot(xs, reward, color="tab:blue", label="reward (mean)")
    if len(std) == len(reward):
        ax.fill_between(xs, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                        color="tab:blue", alpha=0.2, label="± std over samples")
    ax.set(title="reward", xlabel="step")
    ax.legend(loc="best", fontsize=8)
    ax = axes[1]
    for key, label in (("response_length/mean", "mean"), ("response_length/max", "max")):
        x, y = _series(steps, key)
        if y:
            ax.plot(x, y, label=label)
    ax.set(title="response length (tokens)", xlabel="step")
    ax.legend(loc="best", fontsize=8)
    ax = axes[2]
    phases = [(p, _series(steps, f"timing_s/{p}")) for p in PHASES]
    phases = [(p, s) for p, s in phases if s[1] and len(s[1]) == len(xs)]
    if phases:
        ax.stackplot(xs, *[s[1] for _, s in phases], labels=[p for p, _ in phases], alpha=0.85)
        ax.legend(loc="upper right", fontsize=7)
    ax.set(title="time per phase (s, stacked)", xlabel="step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
