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
as many finished groups of its own as it drew prompts (:func:`~trl_nrollout.rollout.partial.homes_done`), and rank
``r``'s share is its first ones to finish (:func:`~trl_nrollout.rollout.partial.split_finished_by_home`). After a
resume each rank starts its own groups again and hands them to the engine's other ranks, so the pool stays one.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from trl_nrollout.rollout.partial import InFlightGroup
from trl_nrollout.rollout.tool_episodes import AgentCallbacks, call_tools, split_tools

logger = logging.getLogger(__name__)


class PartialEnvironments:
    """Mixin of :class:`~trl_nrollout.trainer.partial.PartialRollouts`: the pool's environments (see the module
    docstring). ``_partial_envs``: group key -> its ``n`` environments, for this rank's groups."""

    @property
    def _partial_envs(self) -> dict:
        if "_partial_envs_by_key" not in self.__dict__:
            self._partial_envs_by_key = {}
        return self._partial_envs_by_key

    @property
    def _has_environments(self) -> bool:
        return getattr(self, "environment_factories", None) is not None

    def _env_name(self, row: dict):
        """The name of the environment a dataset row selects (None: the one ``environment_factory``)."""
        return row.get("environment") if self._multi_environment else None

    def _start_env_groups(self, rows: list[dict], n: int) -> tuple[list, list[list[int]], list[list]]:
        """For each dataset row (one per group): its prompt after reset, its engine ids ``[P]`` and its ``n`` new
        environments, drawn from TRL's pool past those the pool's episodes hold, each reset with the row. The ``n``
        resets must give the prompt the same observation (a group's samples share one prompt)."""
        prompts, _ = self._start_episodes([row for row in rows for _ in range(n)])  # past the busy environments
        ids = self._tokenize_prompts(prompts)[0]
        envs = list(self.environments)
        for g in range(len(rows)):
            first = list(ids[g * n])
            if any(list(ids[g * n + k]) != first for k in range(1, n)):
                raise ValueError(
                    f"rollout_partial=True with environment_factory: the {n} environments of one prompt returned "
                    f"different observations from reset(**row), but a group's {n} samples share one prompt (rule: "
                    "reset's observation depends on the row only). Make reset deterministic in the row, or set "
                    "rollout_partial=False.")
        return ([prompts[g * n] for g in range(len(rows))], [list(ids[g * n]) for g in range(len(rows))],
                [envs[g * n:(g + 1) * n] for g in range(len(rows))])

    def _restore_env_groups(self, pool: list[InFlightGroup], rank: int) -> list[InFlightGroup]:
        """The pool with every group of this rank that has no environments (read from a checkpoint) started again
        from its row: new environments, reset, its prompt as they render it, its samples not started."""
        lost = [i for i, g in enumerate(pool) if g.key[2] == rank and g.key not in self._partial_envs]
        if not lost:
            return pool
        prompts, ids, envs = self._start_env_groups([pool[i].payload["row"] for i in lost], pool[lost[0]].n)
        out = list(pool)
        for i, prompt, p, e in zip(lost, prompts, ids, envs):
            g = pool[i]
            self._partial_envs[g.key] = e
            out[i] = replace(g, prompt_ids=p, payload={**g.payload, "prompt": prompt},
                             samples=[s.restarted() for s in g.samples])
        return out

    def _reset_restarted(self, before: list[InFlightGroup], after: list[InFlightGroup]) -> None:
        """Reset the environment of every sample :func:`~trl_nrollout.rollout.partial.drop_stale` started again
        (``after[i].samples[k]`` a new object): its episode starts over, and so does its environment. The
        observation reset returns is not added again: the group keeps its prompt."""
        for old, new in zip(before, after):
            envs = self._partial_envs.get(new.key)
            if envs is None or old is new:
                continue
            for k, (s_old, s_new) in enumerate(zip(old.samples, new.samples)):
                if s_old is not s_new:
                    envs[k].reset(**self._reset_kwargs(new.payload["row"]))

    def _env_agent(self, agent: AgentCallbacks, pool: list[InFlightGroup], width: int) -> AgentCallbacks:
        """``agent`` with each sample's tools those of its environment (sample ``k`` of pool group ``g`` is index
        ``g * width + k``, as :func:`~trl_nrollout.rollout.partial_tool_episodes.run_partial_agents` numbers them), and the
        parser's per-sample environment names set the same way."""
        from trl_nrollout.trainer.multiturn import _environment_tools

        self._batch_environments = [self._env_name(g.payload["row"]) for g in pool for _ in range(width)]
        tools = {}
        for gi, g in enumerate(pool):
            for k, env in enumerate(self._partial_envs.get(g.key, [])):
                tools[gi * width + k] = split_tools(list(self._standalone_tools) + _environment_tools(env))
        loop = getattr(self, "async_loop", None)
        return replace(agent, run_tools=lambda i, calls: call_tools(calls, *tools[i], loop=loop))

    def _envs_for_rewards(self, groups: list[InFlightGroup]) -> None:
        """The environments of the groups this rank trains, sample for sample, for the reward functions'
        ``environments=`` (as a whole rollout sets them)."""
        self.environments = [env for g in groups for env in self._partial_envs[g.key]]
        self._batch_environments = [self._env_name(g.payload["row"]) for g in groups for _ in g.samples]

    def _release_envs(self, groups: list[InFlightGroup]) -> None:
        """The trained groups' environments go back to TRL's pool (free for new groups)."""
        for g in groups:
            self._partial_envs.pop(g.key, None)

    def _pool_to_save(self, pool: list[InFlightGroup]) -> list[InFlightGroup]:
        """The pool a checkpoint keeps: with environments, every group without its episodes (see the module
        docstring), said in one log line; else the pool itself."""
        if not self._has_environments:
            return pool
        started = [s for g in pool for s in g.samples if s.token_ids]
        if started:
            logger.info(
                "rollout_partial with environment_factory: the checkpoint keeps the pool's %d groups (prompts and "
                "dataset rows) without their %d episodes in flight (%d tokens): environments cannot be saved, so "
                "after a resume these groups start again from their prompts with new environments.",
                len(pool), len(started), sum(len(s.token_ids) for s in started))
        return [replace(g, samples=[s.restarted() for s in g.samples]) for g in pool]

    def _note_restored_pool(self, pool: list[InFlightGroup]) -> None:
        """After a resume with environments: one log line, the groups that start again with new environments."""
        if self._has_environments and pool:
            logger.info("rollout_partial with environment_factory: the resumed pool's %d groups start again from their "
                        "prompts with new environments (a checkpoint does not keep environments).", len(pool))
