"""Advantage estimators: a registry of pure tensor functions, selected by name (``adv_estimator``).

Every estimator takes the same inputs and returns ``(advantages, returns)``, both ``[B, T]`` and zero outside
``response_mask``:

- ``token_level_rewards``: ``[B, T]`` float; a sample's outcome reward is the sum of its row (rewards placed on
  the last token, or spread over tokens, give the same outcome).
- ``response_mask``: ``[B, T]`` 0/1, the completion tokens that are trained on.
- ``index``: length ``B``; ``index[i]`` is the prompt (group) id of sample ``i``. Any hashable ids.

Groups of one sample, and groups whose rewards are all equal, get zero advantage (no NaN). Use
:func:`compute_advantages` (the one entry point) or :func:`register_adv_est` to add your own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

EPS = 1e-6

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
_REGISTRY: dict[str, AdvantageFn] = {}


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an estimator under ``name`` (which must be new)."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in _REGISTRY:
            raise ValueError(f"adv_estimator {name!r} is already registered (by {_REGISTRY[name].__name__}).")
        _REGISTRY[name] = fn
        return fn

    return wrap


def available_estimators() -> list[str]:
    """Names accepted by ``adv_estimator``, sorted."""
    return sorted(_REGISTRY)


def get_estimator(name: str) -> AdvantageFn:
    """The registered estimator ``name``; a clear error listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"adv_estimator={name!r} is not a registered estimator; use one of {available_estimators()} "
            f"or register your own with @trl_nrollout.algos.advantages.register_adv_est({name!r})."
        ) from None


def compute_advantages(
    name: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    **options,
) -> tuple[Tensor, Tensor]:
    """Run the estimator ``name``. Shapes: rewards and mask ``[B, T]``, ``len(index) == B``.

    Returns ``(advantages [B, T], returns [B, T])``, zero where ``response_mask`` is 0.
    """
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]."
        )
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for a batch of {token_level_rewards.shape[0]} samples.")
    if not torch.isfinite(token_level_rewards).all():
        raise ValueError(
            "token_level_rewards contains NaN or inf; decide what a failed reward means before computing "
            "advantages (NRolloutConfig.reward_nan_policy: 'error', 'zero' or 'drop_group')."
        )
    fn = get_estimator(name)
    mask = response_mask.to(torch.float32)
    rewards = token_level_rewards.to(torch.float32)
    adv, ret = fn(rewards, mask, index, **options)
    return adv * mask, ret * mask


def response_mask(completions: Sequence[Sequence[int]], tool_masks: Sequence[Sequence[int] | None],
                  width: int) -> Tensor:
    """The estimators' ``response_mask`` ``[B, width]`` float: each completion's tokens (right-padded) less the
    tokens the policy did not sample (``tool_masks[i]``: 1 per completion token the model generated, 0 for a tool
    result or an environment's reply; ``None``: all generated). As verl's multi-turn ``response_mask``: tool
    results get no advantage, no TD error and no KL, and take no part in a batch's whitening statistics."""
    lengths = torch.tensor([len(ids) for ids in completions], dtype=torch.long)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # [B, width]
    for i, (ids, tools) in enumerate(zip(completions, tool_masks, strict=True)):
        if tools is not None:
            if len(tools) != len(ids):
                raise ValueError(f"sample {i}: its tool mask has {len(tools)} entries for {len(ids)} completion "
                                 "tokens; a rollout must give one entry per completion token.")
            mask[i, :len(ids)] = torch.tensor(tools, dtype=torch.float32)
    return mask


def outcome_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Outcome rewards as token-level rewards ``[B, T]``: ``scores[i]`` (``[B]``) on the last position of row ``i``
    where ``mask`` (``[B, T]``) is 1, zeros elsewhere; a row with no such position gets no reward (it has no token
    to credit). The last *masked* token, not the last token: a completion may end on a tool result."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(-1) if mask.shape[1] else torch.full((mask.shape[0],), -1)
    rows = (last >= 0).nonzero().squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].to(torch.float32)
    return rewards


# ---------------------------------------------------------------------------------------------- helpers
def group_ids(index: Sequence[Hashable], device: torch.device | None = None) -> Tensor:
    """Map arbitrary hashable group ids to ``0..G-1`` in order of first appearance. Returns ``[B]`` long."""
    codes: dict[Hashable, int] = {}
    ids = [codes.setdefault(i.item() if isinstance(i, Tensor) else i, len(codes)) for i in index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def group_mean_std(scores: Tensor, gid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, sample std (Bessel) and group size. ``scores``, ``gid``: ``[B]``; outputs ``[B]``.

    A group of one sample has std 0.
    """
    num_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = total / count
    sq = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, (scores - mean[gid]) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return mean[gid], var.sqrt()[gid], count[gid]


def in_constant_group(scores: Tensor, gid: Tensor) -> Tensor:
    """``[B]`` bool: True where every sample of the sample's group has exactly the same score (singletons too).

    Tested exactly (group max == group min), not through the std: the float mean of equal values can differ
    from them by an ulp, and ``ulp / (ulp-sized std + eps)`` is not zero (e.g. seven rewards of 0.7 gave
    GRPO advantages of 0.056 in float32).
    """
    num_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    hi = scores.new_full((num_groups,), -float("inf")).scatter_reduce_(0, gid, scores, "amax")
    lo = scores.new_full((num_groups,), float("inf")).scatter_reduce_(0, gid, scores, "amin")
    return (hi == lo)[gid]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 when the mask is empty; values outside the mask,
    even inf or NaN, are ignored)."""
    return torch.where(mask != 0, x * mask, 0.0).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Whiten ``x`` over the masked positions of the whole batch: ``(x - mean) / sqrt(var + 1e-8)``.

    ``var`` uses Bessel's correction. All-equal masked values (and an empty mask) give exactly zeros (``mean``
    when ``shift_mean=False``), not ``ulp / sqrt(1e-8)``.
    """
    if x.numel() == 0:
        return torch.zeros_like(x)
    valid = mask > 0
    mean = masked_mean(x, mask)
    n = mask.sum()
    constant = torch.where(valid, x, float("inf")).min() >= torch.where(valid, x, -float("inf")).max()
    centered = torch.where(constant, torch.zeros_like(x), x - mean)
    var = ((centered**2) * mask).sum() / (n - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out


def _outcome(rewards: Tensor, mask: Tensor) -> Tensor:
    """Outcome reward per sample ``[B]``: the sum of its row of rewards over the response mask."""
    return (rewards * mask).sum(-1)


def _broadcast(scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    adv = scores.unsqueeze(-1) * mask
    return adv, adv


# ---------------------------------------------------------------------------------------------- estimators
@register_adv_est("grpo")
def grpo_advantage(
    rewards: Tensor,
    mask: Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    std_scope: str = "group",
    epsilon: float = EPS,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean_g) / (std_g + eps)``, broadcast over tokens.

    ``std_g`` is the sample std of the group. ``norm_adv_by_std_in_grpo=False`` keeps ``r_i - mean_g``
    (Dr. GRPO). ``std_scope="batch"`` divides by the std of the whole batch instead of the group's
    (batch-level std scaling, as in "Tricks or Traps? A Deep Dive into RL for LLM Reasoning", 2025).
    Shapes: ``[B, T]`` in and out.
    """
    scores = _outcome(rewards, mask)
    gid = group_ids(index, scores.device)
    mean, std, _ = group_mean_std(scores, gid)
    centered = torch.where(in_constant_group(scores, gid), torch.zeros_like(scores), scores - mean)
    if norm_adv_by_std_in_grpo:
        if std_scope == "group":
            centered = centered / (std + epsilon)
        elif std_scope == "batch":
            batch_std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
            centered = centered / (batch_std + epsilon)
        else:
            raise ValueError(f"std_scope={std_scope!r} must be 'group' or 'batch'.")
    return _broadcast(centered, mask)


@register_adv_est("dr_grpo")
def dr_grpo_advantage(rewards: Tensor, mask: Tensor, index: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean_g``, no std scaling.

    Pair it with ``loss_agg_mode="seq-mean-token-sum-norm"`` to also remove the length bias. ``[B, T]``.
    """
    return grpo_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)


@register_adv_est("rloo")
def rloo_advantage(rewards: Tensor, mask: Tensor, index: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out).

    Equals ``n / (n - 1) * (r_i - mean_g)`` for a group of size ``n``. ``[B, T]``.
    """
    scores = _outcome(rewards, mask)
    gid = group_ids(index, scores.device)
    mean, _, count = group_mean_std(scores, gid)
    loo = (scores - mean) * count / (count - 1).clamp(min=1)
    adv = torch.where(in_constant_group(scores, gid), torch.zeros_like(scores), loo)
    return _broadcast(adv, mask)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    rewards: Tensor, mask: Tensor, index: Sequence[Hashable], gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns ``G_t = r_t + gamma * G_{t+1}`` per token, whitened over the
    batch's masked tokens. No group baseline, so it works with ``rollout_n = 1``. Returns ``(adv, G)`` ``[B, T]``.
    """
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    rewards: Tensor, mask: Tensor, index: Sequence[Hashable]
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten over the batch's masked tokens.

    ``[B, T]``. A batch where every group is all-equal gives zeros.
    """
    scores = _outcome(rewards, mask)
    gid = group_ids(index, scores.device)
    mean, _, _ = group_mean_std(scores, gid)
    centered = torch.where(in_constant_group(scores, gid), torch.zeros_like(scores), scores - mean)
    tok = centered.unsqueeze(-1) * mask
    adv = masked_whiten(tok, mask) * mask
    return adv, adv


@register_adv_est("remax")
def remax_advantage(
    rewards: Tensor, mask: Tensor, index: Sequence[Hashable], reward_baselines: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): ``A_t = G_t - b``, where ``G_t`` is the undiscounted return-to-go and ``b``
    (``reward_baselines``, ``[B]``) the reward of the greedy completion of the same prompt. ``[B, T]``.
    """
    if reward_baselines is None:
        raise ValueError(
            "adv_estimator='remax' needs reward_baselines ([batch] rewards of the greedy completions); the "
            "trainer generates them when adv_estimator='remax'. Pass reward_baselines=... when calling directly."
        )
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.to(returns).reshape(-1, 1) * mask
    return adv, returns


@register_adv_est("opo")
def opo_advantage(rewards: Tensor, mask: Tensor, index: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the baseline is the group's
    length-weighted mean reward ``b_g = sum_j |y_j| r_j / sum_j |y_j|``; ``A_i = r_i - b_g``. ``[B, T]``.
    """
    scores = _outcome(rewards, mask)
    lengths = mask.sum(-1)
    gid = group_ids(index, scores.device)
    g = int(gid.max().item()) + 1 if gid.numel() else 0
    num = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, lengths * scores)
    den = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, lengths)
    count = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    plain_mean = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores) / count
    baseline = torch.where(den > 0, num / den.clamp(min=EPS), plain_mean)
    adv = torch.where(in_constant_group(scores, gid), torch.zeros_like(scores), scores - baseline[gid])
    return _broadcast(adv, mask)


@register_adv_est("grpo_passk")
def grpo_passk_advantage(
    rewards: Tensor,
    mask: Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = EPS,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO (Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using
    Reinforcement Learning", arXiv:2503.19595; verl's ``grpo_passk``): in each group only the best sample gets
    an advantage, ``r_max - r_second``, optionally divided by ``std_g + eps``; the others get 0. Ties for the
    best, and groups of one, give 0. ``[B, T]``.
    """
    scores = _outcome(rewards, mask)
    gid = group_ids(index, scores.device)
    _, std, _ = group_mean_std(scores, gid)
    adv = torch.zeros_like(scores)
    for g in gid.unique():
        members = (gid == g).nonzero(as_tuple=True)[0]
        if members.numel() < 2:
            continue
        vals, order = scores[members].sort(descending=True)
        gap = vals[0] - vals[1]
        if norm_adv_by_std_in_grpo:  # ties give gap == 0 exactly, so no 0 / 0
            gap = gap / (std[members[0]] + epsilon)
        adv[members[order[0]]] = gap
    return _broadcast(adv, mask)


@register_adv_est("gpg")
def gpg_advantage(
    rewards: Tensor, mask: Tensor, index: Sequence[Hashable], epsilon: float = EPS
) -> tuple[Tensor, Tensor]:
    """GPG, Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning", arXiv:2504.02546): ``A_i = alpha * (r_i - mean_g)`` without std scaling,
    where ``alpha = B / M`` rescales the gradient by the fraction of samples whose group is not all-equal
    (``M`` of them; all-equal groups carry no signal; ``alpha = B`` if none is informative, where every
    advantage is 0 anyway). verl approximates ``M`` by the number of nonzero rewards; this is the paper's
    definition. ``epsilon`` is accepted for option compatibility and unused. ``[B, T]``.
    """
    scores = _outcome(rewards, mask)
    gid = group_ids(index, scores.device)
    mean, _, _ = group_mean_std(scores, gid)
    informative = ~in_constant_group(scores, gid)
    m = informative.sum().clamp(min=1).to(scores.dtype)
    alpha = scores.numel() / m
    adv = torch.where(informative, (scores - mean) * alpha, torch.zeros_like(scores))
    return _broadcast(adv, mask)


#: One line per estimator for docs and ``--help``: (formula, when to use it).
ESTIMATOR_TABLE: dict[str, tuple[str, str]] = {
    "grpo": ("(r - mean_g) / (std_g + 1e-6)", "default; groups of n >= 8; std_scope='batch' for batch-level std"),
    "dr_grpo": ("r - mean_g", "removes the std (difficulty) bias; pair with seq-mean-token-sum-norm"),
    "rloo": ("r - mean of the other n-1 samples", "unbiased baseline; small n"),
    "reinforce_plus_plus": ("whiten_batch(discounted return-to-go)", "n = 1 allowed; token-level rewards"),
    "reinforce_plus_plus_baseline": ("whiten_batch(r - mean_g)", "group baseline + batch normalization, stable"),
    "remax": ("return-to-go - r(greedy completion)", "n = 1 allowed; costs one greedy sample per prompt"),
    "opo": ("r - sum(|y| r) / sum(|y|) over the group", "exact on-policy, varying lengths"),
    "grpo_passk": ("best sample: r_max - r_second (/ std_g); others 0", "optimize pass@k instead of pass@1"),
    "gpg": ("(B / M) (r - mean_g), M = samples in informative groups", "no std; rescales for all-equal groups"),
    "gae": ("whiten_batch(GAE(r, V; gamma, lam))", "PPO with a critic (NRolloutPPOTrainer); n = 1 is normal"),
}


def normalize_then_sum(rewards_per_func: Tensor, weights: Tensor, n: int) -> Tensor:
    """GDPO's advantages (TRL's ``multi_objective_aggregation='normalize_then_sum'``) of each sample ``[G]``.

    Each reward function's outputs ``[G, F]`` (NaN: the function does not apply) are normalized within each group
    of ``n`` consecutive samples (``(r - mean) / (std + 1e-4)``, NaN-aware, Bessel-corrected std), weighted by
    ``weights`` ``[F]`` and summed (skipping NaN); the sums are then normalized over the whole batch. A sample no
    function applies to gets NaN (the caller gives it no advantage).
    """
    from trl.trainer.utils import nanstd

    grouped = rewards_per_func.view(-1, n, rewards_per_func.shape[-1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if n > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + 1e-4)).view_as(rewards_per_func)
    summed = torch.nansum(normalized * weights.to(normalized), dim=-1)
    summed = summed.masked_fill(torch.isnan(rewards_per_func).all(dim=-1), float("nan"))
    spread = nanstd(summed) if summed.numel() > 1 else torch.zeros(())
    return (summed - torch.nanmean(summed)) / (spread + 1e-4)


@register_adv_est("gae")
def gae_estimator(rewards: Tensor, mask: Tensor, index: Sequence[Hashable], values: Tensor | None = None,
                  gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """verl's ``gae`` (PPO with a critic): :func:`gae_advantages` of the critic's ``values`` ``[B, T]``; groups play
    no part (``rollout_n = 1`` is normal)."""
    if values is None:
        raise ValueError("adv_estimator='gae' needs the critic's values: train with NRolloutPPOTrainer.")
    return gae_advantages(rewards, values.to(rewards), mask, gamma=gamma, lam=lam)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) per token, as verl's ``gae`` estimator.

    Shapes: ``rewards``, ``values`` (the critic's value of the state before each completion token), ``mask``
    ``[B, T]``. Going backwards over the tokens, ``delta_t = r_t + gamma V_next - V_t`` and
    ``A_t = delta_t + gamma lam A_next``, where "next" is the next *masked* token (0 after the last one): positions
    outside the mask (padding, tool results) neither add a TD error nor break the chain. Returns
    ``(advantages, returns)``: returns ``= A + V`` before whitening (the critic's targets), advantages whitened over
    the batch's masked tokens; both 0 outside the mask.
    """
    mask_f = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
        out[:, t] = adv * m
    returns = (out + values) * mask_f
    return masked_whiten(out, mask_f) * mask_f, returns
