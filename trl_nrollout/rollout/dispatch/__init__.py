"""How work reaches the engines (``rollout_dispatch``): drivers over any engine of the protocol
(:mod:`trl_nrollout.rollout.engines.protocol`), one module per choice.

- :mod:`~trl_nrollout.rollout.dispatch.queue`: the job's groups as one queue (:class:`GroupQueue`), its counters,
  the pull loop (:func:`run_pulled`) and :class:`PullStats`;
- :mod:`~trl_nrollout.rollout.dispatch.shares`: fixed shares, each engine its own ranks' groups (``run_agents``,
  ``run_partial``, ``run_partial_agents``; single-turn shares are the engine's own ``generate_expanded``);
- :mod:`~trl_nrollout.rollout.dispatch.balanced`: one queue of the job's groups that every engine pulls from
  (``generate_balanced``, ``run_agents_balanced``, ``run_partial_balanced``, ``run_partial_agents_balanced``,
  ``balanced_calls``, and the job's queue, counters and way home for other drivers: ``job_queue``, ``send_home``).

- :mod:`~trl_nrollout.rollout.dispatch.rules`: the built-in rules (``shares``, ``balanced``) registered by name
  (:class:`~trl_nrollout.rollout.axes.DispatchRule`: whether the job is pooled, what it needs, its driver per
  operation); every choice between them asks the rule (``dispatch_rule(args.rollout_dispatch)``).

Each driver takes the engine as its first argument and uses only what the protocol names; an engine without a
capability a driver needs is refused by :func:`require`.
"""

from trl_nrollout.rollout.dispatch.queue import GroupQueue, LocalStore, PullStats, run_pulled

__all__ = ["GroupQueue", "LocalStore", "PullStats", "require", "run_pulled"]


def require(engine: object, *capabilities: str, what: str) -> None:
    """Refuse ``engine`` for the driver ``what`` where it lacks one of ``capabilities`` (names the missing ones, the
    engine's class and what it has; a config check refuses these combinations earlier)."""
    have = getattr(engine, "capabilities", frozenset())
    missing = [c for c in capabilities if c not in have]
    if missing:
        raise TypeError(f"{what} needs an engine with {missing} (rollout/engines/protocol.py); "
                        f"{type(engine).__name__} has {sorted(have)}: use rollout_backend='vllm'.")
