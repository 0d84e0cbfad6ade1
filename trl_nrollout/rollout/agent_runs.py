"""Running a user's agents (:mod:`trl_nrollout.trainer.agents`) against an endpoint
(:class:`~trl_nrollout.rollout.agent_endpoint.AgentEndpoint`): one episode per dataset row, each with its own OpenAI
client, async agents on one event loop, sync ones in threads, each within its time."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from trl_nrollout.rollout.agent_episodes import EpisodeRecord


def agent_arguments(agent) -> list[str]:
    """The parameters :class:`EpisodeRunner` fills for ``agent``, by name; ValueError naming the function otherwise."""
    params = list(inspect.signature(agent).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    known = {"client", "base_url", "api_key", "row", "model"}
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
    episodes a rollout hands out, each within ``timeout`` seconds."""

    def __init__(self, agent, timeout: float) -> None:
        self.agent = agent
        self.timeout = timeout

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
        pool = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="trl-nrollout-agent")
        running: dict = {}  # future -> (record, deadline)
        drained = False
        try:
            while True:
                if not drained:
                    new, drained = pull(len(running))
                    for r in new:
                        running[pool.submit(self._one_sync, r, endpoint, names)] = (r, time.monotonic() + timeout)
                if not running:
                    if drained:
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
        drained = False
        while True:
            if not drained:
                new, drained = pull(len(running))
                running.update(asyncio.create_task(one(r)) for r in new)
            if not running:
                if drained:
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
                  "row": dict(record.row), "model": endpoint.model_name}
        return {name: values[name] for name in names}

    @staticmethod
    def _episode_ended(record: EpisodeRecord, endpoint, outcome: str, error: str | None) -> None:
        if record.outcome == "ok" or outcome == "timeout":  # a refused call's limit stays the outcome
            record.outcome, record.error = outcome, error
        if outcome in ("error", "timeout"):
            record.result = None  # unscored
        endpoint.close_episode(record.key)
