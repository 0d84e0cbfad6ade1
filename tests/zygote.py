"""A warm launcher for the test suite's multi-process runs: one server process imports torch, transformers, TRL
and PEFT once per test session, and forks every ``accelerate launch`` the tests ask for (tests/fork_launch.py),
whose ranks are forked in turn. A launch no longer pays about 12 s of imports per rank.

``python tests/zygote.py run SOCKET [accelerate launch arguments] script.py [arguments]`` is what the tests run
(``ACCELERATE_LAUNCH`` in conftest.py): a thin client that starts the server if none listens on ``SOCKET``, hands
it its command, environment, working folder and its stdout / stderr (the file descriptors themselves, so output
and pipes behave as for any child process), forwards SIGTERM / SIGINT to the launch, and exits with its code.
If the client dies (a test's timeout kills it), the launch sees its connection close and kills its ranks.
``python tests/zygote.py stop SOCKET`` ends the server and waits for it to be gone (conftest.py does at the end
of the session).

One server per socket, whatever the timing: the clients that find none take turns (``SOCKET.start``, a lock file)
to start one, and a server runs only while it holds ``SOCKET.lock`` (a second one, or one started after it, exits at
once; its socket is never taken over). A server also stops when the process that first started it (the test
session) is gone, or after :data:`IDLE_S` without a request.

The server's owner is the process that started its first client (``ZYGOTE_OWNER`` in the client's environment
names another: the test session, whose commands may start clients from shells that end sooner).

The server itself never runs a launch: it only forks. It holds no threads and no process group, so every fork
starts as clean as a fresh interpreter that has imported the same modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
IDLE_S = 1800.0  # a server nobody has asked for a launch this long stops
OWNER_POLL_S = 2.0  # how often the server checks that its owner (the test session) is alive


def _send(sock, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    size, data = struct.unpack("!I", head)[0], b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _lock(path: str, wait: bool) -> int | None:
    """An exclusive lock on the file ``path`` (created if missing): its descriptor, or None when another process
    holds it and ``wait`` is False."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(path: str, owner: int) -> None:
    """Serve launches on ``path`` until asked to stop, until the process ``owner`` is gone, or :data:`IDLE_S`
    without a request; returns at once when another server holds ``path``'s lock."""
    lock = _lock(path + ".lock", wait=False)
    if lock is None:
        print(f"[zygote] a server already serves {path}; this one exits", file=sys.stderr)
        return
    sys.path.insert(0, HERE)
    import fork_launch

    fork_launch._preimport()
    if os.path.exists(path):  # a socket file a dead server left (a live one would hold the lock)
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print(f"[zygote] serving {path} (pid {os.getpid()}, for pid {owner})", flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launches are reaped by the kernel; their clients get the codes
    server.settimeout(OWNER_POLL_S)
    last = time.monotonic()
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:  # its session ended without stopping it (killed): do not linger
            if not _alive(owner) or time.monotonic() - last > IDLE_S:
                break
            continue
        last = time.monotonic()
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while len(msg) < 4 or len(msg) < 4 + struct.unpack("!I", msg[:4])[0]:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            msg += chunk
        size = struct.unpack("!I", msg[:4])[0]
        request = json.loads(msg[4:4 + size])
        if request.get("stop"):
            conn.close()
            break
        pid = os.fork()
        if pid == 0:  # the launch
            server.close()
            os.close(lock)  # the lock is the server's alone: a launch still running must not keep it
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            _send(conn, {"pid": os.getpid()})
            code = 1
            try:
                code = fork_launch.main(request["argv"], watch=conn)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                _send(conn, {"code": code})
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()
    server.close()
    os.unlink(path)
    os.close(lock)


def _try_connect(path: str):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except OSError:
        sock.close()
        return None


def _connect(path: str, start: bool):
    """A connection to the server on ``path``; with ``start``, one is started where none listens (by one client
    at a time: the others wait for it, then connect), else None."""
    sock = _try_connect(path)
    if sock is not None or not start:
        return sock
    turn = _lock(path + ".start", wait=True)
    try:
        sock = _try_connect(path)
        if sock is not None:  # started by the client before this one
            return sock
        with open(path + ".log", "ab") as log:  # the server keeps its own copy of the descriptor
            owner = os.environ.get("ZYGOTE_OWNER") or str(os.getppid())  # (a test session's commands run in shells)
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path, owner],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                      cwd=HERE)
        deadline = time.monotonic() + 120
        while (sock := _try_connect(path)) is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launch server did not start on {path}; see {path}.log")
            time.sleep(0.2)
        return sock
    finally:
        os.close(turn)


def run(path: str, argv: list[str]) -> int:
    sock = _connect(path, start=True)
    data = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], [1, 2])
    first = _recv(sock)
    if first is None:
        print("[zygote] the launch server closed the connection", file=sys.stderr)
        return 1
    pid = first["pid"]

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    last = _recv(sock)
    return 1 if last is None else int(last["code"])


def stop(path: str, timeout: float = 50.0) -> bool:
    """Ask the server on ``path`` to stop (one still starting: once it listens) and wait until it has (its lock is
    free); False if it is still there after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    asked = False
    while (lock := _lock(path + ".lock", wait=False)) is None:
        sock = None if asked else _try_connect(path)
        if sock is not None:
            data = json.dumps({"stop": True}).encode()
            socket.send_fds(sock, [struct.pack("!I", len(data)) + data], [1, 2])
            sock.close()
            asked = True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    os.close(lock)
    return True


if __name__ == "__main__":
    command, path, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "serve":
        serve(path, int(rest[0]) if rest else os.getppid())
    elif command == "stop":
        sys.exit(0 if stop(path) else 1)
    else:
        sys.exit(run(path, rest))
