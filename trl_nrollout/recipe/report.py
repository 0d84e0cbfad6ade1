"""What a user sees of a run: one live progress line per step, and at the end ``report.png``.

- :class:`~trl_nrollout.trainer.progress.LiveProgressCallback` (the trainer's, in :mod:`trl_nrollout.trainer.progress`)
  replaces the Trainer's progress callback: the step's key figures in the bar's postfix, updated in place.
- :func:`write_report` plots the run from its log history (matplotlib): reward (mean +- std; a distillation run's
  loss) and response length over steps, and the time of each phase of a step, stacked.
- :func:`end_progress_bars` ends the bar's line when a run stops with an error (its message then starts a line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from trl_nrollout.trainer.progress import finite_number

#: Phases of a step, in order, as logged under ``timing_s/<phase>``.
PHASES = ("weight_sync", "gen", "reward", "old_log_prob", "ref", "teacher", "adv", "update_actor")


def end_progress_bars() -> None:
    """Close the progress bars still open (a run stopped by an error): each ends its line, so what is printed next
    (the error) starts on a line of its own instead of after the bar's ``0/2 [00:02<?, ?it/s]``."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # tqdm.auto's bars (the Trainer's) are tqdm's too
        bar.close()


def _series(history: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for h in history:
        if key in h and "step" in h and finite_number(h[key]):  # an unscored step (None) leaves a gap
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
    key = "reward" if any("reward" in h for h in history) else "loss"  # a distillation run logs no reward
    steps = [h for h in history if key in h and "train_runtime" not in h]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xs, reward = _series(steps, key)
    _, std = _series(steps, "reward_std")
    ax = axes[0]
    ax.plot(xs, reward, color="tab:blue", label="reward (mean)" if key == "reward" else "loss (the divergence)")
    if key == "reward" and len(std) == len(reward):
        ax.fill_between(xs, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                        color="tab:blue", alpha=0.2, label="± std over samples")
    ax.set(title=key, xlabel="step")
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
