"""Rollout ranks (``rollout_ranks``): processes of one launch that only generate, the others train.

The arithmetic of the split, the job slices and the weight buckets are properties (hypothesis); the options a split
cannot serve are refused with the option and a fix (config, plan); real launches (2 trainers + 1 rollout rank, the
warm launcher of the suite) check that a synchronous run samples and learns what a colocated run does, that the
engine holds the trainer's weights after every transfer (ZeRO-3, LoRA), that one-step-off-policy samples one step
stale, that a 2-"node" launch puts the rollout rank on its own node, and that a dead or frozen rank stops the launch
within a bounded time with a message naming it. The reward curves and step times are in
``benchmarks/rollout_ranks.py`` (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ACCELERATE_LAUNCH, ENV, RECIPE, ROOT, launch_two_nodes
from trl_nrollout.cli import main as cli_main
from trl_nrollout.errors import InputError
from trl_nrollout.rollout.bridge import (
    ROLLOUT,
    TRAIN,
    Bridge,
    Roles,
    decode_value,
    encode_value,
    roles_refusal,
)
from trl_nrollout.rollout.engines.vllm_process import barrier_scope
from trl_nrollout.rollout.ranks.buckets import job_slice, pack_bucket, unpack_bucket
from trl_nrollout.rollout.ranks.client import job_agent
from trl_nrollout.rollout.ranks.partial import TopUp, group_fields, partial_entry
from trl_nrollout.rollout.types import JobResult


# ---------------------------------------------------------------------------------------------- the arithmetic
@st.composite
def launches(draw):
    nodes = draw(st.integers(1, 4))
    local = draw(st.integers(1, 8))
    world = nodes * local
    tp = draw(st.sampled_from([1, 2, 4]))
    r = draw(st.integers(0, world))
    return world, local, tp, r


@settings(max_examples=300, deadline=None)
@given(launches())
def test_roles_split_the_launch_into_two_worlds(launch):
    """Every process has one role; trainers are the first ranks (rank 0 among them: it logs and saves); each role's
    ranks are numbered 0.. within their world and map back; a role's processes per node are the same on every node
    it occupies (what accelerate and vLLM read as LOCAL_WORLD_SIZE), and an engine's ranks share a node."""
    world, local, tp, r = launch
    why = roles_refusal(world, r, local, tp)
    if r == 0 or r >= world or r % tp or (world > local and r % local) or (tp > 1 and local % tp and world > local):
        assert (why is None) == (r == 0)
        return
    assert why is None
    roles = Roles(world, r, local)
    assert roles.role(0) == TRAIN and roles.trainers == world - r
    for role in (TRAIN, ROLLOUT):
        ranks = [g for g in range(world) if roles.role(g) == role]
        assert [roles.role_rank(g) for g in ranks] == list(range(len(ranks)))
        assert all(roles.global_rank(role, roles.role_rank(g)) == g for g in ranks)
        assert all(roles.role_size(g) == len(ranks) for g in ranks)
        per_node = {}
        for g in ranks:
            per_node.setdefault(g // local, []).append(g)
        assert {len(v) for v in per_node.values()} == {roles.role_local_world(ranks[0])}
    rollout = roles.rollout_globals()
    assert rollout == list(range(world - r, world))
    for e in range(r // tp):  # an engine's ranks on one node
        assert len({g // local for g in rollout[e * tp:(e + 1) * tp]}) == 1


def test_layouts_that_cannot_split_are_refused_with_a_fix():
    assert "at least 2 processes" in roles_refusal(1, 1, 1)
    assert "leaves no process to train" in roles_refusal(3, 3, 3) and "use at most 2" in roles_refusal(3, 3, 3)
    assert "use rollout_ranks=2" in roles_refusal(6, 3, 6, rollout_tp_size=2)
    assert "use a multiple of 4" in roles_refusal(8, 2, 4)  # a node would hold both worlds
    assert "must be >= 0" in roles_refusal(4, -1, 4)
    assert roles_refusal(8, 4, 4, rollout_tp_size=2) is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.sampled_from([1, 2, 4]), st.integers(1, 4))
def test_job_slices_cover_the_job_with_whole_groups_per_engine(n, groups, tp, engines):
    """The rollout ranks' slices of a job partition it in order; each engine's samples are whole groups (a group's
    seed is its index in the job), engines' counts differ by at most one group, and an engine's ranks split its
    samples evenly."""
    total, r = n * groups, engines * tp
    slices = [job_slice(total, n, r, tp, k) for k in range(r)]
    assert slices[0][0] == 0 and slices[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    per_engine = [(slices[e * tp][0], slices[e * tp + tp - 1][1]) for e in range(engines)]
    assert all(first % n == 0 and last % n == 0 for first, last in per_engine)
    counts = [(last - first) // n for first, last in per_engine]
    assert max(counts) - min(counts) <= 1
    for e in range(engines):
        sizes = [b - a for a, b in slices[e * tp:(e + 1) * tp]]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]),
                          st.lists(st.integers(1, 5), min_size=0, max_size=3)), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_a_bucket_travels_as_bytes_and_comes_back_equal(spec, seed):
    """A bucket packed into one byte buffer (what the weights group broadcasts) unpacks to tensors equal in name,
    shape, dtype and every bit, whatever the mix of dtypes (each tensor aligned for its view)."""
    gen = torch.Generator().manual_seed(seed)
    bucket = [(f"layer.{i}", (torch.randn(shape, generator=gen) * 100).to(dtype)) for i, (dtype, shape) in
              enumerate(spec)]
    buf, layout = pack_bucket(bucket)
    assert buf.dtype == torch.uint8
    back = unpack_bucket(buf.clone(), layout)
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
                          st.lists(st.integers(1, 5), min_size=0, max_size=3)), min_size=1, max_size=5),
       st.sampled_from([torch.bfloat16, torch.float16]), st.booleans())
def test_a_bucket_is_cast_to_the_engines_dtype_before_it_travels(spec, dtype, reuse):
    """Floating tensors travel in the engine's dtype (FSDP2 / fp32 masters hand out float32: half the bytes), equal
    to the trainer's cast; integer tensors unchanged; a reused buffer large enough is packed in place."""
    bucket = [(f"w.{i}", (torch.randn(shape) * 10).to(dt)) for i, (dt, shape) in enumerate(spec)]
    pool = torch.empty(1 << 12, dtype=torch.uint8) if reuse else None
    buf, layout = pack_bucket(bucket, dtype, out=pool)
    if reuse:
        assert buf.data_ptr() == pool.data_ptr()
    for (_, a), (_, b) in zip(bucket, unpack_bucket(buf.clone(), layout)):
        expected = a.to(dtype) if a.is_floating_point() else a
        assert b.dtype == expected.dtype and torch.equal(b, expected)
    assert buf.numel() <= sum(-(-a.numel() * (2 if a.is_floating_point() else 8) // 16) * 16 for _, a in bucket)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(2, 64))
def test_a_value_larger_than_a_part_is_split_and_joined_back(data, chunk):
    """Every value written to the store is at most ``chunk`` bytes; the parts join back to the data."""
    values = encode_value(data, chunk)
    assert all(len(v) <= max(chunk, 9) for v in values)
    assert decode_value(values[0], values[1:]) == data
    if len(data) + 1 > chunk:
        assert len(values) == 1 + -(-len(data) // chunk)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=6))
def test_a_job_result_travels_as_flat_arrays_and_comes_back_equal(rows):
    """A rollout rank's samples (token ids, log-probs, finish reasons) as flat arrays give back every sample."""
    lps = [[-float(t % 97) / 7 for t in r] for r in rows]
    reasons = ["stop" if len(r) % 2 else "length" for r in rows]
    back = JobResult.of(rows, lps, reasons, 1.5, 3).rows()
    assert [c for c, _, _ in back] == rows and [f for _, _, f in back] == reasons
    for (_, lp, _), want in zip(back, lps):
        assert lp == pytest.approx(want, abs=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=6))
def test_tool_episodes_from_a_rollout_rank_keep_each_samples_mask_and_messages(rows):
    """An agent job's answer (rollout_multi_turn='requests' on rollout ranks): each sample's tool mask (one flat
    int8 array for the job) and its messages and counts come back, pickled as the bridge sends them, for the right
    sample. Mutation: pack_extras slicing each mask one token late -> a sample gets its neighbour's mask."""
    import pickle

    from trl_nrollout.rollout.episodes.tools import AgentSample
    from trl_nrollout.rollout.ranks.episodes import episode_extras, sum_stats

    masks = [[(t + k) % 2 for k, t in enumerate(r)] for r in rows]
    samples = [AgentSample([1, 2], r, m, [-0.5] * len(r), "stop", [{"role": "assistant", "content": f"s{i}"}],
                           turns=i + 1, tool_calls=i, tool_failures=i % 2)
               for i, (r, m) in enumerate(zip(rows, masks))]
    result = pickle.loads(pickle.dumps(JobResult.of(rows, [s.logprobs for s in samples], ["stop"] * len(rows), 1.0,
                                                    2, extras=episode_extras(samples), agent_stats=(3, 1, 0.5, 0.2, 4))))
    back = result.extras()
    assert [e["tool_mask"] for e in back] == masks and [c for c, _, _ in result.rows()] == rows
    assert [e["completions"][0]["content"] for e in back] == [f"s{i}" for i in range(len(rows))]
    assert [(e["turns"], e["tool_calls"], e["tool_failures"]) for e in back] == [
        (i + 1, i, i % 2) for i in range(len(rows))]
    assert JobResult.of(rows, [[0.0] * len(r) for r in rows], ["stop"] * len(rows), 1.0, 2).extras() == [None] * len(
        rows)
    stats = sum_stats([result.agent_stats, None, (1, 1, 1.5, 0.4, 2)])  # steps summed, seconds a rank's mean
    assert (stats.engine_steps, stats.steps_with_tools, stats.requests) == (4, 2, 6)
    assert (stats.idle_s, stats.tool_s) == pytest.approx((1.0, 0.3))


def test_a_result_over_the_stores_limit_crosses_a_real_store(monkeypatch):
    """torch's libuv store (the launcher's) drops a connection that sets a value over 8 MiB; a job's samples at a
    user's size (64 prompts x 8 x 4k tokens) are more: the bridge writes them in parts. Mutation: parts of 16 MiB
    -> the store resets the connection and the test fails."""
    from datetime import timedelta

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=20))
    client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                        timeout=timedelta(seconds=20))
    roles = Roles(world=2, rollout_ranks=1, local_world=2)
    writer = Bridge(roles, 1, torch.distributed.PrefixStore("b/", client), None, 30.0)
    reader = Bridge(roles, 0, torch.distributed.PrefixStore("b/", server), None, 30.0)
    try:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 150_000, (64 * 8, 4096), generator=gen).tolist()
        result = JobResult.of(tokens, [[-0.5] * 4096] * len(tokens), ["length"] * len(tokens), 9.0, 2)
        assert result.tokens.nbytes + result.logprobs.nbytes > 8 << 20
        writer.put("out/0/0", result)
        back = reader.take("out/0/0", 1, "the job")
        assert back.rows()[-1][0] == tokens[-1] and back.version == 2
        assert not server.check(["b/out/0/0"]) and not server.check(["b/out/0/0#1"])  # read once, removed
    finally:
        writer.finish()
        reader.finish()


def test_a_tp_engine_on_rollout_ranks_waits_for_its_own_ranks_only():
    """Colocated TP engines on GPUs meet on the whole default group before generating (training collectives may be
    in flight); on rollout ranks only the engine's own ranks meet (a barrier over every rollout rank made the
    engines start every job in lockstep); none on CPU, TP 1 or one process. (The barrier runs on GPUs only: this is
    the rule the engine applies.)"""
    assert barrier_scope(2, cpu=False, distributed=True, rollout_rank=False) == "world"
    assert barrier_scope(2, cpu=False, distributed=True, rollout_rank=True) == "tp"
    assert barrier_scope(1, cpu=False, distributed=True, rollout_rank=True) is None
    assert barrier_scope(2, cpu=True, distributed=True, rollout_rank=False) is None
    assert barrier_scope(2, cpu=False, distributed=False, rollout_rank=False) is None


def _exchange_worker(rank: int, world: int, path: str) -> None:
    from trl_nrollout.rollout.engines.vllm_process import exchange_objects

    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    # rank r sends rank d a list of r * 1000 + d numbers (nothing to itself when r == d == 1)
    out = [None if (rank == 1 and d == 1) else list(range(rank * 1000 + d)) for d in range(world)]
    got = exchange_objects(out)
    for src, value in enumerate(got):
        if src == 1 and rank == 1:
            assert value is None
        else:
            assert value == list(range(src * 1000 + rank)), (rank, src)
    torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_samples_go_home_in_one_exchange_each_rank_its_own(tmp_path):
    """Balanced dispatch sends each rank only its groups, uneven sizes, in one all-to-all (3 gloo processes):
    every rank receives exactly what each sender meant for it. Mutation: swap the two split lists -> wrong sizes,
    the test fails."""
    torch.multiprocessing.spawn(_exchange_worker, args=(3, str(tmp_path / "rdv")), nprocs=3, join=True)


def test_the_engines_memory_default_follows_where_they_live(tmp_path):
    """Colocated engines keep TRL's 0.3 of the device (not reported as a setting the HF engine would leave unused);
    a value the user sets is theirs (reported); rollout ranks default to 0.9 (the config resolves it before the
    split: :data:`ROLLOUT_RANK_GPU_MEMORY_UTILIZATION`, which ``plan`` uses too)."""
    from trl_nrollout import NRolloutConfig

    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.vllm_gpu_memory_utilization == 0.3
    assert not any(s.startswith("vllm_gpu_memory_utilization") for s in args.vllm_engine_settings())
    mine = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", vllm_gpu_memory_utilization=0.5)
    assert "vllm_gpu_memory_utilization=0.5" in mine.vllm_engine_settings()
    from trl_nrollout.plan.roles import ROLLOUT_RANK_GPU_MEMORY_UTILIZATION

    assert ROLLOUT_RANK_GPU_MEMORY_UTILIZATION == 0.9


# ---------------------------------------------------------------------------------------------- partial jobs
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(1, 4))
@settings(max_examples=30, deadline=None)
def test_a_partial_jobs_entries_join_in_rank_order_and_its_groups_fields_reach_every_sample(groups, n):
    """The trainers' partial entries join into the job's (each trainer's rows, prompts and top-ups after those of
    the trainers before it; the restored pool only trainer rank 0 holds), and a rollout rank's answer, which names a
    group's row, prompt and ids on its first sample only, gives every sample its group's. Mutation tried: the
    fields not carried forward -> later samples lose their rows."""
    entries = [partial_entry(3, 0, [{"t": t, "g": g} for g in range(c)], [f"p{t}.{g}" for g in range(c)],
                             [TopUp({"x": t}, "x", [t])], max_staleness=1,
                             oversample=1.0, snapshot=False, restore=["pool"] if t == 0 else None)
               for t, c in enumerate(groups)]
    job = job_agent(entries)
    assert job.rows == [{"t": t, "g": g} for t, c in enumerate(groups) for g in range(c)]
    assert job.prompts == [f"p{t}.{g}" for t, c in enumerate(groups) for g in range(c)]
    assert [e.row["x"] for e in job.extra] == list(range(len(groups))) and job.restore == ["pool"]
    assert pickle.loads(pickle.dumps(job)) == job  # it travels pickled in the job's message
    fields = []
    for i, row in enumerate(job.rows):
        fields += [{"oldest": k, **({"row": row, "prompt": job.prompts[i], "prompt_ids": [i], "images": False}
                                    if k == 0 else {})} for k in range(n)]
    full = group_fields(fields)
    assert [f["row"] for f in full] == [row for row in job.rows for _ in range(n)]
    assert [f["prompt_ids"] for f in full] == [[i] for i in range(len(job.rows)) for _ in range(n)]
    assert [f["oldest"] for f in full] == [k for _ in job.rows for k in range(n)]


@pytest.mark.parametrize("strategy,save_steps,span,max_steps,saving", [
    ("steps", 2, 1, 5, [1, 3, 4]),  # after optimizer steps 2 and 4, and the last (5)
    ("steps", 3, 2, 0, [1, 2, 4]),  # a rollout of 2 optimizer steps: step k's covers k+1 and k+2
    ("no", 1, 1, 5, []),
    ("epoch", 1, 1, 5, [0, 1, 2, 3, 4]),  # (the epoch's end is not known ahead: every rollout answers its pool)
])
def test_the_steps_whose_jobs_answer_their_pool_are_those_saved_after(strategy, save_steps, span, max_steps, saving):
    """A partial job on rollout ranks answers the pool left in flight when the trainers will save a checkpoint after
    an optimizer step of its rollout (TRL's loop saves after global step s when s % save_steps == 0, and at the
    last step). Mutation tried: the steps counted from the rollout's own step (range(step, step + span)) -> the
    first case fails."""
    from types import SimpleNamespace

    from trl_nrollout.trainer.remote_partial import saves_after

    args = SimpleNamespace(save_strategy=strategy, save_steps=save_steps)
    state = SimpleNamespace(save_steps=save_steps, max_steps=max_steps)
    assert [k for k in range(5) if saves_after(args, state, span, k)] == saving


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("options,expected", [
    (dict(rollout_ranks=1, rollout_backend="hf"), "rollout_backend='hf'"),
    (dict(rollout_ranks=1), "single process"),
    (dict(rollout_ranks=-1), "must be >= 0"),
    (dict(rollout_rank_timeout_s=0), "rollout_rank_timeout_s=0"),
    (dict(vllm_mode="server"), "set rollout_ranks=K"),
])
def test_options_rollout_ranks_cannot_serve_are_refused(options, expected, tmp_path):
    """Each refusal names the option and says what to do; none starts torch.distributed (a single process here)."""
    from trl_nrollout import NRolloutConfig

    with pytest.raises(InputError, match=None) as err:
        NRolloutConfig(output_dir=str(tmp_path), train_batch_size=4, rollout_n=2, use_cpu=True, report_to="none",
                       **options)
    assert expected in str(err.value)
    assert not torch.distributed.is_initialized()


def test_max_staleness_as_the_look_ahead_is_refused_naming_both_options(tmp_path):
    """The old spelling: ``max_staleness`` set with ``rollout_ranks`` and no ``rollout_lookahead`` meant the look-ahead
    (and the partial pool's token age); it is refused by the config and the plan, the message naming both options,
    the value and the fix (``rollout_lookahead=<v>``). With ``rollout_lookahead`` set, ``max_staleness`` is the
    pool's token age and passes this check (the config goes on to the launch check of a single process). Mutation
    tried: ``_check_lookahead_spelling`` not called -> the config fails later on the single process, not with this
    message, and the test fails."""
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.plan.figures import split_rollout_ranks
    from trl_nrollout.plan.readers import PlanError

    base = dict(output_dir=str(tmp_path), train_batch_size=4, rollout_n=2, use_cpu=True, report_to="none",
                rollout_ranks=1)
    with pytest.raises(InputError) as err:
        NRolloutConfig(**base, max_staleness=3, rollout_partial=True)
    text = str(err.value)
    assert "max_staleness=3" in text and "rollout_lookahead=3" in text and "token age" in text, text
    with pytest.raises(InputError, match="single process"):  # both spelled: past the spelling, on to the launch
        NRolloutConfig(**base, max_staleness=3, rollout_lookahead=1, rollout_partial=True)
    values = {"num_processes": 3, "rollout_ranks": 1, "train_batch_size": 8, "rollout_n": 4, "max_staleness": 2}
    with pytest.raises(PlanError, match="Set rollout_lookahead=2"):
        split_rollout_ranks(values)
    assert split_rollout_ranks({**values, "rollout_lookahead": 0})[2]["rollout_lookahead"] == 0


def test_rollout_lookahead_without_rollout_ranks_is_refused(tmp_path):
    """``rollout_lookahead`` counts the steps rollout ranks generate ahead: > 0 without rollout ranks is refused with
    the fix; 0 (its default there) and a partial run's ``max_staleness`` are accepted. Mutation tried: the check
    dropped -> the config is built and the test fails."""
    from trl_nrollout import NRolloutConfig

    base = dict(output_dir=str(tmp_path), train_batch_size=4, rollout_n=2, use_cpu=True, report_to="none")
    with pytest.raises(InputError, match="rollout_lookahead=2 needs rollout_ranks > 0.*Set rollout_ranks=K"):
        NRolloutConfig(**base, rollout_lookahead=2)
    config = NRolloutConfig(**base, rollout_lookahead=0, rollout_partial=True, max_staleness=3)
    assert (config.rollout_lookahead, config.max_staleness) == (0, 3)


def test_rollout_lookahead_sets_the_jobs_written_ahead_and_the_versions_staged():
    """A trainer rank writes ``rollout_lookahead`` steps' jobs ahead (``ahead_jobs``: none at 0, the next step's at
    1, two at 2, never past the run's last step), whatever ``max_staleness`` says; a rollout rank stages at most
    ``rollout_lookahead`` weight versions (at least one). Mutations tried: ``ahead_jobs`` reading
    ``args.max_staleness`` (the old meaning) -> a job is written at rollout_lookahead=0, the test fails; the start
    message's ``lookahead`` key read as ``max_staleness`` -> one version staged at rollout_lookahead=2, it fails."""
    from types import SimpleNamespace

    from trl_nrollout.rollout.ranks.reader import staged_versions
    from trl_nrollout.trainer.metrics import Metrics
    from trl_nrollout.trainer.rollout_ranks import RankCalls, RolloutRankPlacement

    def trainer(lookahead: int, max_steps: int = 10):
        state = SimpleNamespace(global_step=3, max_steps=max_steps)
        calls = RankCalls(state=lambda: state, sampling=lambda mode, step: step,
                          start_episodes=lambda rows, busy=None: ([f"prompt {rows}"] * len(rows), []),
                          engine_prompts=lambda prompts: ([[7]] * len(prompts), [None] * len(prompts)),
                          partial_job=None, reset_env=None, log_agent_stats=None, live_environments=None,
                          set_live_environments=None)
        part = RolloutRankPlacement(
            SimpleNamespace(rollout_lookahead=lookahead, max_staleness=2, rollout_partial=False,
                            rollout_multi_turn="turns"),
            SimpleNamespace(optimizer_steps_per_rollout=1), Metrics(), calls, num_generations=2,
            environments=False, agents=False, request_tools=False)
        part.next_generation_inputs = lambda k: [[{"row": i}] * 2 for i in range(k)]
        return part

    def steps(part) -> list[int]:
        return [sampling for _, sampling, _, _ in part.ahead_jobs("train")]

    assert steps(trainer(0)) == []
    assert steps(trainer(1)) == [4]
    assert steps(trainer(2)) == [4, 5]
    assert steps(trainer(2, max_steps=5)) == [4]  # step 5 is past the run's end
    assert trainer(1).ahead_jobs("eval") == []
    assert staged_versions({"lookahead": 2, "max_staleness": 1}) == 2
    assert staged_versions({"lookahead": 0}) == 1


class _RankBridge:
    """A rollout rank's bridge for :func:`~trl_nrollout.rollout.ranks.serve.serve`'s handlers, one rollout rank:
    what is written (``put``) is kept; ``die`` raises :class:`SystemExit` with its reason, as the process would stop."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.roles, self.status, self.written = SimpleNamespace(rollout_ranks=1), "idle", {}

    def put(self, key: str, value) -> None:
        self.written[key] = value

    def die(self, why: str) -> None:
        raise SystemExit(why)


def _served(engine):
    from types import SimpleNamespace

    from trl_nrollout.rollout.ranks.serve import Served
    from trl_nrollout.rollout.ranks.state import RankState

    reader = SimpleNamespace(buckets=lambda message, engine: iter([[("w", torch.zeros(2))]]), loaded=lambda: None)
    return Served(_RankBridge(), 0, None, RankState(engine=engine), reader)


def test_a_new_kind_of_job_is_one_entry_of_the_table_and_an_unknown_one_answers_an_error():
    """``serve`` runs a job by the type of its entry (``JOB_KINDS``): a kind registered from outside the loop is
    answered with what its handler gave, no edit to ``serve``; an entry no handler knows answers the trainers an
    error naming it (they raise it; they never wait). Mutation tried: the job handler looking up ``type(None)``
    whatever the entry -> the new kind runs as single-turn and the answer differs; the test fails."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from trl_nrollout.rollout.bridge import RolloutRankError
    from trl_nrollout.rollout.ranks.jobs import JOB_KINDS, JobDone, job_kind
    from trl_nrollout.rollout.ranks.serve import MESSAGES
    from trl_nrollout.rollout.types import RolloutBatch

    @dataclass(frozen=True)
    class Echo:  # a new kind of job: its entry and its handler, nothing else
        token: int

    job_kind(Echo)(lambda job: JobDone(RolloutBatch([[1]], [[job.entry.token]], [[-0.5]], ["stop"], [0])))
    engine = SimpleNamespace(layout=SimpleNamespace(rollout_tp_size=1), rank=0, tp_ranks=[0])
    loop = _served(engine)
    try:
        message = {"kind": "job", "id": 7, "prompts": [[1]], "n": 1, "sampling": None, "agent": Echo(42)}
        assert MESSAGES["job"](loop, message) is False
        assert loop.bridge.written["out/7/0"].rows() == [([42], [-0.5], "stop")]
        with pytest.raises(RolloutRankError, match="unknown kind 'object'"):
            MESSAGES["job"](loop, {**message, "id": 8, "agent": object()})
        assert loop.bridge.written["out/8/0"]["kind"] == "error"
    finally:
        del JOB_KINDS[Echo]


def test_a_weight_version_that_does_not_load_stops_the_rollout_rank():
    """A version the engine cannot load (after it arrived) stops the rollout rank's process at once
    (``Bridge.die``): nothing would tell the trainers, who would wait for the next job's answer (and, with TP > 1,
    the engine's other ranks in its broadcast) forever. Mutation tried: the load outside the try -> the error
    propagates as a RuntimeError, no die; the test fails."""
    from types import SimpleNamespace

    from trl_nrollout.rollout.ranks.serve import MESSAGES

    def load_buckets(buckets):
        list(buckets)
        raise RuntimeError("size mismatch for w")

    loop = _served(SimpleNamespace(load_buckets=load_buckets))
    with pytest.raises(SystemExit, match="loading weights version 3 failed: RuntimeError: size mismatch for w"):
        MESSAGES["weights"](loop, {"kind": "weights", "version": 3, "receive_s": 0.0, "bytes": 8})


def test_the_plan_prints_both_worlds_and_refuses_a_split_across_a_node(capsys):
    assert cli_main(["plan", "--num-processes", "6", "--rollout-ranks", "2", "--rollout-tp-size", "2",
                     "--train-batch-size", "60", "--rollout-n", "12"]) == 0
    text = capsys.readouterr().out
    assert "6 processes = 4 trainers (global ranks 0..3) + 2 rollout ranks (global ranks 4..5)" in text
    assert "2 rollout ranks / rollout_tp_size=2 = 1; ranks (4,5)" in text
    assert "samples per training rank    720 / 4 = 180" in text  # the trainers share the batch
    assert cli_main(["plan", "--num-processes", "3", "--rollout-ranks", "1", "--train-batch-size", "8",
                     "--rollout-n", "4", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["num_processes"] == 2 and figures["rollout_ranks"]["engine_ranks"] == [[2]]
    assert figures["rollout_ranks"]["rollout_lookahead"] == 1
    assert cli_main(["plan", "--n-gpus-per-node", "4", "--nnodes", "2", "--rollout-ranks", "2",
                     "--train-batch-size", "8", "--rollout-n", "4"]) == 2
    assert "use a multiple of 4" in capsys.readouterr().err


def test_the_plan_of_a_split_launch_imports_no_torch():
    """The split's arithmetic is pure: a plan with rollout ranks answers before torch is even installed."""
    code = ("import sys\nfrom trl_nrollout.cli import main\n"
            "assert main(['plan', '--num-processes', '3', '--rollout-ranks', '1', '--train-batch-size', '8', "
            "'--rollout-n', '4']) == 0\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'vllm') if m in sys.modules]\nassert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_plan_predicts_a_split_launch_beside_the_same_devices_colocated(capsys):
    """``plan --predict --rollout-ranks``: the engines' generation, the trainers' phases, the transfer, the step
    synchronous and pipelined, and the same devices colocated; the recipe's rollout_lookahead picks which step."""
    base = ["plan", "--num-processes", "16", "--rollout-ranks", "8", "--rollout-tp-size", "2", "--train-batch-size",
            "64", "--rollout-n", "16", "--model", "Qwen/Qwen2.5-7B-Instruct", "--device", "h100", "--predict",
            "--max-prompt-length", "512", "--max-completion-length", "1024", "--no-memory", "--trainer-sharding",
            "zero3", "--use-dynamic-bsz", "--json"]  # unsharded, a 7B's states alone exceed a trainer's 80 GiB
    assert cli_main(base) == 0
    out = json.loads(capsys.readouterr().out)["prediction"]
    split = out["split"]
    assert split["pipelined_s"] == out["step_s"] < split["sync_s"]  # rollout_lookahead defaults to 1
    assert out["colocated"]["total_s"] > 0 and split["samples"] == 64 * 16
    assert cli_main([*base, "--rollout-lookahead", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["prediction"]["step_s"] == split["sync_s"]
    assert cli_main(base[:-1]) == 0
    text = capsys.readouterr().out
    assert "8 trainers + 8 rollout ranks" in text and "the same 16 devices colocated" in text


# ---------------------------------------------------------------------------------------------- real launches
def _launch(out, *extra, config: str | None = None, procs: int = 3, timeout: float = 600):
    head = [*ACCELERATE_LAUNCH, "--num_processes", str(procs)]
    head += ["--config_file", str(ROOT / "recipes/accelerate" / config)] if config else ["--multi_gpu"]
    device = ["--use_cpu", "false", "--ddp_backend", "gloo"] if config else ["--use_cpu", "true"]
    proc = subprocess.run([*head, RECIPE, "--output_dir", str(out), *device, "--bf16", "false", *extra], cwd=ROOT,
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    history = json.loads((out / "log_history.json").read_text())
    return {"summary": json.loads((out / "run_summary.json").read_text()),
            "steps": [h for h in history if "reward" in h]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.parametrize("staleness,lags,ranks,dispatch,partial", [(1, [0, 1, 1, 1], 1, "shares", True),
                                                                  (2, [0, 1, 2, 2], 2, "balanced", False),
                                                                  (1, [0, 1, 1, 1], 2, "balanced", True)])
def test_one_step_off_policy_under_zero3_samples_one_step_stale(staleness, lags, ranks, dispatch, partial, tmp_path):
    """2 ZeRO-3 trainers + 1 rollout rank, rollout_lookahead=1 (the default): the first step is generated with the
    initial weights, and every later step's samples by the policy one optimizer step older (the step's job was
    written before the previous update); with rollout_lookahead=2 (1 ZeRO-3 trainer + 2 rollout ranks, their two
    engines pulling each job's groups from one balanced queue), two jobs are written ahead, so the lag grows to 2.
    The trainers log their wait and each transfer's bytes, which are the model's. The engine's log-probs then
    differ from the trainer's by the updates in between (a synchronous run's stay at float32 noise:
    test_trainer's rollout_ranks cases). That a balanced queue samples what fixed shares sample: test_dispatch.py
    (the rollout ranks run the same generate_balanced).

    Partial rollouts (rollout_partial=True; the 2 trainers' rows joined in one job, and the 2 rollout ranks'
    balanced queue over one job pool): the rollout ranks keep the groups that did not finish and continue them at
    the next job, so from the third step on a trained sample holds tokens one version older than the job's weights
    (staleness 2 = the lookahead plus one carried job, within rollout_lookahead + max_staleness, both 1 here).
    Mutation tried: the rollout rank's
    pool emptied after each job (nothing carried) -> staleness never exceeds 1, the assertion fails."""
    run = _launch(tmp_path, "--max_steps", "4", "--rollout_ranks", str(ranks), "--rollout_lookahead", str(staleness),
                  "--max_staleness", str(staleness),
                  "--rollout_dispatch", dispatch, "--learning_rate", "1e-4", "--save_strategy", "no",
                  "--rollout_partial", str(partial).lower(), config="zero3_cpu.yaml")
    steps = run["steps"]
    if partial:  # groups carried from job to job: trained one version older than the job's weights
        stale = [h["partial/staleness_max"] for h in steps]
        assert max(stale) == 2 * staleness and all(h["partial/pool_groups"] > 0 for h in steps), stale
    else:
        assert all("partial/pool_groups" not in h for h in steps)
    assert run["summary"]["processes"] == 3 - ranks and len(steps) == 4
    if dispatch == "balanced":  # the rollout ranks' engines pulled the job's groups (the share run by another)
        assert all(0.0 <= h["rollout/moved_groups"] <= 1.0 for h in steps)
    else:
        assert all("rollout/moved_groups" not in h for h in steps)
    assert [h["rollout/staleness"] for h in steps] == lags
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    # every name the engine loads: the tied embedding goes as lm_head too (float32)
    model_mb = sum(p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False)) / 2**20
    sent = [h["weight_sync/transfer_mb"] for h in steps if "weight_sync/transfer_mb" in h]
    assert sent and all(mb == pytest.approx(model_mb, rel=0.05) for mb in sent)
    assert all(h["rollout/wait_s"] >= 0 and math.isfinite(h["loss"]) for h in steps)
    assert steps[0]["rollout_corr/logprob_abs_diff_max"] < 1e-3  # sampled by the weights it trains from
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps[1:]) > 1e-3  # one update older


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_a_lora_policy_reaches_the_rollout_rank_merged(tmp_path):
    """LoRA trainers (2, DDP) and a rollout rank, synchronous: after every transfer the engine's log-probs equal the
    trainer's (the adapters' deltas merged into the weights sent; the base model never changes), while the KL to
    the base grows (the adapters train)."""
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                           str(ROOT / "tests/assets/peft_train.py"), str(tmp_path), "ddp", "vllm", "ranks"],
                          cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in result["history"] if "reward" in h]
    assert result["processes"] == 2 and len(steps) == 3
    assert [h["rollout/staleness"] for h in steps] == [0, 0, 0]
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 1e-4
    assert steps[0]["actor/kl_loss"] < 1e-5 < steps[-1]["actor/kl_loss"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_two_nodes_with_the_rollout_rank_on_the_second(tmp_path):
    """A 2-"node" launch on this machine (one process per node): node 0 trains, node 1 generates, and training
    runs one step ahead. It asks for TRL's server mode (``vllm_mode="server"``), which maps onto rollout ranks."""
    launch_two_nodes(tmp_path, 1, "--bf16", "false", "--max_steps", "3", "--rollout_ranks", "1", "--save_strategy",
                     "no", "--use_vllm", "true", "--vllm_mode", "server")
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["processes"] == 1 and summary["nnodes"] == 1 and summary["steps"] == 3  # the trainers' world
    history = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "reward" in h]
    assert [h["rollout/staleness"] for h in history] == [0, 1, 1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.parametrize("mode,silent", [("rollout_stop", "rollout rank 0"), ("rollout_kill", None),
                                         ("trainer_stop", "train rank 1")])
def test_a_dead_or_frozen_rank_stops_the_launch(mode, silent, tmp_path):
    """A rollout rank frozen (SIGSTOP) or killed, or a trainer frozen, in the middle of training: the launch ends
    with an error within a bounded time (rollout_rank_timeout_s=5), and for a frozen rank a message names it and
    what it was doing; nothing waits forever. The launcher gives the ranks 3 s after the first one fails
    (FORK_LAUNCH_GRACE_S; 15 s by default), not the 15 s that a frozen rank, which cannot act on SIGTERM, waited
    out before its SIGKILL."""
    start = time.monotonic()
    proc = subprocess.Popen([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                             str(ROOT / "tests/assets/rollout_ranks_fault.py"), str(tmp_path), mode],
                            cwd=ROOT, env={**os.environ, **ENV, "FORK_LAUNCH_GRACE_S": "3"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
        frozen = tmp_path / "frozen.pid"
        if frozen.exists():  # whatever happened, the frozen process must not outlive the test
            pid = int(frozen.read_text())
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    elapsed = time.monotonic() - start
    assert frozen.exists(), output[-4000:]  # the fault was injected (after two steps)
    assert proc.returncode != 0, output[-4000:]
    assert elapsed < 240, elapsed
    if silent:
        assert "has not been heard from" in output and silent in output, output[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_a_job_longer_than_the_collectives_timeout_does_not_stop_the_trainers(tmp_path):
    """The rollout rank is frozen for 15 s in the middle of training (a job that takes that long) while the process
    groups' timeout is ddp_timeout=6: trainer rank 1 waits for its samples on a store key (checking trainer rank 0's
    heartbeat), not inside a collective, so the run ends normally. Mutation: hand the samples out with a broadcast
    of the trainers' group (as before) -> trainer rank 1's collective times out after 6 s and the launch fails."""
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                           str(ROOT / "tests/assets/rollout_ranks_fault.py"), str(tmp_path), "slow_job"],
                          cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400)
    assert (tmp_path / "frozen.pid").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "done").read_text() == "5"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.parametrize("recipe", ["ppo", "remax"])
def test_ppo_and_remax_run_one_step_off_on_a_rollout_rank(recipe, tmp_path):
    """PPO (a critic, two optimizer steps per rollout in its recipe) and ReMax (a greedy pass per step, generated
    after the job written ahead, not instead of it) on 2 trainers + 1 rollout rank: every step after the first
    trains samples one rollout old (in optimizer steps: the rollout's optimizer steps), the greedy pass does not
    discard the job written ahead (the trainers then wait for nothing), and the losses stay finite."""
    run = _launch(tmp_path, "--config", str(ROOT / "recipes/configs" / f"{recipe}.yaml"), "--max_steps", "4",
                  "--rollout_ranks", "1", "--save_strategy", "no")
    steps = run["steps"]
    lag = 2 if recipe == "ppo" else 1  # optimizer steps per rollout
    assert [h["rollout/staleness"] for h in steps] == [0] + [lag] * (len(steps) - 1)
    assert all(math.isfinite(h["loss"]) for h in steps)
    if recipe == "ppo":
        assert all(math.isfinite(h["critic/vf_loss"]) for h in steps)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_a_killed_rollout_rank_restarts_the_launch_and_the_run_resumes_to_the_same_steps(tmp_path):
    """2 trainers + 1 rollout rank, one step off (``rollout_lookahead=1``, the default), DAPO's extra rounds and the
    adaptive KL controller on (the suite's resume recipe). Issue 65 item 1's fault: the rollout rank is killed
    (SIGKILL, from outside) once checkpoint-2 is saved, in a real ``accelerate launch --max_restarts 1``; torchrun's
    agent ends and restarts every process, and the restarted run (resume_from_checkpoint unset) resumes from
    checkpoint-2 on its own and trains steps 3-4 only, logging, value for value, what the uninterrupted run logged
    (reward, loss, gradient norm, KL coefficient, the lag): no step lost or trained twice. At the checkpoint step 3's
    job was already written and sampled by the policy of step 1; the checkpoint keeps it with its samples (trainer
    rank 0's ``nrollout_jobs_ahead.pt``), so the resumed step 3 trains on them (lag 1). Mutations tried: the saved
    jobs not restored (``load_rollout_state`` ignoring ``engine``) -> the resumed step 3 is generated afresh by the
    step-2 policy (lag 0), its logged values differ; the store's keys not scoped by the attempt (rollout/bridge.py)
    -> the restarted processes read the dead attempt's gloo addresses, the launch fails. (The restart count ignored
    by ``resolve_resume``: tests/test_bad_input.py.)"""
    from tests.conftest import ACCELERATE, RESUME, RESUMED_KEYS, assert_resumed
    from tests.fault import launch_killing

    full = _launch(tmp_path / "full", *RESUME, "--rollout_ranks", "1")
    assert any(h["dynamic_sampling/rounds"] > 0 for h in full["steps"])  # extra rounds ran on the rollout rank
    assert [h["rollout/staleness"] for h in full["steps"]] == [0, 1, 1, 1]  # one step off
    out = tmp_path / "killed"
    checkpoint = out / "checkpoint-2"
    code, killed, _ = launch_killing(
        [ACCELERATE, "launch", "--max_restarts", "1", "--multi_gpu", "--num_processes", "3", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", RECIPE, "--output_dir", str(out), "--use_cpu", "true",
         "--bf16", "false", *RESUME, "--rollout_ranks", "1"],
        cwd=ROOT, env={**os.environ, **ENV}, log=tmp_path / "killed.log", checkpoint=checkpoint, rank=2)
    output = (tmp_path / "killed.log").read_text()
    assert killed is not None, output[-4000:]
    assert code == 0, output[-8000:]
    history = json.loads((out / "log_history.json").read_text())
    resumed = {"summary": json.loads((out / "run_summary.json").read_text()),
               "steps": [h for h in history if "reward" in h]}
    assert resumed["summary"]["restarts"] == 1
    assert (checkpoint / "nrollout_jobs_ahead.pt").is_file()
    assert_resumed(full, resumed, checkpoint, keys=(*RESUMED_KEYS, "grad_norm", "rollout/staleness"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_evaluation_goes_through_the_rollout_rank_without_losing_the_job_written_ahead(tmp_path):
    """Evaluation every 2 steps inside train() and once after it (on every process: the rollout rank serves it):
    the evaluation's samples are generated after the job already written for the next training step, which stays
    that step's (the lag stays one step after each evaluation), and every evaluation logs its reward."""
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                           str(ROOT / "tests/assets/rollout_ranks_eval.py"), str(tmp_path)],
                          cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in result["history"] if "reward" in h]
    assert [h["rollout/staleness"] for h in steps] == [0, 1, 1, 1]
    evals = [h for h in result["history"] if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2, 4, 4] and all(math.isfinite(h["eval_reward"]) for h in evals)
    assert math.isfinite(result["final"]["eval_reward"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_a_rollout_func_generates_on_the_rollout_rank(tmp_path):
    """A TRL rollout_func that generates through trainer.rollout_engine, with one trainer and one rollout rank: its
    calls are jobs of the rollout rank (the engine it sees is RemoteEngines), its extra field reaches the reward,
    and the steps train (finite loss, some reward)."""
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2",
                           str(ROOT / "tests/assets/rollout_func_ranks.py"), str(tmp_path)], cwd=ROOT,
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["seen"] == ["RemoteEngines"] * 3
    steps = [h for h in result["history"] if "reward" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps)
    assert max(h["reward"] for h in steps) > 0  # the extra field reached the reward on the trainer


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_weights_travel_as_what_changed_and_arrive_bit_for_bit(tmp_path):
    """weight_sync_delta (issue 65 item 2): 1 trainer + 1 rollout rank with a bf16 engine, synchronous, Adam at
    lr 1e-6: after the first version (whole: nothing held yet) each version crosses as what changed in bf16, far
    fewer bytes than the model's; every bucket the rollout rank decodes must give the trainer's bytes (a checksum
    per bucket, or the run stops), and the engine samples from what it loaded (its log-probs stay within bf16
    rounding of the trainer's float32 ones). Mutation tried: ``_apply`` writing each changed word one place off ->
    the rollout rank raises the checksum error and the launch fails."""
    run = _launch(tmp_path, "--max_steps", "4", "--rollout_ranks", "1", "--rollout_lookahead", "0",
                  "--rollout_dtype", "bfloat16", "--weight_sync_delta", "true", "--learning_rate", "1e-6",
                  "--save_strategy", "no", procs=2)
    steps = run["steps"]
    sent = [(h["weight_sync/transfer_mb"], h["weight_sync/transfer_sent_mb"]) for h in steps
            if "weight_sync/transfer_sent_mb" in h]
    assert len(sent) >= 2, steps
    full, first = sent[0]
    assert first == pytest.approx(full, rel=1e-3)  # the first version: no copy held, every bucket whole
    assert all(mb < 0.5 * whole for whole, mb in sent[1:]), sent  # bf16 words that an lr-1e-6 step changed
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 0.1


@pytest.mark.slow  # (it starts processes: `sleep`, a few milliseconds)
def test_a_peer_whose_process_is_gone_on_this_host_is_seen_at_once():
    """``Bridge._gone``: a watched peer on this host whose process has ended (a SIGKILL: reaped, or a zombie not yet
    reaped) is dead now, without waiting ``rollout_rank_timeout_s`` for its heartbeat to go stale (the launcher's
    SIGTERM cannot reach a process blocked in a collective with it, so this is what stops it at once); a live one
    and one on another host are not (only their heartbeats say). Real processes, an in-memory store. Mutation
    tried: ``_gone`` always False -> the first assertion fails."""
    import socket

    from trl_nrollout.plan.roles import Roles
    from trl_nrollout.rollout.bridge import Bridge

    store = torch.distributed.HashStore()
    bridge = Bridge(Roles(4, 1, 4), 0, store, None, timeout_s=120)
    dead, zombie, alive = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    try:
        for proc in (dead, zombie):
            proc.kill()
        dead.wait()  # reaped: gone; ``zombie`` is killed but not waited for: a zombie until reaped
        host = socket.gethostname()
        for peer, where in ((1, f"{host}:{dead.pid}"), (2, f"{host}:{zombie.pid}"), (3, f"{host}:{alive.pid}"),
                            (4, f"elsewhere-{host}:{dead.pid}")):
            store.set(f"pid/{peer}", where)
        deadline = time.monotonic() + 10
        while not bridge._gone(2):  # (the kill takes a moment to turn it into a zombie)
            assert time.monotonic() < deadline, "a killed child never showed as gone"
            time.sleep(0.05)
        assert bridge._gone(1)
        assert not bridge._gone(3) and not bridge._gone(4) and not bridge._gone(5)  # (5: no pid written yet)
    finally:
        for proc in (zombie, alive):
            proc.kill()
            proc.wait()
        bridge.finish()
