"""Policy losses, KL estimators, loss aggregation and KL controllers: hand-checked cases and invariants.

Every expected number is computed in the test with plain Python arithmetic (``math``), never by the code under
test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trl_nrollout.algos.losses import (
    KL_KINDS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    entropy_bonus,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
)

FAST = settings(max_examples=30, deadline=None)
LOGP = st.floats(-4.0, 0.0, width=32)  # a token's log-probability


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def one(x: float) -> torch.Tensor:  # [1, 1]
    return torch.tensor([[x]], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- KL
def test_kl_values_by_hand():
    # p = 0.5 under the policy, 0.25 under the reference: log p - log p_ref = log 2; r = p_ref / p = 1/2.
    logp, ref = one(math.log(0.5)), one(math.log(0.25))
    expected = {
        "k1": math.log(2),
        "abs": math.log(2),
        "k2": 0.5 * math.log(2) ** 2,
        "k3": 0.5 - math.log(0.5) - 1,  # r - log r - 1 = 0.1931
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for kind in KL_KINDS:
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(expected[aliases.get(kind, kind)], abs=1e-6)
    # The other direction: k1 goes negative, abs and k2 stay symmetric, k3 = 2 - log 2 - 1.
    assert kl_penalty(ref, logp, "k1").item() == pytest.approx(-math.log(2), abs=1e-6)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(math.log(2), abs=1e-6)
    assert kl_penalty(ref, logp, "k3").item() == pytest.approx(2 - math.log(2) - 1, abs=1e-6)


def test_k3_is_clamped():
    # log r = 15 -> r - log r - 1 is about 3.3e6, clamped to 10.
    assert kl_penalty(one(-15.0), one(0.0), "k3").item() == 10.0


@FAST
@given(logp=LOGP, ref=LOGP)
def test_kl_estimators_relations(logp, ref):
    a, b = one(logp), one(ref)
    d = logp - ref
    assert kl_penalty(a, b, "k1").item() == pytest.approx(d, abs=1e-5)
    assert kl_penalty(a, b, "abs").item() == pytest.approx(abs(d), abs=1e-5)
    assert kl_penalty(a, b, "k2").item() == pytest.approx(0.5 * d * d, abs=1e-5)
    k3 = kl_penalty(a, b, "k3").item()
    assert k3 >= -1e-7  # exp(d) - 1 - d in float32: a rounding of 6e-8 below 0 at |d| ~ 3e-6 (found by hypothesis)
    assert k3 == pytest.approx(min(math.exp(-d) + d - 1, 10.0), rel=1e-4, abs=1e-5)  # clamped at 10
    assert kl_penalty(a, a, "k3").item() == 0.0


@FAST
@given(
    logits_p=st.lists(st.floats(-0.75, 0.75), min_size=2, max_size=4),
    logits_q=st.lists(st.floats(-0.75, 0.75), min_size=4, max_size=4),
)
def test_k1_and_k3_are_unbiased_estimates_of_kl(logits_p, logits_q):
    # Expectation under the policy p, summed exactly over a small vocabulary: E_p[k1] = E_p[k3] = KL(p || q).
    # (Logits stay small so that no k3 term reaches its clamp at 10.)
    v = len(logits_p)
    zp = sum(math.exp(x) for x in logits_p)
    zq = sum(math.exp(x) for x in logits_q[:v])
    p = [math.exp(x) / zp for x in logits_p]
    q = [math.exp(x) / zq for x in logits_q[:v]]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    logp = torch.tensor([[math.log(x) for x in p]], dtype=torch.float64)
    logq = torch.tensor([[math.log(x) for x in q]], dtype=torch.float64)
    weights = torch.tensor([p], dtype=torch.float64)
    for kind in ("k1", "k3"):
        assert (weights * kl_penalty(logp, logq, kind)).sum().item() == pytest.approx(kl, abs=1e-9)


@pytest.mark.parametrize("kind", KL_KINDS)
@FAST
@given(logp=st.lists(LOGP, min_size=1, max_size=5), ref=st.lists(LOGP, min_size=5, max_size=5))
def test_straight_through_has_its_own_value_and_k2_gradient(kind, logp, ref):
    ref = ref[: len(logp)]
    x = torch.tensor([logp], requires_grad=True)
    y = torch.tensor([ref])
    value = kl_penalty(x, y, kind + "+")
    torch.testing.assert_close(value.detach(), kl_penalty(x, y, kind).detach(), rtol=0, atol=0)
    value.sum().backward()
    k2_grad = [a - b for a, b in zip(x.detach()[0].tolist(), ref, strict=True)]  # d/dx 0.5 (x - y)^2
    torch.testing.assert_close(x.grad[0], torch.tensor(k2_grad), rtol=1e-5, atol=1e-6)


def test_straight_through_changes_the_gradient_of_k3():
    x = one(math.log(0.5)).requires_grad_()
    kl_penalty(x, one(math.log(0.25)), "k3").sum().backward()
    # d/dx (exp(y - x) - (y - x) - 1) = 1 - exp(y - x) = 1 - 0.5
    assert x.grad.item() == pytest.approx(0.5, abs=1e-6)
    x.grad = None
    kl_penalty(x, one(math.log(0.25)), "k3+").sum().backward()
    assert x.grad.item() == pytest.approx(math.log(2), abs=1e-6)  # k2's: x - y


def test_unknown_kl_kind():
    for kind in ("k4", "k4+", "full"):
        with pytest.raises(ValueError, match="kl kind"):
            kl_penalty(one(0.0), one(0.0), kind)


# ---------------------------------------------------------------------------------------------- aggregation
LOSS = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
MASK = t([1.0, 1.0, 0.0], [1.0, 0.0, 0.0])


def test_agg_loss_modes_on_a_small_matrix():
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(((1 + 2) + 4) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(((1 + 2) / 2 + 4 / 1) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((1 + 2 + 4) / (2 * 3))
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(7 / 20)
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=14).item() == pytest.approx(7 / 14)
    assert agg_loss(LOSS, MASK, "token-mean-micro", num_tokens=14).item() == pytest.approx(7 / 3)  # its own tokens
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(7 / 7)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "token-sum-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_ignores_fully_masked_rows_and_masked_values(mode):
    # A padding row (mask all 0, even holding NaN/inf) neither adds to the loss nor counts as a sequence.
    padded_loss = torch.cat([LOSS, t([float("nan"), float("inf"), 100.0])])
    padded_mask = torch.cat([MASK, t([0.0, 0.0, 0.0])])
    dirty = LOSS.clone()
    dirty[MASK == 0] = float("nan")
    base = agg_loss(LOSS, MASK, mode)
    assert agg_loss(padded_loss, padded_mask, mode).item() == pytest.approx(base.item())
    assert agg_loss(dirty, MASK, mode).item() == pytest.approx(base.item())
    assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


@pytest.mark.parametrize("mode", [m for m in LOSS_AGG_MODES if m != "token-mean-micro"])  # bnpo: per micro batch
@FAST
@given(data=st.data(), B=st.integers(2, 6), T=st.integers(1, 5))
def test_micro_batches_with_global_denominators_add_up(mode, data, B, T):
    loss = torch.tensor(data.draw(st.lists(st.lists(st.floats(-5, 5), min_size=T, max_size=T), min_size=B, max_size=B)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)))
    cut = data.draw(st.integers(1, B - 1))
    totals = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum(), "norm_length": T}
    full = agg_loss(loss, mask, mode, norm_length=T)
    parts = agg_loss(loss[:cut], mask[:cut], mode, **totals) + agg_loss(loss[cut:], mask[cut:], mode, **totals)
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- PPO loss
def ppo(logp: float, old: float, adv: float, **kw):
    return policy_loss(one(logp), one(old), one(adv), one(1.0), **kw)


@pytest.mark.parametrize(
    ("ratio", "adv", "expected", "clipped"),
    [
        (1.5, 1.0, -1.2, 1.0),  # A > 0, ratio above 1 + 0.2: the gain is capped at 1.2 A
        (0.5, 1.0, -0.5, 0.0),  # A > 0, ratio below 1 - 0.2: pessimistic unclipped term
        (0.5, -1.0, 0.8, 1.0),  # A < 0, ratio below 0.8: loss held at 0.8 |A|
        (1.5, -1.0, 1.5, 0.0),  # A < 0, ratio above 1.2 but below c = 3: unclipped
        (1.1, 2.0, -2.2, 0.0),  # inside the trust region
        (1.0, 0.0, 0.0, 0.0),
    ],
)
def test_ppo_clip_cases(ratio, adv, expected, clipped):
    out = ppo(math.log(ratio), 0.0, adv, clip_ratio_low=0.2)
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert out.clipfrac.item() == clipped
    assert out.clipfrac_lower.item() == 0.0
    assert out.approx_kl.item() == pytest.approx(-math.log(ratio), abs=1e-6)
    assert out.ratio_mean.item() == pytest.approx(ratio, abs=1e-5)


def test_clip_higher_is_asymmetric():
    # DAPO: low 0.2, high 0.28.
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    assert ppo(math.log(1.25), 0.0, 1.0, **kw).loss.item() == pytest.approx(-1.25, abs=1e-5)  # inside
    assert ppo(math.log(1.5), 0.0, 1.0, **kw).loss.item() == pytest.approx(-1.28, abs=1e-5)
    assert ppo(math.log(0.7), 0.0, -1.0, **kw).loss.item() == pytest.approx(0.8, abs=1e-5)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    out = ppo(math.log(5.0), 0.0, -1.0, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(3.0, abs=1e-5)  # min(max(5, 1.2), 3)
    assert out.clipfrac_lower.item() == 1.0
    assert ppo(math.log(5.0), 0.0, -1.0, clip_ratio_c=None).loss.item() == pytest.approx(5.0, abs=1e-4)
    # Positive advantages are never dual-clipped.
    assert ppo(math.log(5.0), 0.0, 1.0, clip_ratio_c=3.0).loss.item() == pytest.approx(-1.2, abs=1e-5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo(0.0, 0.0, 1.0, clip_ratio_c=1.0)


def test_ppo_gradient_is_zero_where_clipped():
    # Tokens: inside (ratio 1.1, A 1), clipped (1.5, A 1), dual-clipped (5, A -1), inside (0.9, A -1).
    ratios, advs = [1.1, 1.5, 5.0, 0.9], [1.0, 1.0, -1.0, -1.0]
    logp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    out = policy_loss(logp, torch.zeros(1, 4), torch.tensor([advs]), torch.ones(1, 4), clip_ratio_low=0.2)
    assert out.loss.item() == pytest.approx((-1.1 - 1.2 + 3.0 + 0.9) / 4, abs=1e-5)
    assert out.clipfrac.item() == pytest.approx(1 / 4)  # only the second token (dual clip counts separately)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 4)
    out.loss.backward()
    # d/dlogp of -A exp(logp - old) / 4 tokens = -A ratio / 4 where unclipped, 0 where clipped.
    expected = [-1.0 * 1.1 / 4, 0.0, 0.0, 0.9 / 4]
    torch.testing.assert_close(logp.grad[0], torch.tensor(expected), rtol=1e-5, atol=1e-6)


@FAST
@given(
    logp=LOGP,
    old=LOGP,
    adv=st.floats(-3, 3, width=32),
    low=st.floats(0.05, 0.4),
    extra=st.floats(0.0, 0.3),
    c=st.one_of(st.none(), st.floats(1.5, 5.0)),
)
def test_ppo_single_token_matches_the_formula(logp, old, adv, low, extra, c):
    high = low + extra
    out = ppo(logp, old, adv, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    r = math.exp(logp - old)
    clipped_r = min(max(r, 1 - low), 1 + high)
    expected = max(-adv * r, -adv * clipped_r)
    if c is not None and adv < 0:
        assert out.loss.item() <= -adv * c + 1e-4  # the dual-clip bound
        expected = min(expected, -adv * c)
    assert out.loss.item() == pytest.approx(expected, rel=1e-4, abs=1e-4)


@FAST
@given(data=st.data(), B=st.integers(1, 4), T=st.integers(1, 5))
def test_ppo_values_outside_the_mask_change_nothing(data, B, T):
    def matrix(elements):
        return torch.tensor(data.draw(st.lists(st.lists(elements, min_size=T, max_size=T), min_size=B, max_size=B)))

    logp, old, adv = matrix(LOGP), matrix(LOGP), matrix(st.floats(-2, 2, width=32))
    mask = matrix(st.booleans()).float()
    junk = matrix(st.floats(-50, 50, width=32))
    for level in ("token", "sequence"):
        for mode in LOSS_AGG_MODES:
            a = policy_loss(logp, old, adv, mask, ratio_level=level, loss_agg_mode=mode)
            b = policy_loss(
                torch.where(mask > 0, logp, junk), torch.where(mask > 0, old, -junk), torch.where(mask > 0, adv, junk),
                mask, ratio_level=level, loss_agg_mode=mode,
            )
            for field in ("loss", "clipfrac", "clipfrac_lower", "approx_kl", "ratio_mean"):
                torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GSPO
def test_gspo_ratio_is_the_geometric_mean_of_token_ratios():
    # Token log-ratios +0.2 and -0.2: token ratios 1.2214 / 0.8187, sequence ratio exp(0) = 1.
    logp, old = t([0.2 - 1.0, -0.2 - 1.0]), t([-1.0, -1.0])
    adv, mask = t([1.0, 1.0]), t([1.0, 1.0])
    seq = policy_loss(logp, old, adv, mask, ratio_level="sequence", loss_agg_mode="seq-mean-token-mean")
    tok = policy_loss(logp, old, adv, mask, ratio_level="token", loss_agg_mode="seq-mean-token-mean")
    assert seq.loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert seq.clipfrac.item() == 0.0
    assert tok.loss.item() == pytest.approx(-(1.2 + math.exp(-0.2)) / 2, abs=1e-5)  # e^0.2 clipped to 1.2
    assert tok.clipfrac.item() == pytest.approx(0.5)


def test_gspo_clips_the_whole_sequence():
    logp = t([math.log(1.5), math.log(1.5), 0.0])  # sequence ratio exp(mean(log 1.5, log 1.5)) = 1.5
    out = policy_loss(logp, torch.zeros(1, 3), t([1.0, 1.0, 1.0]), t([1.0, 1.0, 0.0]), ratio_level="sequence")
    assert out.loss.item() == pytest.approx(-1.2, abs=1e-5)
    assert out.clipfrac.item() == 1.0
    assert out.ratio_mean.item() == pytest.approx(1.5, abs=1e-5)


@FAST
@given(data=st.data(), B=st.integers(1, 4), T=st.integers(1, 5))
def test_gspo_value_and_gradient_per_sequence(data, B, T):
    logp = [data.draw(st.lists(st.floats(-2, 0, width=32), min_size=T, max_size=T)) for _ in range(B)]
    old = [data.draw(st.lists(st.floats(-2, 0, width=32), min_size=T, max_size=T)) for _ in range(B)]
    lengths = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    adv = data.draw(st.lists(st.floats(-2, 2, width=32), min_size=B, max_size=B))
    mask = [[1.0 if j < n else 0.0 for j in range(T)] for n in lengths]
    x = torch.tensor(logp, requires_grad=True)
    out = policy_loss(
        x, torch.tensor(old), torch.tensor(adv).unsqueeze(-1).expand(B, T), torch.tensor(mask),
        ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.999, clip_ratio_high=1e3,
        clip_ratio_c=None,
    )
    s = [math.exp(sum(logp[i][j] - old[i][j] for j in range(n)) / n) for i, n in enumerate(lengths)]
    assert out.loss.item() == pytest.approx(-sum(a * si for a, si in zip(adv, s, strict=True)) / B, rel=1e-4, abs=1e-5)
    ratio_mean = sum(n * si for n, si in zip(lengths, s, strict=True)) / sum(lengths)
    assert out.ratio_mean.item() == pytest.approx(ratio_mean, rel=1e-4)
    out.loss.backward()
    # d loss / d logp[i, t] = -A_i s_i / (|y_i| B) on the response, as d s_i / d logp[i, t] = s_i / |y_i|.
    expected = [[-adv[i] * s[i] / (n * B) if j < n else 0.0 for j in range(T)] for i, n in enumerate(lengths)]
    torch.testing.assert_close(x.grad, torch.tensor(expected), rtol=1e-4, atol=1e-6)


def test_unknown_ratio_level():
    with pytest.raises(ValueError, match="ratio_level"):
        ppo(0.0, 0.0, 1.0, ratio_level="sentence")


# ---------------------------------------------------------------------------------------------- entropy
def test_entropy():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])  # [1, 2, V=4]
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), 0.0]]), rtol=1e-5, atol=1e-6)
    assert entropy_bonus(ent, t([1.0, 1.0]), coeff=0.1).item() == pytest.approx(-0.1 * math.log(4) / 2)
    assert entropy_bonus(ent, t([1.0, 1.0]), coeff=0.0).item() == 0.0


# ---------------------------------------------------------------------------------------------- KL controllers
def test_adaptive_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.15, n_steps=10)  # error 0.5, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))
    ctl.update(current_kl=0.1, n_steps=10)
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=100)


@FAST
@given(kl=st.floats(0, 10), target=st.floats(0.01, 1), steps=st.integers(1, 1000))
def test_adaptive_controller_moves_beta_towards_the_target(kl, target, steps):
    assume(abs(kl / target - 1) > 1e-6)
    ctl = AdaptiveKLController(init_kl_coef=0.05, target_kl=target, horizon=10_000)
    ctl.update(kl, steps)
    if kl > target:
        assert ctl.value > 0.05
    elif kl < target:
        assert ctl.value < 0.05
    assert abs(ctl.value / 0.05 - 1) <= 0.2 * steps / 10_000 + 1e-12  # bounded step


def test_fixed_controller_and_kl_in_reward():
    ctl = FixedKLController(0.5)
    ctl.update(current_kl=100.0, n_steps=10)
    assert ctl.value == 0.5
    scores = t([0.0, 1.0], [0.0, 2.0])
    mask = t([1.0, 1.0], [1.0, 0.0])
    ref = torch.zeros(2, 2)
    logp = t([0.5, 0.25], [1.0, 7.0])  # k1 = logp - ref
    rewards, seq_kl = apply_kl_penalty(scores, logp, ref, mask, ctl, kind="k1")
    torch.testing.assert_close(rewards, t([0.0 - 0.25, 1.0 - 0.125], [0.0 - 0.5, 2.0]))
    assert seq_kl == pytest.approx(((0.5 + 0.25) / 2 + 1.0 / 1) / 2)


# ---------------------------------------------------------------------------------------------- TRL's loss family
@FAST
@given(logp=LOGP, adv=st.floats(-3, 3, width=32).filter(lambda a: abs(a) > 1e-3),
       tau=st.floats(0.25, 3.0, width=32))
def test_sapo_has_ppos_gradient_on_policy(logp, adv, tau):
    """At ratio 1 SAPO's soft gate has slope 1: its gradient equals the unclipped PPO gradient, -A d log pi."""
    x = torch.tensor([[logp]], requires_grad=True)
    kw = dict(sapo_temperature_pos=tau, sapo_temperature_neg=tau)
    policy_loss(x, x.detach(), torch.tensor([[adv]]), torch.ones(1, 1), loss_mode="sapo", **kw).loss.backward()
    assert x.grad.item() == pytest.approx(-adv, rel=1e-4, abs=1e-5)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO zeroes the gradient of a token whose ratio left the trust region; CISPO weights it by the capped ratio."""
    logp = torch.tensor([[math.log(3.0), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), loss_mode="cispo", clip_ratio_high=2.0).loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 2, -1.1 / 2]]))  # -min(r, 2) A / tokens
    logp.grad = None
    policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_ratio_high=0.2).loss.backward()
    assert logp.grad[0, 0].item() == 0.0


@FAST
@given(log_w=st.floats(-3, 3, width=32), positive=st.booleans())
def test_vespo_weight_is_one_on_policy_and_falls_off(log_w, positive):
    from trl_nrollout.algos.losses import vespo_weights

    adv = torch.tensor([[1.0 if positive else -1.0]])
    phi = vespo_weights(adv, torch.tensor([[log_w]]), torch.zeros(1, 1), torch.ones(1, 1)).item()
    on_policy = vespo_weights(adv, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)).item()
    assert on_policy == pytest.approx(1.0, abs=1e-6)  # phi(1) = 1
    k, lam = (2.0, 3.0) if positive else (3.0, 2.0)  # TRL's defaults: phi(w) = e^l w^k e^(-l w)
    assert phi == pytest.approx(math.exp(lam + k * log_w - lam * math.exp(log_w)), rel=1e-4, abs=1e-7)


def test_off_policy_mask_drops_only_negative_far_off_policy_sequences():
    from trl_nrollout.algos.losses import off_policy_sequence_mask

    logp = torch.zeros(4, 2)
    sampler = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.01, 0.0], [float("nan"), 0.5]])
    adv = torch.tensor([[1.0], [-1.0], [-1.0], [-1.0]])
    keep = off_policy_sequence_mask(adv, logp, sampler, torch.ones(4, 2), threshold=0.1)
    assert keep.squeeze(-1).tolist() == [1.0, 0.0, 1.0, 0.0]  # positive kept; far & negative dropped; NaN counts 0


def test_rollout_is_weights_truncate_and_mask():
    from trl_nrollout.algos.losses import rollout_is_weights

    old, rollout, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[-2.0, 0.5]]), torch.ones(1, 2)
    w = [math.exp(2.0), math.exp(-0.5)]
    t = rollout_is_weights(old, rollout, mask, level="token", mode="truncate", upper=2.0, lower=0.8)
    assert t[0].tolist() == pytest.approx([2.0, 0.8])
    m = rollout_is_weights(old, rollout, mask, level="token", mode="mask", upper=2.0, lower=0.5)
    assert m[0].tolist() == pytest.approx([0.0, w[1]])  # outside: 0; inside: the weight itself
    s = rollout_is_weights(old, rollout, mask, level="sequence", mode="truncate", upper=10.0)
    assert s.shape == (1, 1) and s.item() == pytest.approx(w[0] * w[1], rel=1e-5)


def test_high_entropy_mask_keeps_the_top_quantile_of_response_tokens():
    from trl_nrollout.algos.losses import entropy_quantile, high_entropy_mask

    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    threshold = entropy_quantile(ent[mask.bool()], 0.5)
    kept = high_entropy_mask(ent, mask, threshold)
    assert kept.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]  # the 3 highest of 7 tokens, never a masked one
    assert entropy_quantile(torch.empty(0), 0.5).item() == math.inf


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 4), cols=st.integers(1, 6))
def test_a_registered_policy_loss_is_selected_by_name_and_weighted_like_the_built_in_ones(seed, rows, cols):
    """``register_policy_loss`` adds a loss that ``policy_loss(loss_mode=...)`` and ``policy_loss_mode`` select:
    its per-token loss is masked, multiplied by the rollout correction's weights (unless registered without) and
    aggregated like the built-in ones; a name registered twice is refused."""
    from trl_nrollout.algos import losses
    from trl_nrollout.algos.losses import agg_loss, available_policy_losses, register_policy_loss
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    g = torch.Generator().manual_seed(seed)
    logp, old = -torch.rand(rows, cols, generator=g), -torch.rand(rows, cols, generator=g)
    adv = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).float()
    weights = torch.rand(rows, cols, generator=g) + 0.5

    def reinforce(x):  # plain REINFORCE: -A log pi
        return -x.advantages * x.log_prob, x.mask.new_zeros(()), x.mask.new_zeros(())

    try:
        register_policy_loss("test_reinforce")(reinforce)
        register_policy_loss("test_reinforce_unweighted", token_weights=False)(reinforce)
        assert {"test_reinforce", "test_reinforce_unweighted", "vanilla"} <= set(available_policy_losses())
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_reinforce")(reinforce)
        out = policy_loss(logp, old, adv, mask, loss_mode="test_reinforce", token_weights=weights)
        assert torch.allclose(out.loss, agg_loss(-adv * logp * weights, mask, "token-mean"))
        unweighted = policy_loss(logp, old, adv, mask, loss_mode="test_reinforce_unweighted", token_weights=weights)
        assert torch.allclose(unweighted.loss, agg_loss(-adv * logp, mask, "token-mean"))
        assert NRolloutConfig(output_dir="unused", use_cpu=True, bf16=False, policy_loss_mode="test_reinforce").policy_loss_mode == "test_reinforce"
    finally:
        losses._POLICY_LOSSES.pop("test_reinforce", None)
        losses._POLICY_LOSSES.pop("test_reinforce_unweighted", None)
    with pytest.raises(InputError, match="policy_loss_mode='test_reinforce' is not one of"):
        NRolloutConfig(output_dir="unused", use_cpu=True, bf16=False, policy_loss_mode="test_reinforce")


# ---------------------------------------------------------------------------------------------- stale samples
@FAST
@given(data=st.data(), B=st.integers(1, 3), T=st.integers(1, 4), cap=st.sampled_from([1.5, 2.0, 5.0]))
def test_a_stale_batchs_loss_is_the_fresh_loss_times_each_tokens_truncated_behaviour_weight(data, B, T, cap):
    """Decoupled PPO (the default where samples can be stale): the clip is taken against the proximal policy
    ``prox`` (the trainer's at the update), and a token that an older behaviour policy ``behav`` sampled has its
    loss multiplied by ``min(pi_prox / pi_behav, cap)``, the rollout correction's truncated weight, and by nothing
    else. So a stale batch's loss (and gradient) is, exactly, the sum over its tokens of each token's loss in the
    same batch sampled fresh (behaviour = proximal: weight 1) times that weight, computed here by hand."""
    from trl_nrollout.algos.losses import rollout_is_weights

    def grid(strategy):
        return torch.tensor(data.draw(st.lists(strategy, min_size=B * T, max_size=B * T))).view(B, T)

    logp = grid(LOGP).requires_grad_(True)
    prox, behav, adv = grid(LOGP), grid(LOGP), grid(st.floats(-3.0, 3.0, width=32))
    mask = grid(st.sampled_from([0.0, 1.0]))
    assume(mask.sum() > 0)
    tokens = [(i, j) for i in range(B) for j in range(T) if mask[i, j]]
    n = float(len(tokens))  # the mini batch's token count, as the trainer passes it
    by_hand = {(i, j): min(math.exp(prox[i, j].item() - behav[i, j].item()), cap) for i, j in tokens}

    def loss(weights, on):
        return policy_loss(logp, prox, adv, on, clip_ratio_c=3.0, token_weights=weights, num_tokens=n).loss

    weights = rollout_is_weights(prox, behav, mask, level="token", mode="truncate", upper=cap)
    fresh = rollout_is_weights(prox, prox, mask, level="token", mode="truncate", upper=cap)
    assert [weights[i, j].item() for i, j in tokens] == pytest.approx([by_hand[k] for k in tokens], rel=1e-5)
    stale = loss(weights, mask)
    alone = {}
    for i, j in tokens:  # each token's fresh loss, the others masked out
        only = torch.zeros(B, T)
        only[i, j] = 1.0
        alone[(i, j)] = loss(fresh, only)
    expected = sum(by_hand[k] * alone[k] for k in tokens)
    assert stale.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert loss(fresh, mask).item() == pytest.approx(sum(alone.values()).item(), rel=1e-5, abs=1e-6)
    (grad_stale,) = torch.autograd.grad(stale, logp)
    (grad_expected,) = torch.autograd.grad(expected, logp)
    assert torch.allclose(grad_stale, grad_expected, rtol=1e-5, atol=1e-6)


def test_normalizers_of_optimizer_steps_that_span_rollouts_follow_trls_rule():
    """A mini batch's loss normalizers: its own tokens and sequences where optimizer steps tile the rollout's micro
    batches; TRL's rule (the rollout's tokens x accumulation / micro batches) where they run on into the next pass
    or rollout (gradient_accumulation_steps=3 over steps_per_generation=4), whose tokens are not known yet."""
    from trl_nrollout.trainer.update import mini_batch_normalizers

    counts = [[10, 6], [20, 6], [30, 6], [41, 6]]
    assert mini_batch_normalizers(counts, 2) == [(30, 12), (30, 12), (71, 12), (71, 12)]
    assert mini_batch_normalizers(counts, 4) == [(101, 24)] * 4
    assert mini_batch_normalizers(counts, 3) == [(101 * 3 / 4, 18.0)] * 4


# ---------------------------------------------------------------------------------------------- truncated sampling
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 4), vocab=st.integers(2, 40), top_k=st.integers(0, 12),
       top_p=st.sampled_from([1.0, 0.97, 0.8, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.02, 0.3]),
       temperature=st.sampled_from([0.6, 1.0]), vllm_order=st.booleans())
def test_the_kept_mass_puts_full_vocabulary_log_probs_on_the_samplers_support(seed, rows, vocab, top_k, top_p,
                                                                            min_p, temperature, vllm_order):
    """A sampler with top-k / top-p / min-p reports each token's log-prob over the tokens it kept (transformers'
    warpers here, in generate()'s order, or with min-p first as vLLM cuts): the trainer's full-vocabulary log-prob
    less ``sampling_support_log_mass`` is that value, for every token the sampler can draw (and 0 is the mass's log
    where nothing is cut)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from trl_nrollout.algos.losses import sampling_support_log_mass

    g = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab, generator=g) * 3.0 / temperature
    cuts = []
    if top_k:
        cuts.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        cuts.append(TopPLogitsWarper(top_p=top_p))
    if min_p:
        cuts = [MinPLogitsWarper(min_p=min_p), *cuts] if vllm_order else [*cuts, MinPLogitsWarper(min_p=min_p)]
    processed = scaled.clone()
    for cut in cuts:
        processed = cut(torch.zeros(rows, 1, dtype=torch.long), processed)
    engine = torch.log_softmax(processed, dim=-1)  # what the sampler reports, -inf where it cut
    full = torch.log_softmax(scaled, dim=-1)
    for token in range(vocab):  # every token as the sampled one, in every row where the sampler keeps it
        targets = torch.full((rows,), token)
        kept = torch.isfinite(engine[:, token])
        mass = sampling_support_log_mass(scaled, targets, top_k=top_k, top_p=top_p, min_p=min_p,
                                         min_p_first=vllm_order)
        assert torch.allclose((full[:, token] - mass)[kept], engine[kept, token], atol=1e-5)
        assert (mass <= 1e-6).all()
        if not cuts:
            assert torch.allclose(mass, torch.zeros(rows), atol=1e-6)
