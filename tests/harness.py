"""What makes the test processes fast without changing what they compute: the harness's frozen heap, kept frozen,
and vLLM's kernel overrides registered once per process.

The frozen heap: what the test process (tests/conftest.py) and each forked rank of the
warm launcher (tests/fork_launch.py) imported before the tests run is moved out of the collector's reach once, and
vLLM's engines may neither unfreeze it nor freeze their own objects.

Why: a vLLM engine freezes the whole heap when it starts (``vllm.utils.gc_utils.freeze_gc_heap``: collect, then
``gc.freeze()``) and unfreezes all of it when it stops (``EngineCore.shutdown``, ``cleanup_dist_env_and_memory``,
the worker's ``shutdown``). In a process that starts many engines one after another (a test session, a launch that
trains one trainer per combination), every engine after the first then meets an unfrozen heap of millions of
module objects (torch, transformers, TRL, vLLM) in each of the ~8 full collections it runs while starting and
stopping: 0.23-0.3 s each on the 2-core machine, 5.8 s of 23 s for three one-process trainers (cProfile,
2026-12-07). Holding the harness's freeze and leaving the engines' objects to the collector (as in any process where
no engine froze them) changes no value a test sees: the same collections run, over the objects made since the
freeze; nothing is left uncollected (an engine's cycles stay collectable: vLLM unfreezes at shutdown for that).
A speed measure of the harness only: the package and the user's processes keep vLLM's behaviour.
"""

from __future__ import annotations

import gc
import os

_ORIGINAL = {"freeze": gc.freeze, "unfreeze": gc.unfreeze}


def _held(*_args, **_kwargs) -> None:
    """``gc.freeze`` / ``gc.unfreeze`` while the harness holds its freeze: nothing (see the module docstring)."""


def preimport(*, ours: bool, stack: bool) -> None:
    """Import what a test's training run imports, so that :func:`hold_frozen_heap` freezes it (TRL's trainer is
    imported lazily, at a run's first use, and a module imported after the freeze stays in every collection's way):
    ``stack``, TRL's trainer stack and what a vLLM engine, DeepSpeed and the run's report import when they start;
    ``ours``, this package's trainer and engines (not in the warm launcher, whose launches may run another tree's
    package: ``PYTHONPATH``)."""
    if stack:
        import deepspeed  # noqa: F401
        import matplotlib
        import peft  # noqa: F401
        import transformers.trainer  # noqa: F401
        import trl  # noqa: F401
        from trl import GRPOTrainer  # noqa: F401

        matplotlib.use("Agg")  # as the run's report does (trl_nrollout/recipe/report.py)
        import compressed_tensors  # noqa: F401
        import matplotlib.pyplot  # noqa: F401
        import vllm.entrypoints.llm  # noqa: F401
        import vllm.model_executor.model_loader  # noqa: F401
        import vllm.model_executor.models.qwen2  # noqa: F401
        import vllm.v1.executor.uniproc_executor  # noqa: F401
        import vllm.v1.worker.cpu_model_runner  # noqa: F401
        import vllm.v1.worker.cpu_worker  # noqa: F401

        register_kernel_overrides_once()
    if ours:
        import trl_nrollout.rollout.engines.hf_engine  # noqa: F401
        import trl_nrollout.rollout.engines.vllm_group  # noqa: F401
        import trl_nrollout.trainer.grpo  # noqa: F401


def hold_frozen_heap() -> None:
    """Collect, freeze what exists now, and keep it so (``gc.freeze`` / ``gc.unfreeze`` do nothing until
    :func:`release_frozen_heap`)."""
    gc.collect()
    _ORIGINAL["freeze"]()
    if os.environ.get("TEST_GC_UNHELD"):  # vLLM's own freezing, to measure what holding saves
        return
    gc.freeze = _held
    gc.unfreeze = _held


def release_frozen_heap() -> None:
    """Give ``gc`` its own ``freeze`` / ``unfreeze`` back and unfreeze the heap (frozen objects are never finalized,
    and some extension modules print a leak report at exit for theirs)."""
    gc.freeze, gc.unfreeze = _ORIGINAL["freeze"], _ORIGINAL["unfreeze"]
    gc.unfreeze()


def register_kernel_overrides_once() -> None:
    """vLLM's CPU platform registers its C++ overrides of Triton kernels each time an engine's worker starts
    (``CpuPlatform.register_triton_kernel_overrides``), and each registration scans every attribute of every loaded
    module for references to rebind (``vllm.triton_utils.dispatcher._rebind_kernels``): 0.79 s per engine start here
    (cProfile, 2026-12-07), and each later one wraps the last one's wrappers again. In a process that starts many
    engines it runs once: the overrides the first registration installed stay in place (the same functions)."""
    from vllm.platforms.cpu import CpuPlatform

    register = CpuPlatform.register_triton_kernel_overrides.__func__
    if getattr(register, "once", False):  # (patched already in this process)
        return
    done: list[bool] = []

    def once(cls) -> None:
        if not done:
            register(cls)
            done.append(True)

    once.once = True
    CpuPlatform.register_triton_kernel_overrides = classmethod(once)
