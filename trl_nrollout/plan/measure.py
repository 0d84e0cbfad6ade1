"""This machine's rates, measured with torch alone (no engine, no trainer): a synchronize of any accelerator, a
median timer, a matmul's FLOP/s, a copy's bytes/s, and the training rates of a model on padded rows
(``mfu_train``, ``mfu_attention``, the fixed cost per forward, the optimizer's bytes/s). ``trl-nrollout plan
--calibrate`` (:mod:`trl_nrollout.calibrate`) and ``scripts/gpu_check.py`` use them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def synchronize(*where: Any) -> None:
    """Wait until the work queued on the devices of ``where`` has finished (each a tensor, a module, whose
    parameters' devices count, a ``torch.device`` or a device name): a CUDA kernel returns before it has run, so a
    clock read right after it would time its launch only. Any accelerator (``torch.accelerator``); the CPU runs
    synchronously, nothing to wait for."""
    import torch

    devices: set = set()
    for item in where:
        if isinstance(item, torch.Tensor):
            devices.add(item.device)
        elif isinstance(item, torch.nn.Module):
            devices.update(p.device for p in item.parameters())
        else:
            devices.add(torch.device(item))
    for device in devices:
        if device.type not in ("cpu", "meta"):
            torch.accelerator.synchronize(device)


def _median_time(fn: Callable[[], object], repeats: int = 5, on: Any = "cpu") -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after one warm-up call; the devices of ``on`` (see
    :func:`synchronize`) are synchronized before each clock read, so that each call's device work is timed, not
    its launch (nor the previous call's queue)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(on)
        start = time.perf_counter()
        fn()
        synchronize(on)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainer_device_args(device: str, has_bf16: bool) -> dict[str, bool]:
    """The trainer arguments of ``--calibrate``'s GRPO runs on ``device`` (``"cpu"``, ``"cuda"``, any accelerator's
    type): on the CPU only where there is no accelerator (``use_cpu``), and in bfloat16 where the device supports
    it (the precision the other measurements take there), float32 otherwise (the CPU's measurements)."""
    cpu = device == "cpu"
    return {"use_cpu": cpu, "bf16": not cpu and has_bf16}


def bf16_supported(device: str) -> bool:
    """Whether ``device`` (a type: ``"cuda"``...) computes in bfloat16 natively; False for the CPU (float32 there)."""
    import torch

    if device == "cpu":
        return False
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    return True


def measure_flops(device: str = "cpu", size: int = 2048, dtype=None) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul in ``dtype`` (default: float32 on the CPU, bfloat16 elsewhere)."""
    import torch

    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)

    return 2 * size**3 / _median_time(lambda: a @ b, on=a)


def measure_mem_bw(device: str = "cpu", mib: int = 256) -> float:
    import torch

    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)

    return 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), on=dst)


def measure_training(policy, dims, flops: float, device: str = "cpu", *, rows: int = 1, long: int = 1024,
                     vocab: int = 100) -> dict[str, float]:
    """The training rates of ``policy`` (a causal LM on ``device``; ``dims`` its :class:`ModelDims`) at ``flops``
    peak: forward + backward of a language-model loss on padded rows (attention under a mask, every query-key pair
    computed, as the trainer's) at three shapes, ``2r x 64``, ``4r x long/4`` and ``r x long`` (``r = rows``; the
    last two hold the same tokens): the fixed cost per micro batch (``forward_s``, half of it: the update counts
    two), ``mfu_train`` per token through the linear layers, ``mfu_attention`` per query-key pair; and an AdamW step
    over the model (``optimizer_bw``, bytes of its states per second). Token ids below ``vocab``."""
    import torch

    from trl_nrollout.plan.cost import OPTIMIZER_BYTES_PER_PARAM

    def train_step(batch: int, length: int) -> float:
        ids = torch.randint(5, vocab, (batch, length), device=device)
        mask = torch.ones_like(ids)
        mask[:, -1] = 0  # a padded row, as the trainer's: attention under a mask, every query-key pair computed

        def run():
            policy.zero_grad(set_to_none=True)
            policy(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

        return _median_time(run, repeats=3, on=policy)

    shapes = [(2 * rows, 64), (4 * rows, long // 4), (rows, long)]  # the last two: the same tokens
    (ta, tb, tc) = (train_step(*shape) for shape in shapes)
    (na, nb, _) = (b * length for b, length in shapes)
    (pa, pb, pc) = (b * length * length for b, length in shapes)
    per_pair = max((tc - tb) / (pc - pb), 1e-15)
    per_token = max((tb - per_pair * pb - (ta - per_pair * pa)) / (nb - na), 1e-12)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-7)
    optimizer_t = _median_time(optimizer.step, repeats=3, on=policy)  # its kernels too, not their launch
    return {"mfu_train": min(1.0, 3 * 2 * dims.matmul_params / flops / per_token),
            "mfu_attention": min(1.0, 3 * dims.attention_flops_per_pair / flops / per_pair),
            "forward_s": max(ta - na * per_token - pa * per_pair, 0.0) / 2,
            "optimizer_bw": dims.num_parameters * OPTIMIZER_BYTES_PER_PARAM / max(optimizer_t, 1e-9),
            "seconds_per_token": per_token, "seconds_per_pair": per_pair}
