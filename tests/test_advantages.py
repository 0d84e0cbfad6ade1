"""Advantage estimators: invariants (hypothesis) and hand-checked closed forms on tiny batches.

Rewards in the property tests are multiples of 0.5 (exact in float32), so sums, shifts and power-of-two scalings
are exact and the tolerances below only absorb the division by a group size or std.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.algos import advantages
from trl_nrollout.algos.advantages import available_estimators, compute_advantages, register_adv_est

FAST = settings(max_examples=25, deadline=None)

#: Estimators whose per-sample advantage is a function of the outcome reward (sum over the response).
OUTCOME = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline")
#: Estimators with a group baseline, for which a group of one or an all-equal group gives exactly 0.
GROUPED = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk")
ALL = (*OUTCOME, "reinforce_plus_plus", "remax")

HALVES = st.integers(-8, 8).map(lambda k: k / 2)  # rewards in {-4, -3.5, ..., 4}


@dataclass
class Batch:
    """A batch described in plain Python: per-sample outcome reward, group id and response length."""

    scores: list[float]
    groups: list[int]
    lengths: list[int]
    T: int

    @property
    def B(self) -> int:
        return len(self.scores)

    def mask(self) -> torch.Tensor:  # [B, T], a prefix of `length` ones per row
        return (torch.arange(self.T).unsqueeze(0) < torch.tensor(self.lengths).unsqueeze(1)).float()

    def rewards(self, scores: list[float] | None = None) -> torch.Tensor:  # [B, T], reward on the last token
        scores = self.scores if scores is None else scores
        out = torch.zeros(self.B, self.T)
        for i, (s, n) in enumerate(zip(scores, self.lengths, strict=True)):
            if n > 0:
                out[i, n - 1] = s
        return out

    def baselines(self, shift: float = 0.0, scale: float = 1.0) -> torch.Tensor:  # [B], for remax
        return torch.tensor([(0.25 * g + shift) * scale for g in self.groups])


@st.composite
def batches(draw, max_groups=4, max_size=6, max_len=5, min_len=1, values=HALVES) -> Batch:
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    n = sum(sizes)
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    groups = [groups[i] for i in draw(st.permutations(range(n)))]  # interleave the groups
    T = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(min(min_len, T), T), min_size=n, max_size=n))
    scores = draw(st.lists(values, min_size=n, max_size=n))
    return Batch(scores, groups, lengths, T)


def run(name: str, batch: Batch, rewards: torch.Tensor | None = None, index=None, baselines=None, **options):
    """Advantages of ``batch`` (``[B, T]``) under ``name``; remax gets a baseline per sample."""
    if name == "remax":
        options.setdefault("reward_baselines", batch.baselines() if baselines is None else baselines)
    rewards = batch.rewards() if rewards is None else rewards
    adv, _ = compute_advantages(name, rewards, batch.mask(), batch.groups if index is None else index, **options)
    return adv


def per_sample(adv: torch.Tensor, batch: Batch) -> list[float]:
    """The advantage of each sample (its first token; 0 for an empty response)."""
    return [float(adv[i, 0]) if n > 0 else 0.0 for i, n in enumerate(batch.lengths)]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg"])
@FAST
@given(batch=batches())
def test_group_sum_of_advantages_is_zero(name, batch):
    adv = per_sample(run(name, batch), batch)
    for g in set(batch.groups):
        members = [adv[i] for i in range(batch.B) if batch.groups[i] == g]
        assert abs(sum(members)) < 1e-4 * max(1.0, sum(abs(a) for a in members))


@FAST
@given(batch=batches())
def test_opo_length_weighted_sum_is_zero(batch):
    adv = per_sample(run("opo", batch), batch)
    for g in set(batch.groups):
        weighted = [batch.lengths[i] * adv[i] for i in range(batch.B) if batch.groups[i] == g]
        assert abs(sum(weighted)) < 1e-4 * max(1.0, sum(abs(w) for w in weighted))


@pytest.mark.parametrize("name", ALL)
@FAST
@given(batch=batches(), shift=st.integers(-5, 5))
def test_invariant_to_a_constant_shift_of_rewards(name, batch, shift):
    shifted = [s + shift for s in batch.scores]
    # reinforce_plus_plus (gamma=1): every return-to-go shifts by the same constant, which whitening removes.
    # remax: the greedy baseline shifts with the rewards.
    base = run(name, batch)
    moved = run(name, batch, rewards=batch.rewards(shifted), baselines=batch.baselines(shift=shift))
    close(moved, base)


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "reinforce_plus_plus_baseline", "reinforce_plus_plus"])
@FAST
@given(batch=batches(), scale=st.sampled_from([0.25, 0.5, 2.0, 3.0, 10.0]))
def test_normalized_estimators_are_invariant_to_positive_scaling(name, batch, scale):
    scaled = [s * scale for s in batch.scores]
    close(run(name, batch, rewards=batch.rewards(scaled)), run(name, batch))


@pytest.mark.parametrize("name", ["dr_grpo", "rloo", "opo", "gpg", "remax"])
@FAST
@given(batch=batches(min_len=0), scale=st.sampled_from([-2.0, 0.25, 0.5, 2.0, 3.0, 10.0]))
def test_unnormalized_estimators_scale_linearly(name, batch, scale):
    scaled = [s * scale for s in batch.scores]
    out = run(name, batch, rewards=batch.rewards(scaled), baselines=batch.baselines(scale=scale))
    close(out, scale * run(name, batch))


@FAST
@given(batch=batches(), scale=st.sampled_from([0.5, 2.0, 3.0]))
def test_grpo_passk_without_std_scales_linearly(batch, scale):
    scaled = [s * scale for s in batch.scores]
    out = run("grpo_passk", batch, rewards=batch.rewards(scaled), norm_adv_by_std_in_grpo=False)
    close(out, scale * run("grpo_passk", batch, norm_adv_by_std_in_grpo=False))


@pytest.mark.parametrize("name", ALL)
@FAST
@given(batch=batches(min_len=0), data=st.data())
def test_mask_is_respected(name, batch, data):
    # An arbitrary (not prefix) mask, with empty rows allowed, and garbage rewards where it is 0.
    def matrix(elements):
        row = st.lists(elements, min_size=batch.T, max_size=batch.T)
        return torch.tensor(data.draw(st.lists(row, min_size=batch.B, max_size=batch.B)), dtype=torch.float32)

    mask = matrix(st.booleans())
    rewards = matrix(HALVES)
    garbage = matrix(st.floats(-1e6, 1e6, width=32))
    dirty = torch.where(mask > 0, rewards, garbage)
    opts = {"reward_baselines": batch.baselines()} if name == "remax" else {}
    adv, ret = compute_advantages(name, rewards, mask, batch.groups, **opts)
    adv_dirty, ret_dirty = compute_advantages(name, dirty, mask, batch.groups, **opts)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    close(adv_dirty, adv, tol=1e-5)
    close(ret_dirty, ret, tol=1e-5)


@pytest.mark.parametrize("name", ALL)
@FAST
@given(
    batch=batches(max_size=8, min_len=0, values=st.floats(-10, 10, width=32)),
    kind=st.sampled_from(["singletons", "all_equal", "random"]),
    empty_rows=st.booleans(),
)
def test_degenerate_batches_give_finite_advantages(name, batch, kind, empty_rows):
    # Arbitrary float32 rewards: the mean of equal values is not always exactly that value in float32.
    if kind == "singletons":
        batch.groups = list(range(batch.B))
    elif kind == "all_equal":  # equal outcomes: an empty response has outcome 0, so keep responses non-empty
        batch.lengths = [max(1, n) for n in batch.lengths]
        first = {}
        batch.scores = [first.setdefault(g, s) for g, s in zip(batch.groups, batch.scores, strict=True)]
    if empty_rows:
        batch.lengths = [0] * batch.B
    adv = run(name, batch)
    assert torch.isfinite(adv).all()
    if (name in GROUPED and kind != "random") or empty_rows:
        assert torch.all(adv == 0), adv
    if name == "reinforce_plus_plus_baseline" and kind != "random":
        assert torch.all(adv == 0), adv  # every group constant: nothing left after centering


@pytest.mark.parametrize("name", ALL)
@FAST
@given(batch=batches(min_len=0), data=st.data())
def test_index_may_be_any_hashable_and_group_order_does_not_matter(name, batch, data):
    base = run(name, batch)
    # The same grouping spelled with strings, tuples, and a tensor of ints.
    close(run(name, batch, index=[f"prompt-{g}" for g in batch.groups]), base, tol=0)
    close(run(name, batch, index=[("uid", g * 7) for g in batch.groups]), base, tol=0)
    close(run(name, batch, index=torch.tensor(batch.groups)), base, tol=0)
    # Permuting the samples permutes the advantages.
    perm = data.draw(st.permutations(range(batch.B)))
    pick = lambda xs: [xs[i] for i in perm]  # noqa: E731
    permuted = Batch(pick(batch.scores), pick(batch.groups), pick(batch.lengths), batch.T)
    out = run(name, permuted, baselines=batch.baselines()[perm])
    close(out, base[perm], tol=1e-5)


@pytest.mark.parametrize("name", OUTCOME)
@FAST
@given(batch=batches(), data=st.data())
def test_rewards_spread_over_tokens_equal_reward_on_last_token(name, batch, data):
    spread = torch.zeros(batch.B, batch.T)
    totals = []
    for i, n in enumerate(batch.lengths):
        pieces = data.draw(st.lists(HALVES, min_size=n, max_size=n))
        spread[i, :n] = torch.tensor(pieces)
        totals.append(sum(pieces))
    close(run(name, batch, rewards=spread), run(name, batch, rewards=batch.rewards(totals)), tol=1e-5)


@pytest.mark.parametrize("name", OUTCOME)
@FAST
@given(batch=batches())
def test_outcome_advantage_is_the_same_on_every_token_of_a_sample(name, batch):
    adv = run(name, batch)
    for i, n in enumerate(batch.lengths):
        assert torch.all(adv[i, :n] == adv[i, 0])


@FAST
@given(batch=batches())
def test_rloo_is_reward_minus_mean_of_the_others(batch):
    adv = per_sample(run("rloo", batch), batch)
    for i in range(batch.B):
        others = [batch.scores[j] for j in range(batch.B) if j != i and batch.groups[j] == batch.groups[i]]
        expected = batch.scores[i] - sum(others) / len(others) if others else 0.0
        assert adv[i] == pytest.approx(expected, abs=1e-4)


@FAST
@given(batch=batches())
def test_grpo_passk_only_the_unique_best_of_a_group_gets_advantage(batch):
    adv = per_sample(run("grpo_passk", batch, norm_adv_by_std_in_grpo=False), batch)
    for g in set(batch.groups):
        members = [i for i in range(batch.B) if batch.groups[i] == g]
        ranked = sorted((batch.scores[i] for i in members), reverse=True)
        gap = ranked[0] - ranked[1] if len(ranked) > 1 else 0.0
        for i in members:
            best = batch.scores[i] == ranked[0] and gap > 0
            assert adv[i] == pytest.approx(gap if best else 0.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------- closed forms
def outcome_batch(scores, index, lengths=None, T=3):
    lengths = [T] * len(scores) if lengths is None else lengths
    batch = Batch(list(scores), list(index), list(lengths), T)
    return batch


def test_grpo_two_samples_is_plus_minus_one_over_root_two():
    adv = run("grpo", outcome_batch([1.0, 0.0], [0, 0]))
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)  # std of {1, 0} (Bessel) = sqrt(1/2)
    assert expected == pytest.approx(0.7071, abs=1e-4)
    close(adv, torch.tensor([[expected] * 3, [-expected] * 3]), tol=1e-6)


def test_grpo_dr_grpo_rloo_of_one_two_three():
    batch = outcome_batch([1.0, 2.0, 3.0], ["q", "q", "q"])

    def col(xs):  # one advantage per sample, on each of its 3 tokens
        return torch.tensor(xs).unsqueeze(-1).expand(3, 3)

    close(run("rloo", batch), col([1 - 2.5, 2 - 2.0, 3 - 1.5]), tol=1e-6)  # [-1.5, 0, 1.5]
    close(run("dr_grpo", batch), col([-1.0, 0.0, 1.0]), tol=1e-6)
    close(run("grpo", batch), col([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)]), tol=1e-6)  # std = 1
    close(run("grpo", batch, norm_adv_by_std_in_grpo=False), run("dr_grpo", batch), tol=0)


def test_grpo_batch_std_scope():
    batch = outcome_batch([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], T=1)
    std = statistics.stdev([1.0, 0.0, 3.0, 3.0])
    expected = torch.tensor([[0.5 / (std + 1e-6)], [-0.5 / (std + 1e-6)], [0.0], [0.0]])
    close(run("grpo", batch, std_scope="batch"), expected, tol=1e-6)
    with pytest.raises(ValueError, match="std_scope"):
        run("grpo", batch, std_scope="nope")


def test_opo_length_weighted_baseline():
    # Baseline = (1 * 1 + 3 * 0) / (1 + 3) = 0.25.
    adv = run("opo", outcome_batch([1.0, 0.0], [0, 0], lengths=[1, 3]))
    close(adv, torch.tensor([[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]]), tol=1e-6)


def test_grpo_passk_best_sample_gap():
    batch = outcome_batch([1.0, 0.0, 0.5], [0, 0, 0], T=1)
    close(run("grpo_passk", batch, norm_adv_by_std_in_grpo=False), torch.tensor([[0.5], [0.0], [0.0]]), tol=1e-6)
    std = statistics.stdev([1.0, 0.0, 0.5])  # 0.5
    close(run("grpo_passk", batch), torch.tensor([[0.5 / (std + 1e-6)], [0.0], [0.0]]), tol=1e-6)
    ties = outcome_batch([1.0, 1.0, 0.0], [0, 0, 0], T=1)
    assert torch.all(run("grpo_passk", ties) == 0)


def test_gpg_rescales_by_the_informative_fraction():
    # Group a = {1, 0} is informative, group b = {1, 1} is not: alpha = B / M = 4 / 2.
    adv = run("gpg", outcome_batch([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], T=1))
    close(adv, torch.tensor([[1.0], [-1.0], [0.0], [0.0]]), tol=1e-6)


def test_remax_return_to_go_minus_greedy_reward():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 1.0 of row 2 is outside its response
    adv, ret = compute_advantages("remax", rewards, mask, [0, 1], reward_baselines=torch.tensor([1.0, 0.5]))
    close(ret, torch.tensor([[6.0, 5.0, 3.0], [0.0, 0.0, 0.0]]), tol=0)
    close(adv, torch.tensor([[5.0, 4.0, 2.0], [-0.5, -0.5, 0.0]]), tol=0)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages("remax", rewards, mask, [0, 1])


def test_reinforce_plus_plus_discounted_return_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, [0, 1], gamma=0.5)
    returns = [0.25, 0.5, 1.0, 1.0, 2.0]  # G_t = r_t + 0.5 G_{t+1}, over the 5 response tokens
    mean, std = statistics.mean(returns), statistics.stdev(returns)
    white = [(g - mean) / math.sqrt(std**2 + 1e-8) for g in returns]
    close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), tol=1e-6)
    close(adv, torch.tensor([white[:3], [*white[3:], 0.0]]), tol=1e-5)


def test_reinforce_plus_plus_baseline_group_centering_then_batch_whitening():
    # Group 0: {1, 0} -> centered {0.5, -0.5}; group 1: {2, 2} -> {0, 0}. Lengths 2, 1, 1, 2 tokens.
    batch = outcome_batch([1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1], lengths=[2, 1, 1, 2], T=2)
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)
    w = [(x - mean) / math.sqrt(std**2 + 1e-8) for x in (0.5, -0.5, 0.0)]
    expected = torch.tensor([[w[0], w[0]], [w[1], 0.0], [w[2], 0.0], [w[2], w[2]]])
    close(run("reinforce_plus_plus_baseline", batch), expected, tol=1e-5)


def test_singleton_and_all_equal_groups_are_zero_even_when_other_groups_are_not():
    # 0.7 x 7 used to give GRPO advantages of 0.056 (the float32 mean of seven 0.7 is off by an ulp).
    scores = [0.7] * 7 + [5.0] + [1.0, 0.0]
    batch = outcome_batch(scores, [0] * 7 + [1] + [2, 2], T=2)
    for name in GROUPED:
        adv = run(name, batch)
        assert torch.all(adv[:8] == 0), (name, adv)
        assert torch.all(adv[8:] != 0) or name == "grpo_passk", (name, adv)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7])
def test_reinforce_plus_plus_of_equal_returns_is_zero(value):
    # One equal reward per sample on its last token (gamma = 1): every return-to-go equals it, nothing to whiten;
    # the float32 mean of many 0.7 is not exactly 0.7, and ulp / sqrt(1e-8) would not be zero.
    for n in range(1, 13):
        batch = outcome_batch([value] * n, list(range(n)), lengths=[1 + i % 3 for i in range(n)], T=3)
        for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
            assert torch.all(run(name, batch) == 0), (name, n)


# ---------------------------------------------------------------------------------------------- registry / errors
def test_registry_lists_every_documented_estimator():
    assert set(available_estimators()) >= {*ALL, "gae"}
    assert set(advantages.ESTIMATOR_TABLE) == {*ALL, "gae"}


def test_unknown_estimator_names_the_known_ones():
    with pytest.raises(ValueError, match="grpo"):
        compute_advantages("nope", torch.zeros(1, 1), torch.ones(1, 1), [0])


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="response_len"):
        compute_advantages("grpo", torch.zeros(2, 3), torch.ones(2, 2), [0, 0])
    with pytest.raises(ValueError, match="index has 1 entries"):
        compute_advantages("grpo", torch.zeros(2, 3), torch.ones(2, 3), [0])
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages("grpo", torch.tensor([[float("nan")], [0.0]]), torch.ones(2, 1), [0, 0])


def test_register_a_custom_estimator():
    name = "test_only_plus_one"

    @register_adv_est(name)
    def plus_one(rewards, mask, index):
        ones = torch.ones_like(rewards)
        return ones, 2 * ones

    try:
        adv, ret = compute_advantages(name, torch.zeros(2, 2), torch.tensor([[1.0, 0.0], [1.0, 1.0]]), [0, 1])
        close(adv, torch.tensor([[1.0, 0.0], [1.0, 1.0]]), tol=0)  # the mask is applied by compute_advantages
        close(ret, torch.tensor([[2.0, 0.0], [2.0, 2.0]]), tol=0)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est(name)(plus_one)
    finally:
        advantages._REGISTRY.pop(name, None)



@settings(max_examples=60, deadline=None)
@given(data=st.data(), groups=st.integers(1, 4), n=st.integers(2, 5), funcs=st.integers(1, 3))
def test_normalize_then_sum_is_gdpo(data, groups, n, funcs):
    """TRL's normalize_then_sum (GDPO), against a loop over groups and functions: each function's rewards are
    normalized in their group (NaN: the function does not apply), weighted, summed, then normalized over the batch."""
    from trl_nrollout.algos.advantages import normalize_then_sum

    value = st.one_of(st.none(), st.integers(-5, 5).map(float))  # a grid: no float32 near-ties
    raw = data.draw(st.lists(st.lists(value, min_size=funcs, max_size=funcs), min_size=groups * n,
                             max_size=groups * n))
    weights = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=funcs, max_size=funcs))
    rewards = torch.tensor([[float("nan") if v is None else v for v in row] for row in raw])
    got = normalize_then_sum(rewards, torch.tensor(weights), n)

    def std(xs):  # Bessel-corrected; NaN for fewer than two values (as TRL's nanstd)
        if len(xs) < 2:
            return float("nan")
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    sums = []
    for i, row in enumerate(raw):
        total, applies = 0.0, False
        for f, v in enumerate(row):
            if v is None:
                continue
            applies = True
            group = [raw[j][f] for j in range((i // n) * n, (i // n + 1) * n) if raw[j][f] is not None]
            s = std(group)
            if not math.isnan(s):
                total += weights[f] * (v - sum(group) / len(group)) / (s + 1e-4)
        sums.append(total if applies else None)
    valid = [s for s in sums if s is not None]
    for s, g in zip(sums, got.tolist()):
        if s is None or len(valid) < 2:
            assert math.isnan(g)
        else:
            expected = (s - sum(valid) / len(valid)) / (std(valid) + 1e-4)
            assert g == pytest.approx(expected, rel=1e-3, abs=1e-3)


# ---------------------------------------------------------------------------------------------- multi-turn inputs
@st.composite
def tool_rows(draw, max_rows=6, max_len=7):
    """Completions with tool masks: each token sampled (1) or a tool result (0); some rows without a mask."""
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        length = draw(st.integers(0, max_len))
        tools = draw(st.one_of(st.none(), st.lists(st.integers(0, 1), min_size=length, max_size=length)))
        rows.append((list(range(100, 100 + length)), tools))
    return rows


@FAST
@given(rows=tool_rows(), data=st.data())
def test_outcome_rewards_land_on_the_last_sampled_token(rows, data):
    """Each row's reward sits on its last sampled token (not on a trailing tool result), so every outcome
    estimator sees the sample's full reward over the response mask; rows with no sampled token get none."""
    from trl_nrollout.algos.advantages import outcome_token_rewards, response_mask

    width = max([len(c) for c, _ in rows] + [1])
    mask = response_mask([c for c, _ in rows], [t for _, t in rows], width)
    scores = torch.tensor(data.draw(st.lists(HALVES, min_size=len(rows), max_size=len(rows))))
    rewards = outcome_token_rewards(scores, mask)
    for i, (ids, tools) in enumerate(rows):
        sampled = [k for k in range(len(ids)) if tools is None or tools[k]]
        assert mask[i].tolist() == [1.0 if k in sampled else 0.0 for k in range(width)]
        expected = [0.0] * width
        if sampled:
            expected[sampled[-1]] = float(scores[i])
        assert rewards[i].tolist() == expected
    # whitening-based estimators take their statistics over sampled tokens only
    adv, _ = compute_advantages("reinforce_plus_plus", rewards, mask, list(range(len(rows))))
    if mask.sum() > 1 and bool((adv != 0).any()):
        assert float((adv * mask).sum() / mask.sum()) == pytest.approx(0.0, abs=1e-5)
    assert bool((adv[mask == 0] == 0).all())


def test_response_mask_refuses_a_tool_mask_of_another_length():
    from trl_nrollout.algos.advantages import response_mask

    with pytest.raises(ValueError, match="tool mask has 2 entries for 3 completion tokens"):
        response_mask([[1, 2, 3]], [[1, 0]], 3)
