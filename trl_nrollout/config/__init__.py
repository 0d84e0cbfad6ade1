"""The options of a run: :class:`NRolloutConfig` (TRL's ``GRPOConfig`` plus verl's rollout vocabulary) and what
makes it up, one module per part, each importing only the ones listed before it (no cycle among them):

- :mod:`.trl_options`: every option TRL's ``GRPOConfig`` adds, honored, mapped onto ours or refused (the drop-in
  table, :data:`~.trl_options.TRL_OPTIONS`, and :class:`~.trl_options.UnsupportedTRLOption`);
- :mod:`.checks`: the options' checks (ranges, choices, combinations that cannot run together), a mixin;
- :mod:`.derive`: how one vocabulary's fields are derived from the other's, a mixin;
- :mod:`.options`: :class:`NRolloutConfig` itself (its fields and help texts) and :func:`to_nrollout_config`;
- :mod:`.distillation`: :class:`~.distillation.NRolloutDistillationConfig` (TRL's ``DistillationConfig`` with
  NRolloutConfig's engine options) and its drop-in table, :data:`~.distillation.DISTILL_OPTIONS`.

``from trl_nrollout.config.options import NRolloutConfig`` keeps working; the names below are loaded on first use, so that
importing a light submodule (``trl_nrollout.config.trl_options``) does not import TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NRolloutConfig": "options", "to_nrollout_config": "options", "config_help_table": "options",
    "VLLM_ENGINE_OPTIONS": "options", "UnsupportedTRLOption": "trl_options", "TRL_OPTIONS": "trl_options",
    "TRL_LOSS_TYPES": "trl_options", "NRolloutDistillationConfig": "distillation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
