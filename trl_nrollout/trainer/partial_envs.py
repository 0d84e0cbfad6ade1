"""Environments in partial rollouts (``rollout_partial=True`` with ``environment_factory``).

Each group of the pool has ``n`` environments, one per sample, drawn from TRL's pool of instances (never one that
an episode in flight holds) and reset with the group's dataset row when the group joins the pool; they live on the
rank that drew the prompt for as long as the group is in the pool, across steps: its samples' tools are their
methods (run on that rank), and when the group trains, its environments are the reward functions'
``environments=`` (sample for sample, as in a whole rollout) and go back to TRL's pool. A sample started again
(staler than ``max_staleness``) gets its environment reset with the row.

Checkpoints: environments are user objects and generally cannot be saved, so a checkpoint keeps each group of the
pool (its key, dataset row and prompt) without its episodes: every sample is saved as not started, and after a
resume the group starts again from its prompt with new environments, reset with its row (one log line at the save
and one at the resume say how many). A resumed run therefore trains those groups from fresh episodes where the
uninterrupted run continued them.

Tensor parallelism (an engine of several ranks, one pool): a group's tools run on the rank that drew it (its
environments are there), and each rank trains its own groups: the engine runs the pool until every rank of it has
as many finished groups of its own as it drew prompts (:func:`~trl_nrollout.rollout.episodes.in_flight.homes_done`), and rank
``r``'s share is its first ones to finish (:func:`~trl_nrollout.rollout.episodes.in_flight.split_finished_by_home`). After a
resume each rank starts its own groups again and hands them to the engine's other ranks, so the pool stays one.

With rollout ranks a group's environments wait here too (:meth:`PoolEnvironments.hold`), their tools registered for
the rollout ranks' calls (the rank side's registry), until the group trains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trl_nrollout.rollout.episodes.in_flight import InFlightGroup
from trl_nrollout.rollout.episodes.tools import AgentCallbacks, call_tools, split_tools

logger = logging.getLogger(__name__)


@dataclass
class TrainerEnvironments:
    """What the pool's environments need of the trainer, bound once when it builds the pool: ``start_episodes(rows,
    busy=None)`` (prompts and tools of new episodes, environments drawn from TRL's pool and reset), ``tokenize``
    (prompts -> engine ids ``[B][P]``), ``current()`` (the environments of the batch the rewards and tools see now),
    ``use(envs=None, names=None)`` (set them, and their environment names, for the rewards and the parser),
    ``reset_kwargs(row)`` (what ``reset`` gets), ``multi`` (``environment_factory`` is a dict), the
    ``standalone_tools`` and ``environment_tools(env)`` (its methods as tools), the async ``loop`` (or None)."""

    start_episodes: Callable[..., tuple[list, list]]
    tokenize: Callable[[list], list[list[int]]]
    current: Callable[[], list | None]
    use: Callable[..., None]
    reset_kwargs: Callable[[dict], dict]
    multi: bool
    standalone_tools: list
    environment_tools: Callable[[Any], list]
    loop: Any = None
    #: prompts -> the processor's encoding where a prompt has images (its ``engine_ids``, ``images``), else None
    encode_images: Callable[[list], Any] = lambda prompts: None


@dataclass
class PoolEnvironments:
    """The pool's environments (see the module docstring). ``enabled``: the trainer has ``environment_factory``;
    ``by_key``: group key -> its ``n`` environments, this rank's groups; ``rows``: a held group's dataset row (rollout
    ranks); ``registry``: the rank side's tools per key, which the rollout ranks' calls reach (None: colocated)."""

    trainer: TrainerEnvironments | None
    by_key: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    registry: dict | None = None

    @property
    def enabled(self) -> bool:
        return self.trainer is not None

    def current(self) -> list | None:
        """The environments the reward functions see now (the trainer's; None without ``environment_factory``)."""
        return self.trainer.current() if self.trainer is not None else None

    def name(self, row: dict):
        """The name of the environment a dataset row selects (None: the one ``environment_factory``)."""
        return row.get("environment") if self.trainer.multi else None

    def start_groups(self, rows: list[dict], n: int) -> tuple[list, list[list[int]], list[list], list]:
        """For each dataset row (one per group): its prompt after reset, its engine ids ``[P]`` (image placeholders
        not expanded), its ``n`` new environments, drawn from TRL's pool past those the pool's episodes hold, each
        reset with the row, and its prompt's images (None: text). The ``n`` resets must give the prompt the same
        observation (a group's samples share one prompt)."""
        t = self.trainer
        prompts, _ = t.start_episodes([row for row in rows for _ in range(n)])  # past the busy environments
        encoded = t.encode_images(prompts)  # (the dataset's images, after the observations: TRL's order)
        ids = encoded.engine_ids if encoded is not None else t.tokenize(prompts)
        envs = list(t.current())
        for g in range(len(rows)):
            first = list(ids[g * n])
            if any(list(ids[g * n + k]) != first for k in range(1, n)):
                raise ValueError(
                    f"rollout_partial=True with environment_factory: the {n} environments of one prompt returned "
                    f"different observations from reset(**row), but a group's {n} samples share one prompt (rule: "
                    "reset's observation depends on the row only). Make reset deterministic in the row, or set "
                    "rollout_partial=False.")
        return ([prompts[g * n] for g in range(len(rows))], [list(ids[g * n]) for g in range(len(rows))],
                [envs[g * n:(g + 1) * n] for g in range(len(rows))],
                [list(encoded.images[g * n]) or None if encoded is not None else None for g in range(len(rows))])

    def restore_groups(self, pool: list[InFlightGroup], rank: int) -> list[InFlightGroup]:
        """The pool with every group of this rank that has no environments (read from a checkpoint) started again
        from its row: new environments, reset, its prompt as they render it, its samples not started."""
        lost = [i for i, g in enumerate(pool) if g.key[2] == rank and g.key not in self.by_key]
        if not lost:
            return pool
        prompts, ids, envs, images = self.start_groups([pool[i].payload["row"] for i in lost], pool[lost[0]].n)
        out = list(pool)
        for i, prompt, p, e, pics in zip(lost, prompts, ids, envs, images):
            g = pool[i]
            self.by_key[g.key] = e
            out[i] = replace(g, prompt_ids=p, payload={**g.payload, "prompt": prompt}, images=pics,
                             samples=[s.restarted() for s in g.samples])
        return out

    def reset_restarted(self, before: list[InFlightGroup], after: list[InFlightGroup]) -> None:
        """Reset the environment of every sample :func:`~trl_nrollout.rollout.episodes.in_flight.drop_stale` started again
        (``after[i].samples[k]`` a new object): its episode starts over, and so does its environment. The
        observation reset returns is not added again: the group keeps its prompt."""
        for old, new in zip(before, after):
            envs = self.by_key.get(new.key)
            if envs is None or old is new:
                continue
            for k, (s_old, s_new) in enumerate(zip(old.samples, new.samples)):
                if s_old is not s_new:
                    envs[k].reset(**self.trainer.reset_kwargs(new.payload["row"]))

    def agent(self, agent: AgentCallbacks, pool: list[InFlightGroup], width: int) -> AgentCallbacks:
        """``agent`` with each sample's tools those of its environment (sample ``k`` of pool group ``g`` is index
        ``g * width + k``, as :func:`~trl_nrollout.rollout.episodes.partial_tools.run_partial_agents` numbers them), and the
        parser's per-sample environment names set the same way."""
        t = self.trainer
        t.use(names=[self.name(g.payload["row"]) for g in pool for _ in range(width)])
        tools = {}
        for gi, g in enumerate(pool):
            for k, env in enumerate(self.by_key.get(g.key, [])):
                tools[gi * width + k] = split_tools(list(t.standalone_tools) + t.environment_tools(env))
        loop = t.loop
        return replace(agent, run_tools=lambda i, calls: call_tools(calls, *tools[i], loop=loop))

    def for_rewards(self, groups: list[InFlightGroup]) -> None:
        """The environments of the groups this rank trains, sample for sample, for the reward functions'
        ``environments=`` (as a whole rollout sets them)."""
        self.trainer.use(envs=[env for g in groups for env in self.by_key[g.key]],
                         names=[self.name(g.payload["row"]) for g in groups for _ in g.samples])

    def release(self, groups: list[InFlightGroup]) -> None:
        """The trained groups' environments go back to TRL's pool (free for new groups)."""
        for g in groups:
            self.by_key.pop(g.key, None)

    def hold(self, key: tuple, row: dict, envs: list) -> None:
        """Group ``key``'s environments wait here (rollout ranks), their tools registered for the rollout ranks'
        calls."""
        t = self.trainer
        self.by_key[key] = envs
        self.rows[key] = row
        self.registry[("group", key)] = [split_tools(list(t.standalone_tools) + t.environment_tools(env))
                                         for env in envs]

    def release_keys(self, keys: list[tuple]) -> None:
        """The groups' environments go back to TRL's pool (trained, or top-ups the engines did not take)."""
        for key in keys:
            self.by_key.pop(key, None)
            self.rows.pop(key, None)
            if self.registry is not None:
                self.registry.pop(("group", key), None)

    def reset(self, key: tuple, k: int) -> None:
        """A rollout rank started sample ``k`` of group ``key`` again (too stale): its environment starts again."""
        self.by_key[key][k].reset(**self.trainer.reset_kwargs(self.rows[key]))

    def to_save(self, pool: list[InFlightGroup]) -> list[InFlightGroup]:
        """The pool a checkpoint keeps: with environments, every group without its episodes (see the module
        docstring), said in one log line; else the pool itself."""
        if not self.enabled:
            return pool
        started = [s for g in pool for s in g.samples if s.token_ids]
        if started:
            logger.info(
                "rollout_partial with environment_factory: the checkpoint keeps the pool's %d groups (prompts and "
                "dataset rows) without their %d episodes in flight (%d tokens): environments cannot be saved, so "
                "after a resume these groups start again from their prompts with new environments.",
                len(pool), len(started), sum(len(s.token_ids) for s in started))
        return [replace(g, samples=[s.restarted() for s in g.samples]) for g in pool]

    def note_restored(self, pool: list[InFlightGroup]) -> None:
        """After a resume with environments: one log line, the groups that start again with new environments."""
        if self.enabled and pool:
            logger.info("rollout_partial with environment_factory: the resumed pool's %d groups start again from their "
                        "prompts with new environments (a checkpoint does not keep environments).", len(pool))
