"""The trainers: ``NRolloutGRPOTrainer`` (:mod:`.grpo`: TRL's ``GRPOTrainer`` with the rollout step as typed
stages, :mod:`.stages`), its parts (reward scoring :mod:`.scoring`, multi-turn rollouts :mod:`.multiturn`, the
policy update :mod:`.update`, checkpoints :mod:`.checkpoints`), ``NRolloutPPOTrainer`` (:mod:`.ppo`) and ``NRolloutDistillationTrainer``
(:mod:`.distillation`: TRL's ``DistillationTrainer`` sampling on our engines).

``from trl_nrollout.trainer import NRolloutGRPOTrainer`` keeps working; the names below are loaded on first use,
so that importing a light submodule (``trl_nrollout.trainer.stages``) does not import TRL.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "NRolloutGRPOTrainer": "grpo", "to_nrollout_config": "grpo", "RewardFunctionError": "scoring",
    "NRolloutPPOTrainer": "ppo", "NRolloutPPOConfig": "ppo",
    "NRolloutDistillationTrainer": "distillation", "NRolloutDistillationConfig": "distillation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
