"""Partial rollouts on a balanced queue (``rollout_partial=True`` with ``rollout_dispatch="balanced"``).

Under fixed shares each engine keeps a pool of its own groups. Here the job keeps one pool, the same on every rank:
the step's new groups of every rank and every group left in flight by earlier steps (a stopped sample is
re-prefilled when it continues, on whichever engine, so it belongs to no engine). The pool's unfinished groups form
one queue (:class:`~trl_nrollout.rollout.dispatch.GroupQueue`, one segment per group's *home* engine: the engine of
the rank that drew its prompt), which every engine pulls from while it has room, as a balanced whole rollout does: an
engine that finishes early takes more. The end rule is the partial one, job-wide: a counter in the process group's
store hands each finished group a ticket (the groups finished in an earlier step hold the first tickets, in pool
order); once ``target`` tickets are out every engine stops, the rest is aborted with its tokens kept, and the first
``target`` groups by ticket train. Versions are recorded per token as under shares; staleness is bounded by the
caller (:func:`~trl_nrollout.rollout.episodes.in_flight.drop_stale` on the job's pool).

Seeds (:func:`home_seed_slots`) follow the group and its sample, never the engine that runs it: a request is seeded as
fixed shares would seed it on the group's home engine, from the home's part of the pool (its seed slots in pool
order). So where the home's part of the pool equals the pool that engine holds under shares (the first step; any
step after the pools agree), every request draws the numbers shares draws, whichever engine pulls it; which groups
finish first, and so where samples are stopped and what is left in flight, depends on timing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from trl_nrollout.rollout.episodes.in_flight import (
    InFlightGroup,
    PartialRun,
    merge_progress,
    pending_requests,
)


def home_seed_slots(groups: list[InFlightGroup], homes: list[int], max_tokens: int) -> dict[tuple[int, int], int]:
    """The seed slot of every request of the pool: ``(pool index, first sample index) -> slot``, counted per home
    engine over its groups in pool order exactly as :func:`~trl_nrollout.rollout.episodes.in_flight.run_partial` counts an
    engine's requests (a fresh group takes ``n`` slots, a continued sample one)."""
    slots: dict[tuple[int, int], int] = {}
    nxt: dict[int, int] = {}
    for i, (g, home) in enumerate(zip(groups, homes)):
        for ks, _, _ in pending_requests(g, max_tokens):
            slots[(i, ks[0])] = nxt.get(home, 0)
            nxt[home] = nxt.get(home, 0) + len(ks)
    return slots


def queue_order(groups: list[InFlightGroup], homes: list[int], engines: int) -> tuple[list[int], list[range]]:
    """The queue: the pool's unfinished groups (pool indices), home engine by home engine, each in pool order, and
    each engine's segment of it (for :class:`~trl_nrollout.rollout.dispatch.GroupQueue`)."""
    order: list[int] = []
    segments: list[range] = []
    for e in range(engines):
        start = len(order)
        order += [i for i, (g, h) in enumerate(zip(groups, homes)) if h == e and not g.finished]
        segments.append(range(start, len(order)))
    return order, segments


def run_partial_pulled(loop, groups: list[InFlightGroup], version: int, max_tokens: int, *,
                       claim: Callable[[int], list[int]], finish: Callable[[list[int]], list[int]],
                       reached: Callable[[], bool], params: Callable[[int, list[int], int], Any],
                       prompt: Callable[[list[int], list | None], Any], capacity: int,
                       outstanding: Callable[[], int], share: Callable[[Callable[[], Any]], Any] | None = None
                       ) -> tuple[list[InFlightGroup], dict[int, int], list[int], int, int, int]:
    """One engine's part of a partial rollout on the job's queue. Before each engine step, while the engine holds
    fewer than ``capacity + n`` unfinished samples (``outstanding()``), it claims pool indices (``claim(k)``) and
    adds their requests (:func:`~trl_nrollout.rollout.episodes.in_flight.pending_requests`; ``params(i, ks, budget)``: the
    SamplingParams of group ``i``'s request for samples ``ks``; ``prompt(ids, images)``: the engine's prompt). When
    a step finishes groups, ``finish(groups) -> tickets`` numbers them job-wide; it stops once ``reached()`` (the
    job's target is out) or when its queue is drained and its requests done, aborting the rest with their tokens.
    ``share(fn)``: at TP > 1 the group's leader calls ``fn`` and every rank gets its result (the ranks step in
    lockstep); None: call here. Returns this engine's pool update (every group, updated where it ran), ``{pool
    index: ticket}``, the pool indices it ran, the samples aborted, the engine steps and the new tokens."""
    ask = share or (lambda fn: fn())
    n = groups[0].n if groups else 1
    owner: dict[str, tuple[int, list[int]]] = {}
    pending: dict[int, int] = {}
    tickets: dict[int, int] = {}
    pulled: list[int] = []
    drained = False
    while not ask(reached):
        held = outstanding()
        if not drained and held < capacity + n:
            want = max(1, math.ceil((capacity + n - held) / n))
            got = ask(lambda want=want: list(claim(want)))
            drained = not got
            for i in got:
                g = groups[i]
                pulled.append(i)
                pending[i] = sum(not s.finished for s in g.samples)
                for ks, ids, budget in pending_requests(g, max_tokens):
                    owner[loop.add(prompt(ids, g.images), params(i, ks, budget))] = (i, ks)
        if not loop.has_unfinished:
            if drained:
                break
            continue
        done = []
        for rid, _ in loop.step():  # a sample finished: its group finishes with its last sample
            i = owner[rid][0]
            pending[i] -= 1
            if pending[i] == 0:
                done.append(i)
        if done:
            tickets.update(zip(done, ask(lambda done=done: list(finish(done)))))
    aborted = len(loop.abort())
    updated, new_tokens = merge_progress(loop, owner, groups, version, max_tokens)
    return updated, tickets, pulled, aborted, loop.steps, new_tokens


def partial_result(groups: list[InFlightGroup], parts: list[tuple[dict, dict]], pulled: list[int],
                   aborted: int, steps: int, new_tokens: int, finished_before: list[int]) -> PartialRun:
    """The :class:`PartialRun` of one engine from every engine's ``parts`` (``{pool index: group}`` updated,
    ``{pool index: ticket}``), the same on every rank: the job's pool updated and its finish order (groups finished
    before the call in pool order, then by ticket, then those cut at their budget when aborted, in pool order)."""
    updated = list(groups)
    tickets: dict[int, int] = {}
    for groups_of, tickets_of in parts:
        for i, g in groups_of.items():
            updated[i] = g
        tickets.update(tickets_of)
    order = list(finished_before) + sorted(tickets, key=tickets.__getitem__)
    seen = set(order)
    order += [i for i, g in enumerate(updated) if g.finished and i not in seen]
    return PartialRun(updated, order, aborted, steps, new_tokens, engine_groups=list(pulled))
