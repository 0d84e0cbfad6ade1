"""The pure group-selection helpers (trl_nrollout.algos.batching): DAPO's constant groups, selection, balance."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from trl_nrollout.algos.batching import balance_groups, constant_groups, select_groups

NAN = math.nan


def test_constant_groups_ignore_unscorable_samples():
    rewards = [1.0, 1.0, 0.0, 1.0, NAN, 2.0, NAN, NAN, 3.0, NAN]
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # 0: all equal; 1: varied; 2: one scorable sample; 3: none scorable; 4: one scorable
    assert constant_groups(rewards, groups) == {0, 2, 3, 4}


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 1.0, 2.0, NAN])), min_size=1, max_size=40))
def test_constant_groups_property(samples):
    groups = [g for g, _ in samples]
    rewards = [r for _, r in samples]
    const = constant_groups(rewards, groups)
    for g in set(groups):
        scorable = {r for gg, r in samples if gg == g and r == r}
        assert (g in const) == (len(scorable) <= 1)


def test_select_and_balance():
    chosen, filler = select_groups([0, 1, 2, 3], {1, 3}, 3)
    assert chosen == [0, 2, 1] and filler == 1
    ranks = balance_groups([10, 1, 1, 10], 2)
    assert sorted(g for r in ranks for g in r) == [0, 1, 2, 3] and all(len(r) == 2 for r in ranks)
    assert {tuple(r) for r in ranks} == {(0, 1), (2, 3)} or {tuple(r) for r in ranks} == {(0, 2), (1, 3)}
