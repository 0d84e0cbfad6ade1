"""The rollout ranks' side of engines on rollout ranks (``rollout_ranks``): :func:`serve`, the loop that acts on the
trainers' messages (:mod:`trl_nrollout.rollout.ranks.client` describes them and holds the trainers' side,
:class:`~trl_nrollout.rollout.ranks.client.RemoteEngines`), each kind of message by its handler (:data:`MESSAGES`), each
kind of job by its own (:data:`~trl_nrollout.rollout.ranks.jobs.JOB_KINDS`).

A failure the trainers cannot be told of (they wait on a key this rank would have written, or in a transfer) stops
this process at once (:meth:`~trl_nrollout.rollout.bridge.Bridge.die`), so that they never wait for it forever: a
weight version that does not load, an answer that cannot be written. A start or a job that fails answers the error
to the trainers, who raise it naming this rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trl_nrollout.rollout.ranks.episodes  # noqa: F401 - EpisodeJob's handler

# the modules that define the kinds of job register them in JOB_KINDS when imported
import trl_nrollout.rollout.ranks.partial  # noqa: F401 - PartialEntry's handler
from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.bridge import Bridge, RolloutRankError
from trl_nrollout.rollout.ranks.buckets import job_slice, read_job_images
from trl_nrollout.rollout.ranks.jobs import RankJob, run_job
from trl_nrollout.rollout.ranks.partial import close_agent_pool
from trl_nrollout.rollout.ranks.reader import MessageReader, staged_versions
from trl_nrollout.rollout.ranks.state import RankState
from trl_nrollout.rollout.types import JobResult


def _expanded(prompt_ids: list[list[int]], start: int, n: int, pics: list | None) -> dict[int, list[int]] | None:
    """A job with images: the engine's prompt (placeholders expanded) of each group of samples ``start, ...``."""
    return None if pics is None else {(start + i) // n: list(p) for i, p in enumerate(prompt_ids)}


def _close_endpoint(state: RankState) -> None:
    """Close the rollout rank's ``agent=`` endpoint, if it started one (a later job starts it again)."""
    endpoint, state.endpoint = state.endpoint, None
    if endpoint is not None:
        endpoint.close()
    close_agent_pool(state)  # (partial agent= episodes' own endpoint and live agents)


@dataclass
class Served:
    """One call of :func:`serve`: the bridge, this rank's index among the rollout ranks (``r``), the engine's builder,
    the rank's :class:`RankState`, the message reader and the counts and seconds of what this rank did."""

    bridge: Bridge
    r: int
    build_engine: Callable[[dict], object]
    state: RankState
    reader: MessageReader
    stats: dict = field(default_factory=lambda: {"jobs": 0, "samples": 0, "gen_s": 0.0, "weights_s": 0.0,
                                                 "receive_s": 0.0, "weights_bytes": 0, "idle_s": 0.0})


def serve(bridge: Bridge, build_engine, state: RankState) -> dict:
    """The rollout rank's loop: act on the trainers' messages in order (:class:`MessageReader` reads them), each by
    its kind's handler (:data:`MESSAGES`), until ``end`` (returns) or ``stop`` (closes the engine).
    ``build_engine(settings)`` builds this rank's engine from the start message; ``state`` (:class:`RankState`)
    keeps the next message's index and the engine between calls (``train()`` then ``evaluate()``). Returns counts
    and seconds of what this rank did."""
    bridge.watch([0])  # trainer rank 0 watches everyone else; a rollout rank watches it only
    loop = Served(bridge, bridge.roles.role_rank(bridge.rank), build_engine, state,
                  MessageReader(bridge, state.msg, state.slots, lambda: state.engine))
    while True:
        t0 = time.perf_counter()
        bridge.status = "idle"
        state.msg, message = loop.reader.next()
        loop.stats["idle_s"] += time.perf_counter() - t0
        handler = MESSAGES.get(message["kind"])
        if handler is None:  # pragma: no cover - a message this version does not know
            raise RolloutRankError(f"unknown message {message['kind']!r} from the trainers (a version mismatch?)")
        if handler(loop, message):
            return loop.stats


def _start(loop: Served, message: dict) -> bool:
    """``start``: build the engine from the settings; answer its parameter names (or the error that stopped it)."""
    bridge, state, r = loop.bridge, loop.state, loop.r
    state.slots = staged_versions(message)
    bridge.status = "starting its engine"
    try:
        engine = state.engine = loop.build_engine(message)
        state.dispatch = dispatch_rule(message.get("dispatch", "shares")).name  # a registered rule (else refused)
        state.agent = message.get("agent")  # tools on the rollout ranks (remote_tool_episodes)
        state.bridge = bridge  # environments' tool calls go home through its store
        answer = {"names": sorted(engine.parameter_names()), "dtype": str(engine.dtype)}
    except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
        _answer(bridge, f"ready/{r}", {"kind": "error", "message": f"{type(err).__name__}: {err}"}, "its start")
        raise
    _answer(bridge, f"ready/{r}", answer, "its engine's start")
    return False


def _weights(loop: Served, message: dict) -> bool:
    """``weights``: load the staged version into the engine (the base, or a new adapter version)."""
    bridge, state, stats = loop.bridge, loop.state, loop.stats
    bridge.status = f"loading weights version {message['version']}"
    t0 = time.perf_counter()
    try:
        buckets = loop.reader.buckets(message, state.engine)  # (TP > 1: from the engine's first rank)
        if message.get("adapter"):  # the LoRA adapter only: a new adapter version, the base stays
            state.engine.load_adapter_tensors({name: t for bucket in buckets for name, t in bucket})
        else:
            state.engine.load_buckets(buckets)
        del buckets
    except Exception as err:  # noqa: BLE001 - the trainers' next job would wait for this rank forever
        bridge.die(f"loading weights version {message.get('version')} failed: {type(err).__name__}: {err}")
    loop.reader.loaded()
    state.version = message["version"]
    stats["weights_s"] += time.perf_counter() - t0
    stats["receive_s"] += message["receive_s"]
    stats["weights_bytes"] += message["bytes"]
    return False


def _job(loop: Served, message: dict) -> bool:
    """``job``: this rank's slice of the job, run by its kind's handler (:func:`~trl_nrollout.rollout.ranks.jobs.
    run_job`); the answer (or the error) goes to ``out/<job>/<r>``."""
    bridge, state, r = loop.bridge, loop.state, loop.r
    roles = bridge.roles
    bridge.status = f"generating job {message['id']}"
    engine = state.engine
    key = f"out/{message['id']}/{r}"
    t0 = time.perf_counter()
    try:
        groups, n = message["prompts"], message["n"]
        tp = engine.layout.rollout_tp_size
        start, stop = job_slice(len(groups) * n, n, roles.rollout_ranks, tp, r)
        message, images = read_job_images(message, start, stop)  # images: PNG bytes once a group, decoded
        done = run_job(RankJob(message, engine, state, r, roles.rollout_ranks, start, stop, images))
        balanced = done.balanced
        if done.pulled is not None and engine.rank == engine.tp_ranks[0]:
            first = job_slice(len(groups) * n, n, roles.rollout_ranks, tp, r)[0] // n
            last = job_slice(len(groups) * n, n, roles.rollout_ranks, tp, r + tp - 1)[1] // n
            balanced = (len(done.pulled.groups), sum(1 for g in done.pulled.groups if not first <= g < last))
        gen_s = time.perf_counter() - t0
        batch = done.batch  # (a partial job's prompts are the groups' as the trainers encode them: not expanded)
        result = JobResult.of(batch.completion_ids, batch.logprobs, batch.finish_reasons, gen_s, state.version,
                              balanced, done.extras, done.agent_stats,
                              _expanded(batch.prompt_ids, start, n, images if done.expanded else None), done.partial)
    except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
        _answer(bridge, key, {"kind": "error", "message": f"{type(err).__name__}: {err}"}, f"job {message['id']}")
        raise
    _answer(bridge, key, result, f"job {message['id']}")
    loop.stats["jobs"] += 1
    loop.stats["samples"] += stop - start
    loop.stats["gen_s"] += gen_s
    return False


def _end(loop: Served, message: dict) -> bool:
    """``end``: the trainers' ``train()`` (or ``evaluate()``) returned; so does this rank's."""
    loop.bridge.status = "between the trainers' calls"
    _close_endpoint(loop.state)  # the next call may be another trainer's
    loop.bridge.unwatch()
    return True


def _stop(loop: Served, message: dict) -> bool:
    """``stop``: the trainers are done: close the engine, say bye, and serve nothing more."""
    # not "done" yet: trainer rank 0 (the store's host) leaves once every rollout rank said bye or is done,
    # and a heartbeat saying "done" while the engine still closed let it leave before the bye was written
    bridge, state = loop.bridge, loop.state
    bridge.status = "closing its engine"
    engine, state.engine = state.engine, None
    try:
        if engine is not None:
            engine.close()
        _close_endpoint(state)
    finally:  # (a close that fails still says bye: trainer rank 0 would wait rollout_rank_timeout_s for it)
        bridge.unwatch()
        with contextlib.suppress(Exception):  # trainer rank 0 stopped waiting (rollout_rank_timeout_s): nothing to say
            bridge.put(f"bye/{loop.r}", True)
        bridge.finish()
        state.stopped = True
    return True


def _answer(bridge: Bridge, key: str, value, what: str) -> None:
    """Write ``value`` at ``key`` for the trainers waiting on it; where that fails they could only wait: this
    process stops (:meth:`~trl_nrollout.rollout.bridge.Bridge.die`)."""
    try:
        bridge.put(key, value)
    except Exception as err:  # noqa: BLE001 - the trainers wait on this key
        bridge.die(f"the answer to {what} could not be written ({key}): {type(err).__name__}: {err}")


#: what a rollout rank does with each kind of the trainers' messages (True: the loop returns)
MESSAGES: dict[str, Callable[[Served, dict], bool]] = {"start": _start, "weights": _weights, "job": _job,
                                                       "end": _end, "stop": _stop}
