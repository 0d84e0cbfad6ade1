"""The rollout ranks' side of engines on rollout ranks (``rollout_ranks``): :func:`serve`, the loop that acts on the
trainers' messages (:mod:`trl_nrollout.rollout.remote` describes them and holds the trainers' side,
:class:`~trl_nrollout.rollout.remote.RemoteEngines`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import astuple

from trl_nrollout.rollout.dispatch.balanced import generate_balanced
from trl_nrollout.rollout.rank_state import RankState
from trl_nrollout.rollout.ranks import Bridge, RolloutRankError
from trl_nrollout.rollout.remote_buckets import job_slice
from trl_nrollout.rollout.remote_partial import (
    PartialEntry,
    close_agent_pool,
    run_partial_agent_job,
    run_partial_job,
)
from trl_nrollout.rollout.remote_reader import MessageReader, staged_versions
from trl_nrollout.rollout.remote_tool_episodes import run_agent_job
from trl_nrollout.rollout.types import JobResult, RolloutBatch


def _expanded(prompt_ids: list[list[int]], start: int, n: int, pics: list | None) -> dict[int, list[int]] | None:
    """A job with images: the engine's prompt (placeholders expanded) of each group of samples ``start, ...``."""
    return None if pics is None else {(start + i) // n: list(p) for i, p in enumerate(prompt_ids)}


def _close_endpoint(state: RankState) -> None:
    """Close the rollout rank's ``agent=`` endpoint, if it started one (a later job starts it again)."""
    endpoint, state.endpoint = state.endpoint, None
    if endpoint is not None:
        endpoint.close()
    close_agent_pool(state)  # (partial agent= episodes' own endpoint and live agents)


def serve(bridge: Bridge, build_engine, state: RankState) -> dict:
    """The rollout rank's loop: act on the trainers' messages in order (:class:`MessageReader` reads them), until
    ``end`` (returns) or ``stop`` (closes the engine). ``build_engine(settings)`` builds this rank's engine from the
    start message; ``state`` (:class:`RankState`) keeps the next message's index and the engine between calls (``train()`` then
    ``evaluate()``). Returns counts and seconds of what this rank did."""
    roles = bridge.roles
    r = roles.role_rank(bridge.rank)
    stats = {"jobs": 0, "samples": 0, "gen_s": 0.0, "weights_s": 0.0, "receive_s": 0.0, "weights_bytes": 0,
             "idle_s": 0.0}
    bridge.watch([0])  # trainer rank 0 watches everyone else; a rollout rank watches it only
    reader = MessageReader(bridge, state.msg, state.slots, lambda: state.engine)
    while True:
        t0 = time.perf_counter()
        bridge.status = "idle"
        state.msg, message = reader.next()
        stats["idle_s"] += time.perf_counter() - t0
        kind = message["kind"]
        if kind == "start":
            state.slots = staged_versions(message)
            bridge.status = "starting its engine"
            try:
                engine = state.engine = build_engine(message)
                state.dispatch = message.get("dispatch", "shares")
                state.agent = message.get("agent")  # tools on the rollout ranks (remote_tool_episodes)
                state.bridge = bridge  # environments' tool calls go home through its store
                answer = {"names": sorted(engine.parameter_names()), "dtype": str(engine.dtype)}
            except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
                bridge.put(f"ready/{r}", {"kind": "error", "message": f"{type(err).__name__}: {err}"})
                raise
            bridge.put(f"ready/{r}", answer)
        elif kind == "weights":
            bridge.status = f"loading weights version {message['version']}"
            t0 = time.perf_counter()
            buckets = reader.buckets(message, state.engine)  # (TP > 1: from the engine's first rank)
            if message.get("adapter"):  # the LoRA adapter only: a new adapter version, the base stays
                state.engine.load_adapter_tensors({name: t for bucket in buckets for name, t in bucket})
            else:
                state.engine.load_buckets(buckets)
            del buckets
            reader.loaded()
            state.version = message["version"]
            stats["weights_s"] += time.perf_counter() - t0
            stats["receive_s"] += message["receive_s"]
            stats["weights_bytes"] += message["bytes"]
        elif kind == "job":
            bridge.status = f"generating job {message['id']}"
            engine = state.engine
            groups, n, pics = message["prompts"], message["n"], message.get("images")  # images: once a group
            start, stop = job_slice(len(groups) * n, n, roles.rollout_ranks, engine.layout.rollout_tp_size, r)
            images = None if pics is None else [pics[i // n] for i in range(start, stop)]
            t0 = time.perf_counter()
            balanced = pulled = extras = agent_stats = partial = None
            try:
                if isinstance(message.get("agent"), PartialEntry):  # groups in flight from job to job
                    slices = [job_slice(len(groups) * n, n, roles.rollout_ranks, engine.layout.rollout_tp_size, q)
                              for q in range(roles.rollout_ranks)]
                    done = (run_partial_agent_job(engine, message, state, slices, r) if message["agent"].agents
                            else run_partial_job(engine, message, state, slices, r, state.dispatch == "balanced"))
                    batch, extras, partial, balanced = done.batch, (done.mask, done.fields), done.report, done.pulled
                    agent_stats = done.agent_stats
                    pics = None  # (the groups' prompts as the trainers encode them: they train wherever they finish)
                elif message.get("agent") is not None:  # whole tool episodes, request by request, tools here
                    prompts = [groups[i // n] for i in range(start, stop)]
                    batch, pulled, extras, stats_ = run_agent_job(engine, message, state, prompts, n, start,
                                                                  state.dispatch == "balanced")
                    agent_stats = astuple(stats_)
                elif "budgets" in message:  # a tool turn: one sample per context, each with its budget
                    batch = engine.generate_turns(groups[start:stop], message["budgets"][start:stop],
                                                  message["sampling"], sample_ids=message["sample_ids"][start:stop],
                                                  num_samples=0)
                elif state.dispatch == "balanced":  # the engines pull the job's groups from one queue
                    prompts = [groups[i // n] for i in range(start, stop)]
                    batch, pulled = generate_balanced(engine, prompts, n, message["sampling"], images=images)
                elif stop > start or engine.layout.rollout_tp_size > 1:
                    prompts = [groups[i // n] for i in range(start, stop)]
                    batch = engine.generate_expanded(prompts, n, message["sampling"], sample_offset=start,
                                                     images=images)
                else:
                    batch = RolloutBatch([], [], [], [], [])
                if pulled is not None and engine.rank == engine.tp_ranks[0]:
                    tp = engine.layout.rollout_tp_size
                    first = job_slice(len(groups) * n, n, roles.rollout_ranks, tp, r)[0] // n
                    last = job_slice(len(groups) * n, n, roles.rollout_ranks, tp, r + tp - 1)[1] // n
                    balanced = (len(pulled.groups), sum(1 for g in pulled.groups if not first <= g < last))
            except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
                bridge.put(f"out/{message['id']}/{r}", {"kind": "error", "message": f"{type(err).__name__}: {err}"})
                raise
            gen_s = time.perf_counter() - t0
            bridge.put(f"out/{message['id']}/{r}", JobResult.of(batch.completion_ids, batch.logprobs,
                                                                batch.finish_reasons, gen_s, state.version,
                                                                balanced, extras, agent_stats,
                                                                _expanded(batch.prompt_ids, start, n, pics), partial))
            stats["jobs"] += 1
            stats["samples"] += stop - start
            stats["gen_s"] += gen_s
        elif kind == "end":
            bridge.status = "between the trainers' calls"
            _close_endpoint(state)  # the next call may be another trainer's
            bridge.unwatch()
            return stats
        elif kind == "stop":
            # not "done" yet: trainer rank 0 (the store's host) leaves once every rollout rank said bye or is done,
            # and a heartbeat saying "done" while the engine still closed let it leave before the bye was written
            bridge.status = "closing its engine"
            engine, state.engine = state.engine, None
            if engine is not None:
                engine.close()
            _close_endpoint(state)
            bridge.unwatch()
            with contextlib.suppress(Exception):  # trainer rank 0 stopped waiting (rollout_rank_timeout_s): nothing to say
                bridge.put(f"bye/{r}", True)
            bridge.finish()
            state.stopped = True
            return stats
        else:  # pragma: no cover - a message this version does not know
            raise RolloutRankError(f"unknown message {kind!r} from the trainers (a version mismatch?)")
