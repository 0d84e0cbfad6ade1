"""One balanced queue (``rollout_dispatch="balanced"``): the job's groups in one queue that every engine pulls from
while it has room, each group's samples sent home to the rank that owns its prompt (see
:mod:`trl_nrollout.rollout.dispatch.queue`). Drivers over any engine with a request loop and job-wide collectives
(``REQUESTS`` and ``BALANCED``; partial rollouts also ``ABORT``); with one engine (``engine.balances_job`` False)
each falls back to its share's driver (:mod:`~trl_nrollout.rollout.dispatch.shares`), which is the same thing.

Besides the drivers, the job's queue and the way home that other drivers use (the live agents' pool,
:mod:`trl_nrollout.rollout.partial.pool`; endpoint agents, :mod:`trl_nrollout.rollout.dispatch.agent_runs`): :func:`job_queue`,
:func:`drop_job_queue`, :func:`job_counter`, :func:`send_home`. Everything here is collective over every rank of
the job and uses only what :mod:`trl_nrollout.rollout.engines.protocol` names (the job-wide members: ``gather_job``,
``exchange_job``, ``job_store``, ``job_key``, ``generate_hook``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.dispatch import require
from trl_nrollout.rollout.dispatch.partial_queue import (
    home_seed_slots,
    partial_result,
    queue_order,
    run_partial_pulled,
)
from trl_nrollout.rollout.dispatch.queue import GroupQueue, LocalStore, PullStats, run_pulled
from trl_nrollout.rollout.dispatch.shares import (
    agent_inputs,
    agents_media,
    continued_prompt,
    first_prompt,
    own_seed_base,
    run_agents,
    run_partial,
    run_partial_agents,
    start_pool,
)
from trl_nrollout.rollout.engines.protocol import ABORT, BALANCED, REQUESTS
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialRun
from trl_nrollout.rollout.episodes.tools import AgentCallbacks, AgentSample, AgentStats, run_agent_requests
from trl_nrollout.rollout.seeds import engine_seed, prompt_seed
from trl_nrollout.rollout.seeds import turn_seed as own_turn_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions, whole_groups


def _leader(engine) -> bool:
    """Whether this rank is its engine's first (the one that claims and holds the results)."""
    return engine.rank == engine.tp_ranks[0]


def _share(engine) -> Callable[[Callable[[], object]], object] | None:
    """On a TP group: the leader calls ``fn()`` and every rank gets its result (the ranks run the same requests);
    None at TP 1."""
    if len(engine.tp_ranks) == 1:
        return None
    leader = _leader(engine)
    return lambda fn: engine.gather_tp(fn() if leader else None)[0]


def generate_balanced(engine, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                      images: list[list] | None = None,
                      order: Callable[[list[list[int]]], list[int]] | None = None) -> tuple[RolloutBatch, PullStats]:
    """``generate_expanded`` with ``rollout_dispatch="balanced"``: the job's groups form one queue; each engine pulls
    groups while it holds fewer than ``max_num_seqs + n`` unfinished samples (vLLM counts each of a request's ``n``
    samples until it ends); afterwards every rank gets the samples of its own prompts, in order. Group ``g`` of the
    job is seeded as under ``"shares"`` (from ``g``), whichever engine runs it. Collective over every rank. Returns
    the batch and this engine's :class:`PullStats` (its groups, in the order it claimed them, and busy seconds).

    ``order(prompts)``: the queue's order, the job's group indices (``prompts``: each group's prompt, job order);
    the engines then pull from the head of that one queue (with one engine too), where by default each engine pulls
    its own ranks' groups first and then the others' (work stealing)."""
    if not engine.balances_job and order is None:  # one engine (or one process): its share is the whole queue
        start = time.perf_counter()
        batch = engine.generate_expanded(sample_prompts, n, sampling, images=images)
        busy = time.perf_counter() - start
        return batch, PullStats(groups=sorted(set(batch.group_index)), claims=1, busy_s=busy)
    job_wide = engine.balances_job  # else one engine: its TP group is the job
    require(engine, REQUESTS, *((BALANCED,) if job_wide else ()), what="generate_balanced (rollout_dispatch='balanced')")
    engine.barrier_before_generate()
    per_rank = (engine.gather_job if job_wide else engine.gather_tp)(([list(p) for p in sample_prompts], images))
    flat = [p for prompts, _ in per_rank for p in prompts]
    unique = whole_groups(flat, n, engine.engine_index)
    flat_images = None
    if any(imgs is not None for _, imgs in per_rank):
        flat_images = [img for prompts, imgs in per_rank
                       for img in (imgs if imgs is not None else [[] for _ in prompts])][::n]
    counts = [len(prompts) for prompts, _ in per_rank]
    # the job's samples in rank order (TRL's: rank r's start at r * its count)
    offset = sum(counts[:engine.rank if job_wide else engine.tp_ranks.index(engine.rank)])
    engine.ready()
    engine.check_prompt_length(max((len(p) for p in unique), default=0), sampling.max_tokens)
    per_request = sampling.seed is not None and engine.seed_mode == "sample"
    shared = None if per_request else engine.sampling_params(n, replace(sampling, seed=None))
    loop = engine.request_loop()

    def add_group(g: int) -> str:
        params = shared or engine.sampling_params(n, replace(sampling, seed=prompt_seed(sampling.seed, g, n)))
        return loop.add(engine.request_prompt(unique[g], None if flat_images is None else flat_images[g]), params)

    leader = _leader(engine)
    with engine.engine_rng(sampling.seed):
        if order is None:
            queue = job_queue(engine, counts, n)
        else:  # one queue in the rule's order, every engine pulling from its head
            queue = GroupQueue(engine.job_store if job_wide else LocalStore(),
                               engine.job_key() if job_wide else "local", [range(len(unique))], 0)
        pulled = queue if order is None else _Ordered(queue, list(order([list(p) for p in unique])))
        requests, stats = run_pulled(loop, pulled, add_group, n, engine.max_num_seqs, share=_share(engine),
                                     outstanding=loop.engine_unfinished)
    held = {g: (loop.prompt_ids(rid) if flat_images is not None else list(unique[g]),
                [(x.token_ids, x.logprobs, x.finish_reason) for x in loop.request(rid)])
            for g, rid in requests.items()} if leader else {}
    done = send_home(engine, held, counts, n) if job_wide else engine.gather_tp(held)[0]  # (the leader's)
    if job_wide:
        drop_job_queue(engine, queue)  # every rank is past its last claim
    missing = sorted({s // n for s in range(offset, offset + len(sample_prompts))} - done.keys())
    if missing:
        raise RuntimeError(f"groups {missing[:5]} of the job's queue were generated by no engine (the queue's "
                           f"counter in the process group's store was changed by another caller).")
    prompt_ids, completion_ids, logprobs, reasons, groups = [], [], [], [], []
    for s in range(offset, offset + len(sample_prompts)):
        g, k = divmod(s, n)
        prompt, samples = done[g]
        tokens, lps, reason = samples[k]
        prompt_ids.append(list(prompt))
        completion_ids.append(list(tokens))
        logprobs.append(list(lps))
        reasons.append(reason)
        groups.append(g)
    return RolloutBatch(prompt_ids, completion_ids, logprobs, reasons, groups,
                        timings={"generate_s": stats.busy_s}), stats


class _Ordered:
    """A :class:`GroupQueue` of positions handed out as the groups ``order`` puts there."""

    def __init__(self, queue: GroupQueue, order: list[int]) -> None:
        if sorted(order) != list(range(len(queue.segments[0]))):
            raise ValueError(f"a dispatch rule's order must list each of the job's {len(queue.segments[0])} groups "
                             f"once; got {order[:10]}...")
        self.queue, self.order = queue, order

    def claim(self, k: int) -> list[int]:
        return [self.order[p] for p in self.queue.claim(k)]


def run_agents_balanced(engine, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                        turn_seed: Callable[[int], int | None], agent: AgentCallbacks, workers: int, images=None
                        ) -> tuple[list[AgentSample], list[int], AgentStats, PullStats]:
    """:func:`~trl_nrollout.rollout.dispatch.shares.run_agents` with ``rollout_dispatch="balanced"``: the job's
    groups form one queue that every engine pulls from while it has room (as :func:`generate_balanced`), each pulled
    group's episodes run request by request on the engine that pulled it (its tools on that engine's first rank:
    ``tools=`` are the same functions on every rank), and the finished episodes go home to the ranks that own their
    prompts. Seeds depend on the job's group and sample, not on the engine: with a seed and ``seed_mode="sample"``
    group ``g``'s first turn as under ``"shares"``, the turn after tool round ``r`` of the job's sample ``s`` from
    ``turn_seed(r)`` and ``s``. Collective over every rank. Returns this rank's samples in order, their groups, the
    engine's :class:`AgentStats` and its :class:`PullStats` (the groups it ran, its busy seconds).

    ``images``: the prompts' encoding (as :func:`~trl_nrollout.rollout.dispatch.shares.run_agents` takes it), None
    for text. Each sample's prompt ids, engine ids and images travel with the job's queue (gathered with the
    prompts: :func:`~trl_nrollout.rollout.dispatch.shares.agent_inputs`), so a pulled group's requests carry its
    prompt's images and a tool's images re-enter with its sample (``agent.media``, read at the sample's place in
    the job), as under fixed shares; the finished episodes go home with their tools' images."""
    if not engine.balances_job:  # one engine: its share is the whole queue
        start = time.perf_counter()
        samples, groups, stats = run_agents(engine, sample_prompts, n, sampling, turn_seed, agent, workers,
                                            images=images)
        return samples, groups, stats, PullStats(groups=sorted(set(groups)), claims=1,
                                                 busy_s=time.perf_counter() - start)
    require(engine, REQUESTS, BALANCED, what="run_agents_balanced (rollout_dispatch='balanced')")
    engine.barrier_before_generate()
    per_rank = engine.gather_job(agent_inputs(sample_prompts, images))
    every = [x for chunk in per_rank for x in chunk]
    flat = [p for p, _, _ in every]
    unique = whole_groups(flat, n, engine.engine_index)
    group_inputs = every[::n]  # (a group's samples share their prompt)
    agent = agents_media(agent, every)  # a pulled sample's images at its place in the job
    counts = [len(prompts) for prompts in per_rank]
    offset = sum(counts[:engine.rank])
    engine.ready()
    engine.check_prompt_length(max((len(p) for p in unique), default=0), sampling.max_tokens)
    per_request = sampling.seed is not None and engine.seed_mode == "sample"
    own_base = own_seed_base(engine, sampling, per_request)  # every request still gets a seed (see run_agents)

    def first_request(g: int):
        seed = prompt_seed(sampling.seed, g, n) if per_request else None
        if own_base is not None:
            seed = prompt_seed(own_turn_seed(own_base, 0), g, n)
        return (list(unique[g]), first_prompt(engine, group_inputs[g]),
                engine.sampling_params(n, replace(sampling, seed=seed)))

    def continue_request(s: int, round_: int, context: list[int], budget: int, view=None):
        base = turn_seed(round_) if per_request else None
        seed = None if base is None else prompt_seed(base, s, 1)
        if own_base is not None:
            seed = prompt_seed(own_turn_seed(own_base, round_), s, 1)
        return (continued_prompt(engine, context, view),
                engine.sampling_params(1, replace(sampling, max_tokens=budget, seed=seed)))

    leader = _leader(engine)
    capacity = engine.max_num_seqs
    loop = engine.request_loop(stream=True)
    pulled_groups: list[int] = []
    start = time.perf_counter()
    with engine.engine_rng(sampling.seed):
        queue = job_queue(engine, counts, n)

        def pull():
            held = loop.engine_unfinished()
            if held >= capacity + n:
                return [], False
            want = max(1, math.ceil((capacity + n - held) / n))
            got = engine.gather_tp(list(queue.claim(want)) if leader else None)[0]
            pulled_groups.extend(got)
            return [(g, *first_request(g)) for g in got], not got

        samples, stats = run_agent_requests(
            loop, [], n, {}, agent, continue_request=continue_request, exchange=engine.gather_tp,
            workers=workers, poll_s=0.01 if len(engine.tp_ranks) > 1 else None, pull=pull, run_pulled=leader)
    busy = time.perf_counter() - start
    done = send_home(engine, {g: [samples[g * n + k] for k in range(n)] for g in pulled_groups} if leader else {},
                     counts, n)
    drop_job_queue(engine, queue)  # every rank is past its last claim
    mine = range(offset, offset + len(sample_prompts))
    missing = sorted({s // n for s in mine} - done.keys())
    if missing:
        raise RuntimeError(f"groups {missing[:5]} of the job's queue were run by no engine.")
    return ([done[s // n][s % n] for s in mine], [s // n for s in mine], stats,
            PullStats(groups=sorted(pulled_groups), claims=1, busy_s=busy))


def run_partial_balanced(engine, groups: list[InFlightGroup], target: int, sampling: SamplingOptions,
                         version: int, homes: list[int]) -> PartialRun:
    """:func:`~trl_nrollout.rollout.dispatch.shares.run_partial` on the job's pool with ``rollout_dispatch=
    "balanced"`` (:mod:`trl_nrollout.rollout.dispatch.partial_queue`): ``groups`` is the job's pool (the same on every rank:
    groups in flight from earlier steps and every rank's new ones), ``homes[i]`` the engine of the rank that drew
    group ``i``'s prompt. Its unfinished groups form one queue every engine pulls from while it has room; once
    ``target`` groups of the job have finished, every engine stops and aborts the rest, their tokens kept. Seeds
    (``seed_mode="sample"``): each request as ``run_partial`` seeds it on the group's home engine
    (:func:`~trl_nrollout.rollout.dispatch.partial_queue.home_seed_slots`), whichever engine runs it. Collective over every
    rank. Returns the job's pool updated and its finish order (the same on every rank), with this engine's counts
    and the pool indices it ran (``engine_groups``)."""
    if not engine.balances_job:  # one engine (or one process): its pool is the job's
        run = run_partial(engine, groups, target, sampling, version)
        run.engine_groups = [i for i, g in enumerate(groups) if not g.finished]
        return run
    require(engine, REQUESTS, ABORT, BALANCED, what="run_partial_balanced (rollout_partial with 'balanced')")
    start_pool(engine, groups, sampling)
    per_request = sampling.seed is not None and engine.seed_mode == "sample"
    slots = home_seed_slots(groups, homes, sampling.max_tokens)
    bases = {e: engine_seed(sampling.seed, e) for e in set(homes)} if per_request else {}

    def params(i: int, ks: list[int], budget: int):
        seed = bases[homes[i]] + slots[(i, ks[0])] if per_request else None
        return engine.sampling_params(len(ks), replace(sampling, max_tokens=budget, seed=seed))

    order, segments = queue_order(groups, homes, engine.layout.num_engines)
    finished_before = [i for i, g in enumerate(groups) if g.finished]
    key, store, leader = engine.job_key(), engine.job_store, _leader(engine)
    queue = GroupQueue(store, key, segments, engine.engine_index)

    def finish(done: list[int]) -> list[int]:  # job-wide tickets, in the order the store saw the groups
        end = len(finished_before) + int(store.add(f"{key}/finished", len(done)))
        return list(range(end - len(done), end))

    def reached() -> bool:
        return len(finished_before) + int(store.add(f"{key}/finished", 0)) >= target

    loop = engine.request_loop(stream=True)
    with engine.engine_rng(sampling.seed):
        updated, tickets, pulled, aborted, steps, new_tokens = run_partial_pulled(
            loop, groups, version, sampling.max_tokens,
            claim=lambda k: [order[p] for p in queue.claim(k)], finish=finish, reached=reached, params=params,
            prompt=engine.request_prompt, capacity=engine.max_num_seqs, outstanding=loop.engine_unfinished,
            share=_share(engine))
    parts = engine.gather_job(({i: updated[i] for i in pulled}, tickets) if leader else ({}, {}))
    _drop_keys(engine, key, [*map(str, range(engine.layout.num_engines)), "finished"])
    return partial_result(groups, parts, pulled, aborted, steps, new_tokens, finished_before)


def run_partial_agents_balanced(engine, groups: list[InFlightGroup], target: int, sampling: SamplingOptions,
                                version: int, homes: list[int], agent: AgentCallbacks, workers: int,
                                quota: tuple[list[int], dict[int, int]] | None = None
                                ) -> tuple[PartialRun, AgentStats]:
    """:func:`run_partial_balanced` for tool-calling episodes: the job's pool (the same on every rank) of
    :class:`~trl_nrollout.rollout.episodes.partial_tools.AgentPartialSample` groups is one queue; each engine pulls groups
    while it has room and runs their episodes turn after turn as requests
    (:func:`~trl_nrollout.rollout.episodes.partial_tools.run_partial_agents`), their tools on its first rank (``tools=`` are
    the same functions on every rank); once ``target`` groups of the job have finished every engine stops, aborts its
    running turns (tokens kept) and waits for its running tools. Every engine's groups then reach every rank (one
    gather over the job), so each rank holds the job's pool updated, episodes, tool masks, log-probs and versions
    included, and trains its share of the first ``target``.

    Seeds (``seed_mode="sample"``): a request the call starts (a fresh group, a turn an earlier abort stopped) as
    :func:`run_partial_balanced` seeds it (its home engine's slots); a turn after tool results from the group's home,
    the turn and the sample's place in the pool: never from the engine that runs it. Collective over every rank.
    ``quota``: ``(drawn_by, {rank: count})``, the rank that drew each pool group and how many of its own groups each
    rank trains (environments: a group trains where its environments live); the engines then stop once every rank
    has its count finished, in place of ``target``. Returns the job's :class:`PartialRun` (``engine_groups``: the
    pool indices this engine ran) and this engine's :class:`AgentStats`."""
    from trl_nrollout.rollout.episodes.partial_tools import run_partial_agents as run_partial_agents_loop

    leader = _leader(engine)
    if not engine.balances_job:  # one engine: its pool is the job's
        run, stats = run_partial_agents(engine, groups, target, sampling, version, agent, workers,
                                        owns=lambda g: leader)
        run.engine_groups = [i for i, g in enumerate(groups) if not g.finished]
        return run, stats
    require(engine, REQUESTS, ABORT, BALANCED, what="run_partial_agents_balanced (rollout_partial with 'balanced')")
    start_pool(engine, groups, sampling)
    seeded = sampling.seed is not None and engine.seed_mode == "sample"
    slots = home_seed_slots(groups, homes, sampling.max_tokens)
    bases = {e: engine_seed(sampling.seed, e) for e in set(homes)} if seeded else {}
    own = own_seed_base(engine, sampling, seeded)  # every request still gets one (see run_partial_agents)
    width = max((g.n for g in groups), default=1)

    def make_params(n: int, budget: int, slot: int, request):
        seed = None if own is None else own + slot
        if seeded:
            base, first = bases[homes[request.group]], request.samples[0]
            seed = (base + slots[(request.group, first)] if request.started
                    else prompt_seed(own_turn_seed(base, request.turn), request.group * width + first, 1))
        return engine.sampling_params(n, replace(sampling, max_tokens=budget, seed=seed))

    order, segments = queue_order(groups, homes, engine.layout.num_engines)
    finished_before = [i for i, g in enumerate(groups) if g.finished]
    key, store = engine.job_key(), engine.job_store
    queue = GroupQueue(store, key, segments, engine.engine_index)
    ask = _share(engine) or (lambda fn: fn())
    capacity = engine.max_num_seqs
    loop = engine.request_loop(stream=True)
    pulled: list[int] = []
    tickets: dict[int, int] = {}

    def pull() -> tuple[list[int], bool]:
        held = loop.engine_unfinished()
        if held >= capacity + width:
            return [], False
        want = max(1, math.ceil((capacity + width - held) / width))
        got = ask(lambda: [order[p] for p in queue.claim(want)])
        pulled.extend(got)
        return got, not got

    def finished(done: list[int]) -> None:  # job-wide tickets, in the order the store saw the groups
        def take() -> list[int]:
            end = len(finished_before) + int(store.add(f"{key}/finished", len(done)))
            return list(range(end - len(done), end))

        tickets.update(zip(done, ask(take)))
        if quota is not None and leader:  # each rank's own groups finished, job-wide
            for g in done:
                store.add(f"{key}/home/{quota[0][g]}", 1)

    def reached() -> bool:
        if quota is not None:
            before = {r: sum(quota[0][i] == r for i in finished_before) for r in quota[1]}
            return ask(lambda: all(before[r] + int(store.add(f"{key}/home/{r}", 0)) >= q
                                   for r, q in quota[1].items()))
        return ask(lambda: len(finished_before) + int(store.add(f"{key}/finished", 0)) >= target)

    with engine.engine_rng(sampling.seed):
        run, stats = run_partial_agents_loop(
            loop, groups, target, version, agent, make_params=make_params, prompt=engine.request_prompt,
            owns=lambda g: leader, exchange=engine.gather_tp, workers=workers, poll_s=0.01, pull=pull,
            finished=finished, reached=reached)
    parts = engine.gather_job(({i: run.groups[i] for i in pulled}, tickets) if leader else ({}, {}))
    _drop_keys(engine, key, [*map(str, range(engine.layout.num_engines)), "finished",
                             *(f"home/{r}" for r in (quota[1] if quota is not None else ()))])
    return partial_result(groups, parts, pulled, run.aborted, run.engine_steps, run.new_tokens,
                          finished_before), stats


@contextlib.contextmanager
def balanced_calls(engine) -> Iterator[list]:
    """Within: every ``engine.generate_expanded`` call (a ``rollout_func``'s) is a balanced rollout
    (:func:`generate_balanced`), the job's groups of that call (every rank calls it, as a collective) in one queue
    the engines pull from. Yields the list that collects each call's ``(PullStats, samples of this rank, n)``."""
    require(engine, REQUESTS, BALANCED, what="balanced_calls (a rollout_func with rollout_dispatch='balanced')")
    calls: list = []

    def hook(sample_prompts: list[list[int]], n: int, sampling: SamplingOptions, sample_offset: int | None = None,
             images: list[list] | None = None) -> RolloutBatch:
        batch, stats = generate_balanced(engine, sample_prompts, n, sampling, images=images)
        calls.append((stats, len(sample_prompts), n))
        return batch

    engine.generate_hook = hook
    try:
        yield calls
    finally:
        engine.generate_hook = None


# ------------------------------------------------------------------ the job's queue and way home, for other drivers
def segments(layout: RolloutLayout, counts: list[int], n: int) -> list[range]:
    """Each engine's own groups (those whose first sample belongs to one of its ranks), in job order; ``counts``:
    each rank's samples."""
    bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]
    total = bounds[-1] // n
    firsts = [bounds[ranks[0]] for ranks in layout.engine_ranks] + [bounds[-1]]
    return [range(min(-(-firsts[e] // n), total), min(-(-firsts[e + 1] // n), total))
            for e in range(layout.num_engines)]


def job_queue(engine, counts: list[int], n: int) -> GroupQueue:
    """A fresh queue of the job's groups (``counts``: each rank's samples), this engine's segment first; every rank
    calls it (a collective's order), rank 0 drops its counters in :func:`drop_job_queue`."""
    return GroupQueue(engine.job_store, engine.job_key(), segments(engine.layout, counts, n), engine.engine_index)


def _drop_keys(engine, key: str, names: list[str]) -> None:
    """Rank 0 deletes ``key/<name>`` from the job's store (once every rank is past its last use)."""
    if engine.rank == 0:
        for name in names:
            engine.job_store.delete_key(f"{key}/{name}")


def drop_job_queue(engine, queue: GroupQueue) -> None:
    """Delete ``queue``'s counters from the store (rank 0, once every rank is past its last claim)."""
    _drop_keys(engine, queue.key, [str(seg) for seg in range(len(queue.segments))])


def job_counter(engine, name: str) -> Callable[[int], int]:
    """A job-wide counter ``name`` in the job's store (every rank reaches it): ``add(k)`` adds ``k`` atomically and
    returns the total (``add(0)`` reads it). Only while ``engine.balances_job``."""
    key, store = engine.job_key(name), engine.job_store
    return lambda k: int(store.add(key, k))


def send_home(engine, held: dict[int, object], counts: list[int], n: int) -> dict[int, object]:
    """Each engine's results ``held`` (by global group, on its leader) to the ranks that own the group's samples
    (rank ``r`` owns the ``counts[r]`` samples after those of the ranks before it): one exchange of every rank with
    every rank (``engine.exchange_job``), each rank receiving only its own groups, nothing padded. Returns this
    rank's groups."""
    bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]

    def owners(g: int) -> list[int]:
        return [r for r in range(len(counts)) if bounds[r] < (g + 1) * n and g * n < bounds[r + 1]]

    parts: list[dict] = [{} for _ in counts]
    for g, value in held.items():  # only an engine's leader holds results
        for r in owners(g):
            parts[r][g] = value
    received: dict[int, object] = {}
    for part in engine.exchange_job([part or None for part in parts]):
        received.update(part or {})
    return received
