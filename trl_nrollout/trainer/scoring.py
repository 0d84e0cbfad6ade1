"""Reward scoring of a rollout, a part of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`
(:class:`RewardScoring`, built once in the trainer's ``__init__``): TRL's reward function contract (signature, async
functions, ``None`` = "does not apply", ``log_metric`` / ``log_extra``, reward models), errors that name the function
and the sample on every rank, and the NaN-aware weighted sum.

Its collaborators are TRL's reward attributes (``reward_funcs``, ``reward_processing_classes``, ``reward_func_names``,
``reward_weights``), the options (``reward_timeout_s``, ``reward_timeout_policy``, ``reward_nan_policy``), the
accelerator, TRL's ``log_metric`` / ``log_extra`` callables and the lists they fill, and the :class:`Metrics` sink;
what changes from call to call (the mode, TRL's ``trainer_state``, the samples' environments) comes with each call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather, gather_object
from torch import Tensor
from trl.data_utils import is_conversational

from trl_nrollout.trainer.metrics import Metrics

logger = logging.getLogger(__name__)  # a child of trl_nrollout.trainer: filtering that name filters all

#: Seconds between two "still waiting for reward function ..." lines while a reward call runs.
WAIT_NOTICE_S = 60.0


@dataclass
class Scores:
    """What scoring a round gives: ``rewards`` ``[G, F]`` of the job's samples (NaN: the function does not apply)
    and the ``log_extra`` columns reward functions logged (job order; ``{}`` unless ``log_completions``)."""

    rewards: Tensor
    extra_logs: dict[str, list]


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the function and the sample."""


class RewardTimeout(Exception):
    """A reward call ran past ``reward_timeout_s`` (it goes on in its daemon thread; its result is dropped)."""


def _run(func, kwargs: dict):
    values = func(**kwargs)
    if inspect.isawaitable(values):  # an async reward function (e.g. one that calls a service)
        values = asyncio.run(values)
    return values


def call_watched(func, kwargs: dict, *, name: str, samples: int, timeout_s: float | None,
                 notice_every_s: float | None = None):
    """``func(**kwargs)`` (awaited if async), saying every ``notice_every_s`` (default :data:`WAIT_NOTICE_S`) that
    the run waits for reward function ``name`` on ``samples`` samples.

    Without ``timeout_s`` the function runs in the calling thread (a function may set its own ``signal.alarm``).
    With it, the function runs in a daemon thread and :class:`RewardTimeout` is raised once ``timeout_s`` passed;
    the thread is left to finish on its own (Python cannot stop it) and never holds the process at exit."""
    every = WAIT_NOTICE_S if notice_every_s is None else notice_every_s
    start = time.monotonic()

    def notice() -> None:
        logger.warning("still waiting for reward function '%s' after %.0f s (%d samples)%s", name,
                       time.monotonic() - start, samples,
                       f"; reward_timeout_s={timeout_s:g}" if timeout_s is not None else
                       "; set reward_timeout_s to bound each call")

    if timeout_s is None:
        done = threading.Event()

        def watch() -> None:
            while not done.wait(every):
                notice()

        threading.Thread(target=watch, daemon=True, name=f"reward-watch:{name}").start()
        try:
            return _run(func, kwargs)
        finally:
            done.set()
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["values"] = _run(func, kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = err

    worker = threading.Thread(target=work, daemon=True, name=f"reward:{name}")
    worker.start()
    deadline = start + timeout_s
    while True:
        worker.join(max(0.0, min(every, deadline - time.monotonic())))
        if not worker.is_alive():
            break
        if time.monotonic() >= deadline:
            raise RewardTimeout(f"reward function '{name}' did not return within reward_timeout_s={timeout_s:g}")
        notice()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["values"]


def as_rewards(values, name: str, prompts: list) -> list[float | None]:
    """The rewards a function returned, checked: one number (or None) per completion; anything else is a
    :class:`RewardFunctionError` naming the function, the value and the sample."""
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function '{name}' returned {type(values).__name__} {str(values)[:80]!r}; "
                                  "it must return a list with one reward (a number, or None) per completion.")
    if len(values) != len(prompts):
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} rewards for {len(prompts)} samples; it must "
            "return one reward (or None) per completion."
        )
    out: list[float | None] = []
    for j, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if not isinstance(v, str | bytes):  # a numeric string is refused too, as TRL's torch.tensor(...) refuses it
            try:
                out.append(float(v))
                continue
            except (TypeError, ValueError):
                pass
        raise RewardFunctionError(
            f"reward function '{name}' returned {v!r} ({type(v).__name__}) for sample {j} "
            f"(prompt={str(prompts[j])[:200]!r}); a reward must be a number, or None where the function does not "
            "apply: convert it in the function (e.g. 1.0 for 'good').")
    return out


@dataclass(frozen=True, eq=False)
class RewardScoring:
    """The trainer's reward scoring (see the module docstring): ``score`` a round, ``weighted`` rewards.

    ``funcs`` / ``processing_classes`` / ``names`` / ``weights`` ``[F]``: TRL's reward functions, their tokenizers,
    names and weights; ``log_metric`` / ``log_extra``: TRL's callables the functions get, which fill
    ``pending_metrics`` / ``pending_extra_logs`` (TRL's lists, shared); ``log_completions``: TRL's completions
    table is kept (the ``log_extra`` columns are gathered for it)."""

    funcs: list
    processing_classes: list
    names: list[str]
    weights: Tensor
    args: Any
    accelerator: Any
    metrics: Metrics
    log_metric: Callable[[str, float], None]
    log_extra: Callable[[str, list], None]
    pending_metrics: dict[str, list]
    pending_extra_logs: dict[str, list]
    log_completions: bool

    @classmethod
    def of(cls, trainer) -> RewardScoring:
        """The part over a TRL ``GRPOTrainer``'s reward attributes, read once (it keeps no reference to ``trainer``)."""
        return cls(trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names,
                   trainer.reward_weights, trainer.args, trainer.accelerator, Metrics(trainer._metrics),
                   trainer._log_metric, trainer._log_completion_extra, trainer._pending_metrics,
                   trainer._pending_extra_logs, trainer.log_completions)

    def _reward_kwargs(self, inputs: list[dict], state, environments: list | None, rows: list[int] | None = None,
                       extra: dict | None = None) -> dict:
        """The dataset columns of ``inputs`` (one list per column) plus the trainer state, as reward kwargs, and the
        per-sample ``extra`` fields of a ``rollout_func`` (as TRL passes them); with ``rows`` (indices of ``inputs``
        in this rank's samples), per-sample extras are cut to those samples."""
        keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
        # TRL's callables: log_extra (completion-table columns; kept as TRL keeps them without log_completions) and
        # log_metric (a scalar averaged over the step and logged beside the built-in metrics; see _flush_metrics)
        kwargs = {**{k: [x[k] for x in inputs] for k in keys}, "trainer_state": state,
                  "log_extra": self.log_extra, "log_metric": self.log_metric}
        per_sample = dict(extra or {})
        if environments is not None:  # environment_factory: each sample's environment
            per_sample["environments"] = environments
        kwargs.update({k: v if rows is None else [v[r] for r in rows] for k, v in per_sample.items()})
        return kwargs

    def _flush_reward_metrics(self, mode: str, local_count: int) -> dict[str, list]:
        """Metrics reward functions logged with ``log_metric`` this round: averaged over all ranks' calls (names
        sorted, so every rank gathers in the same order), as TRL does. With ``log_completions``, returns the
        ``log_extra`` columns of the round's ``local_count`` samples, gathered in job order (else ``{}``)."""
        for name in sorted(set(gather_object(list(self.pending_metrics)))):
            values = self.pending_metrics.get(name, [])
            stats = torch.tensor([float(sum(values)), float(len(values))], device=self.accelerator.device)
            total, count = gather(stats).view(-1, 2).sum(dim=0).tolist()
            self.metrics.add(mode, name, total / max(count, 1.0))
        self.pending_metrics.clear()
        extra = {}
        if self.log_completions:  # TRL's completions table: one value per sample (None where a rank gave none)
            for column in sorted(set(gather_object(list(self.pending_extra_logs)))):
                extra[column] = gather_object(list(self.pending_extra_logs.get(column, [None] * local_count)))
        self.pending_extra_logs.clear()
        return extra

    def _call_reward(self, func, name: str, prompts: list, completions: list, completion_ids: list,
                     kwargs: dict) -> list:
        """Call a reward function with TRL's signature (an async one is awaited), watched: a line every minute while
        it runs, and ``reward_timeout_s`` (see :func:`call_watched`)."""
        return call_watched(func, dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                       **kwargs),
                            name=name, samples=len(prompts), timeout_s=self.args.reward_timeout_s)

    def weighted(self, rewards: Tensor) -> Tensor:
        """The reward of each sample ``[G]``: the reward functions' outputs ``[G, F]`` weighted by reward_weights.

        As in TRL, a function that returned None for a sample (NaN here) does not apply to it: the weighted sum skips
        it; a sample for which no function applies is unscorable and gets NaN (no advantage, not in the stats)."""
        weighted = torch.nansum(rewards * self.weights.cpu(), dim=-1)
        return weighted.masked_fill(torch.isnan(rewards).all(dim=-1), float("nan"))

    def _score_local(self, inputs: list[dict], prompts: list, completions: list, completion_ids: list,
                     kwargs: dict) -> tuple[Tensor, Tensor]:
        """Rewards ``[B_local, F]`` of this rank's samples (None -> NaN) and where a function returned None
        ``[B_local, F]`` (``kwargs``: the reward kwargs of the samples); errors are collected, not raised (see
        score)."""
        out = torch.zeros(len(prompts), len(self.funcs))
        none = torch.zeros(len(prompts), len(self.funcs), dtype=torch.bool)
        for i, (func, proc, name) in enumerate(zip(self.funcs, self.processing_classes,
                                                   self.names)):
            if isinstance(func, torch.nn.Module):
                if is_conversational({"prompt": prompts[0]}):
                    texts = [proc.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
                else:
                    texts = [p + c for p, c in zip(prompts, completions)]
                enc = proc(text=texts, return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False).to(self.accelerator.device)
                with torch.inference_mode():
                    out[:, i] = func(**enc).logits[:, 0].float().cpu()
                continue
            try:
                values = as_rewards(self._call_reward(func, name, prompts, completions, completion_ids, kwargs),
                                    name, prompts)
            except RewardTimeout as err:
                values = self._timed_out(str(err), prompts)
            out[:, i] = torch.tensor([float("nan") if v is None else v for v in values])
            none[:, i] = torch.tensor([v is None for v in values])
        return out, none

    def _timed_out(self, what: str, prompts: list) -> list[float | None]:
        """The rewards of a call past ``reward_timeout_s``, by ``reward_timeout_policy``."""
        policy, rank = self.args.reward_timeout_policy, self.accelerator.process_index
        where = f"{what} on {len(prompts)} samples of rank {rank} (first prompt: {str(prompts[0])[:120]!r})"
        if policy == "error":
            raise RewardFunctionError(
                f"{where}. Make the function time out on its own, raise reward_timeout_s, or set "
                "reward_timeout_policy='none' (the function does not apply to those samples) or 'zero'.")
        logger.warning("%s: %s (reward_timeout_policy=%r).", where,
                       "it does not apply to them" if policy == "none" else "they score 0", policy)
        return [None if policy == "none" else 0.0] * len(prompts)

    def _diagnose(self, exc: Exception, inputs, prompts, completions, completion_ids, extra=None, *, state=None,
                  environments: list | None = None) -> str:
        """Find which reward function and which sample raised, by calling them one sample at a time."""
        for func, name in zip(self.funcs, self.names):
            if isinstance(func, torch.nn.Module):
                continue
            for j in range(len(prompts)):
                try:
                    self._call_reward(func, name, [prompts[j]], [completions[j]], [completion_ids[j]],
                                      self._reward_kwargs([inputs[j]], state, environments, rows=[j], extra=extra))
                except Exception as e:  # noqa: BLE001 - reporting it is the point
                    return (f"reward function '{name}' raised {type(e).__name__}: {e} on sample {j} of rank "
                            f"{self.accelerator.process_index} (prompt={str(prompts[j])[:200]!r}, "
                            f"completion={str(completions[j])[:200]!r})")
        return f"reward computation raised {type(exc).__name__}: {exc}"

    def score(self, inputs: list[dict], prompts: list, completions: list, completion_ids: list, *, mode: str,
              state, environments: list | None = None, extra: dict | None = None) -> Scores:
        """Rewards of every sample of the job ``[G, F]`` (gathered in rank order), NaN policy applied, and the
        ``log_extra`` columns the functions logged. ``inputs`` / ``prompts`` / ``completions`` / ``completion_ids``:
        this rank's samples ``[B_local]``; ``mode``: ``"train"`` or ``"eval"`` (where the metrics go); ``state``:
        TRL's ``trainer_state`` reward kwarg; ``environments``: each sample's environment (``environment_factory``);
        ``extra``: a ``rollout_func``'s per-sample fields, reward kwargs.

        An error on any rank stops every rank (no rank is left waiting in a collective) with a message naming the
        function and the sample.
        """
        error = ""
        empty = torch.zeros(len(prompts), len(self.funcs))
        try:
            kwargs = self._reward_kwargs(inputs, state, environments, extra=extra)
            local, none = self._score_local(inputs, prompts, completions, completion_ids, kwargs)
        except RewardFunctionError as e:
            error, local, none = str(e), empty, empty.bool()
        except Exception as e:  # noqa: BLE001
            error = self._diagnose(e, inputs, prompts, completions, completion_ids, extra, state=state,
                                   environments=environments)
            local, none = empty, empty.bool()
        errors = [e for e in gather_object([error]) if e]
        if errors:
            raise RewardFunctionError(errors[0])
        extra_logs = self._flush_reward_metrics(mode, len(prompts))
        dev = self.accelerator.device
        rewards = gather(local.to(dev)).cpu()
        local_none = none
        none = gather(none.to(dev).float()).cpu().bool()
        # None: "does not apply to this sample" (TRL's meaning), kept as NaN; a NaN or inf a function computed is a bug
        bad = (torch.isnan(rewards) | torch.isinf(rewards)) & ~none
        if bad.any():
            row, col = (int(x) for x in bad.nonzero()[0])
            if self.args.reward_nan_policy == "error":
                raise RewardFunctionError(
                    f"reward function '{self.names[col]}' returned {rewards[row, col].item()} (NaN/inf) "
                    f"for sample {row} of the step; fix the function (return None where a reward does not apply) or "
                    "set reward_nan_policy='zero' to count such rewards as 0."
                )
            rewards = torch.where(bad, torch.zeros_like(rewards), rewards)
        if none.all(dim=-1).any():  # the same on every rank (gathered): the rows are gathered only then
            row = int(none.all(dim=-1).nonzero()[0])
            unscored = [self._row_kwargs(inputs, prompts, completions, extra, j)
                        for j in local_none.all(dim=-1).nonzero().flatten().tolist()[:1]]
            first = next(r for r in gather_object(unscored) if r is not None)
            # TRL's words (users and tests match them), then ours: which sample, and what it means for training
            logger.warning("All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at "
                           "least one reward function returns a valid reward. (Sample %d of the step: it gets no "
                           "advantage.)", first, row)
        return Scores(rewards, extra_logs)

    @staticmethod
    def _row_kwargs(inputs: list[dict], prompts: list, completions: list, extra: dict | None, j: int) -> dict:
        """What the reward functions got for sample ``j`` of this rank, as TRL's warning shows it: its dataset columns
        and a ``rollout_func``'s fields, the prompt and the completion (long values cut to 200 characters)."""
        def short(value):
            text = repr(value)
            return value if len(text) <= 200 else text[:200] + "..."

        row = {k: short(v) for k, v in inputs[j].items() if k not in ("prompt", "completion", "completion_ids")}
        row.update({k: short(v[j]) for k, v in (extra or {}).items() if isinstance(v, list) and len(v) > j})
        row["prompt"], row["completion"] = short(prompts[j]), short(completions[j])
        return row
