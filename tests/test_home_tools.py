"""Tool calls that go home (trl_nrollout/rollout/episodes/home_tools.py) over a real TCPStore, two ranks' HomeTools in one
process (their threads as the ranks' engines' tool runners would call them). The two-process run through the trainer
(balanced queue, environments): tests/test_combinations.py::test_environment_and_agent_episodes_on_a_
balanced_queue_come_home."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from trl_nrollout.rollout.episodes.home_tools import HomeTools


def _store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=60))


def test_calls_run_on_their_home_rank_both_ways_at_once_and_large_answers_travel_in_parts():
    """Samples 0..7 live on rank 0, 8..15 on rank 1; each rank's 6 tool threads call every sample at once (so each
    rank sends half its calls to the other while serving the other's): every call runs where its sample lives, on
    that sample's own state, and its answer comes back whole, one of them 9 MiB (over the store's 8 MiB value: it
    travels in parts). Mutations tried: waiting with a blocking ``store.get`` (it holds the client the threads
    share) -> the calls deadlock and the 60 s bound fails; the answer written in one value -> the 9 MiB answer
    fails."""
    store = _store()
    ran_on: dict[int, list[int]] = {0: [], 1: []}
    lock = threading.Lock()

    def local(rank):
        def run(i, calls):
            assert i // 8 == rank  # only a sample homed here runs here
            with lock:
                ran_on[rank].append(i)
            text = "x" * (9 << 20) if i == 13 else f"sample {i}: {calls[0]['function']['name']}"
            return [{"role": "tool", "name": "t", "content": text}], 0
        return run

    hosts = [HomeTools(store, "job/1", r, lambda i: i // 8, local(r), workers=3) for r in (0, 1)]
    call = [{"type": "function", "function": {"name": "lucky_number", "arguments": {}}}]
    results: dict = {}

    def job():
        with hosts[0], hosts[1], ThreadPoolExecutor(12) as pool:
            futures = {(r, i): pool.submit(hosts[r].run, i, call) for r in (0, 1) for i in range(16)}
            for key, f in futures.items():
                results[key] = f.result()

    runner = threading.Thread(target=job, daemon=True)  # a deadlock fails the test instead of hanging it
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the tool calls did not finish within 60 s (a deadlock)"
    assert len(results) == 32
    assert sorted(ran_on[0]) == sorted(list(range(8)) * 2) and sorted(ran_on[1]) == sorted(list(range(8, 16)) * 2)
    for (_, i), (messages, failed) in results.items():
        assert failed == 0
        assert messages[0]["content"] == ("x" * (9 << 20) if i == 13 else f"sample {i}: lucky_number")
    assert hosts[0].sent == 8 and hosts[1].sent == 8 and hosts[0].served == 8 and hosts[1].served == 8
    assert not store.check(["job/1/0/n"]) and not store.check(["job/1/1/q/0"])  # nothing left in the store


def test_a_home_ranks_runner_error_reaches_the_caller_naming_the_sample():
    """A failure of the home rank's runner (not a tool's error, which is a result) raises on the calling rank with
    the sample and the home rank named; the home rank goes on serving. Mutation tried: the error swallowed (an empty
    answer) -> fails."""
    store = _store()

    def broken(i, calls):
        raise KeyError(f"no environment for sample {i}")

    home = HomeTools(store, "job/2", 0, lambda i: 0, broken, workers=1)
    caller = HomeTools(store, "job/2", 1, lambda i: 0, broken, workers=1)
    with home, caller:
        with pytest.raises(RuntimeError, match=r"sample 5 failed on its home rank 0.*no environment for sample 5"):
            caller.run(5, [])
        with pytest.raises(RuntimeError, match="sample 6"):
            caller.run(6, [])


class _PauseLog(threading.Event):
    """The server's stop event, each pause it waits recorded in order (the server's looks, without a clock)."""

    def __init__(self):
        super().__init__()
        self.pauses: list[float] = []

    def wait(self, timeout=None):
        self.pauses.append(timeout)
        return super().wait(timeout)


def _wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    """Block until ``condition()`` holds; the limit only bounds a failing test (nothing is timed)."""
    import time

    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_idle_long_lived_server_looks_less_often_and_still_answers_at_once():
    """A trainer's server for the rollout ranks' calls lives for the whole run (idle_poll_s=0.05): while no call
    comes its pause between looks doubles from POLL_S up to idle_poll_s and stays there (20 looks a second), a call
    after a long idle is answered, and the look that finds it brings the pause back to POLL_S; a job's server
    (idle_poll_s=POLL_S) keeps looking every 2 ms. The pauses are read in order, not timed. Mutations tried: the
    pause never grows -> the idle server never reaches idle_poll_s; the pause not reset by a call -> the look after
    the call pauses idle_poll_s."""
    from trl_nrollout.rollout.episodes.home_tools import POLL_S

    store = _store()
    run = lambda i, calls: ([{"role": "tool", "name": "t", "content": f"{i}"}], 0)  # noqa: E731
    long_lived = HomeTools(store, "trainer/1", 0, lambda i: 0, run, workers=1, idle_poll_s=0.05)
    long_lived._stop = log = _PauseLog()
    with long_lived:
        _wait_for(lambda: log.pauses.count(0.05) >= 3, "the idle server never paused 0.05 s")
        idle = list(log.pauses)
        sender = HomeTools(store, "trainer/1", 1, lambda i: 0, None, workers=1)
        answer = sender.run(5, [{"type": "function", "function": {"name": "t", "arguments": {}}}])
        _wait_for(lambda: len(log.pauses) > len(idle) + 1, "the server stopped looking")
        after = log.pauses[len(idle):]
    growing = [min(POLL_S * 2 ** k, 0.05) for k in range(1, len(idle) + 1)]
    assert idle == pytest.approx(growing), idle  # 0.004, 0.008 ... 0.05, 0.05 ...: at most 20 looks a second
    # the look that served the call pauses POLL_S (the looks before it, if any, still the idle pause)
    assert POLL_S in after and set(after[:after.index(POLL_S)]) <= {0.05}, after
    assert answer == ([{"role": "tool", "name": "t", "content": "5"}], 0)
    job = HomeTools(_store(), "job/1", 0, lambda i: 0, run, workers=1)
    job._stop = job_log = _PauseLog()
    with job:
        _wait_for(lambda: len(job_log.pauses) >= 20, "the job's server stopped looking")
    assert set(job_log.pauses) == {POLL_S}  # a job's server never backs off
