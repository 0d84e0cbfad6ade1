"""Where the trainer's parts write their figures: one sink over TRL's ``_metrics`` (``{mode: {name: [values]}}``),
handed to each part when the trainer builds it, so a part logs without reaching back into the trainer."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Metrics:
    """TRL's per-mode lists of logged values (``trainer._metrics``, shared, not copied): ``add`` appends one value;
    the trainer's ``log`` averages and clears them as TRL does."""

    store: dict[str, defaultdict[str, list[float]]] = field(
        default_factory=lambda: {"train": defaultdict(list), "eval": defaultdict(list)})

    def add(self, mode: str, name: str, value: float) -> None:
        """Append ``value`` to ``name``'s list in ``mode`` (``"train"`` or ``"eval"``)."""
        self.store[mode][name].append(float(value))
