"""A rollout rank's reader of the trainers' messages (:mod:`trl_nrollout.rollout.ranks.client`), on a thread of its own,
and the rollout rank's side of one weight version's broadcast.

Host memory of the weights (per engine, not per rank): every rollout rank takes part in a version's broadcast over the
weights group, but only the first rank of an engine's TP group keeps it (:func:`holds_versions`): its staged buffers,
page-locked where CUDA is (as trainer rank 0's packing buffers), at most ``rollout_lookahead`` versions. The engine's other
TP ranks receive the broadcast into one reused scratch buffer and drop it; when the version is loaded they get it
from their first rank over the engine's own TP group (gloo), bucket by bucket, each dropped once vLLM asked for the
next. So a node of ``E`` engines of ``tp`` ranks holds at most ``E * slots * V + E * (tp - 1) * 3 * B`` bytes of
weights (``V``: a version's bytes in the engine's dtype, ``B``: its largest bucket: ``weight_sync_bucket_mb`` or one
decoder layer when larger; :func:`staging_bound`), where every rank used to stage whole versions
(``E * tp * slots * V``: 520 GB a version for Qwen2.5-32B at ``rollout_tp_size=4``, 8 rollout ranks on a node).
Page-locked blocks come from PyTorch's caching host allocator, which rounds each up to a power of two (at most 2x;
``pinned_max_round_threshold`` of ``PYTORCH_ALLOC_CONF`` lowers it).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from trl_nrollout.rollout.bridge import Bridge
from trl_nrollout.rollout.ranks.buckets import frame_bucket, unpack_bucket
from trl_nrollout.rollout.ranks.weight_delta import FULL, DeltaHeader, decode

#: Buckets a rollout rank that does not stage versions holds at most: the reader's scratch buffer, the bucket vLLM
#: loads and the next one being received from the engine's first rank (vLLM asks for it before it drops the last).
PASSING_BUCKETS = 3


def broadcast(group, buf: torch.Tensor) -> None:
    """Broadcast ``buf`` from the group's rank 0 (the weights group: trainer rank 0 and the rollout ranks; an
    engine's TP group: its first rank)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


class HostBuffers:
    """The host byte buffers a rollout rank's weight versions pass through: allocated here, page-locked where CUDA
    is (``pin``; vLLM copies them to the device), and counted while any tensor refers to them (weak references: a
    view keeps its buffer alive). :attr:`peak`: the most bytes alive at once, measured at each allocation."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self.peak = 0

    def empty(self, size: int, pin: bool | None = None) -> torch.Tensor:
        """A new uint8 buffer of ``size`` bytes (page-locked with :attr:`pin` unless ``pin`` says otherwise)."""
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin if pin is None else pin)
        with self._lock:
            self._live.add(buf)
            self.peak = max(self.peak, self._bytes())
        return buf

    def live(self) -> int:
        """Bytes of the buffers alive now."""
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(t.numel() for t in list(self._live))


def holds_versions(engine) -> bool:
    """Whether this rollout rank stages whole weight versions: the first rank of its engine's TP group (every rank at
    TP 1, and before an engine exists); the engine's other ranks get each version from it when it is loaded."""
    return engine_tp(engine)[1]


def engine_tp(engine) -> tuple[object | None, bool]:
    """``(group, first)``: the engine's TP process group (gloo, the engine's ranks in order: its rank 0 is the first)
    or None at TP 1, and whether this rank is the engine's first."""
    ranks = list(getattr(engine, "tp_ranks", None) or [])
    group = getattr(engine, "tp_group", None)  # the gloo group of the engine's TP ranks (None before an engine)
    if len(ranks) <= 1 or group is None:
        return None, True
    return group, engine.rank == ranks[0]


def staging_bound(slots: int, version_bytes: int, bucket_bytes: int, holds: bool) -> int:
    """Bytes of weight buffers a rollout rank holds at most (:class:`HostBuffers`' ``peak``): ``slots`` whole
    versions of ``version_bytes`` on the rank that stages them, :data:`PASSING_BUCKETS` buckets of at most
    ``bucket_bytes`` on its engine's other ranks."""
    return slots * version_bytes if holds else PASSING_BUCKETS * bucket_bytes


class MessageReader:
    """A rollout rank's reader of the trainers' messages, on a thread of its own: it reads them in order as soon as
    they are written and receives each weight version at once, while the engine still generates the job before it;
    the engine's first TP rank keeps it in host buffers (a staging copy, see the module docstring), the others drop
    it. The loop then loads the staged version at the job boundary (:meth:`buckets`). At most ``rollout_lookahead``
    versions are staged and not yet loaded (the weights of step ``k`` follow the job of step ``k + rollout_lookahead`` in
    the trainers' messages, so a new version never waits for a job to end, and trainer rank 0 never holds more than
    a few buckets). Errors (a silent trainer, a failed transfer) reach the loop, which raises them. ``engine``: this
    rank's engine once built (None before), which says whether this rank stages versions."""

    def __init__(self, bridge: Bridge, first: int, slots: int = 1, engine: Callable[[], object] | None = None,
                 buffers: HostBuffers | None = None) -> None:
        self.bridge = bridge
        self.next_index = first
        self.buffers = buffers or HostBuffers()
        self._engine = engine or (lambda: None)
        self._scratch: torch.Tensor | None = None
        self._held: list[torch.Tensor] = []  # with weight deltas: the last version's buckets, to decode the next
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
                    # the engine exists: trainer rank 0 writes a version only once every engine answered its start
                    try:
                        staged, size = self._receive(holds_versions(self._engine()))
                    except Exception as err:  # noqa: BLE001 - trainer rank 0 would wait in the broadcast forever
                        bridge.die(f"receiving weights version {message.get('version')} failed: "
                                   f"{type(err).__name__}: {err}")
                    message = {**message, "staged": staged, "bytes": size, "receive_s": time.perf_counter() - t0}
                self._queue.put((i, message))
                if message["kind"] in ("end", "stop"):
                    return
        except BaseException as err:  # noqa: BLE001 - raised by the loop, on the main thread
            self._queue.put((i, err))

    def _receive(self, keep: bool) -> tuple[deque | None, int]:
        """One version from the weights group: its buckets kept (``keep``) or received into the scratch buffer and
        dropped; and its bytes."""
        staged: deque | None = deque() if keep else None
        total = 0
        for i, (size, layout, delta) in enumerate(_frames(self.bridge.weights_group)):
            if keep and delta is None:
                buf = self.buffers.empty(size)
            else:  # dropped (another rank of the engine stages it), or a delta decoded into the held copy
                if self._scratch is None or self._scratch.numel() < size:
                    self._scratch = None  # (the smaller one is freed first)
                    self._scratch = self.buffers.empty(size, pin=False)  # never copied to a device
                buf = self._scratch[:size]
            broadcast(self.bridge.weights_group, buf)
            total += size
            if keep:
                staged.append((self._held_copy(i, buf, delta), layout))
            del buf
        return staged, total

    def _held_copy(self, i: int, buf: torch.Tensor, delta: DeltaHeader | None) -> torch.Tensor:
        """Bucket ``i`` of the version just received, to stage: ``buf`` itself when it came whole, else decoded
        into this rank's copy of the bucket (the trainers sent what changed since it). With weight deltas on
        (the sender says so in each frame) the copy is kept for the next version's delta: one more host copy of the
        weights in the engine's dtype, the price of sending only what changed."""
        if delta is None:
            if i < len(self._held):  # the sender went back to whole buckets: no copy is needed any more
                self._held = []
            return buf
        if delta.kind == FULL:
            full = buf.clone()
        else:
            if i >= len(self._held):
                raise RuntimeError(f"bucket {i} of a weights version came as a {delta.kind} delta, but this rollout "
                                   "rank holds no copy of it (it did not receive the version before)")
            full = decode(delta, buf, self._held[i])
        if i < len(self._held):
            self._held[i] = full
        else:
            self._held.append(full)
        return full.clone()  # the staged copy: the held one changes in place with the next delta

    def next(self) -> tuple[int, dict]:
        """The next message and the index after it (waits; raises what the thread met)."""
        index, message = self._queue.get()
        if isinstance(message, BaseException):
            raise message
        return index, message

    def buckets(self, message: dict, engine) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """A ``weights`` message's version, bucket by bucket (lists of ``(name, tensor)``, views of host buffers),
        for the engine to load; every rank of the engine iterates it together (its first rank hands the others each
        bucket over the engine's TP group as it is asked for). Each bucket is let go once the next is asked for,
        and the message no longer refers to the staged version."""
        group, first = engine_tp(engine)
        staged = message.pop("staged", None)
        if first and staged is None:
            raise RuntimeError(f"weights version {message.get('version')} was not staged on this rollout rank, the "
                               "first of its engine (a reader that could not see the engine when it arrived)")
        if group is None:
            while staged:
                buf, layout = staged.popleft()
                yield unpack_bucket(buf, layout)
                del buf
            return
        if first:
            while staged:
                buf, layout = staged.popleft()
                head, meta = frame_bucket(buf, layout)
                broadcast(group, head)
                broadcast(group, meta)
                broadcast(group, buf)
                yield unpack_bucket(buf, layout)
                del buf
            broadcast(group, torch.zeros(2, dtype=torch.int64))
            return
        for size, layout, _ in _frames(group):  # whole buckets within the engine's TP group
            buf = self.buffers.empty(size)
            broadcast(group, buf)
            yield unpack_bucket(buf, layout)
            del buf

    def loaded(self) -> None:
        """The staged version is in the engine: the next one may be received."""
        self._slot.release()


def _frames(group) -> Iterator[tuple[int, list, DeltaHeader | None]]:
    """The frames of one version's broadcast over ``group`` (see :meth:`RemoteEngines._send`): each bucket's size on
    the wire, layout and delta header (None: the whole bucket), until a header of zeros; the caller receives each
    bucket's data (a broadcast of that size) before it asks for the next frame."""
    while True:
        head = torch.empty(2, dtype=torch.int64)
        broadcast(group, head)
        meta_size, size = head.tolist()
        if size == 0 and meta_size == 0:
            return
        meta = torch.empty(meta_size, dtype=torch.uint8)
        broadcast(group, meta)
        layout, delta = pickle.loads(meta.numpy().tobytes())
        yield size, layout, delta


def staged_versions(start: dict) -> int:
    """Weight versions a rollout rank stages at most: one per job written ahead (``rollout_lookahead``)."""
    return max(1, int(start.get("lookahead") or 1))

