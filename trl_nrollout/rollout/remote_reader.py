"""A rollout rank's reader of the trainers' messages (:mod:`trl_nrollout.rollout.remote`), on a thread of its own,
and the rollout rank's side of one weight version's broadcast."""

from __future__ import annotations

import pickle
import queue
import threading
import time

import torch

from trl_nrollout.rollout.ranks import Bridge


def broadcast(group, buf: torch.Tensor) -> None:
    """Broadcast ``buf`` from the group's rank 0 (the weights group: trainer rank 0 and the rollout ranks)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


class MessageReader:
    """A rollout rank's reader of the trainers' messages, on a thread of its own: it reads them in order as soon as
    they are written and receives each weight version into host buffers at once (a staging copy), while the
    engine still generates the job before it; the loop then loads the staged version at the job boundary (a
    memory copy instead of a transfer). At most ``max_staleness`` versions are staged and not yet loaded (the
    weights of step ``k`` follow the job of step ``k + max_staleness`` in the trainers' messages, so a new version
    never waits for a job to end, and trainer rank 0 never holds more than a few buckets). Errors (a silent trainer,
    a failed transfer) reach the loop, which raises them."""

    def __init__(self, bridge: Bridge, first: int, slots: int = 1) -> None:
        self.bridge = bridge
        self.next_index = first
        self._queue: queue.Queue = queue.Queue()
        self._slot = threading.Semaphore(slots)
        self._thread = threading.Thread(target=self._run, name="trl_nrollout-messages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        bridge, readers = self.bridge, self.bridge.roles.rollout_ranks
        i = self.next_index
        try:
            while True:
                message = bridge.take(f"msg/{i}", 0, f"the trainers' message {i}", delete=False, track=False)
                if bridge.store.add(f"read/{i}", 1) == readers:  # the last rollout rank to read it removes it
                    bridge.drop(f"msg/{i}")
                    bridge.store.delete_key(f"read/{i}")
                i += 1
                if message["kind"] == "start":  # versions staged at most: one per job written ahead
                    self._slot = threading.Semaphore(staged_versions(message))
                if message["kind"] == "weights":
                    self._slot.acquire()
                    t0 = time.perf_counter()
                    message = {**message, "staged": receive_buckets(bridge.weights_group),
                               "receive_s": time.perf_counter() - t0}
                self._queue.put((i, message))
                if message["kind"] in ("end", "stop"):
                    return
        except BaseException as err:  # noqa: BLE001 - raised by the loop, on the main thread
            self._queue.put((i, err))

    def next(self) -> tuple[int, dict]:
        """The next message and the index after it (waits; raises what the thread met)."""
        index, message = self._queue.get()
        if isinstance(message, BaseException):
            raise message
        return index, message

    def loaded(self) -> None:
        """The staged version is in the engine: the next one may be received."""
        self._slot.release()


def staged_versions(start: dict) -> int:
    """Weight versions a rollout rank stages at most: one per job written ahead (``max_staleness``)."""
    return max(1, int(start.get("max_staleness") or 1))


def receive_buckets(group) -> list[tuple[torch.Tensor, list]]:
    """A rollout rank's side of one weight version (see :meth:`RemoteEngines._send`): the buckets' buffers and
    layouts, until a header of zeros."""
    staged = []
    while True:
        head = torch.empty(2, dtype=torch.int64)
        broadcast(group, head)
        meta_size, size = head.tolist()
        if size == 0 and meta_size == 0:
            return staged
        meta = torch.empty(meta_size, dtype=torch.uint8)
        broadcast(group, meta)
        buf = torch.empty(size, dtype=torch.uint8)
        broadcast(group, buf)
        staged.append((buf, pickle.loads(meta.numpy().tobytes())))
