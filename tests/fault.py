"""A real fault for real launches: run a command (an ``accelerate launch``) and SIGKILL one of its processes, from
outside, once a checkpoint folder is complete. Used by tests/test_rollout_ranks.py and benchmarks/rollout_rank_fault.py
(issue 65 item 1: a lost rollout rank)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def launch_killing(cmd: list[str], *, cwd: Path, env: dict, log: Path, checkpoint: Path | None, rank: int,
                   timeout_s: float = 600) -> tuple[int, int | None, float]:
    """Run ``cmd`` (output to ``log``); once ``checkpoint`` is a complete checkpoint folder, SIGKILL the process
    of global ``rank`` of the launch's first attempt (``RANK`` and ``TORCHELASTIC_RESTART_COUNT=0`` in its
    environment). ``checkpoint=None``: kill nothing. Returns ``(exit status, killed pid or None, wall seconds)``;
    a launch past ``timeout_s`` is killed and raises TimeoutError."""
    import psutil

    from trl_nrollout.trainer.checkpoints import is_complete

    start = time.monotonic()
    killed = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"the launch ran past {timeout_s} s; its output: {log}")
                time.sleep(0.1)
                if killed is None and checkpoint is not None and checkpoint.is_dir() and is_complete(checkpoint):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            environ = child.environ()
                            if (environ.get("RANK") == str(rank)
                                    and environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
                                os.kill(child.pid, signal.SIGKILL)
                                killed = child.pid
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, killed, time.monotonic() - start
