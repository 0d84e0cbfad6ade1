"""The advantage stage of ``NRolloutGRPOTrainer``'s rollout step: the estimator over the step's rewards (and the KL
in the reward, the greedy baselines ReMax takes), and the step's rollout metrics. A part: :meth:`AdvantageStage.run`
takes the step's ``Round``, ``Assignment``, ``LogProbs`` and ``StepContext`` and returns its ``Advantages``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather
from torch import Tensor

from trl_nrollout.algos.advantages import (
    compute_advantages,
    normalize_then_sum,
    outcome_token_rewards,
    response_mask,
)
from trl_nrollout.algos.losses import kl_penalty
from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.passes.ulysses import SPGroup
from trl_nrollout.trainer.clocks import TruncatedSteps
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.stages import (
    Advantages,
    Assignment,
    LogProbs,
    Round,
    Sample,
    StepContext,
    fit_width,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardCalls:
    """What the advantage stage asks of the trainer's rollout and scoring, handed in as callables: ``weighted``
    (rewards ``[G, F]`` -> scores ``[G]``, ``reward_weights`` applied), and for ReMax's greedy baselines ``rollout``
    (rows, n, sampling -> batch, prompts, episode), ``sampling`` (mode, greedy= -> the sampling options), ``decode``
    (prompts, completion ids -> completions) and ``score`` (rows, prompts, completions, ids, extra= -> scores)."""

    weighted: Callable[[Tensor], Tensor]
    rollout: Callable[..., tuple]
    sampling: Callable[..., Any]
    decode: Callable[[list, list[list[int]]], list]
    score: Callable[..., Any]


class AdvantageStage:
    """The advantage estimator and the rollout metrics of a rollout step, a part of the trainer (see the module
    docstring). Its collaborators: the config, the accelerator, the :class:`Metrics` sink, TRL's completions log
    (``logs``, the trainer's ``_logs``), the reward functions' names and weights, the KL controller (KL in the
    reward), the Ulysses group, the counter of truncated rollouts and the :class:`RewardCalls`; TRL's
    ``TrainerState`` comes with :meth:`log_step` (the Trainer makes a new one when training starts)."""

    def __init__(self, args: NRolloutConfig, accelerator: Any, metrics: Metrics, calls: RewardCalls, *, logs: dict,
                 reward_func_names: list[str], reward_weights: Tensor, kl_ctrl: Any, sp: SPGroup | None,
                 truncated_steps: TruncatedSteps) -> None:
        self.args, self.accelerator, self.metrics, self.calls, self.logs = args, accelerator, metrics, calls, logs
        self.reward_func_names, self.reward_weights, self.kl_ctrl = reward_func_names, reward_weights, kl_ctrl
        self.sp, self.truncated_steps = sp, truncated_steps

    def run(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext) -> Advantages:
        """The advantage estimator (``adv_estimator``) over the whole job: groups may span ranks, and batch-level
        estimators need every sample. A critic's estimator needs a trainer with a critic (PPO's trainer calls
        :meth:`estimate` with its values)."""
        if self.args.adv_estimator == "gae":
            raise ValueError("adv_estimator='gae' needs a critic (value model): use NRolloutPPOTrainer with "
                             "NRolloutPPOConfig, or pick a critic-free estimator such as 'grpo'.")
        return self.estimate(collected, assigned, logps, ctx)

    def estimate(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext,
                             **estimator_options) -> Advantages:
        """The advantage stage's work: weighted scores ``[G]`` (less the KL penalty when it is in the reward), the
        outcome on each sample's last sampled token, and the estimator with ``estimator_options`` added to the
        configured ones (PPO: the critic's ``values`` ``[G, T]``, ``gamma``, ``lam``). Unscorable samples (no reward
        function applied) are left out of the baselines and get advantage 0, as in TRL."""
        args: NRolloutConfig = self.args
        samples, n = collected.samples, ctx.n
        scores = self.calls.weighted(collected.rewards)  # [G]
        t_max = max(max(len(s.completion_ids) for s in samples), 1)
        resp_mask = response_mask([s.completion_ids for s in samples], [s.tool_mask for s in samples], t_max)
        if args.use_kl_in_reward:
            scores = scores - self._reward_kl_penalty(logps, assigned, resp_mask, ctx)
        token_rewards = outcome_token_rewards(scores, resp_mask)  # on each sample's last sampled token
        options = dict(args.adv_estimator_kwargs or {})
        if args.adv_estimator in ("grpo", "grpo_passk"):
            options.setdefault("norm_adv_by_std_in_grpo", args.norm_adv_by_std_in_grpo)
        if args.adv_estimator == "remax":
            options["reward_baselines"] = self._greedy_baselines(ctx, collected.rows)
        options.update(estimator_options)
        index = [i // n for i in range(len(samples))]
        returns = None
        scorable = ~torch.isnan(scores)
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: TRL computes these advantages itself
            gdpo = normalize_then_sum(collected.rewards, self.reward_weights.cpu(), n)
            advantages = torch.nan_to_num(gdpo, nan=0.0).unsqueeze(-1) * resp_mask
        elif scorable.all():
            advantages, returns = compute_advantages(args.adv_estimator, token_rewards, resp_mask, index, **options)
        else:
            keep = scorable.nonzero().squeeze(-1)
            values = options.get("values")
            for per_sample in ("reward_baselines", "values"):
                if per_sample in options:
                    options[per_sample] = options[per_sample][keep]
            advantages = torch.zeros_like(token_rewards)
            returns = values.new_zeros(token_rewards.shape) if values is not None else None
            if keep.numel():
                advantages[keep], kept_returns = compute_advantages(args.adv_estimator, token_rewards[keep],
                                                                    resp_mask[keep], [index[i] for i in keep.tolist()],
                                                                    **options)
                if returns is not None:
                    returns[keep] = kept_returns
        advantages = torch.nan_to_num(advantages, nan=0.0)  # e.g. a ReMax baseline no reward function applied to
        return Advantages(advantages, scores, resp_mask, returns=returns, values=estimator_options.get("values"))

    def _reward_kl_penalty(self, logps: LogProbs, assigned: Assignment, resp_mask: Tensor, ctx: StepContext
                           ) -> Tensor:
        """KL in the reward: each sample's penalty ``[G]``, the KL controller's coefficient times its KL to the
        reference summed over its sampled tokens (this rank's samples computed here, the job's gathered); the
        controller then moves with the job's mean KL per token."""
        local = assigned.samples  # old is as wide as this rank's longest completion
        local_mask = response_mask([s.completion_ids for s in local], [s.tool_mask for s in local], logps.old.shape[1])
        kl_local = sequence_kl(logps.old, logps.ref, local_mask, self.args.kl_penalty)  # [B], on old's device
        kl_all = torch.zeros(len(resp_mask), device=kl_local.device)
        # a split episode's calls are rows of one job sample: its KL is theirs summed
        kl_all.index_add_(0, torch.tensor(assigned.mine, device=kl_local.device), kl_local.to(kl_all.dtype))
        kl_all = gather(kl_all).view(self.accelerator.num_processes, -1).sum(0).cpu()
        if self.sp is not None:  # each sample on every rank of its sequence-parallel group
            kl_all = kl_all / self.sp.size
        penalty = self.kl_ctrl.value * kl_all
        mean_kl = float((kl_all / resp_mask.sum(-1).clamp(min=1)).mean())
        self.kl_ctrl.update(mean_kl, n_steps=len(resp_mask))
        self.metrics.add(ctx.mode, "actor/reward_kl_penalty", mean_kl)
        self.metrics.add(ctx.mode, "actor/reward_kl_penalty_coeff", self.kl_ctrl.value)
        return penalty

    def log_step(self, collected: Round, adv: Advantages, ctx: StepContext, state: Any) -> None:
        """The step's metrics over the whole job, and TRL's completions table (``log_completions``: TRL's ``log()``
        prints, saves or uploads it); ``state``: TRL's ``TrainerState`` (its step, and the tokens seen, counted
        here)."""
        rewards, table = collected.rewards, collected.table
        self._log_rollout_metrics(ctx.mode, rewards, adv.scores, adv.advantages, adv.response_mask,
                                  collected.samples, ctx.n, state)
        if table is None:
            return
        self.logs["prompt"].extend(table["prompt"])
        self.logs["completion"].extend(table["completion"])
        for i, name in enumerate(self.reward_func_names):
            self.logs["rewards"][name].extend(rewards[:, i].tolist())
        per_sample = (adv.advantages * adv.response_mask).sum(-1) / adv.response_mask.sum(-1).clamp(min=1)
        self.logs["advantages"].extend(per_sample.tolist())
        for column, values in table["extra"].items():
            self.logs["extra"][column].extend(values)
        if table.get("images") is not None:
            self.logs["images"].extend(table["images"])

    def _greedy_baselines(self, ctx: StepContext, rows: list[dict] | None = None) -> Tensor:
        """ReMax: reward of one greedy completion per prompt, for every sample of the job ``[G]``: the prompts of
        ``rows`` (this rank's samples' rows, ``n`` per group: a partial rollout's groups that finished first), else
        of the step's inputs. Generated now, with the weights being trained."""
        unique = (ctx.inputs if rows is None else rows)[::ctx.n]
        calls = self.calls
        batch, prompts, episode = calls.rollout(unique, 1, calls.sampling(ctx.mode, greedy=True))
        completions = (episode.completions if episode.completions is not None
                       else calls.decode(prompts, batch.completion_ids))
        scores = calls.score(unique, prompts, completions, batch.completion_ids, extra=episode.extra_fields)
        return calls.weighted(scores.rewards).repeat_interleave(ctx.n)  # [prompts of the job] -> [G]

    def _log_rollout_metrics(self, mode: str, rewards: Tensor, scores: Tensor, advantages: Tensor, resp_mask: Tensor,
                             samples: list[Sample], n: int, state: Any) -> None:
        """verl's metric names, and TRL's beside them (same values), so either dashboard keeps working. ``rewards``
        ``[G, F]``, ``scores`` ``[G]``, ``advantages`` and ``resp_mask`` ``[G, T]`` of the job's ``samples``;
        ``state``: TRL's ``TrainerState``."""
        for i, name in enumerate(self.reward_func_names):  # over the samples the function applied to (not None)
            self.metrics.add(mode, f"rewards/{name}/mean", torch.nanmean(rewards[:, i]).item())
            self.metrics.add(mode, f"rewards/{name}/std", _nanstd(rewards[:, i]))
        self.metrics.add(mode, "reward", torch.nanmean(scores).item())
        self.metrics.add(mode, "reward_std", _nanstd(scores))
        lengths = torch.tensor([s.sampled_length for s in samples], dtype=torch.float32)
        self.metrics.add(mode, "response_length/mean", lengths.mean().item())
        self.metrics.add(mode, "response_length/max", lengths.max().item())
        self.metrics.add(mode, "response_length/clip_ratio",
                     sum(s.truncated for s in samples) / max(1, len(samples)))
        # TRL's names for the same figures
        truncated = torch.tensor([s.truncated for s in samples])
        self.metrics.add(mode, "completions/mean_length", lengths.mean().item())
        self.metrics.add(mode, "completions/min_length", lengths.min().item())
        self.metrics.add(mode, "completions/max_length", lengths.max().item())
        self.metrics.add(mode, "completions/clipped_ratio", truncated.float().mean().item())
        if mode == "train":  # a rollout cut short everywhere: said once, counted in the run summary
            warning = self.truncated_steps.observe(state.global_step + 1, int(truncated.sum()), len(samples),
                                                   self.args.max_completion_length or 256,
                                                   bool(self.args.mask_truncated_completions))
            if warning and self.accelerator.is_main_process:
                logger.warning(warning)
        terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        self.metrics.add(mode, "completions/mean_terminated_length", terminated.mean().item())
        self.metrics.add(mode, "completions/min_terminated_length", terminated.min().item())
        self.metrics.add(mode, "completions/max_terminated_length", terminated.max().item())
        if n > 1 and len(scores) % n == 0:
            group_std = scores.view(-1, n).std(-1)
            self.metrics.add(mode, "frac_reward_zero_std",
                         torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        valid = advantages[resp_mask.bool()]
        if valid.numel():
            self.metrics.add(mode, "critic/advantages/mean", valid.mean().item())
            self.metrics.add(mode, "critic/advantages/max", valid.max().item())
            self.metrics.add(mode, "critic/advantages/min", valid.min().item())
        if mode == "train":
            state.num_input_tokens_seen += int(sum(s.num_tokens for s in samples))
        self.metrics.store[mode]["num_tokens"] = [state.num_input_tokens_seen]


def rows_advantages(advantages: Tensor, resp_mask: Tensor, mine: list[int], segment: list[bool] | None,
                    width: int) -> Tensor:
    """The per-token advantages of this rank's training rows ``[B, width]``: row ``b`` takes its job sample
    ``mine[b]``'s ``advantages`` ``[G, T]`` (cut or zero-padded to ``width``); a split episode's later call
    (``segment[b]``) takes its episode's advantage, the mean over the episode's sampled tokens (``resp_mask`` ``[G,
    T]``; the outcome estimators give every sampled token the same), on every token (its completion mask says which
    train)."""
    index = torch.as_tensor(mine, dtype=torch.long)
    rows = fit_width(advantages[index], width)
    if segment is None or not any(segment):
        return rows
    per_episode = (advantages * resp_mask).sum(-1) / resp_mask.sum(-1).clamp(min=1)  # [G]
    later = torch.as_tensor(segment, dtype=torch.bool)
    rows[later] = per_episode[index[later]].unsqueeze(-1).to(rows.dtype).expand(-1, width)
    return rows


def _nanstd(x: Tensor) -> float:
    """Sample standard deviation over the non-NaN entries (0 for fewer than two; NaN for none, as TRL logs)."""
    valid = x[~torch.isnan(x)]
    if valid.numel() == 0:
        return float("nan")
    return valid.std().item() if valid.numel() > 1 else 0.0


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str) -> Tensor:
    """KL-in-reward of each sample ``[B]``: the sum of the per-token ``kind`` estimate over the tokens of ``mask``.

    ``logprobs``, ``ref_logprobs``: ``[B, C]`` right-padded, on the training device; ``mask``: ``[B, C]`` 0/1, the
    tokens the policy sampled (:func:`~trl_nrollout.algos.advantages.response_mask`: tool results left out), moved to
    that same device (a CPU mask made ``use_kl_in_reward`` crash on CUDA).
    """
    mask = mask.to(device=logprobs.device, dtype=logprobs.dtype)
    return (kl_penalty(logprobs, ref_logprobs, kind) * mask).sum(-1)
