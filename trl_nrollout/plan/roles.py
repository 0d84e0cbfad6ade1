"""Who does what in a launch with rollout ranks (``rollout_ranks``): pure arithmetic, no torch (``trl-nrollout plan``
reads it before anything is installed or started). The bridge that runs it is :mod:`trl_nrollout.rollout.bridge`."""

from __future__ import annotations

from dataclasses import dataclass

TRAIN, ROLLOUT = "train", "rollout"
#: The engine's fraction of a rollout rank's device by default: the device holds nothing else (no trainer states,
#: no sleeping), unlike a colocated engine (TRL's vllm_gpu_memory_utilization default, 0.3).
ROLLOUT_RANK_GPU_MEMORY_UTILIZATION = 0.9
#: The engine's fraction of a device it shares with a trainer by default (TRL's vllm_gpu_memory_utilization, 0.3):
#: the trainer's weights, gradients, optimizer states and activations take the rest.
COLOCATED_GPU_MEMORY_UTILIZATION = 0.3


@dataclass(frozen=True)
class Roles:
    """Who does what in a launch of ``world`` processes, ``local_world`` per node, whose last ``rollout_ranks``
    only generate. Global ranks ``[0, trainers)`` train, ``[trainers, world)`` generate."""

    world: int
    rollout_ranks: int
    local_world: int

    @property
    def trainers(self) -> int:
        return self.world - self.rollout_ranks

    def role(self, rank: int) -> str:
        return TRAIN if rank < self.trainers else ROLLOUT

    def role_rank(self, rank: int) -> int:
        """The rank within its own world."""
        return rank if rank < self.trainers else rank - self.trainers

    def role_size(self, rank: int) -> int:
        return self.trainers if rank < self.trainers else self.rollout_ranks

    def role_local_world(self, rank: int) -> int:
        """Processes of ``rank``'s role on its node (every node of a role holds the same number: see
        :func:`roles_refusal`)."""
        node = rank // self.local_world
        first, last = node * self.local_world, (node + 1) * self.local_world
        return sum(1 for r in range(first, last) if self.role(r) == self.role(rank))

    def global_rank(self, role: str, role_rank: int) -> int:
        return role_rank if role == TRAIN else self.trainers + role_rank

    def rollout_globals(self) -> list[int]:
        return list(range(self.trainers, self.world))


def roles_refusal(world: int, rollout_ranks: int, local_world: int, rollout_tp_size: int = 1) -> str | None:
    """Why ``rollout_ranks`` cannot split a launch of ``world`` processes (``local_world`` per node) into trainers
    and engines of ``rollout_tp_size`` ranks; None when it can. The message names the option, the rule and a fix."""
    if rollout_ranks < 0:
        return f"rollout_ranks={rollout_ranks} must be >= 0 (processes that only generate; 0: every process trains)."
    if rollout_ranks == 0:
        return None
    if world < 2:
        return (f"rollout_ranks={rollout_ranks} needs at least 2 processes (one to train, one to generate) but the "
                f"launch has {world}; launch more processes (accelerate launch --num_processes {rollout_ranks + 1}), "
                "or set rollout_ranks=0.")
    if rollout_ranks >= world:
        return (f"rollout_ranks={rollout_ranks} leaves no process to train among the launch's {world}; use at most "
                f"{world - 1}, or launch {rollout_ranks + 1} or more processes.")
    if rollout_ranks % rollout_tp_size:
        return (f"rollout_ranks={rollout_ranks} is not a multiple of rollout_tp_size={rollout_tp_size}: each engine "
                f"takes rollout_tp_size rollout ranks; use rollout_ranks="
                f"{max(rollout_tp_size, rollout_ranks - rollout_ranks % rollout_tp_size)}.")
    if local_world < 1 or world % local_world:
        return f"{local_world} processes per node do not divide the launch's {world} processes."
    if world > local_world and rollout_ranks % local_world:
        return (f"rollout_ranks={rollout_ranks} on {world // local_world} nodes of {local_world} processes would "
                "leave a node with both trainers and rollout ranks, and the two worlds with unequal processes per "
                f"node; use a multiple of {local_world} (whole nodes generate: the last ones).")
    if rollout_tp_size > 1 and local_world % rollout_tp_size and world > local_world:
        return (f"rollout_tp_size={rollout_tp_size} does not divide the {local_world} processes per node: an engine's "
                "ranks must share a node.")
    return None


def lookahead_spelling_refusal(rollout_ranks: int, max_staleness: int | None,
                               rollout_lookahead: int | None) -> str | None:
    """The old spelling of the rollout ranks' look-ahead, refused with the fix (None: not that spelling). Earlier
    versions had ``max_staleness`` mean both the look-ahead of rollout ranks and the partial pool's token age; a
    config that sets ``max_staleness`` with ``rollout_ranks`` and leaves ``rollout_lookahead`` unset meant the
    look-ahead (and, with ``rollout_partial``, the token age too). It is refused rather than mapped: a mapping would
    keep the double meaning for exactly the configs that use it (a partial run that raises max_staleness to keep
    long samples would silently generate further ahead)."""
    if not rollout_ranks or max_staleness is None or rollout_lookahead is not None:
        return None
    return (f"max_staleness={max_staleness} with rollout_ranks={rollout_ranks} and no rollout_lookahead: max_staleness "
            "no longer sets how many steps ahead the rollout ranks generate; rollout_lookahead does. Set "
            f"rollout_lookahead={max_staleness}, and max_staleness only for the partial pool's token age (with "
            f"rollout_partial; {max_staleness} keeps what this config did), or drop max_staleness (defaults: "
            "rollout_lookahead=1, max_staleness=1).")
