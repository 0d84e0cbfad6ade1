"""Engines on rollout ranks (``rollout_ranks``): the trainers' side (:class:`RemoteEngines`) and the rollout ranks'
side (:func:`serve`) of the bridge of :mod:`trl_nrollout.rollout.ranks`.

Trainer rank 0 writes messages ``msg/0, msg/1, ...`` that every rollout rank reads in order:

    start     the engine's settings (model, lengths, seed...); each rollout rank builds its engine and answers
              ``ready/<r>`` with its parameter names (or the error that stopped it)
    weights   a policy version: its buckets' names, shapes and dtypes; the bytes follow over the weights group
    job       the job's prompts (every trainer's, in rank order, each repeated n times), n, the sampling options;
              rollout rank r generates its slice (:func:`job_slice`) and answers ``out/<job>/<r>``
    end       the trainers' ``train()`` (or ``evaluate()``) returned: the rollout ranks' returns too
    stop      the trainers are done: the rollout ranks close their engines

Jobs run in the order they were written, each with the last weights written before it, so a job written ``s``
steps ahead of the step that trains on it (``max_staleness=s``) is sampled by a policy ``s`` versions older.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from trl_nrollout.rollout.ranks import Bridge, RolloutRankError
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.rollout.weight_sync import engine_has, iter_weight_buckets

_ALIGN = 16  # byte alignment of each tensor in a bucket's flat buffer (a view as any dtype needs it)


def job_slice(total: int, n: int, rollout_ranks: int, tp: int, r: int) -> tuple[int, int]:
    """Samples ``[start, stop)`` of a job of ``total`` samples (groups of ``n``) that rollout rank ``r`` hands its
    engine: each of the ``rollout_ranks / tp`` engines takes a contiguous run of whole groups (their counts differ
    by at most one), split evenly among its ``tp`` ranks (a group may span them, as in a colocated engine)."""
    engines = rollout_ranks // tp
    groups = total // n
    e, t = divmod(r, tp)
    g0, g1 = e * groups // engines, (e + 1) * groups // engines
    first, count = g0 * n, (g1 - g0) * n
    return first + count * t // tp, first + count * (t + 1) // tp


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[str, tuple, str, int]]]:
    """One bucket as a flat CPU byte buffer and its layout ``[(name, shape, dtype, offset)]``."""
    layout, offset = [], 0
    for name, t in bucket:
        layout.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
        offset += math.ceil(t.numel() * t.element_size() / _ALIGN) * _ALIGN
    buf = torch.empty(offset, dtype=torch.uint8)
    for (_, t), (_, _, _, at) in zip(bucket, layout):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[at:at + flat.numel()].copy_(flat)  # device -> host here
    return buf, layout


def unpack_bucket(buf: torch.Tensor, layout: list[tuple[str, tuple, str, int]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`pack_bucket`'s buffer (views of it)."""
    out = []
    for name, shape, dtype, at in layout:
        dt = getattr(torch, dtype)
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dt).element_size()
        out.append((name, buf[at:at + size].view(dt).view(shape)))
    return out


def _broadcast(group, buf: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def _trainer_gather(obj) -> list:
    """``obj`` of every trainer rank (rank order), on every trainer rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _trainer_broadcast(obj):
    """Trainer rank 0's ``obj`` on every trainer rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class JobResult:
    """What one rollout rank generated for its slice of a job."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    gen_s: float
    version: int


class RemoteEngines:
    """The rollout ranks' engines, seen from a trainer rank: the engine interface the trainer calls
    (``generate_expanded``, ``load_weights``, ``check_prompt_length``, ``sleep``, ``close``), each a collective of
    the trainers. Trainer rank 0 talks to the rollout ranks; the others take part in the trainers' gathers.

    ``lookahead`` jobs may be written before the step that trains on them (``max_staleness``)."""

    def __init__(self, bridge: Bridge, settings: dict, *, max_model_len: int, bucket_bytes: int) -> None:
        self.bridge = bridge
        self.max_model_len = max_model_len
        self.bucket_bytes = bucket_bytes
        self.engine_index = 0
        self.tp_ranks = [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]
        self._msg = 0
        self._jobs = 0
        self._pending: deque = deque()  # (job id, prompts, n, sampling) written ahead, oldest first
        self._sender: threading.Thread | None = None
        self._send_error: list[BaseException] = []
        self._closed = False
        self.version = -1
        self.last_transfer: dict = {}
        names = None
        error = None
        if bridge.is_leader:
            bridge.watch(bridge.roles.rollout_globals())
            self._post({"kind": "start", **settings})
            try:
                answers = [bridge.take(f"ready/{r}", bridge.roles.global_rank("rollout", r),
                                       f"rollout rank {r}'s engine to start")
                           for r in range(bridge.roles.rollout_ranks)]
                names = answers[0]["names"]
            except RolloutRankError as err:
                error = str(err)
        names, error = _trainer_broadcast((names, error))
        if error:
            raise RolloutRankError(error)
        self.engine_names = set(names)

    # ------------------------------------------------------------------ messages
    def _post(self, message: dict) -> None:
        self.bridge.put(f"msg/{self._msg}", message)
        self._msg += 1

    def check_prompt_length(self, longest: int, max_tokens: int) -> None:
        if longest + max_tokens > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens + max_completion_length={max_tokens} exceeds the engine's "
                f"max_model_len={self.max_model_len} (rollout_max_model_len): the completion would be cut short. "
                f"Raise rollout_max_model_len to at least {longest + max_tokens} (within the model's context "
                f"length), shorten or filter out the long prompts, or lower max_completion_length.")

    def sleep(self) -> None:  # the engines live on other processes: nothing to free here
        pass

    def wake_up(self, tags=None) -> None:
        pass

    @property
    def sleeping(self) -> bool:
        return False

    # ------------------------------------------------------------------ weights
    def _join_sender(self) -> None:
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        if self._send_error:
            raise RolloutRankError(f"sending weights to the rollout ranks failed: {self._send_error[0]}")

    @torch.no_grad()
    def load_weights(self, model: nn.Module, version: int = 0) -> dict:
        """Send the policy's weights (policy ``version``) to every rollout rank: every trainer takes part (ZeRO-3
        and FSDP gather collectively); trainer rank 0 copies each bucket to a host buffer and a thread sends them
        over the weights group while the trainers go on. Returns the bytes, buckets and seconds of the copy."""
        start = time.perf_counter()
        leader = self.bridge.is_leader
        if leader:
            self.bridge.watch(self.bridge.roles.rollout_globals())
            self._join_sender()  # the previous version has left: its buffers are free
        packed = []
        for bucket in iter_weight_buckets(model, self.bucket_bytes, keep_alias=engine_has(self.engine_names)):
            if leader:
                packed.append(pack_bucket(bucket))
        stats = {"bytes": sum(b.numel() for b, _ in packed), "buckets": len(packed),
                 "peak_bucket_bytes": max((b.numel() for b, _ in packed), default=0)}
        if leader:
            self._post({"kind": "weights", "version": version, "layouts": [lay for _, lay in packed],
                        "sizes": [b.numel() for b, _ in packed]})
            group = self.bridge.weights_group
            self.last_transfer = transfer = {"version": version, "bytes": stats["bytes"], "seconds": None}

            def send() -> None:
                t0 = time.perf_counter()
                try:
                    for buf, _ in packed:
                        _broadcast(group, buf)
                except BaseException as err:  # noqa: BLE001 - raised on the trainer's thread at the next call
                    self._send_error.append(err)
                transfer["seconds"] = time.perf_counter() - t0

            self._sender = threading.Thread(target=send, name="trl_nrollout-weights", daemon=True)
            self._sender.start()
        self.version = version
        return {**stats, "seconds": time.perf_counter() - start}

    def wait_sent(self) -> float | None:
        """Wait until the last weights have left (trainer rank 0); their transfer's seconds."""
        if self.bridge.is_leader:
            self._join_sender()
            return self.last_transfer.get("seconds")
        return None

    # ------------------------------------------------------------------ generation
    def _write_job(self, prompts: list[list[int]], n: int, sampling: SamplingOptions) -> int:
        job = self._jobs
        self._jobs += 1
        self._post({"kind": "job", "id": job, "prompts": prompts, "n": n, "sampling": sampling})
        return job

    def _read_job(self, job: int) -> list[JobResult]:
        roles = self.bridge.roles
        return [self.bridge.take(f"out/{job}/{r}", roles.global_rank("rollout", r), f"job {job} of rollout rank {r}")
                for r in range(roles.rollout_ranks)]

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = None, ahead: list[tuple[list[list[int]], SamplingOptions]]
                          = (), step_job: bool = False) -> RolloutBatch:
        """This trainer's samples of ``sample_prompts`` (each prompt repeated ``n`` times), generated on the rollout
        ranks; ``ahead``: this trainer's prompts and sampling of the next steps, written now (``max_staleness``
        jobs at most) so that the engines sample them while the trainers train. ``step_job``: this is a training
        step's own job, which an earlier step may have written ahead (else: an evaluation, DAPO's extra round or
        ReMax's greedy pass, generated now, after the jobs already written). Seeds follow the job order (every
        trainer's samples, rank order), as in a colocated run. A collective of the trainers."""
        every = _trainer_gather(([list(p) for p in sample_prompts], [([list(p) for p in a], s) for a, s in ahead]))
        job_prompts = [p for mine, _ in every for p in mine]
        depth = min(len(a) for _, a in every)
        future = [([p for _, a in every for p in a[k][0]], every[0][1][k][1]) for k in range(depth)]
        payload = None
        if self.bridge.is_leader:
            self.bridge.watch(self.bridge.roles.rollout_globals())
            stale_s = 0.0
            results = None
            while step_job and self._pending:  # written ahead: the one this step trains on, unless the data changed
                job, prompts, n_ahead, sampling_ahead = self._pending.popleft()
                t0 = time.perf_counter()
                out = self._read_job(job)
                stale_s += time.perf_counter() - t0
                if prompts == job_prompts and n_ahead == n and sampling_ahead == sampling:
                    results = out
                    break
            wait_start = time.perf_counter()
            if results is None:  # nothing written ahead (the first step, after a resume, evaluation)
                job = self._write_job(job_prompts, n, sampling)
                self._queue_ahead(future, n)
                results = self._read_job(job)
            else:
                self._queue_ahead(future, n)
            wait_s = time.perf_counter() - wait_start + stale_s
            payload = ([x for res in results for x in zip(res.completion_ids, res.logprobs, res.finish_reasons)],
                       {"wait_s": wait_s, "gen_s": max(r.gen_s for r in results),
                        "version": min(r.version for r in results)})
        samples, info = _trainer_broadcast(payload)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        first = sum(len(mine) for mine, _ in every[:rank])
        mine = samples[first:first + len(sample_prompts)]
        groups = [(first + i) // n for i in range(len(mine))]
        batch = RolloutBatch([list(p) for p in sample_prompts], [c for c, _, _ in mine], [lp for _, lp, _ in mine],
                             [f for _, _, f in mine], groups, timings={"generate_s": info["gen_s"]})
        self.last_job = info
        return batch

    def _queue_ahead(self, future: list, n: int) -> None:
        """Write the next steps' jobs that are not written yet (trainer rank 0)."""
        for k, (prompts, sampling) in enumerate(future):
            if k < len(self._pending):
                continue
            job = self._write_job(prompts, n, sampling)
            self._pending.append((job, prompts, n, sampling))

    # ------------------------------------------------------------------ the end
    def end(self) -> None:
        """The trainers' ``train()`` / ``evaluate()`` returned: jobs written ahead are read and dropped, and the
        rollout ranks' ``train()`` returns."""
        if self.bridge.is_leader and not self._closed:
            while self._pending:
                self._read_job(self._pending.popleft()[0])
            self._join_sender()
            self._post({"kind": "end"})
            self.bridge.unwatch()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.bridge.is_leader:
            try:
                while self._pending:
                    self._read_job(self._pending.popleft()[0])
                self._join_sender()
            finally:
                self._post({"kind": "stop"})
                self.bridge.unwatch()
                self._wait_goodbyes()

    def _wait_goodbyes(self) -> None:
        """Trainer rank 0 hosts the launcher's store (unless the launcher does): it waits until every rollout rank
        has read ``stop`` (or exited) before its process may end, at most ``rollout_rank_timeout_s``."""
        roles, deadline = self.bridge.roles, time.monotonic() + self.bridge.timeout_s
        left = set(range(roles.rollout_ranks))
        while left and time.monotonic() < deadline:
            for r in sorted(left):
                state = self.bridge.peer_state(roles.global_rank("rollout", r))
                if self.bridge.store.check([f"bye/{r}"]) or (state is not None and state[1] == "done"):
                    left.discard(r)
            time.sleep(0.01)


# ---------------------------------------------------------------------- the rollout ranks' side
class MessageReader:
    """A rollout rank's reader of the trainers' messages, on a thread of its own: it reads them in order as soon as
    they are written and receives each weight version into host buffers at once (a staging copy), while the
    engine still generates the job before it; the loop then loads the staged version at the job boundary (a
    memory copy instead of a transfer). At most one version is staged and not yet loaded. Errors (a silent trainer,
    a failed transfer) reach the loop, which raises them."""

    def __init__(self, bridge: Bridge, first: int) -> None:
        self.bridge = bridge
        self.next_index = first
        self._queue: queue.Queue = queue.Queue()
        self._slot = threading.Semaphore(1)
        self._thread = threading.Thread(target=self._run, name="trl_nrollout-messages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        bridge, readers = self.bridge, self.bridge.roles.rollout_ranks
        i = self.next_index
        try:
            while True:
                message = bridge.take(f"msg/{i}", 0, f"the trainers' message {i}", delete=False, track=False)
                if bridge.store.add(f"read/{i}", 1) == readers:  # the last rollout rank to read it removes it
                    bridge.store.delete_key(f"msg/{i}")
                    bridge.store.delete_key(f"read/{i}")
                i += 1
                if message["kind"] == "weights":
                    self._slot.acquire()
                    t0 = time.perf_counter()
                    staged = []
                    for size, layout in zip(message["sizes"], message["layouts"]):
                        buf = torch.empty(size, dtype=torch.uint8)
                        _broadcast(bridge.weights_group, buf)
                        staged.append((buf, layout))
                    message = {**message, "staged": staged, "receive_s": time.perf_counter() - t0}
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


def serve(bridge: Bridge, build_engine, state: dict) -> dict:
    """The rollout rank's loop: act on the trainers' messages in order (:class:`MessageReader` reads them), until
    ``end`` (returns) or ``stop`` (closes the engine). ``build_engine(settings)`` builds this rank's engine from the
    start message; ``state`` keeps the next message's index and the engine between calls (``train()`` then
    ``evaluate()``). Returns counts and seconds of what this rank did."""
    roles = bridge.roles
    r = roles.role_rank(bridge.rank)
    stats = {"jobs": 0, "samples": 0, "gen_s": 0.0, "weights_s": 0.0, "receive_s": 0.0, "weights_bytes": 0,
             "idle_s": 0.0}
    bridge.watch(range(roles.world))
    reader = MessageReader(bridge, state.setdefault("msg", 0))
    while True:
        t0 = time.perf_counter()
        bridge.status = "idle"
        state["msg"], message = reader.next()
        stats["idle_s"] += time.perf_counter() - t0
        kind = message["kind"]
        if kind == "start":
            bridge.status = "starting its engine"
            try:
                engine = state["engine"] = build_engine(message)
                answer = {"names": sorted(engine.parameter_names())}
            except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
                bridge.put(f"ready/{r}", {"kind": "error", "message": f"{type(err).__name__}: {err}"})
                raise
            bridge.put(f"ready/{r}", answer)
        elif kind == "weights":
            bridge.status = f"loading weights version {message['version']}"
            t0 = time.perf_counter()
            state["engine"].load_buckets(unpack_bucket(buf, layout) for buf, layout in message["staged"])
            reader.loaded()
            state["version"] = message["version"]
            stats["weights_s"] += time.perf_counter() - t0
            stats["receive_s"] += message["receive_s"]
            stats["weights_bytes"] += sum(message["sizes"])
        elif kind == "job":
            bridge.status = f"generating job {message['id']}"
            engine = state["engine"]
            prompts, n = message["prompts"], message["n"]
            start, stop = job_slice(len(prompts), n, roles.rollout_ranks, engine.layout.rollout_tp_size, r)
            t0 = time.perf_counter()
            try:
                if stop > start or engine.layout.rollout_tp_size > 1:
                    batch = engine.generate_expanded(prompts[start:stop], n, message["sampling"], sample_offset=start)
                    engine.sleep()
                else:
                    batch = RolloutBatch([], [], [], [], [])
            except Exception as err:  # noqa: BLE001 - the trainers raise it, naming this rank
                bridge.put(f"out/{message['id']}/{r}", {"kind": "error", "message": f"{type(err).__name__}: {err}"})
                raise
            gen_s = time.perf_counter() - t0
            bridge.put(f"out/{message['id']}/{r}", JobResult(batch.completion_ids, batch.logprobs,
                                                             batch.finish_reasons, gen_s, state.get("version", 0)))
            stats["jobs"] += 1
            stats["samples"] += stop - start
            stats["gen_s"] += gen_s
        elif kind == "end":
            bridge.status = "between the trainers' calls"
            bridge.unwatch()
            return stats
        elif kind == "stop":
            bridge.status = "done"
            engine = state.pop("engine", None)
            if engine is not None:
                engine.close()
            bridge.unwatch()
            bridge.put(f"bye/{r}", True)
            bridge.finish()
            state["stopped"] = True
            return stats
        else:  # pragma: no cover - a message this version does not know
            raise RolloutRankError(f"unknown message {kind!r} from the trainers (a version mismatch?)")
