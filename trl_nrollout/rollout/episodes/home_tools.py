"""Tool calls that go home: an episode's tools run on the rank that holds its environment, whichever engine runs it.

With ``rollout_dispatch="balanced"`` an engine runs the groups it pulls from the job's queue, other ranks' groups
included, while an ``environment_factory`` episode's environment lives on the rank that reset it (its prompt's rank:
its reward functions read it there). :class:`HomeTools` joins the two: the engine's tool runner calls
:meth:`HomeTools.run`, which runs a call of the rank's own samples at once and sends any other sample's call to its
home rank through the process group's key-value store; every rank serves the calls sent to it from a thread while
its own engine works, until the job's collective end (:meth:`HomeTools.close`, after every engine finished).

On the store, under the call's ``prefix``: ``<home>/n`` counts the calls sent to ``home``; call ``j`` is
``<home>/q/<j>`` (the sample's index and its tool calls, pickled) and its answer ``<home>/a/<j>`` (the tool
messages and failures, or the error that stopped the home rank's runner). Values over the store's size travel in
parts (:func:`~trl_nrollout.rollout.bridge.encode_value`). Keys are deleted once read. Every wait looks for its key
every few milliseconds (:func:`_wait`): a blocking ``get`` would hold the store's client, which this process's
threads share, until the key came.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trl_nrollout.rollout.bridge import chunk_count, decode_value, encode_value

#: seconds between two looks at the count of calls sent to this rank when none is waiting
POLL_S = 0.002

ToolCall = Callable[[int, list[dict]], tuple[list[dict], int]]


def store_put(store, key: str, value: Any) -> None:
    """``value`` pickled at ``key`` (in parts where it is larger than the store takes)."""
    values = encode_value(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    for k in range(len(values) - 1, -1, -1):  # the parts first, the head (what readers wait for) last
        store.set(key if k == 0 else f"{key}#{k}", values[k])


def _wait(store, key: str, stop: threading.Event | None = None) -> bool:
    """Wait until ``key`` is in the store, looking every few milliseconds: never a blocking ``get``, which holds the
    store's client (shared by this process's threads) until the key comes and so would stop the other threads'
    calls, the one that writes the key included. False: ``stop`` was set first."""
    pause = POLL_S
    while not store.check([key]):
        if stop is not None and stop.is_set():
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def store_take(store, key: str) -> Any:
    """The value at ``key`` (waits for it), its keys deleted."""
    _wait(store, key)
    head = store.get(key)
    count = chunk_count(head)
    parts = [store.get(f"{key}#{k}") for k in range(1, count)]  # written before the head: there
    for k in range(count):
        store.delete_key(key if k == 0 else f"{key}#{k}")
    return pickle.loads(decode_value(head, parts))


class HomeTools:
    """This rank's side of one job's tool calls (see the module docstring). ``home(i)``: the rank that holds sample
    ``i``'s environment; ``local(i, calls)``: run sample ``i``'s calls here (``i`` homed on this rank), returning
    ``(tool messages, failures)``; ``workers``: calls of other ranks' engines run at once here. Use as a context
    manager around the engines' collective run (every rank enters and leaves it). ``idle_poll_s``: a server that
    lives long (a trainer's, for rollout ranks' calls) looks less often while no call comes, up to this pause, so
    that many idle servers do not load the store; a call brings it back to :data:`POLL_S`."""

    def __init__(self, store, prefix: str, rank: int, home: Callable[[int], int], local: ToolCall,
                 workers: int, idle_poll_s: float = POLL_S) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self.idle_poll_s = max(POLL_S, idle_poll_s)  # the longest pause between looks while no call comes
        self.home, self.local = home, local
        self.sent = 0  # calls this rank sent to others (for the logs and the tests)
        self.served = 0  # calls others sent here
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="trl-nrollout-home-tool")
        self._stop = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, name="trl-nrollout-home-tools", daemon=True)

    def __enter__(self) -> HomeTools:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, i: int, calls: list[dict]) -> tuple[list[dict], int]:
        """Sample ``i``'s tool calls, run on its home rank; blocks until they are done (a tool runner's thread)."""
        home = self.home(i)
        if home == self.rank:
            return self.local(i, calls)
        j = self.store.add(f"{self.prefix}/{home}/n", 1) - 1
        store_put(self.store, f"{self.prefix}/{home}/q/{j}", (i, calls))
        self.sent += 1
        answer = store_take(self.store, f"{self.prefix}/{home}/a/{j}")
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"the tool calls of sample {i} failed on its home rank {home} (where its environment "
                               f"lives): {answer['error']}")
        return answer

    def _answer(self, j: int, i: int, calls: list[dict]) -> None:
        try:
            value: Any = self.local(i, calls)
        except Exception as err:  # noqa: BLE001 - the caller raises it, naming the sample
            value = {"error": f"{type(err).__name__}: {err}"}
        store_put(self.store, f"{self.prefix}/{self.rank}/a/{j}", value)

    def _serve(self) -> None:
        counter = f"{self.prefix}/{self.rank}/n"
        pause = POLL_S
        try:
            while True:
                stopping = self._stop.is_set()  # read before the count: a call counted before the stop is served
                total = self.store.add(counter, 0)
                pause = POLL_S if self.served < total else min(pause * 2, self.idle_poll_s)
                while self.served < total:
                    i, calls = store_take(self.store, f"{self.prefix}/{self.rank}/q/{self.served}")
                    self._pool.submit(self._answer, self.served, i, calls)
                    self.served += 1
                if stopping:
                    return
                self._stop.wait(pause)
        except BaseException as err:  # noqa: BLE001 - re-raised by close() in the main thread
            self._error.append(err)

    def close(self) -> None:
        """Stop serving (every engine has finished: no call can come any more), wait for the calls running here, and
        raise what stopped the server, if anything did."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True)
        self.store.delete_key(f"{self.prefix}/{self.rank}/n")
        if self._error:
            raise RuntimeError(f"rank {self.rank}'s server of tool calls from other engines failed: "
                               f"{self._error[0]!r}") from self._error[0]
