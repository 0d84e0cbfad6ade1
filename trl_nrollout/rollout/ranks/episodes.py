"""Request-level tool episodes on rollout ranks (``rollout_ranks`` with ``rollout_multi_turn="requests"``).

A whole episode is a job of the rollout ranks: each rollout rank runs the request-level agent loop the colocated
path runs (the dispatch rule's ``run_agents``: :func:`~trl_nrollout.rollout.dispatch.shares.run_agents`, or
``run_agents_balanced`` with ``rollout_dispatch="balanced"``) on its own engine, with the user's tools (the same script builds the trainer on
every process, so the rollout rank holds the same ``tools=``), the trainers' tokenizer (pickled into the start
message, with the response template TRL set on it) and chat template. It answers each episode's tokens, tool masks
(0 on tool-result tokens), the engine's log-probs, finish reasons and what the rewards need (messages, counts);
the trainers turn them into the same batch and episode the colocated path gives.

- :func:`agent_settings`: what the trainers add to the start message (``agent``);
- :func:`episode_extras`: the per-sample fields a :class:`~trl_nrollout.rollout.types.JobResult` carries besides
  tokens and log-probs (the tool masks as one flat ``int8`` array; :func:`~trl_nrollout.rollout.types.pack_extras`
  unpacks them);
- :func:`run_agent_job`: a rollout rank's side of one agent job.

:class:`~trl_nrollout.rollout.types.JobResult` (in :mod:`~trl_nrollout.rollout.types`) is what a rollout rank answers
for its slice of any job (single-turn, a tool turn, episodes).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.episodes.tool_images import TurnMedia
from trl_nrollout.rollout.episodes.tools import (
    AgentCallbacks,
    AgentSample,
    AgentStats,
    call_tools,
    split_tools,
)
from trl_nrollout.rollout.ranks.buckets import encode_job_images
from trl_nrollout.rollout.ranks.jobs import JobDone, RankJob, job_kind
from trl_nrollout.rollout.ranks.state import EpisodeSettings, RankState
from trl_nrollout.rollout.seeds import step_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions

#: The fields of an episode beyond its tokens, log-probs and finish reason (one value per sample).
EPISODE_FIELDS = ("completions", "turns", "tool_calls", "tool_failures")


def agent_settings(processing_class: Any, chat_template: str | None, chat_template_kwargs: dict | None, *, seed: int,
                   max_iterations: int | None, max_completion_length: int, max_model_len: int, workers: int
                   ) -> EpisodeSettings:
    """The ``agent`` entry of the start message: the trainers' tokenizer (or processor), pickled as TRL left it
    (its response template parses the tool calls), the chat template rendering the tool results, and the limits and
    seed of the colocated loop (:class:`AgentCallbacks`)."""
    return EpisodeSettings(pickle.dumps(processing_class, protocol=pickle.HIGHEST_PROTOCOL), chat_template,
                           dict(chat_template_kwargs or {}), seed, max_iterations, max_completion_length, max_model_len,
                           workers)


def agent_callbacks(settings: EpisodeSettings, tools: list) -> tuple[AgentCallbacks, int]:
    """The rollout rank's :class:`AgentCallbacks` (and tool workers) from the start message's ``agent`` entry and
    the rollout rank's own ``tools``: parsing and tool-result rendering exactly as TRL's trainer does them (its
    ``_get_tool_suffix_ids``, called on the same tokenizer and chat template)."""
    from transformers import PreTrainedTokenizerBase
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    processing_class = pickle.loads(settings.processing_class)
    is_vlm = not isinstance(processing_class, PreTrainedTokenizerBase)
    tokenizer = processing_class.tokenizer if is_vlm else processing_class
    view = SimpleNamespace(processing_class=processing_class, chat_template=settings.chat_template,
                           chat_template_kwargs=settings.chat_template_kwargs, _is_vlm=is_vlm,
                           _tokenizer=tokenizer)
    sync, asyn = split_tools(list(tools))
    media = None
    if is_vlm:  # a tool's images: the results' tokens with their placeholders unexpanded, as the engine takes them
        from trl_nrollout.passes.multimodal import engine_suffix_ids

        media = TurnMedia([], [], lambda messages: engine_suffix_ids(
            processing_class, messages, chat_template=settings.chat_template,
            chat_template_kwargs=settings.chat_template_kwargs))
    agent = AgentCallbacks(
        parse=lambda i, ids, prefix: parse_response(tokenizer, ids, prefix=prefix, tools=tools),
        run_tools=lambda i, calls: call_tools(calls, sync, asyn),
        suffix_ids=lambda messages: GRPOTrainer._get_tool_suffix_ids(view, messages),
        max_iterations=settings.max_iterations, max_completion_length=settings.max_completion_length,
        max_model_len=settings.max_model_len, media=media)
    return agent, int(settings.workers)


def episode_extras(samples: list[AgentSample]) -> tuple[np.ndarray, list[dict]]:
    """The samples' tool masks as one flat array (``int8 [sum of lengths]``, in the samples' order, each as long as
    its completion) and their other fields (:data:`EPISODE_FIELDS`), one dict per sample; a sample whose tools
    returned images adds them (``images``: PNG bytes, in order; :func:`~trl_nrollout.rollout.ranks.buckets.
    encode_job_images`)."""
    mask = np.array([m for s in samples for m in s.tool_mask], dtype=np.int8)
    fields = [{"completions": s.messages, "turns": s.turns, "tool_calls": s.tool_calls,
               "tool_failures": s.tool_failures} for s in samples]
    for f, pics in zip(fields, encode_job_images([s.images for s in samples]) or []):
        if pics:
            f["images"] = pics
    return mask, fields


@dataclass(frozen=True)
class EpisodeJob:
    """The entry of a job of whole episodes on the rollout ranks (it travels pickled in the job's message): TRL tool
    episodes request by request (``step`` and ``mode`` seed their turns as the colocated loop's) or ``agent=``
    episodes and a ``rollout_func``'s groups (``rows``: the dataset rows, each ``n`` times). With environments (on
    the trainers): each trainer's tool server and key of its episodes there (``envs``), samples (``sizes``) and
    samples' environment names (``names``). A trainer writes its own (one trainer's lists); the job's joins them in
    rank order (:meth:`join`)."""

    step: int
    mode: str
    rows: list[dict] | None = None
    envs: list[tuple] | None = None
    sizes: list[int] | None = None
    names: list | None = None

    @classmethod
    def join(cls, entries: list[EpisodeJob]) -> EpisodeJob:
        """The job's entry from the trainers' (rank order): each list field joined, each trainer's after those of
        the trainers before it; the step and mode the first trainer's (the same on all)."""
        first = entries[0]

        def joined(name: str) -> list | None:
            return None if getattr(first, name) is None else [x for e in entries for x in getattr(e, name)]

        return cls(first.step, first.mode, rows=joined("rows"), envs=joined("envs"), sizes=joined("sizes"),
                   names=joined("names"))


@job_kind(EpisodeJob)
def episode_job(job: RankJob) -> JobDone:
    """Whole episodes (:data:`~trl_nrollout.rollout.ranks.jobs.JOB_KINDS`): this rank's slice of the job's samples,
    run by :func:`run_agent_job`."""
    batch, pulled, extras, stats = run_agent_job(job.engine, job.message, job.state, job.prompts(), job.message["n"],
                                                 job.start, job.balanced, job.images)
    # (with images the samples' prompts are the engine's ids, placeholders unexpanded: the trainers keep theirs)
    return JobDone(batch, pulled=pulled, extras=extras, agent_stats=astuple(stats), expanded=False)


def run_agent_job(engine, message: dict, state: RankState, prompts: list[list[int]], n: int, sample_offset: int,
                  balanced: bool, images: list | None = None) -> tuple[RolloutBatch, Any, tuple[np.ndarray, list[dict]],
                                                                       AgentStats]:
    """A rollout rank's slice of an agent job: ``prompts`` (each repeated ``n`` times, from the job's sample
    ``sample_offset`` on) as request-level episodes on ``engine``. Seeds as the colocated loop's: the first turn by
    the job's group and sample, the turn after tool round ``r`` from ``step_seed(seed, step, r, mode + "/turn")``
    (the step and mode of the job's ``agent`` entry). ``state``: the rollout rank's (the start message's ``agent``
    settings, its ``tools``; the callbacks are built once and kept there). ``images``: per sample, its prompt's
    images (the job's, once a group; ``prompts`` then hold the placeholders unexpanded), None for text: they go
    with every request of the episode, a tool's images after them (the colocated loop's ``agent.media``), and each
    sample's tools' images come back in its fields. Returns the batch, the balanced
    dispatch's pull stats (None under fixed shares), the tool masks and fields (:func:`episode_extras`) and the engine's stats."""
    settings = state.agent
    if settings is None:
        raise RuntimeError("an agent job reached a rollout rank whose start message had no agent settings "
                           "(a version mismatch between the trainers and the rollout ranks?)")
    job: EpisodeJob = message["agent"]
    if job.rows is not None:  # agent= episodes: the user's agents on this rank's endpoint
        return run_endpoint_job(engine, message, state, sample_offset, sample_offset + len(prompts), n, balanced)
    agent, workers = tool_callbacks(state, environments=bool(job.envs))
    sampling: SamplingOptions = message["sampling"]
    if job.envs:  # environments: the calls go home to the trainers, parsed with their tools' schemas
        agent = env_agent(agent, state, job, n, sample_offset, balanced)

    def turn_seed(round_: int) -> int | None:
        if sampling.seed is None:
            return None
        return step_seed(settings.seed, job.step, round_, f"{job.mode}/turn")

    encoded = None
    if agent.media is not None:  # a VLM: the prompts' images (if any) and the tools' travel with the episodes
        pics = [list(i) for i in images] if images is not None else [[] for _ in prompts]
        agent = replace(agent, media=replace(agent.media, prompt_images=pics, engine_prompts=[list(p) for p in prompts]))
        if images is not None:
            encoded = SimpleNamespace(images=pics, engine_ids=[list(p) for p in prompts])
    pulled = None
    if not prompts and not balanced and engine.layout.rollout_tp_size == 1:  # no share of this job
        samples, stats = [], AgentStats()
    else:  # the start message's dispatch rule (balanced: ``run_agents_balanced``, its pull stats)
        samples, _, stats, pulled = dispatch_rule(state.dispatch).run_agents(
            engine, prompts, n, sampling, turn_seed, agent, workers, sample_offset=sample_offset, images=encoded)
    batch = RolloutBatch([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                         [s.logprobs for s in samples], [s.finish_reason for s in samples],
                         list(range(len(samples))))
    return batch, pulled, episode_extras(samples), stats


def env_tool_schemas(env_tools: dict) -> dict:
    """Each environment's tools (TRL's ``_env_tools``: environment name -> its tools, the standalone ones included)
    as JSON schemas: what the rollout ranks parse an episode's calls with (the environments stay on the trainers)."""
    from transformers.utils import get_json_schema

    return {name: [t if isinstance(t, dict) else get_json_schema(t) for t in tools] for name, tools in env_tools.items()}


def env_home(job: EpisodeJob, n: int, trainer_rank) -> Callable[[int], tuple[str, tuple]]:
    """Job sample ``s`` -> ``(the store prefix of its trainer's tool server, (that trainer's global rank, the key
    of its episodes there, its index among that trainer's samples))``: where its environment's tools run.
    ``job.sizes``: each trainer's samples; ``trainer_rank(t)``: trainer ``t``'s global rank."""
    ends = np.cumsum(job.sizes)

    def home(s: int) -> tuple[str, tuple]:
        t = int(np.searchsorted(ends, s, side="right"))
        prefix, key = job.envs[t]
        return prefix, (trainer_rank(t), key, s - (int(ends[t - 1]) if t else 0))

    return home


def home_call(state: RankState, prefix: str, where: tuple, calls: list[dict]) -> tuple[list[dict], int]:
    """Send ``calls`` home to the trainer tool server at ``prefix`` (``where``: its global rank, the key of the
    episodes there, the sample's index among them) and wait for the tool messages and failures: a rollout rank's
    side of :class:`~trl_nrollout.rollout.episodes.home_tools.HomeTools` (send-only: nothing is served here)."""
    from trl_nrollout.rollout.episodes.home_tools import HomeTools

    senders = state.env_senders
    if prefix not in senders:
        bridge = state.bridge
        senders[prefix] = HomeTools(bridge.store, prefix, bridge.rank, lambda w: w[0], None, 1)
    return senders[prefix].run(where, calls)


def _env_parse(state: RankState) -> Callable[[list[int], list[int], object], Any]:
    """``parse(ids, prefix, name)``: a turn parsed with environment ``name``'s tool schemas (the start message's
    ``env_tools``), with the trainers' tokenizer."""
    from trl.chat_template_utils import parse_response

    if state.agent_tokenizer is None:
        processing_class = pickle.loads(state.agent.processing_class)
        state.agent_tokenizer = getattr(processing_class, "tokenizer", processing_class)
    tokenizer, schemas = state.agent_tokenizer, state.agent.env_tools
    return lambda ids, prefix, name: parse_response(tokenizer, ids, prefix=prefix, tools=schemas[name])


def env_agent(agent: AgentCallbacks, state: RankState, job: EpisodeJob, n: int, sample_offset: int,
              balanced: bool) -> AgentCallbacks:
    """``agent`` for episodes whose environments live on the trainers: each sample's turns parsed with its
    environment's tool schemas, its tool calls sent home to its trainer's tool server (:func:`home_call`). The
    engine's loop numbers samples from this rank's first (``sample_offset`` in the job), or by their place in the
    job (``balanced``)."""
    from trl_nrollout.plan.roles import TRAIN

    bridge = state.bridge
    home = env_home(job, n, lambda t: bridge.roles.global_rank(TRAIN, t))
    parse, names = _env_parse(state), job.names

    def index(i: int) -> int:
        return i if balanced else sample_offset + i

    return replace(agent, parse=lambda i, ids, prefix: parse(ids, prefix, names[index(i)]),
                   run_tools=lambda i, calls: home_call(state, *home(index(i)), calls))


def partial_env_agent(agent: AgentCallbacks, state: RankState, groups: list, width: int, hosts: list[str]
                      ) -> AgentCallbacks:
    """``agent`` for a partial pool's episodes whose environments live on the trainers: sample ``k`` of pool group
    ``g`` (index ``g * width + k``, as the partial loops number them) is parsed with its row's environment's tool
    schemas and its calls go home to the trainer that drew the group (its key's third field), to the group's
    environments there."""
    from trl_nrollout.plan.roles import TRAIN

    bridge, parse = state.bridge, _env_parse(state)
    single = None in state.agent.env_tools  # one environment_factory: its tools for every row

    def where(i: int) -> tuple[str, tuple]:
        g = groups[i // width]
        return hosts[g.key[2]], (bridge.roles.global_rank(TRAIN, g.key[2]), ("group", g.key), i % width)

    def name(i: int):
        return None if single else groups[i // width].payload["row"].get("environment")

    return replace(agent, parse=lambda i, ids, prefix: parse(ids, prefix, name(i)),
                   run_tools=lambda i, calls: home_call(state, *where(i), calls))


def run_endpoint_job(engine, message: dict, state: RankState, start: int, stop: int, n: int, balanced: bool
                     ) -> tuple[RolloutBatch, Any, tuple[np.ndarray, list[dict]], AgentStats]:
    """A rollout rank's slice ``[start, stop)`` of an ``agent=`` job: the user's agent (the rollout rank's trainer
    was built with it: the same script runs everywhere) runs one episode per row of the job's ``agent`` entry on
    this rank's endpoint (started once, with the trainers' tokenizer and limits from the start message) and engine
    (:func:`~trl_nrollout.rollout.dispatch.agent_runs.run_episodes`; seeds by the job's sample, as colocated). Answers each
    episode's record (its calls' tokens and log-probs, the agent's result) for the trainers to assemble; the batch's
    own completions stay empty."""
    from trl_nrollout.rollout.dispatch.agent_runs import run_episodes

    settings, runner = state.agent, rank_runner(state, engine)
    if state.endpoint is None:
        state.endpoint = rank_endpoint(settings)
    job: EpisodeJob = message["agent"]
    rows = job.rows[start:stop]
    if not rows and not balanced and engine.layout.rollout_tp_size == 1:  # no share of this job
        records, idle, pulled = [], 0.0, None
    else:
        run = run_episodes(engine, state.endpoint, runner, rows, n, message["sampling"], offset=start,
                           tag=f"{job.mode}{job.step}", rank=engine.rank,
                           balanced=balanced and engine.balances_job)
        records, idle, pulled = run.records, run.serve["idle_s"], run.pulled
    k = len(records)
    batch = RolloutBatch([[] for _ in range(k)], [[] for _ in range(k)], [[] for _ in range(k)], ["stop"] * k,
                         list(range(k)))
    func = settings.func is not None  # a rollout_func's groups: what it returned travels, not its calls
    answered = [replace(r, row={}, calls=[] if func else r.calls) for r in records]  # (the trainers hold the rows)
    return batch, pulled, (np.zeros(0, dtype=np.int8), [{"record": r, "engine_idle_s": idle} for r in answered]), \
        AgentStats()


def tool_callbacks(state: RankState, environments: bool = False) -> tuple[AgentCallbacks, int]:
    """The rollout rank's tool-calling callbacks and workers, built once from the start message's ``agent`` settings
    and the script's ``tools=`` (``environments``: the tools are the trainers' environments', called home, so the
    rank needs none of its own)."""
    if not state.tools and not environments:
        raise RuntimeError("tool episodes (rollout_multi_turn='requests') run their tools on the rollout ranks, but "
                           "this rollout rank's trainer was built without tools=: build NRolloutGRPOTrainer with the "
                           "same tools= on every process (the same script runs everywhere).")
    if state.agent_callbacks is None:
        state.agent_callbacks = agent_callbacks(state.agent, state.tools or [])
    return state.agent_callbacks


def rank_runner(state: RankState, engine):
    """What runs a job's episodes on this rollout rank's endpoint: the script's ``agent=``
    (:class:`~trl_nrollout.rollout.dispatch.agent_runs.EpisodeRunner`), or its ``rollout_func`` group by group
    (:class:`~trl_nrollout.rollout.episodes.rollout_func.FuncRunner`, where the start message's ``agent`` settings have
    ``func``). The function's ``trainer`` here is a :class:`RankTrainer` (this rank's arguments, the trainers'
    tokenizer, ``num_generations``, ``state.global_step`` the weights' version), kept in ``state``."""
    from trl_nrollout.rollout.dispatch.agent_runs import EpisodeRunner
    from trl_nrollout.rollout.episodes.rollout_func import FuncRunner

    settings = state.agent
    func = settings.func
    if func is None:
        return EpisodeRunner(user_agent(state), settings.timeout, state.tools or (), settings.max_running)
    if state.user_func is None:
        raise RuntimeError("the trainers run their rollout_func group by group on the rollout ranks, but this rollout "
                           "rank's trainer was built without rollout_func=: build NRolloutGRPOTrainer with the same "
                           "rollout_func= on every process (the same script runs everywhere).")
    if state.func_trainer is None:
        processing_class = pickle.loads(settings.processing_class)
        state.func_trainer = RankTrainer(state, processing_class, func.n, engine.rank)
    return FuncRunner(state.user_func, state.func_trainer, func.n, engine.max_model_len, func.limit,
                      func.need_logprobs)


class RankTrainer:
    """What a ``rollout_func`` sees as its trainer on a rollout rank: ``args`` (this process's, the same script's,
    from the rollout rank's ``rank_state``), ``processing_class`` (the trainers'), ``num_generations``,
    ``accelerator.process_index`` (``rank``: this rollout rank's place among the rollout ranks) and
    ``state.global_step`` (the version of the weights this rank holds now); ``rollout_engine`` is the group's
    (:class:`~trl_nrollout.rollout.episodes.rollout_func.TrainerView` sets it). Anything else a trainer has is not here: the
    error names it."""

    def __init__(self, rank_state: RankState, processing_class, n: int, rank: int) -> None:
        self._rank_state = rank_state
        self.args, self.processing_class, self.num_generations = rank_state.user_args, processing_class, n
        self.accelerator = SimpleNamespace(process_index=rank, is_main_process=False)
        self.is_rollout_rank = True

    @property
    def state(self) -> SimpleNamespace:
        return SimpleNamespace(global_step=self._rank_state.version)

    def __getattr__(self, name: str):
        raise AttributeError(f"a rollout_func run on a rollout rank gets a trainer with args, processing_class, "
                             f"num_generations, accelerator.process_index, state.global_step and rollout_engine; it "
                             f"has no {name!r} (the trainers' own attributes stay on the trainers).")


def user_agent(state: RankState):
    """The script's ``agent=`` on this rollout rank (the same script built its trainer); an error without one."""
    if state.user_agent is None or state.agent is None:
        raise RuntimeError("agent= episodes run on the rollout ranks, but this rollout rank's trainer was built "
                           "without agent=: build NRolloutGRPOTrainer with the same agent= on every process (the "
                           "same script runs everywhere).")
    return state.user_agent


def rank_endpoint(settings: EpisodeSettings):
    """An agent endpoint on this rollout rank, with the trainers' tokenizer and limits (the start message's
    ``agent`` settings)."""
    from trl_nrollout.rollout.dispatch.agent_runs import start_endpoint

    processing_class = pickle.loads(settings.processing_class)
    return start_endpoint(getattr(processing_class, "tokenizer", processing_class), **settings.endpoint)


def sum_stats(stats: list[tuple | None]) -> AgentStats | None:
    """The job's :class:`AgentStats` over the rollout ranks that reported them (None when none did): engine steps
    and requests summed (their ratio is the job's overlap), seconds averaged over the ranks (as the colocated
    metrics average them over the trainers)."""
    got = [AgentStats(*s) for s in stats if s is not None]
    if not got:
        return None
    return AgentStats(engine_steps=sum(s.engine_steps for s in got), steps_with_tools=sum(s.steps_with_tools for s in got),
                      idle_s=sum(s.idle_s for s in got) / len(got), tool_s=sum(s.tool_s for s in got) / len(got),
                      requests=sum(s.requests for s in got))
