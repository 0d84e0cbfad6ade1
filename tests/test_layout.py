"""RolloutLayout: the worked example, property tests over many layouts, and every validation error."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_nrollout.plan import layout as layout_mod
from trl_nrollout.plan.layout import LayoutError, RolloutLayout, divisors, nearest_multiples

EXAMPLE = dict(num_processes=6, rollout_tp_size=2, train_batch_size=60, rollout_n=12, log_prob_micro_batch_size=48)


def build(**kw) -> RolloutLayout:
    return RolloutLayout.build(**kw)


# ---------------------------------------------------------------------------------------------- worked example
def test_worked_example():
    lay = build(**EXAMPLE)
    assert lay.num_engines == 3
    assert lay.engine_ranks == ((0, 1), (2, 3), (4, 5))
    assert lay.prompts_per_engine == 20
    assert lay.samples_per_engine == 240
    assert lay.total_samples == 720
    assert lay.data_parallel_size == 6
    assert lay.samples_per_rank == 120
    assert lay.old_log_prob.per_device == 8
    assert lay.ref_log_prob.per_device == 8  # the reference pass follows the old-policy pass
    assert lay.old_log_prob.num_micro_batches == 15
    assert lay.optimizer_steps_per_rollout == 1 and lay.gradient_accumulation_steps == 1
    assert [lay.engine_of_rank(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert lay.engine_prompt_range(1) == range(20, 40)
    assert lay.engine_sample_range(2) == range(480, 720)
    assert lay.rank_sample_range(5) == range(600, 720)
    assert lay.sample_group(239) == 19 and lay.sample_group(240) == 20
    assert lay.engine_of_prompt(59) == 2


def test_worked_example_per_device_and_gpus_per_node_say_the_same():
    a = build(**EXAMPLE)
    b = build(n_gpus_per_node=6, nnodes=1, rollout_tp_size=2, train_batch_size=60, rollout_n=12,
              log_prob_micro_batch_size_per_device=8)
    c = build(num_processes=6, n_gpus_per_node=2, nnodes=3, rollout_tp_size=2, train_batch_size=60, rollout_n=12,
              log_prob_micro_batch_size_per_device=8)
    for other in (b, c):
        assert other.num_engines == a.num_engines and other.engine_ranks == a.engine_ranks
        assert other.old_log_prob.per_device == a.old_log_prob.per_device == 8
        assert other.old_log_prob.source == "log_prob_micro_batch_size_per_device"


def test_design_error_message_verbatim():
    with pytest.raises(LayoutError) as info:
        build(num_processes=6, rollout_tp_size=2, train_batch_size=50, rollout_n=12)
    assert str(info.value) == (
        "train_batch_size=50 is not divisible by the 3 rollout engines (6 processes / rollout_tp_size=2); "
        "use 48 or 51."
    )
    assert info.value.fixes == ({"train_batch_size": 48}, {"train_batch_size": 51})


def test_table_and_to_dict():
    lay = build(**EXAMPLE)
    table = lay.table()
    for text in ("6 / rollout_tp_size=2 = 3", "(0,1), (2,3), (4,5)", "60 / 3 = 20", "20 x n=12 = 240",
                 "3 x 240 = 720", "log_prob_micro_batch_size=48 // 6 ranks", "8 sequences per device"):
        assert text in table
    d = lay.to_dict()
    json.dumps(d)  # JSON-able
    for key in ("num_engines", "engine_ranks", "prompts_per_engine", "samples_per_engine", "total_samples",
                "samples_per_rank", "log_prob_micro_batch_size_per_device",
                "ref_log_prob_micro_batch_size_per_device", "old_log_prob", "ref_log_prob", "notes",
                "optimizer_steps_per_rollout", "gradient_accumulation_steps", "data_parallel_size"):
        assert key in d
    assert d["engine_ranks"] == [[0, 1], [2, 3], [4, 5]]
    assert d["log_prob_micro_batch_size_per_device"] == 8


def test_many_engines_table_is_shortened():
    lay = build(num_processes=32, rollout_tp_size=2, train_batch_size=32, rollout_n=8)
    assert "(16 groups)" in lay.table()


# ---------------------------------------------------------------------------------------------- defaults, notes
def test_defaults():
    lay = build(train_batch_size=4, rollout_n=8)
    assert lay.num_processes == 1 and lay.num_engines == 1 and lay.ppo_mini_batch_size == 4
    assert lay.ppo_micro_batch_size_per_device == 32 and lay.gradient_accumulation_steps == 1
    assert lay.old_log_prob.per_device == 32 and lay.old_log_prob.source.startswith("default")
    assert build(nnodes=2, train_batch_size=4, rollout_n=8).num_processes == 2  # one process per node


def test_mini_micro_and_epochs():
    lay = build(num_processes=4, train_batch_size=32, rollout_n=8, ppo_mini_batch_size=8,
                ppo_micro_batch_size_per_device=4, ppo_epochs=2)
    assert lay.mini_batch_samples_per_rank == 16 and lay.gradient_accumulation_steps == 4
    assert lay.optimizer_steps_per_rollout == 8
    assert lay.mini_batch_ranges(1) == [range(64, 80), range(80, 96), range(96, 112), range(112, 128)]


def test_optimizer_steps_spanning_two_rollouts_as_trl():
    """TRL's layout gradient_accumulation_steps=3, steps_per_generation=4, per_device_train_batch_size=6,
    num_iterations=2 on one process: optimizer steps of 18 samples over rollouts of 24 (n=8) train as TRL's loop
    runs them (8/3 optimizer steps per rollout), where the layout refused ppo_mini_batch_samples=18 before; a
    note says so. Steps that only run on into the next pass over the same rollout keep a whole number per rollout."""
    lay = build(num_processes=1, train_batch_size=3, rollout_n=8, ppo_mini_batch_samples=18,
                ppo_micro_batch_size_per_device=6, ppo_epochs=2)
    assert lay.spans_rollouts and lay.optimizer_steps_per_rollout == pytest.approx(8 / 3)
    assert lay.gradient_accumulation_steps == 3 and lay.samples_per_rank == 24
    assert lay.mini_batch_ranges(0) == [range(0, 18), range(18, 24)]  # the second step runs on into the next pass
    assert any("into the next rollout" in n for n in lay.notes)
    assert "= 2.667 (8/3)" in lay.table()
    json.dumps(lay.to_dict())
    passes = build(num_processes=1, train_batch_size=3, rollout_n=8, ppo_mini_batch_samples=16,
                   ppo_micro_batch_size_per_device=8, ppo_epochs=2)  # 48 samples over 3 steps of 16: no rollout spanned
    assert passes.optimizer_steps_per_rollout == 3 and not passes.spans_rollouts
    assert any("next (ppo_epochs=2)" in n and "next rollout" not in n for n in passes.notes)
    aligned = build(num_processes=1, train_batch_size=3, rollout_n=8, ppo_mini_batch_samples=12,
                    ppo_micro_batch_size_per_device=6)
    assert aligned.optimizer_steps_per_rollout == 2 and isinstance(aligned.optimizer_steps_per_rollout, int)
    assert not any("pass over a rollout" in n for n in aligned.notes)


def test_reference_pass_options():
    lay = build(num_processes=2, train_batch_size=4, rollout_n=4, log_prob_micro_batch_size_per_device=4,
                ref_log_prob_micro_batch_size=4)
    assert lay.old_log_prob.per_device == 4 and lay.ref_log_prob.per_device == 2
    tok = build(num_processes=2, train_batch_size=4, rollout_n=4, log_prob_max_token_len_per_device=4096)
    assert tok.old_log_prob.max_token_len == 4096 and tok.ref_log_prob.max_token_len == 4096
    assert "dynamic, <= 4096 tokens" in tok.table()
    own = build(num_processes=2, train_batch_size=4, rollout_n=4, log_prob_max_token_len_per_device=4096,
                ref_log_prob_micro_batch_size_per_device=2)
    assert own.ref_log_prob.max_token_len is None and own.ref_log_prob.per_device == 2


def test_notes():
    assert any("noisy below 8" in n for n in build(train_batch_size=4, rollout_n=4).notes)
    assert not build(train_batch_size=4, rollout_n=4, adv_estimator="reinforce_plus_plus").notes
    lay = build(**{**EXAMPLE, "log_prob_micro_batch_size": 50})
    assert lay.old_log_prob.per_device == 8
    assert any("not a multiple of the data-parallel size 6" in n and "48 or 54" in n for n in lay.notes)
    assert "note:" in lay.table()


def test_a_tp_group_never_spans_two_nodes():
    """6 processes on 2 nodes of 3: TP=2 would put ranks 2 and 3 (nodes 0 and 1) in one engine."""
    with pytest.raises(LayoutError) as err:
        build(n_gpus_per_node=3, nnodes=2, rollout_tp_size=2, train_batch_size=6, rollout_n=8)
    assert err.value.rule == "tp_within_node" and err.value.option == "rollout_tp_size"
    assert "span two nodes" in str(err.value) and "use 1 or 3" in str(err.value)
    ok = build(n_gpus_per_node=4, nnodes=2, rollout_tp_size=2, train_batch_size=8, rollout_n=8)
    for ranks in ok.engine_ranks:  # every engine's ranks on one node
        assert len({r // 4 for r in ranks}) == 1


def test_helpers():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1]
    assert nearest_multiples(50, 3) == [48, 51]
    assert nearest_multiples(6, 3) == [3, 9]
    assert nearest_multiples(2, 3) == [3]


@pytest.mark.parametrize(
    "call",
    [lambda lay: lay.engine_of_rank(6), lambda lay: lay.rank_sample_range(-1), lambda lay: lay.engine_sample_range(3),
     lambda lay: lay.engine_prompt_range(-1), lambda lay: lay.sample_group(720), lambda lay: lay.engine_of_prompt(60)],
)
def test_index_out_of_range(call):
    with pytest.raises(LayoutError, match="is outside 0.."):
        call(build(**EXAMPLE))


def test_subclass_build_returns_subclass():
    class Mine(RolloutLayout):
        pass

    assert type(Mine.build(**EXAMPLE)) is Mine


# ---------------------------------------------------------------------------------------------- every error
BASE = dict(num_processes=6, rollout_tp_size=2, train_batch_size=60, rollout_n=12)

# (id, arguments, rule, option)
ERROR_CASES = [
    ("zero batch", {**BASE, "train_batch_size": 0}, "positive_int", "train_batch_size"),
    ("missing batch", {**BASE, "train_batch_size": None}, "positive_int", "train_batch_size"),
    ("negative n", {**BASE, "rollout_n": -4}, "positive_int", "rollout_n"),
    ("string processes", {**BASE, "num_processes": "6"}, "positive_int", "num_processes"),
    ("float tp", {**BASE, "rollout_tp_size": 2.0}, "positive_int", "rollout_tp_size"),
    ("bool epochs", {**BASE, "ppo_epochs": True}, "positive_int", "ppo_epochs"),
    ("zero nnodes", {**BASE, "nnodes": 0}, "positive_int", "nnodes"),
    ("zero gpus", {**BASE, "num_processes": None, "n_gpus_per_node": 0}, "positive_int", "n_gpus_per_node"),
    ("zero micro", {**BASE, "ppo_micro_batch_size_per_device": 0}, "positive_int", "ppo_micro_batch_size_per_device"),
    ("zero token budget", {**BASE, "log_prob_max_token_len_per_device": 0}, "positive_int",
     "log_prob_max_token_len_per_device"),
    ("estimator not a name", {**BASE, "adv_estimator": None}, "estimator_name", "adv_estimator"),
    ("processes vs gpus", {**BASE, "n_gpus_per_node": 4}, "world_size_mismatch", "num_processes"),
    ("processes vs nodes", {**BASE, "num_processes": 7, "nnodes": 2, "rollout_tp_size": 1, "train_batch_size": 70},
     "processes_per_node", "num_processes"),
    ("tp vs processes", {**BASE, "rollout_tp_size": 4}, "tp_divides_world", "rollout_tp_size"),
    ("tp vs gpus per node", {**BASE, "num_processes": None, "n_gpus_per_node": 3, "nnodes": 2,
                             "rollout_tp_size": 4}, "tp_divides_world", "rollout_tp_size"),
    ("tp group across nodes", {**BASE, "num_processes": None, "n_gpus_per_node": 3, "nnodes": 2,
                               "rollout_tp_size": 2, "train_batch_size": 6}, "tp_within_node", "rollout_tp_size"),
    ("tp larger than world", {**BASE, "num_processes": 4, "rollout_tp_size": 8}, "tp_divides_world",
     "rollout_tp_size"),
    ("sp vs processes", {**BASE, "sequence_parallel_size": 4}, "sp_divides_world", "sequence_parallel_size"),
    ("n=1 with grpo", {**BASE, "rollout_n": 1}, "group_needs_n", "rollout_n"),
    ("n=1 with rloo", {**BASE, "rollout_n": 1, "adv_estimator": "rloo"}, "group_needs_n", "rollout_n"),
    ("more engines than prompts", {**BASE, "num_processes": 8, "rollout_tp_size": 1, "train_batch_size": 4,
                                   "rollout_n": 8}, "engines_exceed_prompts", "train_batch_size"),
    ("prompts vs engines", {**BASE, "train_batch_size": 50}, "prompts_divide_engines", "train_batch_size"),
    ("samples vs dp", {**BASE, "train_batch_size": 3, "rollout_n": 1, "adv_estimator": "remax"},
     "samples_divide_dp", "train_batch_size"),
    ("mini vs batch", {**BASE, "ppo_mini_batch_size": 7}, "mini_divides_batch", "ppo_mini_batch_size"),
    ("mini larger than batch", {**BASE, "ppo_mini_batch_size": 120}, "mini_divides_batch", "ppo_mini_batch_size"),
    ("mini normalizes to 0", {**BASE, "rollout_n": 1, "ppo_mini_batch_size": 5, "adv_estimator": "remax"},
     "mini_divides_dp", "ppo_mini_batch_size"),
    ("mini samples vs mini prompts", {**BASE, "ppo_mini_batch_size": 20, "ppo_mini_batch_samples": 100},
     "mini_samples_conflict", "ppo_mini_batch_samples"),
    ("mini samples vs ranks", {**BASE, "ppo_mini_batch_samples": 7}, "mini_samples_divide", "ppo_mini_batch_samples"),
    ("micro vs rollout share", {**BASE, "ppo_mini_batch_samples": 42, "ppo_micro_batch_size_per_device": 7},
     "micro_divides_rollout", "ppo_micro_batch_size_per_device"),
    ("micro vs mini", {**BASE, "ppo_micro_batch_size_per_device": 7}, "micro_divides_mini",
     "ppo_micro_batch_size_per_device"),
    ("log-prob both set", {**BASE, "log_prob_micro_batch_size": 48, "log_prob_micro_batch_size_per_device": 8},
     "micro_batch_both_set", "log_prob_micro_batch_size"),
    ("ref log-prob both set", {**BASE, "ref_log_prob_micro_batch_size": 48,
                               "ref_log_prob_micro_batch_size_per_device": 8},
     "micro_batch_both_set", "ref_log_prob_micro_batch_size"),
    ("log-prob normalizes to 0", {**BASE, "log_prob_micro_batch_size": 4}, "micro_batch_zero",
     "log_prob_micro_batch_size"),
    ("ref log-prob normalizes to 0", {**BASE, "ref_log_prob_micro_batch_size": 5}, "micro_batch_zero",
     "ref_log_prob_micro_batch_size"),
]


def _fix_is_named(message: str, option: str, change: dict) -> bool:
    key, val = next(iter(change.items()))
    if val is None:
        return f"unset {key}" in message
    shown = repr(val) if isinstance(val, str) else str(val)
    return shown in message and (key == option or key in message or key == "num_processes")


@pytest.mark.parametrize("kwargs,rule,option", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_every_error_names_option_value_rule_and_a_valid_fix(kwargs, rule, option):
    with pytest.raises(LayoutError) as info:
        build(**kwargs)
    err = info.value
    msg = str(err)
    assert err.rule == rule and err.option == option
    value = kwargs.get(option, getattr(err, "value", None))
    assert msg.startswith(f"{option}={value!r}" if isinstance(value, str) or value is None else f"{option}={value}")
    assert err.value == value
    assert err.fixes, msg
    for change in err.fixes:
        assert _fix_is_named(msg, option, change), (change, msg)
        fixed = build(**{**kwargs, **change})  # the fix gives a valid layout
        assert isinstance(fixed, RolloutLayout)


def test_every_rule_in_the_source_is_tested():
    here = Path(layout_mod.__file__)
    source = here.read_text() + (here.parent / "layout_rules.py").read_text()
    rules = set(re.findall(r'rule="([a-z_]+)"', source)) - {"rank_range", "engine_range", "sample_range",
                                                             "prompt_range"}
    assert rules == {c[2] for c in ERROR_CASES}


def test_specific_fixes():
    def fixes(**kw):
        with pytest.raises(LayoutError) as info:
            build(**kw)
        return info.value.fixes, str(info.value)

    f, msg = fixes(**{**BASE, "rollout_tp_size": 4})
    assert {"rollout_tp_size": 2} in f and {"rollout_tp_size": 3} in f and "4 or 8 processes" in msg
    f, msg = fixes(**{**BASE, "num_processes": "6"})
    assert f == ({"num_processes": 6},) and msg.endswith("use 6.")
    f, msg = fixes(**{**BASE, "rollout_n": 1})
    assert {"adv_estimator": "reinforce_plus_plus"} in f and "(8 or more is usual)" in msg
    f, msg = fixes(**{**BASE, "log_prob_micro_batch_size": 4})
    assert "6 (1 per device) or 48 (8 per device)" in msg
    assert {"log_prob_micro_batch_size_per_device": 8, "log_prob_micro_batch_size": None} in f


def test_fix_when_another_option_is_also_wrong_clears_this_rule():
    # train_batch_size=50 is wrong, and so are the log-prob options: no single change gives a valid layout.
    kw = {**BASE, "train_batch_size": 50, "log_prob_micro_batch_size": 48, "log_prob_micro_batch_size_per_device": 8}
    with pytest.raises(LayoutError) as info:
        build(**kw)
    err = info.value
    assert err.rule == "prompts_divide_engines" and err.fixes
    for change in err.fixes:
        with pytest.raises(LayoutError) as later:
            build(**{**kw, **change})
        assert later.value.stage > err.stage and later.value.rule == "micro_batch_both_set"


# ---------------------------------------------------------------------------------------------- properties
@st.composite
def valid_layouts(draw):
    engines = draw(st.integers(1, 8))
    tp = draw(st.integers(1, 4))
    world = engines * tp
    sp = draw(st.sampled_from(divisors(world)))
    dp = world // sp
    n = draw(st.integers(1, 16))
    est = draw(st.sampled_from(["grpo", "rloo", "reinforce_plus_plus"] if n > 1 else ["reinforce_plus_plus"]))
    step = math.lcm(engines, dp // math.gcd(dp, n))
    tbs = step * draw(st.integers(1, 6))
    mini = draw(st.sampled_from([d for d in divisors(tbs) if d * n % dp == 0]))
    micro = draw(st.sampled_from(divisors(mini * n // dp)))
    kw = dict(rollout_tp_size=tp, train_batch_size=tbs, rollout_n=n, ppo_mini_batch_size=mini,
              ppo_micro_batch_size_per_device=micro, ppo_epochs=draw(st.integers(1, 3)),
              sequence_parallel_size=sp, adv_estimator=est)
    nodes = draw(st.sampled_from(divisors(world // tp)))  # an engine's TP group never spans two nodes
    if draw(st.booleans()):
        kw.update(num_processes=world, nnodes=nodes)
    else:
        kw.update(n_gpus_per_node=world // nodes, nnodes=nodes)
    for prefix in ("log_prob", "ref_log_prob"):
        how = draw(st.sampled_from(["global", "device", "tokens", "none"]))
        if how == "global":
            kw[f"{prefix}_micro_batch_size"] = dp * draw(st.integers(1, 16)) + draw(st.integers(0, dp - 1))
        elif how == "device":
            kw[f"{prefix}_micro_batch_size_per_device"] = draw(st.integers(1, 40))
        elif how == "tokens":
            kw[f"{prefix}_max_token_len_per_device"] = draw(st.integers(256, 8192))
    return kw


def _partition(ranges, total):
    flat = [i for r in ranges for i in r]
    assert flat == list(range(total))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_layouts())
def test_properties_of_valid_layouts(kw):
    lay = build(**kw)
    world, tp, n, dp = lay.num_processes, lay.rollout_tp_size, lay.rollout_n, lay.data_parallel_size
    # samples conserved
    assert lay.total_samples == lay.train_batch_size * n == lay.num_engines * lay.samples_per_engine
    assert lay.total_samples == dp * lay.samples_per_rank
    assert lay.samples_per_engine == lay.prompts_per_engine * n
    # engines: consecutive TP groups partitioning the ranks; prompt and sample ranges partition the step
    _partition(lay.engine_ranks, world)
    assert all(len(g) == tp for g in lay.engine_ranks)
    assert all(lay.engine_of_rank(r) == e for e, g in enumerate(lay.engine_ranks) for r in g)
    _partition([lay.engine_prompt_range(e) for e in range(lay.num_engines)], lay.train_batch_size)
    _partition([lay.engine_sample_range(e) for e in range(lay.num_engines)], lay.total_samples)
    for e in range(lay.num_engines):
        groups = {lay.sample_group(s) for s in lay.engine_sample_range(e)}
        assert groups == set(lay.engine_prompt_range(e))
        assert all(lay.engine_of_prompt(p) == e for p in lay.engine_prompt_range(e))
    # groups are contiguous runs of n samples
    groups = [lay.sample_group(s) for s in range(lay.total_samples)]
    assert groups == [g for g in range(lay.train_batch_size) for _ in range(n)]
    # every rank's share is equal; data-parallel ranks partition the samples; a SP group shares one share
    shares = [lay.rank_sample_range(r) for r in range(world)]
    assert {len(s) for s in shares} == {lay.samples_per_rank}
    _partition(shares[:: lay.sequence_parallel_size], lay.total_samples)
    assert all(shares[r] == shares[r - r % lay.sequence_parallel_size] for r in range(world))
    # mini and micro batches cover the rank's share
    assert lay.gradient_accumulation_steps * lay.ppo_micro_batch_size_per_device == lay.mini_batch_samples_per_rank
    assert lay.optimizer_steps_per_rollout == lay.train_batch_size // lay.ppo_mini_batch_size * lay.ppo_epochs
    for r in range(world):
        share = lay.rank_sample_range(r)
        assert [i for m in lay.mini_batch_ranges(r) for i in m] == list(share)
        assert len(lay.mini_batch_ranges(r)) == lay.train_batch_size // lay.ppo_mini_batch_size
        for ref, mb in ((False, lay.old_log_prob), (True, lay.ref_log_prob)):
            micro = lay.micro_batch_ranges(r, ref=ref)
            assert [i for m in micro for i in m] == list(share)
            assert len(micro) == mb.num_micro_batches and all(1 <= len(m) <= mb.per_device for m in micro)
    # the per-device micro batch is what was asked for
    if kw.get("log_prob_micro_batch_size") is not None:
        assert lay.old_log_prob.per_device == kw["log_prob_micro_batch_size"] // dp
    if kw.get("log_prob_micro_batch_size_per_device") is not None:
        assert lay.old_log_prob.per_device == kw["log_prob_micro_batch_size_per_device"]
    json.dumps(lay.to_dict())
    assert lay.table()


@st.composite
def any_arguments(draw):
    opt = lambda s: st.one_of(st.none(), s)  # noqa: E731
    return dict(
        num_processes=draw(opt(st.integers(0, 12))),
        rollout_tp_size=draw(st.integers(1, 6)),
        train_batch_size=draw(st.integers(1, 64)),
        rollout_n=draw(st.integers(1, 16)),
        ppo_mini_batch_size=draw(opt(st.integers(1, 64))),
        ppo_micro_batch_size_per_device=draw(opt(st.integers(1, 32))),
        log_prob_micro_batch_size=draw(opt(st.integers(1, 64))),
        log_prob_micro_batch_size_per_device=draw(opt(st.integers(1, 16))),
        ref_log_prob_micro_batch_size=draw(opt(st.integers(1, 64))),
        sequence_parallel_size=draw(st.sampled_from([1, 1, 2, 3])),
        adv_estimator=draw(st.sampled_from(["grpo", "rloo", "remax", "reinforce_plus_plus"])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_arguments())
def test_any_arguments_give_a_layout_or_an_error_with_a_fix(kw):
    try:
        lay = build(**kw)
    except LayoutError as err:
        msg = str(err)
        assert err.option and msg.startswith(f"{err.option}=")
        assert err.fixes, msg
        for change in err.fixes:
            try:
                build(**{**kw, **change})
            except LayoutError as later:  # another option is wrong too: the fix must at least clear this rule
                assert later.stage > err.stage, (msg, change, str(later))
        return
    assert lay.total_samples == lay.data_parallel_size * lay.samples_per_rank
    assert lay.train_batch_size % lay.num_engines == 0
