"""Rollout ranks: some processes of one launch only generate, the others train (``rollout_ranks``).

One ``accelerate launch`` of ``W`` processes is split into two torch.distributed worlds before accelerate starts:
the first ``W - R`` global ranks train (DDP, DeepSpeed ZeRO or FSDP among themselves, rank 0 logs and saves) and the
last ``R`` generate (their own world: vLLM engines of ``rollout_tp_size`` ranks within a node). Both worlds are set
up on the launcher's rendezvous store, under their own prefixes, so no port is opened besides the launcher's.

Between the two worlds (the *bridge*):

- messages from trainer rank 0 to the rollout ranks (a start message, weight versions, generation jobs, the end),
  and the rollout ranks' samples back, travel through the same store, one key each, read in order;
- weights travel over a gloo process group of trainer rank 0 and the rollout ranks, one flat byte buffer per
  bucket (``weight_sync_bucket_mb``), sent from a thread, so the trainers go on training while they travel;
- every process writes a heartbeat (time and what it is doing) to the store every second; a watchdog thread stops
  a process whose peer has not been heard from for ``rollout_rank_timeout_s`` (a dead or frozen process), with a
  message naming the peer and what it was doing, so no rank waits forever.

The math of who is who is in :class:`~trl_nrollout.plan.roles.Roles` (pure, no torch: ``trl-nrollout plan``
uses it); :func:`~trl_nrollout.plan.roles.roles_refusal` says why a layout cannot work.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import socket
import sys
import threading
import time
from datetime import timedelta

import torch

from trl_nrollout.plan.roles import ROLLOUT, TRAIN, Roles, roles_refusal

__all__ = ["ROLLOUT", "TRAIN", "Bridge", "Roles", "RolloutRankError", "current_bridge", "roles_refusal", "split_world"]
_PREFIX = "trl_nrollout/bridge/"


class RolloutRankError(RuntimeError):
    """A rank of the other world died, hung, or failed; the message names it and what it was doing."""


class Bridge:
    """The link between the two worlds of this process's launch (see the module docstring). ``store``: the
    launcher's store under the bridge's prefix; ``weights_group``: the gloo group of trainer rank 0 (its rank 0)
    and the rollout ranks (1 + their rollout rank), None on the other trainers."""

    def __init__(self, roles: Roles, rank: int, store, weights_group, timeout_s: float) -> None:
        self.roles = roles
        self.rank = rank
        self.store = store
        self.weights_group = weights_group
        self.timeout_s = timeout_s
        self.status = "starting"
        self._watch: set[int] = set()  # the peers whose silence stops this process
        self._stopped = threading.Event()
        self._pids: dict[int, str] = {}  # peer -> "host:pid", read once
        store.set(f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
        self._beat = threading.Thread(target=self._heartbeat, name="trl_nrollout-heartbeat", daemon=True)
        self._beat.start()
        atexit.register(self.finish)

    @property
    def role(self) -> str:
        return self.roles.role(self.rank)

    @property
    def is_leader(self) -> bool:
        """Trainer rank 0: the one that talks to the rollout ranks."""
        return self.rank == 0

    def describe(self, rank: int) -> str:
        where = ""
        try:
            if self.store.check([f"pid/{rank}"]):
                where = f", process {self.store.get(f'pid/{rank}').decode()}"
        except Exception:  # noqa: BLE001 - the store's host is gone; the rank alone says enough
            pass
        return f"global rank {rank} ({self.roles.role(rank)} rank {self.roles.role_rank(rank)}{where})"

    # ------------------------------------------------------------------ liveness
    def watch(self, ranks) -> None:
        """From now on, stop this process when one of ``ranks`` has not written a heartbeat for ``timeout_s``."""
        self._watch = set(ranks) - {self.rank}

    def unwatch(self) -> None:
        self._watch = set()

    def finish(self) -> None:
        """This rank is done (its peers no longer wait for it): the last heartbeat says so."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(Exception):  # the store's host may have exited first; nothing waits then
            self.store.set(f"beat/{self.rank}", f"{time.time()}|done")

    def _heartbeat(self) -> None:
        while not self._stopped.wait(1.0):
            try:
                self.store.set(f"beat/{self.rank}", f"{time.time()}|{self.status}")
            except Exception:  # noqa: BLE001 - the store's host is gone: trainer rank 0 exited or died
                if self._watch:
                    self._die(f"the launcher's store (hosted by trainer rank 0 or the launcher) stopped answering "
                              f"while this rank was {self.status}: trainer rank 0 died or exited")
                return
            if self._watch:
                self._check_peers()

    def peer_state(self, rank: int) -> tuple[float, str] | None:
        """The last heartbeat of ``rank``: (seconds since, what it was doing), None before its first one."""
        key = f"beat/{rank}"
        if not self.store.check([key]):
            return None
        stamp, _, status = self.store.get(key).decode().partition("|")
        return time.time() - float(stamp), status

    def _check_peers(self) -> None:
        for peer in sorted(self._watch):
            state = self.peer_state(peer)
            if state is None or state[1] == "done":
                continue
            silent, status = state
            if self._gone(peer):  # (its launcher ends the launch, or restarts it: --max_restarts)
                self._die(f"{self.describe(peer)} has died (its process is gone) while it was {status}")
            if silent > self.timeout_s:
                self._die(f"{self.describe(peer)} has not been heard from for {silent:.0f} s (rollout_rank_timeout_s="
                          f"{self.timeout_s:g}); it was last {status}. It died or hangs; see its own output above")

    def _gone(self, peer: int) -> bool:
        """Whether ``peer`` runs on this host and its process has ended (a peer elsewhere: only its heartbeat says).
        A launcher that restarts its processes (torchrun, ``--max_restarts``) asks the others to stop with SIGTERM,
        which a process blocked in a collective with the dead one cannot act on: this check stops it at once."""
        import psutil

        where = self._pids.get(peer)
        if where is None:
            if not self.store.check([f"pid/{peer}"]):
                return False
            where = self._pids[peer] = self.store.get(f"pid/{peer}").decode()
        host, _, pid = where.rpartition(":")
        if host != socket.gethostname():
            return False
        try:
            return psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False

    def die(self, why: str) -> None:
        """Stop this process at once, saying ``why`` (see :meth:`_die`): for a failure its peers could only wait on,
        such as a weights broadcast that cannot go on."""
        self._die(why)

    def _die(self, why: str) -> None:
        """Stop this process at once (a thread cannot raise into the main thread, which may be blocked in a
        collective): the launcher then stops the others."""
        sys.stderr.write(f"\ntrl_nrollout: {self.describe(self.rank)} stops: {why}.\n")
        sys.stderr.flush()
        os._exit(1)

    # ------------------------------------------------------------------ messages
    def put(self, key: str, value) -> None:
        """Write ``value`` (pickled) at ``key``. A value over :data:`CHUNK_BYTES` travels in parts ``key#1 ...``
        written first, then ``key`` itself (a header with the count), so a reader that sees ``key`` sees all of it:
        the launcher's store refuses a single value over 8 MiB (torch's libuv server drops the connection)."""
        for k, part in enumerate(encode_value(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), start=0):
            self.store.set(key if k == 0 else f"{key}#{k}", part)

    def _read(self, key: str, delete: bool):
        head = self.store.get(key)
        parts = [self.store.get(f"{key}#{k}") for k in range(1, chunk_count(head))]
        if delete:
            self.drop(key, head)
        return pickle.loads(decode_value(head, parts))

    def drop(self, key: str, head: bytes | None = None) -> None:
        """Remove ``key`` and its parts."""
        head = self.store.get(key) if head is None else head
        for k in range(1, chunk_count(head)):
            self.store.delete_key(f"{key}#{k}")
        self.store.delete_key(key)

    def wait_for(self, key: str, sender: int, what: str) -> None:
        """Wait until ``key`` exists: checks it at intervals growing from 1 ms to :data:`POLL_MAX_S` (a quick answer
        stays quick, a long wait costs a few store calls a second), and once per :data:`LIVENESS_S` that ``sender``
        lives. (The store's own ``wait`` with a timeout logs a C++ warning at every timeout.)"""
        delay, checked = 0.001, time.monotonic()
        while not self.store.check([key]):
            if time.monotonic() - checked >= LIVENESS_S:
                checked = time.monotonic()
                state = self.peer_state(sender)
                if state is not None and state[0] > self.timeout_s and state[1] != "done":
                    raise RolloutRankError(
                        f"{self.describe(sender)} has not been heard from for {state[0]:.0f} s while this rank waited "
                        f"for {what} (rollout_rank_timeout_s={self.timeout_s:g}); it was last {state[1]}.")
                if state is not None and state[1] == "done" and not self.store.check([key]):
                    raise RolloutRankError(f"{self.describe(sender)} finished while this rank waited for {what}.")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def take(self, key: str, sender: int, what: str, delete: bool = True, track: bool = True):
        """The value at ``key``, written by ``sender``; waits for it, checking that the sender lives (a
        :class:`RolloutRankError` naming it otherwise). ``delete``: remove the key once read (one reader);
        ``track``: the heartbeat says this rank is waiting for it (not from a helper thread)."""
        last = self.status
        if track:
            self.status = f"waiting for {what}"
        try:
            self.wait_for(key, sender, what)
            value = self._read(key, delete)
            if isinstance(value, dict) and value.get("kind") == "error":
                raise RolloutRankError(f"{self.describe(sender)} failed: {value['message']}")
            return value
        finally:
            if track:
                self.status = last


#: The largest part of a value written to the store (the libuv store server refuses values over 8 MiB).
CHUNK_BYTES = 4 << 20
#: Longest pause between two checks of a key waited for, and between two checks that its writer lives.
POLL_MAX_S = 0.05
LIVENESS_S = 1.0


def encode_value(data: bytes, chunk: int | None = None) -> list[bytes]:
    """``data`` as the store's values: one (a 0 byte, then the data) when it fits ``chunk`` bytes, else a header (a 1
    byte, then the count of parts as 8 bytes) followed by the parts, each at most ``chunk`` bytes."""
    chunk = CHUNK_BYTES if chunk is None else chunk
    if len(data) + 1 <= chunk:
        return [b"\x00" + data]
    parts = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    return [b"\x01" + (len(parts) + 1).to_bytes(8, "little"), *parts]


def chunk_count(head: bytes) -> int:
    """How many values (the header included) :func:`encode_value` wrote for the value whose first one is ``head``."""
    return 1 if head[:1] == b"\x00" else int.from_bytes(head[1:9], "little")


def decode_value(head: bytes, parts: list[bytes]) -> bytes:
    """The data of :func:`encode_value`'s values (``head`` and the rest)."""
    if head[:1] == b"\x00":
        return head[1:]
    return b"".join(parts)


_BRIDGE: Bridge | None = None


def current_bridge() -> Bridge | None:
    """This process's bridge, once :func:`split_world` ran (None: no rollout ranks)."""
    return _BRIDGE


def split_world(rollout_ranks: int, rollout_tp_size: int = 1, timeout_s: float = 120.0,
                group_timeout_s: float = 1800.0) -> Bridge:
    """Split this launch into trainers and rollout ranks (see the module docstring); idempotent within a process.

    Reads the launcher's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` to this process's world (``LOCAL_RANK``
    keeps the device index) and starts that world's default process group, so that accelerate, DeepSpeed and vLLM
    see their own world only. Must run before anything starts torch.distributed (an ``Accelerator``, a
    ``PartialState``); :class:`~trl_nrollout.config.NRolloutConfig` calls it first thing.
    """
    global _BRIDGE
    from trl_nrollout.errors import InputError

    if _BRIDGE is not None:
        if _BRIDGE.roles.rollout_ranks != rollout_ranks:
            raise InputError(f"rollout_ranks={rollout_ranks}, but this launch was already split with rollout_ranks="
                             f"{_BRIDGE.roles.rollout_ranks}; one launch has one split: build one NRolloutConfig per "
                             "launch, with the same rollout_ranks.")
        return _BRIDGE

    if torch.distributed.is_initialized():
        raise InputError(
            f"rollout_ranks={rollout_ranks} splits the launch's processes before torch.distributed starts, but it "
            "was already started (an Accelerator, a PartialState or init_process_group ran before the config was "
            "built); build NRolloutConfig first.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    why = roles_refusal(world, rollout_ranks, local_world, rollout_tp_size)
    if why:
        raise InputError(why)
    roles = Roles(world, rollout_ranks, local_world)
    store, _, _ = next(torch.distributed.rendezvous("env://", rank, world, timeout=timedelta(seconds=600)))
    # a launch restarted by its agent (accelerate launch --max_restarts: a process died) may keep the store of the
    # attempt before, whose keys (the dead processes' addresses, messages, heartbeats) must not be read: each attempt
    # has its own keys
    store = torch.distributed.PrefixStore(f"a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    role = roles.role(rank)
    # the process groups' timeout is the trainer's ddp_timeout (``group_timeout_s``), as accelerate would set it:
    # a collective waits that long. Waits that depend on the other world (a job, the engines' start) do not block
    # in a collective: they wait on store keys and check the sender's heartbeat (``timeout_s``).
    timeout = timedelta(seconds=group_timeout_s)
    os.environ["RANK"] = str(roles.role_rank(rank))
    os.environ["WORLD_SIZE"] = str(roles.role_size(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(roles.role_local_world(rank))
    os.environ["TRL_NROLLOUT_ROLE"] = role
    os.environ["TRL_NROLLOUT_GLOBAL_RANK"] = str(rank)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(
        backend, store=torch.distributed.PrefixStore(f"trl_nrollout/{role}/", store), rank=roles.role_rank(rank),
        world_size=roles.role_size(rank), timeout=timeout)
    bridge_store = torch.distributed.PrefixStore(_PREFIX, store)
    group = None
    if rank == 0 or role == ROLLOUT:  # trainer rank 0 is the weights group's rank 0
        members = 1 + rollout_ranks
        # a transfer waits for the other world (a rollout rank busy receiving, a trainer gathering ZeRO-3 shards):
        # the heartbeats stop a dead or frozen peer, so the group itself may wait long (and a transfer may be long)
        group = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore("trl_nrollout/weights/", store),
            0 if rank == 0 else 1 + roles.role_rank(rank), members, max(timeout, timedelta(hours=2)))
    _BRIDGE = Bridge(roles, rank, bridge_store, group, timeout_s)
    return _BRIDGE
