"""Policy losses, KL estimators, loss aggregation and KL controllers: pure tensor functions.

Shapes: ``[B, T]`` for every per-token tensor (``B`` samples, ``T`` response positions); masks are 0/1 over
the response tokens that count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trl_nrollout.algos.advantages import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                  "token-mean-micro")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


# ---------------------------------------------------------------------------------------------- KL
def _kl_forward(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        # Schulman's k3 = r - log r - 1 with r = p_ref / p: non-negative, low variance; clamped for stability.
        log_r = (ref_logprob - logprob).clamp(-20, 20)
        return (log_r.exp() - log_r - 1).clamp(-10, 10)
    raise ValueError(
        f"kl kind={kind!r} is not known; use one of {list(KL_KINDS)} or a straight-through variant "
        f"such as 'k3+' / 'low_var_kl+'."
    )


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate between the policy and the reference, ``[B, T]``.

    ``k1``/``kl``: ``log p - log p_ref``; ``abs``: its absolute value; ``k2``/``mse``: half its square;
    ``k3``/``low_var_kl``: ``r - log r - 1`` with ``r = p_ref / p``, clamped to [-10, 10] (Schulman 2020).
    A trailing ``+`` (e.g. ``k3+``) is straight-through: the value of the named estimator, the gradient of
    ``k2`` (whose gradient is an unbiased estimate of the KL's gradient).
    """
    if kind.endswith("+"):
        value = _kl_forward(logprob, ref_logprob, kind[:-1])
        grad_path = _kl_forward(logprob, ref_logprob, "k2")
        return grad_path - grad_path.detach() + value.detach()
    return _kl_forward(logprob, ref_logprob, kind)


# ---------------------------------------------------------------------------------------------- aggregation
def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: int | None = None,
    row_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` loss to a scalar.

    - ``token-mean``: sum over all masked tokens / number of masked tokens (DAPO; verl's default).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (original GRPO).
    - ``seq-mean-token-sum-norm``: token sum / (sequences x ``norm_length``), a constant length (Dr. GRPO);
      ``norm_length`` defaults to ``T``.
    - ``token-mean-micro``: the token mean of this micro batch alone, whatever ``num_tokens`` says (TRL's
      ``bnpo``; the trainer divides it by the accumulation steps). ``row_tokens`` ``[B]``: each row's own
      denominator instead (the tokens of the micro batch it was counted in, when micro batches are re-cut by a
      token budget).

    "Sequences" are the rows with at least one masked token (a fully masked row, e.g. padding, neither adds
    to the loss nor dilutes it; as verl). ``num_tokens`` / ``num_seqs`` override the denominators, so that
    micro batches of one mini batch add up to the mini batch's loss (pass the mini batch's totals). Values
    outside the mask are ignored (even inf/NaN). Empty masks give 0, never NaN.
    """
    mask = loss_mask.to(loss_mat.dtype)
    masked = torch.where(mask != 0, loss_mat * mask, 0.0)  # [B, T]
    if loss_agg_mode == "token-mean-micro":
        if row_tokens is not None:
            return (masked.sum(-1) / row_tokens.to(loss_mat.dtype).clamp(min=1)).sum()
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss_mat.dtype)
        return masked.sum() / denom.clamp(min=1)
    if num_seqs is None:
        seqs = (mask.sum(-1) > 0).sum().to(loss_mat.dtype)
    else:
        seqs = torch.as_tensor(num_seqs, dtype=loss_mat.dtype)
    seqs = seqs.clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        return masked.sum() / (seqs * length)
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not known; use one of {list(LOSS_AGG_MODES)}.")


# ---------------------------------------------------------------------------------------------- PPO loss
@dataclass
class PolicyLossOutput:
    """The PPO loss and its diagnostics (scalars)."""

    loss: Tensor
    clipfrac: Tensor  # fraction of tokens where the (upper or lower) clip was active
    clipfrac_lower: Tensor  # fraction of tokens where the dual clip (negative advantages) was active
    approx_kl: Tensor  # mean of (old - new) log-prob over the mask (k1), as verl's ppo_kl
    ratio_mean: Tensor


def importance_ratio(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor, ratio_level: str = "token"
                     ) -> Tensor:
    """``pi / pi_old`` per token ``[B, T]``: the token ratio, or GSPO's sequence ratio ``exp(mean_t(log pi -
    log pi_old))`` broadcast over the sequence with a per-token straight-through gradient (its value is the
    sequence's; summed or averaged over a sequence, its gradient equals that of the sequence ratio itself)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    if ratio_level == "token":
        return log_ratio.exp()
    if ratio_level == "sequence":
        seq_log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).clamp(max=10.0)
        return (seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()).exp()
    raise ValueError(f"ratio_level={ratio_level!r} must be 'token' or 'sequence' (GSPO).")


def vespo_weights(advantages: Tensor, log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor, *,
                  log_is_weight: Tensor | None = None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """VESPO's gamma weight of each sequence, ``phi(w) = exp(lambda) w^k exp(-lambda w)`` (so ``phi(1) = 1``), with
    ``w`` the sequence importance ratio ``prod_t pi / pi_old`` (times the rollout correction ``exp(log_is_weight)``,
    ``[B, 1]`` or ``[B, T]`` summed over the sequence, when given); ``k, lambda`` by the sign of the advantage.
    No gradient. ``[B, T]`` in, ``[B, T]`` out (constant over a sequence when the advantage is)."""
    with torch.no_grad():
        floor = math.log(1e-8)
        mask = response_mask.to(log_prob.dtype)
        log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
        log_w = (log_ratio * mask).sum(-1, keepdim=True)  # [B, 1]
        if log_is_weight is not None:
            log_w = log_w + log_is_weight.clamp(floor, 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a per-token policy loss sees, all ``[B, T]``: the policy's ``log_prob`` (with gradient), the
    ``advantages``, the importance ``ratio`` ``pi / pi_old`` (per token, or GSPO's per sequence broadcast) and the
    response ``mask``; and the options of :func:`policy_loss` (``clip_ratio_high`` already defaulted to the low
    bound)."""

    log_prob: Tensor
    advantages: Tensor
    ratio: Tensor
    mask: Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    delta: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_weight: Tensor | None


#: a per-token policy loss: ``(per-token loss [B, T], clip fraction [], lower clip fraction [])``
PolicyLossFn = Callable[[PolicyLossInputs], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class _PolicyLoss:
    fn: PolicyLossFn
    token_weights: bool  # whether the rollout correction's weights multiply its per-token loss


_POLICY_LOSSES: dict[str, _PolicyLoss] = {}


def register_policy_loss(name: str, *, token_weights: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a per-token policy loss under ``name`` (then ``policy_loss_mode=name`` selects it).
    ``token_weights=False`` for a loss whose own weight already includes the rollout correction (VESPO's)."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy_loss_mode {name!r} is already registered (by {_POLICY_LOSSES[name].fn.__name__}).")
        _POLICY_LOSSES[name] = _PolicyLoss(fn, token_weights)
        return fn

    return deco


def available_policy_losses() -> list[str]:
    """The registered ``policy_loss_mode`` names."""
    return list(_POLICY_LOSSES)


@register_policy_loss("vanilla")
def vanilla_policy_loss(x: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017) with clip-higher (DAPO), ``max(-A r, -A clip(r, 1 - low,
    1 + high))``; for ``A < 0`` also capped at ``-A c`` (dual clip, Ye et al. 2020; ``clip_ratio_c=None``
    disables). ``delta`` caps the unclipped ratio (INTELLECT-2's two-sided clip)."""
    adv, ratio, mask = x.advantages, x.ratio, x.mask
    unclipped = ratio if x.delta is None else ratio.clamp(max=x.delta)
    loss1 = -adv * unclipped
    loss2 = -adv * ratio.clamp(1 - x.clip_ratio_low, 1 + x.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
    if x.clip_ratio_c is None:
        return clipped, clipfrac, mask.new_zeros(())
    if x.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={x.clip_ratio_c} must be > 1 (it caps -A * ratio at -A * c); use 3.0.")
    loss3 = -adv * x.clip_ratio_c
    clipfrac_lower = masked_mean(((clipped > loss3) & (adv < 0)).to(mask.dtype), mask)
    return torch.where(adv < 0, torch.minimum(loss3, clipped), clipped), clipfrac, clipfrac_lower


@register_policy_loss("cispo")
def cispo_policy_loss(x: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor]:
    """``-sg(min(r, clip_ratio_high)) A log pi``: the clipped ratio weights the log-likelihood, so no token loses
    its gradient (MiniMax-M1 / ScaleRL; ``clip_ratio_high`` is the ratio bound itself, e.g. 5)."""
    high = x.clip_ratio_high
    per_token = -x.ratio.clamp(max=high).detach() * x.advantages * x.log_prob
    clipfrac = masked_mean(((x.ratio > high) & (x.advantages > 0)).to(x.mask.dtype), x.mask)
    return per_token, clipfrac, x.mask.new_zeros(())


@register_policy_loss("sapo")
def sapo_policy_loss(x: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor]:
    """``-A sigmoid(tau (r - 1)) 4 / tau``, a soft trust region, ``tau`` by the sign of ``A`` (SAPO)."""
    tau = torch.where(x.advantages > 0, x.sapo_temperature_pos, x.sapo_temperature_neg)
    per_token = -torch.sigmoid(tau * (x.ratio - 1)) * 4 / tau * x.advantages
    return per_token, x.mask.new_zeros(()), x.mask.new_zeros(())


@register_policy_loss("vespo", token_weights=False)
def vespo_policy_loss(x: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor]:
    """``-phi A log pi`` with the sequence's gamma weight ``vespo_weight`` (:func:`vespo_weights`, which includes
    the rollout correction)."""
    if x.vespo_weight is None:
        raise ValueError("loss_mode='vespo' needs vespo_weight (see vespo_weights).")
    return -x.vespo_weight.detach() * x.advantages * x.log_prob, x.mask.new_zeros(()), x.mask.new_zeros(())


def policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    ratio_level: str = "token",
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_weight: Tensor | None = None,
    token_mask: Tensor | None = None,
    token_weights: Tensor | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """The policy-gradient loss of one micro batch. All inputs ``[B, T]``; ``ratio = pi / pi_old``
    (:func:`importance_ratio`, per token or GSPO's per sequence).

    ``loss_mode`` (verl's ``policy_loss.loss_mode``; TRL's ``loss_type`` picks one) names a registered per-token
    loss (:func:`register_policy_loss`): ``"vanilla"`` (PPO's clipped surrogate, :func:`vanilla_policy_loss`),
    ``"cispo"``, ``"sapo"``, ``"vespo"``, or your own.

    ``token_mask`` (0/1: entropy-quantile or off-policy masks) and ``token_weights`` (rollout correction; not for
    a loss registered with ``token_weights=False``, such as vespo, whose weight includes it) multiply the
    per-token loss; both carry no gradient. The per-token loss is then aggregated (``loss_agg_mode``).
    """
    if loss_mode not in _POLICY_LOSSES:
        raise ValueError(f"loss_mode={loss_mode!r} is not known; use one of {available_policy_losses()}.")
    entry = _POLICY_LOSSES[loss_mode]
    mask = response_mask.to(log_prob.dtype)
    ratio = importance_ratio(log_prob, old_log_prob, response_mask, ratio_level)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    inputs = PolicyLossInputs(
        log_prob, advantages, ratio, mask, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_low if clip_ratio_high is None else clip_ratio_high, clip_ratio_c=clip_ratio_c,
        delta=delta, sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        vespo_weight=vespo_weight)
    per_token, clipfrac, clipfrac_lower = entry.fn(inputs)
    if token_mask is not None:
        per_token = per_token * token_mask.detach().to(per_token.dtype)
    if token_weights is not None and entry.token_weights:
        per_token = per_token * token_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, **agg_kwargs)
    return PolicyLossOutput(
        loss=loss,
        clipfrac=clipfrac.detach(),
        clipfrac_lower=clipfrac_lower.detach(),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
        ratio_mean=masked_mean(ratio, mask).detach(),
    )


def high_entropy_mask(entropies: Tensor, response_mask: Tensor, threshold: float | Tensor) -> Tensor:
    """0/1 ``[B, T]``: the response tokens whose entropy is at least ``threshold`` (the ``1 - rho`` quantile of all
    response-token entropies of the step, for "Beyond the 80/20 rule"'s top-``rho`` tokens)."""
    return ((entropies.detach() >= threshold) & (response_mask != 0)).to(entropies.dtype)


def entropy_quantile(entropies: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of a 1-D tensor of entropies (all response tokens, all ranks); ``inf`` when empty (no
    token passes)."""
    values = entropies.detach().float()
    if values.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(values, q)


def off_policy_sequence_mask(advantages: Tensor, log_prob: Tensor, sampling_log_prob: Tensor,
                             response_mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[B, 1]``: drop (0) a sequence whose advantage is negative and whose
    mean ``log pi_sampler - log pi`` over its tokens exceeds ``threshold``; keep (1) every other. A token the sampler
    could not score (NaN) counts as no divergence. The sequence's advantage is its mean over its tokens."""
    mask = response_mask.to(log_prob.dtype)
    diff = torch.nan_to_num(sampling_log_prob - log_prob.detach(), nan=0.0)
    count = mask.sum(-1, keepdim=True).clamp(min=1.0)
    mean_kl = (diff * mask).sum(-1, keepdim=True) / count
    seq_adv = (advantages * mask).sum(-1, keepdim=True) / count if advantages.shape[-1] > 1 else advantages
    return ((seq_adv >= 0) | (mean_kl <= threshold)).to(log_prob.dtype)


def rollout_is_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, *, level: str,
                       mode: str, upper: float | None, lower: float | None = None) -> Tensor:
    """Importance weights ``pi_old / pi_rollout`` that correct the rollout engine / trainer mismatch (TRL's
    ``vllm_importance_sampling_*``, verl's ``rollout_is``): per token ``[B, T]`` or per sequence (the product over
    the sequence) ``[B, 1]``. ``"truncate"`` clamps them to ``[lower, upper]``; ``"mask"`` sets those outside to 0.
    Tokens the engine could not score (NaN) get weight 1. No gradient."""
    with torch.no_grad():
        diff = torch.nan_to_num((old_log_prob - rollout_log_prob) * response_mask.to(old_log_prob.dtype), nan=0.0)
        if level == "sequence":
            diff = diff.sum(-1, keepdim=True)
        elif level != "token":
            raise ValueError(f"rollout_is={level!r} must be 'token' or 'sequence'.")
        w = diff.exp()
        if mode == "truncate":
            return w.clamp(min=lower, max=upper)
        if mode == "mask":
            lo = -math.inf if lower is None else lower
            hi = math.inf if upper is None else upper
            return w.masked_fill((w < lo) | (w > hi), 0.0)
        raise ValueError(f"rollout_is_mode={mode!r} must be 'truncate' or 'mask'.")


def sampling_support_log_mass(logits: Tensor, targets: Tensor, *, top_k: int = 0, top_p: float = 1.0,
                              min_p: float = 0.0, min_p_first: bool = True, rows_per_sort: int = 128) -> Tensor:
    """Log of the probability mass the sampler keeps at each position ``[N]``: ``log sum_{v kept} softmax(logits)_v``
    (0 when nothing is cut), for ``logits`` ``[N, V]`` already divided by the temperature and ``targets`` ``[N]`` the
    sampled tokens (always counted as kept: the engine sampled them, so a token on the edge of the trainer's cut by
    float noise stays in).

    An engine that samples with top-k / top-p / min-p reports each token's log-prob over the tokens it kept,
    renormalized (vLLM's ``processed_logprobs``; the HF engine's recorded log-probs): ``log p(y) - log S``. The
    trainer's ``log p(y)`` minus this value is the same quantity over the same support, so the two compare like
    with like (the rollout correction, the mismatch metrics). The cuts follow the samplers: top-k keeps the tokens
    whose logit is at least the k-th largest (ties kept); top-p keeps, over the distribution renormalized on what
    top-k (and min-p) left, the smallest set of largest tokens whose mass reaches ``top_p`` (the tokens whose
    ascending cumulative mass stays at or below ``1 - top_p`` are cut, the largest always kept); min-p keeps the
    tokens whose probability is at least ``min_p`` times the largest. ``min_p_first``: min-p before top-k/top-p
    (vLLM's order) or after them (transformers' ``generate``). Top-p sorts ``rows_per_sort`` rows at a time (a sort
    holds values and indices ``[rows, V]``). No gradient.
    """
    with torch.no_grad():
        logits = logits.float()
        n, vocab = logits.shape
        kept = torch.ones_like(logits, dtype=torch.bool)

        def cut_min_p() -> None:
            if min_p and min_p > 0:
                probs = torch.softmax(logits.masked_fill(~kept, -math.inf), dim=-1)
                kept.logical_and_(probs >= probs.amax(-1, keepdim=True) * min_p)

        if min_p_first:
            cut_min_p()
        if top_k and 0 < top_k < vocab:
            kth = logits.topk(int(top_k), dim=-1).values[:, -1:]
            kept.logical_and_(logits >= kth)
        if top_p is not None and top_p < 1.0:
            for s in range(0, n, rows_per_sort):
                rows = logits[s:s + rows_per_sort].masked_fill(~kept[s:s + rows_per_sort], -math.inf)
                ordered = rows.sort(dim=-1).values  # ascending
                cut = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
                cut[:, -1] = False  # the largest token always stays
                smallest = ordered.gather(-1, cut.sum(-1, keepdim=True))  # the smallest logit that stays
                kept[s:s + rows_per_sort].logical_and_(rows >= smallest)
        if not min_p_first:
            cut_min_p()
        kept.scatter_(1, targets.long().view(-1, 1), True)
        return torch.logsumexp(logits.masked_fill(~kept, -math.inf), dim=-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: ``[..., V] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_bonus(entropy: Tensor, response_mask: Tensor, coeff: float, loss_agg_mode: str = "token-mean",
                  **agg_kwargs) -> Tensor:
    """The term to add to the loss for an entropy bonus: ``-coeff * agg(entropy)`` (0 when ``coeff`` is 0)."""
    if coeff == 0:
        return entropy.new_zeros(())
    return -coeff * agg_loss(entropy, response_mask, loss_agg_mode, **agg_kwargs)


# ---------------------------------------------------------------------------------------------- KL in reward
class FixedKLController:
    """A constant KL coefficient ``beta``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:  # noqa: D102 - nothing to adapt
        return None


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): move ``beta`` so the observed KL tracks ``target_kl``.

    ``beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target_kl > 0 and horizon > 0 (got {target_kl}, {horizon}); e.g. 0.1, 10000."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``value`` after ``n_steps`` samples were seen with mean KL ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    controller: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[Tensor, float]:
    """KL in the reward: ``rewards = scores - beta * KL_t`` per token. Returns the rewards ``[B, T]`` and the
    batch's mean per-sequence KL (what :meth:`AdaptiveKLController.update` takes)."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask
    rewards = token_level_scores - controller.value * kld
    seq_kl = (kld.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return rewards, float(seq_kl)


def value_loss(vpreds: Tensor, returns: Tensor, old_values: Tensor, mask: Tensor, cliprange_value: float,
               loss_agg_mode: str = "token-mean", **agg_kwargs) -> tuple[Tensor, Tensor]:
    """The critic's clipped value loss (PPO; verl's ``compute_value_loss``) and its clip fraction.

    Shapes ``[B, T]``. ``vpreds`` (with gradient) are clipped to ``old_values +- cliprange_value``; the loss is
    ``0.5 * agg(max((vpred - R)^2, (vpred_clipped - R)^2))`` with :func:`agg_loss` (``agg_kwargs``: its
    ``num_tokens`` / ``num_seqs`` / ``norm_length``); the clip fraction is the share of masked tokens where the
    clipped term is the larger one.
    """
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    plain = (vpreds - returns) ** 2
    worse = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(plain, worse), mask, loss_agg_mode, **agg_kwargs)
    m = mask.to(vpreds.dtype)
    clipfrac = ((worse > plain).to(vpreds.dtype) * m).sum() / m.sum().clamp(min=1)
    return loss, clipfrac


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens ``[B, T]`` (1: the critic predicts the returns; 0: no
    better than their mean; NaN-free: 0 when the returns do not vary)."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)
    mean_r = (returns * m).sum() / n
    var_r = (((returns - mean_r) ** 2) * m).sum() / n
    diff = (returns - values) * m
    var_d = (((diff - diff.sum() / n) ** 2) * m).sum() / n
    return torch.where(var_r > 0, 1 - var_d / var_r.clamp(min=1e-12), torch.zeros_like(var_r))
