"""Pure helpers deciding which groups a step trains on and which rank gets them.

- :func:`constant_groups`: the groups whose rewards are all equal (no learning signal under group baselines).
- :func:`select_groups`: DAPO dynamic sampling's choice: informative groups first, in arrival order, topped up
  with filtered ones only when the extra rounds ran out.
- :func:`balance_groups`: whole groups to ranks, the same number of groups per rank, token counts as even as a
  greedy longest-first assignment makes them (verl's ``balance_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence


def constant_groups(rewards: Sequence[float], group_of: Sequence[int]) -> set[int]:
    """Ids of the groups whose samples all have the same reward (a group of one sample counts as constant).

    NaN rewards (samples no reward function applied to) are left out: a group with one scorable sample or none is
    constant."""
    first: dict[int, float] = {}
    varied: set[int] = set()
    for g in group_of:
        first.setdefault(g, float("nan"))
    for r, g in zip(rewards, group_of):
        if r != r:  # NaN
            continue
        if first[g] != first[g]:
            first[g] = r
        elif r != first[g]:
            varied.add(g)
    return set(first) - varied


def select_groups(group_order: Sequence[int], constant: set[int], needed: int) -> tuple[list[int], int]:
    """Pick ``needed`` groups: informative ones in arrival order, then constant ones if there are too few.

    Returns (chosen group ids in arrival order of choice, number of constant groups used as filler).
    """
    informative = [g for g in group_order if g not in constant]
    chosen = informative[:needed]
    filler = [g for g in group_order if g in constant][: needed - len(chosen)]
    return chosen + filler, len(filler)


def balance_groups(group_tokens: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Assign group indices to ``num_ranks`` ranks, ``len(group_tokens) / num_ranks`` each, evening out tokens.

    Greedy: groups by decreasing token count, each to the rank with the fewest tokens that still has room.
    Each rank's list is sorted (so a rank keeps the original order of its groups).
    """
    g = len(group_tokens)
    if g % num_ranks:
        raise ValueError(f"{g} groups cannot be split evenly over {num_ranks} ranks; balance_batch needs whole groups "
                         "per rank (samples per rank a multiple of rollout_n).")
    per = g // num_ranks
    loads = [0] * num_ranks
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for idx in sorted(range(g), key=lambda i: (-group_tokens[i], i)):
        rank = min((r for r in range(num_ranks) if len(members[r]) < per), key=lambda r: (loads[r], r))
        members[rank].append(idx)
        loads[rank] += group_tokens[idx]
    return [sorted(m) for m in members]
