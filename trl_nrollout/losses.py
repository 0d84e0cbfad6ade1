"""Policy losses, KL estimators, loss aggregation and KL controllers: pure tensor functions.

Shapes: ``[B, T]`` for every per-token tensor (``B`` samples, ``T`` response positions); masks are 0/1 over
the response tokens that count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trl_nrollout.advantages import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
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
) -> Tensor:
    """Reduce a ``[B, T]`` loss to a scalar.

    - ``token-mean``: sum over all masked tokens / number of masked tokens (DAPO; verl's default).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (original GRPO).
    - ``seq-mean-token-sum-norm``: token sum / (sequences x ``norm_length``), a constant length (Dr. GRPO);
      ``norm_length`` defaults to ``T``.

    "Sequences" are the rows with at least one masked token (a fully masked row, e.g. padding, neither adds
    to the loss nor dilutes it; as verl). ``num_tokens`` / ``num_seqs`` override the denominators, so that
    micro batches of one mini batch add up to the mini batch's loss (pass the mini batch's totals). Values
    outside the mask are ignored (even inf/NaN). Empty masks give 0, never NaN.
    """
    mask = loss_mask.to(loss_mat.dtype)
    masked = torch.where(mask != 0, loss_mat * mask, 0.0)  # [B, T]
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
    token_weights: Tensor | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020).

    ``ratio = pi / pi_old`` per token (``ratio_level="token"``), or GSPO's sequence ratio
    ``exp(mean_t(log pi - log pi_old))`` with a per-token straight-through gradient (``"sequence"``, Zheng et
    al. 2025). ``token_weights`` (``[B, T]``, no gradient) multiply the per-token loss, e.g. importance weights
    correcting the rollout engine / trainer mismatch. Loss per token: ``max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` it is also capped at
    ``-A c`` (dual clip, ``clip_ratio_c > 1``; ``None`` disables). All inputs ``[B, T]``.

    GSPO as published is ``ratio_level="sequence"`` with ``loss_agg_mode="seq-mean-token-mean"`` (verl forces
    that mode); another mode weights each sequence's clipped term by its token count.
    """
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    if ratio_level == "token":
        ratio = log_ratio.exp()
    elif ratio_level == "sequence":
        seq_log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).clamp(max=10.0)
        ratio = (seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()).exp()
    else:
        raise ValueError(f"ratio_level={ratio_level!r} must be 'token' or 'sequence' (GSPO).")
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (it caps -A * ratio at -A * c); use 3.0.")
        loss3 = -advantages * clip_ratio_c
        dual = torch.minimum(loss3, clipped)
        clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).to(mask.dtype), mask)
        per_token = torch.where(advantages < 0, dual, clipped)
    else:
        clipfrac_lower = mask.new_zeros(())
        per_token = clipped
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, **agg_kwargs)
    return PolicyLossOutput(
        loss=loss,
        clipfrac=clipfrac.detach(),
        clipfrac_lower=clipfrac_lower.detach(),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
        ratio_mean=masked_mean(ratio, mask).detach(),
    )


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
