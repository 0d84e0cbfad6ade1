"""What sharded training asks of every forward outside the update, in one place.

Under DeepSpeed ZeRO-3 and FSDP a forward (and a backward) gathers the parameters collectively: every rank must
run as many forwards as the busiest one, or the others wait forever. The log-prob passes, the critic's value pass
and update, the HF engine's ``generate`` and the weight sync all ask the same questions:

- :func:`is_zero3` / :func:`is_fsdp`: is this module sharded that way (read from its parameters, so it holds for a
  module prepared by accelerate or by hand);
- :func:`zero3_configured`: does the launch's config say ZeRO-3 (before the model is wrapped);
- :func:`generate_syncs_forwards`: transformers' own condition for ``generate(synced_gpus=True)``;
- :func:`synced_count`: a count of forwards raised to the largest over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn


def is_zero3(model: nn.Module) -> bool:
    """DeepSpeed ZeRO-3 partitions parameters and tags each with ``ds_id``."""
    return has_zero3_parameters(model.named_parameters())


def has_zero3_parameters(named) -> bool:
    """Whether any of ``(name, parameter)`` pairs (the weight sync's list, or ``named_parameters()``) is a ZeRO-3
    partitioned parameter (tagged with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for _, p in named)


def is_fsdp(model: nn.Module) -> bool:
    """FSDP1 (a ``FullyShardedDataParallel`` wrapper anywhere in the module) or FSDP2 (``DTensor`` parameters)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    if isinstance(model, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in model.modules()
    ):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def zero3_configured(accelerator) -> bool:
    """Whether the launch runs DeepSpeed ZeRO-3 (accelerate's state, as TRL reads it): known before the model is
    wrapped, where :func:`is_zero3` may not be yet."""
    from trl.distributed import DistributedBackend

    return DistributedBackend(accelerator).is_zero3


def generate_syncs_forwards(model: nn.Module) -> bool:
    """Whether transformers' ``generate`` keeps the ranks' forwards in step (``synced_gpus``): ZeRO-3 or FSDP over
    several ranks, by transformers' own test, so that our engine decides exactly as ``generate`` does."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return world > 1 and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def synced_count(count: int, device: torch.device | str, sync: bool) -> int:
    """``count`` raised to the largest over the processes when ``sync`` (sharded parameters are gathered in every
    forward and backward: all ranks must run as many); ``count`` itself otherwise or outside a process group."""
    if not (sync and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return count
    n = torch.tensor([count], device=device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    return int(n.item())
