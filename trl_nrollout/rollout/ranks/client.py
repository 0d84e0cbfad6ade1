"""Engines on rollout ranks (``rollout_ranks``): the trainers' side (:class:`RemoteEngines`) and the rollout ranks'
side (:func:`~trl_nrollout.rollout.ranks.serve.serve`) of the bridge of :mod:`trl_nrollout.rollout.bridge`.

Trainer rank 0 writes messages ``msg/0, msg/1, ...`` that every rollout rank reads in order:

    start     the engine's settings (model, lengths, seed...); each rollout rank builds its engine and answers
              ``ready/<r>`` with its parameter names (or the error that stopped it)
    weights   a policy version; its buckets follow over the weights group, each a size, then a byte buffer (its
              layout, then the tensors, cast to the engine's dtype), ended by a size of 0. With ``adapter``: the
              buckets hold the LoRA adapter's tensors only (``rollout_lora_sync="adapter"``), loaded as a new
              adapter version; the base weights stay
    job       the job's prompts (every trainer's groups, in rank order, each prompt once), n, the sampling options;
              rollout rank r generates its slice (:func:`job_slice`) and answers ``out/<job>/<r>`` (token ids and
              log-probs as flat arrays). With ``images``: each group's images (once a group), the prompts' image
              placeholders not expanded; the answer adds each group's prompt as the engine expanded it. With
              ``agent``: the job's entry, a dataclass whose type is the job's kind
              (:data:`~trl_nrollout.rollout.ranks.jobs.JOB_KINDS`): whole episodes on the rollout ranks
              (:class:`~trl_nrollout.rollout.ranks.episodes.EpisodeJob`, answered with their tool masks and
              messages or records), one more tool turn (:class:`~trl_nrollout.rollout.ranks.jobs.TurnEntry`), a
              partial job's groups (:class:`~trl_nrollout.rollout.ranks.partial.PartialEntry`)
    end       the trainers' ``train()`` (or ``evaluate()``) returned: the rollout ranks' returns too
    stop      the trainers are done: the rollout ranks close their engines

Values larger than the store takes travel in parts (:meth:`~trl_nrollout.rollout.bridge.Bridge.put`). Trainer rank 0
hands each other trainer its own samples through the store (``home/<call>/<rank>``): the other trainers wait on a key,
checking trainer rank 0's heartbeat, never inside a collective while the engines work (a job may outlast a timeout).

Jobs run in the order they were written, each with the last weights written before it, so a job written ``s``
steps ahead of the step that trains on it (``rollout_lookahead=s``) is sampled by a policy ``s`` versions older.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch
from torch import nn

from trl_nrollout.rollout.bridge import Bridge, RolloutRankError
from trl_nrollout.rollout.engines.protocol import ADAPTERS, JOBS
from trl_nrollout.rollout.engines.vllm_settings import check_prompt_length
from trl_nrollout.rollout.engines.weight_sync import adapter_tensors, engine_has, iter_weight_buckets
from trl_nrollout.rollout.ranks.buckets import (
    dtype_of,
    frame_bucket,
    images_digest,
    job_message,
    pack_bucket,
)
from trl_nrollout.rollout.ranks.episodes import EpisodeJob, sum_stats
from trl_nrollout.rollout.ranks.jobs import TurnEntry
from trl_nrollout.rollout.ranks.partial import PartialEntry, group_fields
from trl_nrollout.rollout.ranks.reader import broadcast
from trl_nrollout.rollout.ranks.weight_delta import DeltaHeader, encode
from trl_nrollout.rollout.types import JobResult, RolloutBatch, SamplingOptions


def _trainer_gather(obj) -> list:
    """``obj`` of every trainer rank (rank order), on every trainer rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class RemoteEngines:
    """The rollout ranks' engines, seen from a trainer rank: the engine protocol's core
    (:class:`~trl_nrollout.rollout.engines.protocol.RolloutEngine`), adapters and jobs, each a collective of the
    trainers. Trainer rank 0 talks to the rollout ranks and hands the other trainers their part through the
    store; they wait on a key (checking its heartbeat), never inside a collective while the engines work.

    ``lookahead`` jobs may be written before the step that trains on them (``rollout_lookahead``)."""

    #: Buckets packed and not yet sent, at most (trainer rank 0's host memory: this many buckets, not the model).
    SEND_QUEUE = 2
    #: what it can do beyond the core (:mod:`trl_nrollout.rollout.engines.protocol`): adapters, and jobs written ahead
    capabilities = frozenset({ADAPTERS, JOBS})
    #: the trainers see one engine each (their own samples come home); the rollout ranks' queue is theirs
    balances_job = False

    def __init__(self, bridge: Bridge, settings: dict, *, max_model_len: int, bucket_bytes: int) -> None:
        self.bridge = bridge
        self.max_model_len = max_model_len
        self.bucket_bytes = bucket_bytes
        self.engine_index = 0
        self.tp_ranks = [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]
        self.rank = self.tp_ranks[0]
        self.trainers = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self._msg = 0
        self._jobs = 0
        self._calls = 0  # hand-outs from trainer rank 0 to the others (the same count on every trainer)
        self._pending: deque = deque()  # (job id, groups, n, sampling) written ahead, oldest first
        self._read: dict[int, list[JobResult]] = {}  # jobs written ahead already read (for a checkpoint, or from one)
        self._sender: threading.Thread | None = None
        self._send_queue: queue.Queue | None = None
        self._free: queue.Queue = queue.Queue()
        for _ in range(self.SEND_QUEUE):
            self._free.put(None)  # buffers to pack into (allocated at the first use, grown when a bucket needs it)
        self._send_error: list[BaseException] = []
        self._closed = False
        self.version = -1
        self.last_transfer: dict = {}
        #: weight_sync_delta: send each bucket as what changed since the last version (trainer rank 0 keeps a copy
        #: of what it sent, in the engine's dtype)
        self.weight_delta = bool(settings.get("weight_sync_delta"))
        self._held: list[tuple[torch.Tensor, list]] = []
        self.last_job: dict = {}  # the last job's report (see _job_samples)
        self.partial_pools: list = []  # a partial job's pools in flight, per engine that holds one (trainer rank 0)
        answer: dict = {}
        if bridge.is_leader:
            self._watch()
            self._post({"kind": "start", **settings})
            try:
                answers = [bridge.take(f"ready/{r}", bridge.roles.global_rank("rollout", r),
                                       f"rollout rank {r}'s engine to start")
                           for r in range(bridge.roles.rollout_ranks)]
                answer = {"names": answers[0]["names"], "dtype": answers[0].get("dtype")}
            except RolloutRankError as err:
                answer = {"error": str(err)}
        answer = self._hand_out([answer] * self.trainers, "the rollout ranks' engines to start")
        if answer.get("error"):
            raise RolloutRankError(answer["error"])
        self.engine_names = set(answer["names"])
        self.engine_dtype = dtype_of(answer.get("dtype"))

    # ------------------------------------------------------------------ messages
    def _watch(self) -> None:
        """Trainer rank 0 watches every other rank of the launch (one reader of all heartbeats); the others watch
        it only (:func:`~trl_nrollout.rollout.ranks.serve.serve`), so the store answers a few calls per rank and second whatever the launch's size."""
        self.bridge.watch(range(self.bridge.roles.world))

    def _post(self, message: dict) -> None:
        self.bridge.put(f"msg/{self._msg}", message)
        self._msg += 1

    def _hand_out(self, values: list, what: str):
        """Trainer rank 0 gives trainer ``t`` ``values[t]`` (its own part, through the store); every trainer
        returns its value. The others wait for the key (checking trainer rank 0 lives), not in a collective."""
        call = self._calls
        self._calls += 1
        if self.trainers == 1:
            return values[0]
        if self.bridge.is_leader:
            for t in range(1, self.trainers):
                self.bridge.put(f"home/{call}/{t}", values[t])
            return values[0]
        return self.bridge.take(f"home/{call}/{self.rank}", 0, f"{what} (from trainer rank 0)")

    def check_prompt_length(self, longest: int, max_tokens: int) -> None:
        check_prompt_length(longest, max_tokens, self.max_model_len)

    def sleep(self) -> None:  # the engines live on other processes: nothing to free here
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def gather_tp(self, obj) -> list:
        """``[obj]``: each trainer is an engine of its own here (its samples come home to it alone)."""
        return [obj]

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

    def _take_buffer(self) -> torch.Tensor | None:
        while True:  # a free buffer, or the sender's failure (it stopped returning them)
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                if self._send_error or (self._sender is not None and not self._sender.is_alive()):
                    self._join_sender()
                    raise RolloutRankError("sending weights to the rollout ranks stopped") from None

    @torch.no_grad()
    def load_weights(self, model: nn.Module, merge_lora: bool = True, version: int = 0) -> dict:
        """Send the policy's weights (policy ``version``) to every rollout rank: every trainer takes part (ZeRO-3
        and FSDP gather collectively); trainer rank 0 casts each bucket to the engine's dtype, packs it into one of
        :attr:`SEND_QUEUE` reused host buffers (pinned where a GPU is) and a thread sends it over the weights group
        while the next bucket is gathered and packed; the last buckets leave while the trainers go on. Returns the
        bytes, buckets and seconds of the gather and copy. ``merge_lora=False``: a PEFT model's base weights
        without its adapter (engines serving the adapter themselves)."""
        return self._send_version(version, iter_weight_buckets(
            model, self.bucket_bytes, keep_alias=engine_has(self.engine_names), merge_lora=merge_lora))

    @torch.no_grad()
    def load_adapter(self, model: nn.Module, version: int = 0) -> dict:
        """Send only the policy's LoRA adapter (policy ``version``; ``rollout_lora_sync="adapter"``): every trainer
        gathers the adapter's tensors (ZeRO-3 / FSDP: collectively, the adapter only), trainer rank 0 sends them as
        one bucket; each rollout rank loads them as a new adapter version of its engine. Returns the bytes, buckets
        and seconds of the gather and copy."""
        start = time.perf_counter()
        tensors = adapter_tensors(model)
        return self._send_version(version, iter([sorted(tensors.items())]), adapter=True, start=start)

    def _send_version(self, version: int, buckets, adapter: bool = False, start: float | None = None) -> dict:
        """Post a ``weights`` message and send ``buckets`` (iterated on every trainer: gathers are collective;
        trainer rank 0 packs and sends them)."""
        start = time.perf_counter() if start is None else start
        leader = self.bridge.is_leader
        stats = {"bytes": 0, "buckets": 0, "peak_bucket_bytes": 0}
        if leader:
            self._watch()
            self._join_sender()  # the previous version has left: its buffers are free
            self._post({"kind": "weights", "version": version, **({"adapter": True} if adapter else {})})
            self._send_queue = queue.Queue()
            transfer = {"version": version, "bytes": 0, "seconds": None, "wire_bytes": 0,
                        "delta": self.weight_delta and not adapter, "kinds": {}}
            if not transfer["delta"]:
                self._held = []  # whole buckets: the rollout ranks drop their copies too
            self.last_transfer = transfer
            self._sender = threading.Thread(target=self._send, args=(self._send_queue, transfer),
                                            name="trl_nrollout-weights", daemon=True)
            self._sender.start()
        # trainer rank 0 may have waited for the previous version to leave (a rollout rank busy or frozen for
        # longer than ddp_timeout): the others wait for it here, on a store key, not in the gathers' collective
        self._hand_out([None] * self.trainers, f"the start of weights version {version}")
        try:
            for bucket in buckets:
                if not leader:
                    continue
                buf, layout = pack_bucket(bucket, self.engine_dtype, out=self._take_buffer(),
                                          pin=torch.cuda.is_available())
                stats["bytes"] += buf.numel()
                stats["buckets"] += 1
                stats["peak_bucket_bytes"] = max(stats["peak_bucket_bytes"], buf.numel())
                self._send_queue.put((stats["buckets"] - 1, buf, layout))
        finally:
            if leader:
                self._send_queue.put(None)  # the end of this version (the sender sends a size of 0)
        if leader:
            self.last_transfer["bytes"] = stats["bytes"]
        self._hand_out([None] * self.trainers, f"weights version {version} packed")  # (it may wait for buffers)
        self.version = version
        return {**stats, "seconds": time.perf_counter() - start}

    def _send(self, work: queue.Queue, transfer: dict) -> None:
        """The sender thread of trainer rank 0: each packed bucket as a header, its layout and its data, then a
        header of zeros; each buffer goes back to the pool once sent."""
        group, t0 = self.bridge.weights_group, time.perf_counter()
        try:
            while True:
                item = work.get()
                if item is None:
                    broadcast(group, torch.zeros(2, dtype=torch.int64))
                    break
                i, buf, layout = item
                delta, data = self._encode(i, buf, layout, transfer)
                head, meta = frame_bucket(data, layout, delta)
                broadcast(group, head)
                broadcast(group, meta)
                broadcast(group, data)
                transfer["wire_bytes"] += data.numel()
                self._free.put(buf if buf._base is None else buf._base)
        except BaseException as err:  # noqa: BLE001 - raised on the trainer's thread at the next call
            self._send_error.append(err)
            self._free.put(None)  # the packer may wait for a buffer: it sees the error instead
        transfer["seconds"] = time.perf_counter() - t0

    def _encode(self, i: int, buf: torch.Tensor, layout: list, transfer: dict
                ) -> tuple[DeltaHeader | None, torch.Tensor]:
        """Bucket ``i`` as it crosses: whole (no header) without weight deltas; with them, encoded against the copy
        of the bucket the rollout ranks hold (the one sent last, kept here), whichever form is smallest
        (:func:`~trl_nrollout.rollout.ranks.weight_delta.encode`; whole when the layout changed or no copy is held)."""
        if not transfer["delta"]:
            return None, buf
        prev = self._held[i] if i < len(self._held) and self._held[i][1] == layout else None
        delta, data = encode(prev[0] if prev is not None else None, buf)
        transfer["kinds"][delta.kind] = transfer["kinds"].get(delta.kind, 0) + 1
        copy = (buf.clone(), layout)
        if i < len(self._held):
            self._held[i] = copy
        else:
            self._held.append(copy)
        return delta, data

    def wait_sent(self) -> float | None:
        """Wait until the last weights have left (trainer rank 0); their transfer's seconds."""
        if self.bridge.is_leader:
            self._join_sender()
            return self.last_transfer.get("seconds")
        return None

    # ------------------------------------------------------------------ generation
    def _write_job(self, groups: list[list[int]], n: int, sampling: SamplingOptions, agent=None,
                   images: list[list] | None = None) -> int:
        job = self._jobs
        self._jobs += 1
        self._post(job_message(job, groups, n, sampling, agent, images))  # (images: PNG bytes, once a group)
        return job

    def _read_job(self, job: int) -> list[JobResult]:
        if job in self._read:  # read for a checkpoint, or restored from one (jobs_ahead)
            return self._read.pop(job)
        roles = self.bridge.roles
        return [self.bridge.take(f"out/{job}/{r}", roles.global_rank("rollout", r), f"job {job} of rollout rank {r}")
                for r in range(roles.rollout_ranks)]

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = None, ahead: list[tuple] = (), step_job: bool = False,
                          images: list[list] | None = None) -> RolloutBatch:
        """This trainer's samples of ``sample_prompts`` (each prompt repeated ``n`` times), generated on the rollout
        ranks; ``ahead``: this trainer's prompts and sampling of the next steps, written now (``rollout_lookahead``
        jobs at most) so that the engines sample them while the trainers train. ``step_job``: this is a training
        step's own job, which an earlier step may have written ahead (else: an evaluation, DAPO's extra round or
        ReMax's greedy pass, generated now, after the jobs already written). Seeds follow the job order (every
        trainer's samples, rank order), as in a colocated run. ``images``: per sample, its prompt's images (the
        prompts then hold the image placeholders unexpanded; the batch's ``prompt_ids`` are the engine's,
        expanded). A collective of the trainers."""
        batch, _ = self._job_samples(sample_prompts, n, sampling, ahead, step_job, None, images)
        return batch

    def run_job_episodes(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                         agent: EpisodeJob | PartialEntry,
                         ahead: list[tuple] = (), step_job: bool = False, images: list[list] | None = None
                         ) -> tuple[RolloutBatch, list[dict]]:
        """This trainer's request-level tool episodes (``sample_prompts``: each prompt ``n`` times), each a whole
        episode generated on the rollout ranks with their tools (:func:`~trl_nrollout.rollout.ranks.episodes.
        run_agent_job`); ``agent``: this trainer's :class:`~trl_nrollout.rollout.ranks.episodes.EpisodeJob` (the turns' seeds); ``ahead`` and ``step_job``
        as in :meth:`generate_expanded` (later steps' episodes run while the trainers train). Returns the batch and
        each sample's tool mask (``[L]``, 0 on tool-result tokens) and episode fields. A partial job's ``agent``
        entry (:class:`~trl_nrollout.rollout.ranks.partial.PartialEntry`; ``images`` per sample as in
        :meth:`generate_expanded`): the samples of the groups that finished first, whichever job drew them, each
        with its group's fields; the batch's prompt ids are the groups' own. A collective of the trainers."""
        return self._job_samples(sample_prompts, n, sampling, ahead, step_job, agent, images)

    def _job_samples(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions, ahead: list[tuple],
                     step_job: bool, agent: EpisodeJob | PartialEntry | None, images: list[list] | None = None
                     ) -> tuple[RolloutBatch, list]:
        """:meth:`generate_expanded` and :meth:`run_job_episodes`: this trainer's batch and each sample's extras
        (None for a single-turn job). ``ahead``: ``(prompts, sampling[, agent[, images per sample]])``. Images
        reach trainer rank 0 only, each group's once (a gather to it, only when a trainer has images)."""
        mine = _groups_of(sample_prompts, n)
        pics = [_groups_of(images, n)] + [_groups_of(a[3], n) if len(a) > 3 else None for a in ahead]
        every = _trainer_gather((mine, [(_groups_of(a[0], n), a[1], a[2] if len(a) > 2 else None) for a in ahead],
                                 any(p is not None for p in pics), agent))
        job_groups = [g for groups, *_ in every for g in groups]
        depth = min(len(a) for _, a, *_ in every)
        every_pics = _leader_gather(pics) if any(e[2] for e in every) else None
        job_pics = _job_images(every_pics, [len(g) for g, *_ in every], 0)
        agent = job_agent([e[3] for e in every])
        future = [([g for _, a, *_ in every for g in a[k][0]], every[0][1][k][1],
                   job_agent([a[k][2] for _, a, *_ in every]),
                   _job_images(every_pics, [len(a[k][0]) for _, a, *_ in every], k + 1)) for k in range(depth)]
        parts = [None] * self.trainers
        if self.bridge.is_leader:
            self._watch()
            stale_s = 0.0
            results = None
            digest = images_digest(job_pics)
            while step_job and self._pending:  # written ahead: the one this step trains on, unless the data changed
                job, *written = self._pending.popleft()
                t0 = time.perf_counter()
                out = self._read_job(job)
                stale_s += time.perf_counter() - t0
                if written == [job_groups, n, sampling, agent, digest]:  # the images too (their digest)
                    results = out
                    break
            wait_start = time.perf_counter()
            if results is None:  # nothing written ahead (the first step, an evaluation; a resume without them)
                job = self._write_job(job_groups, n, sampling, agent, job_pics)
                self._queue_ahead(future, n)
                results = self._read_job(job)
            else:
                self._queue_ahead(future, n)
            info = {"wait_s": time.perf_counter() - wait_start + stale_s, "gen_s": max(r.gen_s for r in results),
                    "version": min(r.version for r in results)}
            pulled = [r.balanced for r in results if r.balanced is not None]
            if pulled:  # the share of the job's groups an engine other than their own ran
                info["moved_groups"] = sum(m for _, m in pulled) / max(1, sum(g for g, _ in pulled))
            info["agent_stats"] = sum_stats([r.agent_stats for r in results])
            reports = [dict(r.partial) for r in results if r.partial is not None]
            if reports:  # a partial job: the engines' counts; the pools in flight stay here (a checkpoint's)
                self.partial_pools = [rep.pop("pool") for rep in reports if rep["pool_of"]]
                info["partial"] = reports
            rows = [(*x, e) for res in results for x, e in zip(res.rows(), res.extras())]
            expanded = {g: p for res in results for g, p in (res.prompts or {}).items()}  # images: the engine's
            first = 0
            for t, (groups, *_) in enumerate(every):  # each trainer its own samples only
                count, g0 = len(groups) * n, first // n
                parts[t] = (rows[first:first + count], info,
                            [expanded[g0 + g] for g in range(len(groups))] if expanded else None)
                first += count
        rows, info, expanded = self._hand_out(parts, "the samples of this step")
        groups_before = sum(len(groups) for groups, *_ in every[:self.rank])
        index = [groups_before + i // n for i in range(len(rows))]
        prompts = [list(p) for p in sample_prompts] if expanded is None else [list(expanded[i // n]) for i in
                                                                               range(len(rows))]
        if isinstance(agent, PartialEntry):  # the finished groups' own prompts and fields
            fields = group_fields([r[3] for r in rows])
            prompts = [list(f["prompt_ids"]) for f in fields]
            rows = [(*r[:3], f) for r, f in zip(rows, fields)]
        batch = RolloutBatch(prompts, [r[0] for r in rows], [r[1] for r in rows],
                             [r[2] for r in rows], index, timings={"generate_s": info["gen_s"]})
        self.last_job = info
        return batch, [r[3] for r in rows]

    def generate_turns(self, contexts: list[list[int]], budgets: list[int], sampling: SamplingOptions,
                       sample_offset: int = 0, sample_ids: list[int] | None = None,
                       num_samples: int | None = None, images: list[list] | None = None,
                       mm: list | None = None) -> RolloutBatch:
        """One more turn of multi-turn samples, generated on the rollout ranks (the tools ran on the trainers): one
        sample per context, each with its own budget, as :meth:`VLLMEngineGroup.generate_turns`. Every trainer calls
        it (possibly with no contexts); one job holds every trainer's contexts, rank order. Seeds (with a seed and
        ``seed_mode="sample"``) come from each sample's place in the job: ``sample_ids[k]`` among this trainer's
        ``num_samples``, after the trainers before it. The job is generated after those written ahead (a later
        step's first turns may come first) and with the weights the rollout ranks hold then. A collective of the
        trainers. Returns this trainer's samples in order. ``images``: per context, its images in order (its
        prompt's, then its tools'; the context holds their placeholders unexpanded): they travel to trainer rank 0
        only, and in the job as PNG bytes, each image object once (a prompt's, shared by its group's samples, once
        a group: :func:`~trl_nrollout.rollout.ranks.buckets.encode_job_images`); the returned ``prompt_ids`` are the
        engine's, expanded."""
        if mm is not None:
            raise ValueError("the engines on the rollout ranks are vLLM's, which expand images themselves: pass the "
                             "images as images=, not mm= tensors.")
        ids = list(range(len(contexts))) if sample_ids is None else list(sample_ids)
        count = len(contexts) if num_samples is None else int(num_samples)
        every = _trainer_gather(([(list(c), int(b), int(i)) for c, b, i in zip(contexts, budgets, ids)], count,
                                 images is not None))
        every_pics = _leader_gather(images) if any(has for *_, has in every) else None
        before = [sum(c for _, c, _ in every[:t]) for t in range(len(every))]
        flat = [(ctx, budget, before[t] + i) for t, (chunk, *_) in enumerate(every) for ctx, budget, i in chunk]
        parts: list = [None] * self.trainers
        if self.bridge.is_leader:
            self._watch()
            rows, expanded = [], {}
            if flat:
                pics = None if every_pics is None else [
                    list(p) for t, (chunk, *_) in enumerate(every)
                    for p in (every_pics[t] if every_pics[t] is not None else [[]] * len(chunk))]
                job = self._write_job([c for c, _, _ in flat], 1, sampling,
                                      TurnEntry([b for _, b, _ in flat], [s for _, _, s in flat]), pics)
                results = self._read_job(job)
                rows = [x for res in results for x in res.rows()]
                expanded = {g: p for res in results for g, p in (res.prompts or {}).items()}  # images: the engine's
            first = 0
            for t, (chunk, *_) in enumerate(every):
                parts[t] = (rows[first:first + len(chunk)],
                            [expanded[first + k] for k in range(len(chunk))] if expanded else None)
                first += len(chunk)
        rows, seen = self._hand_out(parts, "a tool turn's samples")
        return RolloutBatch([list(c) for c in (contexts if seen is None else seen)], [r[0] for r in rows],
                            [r[1] for r in rows], [r[2] for r in rows], list(range(len(contexts))))

    def _queue_ahead(self, future: list, n: int) -> None:
        """Write the next steps' jobs that are not written yet (trainer rank 0)."""
        for k, (groups, sampling, agent, images) in enumerate(future):
            if k < len(self._pending):
                continue
            job = self._write_job(groups, n, sampling, agent, images)
            self._pending.append((job, groups, n, sampling, agent, images_digest(images)))

    # ------------------------------------------------------------------ a checkpoint's jobs written ahead
    def jobs_ahead(self) -> list[tuple[list, list[JobResult]]] | None:
        """Trainer rank 0, at a checkpoint: each job written ahead (``rollout_lookahead``), as written (groups, n,
        sampling, agent, images' digest), with its results, read now (waiting for the engines where it still runs)
        and kept for the step that trains on it; a resumed run trains on them (:meth:`restore_jobs_ahead`), as the
        uninterrupted run does, instead of generating them again with newer weights. None off trainer rank 0, with
        nothing written ahead, or where a job cannot be replayed: a partial job's (the pool in flight moves on with
        it; the checkpoint keeps the pool after the step's own job) or an environment's episodes (their state is
        the trainers')."""
        if not self.bridge.is_leader or not self._pending:
            return None
        if any(isinstance(e[4], PartialEntry) or (isinstance(e[4], dict) and "envs" in e[4]) for e in self._pending):
            return None
        self._watch()
        saved = []
        for job, *written in self._pending:
            if job not in self._read:
                self._read[job] = self._read_job(job)
            saved.append((written, self._read[job]))
        return saved

    def restore_jobs_ahead(self, saved: list[tuple[list, list[JobResult]]]) -> None:
        """Trainer rank 0: a checkpoint's :meth:`jobs_ahead` become this run's jobs written ahead, already read (ids
        below 0, which the rollout ranks never see): the step each was written for takes its saved samples, and the
        jobs after them are written as the steps go, with the weights then sent."""
        if not self.bridge.is_leader:
            return
        for written, results in saved:
            job = -1 - len(self._read)
            self._read[job] = results
            self._pending.append((job, *written))

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
            time.sleep(0.05)


def job_agent(entries: list[EpisodeJob | PartialEntry | None]) -> EpisodeJob | PartialEntry | None:
    """A job's entry from the trainers' (rank order; None: a single-turn job's): their kind's ``join``
    (:meth:`~trl_nrollout.rollout.ranks.episodes.EpisodeJob.join`,
    :meth:`~trl_nrollout.rollout.ranks.partial.PartialEntry.join`: each trainer's lists after those of the trainers
    before it, the job's order)."""
    first = entries[0]
    return None if first is None else type(first).join(entries)


def _groups_of(sample_prompts: list | None, n: int) -> list | None:
    """Each group's prompt (or images) once (``sample_prompts`` holds each ``n`` times in a row); None for None."""
    return None if sample_prompts is None else [list(sample_prompts[i]) for i in range(0, len(sample_prompts), n)]


def _leader_gather(obj) -> list | None:
    """``obj`` of every trainer rank (rank order) on trainer rank 0; None on the others."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out


def _job_images(every: list | None, sizes: list[int], k: int) -> list[list] | None:
    """The images of job ``k`` (0: the step's, ``k``: the ``k``-th ahead) per group, every trainer's in rank order
    (``every[t][k]``: trainer ``t``'s, None without images; ``sizes[t]``: its groups); None when no trainer's
    job has images (or off trainer rank 0)."""
    if every is None or all(p[k] is None for p in every):
        return None
    return [imgs for p, size in zip(every, sizes) for imgs in (p[k] if p[k] is not None else [[]] * size)]
