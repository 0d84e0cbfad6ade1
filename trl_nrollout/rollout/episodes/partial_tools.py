"""Partial rollouts of tool-calling episodes: the pool of :mod:`trl_nrollout.rollout.episodes.in_flight` whose samples are
multi-turn episodes run request by request (:func:`~trl_nrollout.rollout.episodes.tools.run_agent_requests`'s loop).

Two axes compose here: *when a step's rollout ends* (the first ``target`` groups to finish train; the others stay in
the pool across weight syncs) and *what an episode is* (turns, tool calls and their results, as
:class:`~trl_nrollout.rollout.episodes.tools.AgentSample` advances them). A sample of the pool is in one of three states
between steps:

- not started (no token yet: a fresh group runs as one request of ``n`` samples, sharing the prompt's prefill);
- in a turn: ``base`` (the turn's context: the prompt, or the episode so far with the last tool results) and the
  turn's tokens so far (``turn_ids``: the turn was stopped by an abort; it continues from ``base + turn_ids`` with
  the rest of the turn's budget, and is parsed once, whole, when it ends);
- done (its last turn called no tool, its tool rounds ran out, or its budget ended).

A turn that ends with tool calls runs them on a thread (``workers`` at a time) while the engine goes on; when the
step's groups have finished, the running requests are aborted (tokens kept) and the tool calls still running are
waited for, so between steps no sample waits on a tool: its results are in, its next turn's ``base`` is set.
Every token records the policy version that sampled it (tool-result tokens: the version that added them), so
staleness and the rollout correction work as for single-turn partial rollouts.

Tensor parallelism: every rank of an engine holds the same pool and runs the same requests in the same engine
steps. A group's tools run on one rank only (``owns``); each iteration the ranks exchange the tool results that
came in (messages, not just contexts), so every rank's copy of each episode stays the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialRun
from trl_nrollout.rollout.episodes.tool_images import message_images
from trl_nrollout.rollout.episodes.tools import AgentCallbacks, AgentSample, AgentStats, ToolRunner


@dataclass
class AgentPartialSample:
    """One tool-calling sample of a group in flight (see the module docstring).

    ``episode``: the sample after its first turn (None before); ``versions`` ``[L]``: the policy version of each of
    ``episode.completion_ids``; ``base``: the context of the turn in progress (None: the first turn, whose context is
    the group's prompt); ``budget``: that turn's token budget (None: the first turn's, ``max_completion_length``);
    ``turn_ids`` / ``turn_logprobs`` / ``turn_versions`` ``[T]``: the turn's tokens before an abort; ``done``: the
    episode ended."""

    episode: AgentSample | None = None
    versions: list[int] = field(default_factory=list)
    base: list[int] | None = None
    budget: int | None = None
    turn_ids: list[int] = field(default_factory=list)
    turn_logprobs: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def finished(self) -> bool:
        return self.done

    @property
    def finish_reason(self) -> str | None:
        return self.episode.finish_reason if self.done and self.episode is not None else None

    @property
    def token_ids(self) -> list[int]:
        """Every token it holds: the episode's completion and the turn in progress."""
        return (list(self.episode.completion_ids) if self.episode is not None else []) + list(self.turn_ids)

    def oldest_version(self) -> int | None:
        versions = self.versions + self.turn_versions
        return min(versions) if versions else None

    def restarted(self) -> AgentPartialSample:
        """The sample started again from its prompt (too stale)."""
        return AgentPartialSample()

    def next_request(self, prompt_ids: list[int], max_completion_length: int) -> tuple[list[int], int]:
        """The context ``[C]`` and token budget of its next request: the turn in progress, continued."""
        base = list(prompt_ids) if self.base is None else self.base
        budget = max_completion_length if self.budget is None else self.budget
        return base + self.turn_ids, budget - len(self.turn_ids)

    def engine_request(self, group: InFlightGroup, max_completion_length: int) -> tuple[list[int], int, list]:
        """:meth:`next_request` as the engine takes it, with its images: the group's prompt's and its tools', in
        order (none: text), the context with their placeholders unexpanded (the group's ``prompt_ids`` are the
        engine's form; where a tool returned an image, the episode's ``engine_completion``)."""
        context, budget = self.next_request(group.prompt_ids, max_completion_length)
        episode = self.episode
        images = list(group.images or []) + (list(episode.images) if episode is not None else [])
        if episode is not None and episode.engine_completion is not None:
            context = list(group.prompt_ids) + list(episode.engine_completion) + list(self.turn_ids)
        return context, budget, images

    def end_turn(self, new: list[int], new_logprobs: list[float], finish_reason: str, version: int,
                 prompt_ids: list[int], parse: Callable[[list[int], list[int]], dict], max_iterations: int | None
                 ) -> bool:
        """The turn in progress ended with ``new`` tokens (sampled by ``version``): parse it whole and add it to the
        episode. Returns whether its tool calls run next (else the episode is done)."""
        ids, logprobs = self.turn_ids + list(new), self.turn_logprobs + list(new_logprobs)
        versions = self.turn_versions + [version] * len(new)
        if self.episode is None:
            self.episode = AgentSample.first_turn(prompt_ids, ids, logprobs, finish_reason, parse(ids, list(prompt_ids)))
            self.versions = versions
        else:
            base = list(self.base or [])
            budget = len(ids) if self.budget is None else self.budget
            self.episode.add_turn(ids, logprobs, finish_reason, budget, lambda turn: parse(turn, base))
            self.versions += versions[:budget]
        self.turn_ids, self.turn_logprobs, self.turn_versions = [], [], []
        if self.episode.may_call(max_iterations):
            return True
        self.episode.calls_tools = False
        self.done = True
        return False

    def add_results(self, tool_messages: list[dict], failed: int, version: int, agent: AgentCallbacks) -> None:
        """The last turn's tool results are in: append them (tagged ``version``) and set the next turn's context,
        or end the episode when they do not fit."""
        episode = self.episode
        assert episode is not None
        before = len(episode.completion_ids)
        media = agent.media  # (None: a loop that carries no images, whose tool images are refused)
        images = message_images(tool_messages) if media is not None else None
        context = episode.add_tool_results(tool_messages, failed, agent.suffix_ids(tool_messages),
                                           agent.max_completion_length, agent.max_model_len, images,
                                           media.engine_suffix(tool_messages) if images else None)
        if context is None:
            self.done = True
            return
        self.versions += [version] * (len(episode.completion_ids) - before)
        self.base = context
        self.budget = episode.budget(context, agent.max_completion_length, agent.max_model_len)


class Request(NamedTuple):
    """What one request of :func:`run_partial_agents` is for: pool index ``group``, its ``samples`` (all ``n`` for a
    fresh group's first turn, else one), the ``turn`` in progress (0: the first; ``r``: the turn after tool round
    ``r``) and whether the call ``started`` it (a fresh group, or a turn stopped by an earlier call's abort) rather
    than after tool results within the call. Within a call, ``(group, samples[0], turn)`` names one request."""

    group: int
    samples: list[int]
    turn: int
    started: bool


def run_partial_agents(
    loop,
    groups: list[InFlightGroup],
    target: int,
    version: int,
    agent: AgentCallbacks,
    *,
    make_params: Callable[[int, int, int], Any],
    prompt: Callable[[list[int]], Any],
    owns: Callable[[InFlightGroup], bool],
    exchange: Callable[[Any], list],
    workers: int,
    poll_s: float | None = None,
    pull: Callable[[], tuple[list[int], bool]] | None = None,
    finished: Callable[[list[int]], None] | None = None,
    reached: Callable[[], bool] | None = None,
    done: Callable[[list[int]], bool] | None = None,
) -> tuple[PartialRun, AgentStats]:
    """Run the pool ``groups`` of tool-calling episodes on one engine until ``target`` groups have finished (or none
    is left unfinished); abort the running turns (tokens kept) and wait for the tools still running.

    ``loop``: a streaming :class:`~trl_nrollout.rollout.engines.requests.EngineLoop`; ``make_params(n, budget, slot,
    request)``: the SamplingParams of one request (``slot``: its place among the call's requests, spaced by ``n``;
    ``request``: the :class:`Request` it is for); ``prompt(ids)``:
    the engine's prompt; ``owns(group)``: whether this rank runs the group's tools; ``exchange(obj)``: every rank of
    the engine's TP group calls it each iteration and gets all ranks' objects in rank order; ``poll_s``: how long an
    idle engine waits for a tool before the next exchange (None: until one finishes, right for one rank).
    ``agent.parse`` / ``agent.run_tools`` get the sample's place in the pool (``g * n + k``) as their index.

    A queue shared with other engines (``rollout_dispatch="balanced"``: the pool is the job's, the same on every
    rank): no group starts at once; ``pull()`` (each iteration, agreeing across the TP group) hands this engine pool
    indices to start, ``([g], drained)``; ``finished(groups)`` is told the groups that finished in an iteration (the
    job's tickets); ``reached()`` (agreeing across the TP group) says the job's ``target`` groups are out, in place
    of this engine's own count. ``done(finish_order)``: in place of ``target``, whether the groups finished so far
    are enough (the same on every rank of the TP group: they see the same finish order).
    Returns the :class:`PartialRun` (the pool updated, the order groups finished in) and the :class:`AgentStats`."""
    pool = [replace(g, samples=[_copy(s) for s in g.samples]) for g in groups]
    owner: dict[str, tuple[int, list[int]]] = {}
    slot = 0
    stats = AgentStats()
    finish_order = [i for i, g in enumerate(pool) if g.finished]
    reported = len(finish_order)  # groups finished before the call hold the first places: not reported
    width = max((g.n for g in pool), default=1)

    def add(g: int, ks: list[int], context: list[int], budget: int, started: bool, images: list | None = None
            ) -> None:
        nonlocal slot
        episode = pool[g].samples[ks[0]].episode
        turn = 0 if episode is None else episode.rounds + 1  # the turn in progress: the first, or after a tool round
        rid = loop.add(prompt(context, images) if images else prompt(context),
                       make_params(len(ks), budget, slot, Request(g, ks, turn, started)))
        owner[rid] = (g, ks)
        slot += len(ks)
        stats.requests += 1

    def parse_for(g: int, k: int) -> Callable[[list[int], list[int]], dict]:
        return lambda ids, prefix: agent.parse(g * width + k, ids, prefix)

    def start(g: int) -> None:
        """Group ``g``'s requests as the call starts it: a fresh group as one request, else its unfinished samples."""
        group = pool[g]
        if group.finished:
            return
        if not group.started and all(s.base is None for s in group.samples):
            add(g, list(range(group.n)), list(group.prompt_ids), agent.max_completion_length, True, group.images)
            return
        for k, s in enumerate(group.samples):
            if not s.finished:
                context, budget, images = s.engine_request(group, agent.max_completion_length)
                add(g, [k], context, budget, True, images)

    def stop() -> bool:
        if reached is not None:
            return reached()
        return done(finish_order) if done is not None else len(finish_order) >= target

    def report() -> None:
        nonlocal reported
        if finished is not None and len(finish_order) > reported:
            finished(finish_order[reported:])
        reported = len(finish_order)

    if pull is None:
        for g in range(len(pool)):
            start(g)
    drained = pull is None
    runner = ToolRunner(agent.run_tools, workers)
    waiting: set[tuple[int, int]] = set()  # samples whose tools run (on whichever rank owns them)

    def group_done(g: int) -> None:
        if pool[g].finished and g not in finish_order:
            finish_order.append(g)

    def turn_ended(g: int, k: int, progress, reason: str) -> None:
        sample = pool[g].samples[k]
        if sample.end_turn(progress.token_ids, progress.logprobs, reason, version, pool[g].prompt_ids,
                           parse_for(g, k), agent.max_iterations):
            waiting.add((g, k))
            if owns(pool[g]):
                runner.submit(g * width + k, g * width + k, sample.episode.messages[-1]["tool_calls"])
        group_done(g)

    def results(timeout: float | None) -> list:
        return [(key // width, key % width, messages, failed) for key, messages, failed in runner.finished(timeout)]

    def apply(everyone: list) -> list[tuple[int, int]]:
        """Every rank's tool results, in rank order: the episodes go on (identically on every rank)."""
        ready = []
        for rank_results, _ in everyone:
            for g, k, messages, failed in rank_results:
                waiting.discard((g, k))
                sample = pool[g].samples[k]
                sample.add_results(messages, failed, version, agent)
                if sample.finished:
                    group_done(g)
                else:
                    ready.append((g, k))
        return ready

    try:
        while not stop():
            if not drained:  # a shared queue: more groups while the engine has room
                pulled, drained = pull()
                for g in pulled:
                    start(g)
            if loop.has_unfinished:
                mine = results(0.0)
            else:  # the engine has nothing to run: wait for a tool
                if not waiting:
                    break
                idle_from = time.perf_counter()
                mine = results(poll_s)
                stats.idle_s += time.perf_counter() - idle_from
            everyone = exchange((mine, runner.pending))
            for g, k in apply(everyone):
                context, budget, images = pool[g].samples[k].engine_request(pool[g], agent.max_completion_length)
                add(g, [k], context, budget, False, images)
            if not loop.has_unfinished and waiting and not any(p or r for r, p in everyone):
                raise RuntimeError(f"{len(waiting)} tool-calling samples wait for tools no rank runs: the ranks of "
                                   "the engine's TP group disagree about them (a bug).")
            report()
            if stop() or not loop.has_unfinished:
                continue
            tools_running = runner.pending > 0
            for rid, j in loop.step():
                g, ks = owner[rid]
                progress = loop.samples[(rid, j)]
                turn_ended(g, ks[j], progress, progress.finish_reason)
            stats.engine_steps += 1
            stats.steps_with_tools += tools_running
            report()
        aborted = loop.abort()
        for rid, j in aborted:  # the turns stopped here keep their tokens and continue after the next sync
            g, ks = owner[rid]
            sample, progress = pool[g].samples[ks[j]], loop.samples[(rid, j)]
            _, budget = sample.next_request(pool[g].prompt_ids, agent.max_completion_length)
            if len(progress.token_ids) >= budget:  # stopped on its last token: the turn ends, cut
                turn_ended(g, ks[j], progress, "length")
                continue
            sample.turn_ids += progress.token_ids
            sample.turn_logprobs += progress.logprobs
            sample.turn_versions += [version] * len(progress.token_ids)
        while True:  # the tools still running: their results are in before the step trains
            everyone = exchange((results(None if runner.pending else 0.0), runner.pending))
            apply(everyone)
            if not waiting:
                break
            if not any(pending or rank_results for rank_results, pending in everyone):
                raise RuntimeError(f"{len(waiting)} tool-calling samples wait for tools no rank runs: the ranks of "
                                   "the engine's TP group disagree about them (a bug).")
    finally:
        runner.close()
    stats.tool_s = runner.tool_s
    new_tokens = sum(len(p.token_ids) for p in loop.samples.values())
    return PartialRun(pool, finish_order, len(aborted), loop.steps, new_tokens), stats


def _copy(sample):
    """A sample the run may change without touching the caller's pool."""
    if not isinstance(sample, AgentPartialSample):
        return sample
    episode = None if sample.episode is None else replace(
        sample.episode, completion_ids=list(sample.episode.completion_ids), tool_mask=list(sample.episode.tool_mask),
        logprobs=list(sample.episode.logprobs), messages=list(sample.episode.messages),
        images=list(sample.episode.images), engine_completion=None if sample.episode.engine_completion is None
        else list(sample.episode.engine_completion))
    return replace(sample, episode=episode, versions=list(sample.versions), turn_ids=list(sample.turn_ids),
                   turn_logprobs=list(sample.turn_logprobs), turn_versions=list(sample.turn_versions))
