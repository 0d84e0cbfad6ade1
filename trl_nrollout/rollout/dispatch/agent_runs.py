"""Running a user's agents (:mod:`trl_nrollout.trainer.agents`) against an endpoint
(:class:`~trl_nrollout.rollout.episodes.endpoint.AgentEndpoint`): one episode per dataset row, each with its own OpenAI
client, async agents on one event loop, sync ones in threads, each within its time (:class:`EpisodeRunner`); one
rollout's episodes on a rank's engine, handed out whole or pulled from a balanced queue (:func:`run_episodes`),
colocated or on a rollout rank."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import Any

from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.dispatch import PullStats
from trl_nrollout.rollout.dispatch.balanced import drop_job_queue, job_queue, send_home
from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
from trl_nrollout.rollout.seeds import prompt_seed, turn_seed
from trl_nrollout.rollout.types import SamplingOptions

logger = logging.getLogger(__name__)


def agent_arguments(agent) -> list[str]:
    """The parameters :class:`EpisodeRunner` fills for ``agent``, by name; ValueError naming the function otherwise."""
    params = list(inspect.signature(agent).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    known = {"client", "base_url", "api_key", "row", "model", "tools"}
    if set(names) & known:
        missing = [p.name for p in params if p.name not in known and p.default is p.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise ValueError(f"agent {getattr(agent, '__name__', agent)!r} has parameters {missing} the trainer cannot "
                             f"fill: an agent takes any of {sorted(known)} (by name), or (client, row).")
        return [n for n in names if n in known]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        raise ValueError(f"agent {getattr(agent, '__name__', agent)!r} must take (client, row), or parameters named "
                         f"among {sorted(known)}.")
    return ["client", "row"]


class EpisodeRunner:
    """Runs ``agent`` (a function, sync or ``async``, of the parameters :func:`agent_arguments` names) for the
    episodes a rollout hands out, each within ``timeout`` seconds; an agent with a ``tools`` parameter gets
    ``tools`` (the trainer's ``tools=`` functions, to call as it likes)."""

    def __init__(self, agent, timeout: float, tools: list | tuple = (), max_running: int | None = None) -> None:
        if max_running is not None and (isinstance(max_running, bool) or not isinstance(max_running, int)
                                        or max_running < 1):
            raise ValueError(f"agent_max_concurrent={max_running!r} must be a whole number >= 1 (episodes whose "
                             "agents run at once on a rank), or None for the default, 1024.")
        self.agent = agent
        self.timeout = timeout
        self.tools = list(tools)
        self.max_running = max_running or DEFAULT_MAX_NUM_SEQS

    def run(self, pull: Callable[[int], tuple[list[EpisodeRecord], bool]], endpoint,
            finished: threading.Event) -> None:
        """Run the episodes ``pull(running)`` hands out (given how many run: new ones and whether it has no more) on
        this rank's endpoint, async agents on one event loop, sync ones in threads, each within
        ``timeout`` seconds of its start; set ``finished`` when the last has returned, failed or timed out."""
        try:
            names = agent_arguments(self.agent)
            timeout = self.timeout
            if inspect.iscoroutinefunction(self.agent):
                asyncio.run(self._run_async(pull, endpoint, names, timeout))
            else:
                self._run_sync(pull, endpoint, names, timeout)
        finally:
            finished.set()

    def _run_sync(self, pull, endpoint, names: list[str], timeout: float) -> None:
        pool = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="trl-nrollout-agent")  # a timed-out agent keeps its thread
        running: dict = {}  # future -> (record, deadline): at most max_running; the others wait in `waiting`
        waiting: list[EpisodeRecord] = []
        drained = False
        try:
            while True:
                if not drained and len(running) + len(waiting) < self.max_running:
                    new, drained = pull(len(running))
                    waiting += new
                while waiting and len(running) < self.max_running:  # an episode's time starts when its agent does
                    r = waiting.pop(0)
                    running[pool.submit(self._one_sync, r, endpoint, names)] = (r, time.monotonic() + timeout)
                self.peak_running = max(getattr(self, "peak_running", 0), len(running))
                if not running:
                    if drained and not waiting:
                        return
                    continue
                soonest = min(deadline for _, deadline in running.values())
                done, _ = wait_futures(running, timeout=max(0.0, soonest - time.monotonic()),
                                       return_when=FIRST_COMPLETED)
                now = time.monotonic()
                for f in list(running):
                    record, deadline = running[f]
                    if f in done:
                        del running[f]
                    elif now >= deadline:  # its thread may go on; its episode is closed, its later calls refused
                        self._episode_ended(record, endpoint, "timeout", f"ran past agent_timeout_s={timeout}")
                        del running[f]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _run_async(self, pull, endpoint, names: list[str], timeout: float) -> None:
        import openai

        async def one(record: EpisodeRecord) -> None:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url(record.key), api_key=record.key, max_retries=0,
                                        timeout=timeout)
            try:
                result = await asyncio.wait_for(self.agent(**self._kwargs(names, client, record, endpoint)),
                                                timeout)
                record.result = result
                self._episode_ended(record, endpoint, record.outcome, record.error)
            except TimeoutError:
                self._episode_ended(record, endpoint, "timeout", f"ran past agent_timeout_s={timeout}")
            except Exception as err:  # noqa: BLE001 - the agent's failure is an unscored episode
                self._episode_ended(record, endpoint, "error", f"{type(err).__name__}: {err}")
            finally:
                await client.close()

        running: set = set()
        waiting: list[EpisodeRecord] = []  # at most max_running run; the others wait here
        drained = False
        while True:
            if not drained and len(running) + len(waiting) < self.max_running:
                new, drained = pull(len(running))
                waiting += new
            while waiting and len(running) < self.max_running:
                running.add(asyncio.create_task(one(waiting.pop(0))))
            self.peak_running = max(getattr(self, "peak_running", 0), len(running))
            if not running:
                if drained and not waiting:
                    return
                continue
            _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)

    def _one_sync(self, record: EpisodeRecord, endpoint, names: list[str]) -> None:
        import openai

        client = openai.OpenAI(base_url=endpoint.base_url(record.key), api_key=record.key, max_retries=0,
                               timeout=self.timeout)
        try:
            record.result = self.agent(**self._kwargs(names, client, record, endpoint))
            self._episode_ended(record, endpoint, record.outcome, record.error)
        except Exception as err:  # noqa: BLE001 - the agent's failure is an unscored episode
            self._episode_ended(record, endpoint, "error", f"{type(err).__name__}: {err}")
        finally:
            client.close()

    def _kwargs(self, names: list[str], client, record: EpisodeRecord, endpoint) -> dict:
        values = {"client": client, "base_url": endpoint.base_url(record.key), "api_key": record.key,
                  "row": dict(record.row), "model": endpoint.model_name, "tools": list(self.tools)}
        return {name: values[name] for name in names}

    @staticmethod
    def _episode_ended(record: EpisodeRecord, endpoint, outcome: str, error: str | None) -> None:
        if record.outcome == "ok" or outcome == "timeout":  # a refused call's limit stays the outcome
            record.outcome, record.error = outcome, error
        if outcome in ("error", "timeout"):
            record.result = None  # unscored
        endpoint.close_episode(record.key)


def start_endpoint(tokenizer, *, model_name: str, max_model_len: int, max_completion_length: int, max_calls: int,
                   policy: dict[str, Any], processor: Any = None):
    """A started :class:`~trl_nrollout.rollout.episodes.endpoint.AgentEndpoint` for ``tokenizer``, answering tool calls
    with TRL's response parser where TRL knows the chat template's tool-call format (Qwen2.5/Qwen3/Llama-3/...; it
    is set on the tokenizer), plain text otherwise. ``processor``: a vision-language policy's (its agents' calls may
    send images), None for a text policy."""
    from trl.chat_template_utils import add_response_schema, parse_response

    from trl_nrollout.rollout.episodes.endpoint import AgentEndpoint

    def has_parser() -> bool:
        return (getattr(tokenizer, "response_schema", None) is not None
                or getattr(tokenizer, "response_template", None) is not None)

    if not has_parser():
        try:
            add_response_schema(tokenizer)
        except ValueError:
            logger.info("agent endpoint: TRL has no response parser for this chat template: answers are plain text "
                        "(no tool_calls).")
    parse = None
    if has_parser():
        def parse(ids, prefix, tools):
            return parse_response(tokenizer, ids, prefix=prefix, tools=None)
    endpoint = AgentEndpoint(tokenizer, model_name=model_name, max_model_len=max_model_len,
                             max_completion_length=max_completion_length, max_calls=max_calls, parse=parse,
                             policy=policy, processor=processor)
    endpoint.start()
    return endpoint


def hand_out(records: list[EpisodeRecord]) -> Callable[[int], tuple[list[EpisodeRecord], bool]]:
    """An :meth:`EpisodeRunner.run` pull that hands out ``records`` at once, then nothing more."""
    handed: list[bool] = []

    def pull(running: int) -> tuple[list[EpisodeRecord], bool]:
        out = [] if handed else records
        handed.append(True)
        return out, True

    return pull


def call_params(engine, sampling: SamplingOptions) -> Callable:
    """An endpoint call's vLLM ``SamplingParams`` on ``engine``: ``sampling`` with the call's token limit, seed and
    stop strings (:meth:`~trl_nrollout.rollout.episodes.endpoint.AgentEndpoint.serve`'s ``params``); a call with its
    own ``sampling`` (a ``rollout_func``'s) samples with that."""
    def params(call):
        return engine.sampling_params(1, replace(call.sampling or sampling, max_tokens=call.max_tokens,
                                                  seed=call.seed, stop=tuple(call.stop)))

    return params


@dataclass
class EpisodeRun:
    """One rollout's episodes on a rank: ``records``, those of the rank's own rows in their order (run here or, on a
    balanced queue, wherever their group was pulled); ``serve``, the endpoint's counts (``engine_steps``,
    ``requests``, ``idle_s``); ``wall_s``; ``pulled``, on a balanced queue over several engines the groups this
    rank's engine ran (its TP ranks' together), else None."""

    records: list[EpisodeRecord]
    serve: dict[str, float]
    wall_s: float
    pulled: PullStats | None = None


def run_episodes(engine, endpoint, runner: EpisodeRunner, rows: list[dict], n: int, sampling: SamplingOptions, *,
                 offset: int, tag: str, rank: int, balanced: bool) -> EpisodeRun:
    """Run one episode per row of ``rows`` (this rank's, TRL's order: each dataset row ``n`` times; the job's samples
    ``offset ..``) with ``runner`` on ``endpoint``, their calls on ``engine`` (a
    :class:`~trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup`, stepped only here; a TP engine's ranks exchange their
    requests). A call's seed comes from the sample's place in the job ``s`` and the call ``c`` (the first as a
    single-turn sample's, ``sampling.seed + s``; later ones per call), not from the rank that runs it.

    ``balanced`` (``rollout_dispatch="balanced"``, several engines): every rank's rows form one queue of groups
    (:func:`~trl_nrollout.rollout.dispatch.balanced.job_queue`); each rank runs the episodes of the
    groups it pulls, pulling while it runs fewer than its share of its engine's ``max_num_seqs`` plus a group, and
    the finished episodes go home to the ranks that own their rows. Collective over the engines' ranks then.
    ``tag``: the episodes' keys' prefix (unique per rollout on the rank)."""
    if balanced:  # the job's rows, rank order: rank r's samples follow those of the ranks before it
        every = engine.gather_job([dict(row) for row in rows])
        counts = [len(part) for part in every]
        job_rows = [row for part in every for row in part]
        first = 0  # job_rows[s] is sample s's row
    else:
        job_rows, first = [dict(row) for row in rows], offset
    base = sampling.seed

    def seed(s: int, c: int) -> int | None:
        if base is None:
            return None
        return base + s if c == 0 else prompt_seed(turn_seed(base, c), s, 1)

    def record(s: int) -> EpisodeRecord:
        return EpisodeRecord(key=f"{tag}r{rank}e{s}x{time.monotonic_ns() % 10**6}", row=dict(job_rows[s - first]))

    ran: dict[int, EpisodeRecord] = {}
    claimed: list[int] = []
    if balanced:
        queue = job_queue(engine, counts, n)
        capacity = engine.max_num_seqs
        target = -(-capacity // len(engine.tp_ranks)) + n  # this rank's share of its engine's batch, a group more

        def pull(running: int) -> tuple[list[EpisodeRecord], bool]:
            if running >= target:
                return [], False
            got = list(queue.claim(max(1, -(-(target - running) // n))))
            claimed.extend(got)
            new = {g * n + k: record(g * n + k) for g in got for k in range(n)}
            endpoint.admit(list(new.values()), list(new))
            ran.update(new)
            return list(new.values()), not got
        endpoint.open([], seed)
    else:
        mine = [record(offset + i) for i in range(len(rows))]
        ran.update(zip(range(offset, offset + len(rows)), mine))
        endpoint.open(mine, seed, list(ran))
        pull = hand_out(mine)
    loop = engine.request_loop(stream=False)
    finished = threading.Event()
    thread = threading.Thread(target=runner.run, args=(pull, endpoint, finished), daemon=True,
                              name="trl-nrollout-agents")
    start = time.perf_counter()
    thread.start()
    engine.barrier_before_generate()  # TP > 1 on GPUs: no training collective interleaves with the engine's
    stats = endpoint.serve(loop, call_params(engine, sampling), finished.is_set, exchange=engine.gather_tp,
                           me=engine.tp_ranks.index(engine.rank))
    thread.join(timeout=5)
    endpoint.open([], None)
    wall = time.perf_counter() - start
    if not balanced:
        return EpisodeRun([ran[offset + i] for i in range(len(rows))], stats, wall)
    home = send_home(engine, {g: [ran[g * n + k] for k in range(n)] for g in claimed}, counts, n)
    drop_job_queue(engine, queue)  # every rank is past its last claim
    places = range(offset, offset + len(rows))
    missing = sorted({s // n for s in places} - home.keys())
    if missing:
        raise RuntimeError(f"the agent episodes of groups {missing[:5]} were run by no rank.")
    groups = sorted(g for part in engine.gather_tp(claimed) for g in part)
    return EpisodeRun([home[s // n][s % n] for s in places], stats, wall,
                      PullStats(groups=groups, claims=1, busy_s=wall))
