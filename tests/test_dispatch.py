"""``rollout_dispatch``: which engine generates which group. The job's queue (pure), the config's and trainer's
refusals, and real vLLM engines in two processes pulling from one queue: the same samples as fixed shares, each
back on its own rank, work moved off a slow engine."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, run_cmd, torchrun
from trl_nrollout.rollout.dispatch import GroupQueue, LocalStore


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=4),
       claims=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=80))
def test_claims_hand_out_each_group_once_own_segment_first(sizes, claims):
    """Engines claim in any interleaving and any sizes: each group goes to one engine once, in its segment's order;
    an engine takes its own segment's groups before any other's (it steals only once its own are all handed out);
    when everyone keeps claiming, every group is handed out."""
    bounds = [sum(sizes[:e]) for e in range(len(sizes) + 1)]
    segments = [range(bounds[e], bounds[e + 1]) for e in range(len(sizes))]
    store = LocalStore()
    queues = [GroupQueue(store, "k", segments, home) for home in range(len(sizes))]
    got: list[list[int]] = [[] for _ in sizes]
    for engine, k in claims:
        engine %= len(sizes)
        claim = list(queues[engine].claim(k))
        assert len(claim) <= k
        assert claim == list(range(claim[0], claim[0] + len(claim))) if claim else True  # in order
        got[engine] += claim
    for _ in range(bounds[-1] + 1):  # drain
        for engine, q in enumerate(queues):
            got[engine] += list(q.claim(3))
    flat = sorted(g for groups in got for g in groups)
    assert flat == list(range(bounds[-1]))
    for engine, groups in enumerate(got):
        own = [g in segments[engine] for g in groups]
        assert own == sorted(own, reverse=True)  # own groups first, then stolen ones
    for q in queues:
        assert list(q.claim(2)) == []


def test_config_refuses_what_a_balanced_dispatch_cannot_do():
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.errors import InputError

    base = dict(output_dir="/tmp/x", report_to="none", use_cpu=True)
    with pytest.raises(InputError, match=r"rollout_dispatch='least'.*must be one of \['shares', 'balanced'\]"):
        NRolloutConfig(**base, rollout_dispatch="least")
    with pytest.raises(InputError, match="needs vLLM engines.*rollout_backend='hf'.*rollout_dispatch='shares'"):
        NRolloutConfig(**base, rollout_dispatch="balanced", rollout_backend="hf")
    # partial rollouts run on the balanced queue (one job-wide pool: tests below)
    assert NRolloutConfig(**base, rollout_dispatch="balanced", rollout_partial=True).rollout_partial
    assert NRolloutConfig(**base, rollout_dispatch="balanced").rollout_dispatch == "balanced"


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory, tiny_model_path):
    """Two processes, one engine each (TP=1); engine 0 slowed; fixed shares, then a balanced queue seeded and
    unseeded."""
    out = tmp_path_factory.mktemp("dispatch")
    run_cmd([*torchrun(2), str(ROOT / "tests/dist/dispatch_dist.py"), "1", tiny_model_path, str(out)], timeout=500,
            env={"ACCELERATE_USE_CPU": None})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_balanced_queue_samples_what_fixed_shares_sample(balanced_runs):
    """Each group is seeded from its place in the job, whichever engine runs it: every rank gets back the samples
    of its own prompts, in order, token for token and log-prob for log-prob the fixed shares' samples."""
    for res in balanced_runs:
        shares, balanced = res["shares"], res["balanced"]
        assert balanced["prompt_ids"] == res["prompts"] == shares["prompt_ids"]
        assert balanced["group_index"] == shares["group_index"]
        assert balanced["completion_ids"] == shares["completion_ids"]
        assert len({len(c) for c in balanced["completion_ids"]}) > 1  # the stops apply: lengths differ
        for got, want in zip(balanced["logprobs"], shares["logprobs"]):
            assert got == pytest.approx(want, abs=1e-5)
        assert balanced["finish_reasons"] == shares["finish_reasons"]


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_tool_episodes_from_a_balanced_queue_equal_the_fixed_shares_episodes(balanced_runs):
    """Tool-calling episodes request by request (a scripted agent) pulled from one balanced queue, engine 0 slowed:
    the fast engine runs some of rank 0's groups' episodes (their tools on its rank), and every rank gets back its own
    prompts' episodes, in order, turn for turn and token for token the fixed shares' (each request is seeded from
    its group or sample in the job, whichever engine runs it), with their tool masks."""
    engines = {res["engine_index"]: res["agents_balanced"]["engine_groups"] for res in balanced_runs}
    total = sum(len(res["prompts"]) for res in balanced_runs) // 3
    assert sorted(g for groups in engines.values() for g in groups) == list(range(total))
    assert set(engines[1]) & set(range(total // 2)), engines  # rank 0's groups ran on engine 1
    for res in balanced_runs:
        shares, balanced = res["agents_shares"], res["agents_balanced"]
        assert balanced["prompt_ids"] == res["prompts"] == shares["prompt_ids"]
        assert balanced["group_index"] == shares["group_index"]
        assert max(shares["turns"]) > 1, "the script should call the tool"
        for key in ("completion_ids", "tool_mask", "turns"):
            assert balanced[key] == shares[key], key
        for got, want in zip(balanced["logprobs"], shares["logprobs"]):
            assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["balanced", "unseeded"])
def test_a_slow_engine_hands_its_groups_to_the_fast_one(balanced_runs, case):
    """Engine 0 takes longer per step: the fast engine steals groups of rank 0's prompts and runs more of the
    job's groups; every group is generated once, by one engine; every rank still gets its own prompts' samples.
    With max_num_seqs = n each engine runs one group and keeps one waiting: right after a claim it never holds a
    group more than that (it pulls as it frees room, never its whole share at once)."""
    per_engine = {res["engine_index"]: res[case]["engine_groups"] for res in balanced_runs}
    for res in balanced_runs:
        assert res[case]["engine_groups"] and 2 * 3 <= res[case]["peak_outstanding"] < 3 * 3
    total = sum(len(res["prompts"]) for res in balanced_runs) // 3
    every = sorted(g for groups in per_engine.values() for g in groups)
    assert every == list(range(total))
    rank0_groups = set(range(total // 2))
    assert set(per_engine[1]) & rank0_groups, per_engine
    assert len(per_engine[1]) > len(per_engine[0]), per_engine
    for res in balanced_runs:
        assert res[case]["prompt_ids"] == res["prompts"]
        assert len(res[case]["completion_ids"]) == len(res["prompts"])
    assert balanced_runs[0]["store_keys_left"] == [False] * 4  # the queue's counters were removed


def _by_key(groups: list[dict]) -> dict[tuple, dict]:
    return {tuple(g["key"]): g for g in groups}


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_partial_rollouts_pull_the_jobs_pool_from_one_queue(balanced_runs):
    """rollout_partial with a balanced queue, engine 0 slowed: the job's pool (every rank's groups) is one queue.
    Both ranks hold the same pool and finish order afterwards; half the job's groups finished whole and train, the
    rest stays in flight with its tokens, each tagged with its version; the fast engine ran some of rank 0's groups.
    Every request is seeded as fixed shares seeds it on the group's home engine, whichever engine runs it: each
    sample is a prefix of (or equal to) the same sample run to its end under shares. The pool continued at version 1
    with engine 0 arriving late: engine 1 pulls and continues the samples engine 0 stopped (leftovers are not kept
    per engine); every group finishes, each token's version is the call that sampled it.
    Mutations tried: a request seeded by the engine that runs it (not its group's home) -> the prefix check fails;
    leftovers queued under the engine that last ran them and not stolen -> the continuation check fails."""
    r0, r1 = balanced_runs
    total = len(r0["partial_shares"]) + len(r1["partial_shares"])
    shares = {**_by_key(r0["partial_shares"]), **_by_key(r1["partial_shares"])}
    for name in ("partial_balanced", "partial_continued"):
        for key in ("groups", "finish_order"):
            assert r0[name][key] == r1[name][key], (name, key)  # one job pool, the same on every rank
    first, second = r0["partial_balanced"], r0["partial_continued"]
    groups = first["groups"]
    assert len(groups) == total
    trained = [groups[i] for i in first["finish_order"][:total // 2]]
    assert all(s["finish_reason"] is not None for g in trained for s in g["samples"])  # whole groups
    assert r0["partial_balanced"]["aborted"] + r1["partial_balanced"]["aborted"] > 0
    ran = {res["engine_index"]: set(res["partial_balanced"]["engine_groups"]) for res in balanced_runs}
    assert ran[1] & set(range(total // 2)), ran  # the fast engine ran some of rank 0's groups
    assert not ran[0] & ran[1]
    for g in groups:
        ref = shares[tuple(g["key"])]
        for got, want in zip(g["samples"], ref["samples"]):
            length = len(got["token_ids"])
            assert got["token_ids"] == want["token_ids"][:length], g["key"]
            assert got["logprobs"] == pytest.approx(want["logprobs"][:length], abs=1e-5)
            assert got["versions"] == [0] * length
            if got["finish_reason"] is not None:
                assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == want["finish_reason"]
    stopped_on_0 = {tuple(groups[i]["key"]) for i in ran[0]
                    if any(s["finish_reason"] is None and s["token_ids"] for s in groups[i]["samples"])}
    continued = second["groups"]
    ran_second = {res["engine_index"]: res["partial_continued"]["engine_groups"] for res in balanced_runs}
    moved = {tuple(continued[i]["key"]) for i in ran_second[1]} & stopped_on_0
    assert moved, (ran_second, stopped_on_0)  # stopped on engine 0, continued on engine 1
    assert all(s["finish_reason"] is not None for g in continued for s in g["samples"])
    for g in continued:
        before = _by_key(groups)[tuple(g["key"])]
        for s, s0 in zip(g["samples"], before["samples"]):
            assert s["token_ids"][:len(s0["token_ids"])] == s0["token_ids"]  # its tokens kept, then continued
            assert s["versions"] == [0] * len(s0["token_ids"]) + [1] * (len(s["token_ids"]) - len(s0["token_ids"]))
            assert len(s["logprobs"]) == len(s["token_ids"])
    assert r0["partial_keys_left"] == [False] * 12  # the queues' and the finish counters' keys were removed


SUFFIX = [9, 41, 42]  # the scripted agent's rendered tool result (tests/dist/dispatch_dist.py)


def _check_episode(s: dict, versions: set[int]) -> None:
    """One pool sample's episode: tokens, mask, log-probs and versions align; the masked tokens are exactly the
    rendered tool results (one per tool round continued), log-prob 0; the model's tokens have real log-probs."""
    e = s["episode"]
    if e is None:  # still in its first turn
        assert not s["versions"] and len(s["turn_ids"]) == len(s["turn_versions"]) == len(s["turn_logprobs"])
        return
    assert len(e["completion_ids"]) == len(e["tool_mask"]) == len(e["logprobs"]) == len(s["versions"])
    masked = [t for t, m in zip(e["completion_ids"], e["tool_mask"]) if m == 0]
    results = e["turns"] - 1 + (s["base"] is not None and not s["done"])  # rounds continued, and one in progress
    assert masked == SUFFIX * results, (masked, e["turns"])
    assert all(lp == 0.0 for lp, m in zip(e["logprobs"], e["tool_mask"]) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(e["logprobs"], e["tool_mask"]) if m == 1)
    assert set(s["versions"]) | set(s["turn_versions"]) <= versions


def _first_turn(s: dict) -> list[int]:
    """A sample's first-turn tokens so far (its whole first turn once it ended)."""
    e = s["episode"]
    if e is None:
        return list(s["turn_ids"])
    mask = e["tool_mask"]
    return e["completion_ids"][:mask.index(0) if 0 in mask else len(mask)]


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_partial_tool_episodes_pull_the_jobs_pool_and_reach_every_rank(balanced_runs):
    """rollout_partial with tools on a balanced queue (engine 0 slowed): the job's pool of tool-calling episodes is
    one queue; each engine runs its pulled groups' turns and tools, and afterwards both ranks hold the same pool and
    finish order, every episode with its tool mask (exactly the rendered results masked), log-probs and versions.
    Half the job's groups trained whole; the fast engine ran some of rank 0's groups; a fresh group's first turn is
    seeded from its home engine, so it is (a prefix of) the first turn fixed shares sample, whichever engine ran it.
    Continued at version 1 with engine 0 late: engine 1 continues episodes engine 0 stopped, each keeping its
    tokens, mask and versions (0 before, 1 after), and every group finishes.
    Mutations tried: the tool mask left out of the gather (the pulled groups' episodes not sent to the other ranks:
    ``parts`` of the leader empty) -> the same-pool check fails; first turns seeded by the engine that runs them
    (``homes[...]`` -> this engine) -> the first-turn check fails."""
    r0, r1 = balanced_runs
    total = len(r0["partial_agents_shares"]) + len(r1["partial_agents_shares"])
    shares = {**_by_key(r0["partial_agents_shares"]), **_by_key(r1["partial_agents_shares"])}
    for name in ("partial_agents_balanced", "partial_agents_continued"):
        for key in ("groups", "finish_order"):
            assert r0[name][key] == r1[name][key], (name, key)  # one job pool, the same on every rank
    first, second = r0["partial_agents_balanced"], r0["partial_agents_continued"]
    groups = first["groups"]
    assert len(groups) == total
    trained = [groups[i] for i in first["finish_order"][:total // 2]]
    assert all(s["done"] for g in trained for s in g["samples"])  # whole groups
    assert max(s["episode"]["turns"] for g in trained for s in g["samples"]) > 1, "no tool was called"
    assert first["aborted"] + r1["partial_agents_balanced"]["aborted"] > 0
    ran = {res["engine_index"]: set(res["partial_agents_balanced"]["engine_groups"]) for res in balanced_runs}
    assert ran[1] & set(range(total // 2)), ran  # the fast engine ran some of rank 0's groups
    assert not ran[0] & ran[1]
    for g in groups:
        ref = shares[tuple(g["key"])]
        for got, want in zip(g["samples"], ref["samples"]):
            _check_episode(got, {0})
            mine, theirs = _first_turn(got), _first_turn(want)
            assert mine == theirs[:len(mine)], g["key"]
            if got["episode"] is not None:
                assert mine == theirs, g["key"]
    stopped_on_0 = {tuple(groups[i]["key"]) for i in ran[0] if not all(s["done"] for s in groups[i]["samples"])}
    continued = second["groups"]
    ran_second = {res["engine_index"]: res["partial_agents_continued"]["engine_groups"] for res in balanced_runs}
    moved = {tuple(continued[i]["key"]) for i in ran_second[1]} & stopped_on_0
    assert moved, (ran_second, stopped_on_0)  # stopped on engine 0, continued on engine 1
    assert all(s["done"] for g in continued for s in g["samples"])
    before = _by_key(groups)
    for g in continued:
        for s, s0 in zip(g["samples"], before[tuple(g["key"])]["samples"]):
            _check_episode(s, {0, 1})
            e, e0 = s["episode"], s0["episode"]
            kept = (e0["completion_ids"] if e0 else []) + s0["turn_ids"]
            assert e["completion_ids"][:len(kept)] == kept  # its tokens kept, then continued
            if e0 is not None:
                assert e["tool_mask"][:len(e0["tool_mask"])] == e0["tool_mask"]
            old = s0["versions"] + s0["turn_versions"]
            assert s["versions"] == old + [1] * (len(s["versions"]) - len(old))
