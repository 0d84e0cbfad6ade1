"""Shared fixtures: the built-in tiny model (built once per machine, cached) and helpers to run launchers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Keep CPU runs light and quiet; vLLM-specific settings are applied by the library itself.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Local folder of ``builtin:tiny-qwen2`` (built on first use)."""
    from trl_nrollout.builtin import resolve_model

    return resolve_model("builtin:tiny-qwen2")


def run_cmd(args: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, fail the test with its output when it exits non-zero."""
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc
