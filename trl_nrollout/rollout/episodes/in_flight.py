"""Partial rollouts: a step's rollout ends when enough groups have finished; the others wait for the next step.

With ``rollout_partial=True`` each engine keeps a pool of groups in flight. A step adds its new prompts to the pool,
runs every unfinished sample (a fresh group as one request of ``n`` samples, a sample stopped earlier as a
continuation: prompt + its tokens so far, with the rest of its token budget), and stops the engine as soon as the
step's number of groups have all ``n`` samples finished. The unfinished samples are aborted with their tokens and
log-probs kept and continue after the next weight sync. So the step no longer waits for its longest sample, and
the engine stays full of work while it runs.

Every token records the policy version (optimizer steps taken) that sampled it, and its behaviour log-prob; the
rollout correction (``rollout_is``) weights each token by its own. A sample whose oldest token is more than
``max_staleness`` versions old when a step starts is dropped and started again (its group keeps its place). Groups
stay whole: a group trains when its ``n`` samples have finished, all of them together.

The pure parts (staleness, the choice of the groups that train) are functions here; :func:`run_partial` drives one
engine through :class:`~trl_nrollout.rollout.engines.requests.EngineLoop`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trl_nrollout.rollout.engines.requests import EngineLoop, SampleProgress


@dataclass
class PartialSample(SampleProgress):
    """One sample of a group as far as it got: the engine loop's tokens ``[L]``, behaviour log-probs ``[L]`` and
    ``finish_reason`` (None while unfinished, else ``"stop"`` / ``"length"``), and the policy version that sampled
    each token ``[L]``."""

    versions: list[int] = field(default_factory=list)

    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    def restarted(self) -> PartialSample:
        """The sample started again from its prompt (too stale)."""
        return PartialSample()

    def extended(self, tokens: list[int], logprobs: list[float], version: int) -> PartialSample:
        """This sample with ``tokens`` appended, sampled by policy ``version``."""
        return PartialSample(self.token_ids + tokens, self.logprobs + logprobs, self.finish_reason,
                             self.versions + [version] * len(tokens))


@dataclass
class InFlightGroup:
    """One prompt's ``n`` samples in flight. ``key``: unique in the run (seeds and order); ``prompt_ids``: the
    prompt's tokens as the engine takes them (image placeholders not expanded); ``payload``: what the caller carries
    with the group (the dataset row it scores against); ``images``: the prompt's images (vLLM's
    ``multi_modal_data``), sent with the prompt on every request of the group, continuations included (None: text)."""

    key: int
    prompt_ids: list[int]
    samples: list[PartialSample]
    payload: Any = None
    restarts: int = 0
    images: list | None = None

    @classmethod
    def fresh(cls, key: int, prompt_ids: list[int], n: int, payload: Any = None,
              sample: Callable[[], Any] = PartialSample, images: list | None = None) -> InFlightGroup:
        """A group not started yet; ``sample()`` makes each of its ``n`` samples (a
        :class:`~trl_nrollout.rollout.episodes.partial_tools.AgentPartialSample` for tool-calling episodes)."""
        return cls(key, list(prompt_ids), [sample() for _ in range(n)], payload,
                   images=list(images) if images else None)

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def started(self) -> bool:
        return any(s.token_ids for s in self.samples)

    def staleness(self, version: int) -> int:
        """Versions between ``version`` and the oldest token of the group (0 for a group with no tokens)."""
        oldest = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return version - min(oldest) if oldest else 0


def drop_stale(groups: list[InFlightGroup], version: int, max_staleness: int
               ) -> tuple[list[InFlightGroup], int, int]:
    """The pool at the start of step ``version``: every sample whose oldest token is more than ``max_staleness``
    versions old is dropped and starts again (empty, unfinished); its group keeps its place. Returns the groups, the
    number of samples restarted and the tokens they dropped. Afterwards no sample in the pool is staler than
    ``max_staleness``."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0.")
    out, restarted, dropped = [], 0, 0
    for g in groups:
        samples = []
        for s in g.samples:
            oldest = s.oldest_version()
            if oldest is not None and version - oldest > max_staleness:
                samples.append(s.restarted())
                restarted += 1
                dropped += len(s.token_ids)
            else:
                samples.append(s)
        changed = any(a is not b for a, b in zip(samples, g.samples))
        out.append(replace(g, samples=samples, restarts=g.restarts + 1) if changed else g)
    return out, restarted, dropped


def split_finished(groups: list[InFlightGroup], finish_order: list[int], target: int
                   ) -> tuple[list[InFlightGroup], list[InFlightGroup]]:
    """The ``target`` groups that train (the first to finish: ``finish_order`` holds pool indices in the order the
    groups finished, earlier ones first) and the pool that waits (every other group, in pool order)."""
    chosen = finish_order[:target]
    taken = set(chosen)
    return [groups[i] for i in chosen], [g for i, g in enumerate(groups) if i not in taken]


def homes_done(homes: list[int], finish_order: list[int], quota: dict[int, int]) -> bool:
    """Whether every home ``h`` of ``quota`` has ``quota[h]`` groups among the finished (``homes[i]``: the home of
    pool group ``i``; ``finish_order``: pool indices). The stop of a pool whose groups must train where they live
    (environments: a group trains on the rank that drew it)."""
    got = dict.fromkeys(quota, 0)
    for i in finish_order:
        if homes[i] in got:
            got[homes[i]] += 1
    return all(got[h] >= q for h, q in quota.items())


def split_finished_by_home(groups: list[InFlightGroup], finish_order: list[int], homes: list[int],
                           quota: dict[int, int]) -> tuple[list[InFlightGroup], list[InFlightGroup]]:
    """:func:`split_finished` where each group trains on its home: for each home of ``quota`` in its order, its
    first ``quota[h]`` groups to finish (fewer when fewer finished), concatenated, so that rank ``h``'s share is
    its own groups; the pool that waits is every other group, in pool order."""
    chosen: list[int] = []
    for h, q in quota.items():
        chosen += [i for i in finish_order if homes[i] == h][:q]
    taken = set(chosen)
    return [groups[i] for i in chosen], [g for i, g in enumerate(groups) if i not in taken]


@dataclass
class PartialRun:
    """What one engine call of a partial rollout did: ``groups`` (the pool after the call, updated),
    ``finish_order`` (pool indices of finished groups, in the order they finished: those already finished first),
    and counts: ``aborted`` samples stopped with their tokens kept, ``engine_steps``, ``new_tokens``. With a
    balanced queue (:mod:`trl_nrollout.rollout.dispatch.partial_queue`): the job's pool, its finish order, this engine's
    counts, and ``engine_groups``, the pool indices this engine ran (in claim order)."""

    groups: list[InFlightGroup]
    finish_order: list[int]
    aborted: int
    engine_steps: int
    new_tokens: int
    engine_groups: list[int] = field(default_factory=list)


def pending_requests(g: InFlightGroup, max_tokens: int) -> list[tuple[list[int], list[int], int]]:
    """The requests that run group ``g`` on: ``(sample indices, prompt ids, token budget)`` each. A fresh group is
    one request of its ``n`` samples (the engine shares the prompt's prefill among them); a started one, one request
    per unfinished sample (prompt + its tokens so far, the rest of its budget); a finished one, none."""
    if g.finished:
        return []
    if not g.started:
        return [(list(range(g.n)), list(g.prompt_ids), max_tokens)]
    return [([k], g.prompt_ids + s.token_ids, max_tokens - len(s.token_ids))
            for k, s in enumerate(g.samples) if not s.finished]


def merge_progress(loop: EngineLoop, owner: dict[str, tuple[int, list[int]]], groups: list[InFlightGroup],
                   version: int, max_tokens: int) -> tuple[list[InFlightGroup], int]:
    """The pool ``groups`` with what the (stopped) ``loop``'s requests sampled appended to their samples, tagged
    ``version`` (``owner``: request -> (pool index, its sample indices)); an aborted sample stays unfinished unless
    its budget is spent. Returns the updated pool and the new tokens."""
    updated = list(groups)
    new_tokens = 0
    for rid, (i, ks) in owner.items():
        progress = loop.request(rid)
        samples = list(updated[i].samples)
        for j, k in enumerate(ks):
            p = progress[j]
            merged = samples[k].extended(p.token_ids, p.logprobs, version)
            merged.finish_reason = None if p.finish_reason == "abort" else p.finish_reason
            if merged.finish_reason is None and len(merged.token_ids) >= max_tokens:
                merged.finish_reason = "length"  # aborted on its last token: nothing left to continue
            samples[k] = merged
            new_tokens += len(p.token_ids)
        updated[i] = replace(updated[i], samples=samples)
    return updated, new_tokens


def run_partial(loop: EngineLoop, groups: list[InFlightGroup], target: int, version: int, max_tokens: int,
                make_params: Callable[[int, int, int | None], Any], prompt: Callable[[list[int], list | None], Any]
                ) -> PartialRun:
    """Run one engine on the pool until ``target`` groups have finished (or none is left unfinished), then abort
    the rest, keeping their tokens. ``make_params(n, max_tokens, seed_slot)`` builds the SamplingParams of one
    request (``seed_slot``: the request's place among this call's requests, spaced by ``n``, for the caller's
    seeds); ``prompt(ids, images)`` the engine's prompt (``images``: the group's, on every request of it). New
    tokens are tagged ``version``. Every rank of a TP group calls it with the same pool and makes the same decisions
    (they see the same outputs). ``loop``: a streaming request loop of the engine (its requests use the engine's
    current adapter version: a sample continued after a sync continues under the new adapter)."""
    owner: dict[str, tuple[int, list[int]]] = {}  # request -> (pool index, the sample indices it serves)
    slot = 0
    finish_order = [i for i, g in enumerate(groups) if g.finished]
    for i, g in enumerate(groups):
        for ks, ids, budget in pending_requests(g, max_tokens):
            rid = loop.add(prompt(ids, g.images), make_params(len(ks), budget, slot))
            owner[rid] = (i, ks)
            slot += len(ks)
    pending = {i: sum(not s.finished for s in g.samples) for i, g in enumerate(groups) if not g.finished}
    while len(finish_order) < target and loop.has_unfinished:
        for rid, _ in loop.step():  # a sample finished: its group finishes with its last sample
            i = owner[rid][0]
            pending[i] -= 1
            if pending[i] == 0:
                finish_order.append(i)
        if not loop.engine_has_unfinished():
            break
    aborted = len(loop.abort())
    updated, new_tokens = merge_progress(loop, owner, groups, version, max_tokens)
    for i, g in enumerate(updated):  # a group whose last sample was cut at its budget when aborted
        if g.finished and i not in finish_order:
            finish_order.append(i)
    return PartialRun(updated, finish_order, aborted, loop.steps, new_tokens)
