"""The process around a ``VLLMEngineGroup``: one external-launcher engine per process (a new trainer releases the
previous one), vLLM's process groups and the default one's life, which ranks a generation's barrier spans, objects
exchanged between ranks as bytes, and token prompts as vLLM takes them."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


#: Engine groups alive in this process (weakly held): vLLM's external launcher supports one engine per process.
LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def restore_env(name: str, value: str | None) -> None:
    """Set ``os.environ[name]`` back to ``value`` (unset it where it was unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def close_live_engines() -> None:
    """Release every engine group still alive in this process (a trainer built after another one)."""
    for group in list(LIVE_ENGINES):
        logger.info("releasing the rollout engine of a previous trainer (vLLM runs one engine per process)")
        group.close()


def forget_stale_vllm_groups() -> None:
    """vLLM's groups left by an engine whose default process group was destroyed since (the recipe's ``main`` ends
    with ``destroy_process_group``): a new engine would reuse them and fail to start."""
    import sys

    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is None or parallel_state._WORLD is None:
        return
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        release_vllm_groups()


def release_vllm_groups() -> None:
    """Forget vLLM's process groups after the shutdown of an engine that started torch.distributed itself (one
    process). The shutdown destroys the default group but leaves vLLM's groups (world, TP, PP, ...) registered: a
    later engine in this process (a second ``main`` of the recipe, a sweep) would reuse them and fail to start
    ("not initialized in the world group map")."""
    from vllm.distributed import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            try:
                value.destroy()
            except Exception as err:  # noqa: BLE001 - its torch group may already be gone with the default one
                logger.debug("vLLM group %s: %s", name, err)
            setattr(parallel_state, name, None)
    parallel_state._NODE_COUNT = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def keep_default_process_group():
    """During a vLLM shutdown: release vLLM's world group but not torch's default process group."""
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def release_world_only() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = release_world_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def barrier_scope(tp: int, cpu: bool, distributed: bool, rollout_rank: bool) -> str | None:
    """Where an engine's ranks meet before a generation (:meth:`VLLMEngineGroup.barrier_before_generate`):
    ``"world"`` (the default group: colocated TP engines on GPUs), ``"tp"`` (the engine's own ranks: TP engines on
    rollout ranks, where no training collective runs), or None (TP 1, CPU, one process)."""
    if not distributed or tp <= 1 or cpu:
        return None
    return "tp" if rollout_rank else "world"


def on_rollout_rank() -> bool:
    from trl_nrollout.rollout.bridge import ROLLOUT, current_bridge

    bridge = current_bridge()
    return bridge is not None and bridge.role == ROLLOUT


def exchange_objects(outgoing: list, group=None) -> list:
    """``outgoing[r]`` (any picklable value; None sends nothing) to rank ``r`` of ``group``, from every rank at once:
    returns what each rank sent this one (None where it sent nothing). Two ``all_to_all_single`` calls (the sizes,
    then the bytes, uneven splits), so each byte travels once and only to its rank (a scatter of pickled objects
    per sender pads every part to the largest and runs once per sender)."""
    world = torch.distributed.get_world_size(group)
    blobs = [b"" if obj is None else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) for obj in outgoing]
    if len(blobs) != world:
        raise ValueError(f"exchange_objects: {len(blobs)} values for a group of {world} ranks.")
    send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    torch.distributed.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)[:int(send_sizes.sum())]
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    torch.distributed.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                                        input_split_sizes=send_sizes.tolist(), group=group)
    out, at = [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(recv[at:at + size].numpy().tobytes()) if size else None)
        at += size
    return out


def vllm_prompts(prompts: Sequence[Sequence[int]], images: Sequence[list] | None = None) -> list:
    """vLLM's inputs: token ids, with ``multi_modal_data`` for a prompt that has images (one image as itself, more
    as a list, as TRL passes them)."""
    from vllm.inputs import TokensPrompt

    out = []
    for g, p in enumerate(prompts):
        imgs = images[g] if images is not None else None
        if imgs:
            out.append(TokensPrompt(prompt_token_ids=list(p), multi_modal_data={"image": imgs[0] if len(imgs) == 1
                                                                                 else list(imgs)}))
        else:
            out.append(TokensPrompt(prompt_token_ids=list(p)))
    return out
