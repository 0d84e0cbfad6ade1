"""``accelerate launch`` for the test suite, with each process forked from one that has already imported torch,
transformers, TRL and PEFT.

A real launch (``accelerate launch`` -> torchrun) starts every process as a fresh interpreter, and on the
project's 2-core machines each pays about 12 s of imports before it does anything (transformers' trainer utilities
6.9 s, of which PEFT 4.3 s and torch 2.5 s): with some forty multi-process tests that was a third of the suite.
This launcher parses the same arguments with accelerate's own parser and validation, builds the same process
environment with accelerate's own functions (``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``: the
DeepSpeed and FSDP configs, mixed precision, threads per process), imports the heavy modules once, and forks one
process per rank, each running the script as ``__main__`` with torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The processes are real: separate
interpreters after the fork, their own torch.distributed process group (gloo), DeepSpeed and vLLM imported and
started in each. As torchrun does, the first rank that fails makes the others stop (SIGTERM, then SIGKILL) and the
launcher exits with its code; SIGTERM / SIGINT to the launcher go to every rank.

Nothing of a launch outlives it: the ranks form one process group of their own (led by rank 0, whose pid the
launcher holds, unreaped, until the end, so that the group's id cannot pass to another process), every signal goes
to that whole group (the ranks and whatever they started), and when the last rank has ended the group is killed,
taking what the ranks left behind. A rank gets SIGKILL when the launcher itself dies (Linux: a launcher killed with
SIGKILL cannot stop them).

A launch over several "machines" (``--num_machines M --machine_rank r``, one launcher per node, as a user starts
``accelerate launch`` once per node) forks this node's ranks, ``r * P`` to ``r * P + P - 1`` of ``P = num_processes /
M``, with torchrun's node variables (``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``LOCAL_WORLD_SIZE = P``) and the main
process's address and port as every rank's rendezvous (accelerate's ``--same_network``). The README's commands and
the tests of the command line itself use the real ``accelerate launch``.

``--torchrun N`` in place of accelerate's arguments launches as ``torchrun --nproc_per_node N`` would (the tests of
tests/dist/, plain torch.distributed: no accelerate variables; ``torchrun`` in conftest.py).

    python tests/fork_launch.py [accelerate launch arguments] script.py [script arguments]
    python tests/fork_launch.py --torchrun N script.py [script arguments]
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

GRACE_S = 15.0  # how long ranks get to stop after SIGTERM before SIGKILL (a launch's FORK_LAUNCH_GRACE_S overrides
# it: a test whose rank is frozen on purpose (SIGSTOP: SIGTERM waits until it runs again) need not wait it out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Script:
    """What each rank runs as ``__main__``: a file's ``path`` (``python path args``), or with ``module`` a module's
    name (``python -m name args``)."""

    name: str
    args: list[str]
    module: bool = False

    def run(self) -> None:
        import runpy

        sys.argv = [self.name, *self.args]  # (a module's: runpy sets argv[0] to its file)
        if self.module:
            sys.path.insert(0, os.getcwd())  # as ``python -m`` does
            runpy.run_module(self.name, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(self.name)))
            runpy.run_path(self.name, run_name="__main__")


@dataclass(frozen=True)
class Node:
    """This launcher's place in a launch over several machines: its ``rank`` of ``machines``, and the main process's
    ``addr`` and ``port`` (``port`` 0 on one machine: a free port of this one)."""

    rank: int = 0
    machines: int = 1
    addr: str = "127.0.0.1"
    port: int = 0


def _environment(argv: list[str]) -> tuple[dict, int, Script, Node]:
    """accelerate's environment for the launch, its process count (every node's), what each rank runs and this
    launcher's node."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args = launch_command_parser().parse_args(argv)
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    node = Node()
    if (args.num_machines or 1) > 1:
        node = Node(int(args.machine_rank), int(args.num_machines), str(args.main_process_ip),
                    int(args.main_process_port))
    if args.use_deepspeed and not args.cpu:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config_flag:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif (args.multi_gpu or args.use_fsdp) and not args.cpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    script = Script(args.training_script, list(args.training_script_args), module=bool(args.module))
    return dict(env), int(args.num_processes or 1), script, node


def _preimport() -> None:
    """What every rank imports: TRL's trainer stack, and what a rank's vLLM engine, DeepSpeed and the run's report
    import when they start (measured: 5 s of a 2-process launch's 20 went to imports in each rank); then the heap is
    frozen, so that the collections vLLM runs while its engine starts (3 s of that launch) skip these modules'
    objects. Our own package stays to the ranks: a launch may run another tree's (``PYTHONPATH``). Nothing imported
    here starts a thread (checked), so every fork is as clean as a fresh interpreter."""
    from harness import hold_frozen_heap, preimport  # tests/harness.py (this folder is the launcher's path)

    preimport(ours=False, stack=True)
    hold_frozen_heap()  # and vLLM's engines neither unfreeze it nor freeze their own objects


def _rank_variables(rank: int, world: int, node: Node, port: int) -> dict[str, str]:
    """What torchrun gives rank ``rank`` of ``world`` on ``node`` (each node running ``world / machines`` ranks)."""
    local_world = world // node.machines
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % local_world), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node.rank), "GROUP_WORLD_SIZE": str(node.machines),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": node.addr, "MASTER_PORT": str(port)}


def _run_rank(env: dict, rank: int | None, world: int, node: Node, port: int, script: Script) -> int:
    """Run ``script`` as rank ``rank`` of ``world`` (None: as a plain process, without rank variables); its exit
    code."""
    import atexit
    import traceback

    os.environ.clear()
    os.environ.update(env)
    if rank is not None:
        os.environ.update(_rank_variables(rank, world, node, port))
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):  # read at start-up only
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # the OpenMP runtime read the launcher's value when torch was imported
        import torch

        torch.set_num_threads(int(threads))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    code = 0
    try:
        script.run()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's error is printed and becomes its exit code, as in torchrun
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _closed(sock) -> bool:
    """Whether the peer of ``sock`` closed it (readable with nothing to read)."""
    import select

    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _exit_code(pid: int, reap: bool = True) -> int | None:
    """The exit code of the child ``pid`` once it has ended (minus the signal that killed it), else None. ``reap``
    False leaves it a zombie: its pid, and the process group it leads, cannot pass to another process yet."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | (0 if reap else os.WNOWAIT))
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(group: int, signum: int) -> None:
    """``signum`` to every process of the process group ``group`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL to this process when its parent (the launcher) ends; at once if it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


def _torchrun_environment(argv: list[str]) -> tuple[dict, int, Script]:
    """``--torchrun N script.py [arguments]``: what ``torchrun --nproc_per_node N script.py`` gives its processes (the
    caller's environment, and ``OMP_NUM_THREADS=1`` unless set when N > 1, as torchrun does; the rank variables are
    :func:`_run_rank`'s), without accelerate's variables: the tests of tests/dist/ run plain torch.distributed."""
    world, script, *script_args = argv[1:]
    env = dict(os.environ)
    if int(world) > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env, int(world), Script(script, script_args)


def _plain_script(argv: list[str]) -> Script:
    """``--plain script.py [arguments]`` or ``--plain -m module [arguments]``: one process, as ``python`` would run it
    (no launcher's variables): the docs' commands (tests/test_docs.py puts ``trl-nrollout`` and ``accelerate launch``
    through this launcher)."""
    if argv[1:2] == ["-m"]:
        return Script(argv[2], argv[3:], module=True)
    return Script(argv[1], argv[2:])


def main(argv: list[str], watch=None) -> int:
    """Launch; returns the exit code. ``watch``: a socket whose closing (the client that asked for this launch went
    away, e.g. killed at a timeout) kills the ranks. ``argv``: ``accelerate launch``'s arguments,
    ``--torchrun N script.py [arguments]`` for torchrun's processes (:func:`_torchrun_environment`), or ``--plain``
    and a script or ``-m module`` for one plain process (:func:`_plain_script`)."""
    node, ranked = Node(), True
    if argv[:1] == ["--torchrun"]:
        env, world, script = _torchrun_environment(argv)
    elif argv[:1] == ["--plain"]:
        env, world, script, ranked = dict(os.environ), 1, _plain_script(argv), False
    else:
        env, world, script, node = _environment(argv)
        env = {**os.environ, **env}
    _preimport()
    port = node.port or _free_port()
    mine = range(node.rank * world // node.machines, (node.rank + 1) * world // node.machines)
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    group = 0  # the launch's process group: rank 0's pid
    launcher = os.getpid()
    for rank in mine:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, group)
                _die_with_parent(launcher)
                code = _run_rank(env, rank if ranked else None, world, node, port, script)
            finally:
                os._exit(code)
        with contextlib.suppress(OSError):  # as in the child: whichever runs first
            os.setpgid(pid, group or pid)
        group = group or pid
        children[pid] = rank

    def forward(signum, _frame):
        _signal_group(group, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed: int | None = None
    deadline: float | None = None
    try:
        while children:
            ended = next(((pid, code) for pid in children
                          if (code := _exit_code(pid, reap=pid != group)) is not None), None)
            if ended is None and watch is not None and _closed(watch):
                print("[fork_launch] the caller went away; killing the ranks", file=sys.stderr)
                forward(signal.SIGKILL, None)
                watch = None
                failed = failed or 1
                continue
            if ended is None:
                if deadline is not None and time.monotonic() > deadline:
                    forward(signal.SIGKILL, None)
                    deadline = None
                time.sleep(0.05)
                continue
            pid, code = ended
            rank = children.pop(pid)
            if code != 0 and failed is None:
                failed = code if code > 0 else 1
                print(f"[fork_launch] rank {rank} exited with {code}; stopping the other ranks", file=sys.stderr)
                forward(signal.SIGTERM, None)
                deadline = time.monotonic() + float(os.environ.get("FORK_LAUNCH_GRACE_S", GRACE_S))
    finally:  # what the ranks started and left running; then rank 0's pid is released
        forward(signal.SIGKILL, None)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(group, 0)
    return failed or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
