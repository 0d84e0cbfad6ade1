"""Tool calls that go home (trl_nrollout/rollout/home_tools.py) over a real TCPStore, two ranks' HomeTools in one
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

from trl_nrollout.rollout.home_tools import HomeTools


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


class _CountingStore:
    """A real TCPStore, its ``add`` calls counted (a server's looks at its count of calls)."""

    def __init__(self, store):
        self.store, self.adds = store, 0

    def add(self, key, value):
        self.adds += 1
        return self.store.add(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_an_idle_long_lived_server_looks_less_often_and_still_answers_at_once():
    """A trainer's server for the rollout ranks' calls lives for the whole run (idle_poll_s=0.05): while no call
    comes it backs off to 20 looks a second (a job's server keeps looking every 2 ms), and a call after a long idle
    is answered, after which it looks often again. Mutation tried: the pause never grows -> the idle server looks
    as often as the job's, the first assertion fails."""
    import time

    store = _CountingStore(_store())
    run = lambda i, calls: ([{"role": "tool", "name": "t", "content": f"{i}"}], 0)  # noqa: E731
    long_lived = HomeTools(store, "trainer/1", 0, lambda i: 0, run, workers=1, idle_poll_s=0.05)
    with long_lived:
        time.sleep(0.6)
        idle_looks = store.adds
        sender = HomeTools(store, "trainer/1", 1, lambda i: 0, None, workers=1)
        start = time.perf_counter()
        answer = sender.run(5, [{"type": "function", "function": {"name": "t", "arguments": {}}}])
        waited = time.perf_counter() - start
    job_store = _CountingStore(_store())
    with HomeTools(job_store, "job/1", 0, lambda i: 0, run, workers=1):
        time.sleep(0.6)
    assert idle_looks < 30 < job_store.adds  # 0.6 s idle: about 12 looks, against about 300
    assert answer == ([{"role": "tool", "name": "t", "content": "5"}], 0) and waited < 1.0
