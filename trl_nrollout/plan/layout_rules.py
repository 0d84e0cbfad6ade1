"""The machinery behind every :class:`LayoutError` of :mod:`trl_nrollout.plan.layout`: the error itself, the search for
fixes (each suggested value is tried by building the layout again with it), and how fixes are put in words.

Split from ``layout.py`` so that the layout's arithmetic reads on its own; nothing here knows the rules, which
live in ``layout._build``: a :class:`Builder` is handed the function that rebuilds a layout to try a fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from trl_nrollout.errors import InputError

#: How many alternative layouts a fix search may try for one error (each try is a cheap pure build).
_MAX_FIX_TRIALS = 300


class LayoutError(InputError):
    """An invalid rollout layout. The message names the option, the value, the rule and a fix.

    Attributes: ``option`` and ``value`` (what broke the rule), ``rule`` (a short id of the rule) and ``fixes``
    (a tuple of change dicts; applying any one of them to the arguments of :meth:`RolloutLayout.build` gives a
    valid layout, or at least clears this rule when another option is wrong as well).
    """

    def __init__(
        self,
        message: str,
        *,
        option: str | None = None,
        value: Any = None,
        rule: str = "",
        fixes: Iterable[dict[str, Any]] = (),
        stage: int = 0,
    ) -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.rule = rule
        self.fixes: tuple[dict[str, Any], ...] = tuple(fixes)
        self.stage = stage  # how many checks passed before this one (used to rank partial fixes)


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_multiples(value: int, base: int) -> list[int]:
    """The positive multiples of ``base`` closest to ``value`` (one below and one above, when they exist).

    >>> nearest_multiples(50, 3)
    [48, 51]
    >>> nearest_multiples(6, 3)
    [3, 9]
    """
    below = (value - 1) // base * base
    above = (value // base + 1) * base
    return [m for m in (below, above) if m > 0] or [base]


def _by_distance(value: Any, pool: Iterable[int]) -> list[int]:
    """``pool`` sorted by distance to ``value`` (ties: smaller first); plain order when ``value`` is not a number."""
    pool = sorted(set(pool))
    if isinstance(value, int) and not isinstance(value, bool):
        return sorted(pool, key=lambda c: (abs(c - value), c))
    return pool


def _multiples_near(value: Any, base: int, spread: int = 64) -> list[int]:
    """Positive multiples of ``base`` around ``value``, nearest first."""
    v = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else base
    top = v // base + spread
    return _by_distance(v, (base * k for k in range(1, top + 1)))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fmt_value(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _render(fixes: Iterable[dict[str, Any]], option: str | None) -> str:
    """Fixes as words: ``use 48 or 51`` (values of the failing option), ``use rollout_tp_size 1 or 3``,
    ``unset X``; alternatives joined by ``, or``."""
    groups: dict[str, list[str]] = {}
    for change in fixes:
        key, val = next(iter(change.items()))
        extra = [k for k, v in list(change.items())[1:] if v is None]
        text = "" if val is None else _fmt_value(val)
        if extra:
            text += f" (and unset {', '.join(extra)})"
        groups.setdefault(f"unset:{key}" if val is None else key, []).append(text)
    parts = []
    for key, texts in groups.items():
        if key.startswith("unset:"):
            parts.append(f"unset {key[6:]}{texts[0]}")
        elif key == option:
            parts.append("use " + " or ".join(texts))
        else:
            parts.append(f"use {key} " + " or ".join(texts))
    return ", or ".join(parts)


class Builder:
    """One validation pass over the arguments of :meth:`RolloutLayout.build`.

    Every check calls :meth:`step` first, so ``stage`` counts the checks passed: a fix that moves a failing build
    to a later stage clears the rule even when another option is also wrong.
    """

    def __init__(self, args: dict[str, Any], suggest: bool, rebuild: Callable[[dict[str, Any]], Any]) -> None:
        self.a = args
        self.suggest = suggest
        self.stage = 0
        self._rebuild = rebuild  # layout._build without fix suggestions: one trial of a candidate change

    def step(self) -> None:
        self.stage += 1

    def _trial(self, changes: dict[str, Any]) -> LayoutError | None:
        try:
            self._rebuild({**self.a, **changes})
        except LayoutError as err:
            return err
        return None

    def fixes(self, candidates: Iterable[dict[str, Any]], want: int = 2) -> list[dict[str, Any]]:
        """The first ``want`` candidate changes that give a valid layout (else: that clear this rule)."""
        if not self.suggest:
            return []
        valid: list[dict[str, Any]] = []
        progress: list[dict[str, Any]] = []
        for i, change in enumerate(candidates):
            if i >= _MAX_FIX_TRIALS or len(valid) >= want:
                break
            err = self._trial(change)
            if err is None:
                valid.append(change)
            elif err.stage > self.stage and len(progress) < want:
                progress.append(change)
        chosen = valid or progress

        def order(change: dict[str, Any]) -> tuple:
            v = next(iter(change.values()))
            return (v is not None, v if isinstance(v, int) else 0)

        return sorted(chosen, key=order) if len({next(iter(c)) for c in chosen}) == 1 else chosen

    def fail(
        self,
        head: str,
        *,
        rule: str,
        option: str,
        value: Any,
        candidates: Iterable[dict[str, Any]] | list[Iterable[dict[str, Any]]] = (),
        render: Callable[[list[dict[str, Any]]], str] | None = None,
    ) -> LayoutError:
        """A :class:`LayoutError` whose message is ``head; use <fixes>.`` (``render`` words the fixes).

        ``candidates`` is one iterable of change dicts, or a list of them (each searched separately, e.g. one for
        the failing option and one for an alternative option).
        """
        found: list[dict[str, Any]] = []
        if self.suggest:
            nested = isinstance(candidates, list) and bool(candidates) and not isinstance(candidates[0], dict)
            groups = candidates if nested else [candidates]
            for group in groups:
                found += self.fixes(group)
        if found:
            text = render(found) if render else _render(found, option)
            message = f"{head}; {text}."
        else:  # only when fixes are not searched (a trial build) or none clears the rule
            message = f"{head}."
        return LayoutError(message, option=option, value=value, rule=rule, fixes=found, stage=self.stage)

    # ------------------------------------------------------------------ reusable checks
    def positive(self, name: str, allow_none: bool = False) -> None:
        self.step()
        value = self.a[name]
        if (value is None and allow_none) or _is_positive_int(value):
            return
        coerced: int | None = None
        if isinstance(value, (float, str)):
            try:
                as_float = float(value)
            except ValueError:
                as_float = math.nan
            if math.isfinite(as_float) and as_float >= 1 and as_float == int(as_float):
                coerced = int(as_float)  # "8" or 8.0 -> 8
        cands: list[dict[str, Any]]
        if coerced is not None and self.suggest and self._trial({name: coerced}) is None:
            cands = [{name: coerced}]
        else:
            cands = ([{name: None}] if allow_none else []) + [{name: k} for k in range(1, 257)]
        raise self.fail(
            f"{name}={value!r} must be a positive integer" + (" or unset" if allow_none else ""),
            rule="positive_int", option=name, value=value, candidates=cands,
        )
