"""Partial rollouts of ``agent=`` episodes (``rollout_partial=True``): a pool of groups whose agents run on across
steps.

A step adds its new groups (``n`` episodes of one dataset row, each its own agent run) to the rank's pool and serves
the pool's calls on the rank's engine until ``target`` groups have finished (every episode of the group returned,
failed or ran out of time); those train, in the order they finished, and the rest run on. An agent never sees a step
end: its call in the engine then is aborted with its tokens kept and queued again (at the next step it continues
from its prompt and those tokens on the weights of then, so no token is drawn twice; each token keeps the log-prob
of the policy that drew it, which the decoupled loss corrects as it does a partial sample's), and its agent keeps
waiting for the answer
(training time counts toward ``agent_timeout_s``); its tools keep running while the trainer trains. A group whose
episodes started more than ``max_staleness`` versions ago starts again: its episodes are closed (their agents' later
calls get a 404 and their results are dropped) and new ones start with the same row.

The pool has an endpoint of its own (an evaluation's episodes use the trainer's other one). Seeds: a call's seed
comes from the episode's place (a counter over the groups this rank started, restarts included) and the call's
index, not from the step or the other requests in the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl_nrollout.rollout.dispatch.agent_runs import EpisodeRunner, call_params, hand_out
from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
from trl_nrollout.rollout.seeds import prompt_seed, turn_seed
from trl_nrollout.rollout.types import SamplingOptions


@dataclass
class LiveGroup:
    """One dataset row's ``n`` episodes in flight: ``key`` (unique in the run: version, round, rank, index),
    ``row``, ``prompt`` (the row's prompt as the trainer renders it), ``records`` (its episodes, in order),
    ``version`` (the policy version its episodes started on), ``restarts``, ``finished`` (its place in the finish
    order, once every episode has ended)."""

    key: tuple
    row: dict
    prompt: Any
    records: list[EpisodeRecord] = field(default_factory=list)
    version: int = 0
    restarts: int = 0
    finished: int | None = None

    @property
    def oldest(self) -> int:
        """The policy version of the group's oldest token (its calls' tagged versions; ``version`` before any)."""
        tagged = [v for r in self.records if (v := r.oldest_version) is not None]
        return min(tagged, default=self.version)


class AgentPool:
    """A rank's groups of agent episodes in flight (see the module docstring): ``runner`` runs the agents,
    ``endpoint`` (an :class:`~trl_nrollout.rollout.episodes.endpoint.AgentEndpoint` of the pool's own, started) serves
    their calls; ``rank`` and ``world`` make the episodes' seed places unique over the ranks."""

    def __init__(self, runner: EpisodeRunner, endpoint, rank: int, world: int) -> None:
        self.runner = runner
        self.endpoint = endpoint
        self.rank, self.world = rank, world
        self.groups: list[LiveGroup] = []
        self._started = 0  # groups started on this rank (restarts included): the seeds' places
        self._finished = 0  # groups finished (the finish order)
        self._base: int | None = None

    def seed_with(self, sampling: SamplingOptions) -> None:
        """The pool's seed base: the first step's sampling seed (None: unseeded), kept for the run."""
        if self._base is None and not self.groups:
            self._base = sampling.seed
            base = self._base

            def seed(s: int, c: int) -> int | None:
                if base is None:
                    return None
                return base + s if c == 0 else prompt_seed(turn_seed(base, c), s, 1)

            self.endpoint.open([], seed)

    def add(self, keys: list[tuple], rows: list[dict], prompts: list, n: int, version: int) -> None:
        """New groups, one per row, their ``n`` agents started now."""
        groups = [LiveGroup(key, dict(row), prompt, version=version) for key, row, prompt in zip(keys, rows, prompts)]
        self.groups.extend(groups)
        self._start(groups, n)

    def restart_stale(self, version: int, max_staleness: int, n: int) -> int:
        """Start again every group (finished or not) whose episodes started more than ``max_staleness`` versions
        before ``version``; returns how many episodes started again."""
        stale = [g for g in self.groups if version - g.version > max_staleness]
        for g in stale:
            self.endpoint.forget([r.key for r in g.records])
            g.version, g.restarts, g.finished = version, g.restarts + 1, None
        self._start(stale, n)
        return sum(len(g.records) for g in stale)

    def run(self, engine, sampling: SamplingOptions, target: int, version: int | None = None
            ) -> tuple[list[LiveGroup], dict[str, float]]:
        """Serve the pool's calls on ``engine`` (a VLLMEngineGroup; a TP engine's ranks exchange their calls and
        stop together) until ``target`` of this rank's groups have finished; returns the first ``target`` to finish
        (they leave the pool) and the endpoint's counts (``carried``: calls aborted, to continue next step;
        ``kept_tokens``: their tokens so far). ``version``: the policy version the engine holds, each drawn token's
        tag (:attr:`~trl_nrollout.rollout.episodes.agent_calls.Call.versions`)."""
        if len(self.groups) < target:
            raise RuntimeError(f"the agent pool holds {len(self.groups)} groups for a step of {target}: a bug.")
        loop = engine.request_loop(stream=True)  # an aborted call keeps the tokens it drew
        engine.barrier_before_generate()
        stats = self.endpoint.serve(loop, call_params(engine, sampling), lambda: self._scan() >= target, exchange=engine.gather_tp,
                                    me=engine.tp_ranks.index(engine.rank), carry=True, version=version)
        self._scan()
        done = sorted((g for g in self.groups if g.finished is not None), key=lambda g: g.finished)[:target]
        chosen = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in chosen]
        self.endpoint.forget([r.key for g in done for r in g.records])
        return done, stats

    def run_shared(self, engine, sampling: SamplingOptions, reached: Callable[[], bool],
                   pull: Callable[[int], None], ticket: Callable[[], int], version: int | None = None
                   ) -> dict[str, float]:
        """:meth:`run` for a pool among others (``rollout_dispatch="balanced"``): serve the pool's calls until
        ``reached()`` says the job has enough finished groups; before each look, ``pull(running episodes)`` may add
        groups from the job's queue (:meth:`add`); a group that finishes takes the job-wide ``ticket()`` (its place
        in the job's finish order, across steps). Nothing leaves the pool: the caller picks what trains
        (:meth:`take`). Returns the endpoint's counts."""
        loop = engine.request_loop(stream=True)  # an aborted call keeps the tokens it drew
        engine.barrier_before_generate()

        def done() -> bool:
            pull(self.running())
            self._scan(ticket)
            return reached()

        stats = self.endpoint.serve(loop, call_params(engine, sampling), done, exchange=engine.gather_tp,
                                    me=engine.tp_ranks.index(engine.rank), carry=True, version=version)
        self._scan(ticket)
        return stats

    def running(self) -> int:
        """Episodes of the pool still open."""
        episodes = self.endpoint.episodes
        return sum(1 for g in self.groups for r in g.records if not episodes[r.key].closed)

    def take(self, keys: set) -> list[LiveGroup]:
        """The groups of ``keys`` leave the pool (they train); returned in pool order."""
        out = [g for g in self.groups if g.key in keys]
        self.groups = [g for g in self.groups if g.key not in keys]
        self.endpoint.forget([r.key for g in out for r in g.records])
        return out

    def close(self) -> None:
        """Close every episode (their agents' later calls get a 404) and the endpoint."""
        self.endpoint.forget([r.key for g in self.groups for r in g.records])
        self.groups = []
        self.endpoint.close()

    def _scan(self, ticket: Callable[[], int] | None = None) -> int:
        """Mark the groups whose episodes have all ended (in the order seen, or by ``ticket()``: a job-wide place);
        returns how many have."""
        episodes = self.endpoint.episodes
        count = 0
        for g in self.groups:
            if g.finished is None and all(episodes[r.key].closed for r in g.records):
                if ticket is None:
                    g.finished = self._finished
                    self._finished += 1
                else:
                    g.finished = ticket()
            count += g.finished is not None
        return count

    def _start(self, groups: list[LiveGroup], n: int) -> None:
        if not groups:
            return
        records, places = [], []
        for g in groups:
            first = (self._started * self.world + self.rank) * n
            self._started += 1
            g.records = [EpisodeRecord(key=f"p{'-'.join(map(str, g.key))}r{g.restarts}k{k}x"
                                           f"{time.monotonic_ns() % 10**6}", row=dict(g.row)) for k in range(n)]
            records += g.records
            places += range(first, first + n)
        self.endpoint.admit(records, places)
        threading.Thread(target=self.runner.run, args=(hand_out(records), self.endpoint, threading.Event()),
                         daemon=True, name="trl-nrollout-agent-pool").start()
