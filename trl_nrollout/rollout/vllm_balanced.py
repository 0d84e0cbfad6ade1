"""Balanced dispatch on a ``VLLMEngineGroup`` (``rollout_dispatch="balanced"``): the job's groups in one queue
that every engine pulls from while it has room, each group's samples sent home to the rank that owns its prompt. A
mixin of :class:`~trl_nrollout.rollout.vllm_group.VLLMEngineGroup`."""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from trl_nrollout.rollout.dispatch import GroupQueue, PullStats, run_pulled
from trl_nrollout.rollout.partial import InFlightGroup, PartialRun
from trl_nrollout.rollout.partial_queue import (
    home_seed_slots,
    partial_result,
    queue_order,
    run_partial_pulled,
)
from trl_nrollout.rollout.seeds import SEED_BITS, engine_seed, prompt_seed
from trl_nrollout.rollout.seeds import turn_seed as own_turn_seed
from trl_nrollout.rollout.tool_episodes import AgentCallbacks, AgentSample, AgentStats, run_agent_requests
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.rollout.vllm_process import exchange_objects, vllm_prompts


def partial_prompt(ids: list[int], images: list | None):
    """A partial rollout's request prompt: token ids, with the group's images (``multi_modal_data``) if it has any."""
    return vllm_prompts([ids], [images] if images else None)[0]

logger = logging.getLogger(__name__)


class BalancedDispatch:
    """One balanced queue of the job's groups over the engines (see the module docstring)."""

    def generate_balanced(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          images: list[list] | None = None) -> tuple[RolloutBatch, PullStats]:
        """:meth:`generate_expanded` with ``rollout_dispatch="balanced"`` (:mod:`trl_nrollout.rollout.dispatch`): the
        job's groups form one queue; each engine pulls groups while it holds fewer than ``max_num_seqs + n`` unfinished
        samples (vLLM counts each of a request's ``n`` samples until it ends);
        afterwards every rank gets the samples of its own prompts, in order. Group ``g`` of the job is seeded as
        under ``"shares"`` (from ``g``), whichever engine runs it. Collective over every rank. Returns the batch and
        this engine's :class:`~trl_nrollout.rollout.dispatch.PullStats` (its groups and busy seconds)."""
        if self._world_group is None:  # one engine (or one process): its share is the whole queue
            start = time.perf_counter()
            batch = self.generate_expanded(sample_prompts, n, sampling, images=images)
            busy = time.perf_counter() - start
            return batch, PullStats(groups=sorted(set(batch.group_index)), claims=1, busy_s=busy)
        self.barrier_before_generate()
        world = torch.distributed.get_world_size()
        per_rank = [None] * world
        torch.distributed.all_gather_object(per_rank, ([list(p) for p in sample_prompts], images),
                                            group=self._world_group)
        flat = [p for prompts, _ in per_rank for p in prompts]
        unique = self._whole_groups(flat, n)
        flat_images = None
        if any(imgs is not None for _, imgs in per_rank):
            flat_images = [img for prompts, imgs in per_rank
                           for img in (imgs if imgs is not None else [[] for _ in prompts])][::n]
        counts = [len(prompts) for prompts, _ in per_rank]
        offset = sum(counts[:self.rank])  # the job's samples in rank order (TRL's: rank r's start at r * its count)
        self._ready()
        self.check_prompt_length(max((len(p) for p in unique), default=0), sampling.max_tokens)
        per_request = sampling.seed is not None and self.seed_mode == "sample"
        shared = None if per_request else self.sampling_params(n, replace(sampling, seed=None))
        engine_prompts = vllm_prompts(unique, flat_images)
        loop = self.request_loop()

        def add_group(g: int) -> str:
            params = shared or self.sampling_params(n, replace(sampling, seed=prompt_seed(sampling.seed, g, n)))
            return loop.add(engine_prompts[g], params)

        leader = self.rank == self.tp_ranks[0]

        def share(claim):  # the TP group's leader claims; its ranks run the same groups
            return self.gather_tp(claim() if leader else None)[0]

        capacity = self.max_num_seqs
        with self._engine_rng(sampling.seed):
            queue = self.job_queue(counts, n)
            requests, stats = run_pulled(loop, queue, add_group, n, capacity,
                                         share=None if self._tp_group is None else share,
                                         outstanding=self.llm.llm_engine.get_num_unfinished_requests)
        done = self.send_home(
            {g: (loop.prompt_ids(rid) if flat_images is not None else list(unique[g]),
                 [(x.token_ids, x.logprobs, x.finish_reason) for x in loop.request(rid)])
             for g, rid in requests.items()} if leader else {},
            counts, n)
        self.drop_job_queue(queue)  # every rank is past its last claim
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
        batch = RolloutBatch(prompt_ids, completion_ids, logprobs, reasons, groups,
                             timings={"generate_s": stats.busy_s})
        return batch, stats

    def run_agents_balanced(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                            turn_seed: Callable[[int], int | None], agent: AgentCallbacks, workers: int
                            ) -> tuple[list[AgentSample], list[int], AgentStats, PullStats]:
        """:meth:`run_agents` with ``rollout_dispatch="balanced"``: the job's groups form one queue that every engine
        pulls from while it has room (as :meth:`generate_balanced`), each pulled group's episodes run request by
        request on the engine that pulled it (its tools on that engine's first rank: ``tools=`` are the same
        functions on every rank), and the finished episodes go home to the ranks that own their prompts.
        Seeds depend on the job's group and sample, not on the engine: with a seed and ``seed_mode="sample"`` group
        ``g``'s first turn as under ``"shares"``, the turn after tool round ``r`` of the job's sample ``s`` from
        ``turn_seed(r)`` and ``s``. Collective over every rank. Returns this rank's samples in order, their groups,
        the engine's :class:`AgentStats` and its :class:`PullStats` (the groups it ran, its busy seconds)."""
        if self._world_group is None:  # one engine: its share is the whole queue
            start = time.perf_counter()
            samples, groups, stats = self.run_agents(sample_prompts, n, sampling, turn_seed, agent, workers)
            return samples, groups, stats, PullStats(groups=sorted(set(groups)), claims=1,
                                                     busy_s=time.perf_counter() - start)
        self.barrier_before_generate()
        per_rank: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, [list(p) for p in sample_prompts], group=self._world_group)
        flat = [p for prompts in per_rank for p in prompts]
        unique = self._whole_groups(flat, n)
        counts = [len(prompts) for prompts in per_rank]
        offset = sum(counts[:self.rank])
        self._ready()
        self.check_prompt_length(max((len(p) for p in unique), default=0), sampling.max_tokens)
        per_request = sampling.seed is not None and self.seed_mode == "sample"
        own_base = None  # TP > 1 without per-request seeds: every request still gets one (see run_agents)
        if not per_request and len(self.tp_ranks) > 1:
            own_base = (engine_seed(sampling.seed, self.engine_index) if sampling.seed is not None
                        else self.gather_tp(secrets.randbits(SEED_BITS))[0])

        from vllm.inputs import TokensPrompt

        def first_request(g: int):
            seed = prompt_seed(sampling.seed, g, n) if per_request else None
            if own_base is not None:
                seed = prompt_seed(own_turn_seed(own_base, 0), g, n)
            return (list(unique[g]), TokensPrompt(prompt_token_ids=list(unique[g])),
                    self.sampling_params(n, replace(sampling, seed=seed)))

        def continue_request(s: int, round_: int, context: list[int], budget: int):
            base = turn_seed(round_) if per_request else None
            seed = None if base is None else prompt_seed(base, s, 1)
            if own_base is not None:
                seed = prompt_seed(own_turn_seed(own_base, round_), s, 1)
            return (TokensPrompt(prompt_token_ids=list(context)),
                    self.sampling_params(1, replace(sampling, max_tokens=budget, seed=seed)))

        leader = self.rank == self.tp_ranks[0]
        capacity = self.max_num_seqs
        outstanding = self.llm.llm_engine.get_num_unfinished_requests
        pulled_groups: list[int] = []
        start = time.perf_counter()
        with self._engine_rng(sampling.seed):
            queue = self.job_queue(counts, n)

            def pull():
                held = outstanding()
                if held >= capacity + n:
                    return [], False
                want = max(1, math.ceil((capacity + n - held) / n))
                got = self.gather_tp(list(queue.claim(want)) if leader else None)[0]
                pulled_groups.extend(got)
                return [(g, *first_request(g)) for g in got], not got

            samples, stats = run_agent_requests(
                self.request_loop(stream=True), [], n, {}, agent, continue_request=continue_request,
                exchange=self.gather_tp, workers=workers, poll_s=0.01 if len(self.tp_ranks) > 1 else None,
                pull=pull, run_pulled=leader)
        busy = time.perf_counter() - start
        done = self.send_home({g: [samples[g * n + k] for k in range(n)] for g in pulled_groups} if leader else {},
                               counts, n)
        self.drop_job_queue(queue)  # every rank is past its last claim
        mine = range(offset, offset + len(sample_prompts))
        missing = sorted({s // n for s in mine} - done.keys())
        if missing:
            raise RuntimeError(f"groups {missing[:5]} of the job's queue were run by no engine.")
        return ([done[s // n][s % n] for s in mine], [s // n for s in mine], stats,
                PullStats(groups=sorted(pulled_groups), claims=1, busy_s=busy))

    def run_partial_balanced(self, groups: list[InFlightGroup], target: int, sampling: SamplingOptions,
                             version: int, homes: list[int]) -> PartialRun:
        """:meth:`run_partial` on the job's pool with ``rollout_dispatch="balanced"``
        (:mod:`trl_nrollout.rollout.partial_queue`): ``groups`` is the job's pool (the same on every rank: groups in
        flight from earlier steps and every rank's new ones), ``homes[i]`` the engine of the rank that drew group
        ``i``'s prompt. Its unfinished groups form one queue every engine pulls from while it has room; once
        ``target`` groups of the job have finished, every engine stops and aborts the rest, their tokens kept.
        Seeds (``seed_mode="sample"``): each request as :meth:`run_partial` seeds it on the group's home engine
        (:func:`~trl_nrollout.rollout.partial_queue.home_seed_slots`), whichever engine runs it. Collective over every
        rank. Returns the job's pool updated and its finish order (the same on every rank), with this engine's counts
        and the pool indices it ran (``engine_groups``)."""
        if self._world_group is None:  # one engine (or one process): its pool is the job's
            run = self.run_partial(groups, target, sampling, version)
            run.engine_groups = [i for i, g in enumerate(groups) if not g.finished]
            return run
        self._start_pool(groups, sampling)
        per_request = sampling.seed is not None and self.seed_mode == "sample"
        slots = home_seed_slots(groups, homes, sampling.max_tokens)
        bases = {e: engine_seed(sampling.seed, e) for e in set(homes)} if per_request else {}

        def params(i: int, ks: list[int], budget: int):
            seed = bases[homes[i]] + slots[(i, ks[0])] if per_request else None
            return self.sampling_params(len(ks), replace(sampling, max_tokens=budget, seed=seed))

        order, segments = queue_order(groups, homes, self.layout.num_engines)
        finished_before = [i for i, g in enumerate(groups) if g.finished]
        self._pull_calls += 1
        key = f"{self._pull_prefix}/{self._pull_calls}"
        store = self._store
        leader = self.rank == self.tp_ranks[0]
        queue = GroupQueue(store, key, segments, self.engine_index)

        def finish(done: list[int]) -> list[int]:  # job-wide tickets, in the order the store saw the groups
            end = len(finished_before) + int(store.add(f"{key}/finished", len(done)))
            return list(range(end - len(done), end))

        def reached() -> bool:
            return len(finished_before) + int(store.add(f"{key}/finished", 0)) >= target

        share = None if self._tp_group is None else (lambda fn: self.gather_tp(fn() if leader else None)[0])
        capacity = self.max_num_seqs
        with self._engine_rng(sampling.seed):
            updated, tickets, pulled, aborted, steps, new_tokens = run_partial_pulled(
                self.request_loop(stream=True), groups, version, sampling.max_tokens,
                claim=lambda k: [order[p] for p in queue.claim(k)], finish=finish, reached=reached, params=params,
                prompt=partial_prompt, capacity=capacity,
                outstanding=self.llm.llm_engine.get_num_unfinished_requests, share=share)
        parts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, ({i: updated[i] for i in pulled}, tickets) if leader else ({}, {}),
                                            group=self._world_group)
        if self.rank == 0:  # every rank is past its last claim
            for name in [*map(str, range(self.layout.num_engines)), "finished"]:
                store.delete_key(f"{key}/{name}")
        return partial_result(groups, parts, pulled, aborted, steps, new_tokens, finished_before)

    def run_partial_agents_balanced(self, groups: list[InFlightGroup], target: int, sampling: SamplingOptions,
                                    version: int, homes: list[int], agent: AgentCallbacks, workers: int,
                                    quota: tuple[list[int], dict[int, int]] | None = None
                                    ) -> tuple[PartialRun, AgentStats]:
        """:meth:`run_partial_balanced` for tool-calling episodes: the job's pool (the same on every rank) of
        :class:`~trl_nrollout.rollout.partial_tool_episodes.AgentPartialSample` groups is one queue; each engine pulls
        groups while it has room and runs their episodes turn after turn as requests
        (:func:`~trl_nrollout.rollout.partial_tool_episodes.run_partial_agents`), their tools on its first rank (``tools=``
        are the same functions on every rank); once ``target`` groups of the job have finished every engine stops,
        aborts its running turns (tokens kept) and waits for its running tools. Every engine's groups then reach
        every rank (one gather over the job), so each rank holds the job's pool updated, episodes, tool masks,
        log-probs and versions included, and trains its share of the first ``target``.

        Seeds (``seed_mode="sample"``): a request the call starts (a fresh group, a turn an earlier abort stopped) as
        :meth:`run_partial_balanced` seeds it (its home engine's slots); a turn after tool results from the group's
        home, the turn and the sample's place in the pool: never from the engine that runs it. Collective over every
        rank. ``quota``: ``(drawn_by, {rank: count})``, the rank that drew each pool group and how many of its own
        groups each rank trains (environments: a group trains where its environments live); the engines then stop
        once every rank has its count finished, in place of ``target``. Returns the job's :class:`PartialRun`
        (``engine_groups``: the pool indices this engine ran) and this engine's :class:`AgentStats`."""
        leader = self.rank == self.tp_ranks[0]
        if self._world_group is None:  # one engine: its pool is the job's
            run, stats = self.run_partial_agents(groups, target, sampling, version, agent, workers,
                                                 owns=lambda g: leader)
            run.engine_groups = [i for i, g in enumerate(groups) if not g.finished]
            return run, stats
        self._start_pool(groups, sampling)
        seeded = sampling.seed is not None and self.seed_mode == "sample"
        slots = home_seed_slots(groups, homes, sampling.max_tokens)
        bases = {e: engine_seed(sampling.seed, e) for e in set(homes)} if seeded else {}
        own = None  # TP > 1 without per-request seeds: every request still gets one (see run_partial_agents)
        if not seeded and len(self.tp_ranks) > 1:
            own = (engine_seed(sampling.seed, self.engine_index) if sampling.seed is not None
                   else self.gather_tp(secrets.randbits(SEED_BITS))[0])
        width = max((g.n for g in groups), default=1)

        def make_params(n: int, budget: int, slot: int, request):
            seed = None if own is None else own + slot
            if seeded:
                base, first = bases[homes[request.group]], request.samples[0]
                seed = (base + slots[(request.group, first)] if request.started
                        else prompt_seed(own_turn_seed(base, request.turn), request.group * width + first, 1))
            return self.sampling_params(n, replace(sampling, max_tokens=budget, seed=seed))

        order, segments = queue_order(groups, homes, self.layout.num_engines)
        finished_before = [i for i, g in enumerate(groups) if g.finished]
        self._pull_calls += 1
        key = f"{self._pull_prefix}/{self._pull_calls}"
        store = self._store
        queue = GroupQueue(store, key, segments, self.engine_index)
        ask = (lambda fn: fn()) if self._tp_group is None else (lambda fn: self.gather_tp(fn() if leader else None)[0])
        capacity = self.max_num_seqs
        outstanding = self.llm.llm_engine.get_num_unfinished_requests
        pulled: list[int] = []
        tickets: dict[int, int] = {}

        def pull() -> tuple[list[int], bool]:
            held = outstanding()
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

        from vllm.inputs import TokensPrompt

        from trl_nrollout.rollout.partial_tool_episodes import run_partial_agents

        with self._engine_rng(sampling.seed):
            run, stats = run_partial_agents(
                self.request_loop(stream=True), groups, target, version, agent, make_params=make_params,
                prompt=lambda ids: TokensPrompt(prompt_token_ids=list(ids)), owns=lambda g: leader,
                exchange=self.gather_tp, workers=workers, poll_s=0.01, pull=pull, finished=finished,
                reached=reached)
        parts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, ({i: run.groups[i] for i in pulled}, tickets) if leader
                                            else ({}, {}), group=self._world_group)
        if self.rank == 0:  # every rank is past its last claim
            for name in [*map(str, range(self.layout.num_engines)), "finished",
                         *(f"home/{r}" for r in (quota[1] if quota is not None else ()))]:
                store.delete_key(f"{key}/{name}")
        return partial_result(groups, parts, pulled, run.aborted, run.engine_steps, run.new_tokens,
                              finished_before), stats

    @contextlib.contextmanager
    def balanced_calls(self):
        """Within: every :meth:`generate_expanded` call (a ``rollout_func``'s) is a balanced rollout, the job's groups
        of that call (every rank calls it, as a collective) in one queue the engines pull from. Yields the list that
        collects each call's ``(PullStats, samples of this rank, n)``."""
        calls: list = []
        self._balanced_calls = calls
        try:
            yield calls
        finally:
            self._balanced_calls = None

    def job_queue(self, counts: list[int], n: int) -> GroupQueue:
        """A fresh queue of the job's groups (``counts``: each rank's samples), this engine's segment first; every
        rank calls it (a collective's order), rank 0 drops its counters in :meth:`drop_job_queue`."""
        self._pull_calls += 1
        return GroupQueue(self._store, f"{self._pull_prefix}/{self._pull_calls}", self._segments(counts, n),
                          self.engine_index)

    def drop_job_queue(self, queue: GroupQueue) -> None:
        """Delete ``queue``'s counters from the store (rank 0, once every rank is past its last claim)."""
        if self.rank == 0:
            for seg in range(len(queue.segments)):
                self._store.delete_key(f"{queue.key}/{seg}")

    def gather_job(self, obj) -> list:
        """``obj`` of every rank of the job, in rank order (``[obj]`` with one engine: see :meth:`gather_tp`).
        Collective over every rank."""
        if self._world_group is None:
            return self.gather_tp(obj)
        out: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj, group=self._world_group)
        return out

    def _segments(self, counts: list[int], n: int) -> list[range]:
        """Each engine's own groups (those whose first sample belongs to one of its ranks), in job order."""
        bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]
        total = bounds[-1] // n
        firsts = [bounds[ranks[0]] for ranks in self.layout.engine_ranks] + [bounds[-1]]
        return [range(min(-(-firsts[e] // n), total), min(-(-firsts[e + 1] // n), total))
                for e in range(self.layout.num_engines)]

    def send_home(self, held: dict[int, object], counts: list[int], n: int) -> dict[int, object]:
        """Each engine's results ``held`` (by global group, on its leader) to the ranks that own the group's samples
        (rank ``r`` owns the ``counts[r]`` samples after those of the ranks before it): one exchange of every rank
        with every rank (:func:`exchange_objects`), each rank receiving only its own groups, nothing padded.
        Returns this rank's groups."""
        bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]

        def owners(g: int) -> list[int]:
            return [r for r in range(len(counts)) if bounds[r] < (g + 1) * n and g * n < bounds[r + 1]]

        parts: list[dict] = [{} for _ in counts]
        for g, value in held.items():  # only an engine's leader holds results
            for r in owners(g):
                parts[r][g] = value
        received: dict[int, object] = {}
        for part in exchange_objects([part or None for part in parts], self._world_group):
            received.update(part or {})
        return received

    def _whole_groups(self, flat: list[list[int]], n: int) -> list[list[int]]:
        """The engine's prompts, one per group, from its samples' prompts ``flat`` (each repeated ``n`` times
        consecutively); a clear error where they are not whole groups."""
        if len(flat) % n:
            raise ValueError(f"the {len(flat)} samples of engine {self.engine_index} are not whole groups of n={n}.")
        unique = flat[::n]
        for g, p in enumerate(unique):
            if any(flat[g * n + k] != p for k in range(n)):
                raise ValueError(
                    f"samples {g * n}..{g * n + n - 1} of engine {self.engine_index} are not {n} copies of one "
                    f"prompt: prompts must be repeated n={n} times consecutively (TRL's RepeatSampler order)."
                )
        return unique

    # ------------------------------------------------------------------ for drivers above the engine (rollout/pool.py)
    @property
    def balances_job(self) -> bool:
        """Whether this engine pulls from a job-wide queue (``rollout_dispatch="balanced"`` over several engines in
        one process group): :meth:`gather_job`, :meth:`job_queue` and :meth:`job_counter` then span the job."""
        return self._world_group is not None

    def job_counter(self, name: str) -> Callable[[int], int]:
        """A job-wide counter ``name`` in the process group's store (every rank reaches it): ``add(k)`` adds ``k``
        atomically and returns the total (``add(0)`` reads it). Only while :attr:`balances_job`."""
        key = f"{self._pull_prefix}/{name}"
        return lambda k: int(self._store.add(key, k))
