"""The built-in dispatch rules (``rollout_dispatch``), registered in :data:`trl_nrollout.rollout.axes.DISPATCH_RULES`:
each a :class:`~trl_nrollout.rollout.axes.DispatchRule` naming its drivers, one per operation, with the same
signature under every rule (the adapters below give the two modules' drivers that signature).

- ``shares`` (the default): each engine its own ranks' groups (:mod:`~trl_nrollout.rollout.dispatch.shares`;
  single-turn samples are the engine's own ``generate_expanded``);
- ``balanced``: one queue of the job's groups that every engine pulls from, the results sent home
  (:mod:`~trl_nrollout.rollout.dispatch.balanced`); job-wide, it needs the engine's ``REQUESTS`` and ``BALANCED``.

A new rule is one more :func:`~trl_nrollout.rollout.axes.register_dispatch` call (docs/architecture.md, "Adding a
dispatch rule"); ``rollout_dispatch`` accepts every registered name. This module is imported with the package
(``trl_nrollout/rollout/__init__.py``), so every layer reads the built-ins from the registry.
"""

from __future__ import annotations

import contextlib

from trl_nrollout.rollout.axes import DispatchRule, register_dispatch
from trl_nrollout.rollout.dispatch import balanced, shares
from trl_nrollout.rollout.dispatch.queue import PullStats
from trl_nrollout.rollout.engines.protocol import BALANCED, REQUESTS, has
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions

__all__ = ["BALANCED_RULE", "SHARES_RULE"]


def generate_shares(engine, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions, *,
                    sample_offset: int | None = None, images: list[list] | None = None, mm: list | None = None
                    ) -> tuple[RolloutBatch, PullStats | None]:
    """This rank's samples from its engine's share (``engine.generate_expanded``: ``images`` for an engine that
    expands them, ``mm`` the HF engine's tensors). No pull stats."""
    extra = {k: v for k, v in (("images", images), ("mm", mm)) if v is not None}
    return engine.generate_expanded(sample_prompts, n, sampling, sample_offset=sample_offset, **extra), None


def generate_balanced(engine, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions, *,
                      sample_offset: int | None = None, images: list[list] | None = None, mm: list | None = None
                      ) -> tuple[RolloutBatch, PullStats]:
    """:func:`~trl_nrollout.rollout.dispatch.balanced.generate_balanced` (a group is seeded by its place in the job,
    so ``sample_offset`` is not needed; ``mm`` is refused: the balanced queue runs on engines that expand images)."""
    if mm is not None:
        raise ValueError("rollout_dispatch='balanced' runs on engines that expand images themselves (images=), "
                         "not on the HF engine's mm= tensors.")
    return balanced.generate_balanced(engine, sample_prompts, n, sampling, images=images)


def agents_shares(engine, sample_prompts, n, sampling, turn_seed, agent, workers, *, sample_offset=None, images=None):
    """:func:`~trl_nrollout.rollout.dispatch.shares.run_agents`, no pull stats."""
    return (*shares.run_agents(engine, sample_prompts, n, sampling, turn_seed, agent, workers,
                               sample_offset=sample_offset, images=images), None)


def agents_balanced(engine, sample_prompts, n, sampling, turn_seed, agent, workers, *, sample_offset=None,
                    images=None):
    """:func:`~trl_nrollout.rollout.dispatch.balanced.run_agents_balanced` (seeded by the job's groups: no
    ``sample_offset``; ``images`` travel with the queue's groups)."""
    return balanced.run_agents_balanced(engine, sample_prompts, n, sampling, turn_seed, agent, workers, images=images)


def func_calls_shares(engine) -> contextlib.AbstractContextManager[list]:
    """A ``rollout_func``'s engine calls as they are (each engine its own ranks' prompts): nothing to log."""
    return contextlib.nullcontext([])


def func_calls_balanced(engine) -> contextlib.AbstractContextManager[list]:
    """Each of a ``rollout_func``'s ``generate_expanded`` calls a balanced rollout
    (:func:`~trl_nrollout.rollout.dispatch.balanced.balanced_calls`), on an engine with ``BALANCED`` (else as
    they are)."""
    return balanced.balanced_calls(engine) if has(engine, BALANCED) else contextlib.nullcontext([])


def partial_balanced(engine, groups, target, sampling, version, homes):
    """The job's partial pool on the balanced queue (:func:`~trl_nrollout.rollout.dispatch.balanced.
    run_partial_balanced`)."""
    return balanced.run_partial_balanced(engine, groups, target, sampling, version, homes)


def partial_agents_balanced(engine, groups, target, sampling, version, homes, agent, workers, quota=None):
    """The job's partial pool of tool episodes on the balanced queue (:func:`~trl_nrollout.rollout.dispatch.
    balanced.run_partial_agents_balanced`)."""
    return balanced.run_partial_agents_balanced(engine, groups, target, sampling, version, homes, agent, workers,
                                                quota=quota)


SHARES_RULE = register_dispatch(DispatchRule(
    name="shares", job_wide=False, generate=generate_shares, run_agents=agents_shares, func_calls=func_calls_shares,
    help="each engine its own ranks' prompts (the step waits for the slowest engine)."))

BALANCED_RULE = register_dispatch(DispatchRule(
    name="balanced", job_wide=True, generate=generate_balanced, run_agents=agents_balanced,
    func_calls=func_calls_balanced, run_partial=partial_balanced, run_partial_agents=partial_agents_balanced,
    needs=(REQUESTS, BALANCED), needs_why="the HF engine has no request-level loop to add groups to while it generates",
    help="one queue for the job; each engine pulls the next groups whenever it holds fewer than "
         "rollout_max_num_seqs samples (verl's least-loaded routing), and the samples go back to their ranks. A "
         "group's seed follows the group, not the engine. Helps when an engine runs fewer samples at once than its "
         "share; single-turn and tool rollouts (request-level: whole episodes on the engine that pulled them; an "
         "environment_factory episode's tool calls run on its prompt's rank) on vLLM engines, partial rollouts (the "
         "job's pool, groups in flight included, in the queue), agent= episodes (ranks pull groups of the job's "
         "rows, episodes go home) and a rollout_func's engine calls (each generate_expanded call, made by every "
         "rank, one queue; run group by group, with rollout_multi_turn='requests' or partial: ranks pull the job's "
         "groups and run the function on them, samples go home)."))
