"""Which engine generates which group: fixed shares, or one job-wide queue that engines pull from.

``rollout_dispatch="shares"`` (the default): each engine generates the groups of its own ranks (a TP group's ranks
pool their prompts). The step's rollout lasts as long as its slowest engine: an engine whose groups happened to
draw long completions keeps the others waiting.

``rollout_dispatch="balanced"``: the step's groups form one queue for the whole job, cut into one segment per
engine (its own ranks' groups). Each engine keeps about ``max_num_seqs`` samples running and one group waiting and,
whenever a step of its own leaves fewer, claims the next groups of its own segment, and once that is empty the next
groups of another engine's (work stealing), from counters every rank can reach (the process group's key-value
store: one atomic ``add`` per claim, no central process). An engine with less outstanding work thus claims sooner,
and the groups an engine slowed by long samples has not started go to the others. When the queue is empty and every engine has finished, the samples return to the ranks
that own their prompts (one gather), in the order ``shares`` would give.

What a seed fixes in this mode: a group's sampling seed comes from its place in the job (its global index), not from
the engine that runs it, so each group draws the same numbers under either dispatch. Which engine runs a group, and
which other samples share its engine steps, depend on timing; batch composition can move a float's last bits, so two
balanced runs agree sample for sample where the engine's kernels are batch-invariant (the CPU runs in our tests),
and otherwise up to near-ties. With a single engine both modes are the same.

Balancing helps where an engine runs fewer samples at once than its share (``max_num_seqs`` below the share: the
usual case at scale, when KV-cache memory bounds the batch); when every sample of the share runs at once, all of
an engine's work has started at the first step and there is nothing left to move (a partial rollout then is the
tool: it stops the tail instead).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class LocalStore:
    """A counter store in one process (threads may share it): the one call of ``torch.distributed.Store`` that
    :class:`GroupQueue` uses, for tests and single-process runs."""

    def __init__(self) -> None:
        self._values: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount
            return self._values[key]


class GroupQueue:
    """The job's groups as one queue cut into segments, one per engine (its own ranks' groups, in order), each
    segment's head an atomic counter under ``key/<segment>`` in ``store`` (a ``torch.distributed.Store`` every rank
    reaches, or a :class:`LocalStore`). Engine ``home`` claims from its own segment first and, once that is empty,
    from the others in turn (work stealing): engines that keep pace generate their own groups, and only the groups a
    slower engine has not started move. Use a fresh ``key`` per call."""

    def __init__(self, store, key: str, segments: list[range], home: int) -> None:
        self.store = store
        self.key = key
        self.segments = segments
        self.home = home
        self._empty: set[int] = set()

    def claim(self, k: int) -> range:
        """The next ``k`` groups (fewer at the end of a segment; an empty range once every segment is drained)."""
        count = len(self.segments)
        for step in range(count):
            seg = (self.home + step) % count
            if seg in self._empty:
                continue
            part = self.segments[seg]
            end = int(self.store.add(f"{self.key}/{seg}", k))  # atomic: the counter after our add
            got = range(part.start + min(end - k, len(part)), part.start + min(end, len(part)))
            if end >= len(part):
                self._empty.add(seg)
            if len(got):
                return got
        return range(0)


@dataclass
class PullStats:
    """What one engine did in a balanced rollout: the groups it generated (global indices, claim order), its claims,
    the most samples it held right after a claim (``peak_outstanding``), and the seconds from the call's start until
    its last sample finished (``busy_s``)."""

    groups: list[int] = field(default_factory=list)
    claims: int = 0
    peak_outstanding: int = 0
    busy_s: float = 0.0


def run_pulled(loop, queue, add_group: Callable[[int], str], n: int, capacity: int,
               share: Callable[[Callable[[], list[int]]], list[int]] | None = None,
               outstanding: Callable[[], int] | None = None) -> tuple[dict[int, str], PullStats]:
    """Run ``loop`` (an :class:`~trl_nrollout.rollout.engines.requests.EngineLoop`) on groups pulled from ``queue`` until
    the queue is drained and every pulled group has finished.

    Before each engine step, while the engine holds fewer than ``capacity + n`` unfinished samples
    (``outstanding()``; default ``n`` per unfinished request), it claims enough groups to reach that (at least one)
    and adds each with ``add_group(g) -> request id``: ``capacity`` samples run, about one group waits in the
    engine's own queue, so a slot freed by a finished sample is refilled within the same step.
    ``share(claim)``: on a TP group, the group's leader calls ``claim()`` and every rank gets its result (the ranks
    run the same requests and step in lockstep, so they reach each claim together); None: claim here.
    Returns ``{group: request id}`` and the :class:`PullStats`."""
    if n < 1 or capacity < 1:
        raise ValueError(f"n={n} and capacity={capacity} must be >= 1.")
    count = outstanding or (lambda: n * loop.num_open)
    target = capacity + n
    start = time.perf_counter()
    requests: dict[int, str] = {}
    stats = PullStats()
    drained = False
    while True:
        held = count()
        if not drained and held < target:
            want = max(1, math.ceil((target - held) / n))

            def claim(want: int = want) -> list[int]:
                return list(queue.claim(want))

            got = claim() if share is None else share(claim)
            stats.claims += 1
            if not got:
                drained = True
            for g in got:
                requests[g] = add_group(g)
                stats.groups.append(g)
            stats.peak_outstanding = max(stats.peak_outstanding, count())
        if not loop.has_unfinished:
            if drained:
                break
            continue
        loop.step()
    stats.busy_s = time.perf_counter() - start
    return requests, stats
