"""Agents written in any framework, trained as they are: ``NRolloutGRPOTrainer(agent=...)``.

An agent is a function (sync or ``async``) that runs one episode: given an OpenAI client whose base URL is its
episode's on the trainer's endpoint (:mod:`trl_nrollout.rollout.episodes.endpoint`) and the dataset row, it talks to
the policy as to any OpenAI-compatible server and returns its reward (a number), a dict of reward-function kwargs,
or None (unscored). Parameters are matched by name: ``client`` (an ``openai.AsyncOpenAI`` for an async agent, an
``openai.OpenAI`` otherwise), ``base_url`` and ``api_key`` (for frameworks that build their own client), ``row``
(the dataset row), ``model`` (the name to send), ``tools`` (the trainer's ``tools=`` functions); a function of two
positional parameters gets ``(client, row)``.

Each step every rank runs its ``n`` episodes per prompt at once (async agents on one event loop, sync agents in
threads) against its own endpoint and engine, while the trainer's thread runs their requests on the engine as they
come (no turn barrier). What trains is what the engine generated
(:func:`~trl_nrollout.rollout.episodes.agent_calls.assemble`): an episode whose calls chain is one sample (tokens between
calls masked); an episode whose agent edited its history (split) trains each call as a sample of its own with the
episode's advantage (:func:`split_calls`, :func:`~trl_nrollout.trainer.stages.expand_segments`; a rank then trains
more rows than its share of episodes), and ``agent/split_episodes`` counts them. An agent that raises, or runs past ``agent_timeout_s``, is
an unscored episode (its reward None: TRL's rules), never a hang; one past ``agent_max_calls`` gets an error
answer and its reward as it returns it.

The episode kind is :class:`EndpointAgents` (:mod:`trl_nrollout.trainer.episodes`); with
``rollout_dispatch="balanced"`` over several engines the ranks pull groups of the job's rows from one queue, run them
on their own endpoints and send the finished episodes home. A partial rollout of agents (a pool of live episodes) is
:class:`~trl_nrollout.trainer.pool_rounds.LiveRound`.

Reward: without ``reward_funcs`` the agent's number is the reward (:func:`agent_reward`); with them, every function
gets ``agent_reward`` (and a dict result's keys) as keyword arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from accelerate.utils import gather_object

from trl_nrollout.config.checks import agent_dependencies_refusal
from trl_nrollout.errors import InputError
from trl_nrollout.rollout.axes import DispatchRule
from trl_nrollout.rollout.dispatch import PullStats
from trl_nrollout.rollout.dispatch.agent_runs import (
    EpisodeRun,
    EpisodeRunner,
    agent_arguments,
    run_episodes,
    start_endpoint,
)
from trl_nrollout.rollout.episodes.agent_calls import Assembled, EpisodeRecord, assemble, reward_kwargs
from trl_nrollout.rollout.episodes.rollout_func import FuncRunner, func_samples, samples_batch
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.episodes import Episode, EpisodeJob
from trl_nrollout.trainer.stages import Sample

logger = logging.getLogger(__name__)


def agent_reward(completions: list, agent_reward: list | None = None, **kwargs) -> list[float | None]:
    """The reward function of an agent trainer without ``reward_funcs``: each episode's own reward, as its agent
    returned it (None: unscored)."""
    return list(agent_reward) if agent_reward is not None else [None] * len(completions)


def split_calls(assembled: Assembled, record: EpisodeRecord, limit: int | None, processor: Any = None
                ) -> tuple[Sample, ...]:
    """A split episode's calls after the first, each a sample of its own (its prompt as the trainer's forward takes
    it, image placeholders expanded, its completion and the engine's log-probs; ``length`` where the engine stopped
    at the token limit or the completion reaches ``limit``); empty for an episode that is one sample. A call that
    sent images carries its own image tensors (``processor``'s, in :attr:`Sample.mm`): every image of its prompt, as
    the engine saw them."""
    if not assembled.split:
        return ()
    out = []
    for call in trained_calls(record)[1:]:
        ids = list(call.completion_ids)
        if not ids:  # a call that generated nothing has nothing to train
            continue
        cut = call.finish_reason == "length" or (limit is not None and len(ids) >= limit)
        mm = None
        if call.images:
            from trl_nrollout.passes.multimodal import image_tensors

            mm = image_tensors(processor, call.images)
        out.append(Sample(list(call.prompt_ids), ids, list(call.logprobs), "length" if cut else "stop", None, mm))
    return tuple(out)


def agent_reward_funcs(agent, reward_funcs, args=None) -> list | None:
    """The reward functions of a trainer with ``agent`` (checked: a callable with parameters the trainer fills):
    ``reward_funcs``, or the agent's own reward (:func:`agent_reward`) when none are given. ``agent_max_concurrent``
    without an agent is refused: nothing else reads it (a ``rollout_func`` run group by group runs one call per
    group), so it would be ignored."""
    if agent is None:
        cap = getattr(args, "agent_max_concurrent", None)
        if cap is not None:
            raise InputError(f"agent_max_concurrent={cap} caps the episodes of agent= (agents behind the "
                             "trainer's OpenAI-compatible endpoint), and this trainer has no agent=: nothing would "
                             "read it. Pass agent=your_function, or drop agent_max_concurrent (TRL tools and "
                             "rollout_func episodes run as many at once as the engine's rollout_max_num_seqs).")
        return reward_funcs
    if not callable(agent):
        raise TypeError(f"agent={agent!r} must be a function (sync or async) running one episode.")
    agent_arguments(agent)
    if (why := agent_dependencies_refusal()) is not None:  # before the model loads, not at the first rollout
        raise InputError(why)
    return reward_funcs if reward_funcs else [agent_reward]


def agent_refusal(args, rollout_backend: str, environment_factories, rollout_func) -> str | None:
    """Why a trainer with these options, engine, environments and ``rollout_func`` cannot run ``agent=`` (None: it
    can); the rows of :data:`~trl_nrollout.rollout.axes.REFUSALS` whose first side is ``agent``."""
    from trl_nrollout.rollout.axes import machine_refusal

    if rollout_backend != "vllm":
        return machine_refusal("agent", "drop agent=", auto=args.rollout_backend == "auto")
    if environment_factories or rollout_func is not None:
        return ("agent= with environment_factory or rollout_func: each of them is the episode's loop, as the "
                "agent is (one episode kind per trainer); build the environment inside the agent (it gets the "
                "row), or drop agent=. (tools= compose: an agent with a `tools` parameter gets them.)")
    if args.rollout_seed_mode == "engine":
        return ("agent= with rollout_seed_mode='engine': the endpoint seeds each request (a sample's tokens must "
                "not depend on which other requests share an engine step); use rollout_seed_mode='sample'.")
    return None


def endpoint_settings(args, model_name: str, max_model_len: int, processor: Any = None) -> dict:
    """What an endpoint needs besides the tokenizer (:func:`start_endpoint`'s keywords): the policy's ``model_name``,
    its engine's context ``max_model_len``, the options' limits and sampling, a vision-language policy's
    ``processor`` (its agents may send images; None: a text policy, or where agents' images are not carried)."""
    return {"model_name": model_name, "max_model_len": max_model_len, "processor": processor,
            "max_completion_length": args.max_completion_length, "max_calls": args.agent_max_calls,
            "policy": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                       "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}}


def episode_runner(agent, rollout_func, func_trainer, args, num_generations: int, max_model_len: int, tools):
    """What runs episodes on an endpoint: the ``agent`` (:class:`EpisodeRunner`, with the trainer's ``tools``), or
    the ``rollout_func`` group by group (:class:`~trl_nrollout.rollout.episodes.rollout_func.FuncRunner`; ``func_trainer``: what
    TRL's contract hands the function)."""
    if rollout_func is None:
        return EpisodeRunner(agent, args.agent_timeout_s, tools or (), args.agent_max_concurrent)
    return FuncRunner(rollout_func, func_trainer, num_generations, max_model_len, args.max_completion_length,
                      args.rollout_is is not None)


def remote_agent_episodes(engine, agent_job: Callable, ahead_jobs: Callable, log_remote: Callable, inputs: list[dict],
                          prompt_ids: list[list[int]], n: int, sampling: SamplingOptions, mode: str, step: int,
                          step_job: bool) -> EpisodeRun:
    """This rank's episodes run on the rollout ranks (``engine``: their proxy): a job whose ``agent`` entry carries
    the rows (``agent_job(mode, step, rows)``; ``ahead_jobs(mode)``: the next steps' jobs, written ahead;
    ``log_remote(mode)``: the step's view of the rollout ranks), read back as the records (the rollout ranks'
    endpoints recorded every call's tokens and log-probs; what trains is assembled here, as colocated)."""
    batch, extras = engine.run_job_episodes(
        [list(p) for p in prompt_ids], n, sampling, agent_job(mode, step, inputs),
        ahead=ahead_jobs(mode) if step_job else (), step_job=step_job)
    if step_job:
        log_remote(mode)
    idle = max((e["engine_idle_s"] for e in extras), default=0.0)
    records = [replace(e["record"], row=dict(row)) for e, row in zip(extras, inputs, strict=True)]
    return EpisodeRun(records, {"idle_s": idle}, batch.timings.get("generate_s", 0.0))


@dataclass(frozen=True)
class AgentRecords:
    """What trains of finished episodes' records: a ``rollout_func``'s returned samples (``func``), or the agents'
    calls assembled and logged into ``metrics``. ``tokenize``: TRL's prompt tokenization; ``limit``:
    ``max_completion_length``; ``rank``: this process (for the logs); ``processor``: a vision-language policy's
    (the image tensors of calls that sent images), None for a text policy; ``encode_images``: the prompts' images
    encoded (``collector.ImagePrompts.encode``; None for text prompts): a ``rollout_func``'s samples train on their
    prompts' images, TRL's contract, as the whole-batch call's do."""

    tokenizer: Any
    tokenize: Callable[[list], tuple]
    func: bool
    limit: int | None
    metrics: Any
    rank: int
    main: bool
    processor: Any = None
    encode_images: Callable[[list], Any] | None = None

    def batch(self, records: list[EpisodeRecord], prompts: list, n: int, offset: int, mode: str, stats: dict,
              wall: float, prompt_ids: list[list[int]] | None = None) -> tuple[RolloutBatch, Episode]:
        """What trains of ``records`` (one per sample, in order; ``prompts`` theirs, the job's samples ``offset
        ..``): a ``rollout_func``'s samples, or the agents' calls assembled and logged with the endpoint's ``stats``
        and the rollout's ``wall`` seconds. ``prompt_ids``: the prompts' tokens where the caller has them (else
        tokenized here, for agents only)."""
        if self.func:  # the samples it returned (an error with its traceback where it raised)
            batch, masks, extra = samples_batch(func_samples(records), n, offset)
            images = self.encode_images(prompts) if self.encode_images is not None else None
            return batch, Episode(tool_mask=masks, extra_fields=extra, mm=images.mm if images is not None else None)
        ids = prompt_ids if prompt_ids is not None else self.tokenize(prompts)[0]
        batch, episode = self.assembled(records, ids, n, offset)
        self.log(mode, records, episode, stats, wall)
        return batch, episode

    def assembled(self, records: list[EpisodeRecord], prompt_ids: list[list[int]], n: int, offset: int
                  ) -> tuple[RolloutBatch, Episode]:
        """What trains of ``records`` (one per sample; ``prompt_ids`` their prompts' tokens; the job's samples
        ``offset ..``): the batch and the :class:`~trl_nrollout.trainer.episodes.Episode` (masks between calls, the
        calls' messages, a split episode's later calls, the agents' reward kwargs; ``assembled``: each episode laid
        out, for the logs)."""
        eos = self.tokenizer.eos_token_id or 0
        done = [assemble(trained_calls(r), prompt_ids[i], eos) for i, r in enumerate(records)]
        masks = [a.mask for a in done]
        limit = self.limit
        segments = [split_calls(a, r, limit, self.processor) for a, r in zip(done, records)]  # its later calls
        # cut at the limit: the episode's last call (a split episode's sample is its first call)
        reasons = [("length" if len(a.completion_ids) >= limit
                    or (r.calls and r.calls[0 if a.split else -1].finish_reason == "length") else "stop")
                   for a, r in zip(done, records)]
        batch = RolloutBatch([a.prompt_ids for a in done], [a.completion_ids for a in done],
                             [a.logprobs for a in done], reasons, [(offset + i) // max(n, 1) for i in range(len(done))])
        extra = _reward_kwargs(records)
        completions = [[{"role": "assistant", "content": self.tokenizer.decode(c.completion_ids,
                                                                               skip_special_tokens=True)}
                        for c in r.calls] or [{"role": "assistant", "content": ""}] for r in records]
        return batch, Episode(tool_mask=masks, completions=completions, turns=[max(1, len(r.calls)) for r in records],
                              tool_calls=[0] * len(records), tool_failures=[0] * len(records), extra_fields=extra,
                              segments=segments, assembled=done, mm=self.image_tensors(records, done))

    def image_tensors(self, records: list[EpisodeRecord], done: list[Assembled]) -> list | None:
        """Per sample, the processor's image tensors of the images its prompt holds, in order: an episode's last
        call's (the calls chain, so its prompt holds every image the episode sent); a split episode's first call's
        (its sample is that call; its later calls carry their own, :func:`split_calls`). None where none was sent."""
        if not any(c.images for r in records for c in r.calls):
            return None
        from trl_nrollout.passes.multimodal import image_tensors

        out = []
        for r, a in zip(records, done):
            call = (r.calls[0] if a.split else r.calls[-1]) if r.calls else None
            out.append(image_tensors(self.processor, call.images) if call is not None and call.images else None)
        return out

    def log(self, mode: str, records: list[EpisodeRecord], episode: Episode, stats: dict, wall: float) -> None:
        """The agents' outcomes, calls and splits (over every rank), the engine's idle seconds, the wall time."""
        every = gather_object([(len(r.calls), r.outcome, a.split) for r, a in zip(records, episode.assembled)])
        total = len(every)
        add = self.metrics.add
        for outcome in ("error", "timeout", "calls", "tokens"):
            add(mode, f"agent/{outcome}_episodes", sum(o == outcome for _, o, _ in every) / max(total, 1))
        add(mode, "agent/calls_per_episode", sum(c for c, _, _ in every) / max(total, 1))
        add(mode, "agent/split_episodes", sum(s for _, _, s in every) / max(total, 1))
        add(mode, "agent/engine_idle_s", stats["idle_s"])
        if "kept_tokens" in stats:  # partial rollouts: calls cut by the step's end continue with these tokens
            add(mode, "agent/continued_tokens", stats["kept_tokens"])
            add(mode, "agent/redrawn_tokens", stats.get("redrawn_tokens", 0.0))  # (stop strings at the cut)
        add(mode, "agent/rollout_s", wall)
        split = sum(s for _, _, s in every)
        if split and self.main:
            logger.info("%d of %d agent episodes split (their agent edited its history): each of their calls trains "
                        "as a sample of its own, with its episode's advantage.", split, total)
        failed = [r for r in records if r.outcome in ("error", "timeout")]
        if failed:
            logger.warning("%d of %d agent episodes on rank %d are unscored (%s), e.g. %s", len(failed), len(records),
                           self.rank, ", ".join(sorted({r.outcome for r in failed})), failed[0].error)


def trained_calls(record: EpisodeRecord) -> list:
    """An episode's calls with each prompt as the trainer's forward takes it (image placeholders expanded)."""
    return [c if c.expanded_ids is None else replace(c, prompt_ids=list(c.expanded_ids)) for c in record.calls]


def _reward_kwargs(records: list[EpisodeRecord]) -> dict[str, list]:
    """Every episode's result as reward-function kwargs (one list per key; None where an episode lacks it)."""
    per = []
    for r in records:
        try:
            per.append(reward_kwargs(r.result))
        except TypeError as err:
            raise TypeError(f"episode of row {r.row!r:.100}: {err}") from None
    keys = sorted({k for kw in per for k in kw})
    return {k: [kw.get(k) for kw in per] for k in keys}


class EndpointAgents:
    """The episode kind of ``agent=`` (and of a ``rollout_func`` run group by group): this rank's episodes (one per
    sample, TRL's order: each prompt ``n`` times) through an endpoint, what trains assembled by ``records``.

    Colocated, on this rank's endpoint (started at the first rollout with ``settings``, closed by :meth:`close`) and
    ``engine`` (:func:`~trl_nrollout.rollout.dispatch.agent_runs.run_episodes`; with a job-wide dispatch ``rule``,
    ``rollout_dispatch="balanced"``, over several engines the ranks pull groups of the job's rows from one queue and
    the episodes come home). With rollout ranks, ``remote(inputs, prompt_ids, n, sampling, mode, step, step_job)`` runs them there (:func:`remote_agent_episodes`,
    the next steps' written ahead) and sends the records back. ``runner()``: a new runner of the episodes
    (:func:`episode_runner`)."""

    tokenized = False

    def __init__(self, engine, records: AgentRecords, runner: Callable[[], Any], tokenizer, settings: Callable[[], dict],
                 *, rule: DispatchRule, rank: int, log_dispatch: Callable[..., None],
                 remote: Callable[..., EpisodeRun] | None = None) -> None:
        self.rollout_engine, self.records, self.runner = engine, records, runner
        self.tokenizer, self.settings = tokenizer, settings
        self.rule, self.rank, self.log_dispatch, self.remote = rule, rank, log_dispatch, remote
        self.endpoint = None

    def start(self):
        """The rank's endpoint, started once (its port stays for the run)."""
        if self.endpoint is None:
            self.endpoint = start_endpoint(self.tokenizer, **self.settings())
            logger.info("agent endpoint: http://127.0.0.1:%d/e/<episode>/v1 (rank %d)", self.endpoint.port, self.rank)
        return self.endpoint

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def run(self, job: EpisodeJob) -> tuple[RolloutBatch, Episode]:
        inputs, n, offset, mode = job.inputs, job.n, job.offset, job.mode
        prompt_ids = None  # (tokenized where a job carries them, or where the agents' calls are assembled)
        if self.remote is not None:
            prompt_ids = self.records.tokenize(job.prompts)[0]
            run = self.remote(inputs, prompt_ids, n, job.sampling, mode, job.step, job.step_job)
        else:
            engine = self.rollout_engine
            run = run_episodes(engine, self.start(), self.runner(), inputs, n, job.sampling, offset=offset,
                               tag=f"{mode}{job.step}", rank=self.rank,
                               balanced=self.rule.job_wide and engine.balances_job)
            if self.rule.job_wide:  # (one engine: its queue is this rank's groups)
                self.log_dispatch(mode, run.pulled or PullStats(groups=sorted({(offset + i) // n for i in range(
                    len(inputs))}), claims=1, busy_s=run.wall_s), len(inputs), n)
        return self.records.batch(run.records, job.prompts, n, offset, mode, run.serve, run.wall_s, prompt_ids)
