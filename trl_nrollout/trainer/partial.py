"""The trainer's side of partial rollouts (``rollout_partial=True``): the pool of groups in flight across steps.

Each step this rank's new prompts join its engine's pool (gathered over the TP group, so every rank of an engine
holds the same pool), samples staler than ``max_staleness`` start again, the engine runs the pool until the step's
groups have finished (:func:`~trl_nrollout.rollout.dispatch.shares.run_partial`), and the first groups
to finish train, this rank taking its share. The rest stays in the pool, saved in every checkpoint (one file per
rank), so a resumed run continues the samples that were in flight.

With ``rollout_dispatch="balanced"`` and several engines the pool is the job's (every rank's new prompts gathered
over every rank, so every rank holds the same pool): its unfinished groups form one queue the engines pull from
(:func:`~trl_nrollout.rollout.dispatch.balanced.run_partial_balanced`), the job's first groups to
finish train, rank ``r`` taking the ``r``-th share of them. Tool-calling episodes too
(:func:`~trl_nrollout.rollout.dispatch.balanced.run_partial_agents_balanced`): a group's turns and
tools run on the engine that pulled it (its first rank's tools: ``tools=`` are the same on every rank), and every
engine's groups, episodes and masks included, reach every rank afterwards.

Image prompts: a group holds its prompt's engine ids (placeholders not expanded) and its images, sent with every
request of the group, a continued sample's included; when it trains, the processor encodes its prompt again (the
expanded ids and the image tensors the model trains on). A checkpoint's pool keeps the images: a PIL image in the
JSON is written as ``{"__image_png__": <base64 PNG>}`` (lossless) and read back as a PIL image.

The pool is one part of the trainer, :class:`PartialPool`, built once (:meth:`PartialPool.of`) with its round
chosen then from the placement and the episode kind: :class:`~trl_nrollout.trainer.pool_rounds.EngineRound`
(colocated engine groups), :class:`~trl_nrollout.trainer.pool_rounds.LiveRound` (colocated endpoint agents or a
``rollout_func``'s groups) or :class:`~trl_nrollout.trainer.remote_partial.RemoteRound` (rollout ranks). It owns the
groups in flight, their environments (:class:`~trl_nrollout.trainer.partial_envs.PoolEnvironments`), their
checkpoint file and the ``partial/*`` metrics; TRL's hooks hand to it in one line.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import asdict

from trl_nrollout.rollout.axes import machine_refusal
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample
from trl_nrollout.rollout.episodes.partial_tools import AgentPartialSample
from trl_nrollout.rollout.episodes.tools import AgentSample
from trl_nrollout.rollout.ranks.buckets import PNG_MODES, from_png, png_bytes
from trl_nrollout.trainer.agents import episode_runner
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.partial_envs import PoolEnvironments, TrainerEnvironments
from trl_nrollout.trainer.pool_host import PoolGroups, PoolHost, PromptEncoder
from trl_nrollout.trainer.pool_rounds import Colocated, EngineRound, LiveRound
from trl_nrollout.trainer.remote_partial import PartialJobParts, RankSide, RemoteRound
from trl_nrollout.trainer.stages import Round, StepContext

logger = logging.getLogger(__name__)

#: the in-flight pool of a rank, in each checkpoint
POOL_FILE = "nrollout_partial_rank{rank}.json"


def partial_refusal(rollout_backend: str) -> str | None:
    """Why a trainer generating with ``rollout_backend`` cannot roll out partially (None when it can)."""
    if rollout_backend != "vllm":
        return machine_refusal("rollout_partial=True", "rollout_partial=False", auto=True)
    return None


def check_partial(rollout_backend: str, tools: list | None, args, main_process: bool) -> None:
    """``rollout_partial=True`` on a trainer (else nothing): refused with the reason (:func:`partial_refusal`), or
    noted once where it changes how an option acts (tool episodes run request by request under ``'turns'``)."""
    from trl_nrollout.config.trl_options import UnsupportedTRLOption

    if not args.rollout_partial:
        return
    if (why := partial_refusal(rollout_backend)) is not None:
        raise UnsupportedTRLOption(why)
    if tools and args.rollout_multi_turn == "turns" and main_process:
        logger.info("rollout_partial=True: the training steps' tool episodes run request by request (a partial "
                    "rollout has no turn barrier: it stops before its slowest samples); rollout_multi_turn='turns' "
                    "applies to whole rollouts (evaluation).")


class PartialPool:
    """The partial pool of a trainer rank (see the module docstring): ``rounds`` (its placement's and episode
    kind's round, chosen once), the ``groups`` in flight, their ``envs``, and this process's ``rank`` (its
    checkpoint file)."""

    def __init__(self, rounds: EngineRound | LiveRound | RemoteRound, groups: PoolGroups, envs: PoolEnvironments,
                 rank: int) -> None:
        self.rounds, self.groups, self.envs, self.rank = rounds, groups, envs, rank

    def round(self, ctx: StepContext, round_: int = 0) -> Round:
        """The step's groups from the pool: this rank's share of the groups that finished first (the job's samples
        ``[G]``, gathered, and their rewards ``[G, F]``). ``round_`` > 0: one of DAPO's extra rounds
        (``filter_groups``), ``ctx.inputs`` then its fresh prompts."""
        return self.rounds.round(ctx, round_)

    def job(self, step: int, rows: list[dict]) -> PartialJobParts:
        """Rollout ranks: this rank's part of step ``step``'s partial job of ``rows`` (one per group), written ahead
        (:meth:`~trl_nrollout.trainer.remote_partial.RemoteRound.job`)."""
        return self.rounds.job(step, rows)

    def reset_env(self, key: tuple, k: int) -> None:
        """Rollout ranks: sample ``k`` of group ``key`` started again there, its environment resets here."""
        self.envs.reset(key, k)

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str) -> None:
        """This rank's pool as JSON (its groups' prompts, tokens, log-probs, versions, dataset rows and images)."""
        path = os.path.join(folder, POOL_FILE.format(rank=self.rank))
        try:
            text = pool_to_json(self.rounds.to_save())
        except TypeError as err:
            raise TypeError(f"rollout_partial=True saves the samples in flight with their dataset rows, and a row "
                            f"holds a value JSON cannot write ({err}); keep the dataset's columns to text and "
                            "numbers, or set rollout_partial=False.") from None
        with open(path, "w") as fh:
            fh.write(text)

    def load(self, checkpoint: str) -> None:
        """The pool a checkpoint saved for this rank (none where it has no file)."""
        path = os.path.join(checkpoint, POOL_FILE.format(rank=self.rank))
        if not os.path.isfile(path):
            return
        with open(path) as fh:
            self.groups.groups = pool_from_json(fh.read())
        self.groups.restore = True  # rollout ranks: the first job carries it back to them
        self.envs.note_restored(self.groups.groups)

    def close(self) -> None:
        """Release what the round holds (live agents' endpoint)."""
        self.rounds.close()

    @classmethod
    def of(cls, trainer) -> PartialPool:
        """The part over a trainer's collaborators, read once (the pool keeps callables of the trainer's other
        parts, never the trainer): the placement (rollout ranks or colocated) and the episode kind (endpoint agents
        or a ``rollout_func`` vs engine groups) choose its round here, once."""
        from trl_nrollout.trainer.multiturn import _environment_tools

        args, acc, t = trainer.args, trainer.accelerator, trainer
        loop = getattr(t, "async_loop", None)
        tokenize = lambda prompts: t._tokenize_prompts(prompts)[0]  # noqa: E731
        env_side = None
        if getattr(t, "environment_factories", None) is not None:
            def use(envs=None, names=None) -> None:  # the environments the rewards and the parser see
                if envs is not None:
                    t.environments = envs
                if names is not None:
                    t._batch_environments = names

            env_side = TrainerEnvironments(t._start_episodes, tokenize, lambda: getattr(t, "environments", None), use,
                                           t._reset_kwargs, t._multi_environment, list(t._standalone_tools or []),
                                           _environment_tools, loop, t._encode_images)
        rr = t.rollout_ranks  # (None: colocated)
        envs = PoolEnvironments(env_side, registry=rr.env_registry if rr is not None else None)
        t._partial_envs_by_key = envs.by_key  # (the trainer's episodes draw past the environments the pool holds)
        host = PoolHost(
            step=lambda: t.state.global_step, state=lambda: t.state, sampling=t._sampling, draw_inputs=t._draw_inputs,
            start_episodes=t._start_episodes, tokenize=tokenize, encode_images=t._encode_images, decode=t._decode,
            round_of=t._round_of, records_batch=t._records_batch, log_agent_stats=t._log_agent_stats,
            log_turns=t._log_turns, parse_turn=t._parse_turn, suffix_ids=t._get_tool_suffix_ids,
            home_tools=t._home_tools, endpoint_settings=t._endpoint_settings, context_length=t.engine_setup.context_length,
            episode_runner=lambda: episode_runner(t.agent, t.rollout_func, t, args, t.num_generations,
                                                  t.rollout_engine.max_model_len, t.tools))
        groups = PoolGroups()
        encoder = PromptEncoder(t.processing_class, t.tools, t.chat_template, t.chat_template_kwargs, t._is_vlm)
        metrics = Metrics(t._metrics)
        agents = t.agent is not None or t.rollout_func is not None
        if rr is not None:  # the pools live on the rollout ranks (trainer/remote_partial.py)
            side = RankSide(t.rollout_engine, rr.ahead_jobs, rr.log_job,
                            rr.env_host.prefix if rr.env_host is not None else None)
            rounds = RemoteRound(args, t.layout, acc.process_index, acc.is_main_process, t.num_generations, host,
                                 side, groups, envs, encoder, metrics, t.generation_clock, tools=bool(t.tools),
                                 agents=agents)
        else:
            on = Colocated(args, t.rollout_engine, t.layout, acc.process_index, acc.num_processes, host, groups, envs,
                           t.scoring, encoder, metrics, t.generation_clock, t.tools, loop, t._tokenizer,
                           t.log_completions)
            rounds = LiveRound(on) if agents else EngineRound(on)  # live agents / rollout_func groups, or samples
        return cls(rounds, groups, envs, acc.process_index)


#: how a PIL image is written in a pool's JSON (a lossless PNG, base64)
IMAGE_KEY = "__image_png__"


def _image_to_json(value):
    """``json.dumps``'s ``default``: a PIL image as ``{IMAGE_KEY: base64 PNG}`` (:func:`~trl_nrollout.rollout.ranks.
    buckets.png_bytes`, as a rollout rank's job carries it); anything else, or an image of a mode PNG lacks, is
    JSON's error."""
    from PIL import Image

    if isinstance(value, Image.Image) and isinstance(data := png_bytes(value), bytes):
        return {IMAGE_KEY: base64.b64encode(data).decode("ascii")}
    what = f"a {value.mode} image (PNG holds {', '.join(PNG_MODES)})" if isinstance(value, Image.Image) else \
        f"Object of type {type(value).__name__}"
    raise TypeError(f"{what} is not JSON serializable")


def _image_from_json(d: dict):
    """``json.loads``'s ``object_hook``: the PIL image of ``{IMAGE_KEY: ...}`` (pixels and mode as saved)."""
    if len(d) == 1 and IMAGE_KEY in d:
        return from_png(base64.b64decode(d[IMAGE_KEY]))
    return d


def pool_to_json(groups: list[InFlightGroup]) -> str:
    """A pool as JSON text: every group's fields, PIL images (prompt messages, dataset rows, ``images``) as PNGs."""
    return json.dumps([asdict(g) for g in groups], default=_image_to_json)


def pool_from_json(text: str) -> list[InFlightGroup]:
    """The pool :func:`pool_to_json` wrote, images read back as PIL images."""
    return [_group(d) for d in json.loads(text, object_hook=_image_from_json)]


def _group(d: dict) -> InFlightGroup:
    key = d["key"]
    return InFlightGroup(tuple(key) if isinstance(key, list) else key, list(d["prompt_ids"]),
                         [_sample(s) for s in d["samples"]], d["payload"], int(d["restarts"]), d.get("images"))


def _sample(d: dict) -> PartialSample | AgentPartialSample:
    """A pool sample from its JSON: a tool-calling episode (it has ``episode``) or a single-turn sample."""
    if "episode" not in d:
        return PartialSample(**d)
    episode = None if d["episode"] is None else AgentSample(**d["episode"])
    return AgentPartialSample(**{**d, "episode": episode})
