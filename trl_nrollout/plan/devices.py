"""Device profiles for the step's cost model (:mod:`trl_nrollout.plan.cost`): what a device can do at best, and
how much of it a rollout or a training step reaches.

The named GPU profiles hold the vendor's datasheet figures (dense, no sparsity), cited per profile. The efficiency
factors and fixed costs are ours: typical fractions of peak for vLLM decode and for a training step, to be replaced
by a calibrated profile where one exists (``trl-nrollout plan --calibrate`` measures this machine and saves one).
No torch at import.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

TFLOPS = 1e12
GBPS = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One device (one rank of the job) for the cost model.

    Peaks: ``flops`` (dense FLOP/s at the dtype the step runs in: bf16 on GPUs, float32 on a CPU), ``mem_bw``
    (device memory, B/s), ``link_bw`` (between the devices of a node, per direction, B/s: TP all-reduces, ZeRO-3
    gathers), ``memory_gib``. Efficiencies (fractions of a peak reached): ``mfu_prefill`` (prefill and decode
    matmuls), ``mfu_train`` (training forwards and backwards), ``bw_eff`` (decode's weight and KV reads),
    ``link_eff``; ``node_link_bw`` (per device between nodes, per direction, B/s: a trainer's gradient reduce and
    gathers when it spans nodes; None: as ``link_bw``). Fixed costs, seconds: ``step_s`` per engine step (scheduler, sampler, Python), ``seq_step_s`` per
    running sequence per engine step beyond the roofline (sampling, output processing: large on a CPU),
    ``call_s`` per generation call, ``forward_s`` per training forward (launches, hooks), ``sync_s`` per weight
    sync, ``allreduce_s`` latency of one TP all-reduce. ``sync_bw`` the weight sync's B/s (None: half of
    ``mem_bw x bw_eff``, a read and a write); ``optimizer_bw`` the optimizer step's B/s over its states (None:
    ``mem_bw x bw_eff``). The rollout ranks' weight transfer (trainer rank 0's device -> its host -> the rollout
    ranks' hosts over gloo -> their devices): ``host_bw`` a device's copy to or from host memory, per direction, B/s
    (the PCIe link; None: ``mem_bw x bw_eff``, a CPU's copy is a memcpy); ``gloo_bw`` one host-to-host stream of
    gloo's TCP transport, B/s (on one node through the loopback; between nodes also at most ``node_link_bw``;
    5 GB/s assumed, not a datasheet figure: set it in a profile where measured); ``host_optimizer_bw`` the B/s over
    its states of an optimizer step offloaded to the host (ZeRO-Offload's CPU Adam, one device's share of its host:
    10 GB/s assumed).
    What a trainer adds around the engine and the model (calibrated; 0 in the datasheet
    profiles): ``gen_sample_s`` per sample in the generation phase (requests in and out, bookkeeping),
    ``train_sample_s`` per sample and ``train_token_s`` per token per update epoch (the loss's work beyond the
    matmuls, masks, metrics; a CPU's first touch of fresh activation memory), ``train_fixed_s`` per optimizer step
    (clipping, the step's bookkeeping). ``mfu_attention``: the training passes' efficiency on attention's
    query-key pairs (None: ``mfu_train``; a CPU's attention kernels under a mask run below its matmuls). ``source`` says where the figures come
    from."""

    name: str
    flops: float
    mem_bw: float
    link_bw: float
    memory_gib: float
    mfu_prefill: float = 0.5
    mfu_train: float = 0.4
    bw_eff: float = 0.7
    link_eff: float = 0.7
    node_link_bw: float | None = None
    step_s: float = 0.004
    seq_step_s: float = 0.0
    call_s: float = 0.05
    forward_s: float = 0.004
    sync_s: float = 0.1
    allreduce_s: float = 2e-5
    sync_bw: float | None = None
    optimizer_bw: float | None = None
    gen_sample_s: float = 0.0
    train_sample_s: float = 0.0
    train_fixed_s: float = 0.0
    mfu_attention: float | None = None
    train_token_s: float = 0.0
    #: the training forwards' attention takes a packed row's sequences by their boundaries (varlen: a CUDA device in
    #: half precision, PyTorch's flash kernel or flash-attention's), so padding-free rows cost each sequence's pairs
    #: only and need no mask; False: a block mask over each row (SDPA computes its ``L x L`` pairs), as on a CPU
    varlen_attention: bool = False
    host_bw: float | None = None
    gloo_bw: float = 5 * GBPS
    host_optimizer_bw: float = 10 * GBPS
    #: the engines' generation time when they serve a LoRA adapter of rank ``lora_gen_rank`` themselves
    #: (``rollout_lora_sync="adapter"``: vLLM's LoRA kernels beside every targeted layer) over the same rollout on
    #: merged weights; other ranks by :meth:`lora_slowdown`. GPUs: 1.15 at rank 16 ASSUMED (not measured here: the
    #: lent GPU machine has no vLLM); ``plan --calibrate`` measures it on this machine's engine
    lora_gen_slowdown: float = 1.15
    lora_gen_rank: int = 16
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("flops", "mem_bw", "link_bw", "memory_gib", "gloo_bw", "host_optimizer_bw", "lora_gen_rank"):
            if not getattr(self, name) > 0:
                raise ValueError(f"device profile {self.name!r}: {name}={getattr(self, name)!r} must be > 0.")
        for name in ("mfu_prefill", "mfu_train", "bw_eff", "link_eff", "mfu_attention"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"device profile {self.name!r}: {name}={getattr(self, name)!r} must be in (0, 1].")
        for name in ("step_s", "seq_step_s", "call_s", "forward_s", "sync_s", "allreduce_s", "gen_sample_s",
                     "train_sample_s", "train_fixed_s", "train_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"device profile {self.name!r}: {name}={getattr(self, name)!r} must be >= 0.")
        if not self.lora_gen_slowdown >= 1:
            raise ValueError(f"device profile {self.name!r}: lora_gen_slowdown={self.lora_gen_slowdown!r} must be >= 1 "
                             "(generation with the LoRA kernels over generation on merged weights).")

    def lora_slowdown(self, rank: int) -> float:
        """Generation time with the engines serving a rank-``rank`` adapter over merged weights: the measured (or
        assumed) ``lora_gen_slowdown`` at ``lora_gen_rank``, its excess scaled by the rank (the kernels' extra work
        is ``r x (in + out)`` per targeted layer and token)."""
        return 1 + (self.lora_gen_slowdown - 1) * rank / self.lora_gen_rank

    @property
    def attention_mfu(self) -> float:
        """The training passes' efficiency on attention (``mfu_attention``, or ``mfu_train`` when not set)."""
        return self.mfu_attention if self.mfu_attention is not None else self.mfu_train

    @property
    def weight_sync_bw(self) -> float:
        return self.sync_bw if self.sync_bw is not None else self.mem_bw * self.bw_eff / 2

    @property
    def host_rate(self) -> float:
        """B/s of one copy between the device and host memory (``host_bw`` at ``link_eff``; a CPU: a memcpy)."""
        return self.host_bw * self.link_eff if self.host_bw is not None else self.mem_bw * self.bw_eff

    @property
    def optimizer_rate(self) -> float:
        return self.optimizer_bw if self.optimizer_bw is not None else self.mem_bw * self.bw_eff

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DeviceProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"device profile: unknown keys {unknown}; known: {sorted(known)}.")
        return cls(**data)


_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense, NVLink 600 GB/s (both directions)"
_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: BF16 989 TFLOPS dense, HBM3 3.35 TB/s, NVLink 900 GB/s"
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: BF16 989 TFLOPS dense, HBM3e 4.8 TB/s, NVLink 900 GB/s"
_NVIDIA_L40S = "NVIDIA L40S datasheet (2023): BF16 362 TFLOPS dense, GDDR6 864 GB/s, PCIe Gen4 x16 64 GB/s"

#: between nodes, per GPU and direction: the DGX systems' one InfiniBand port per GPU (DGX A100 datasheet: 8x
#: ConnectX-6 200 Gb/s HDR; DGX H100 / H200 datasheets: 8x ConnectX-7 400 Gb/s NDR); an L40S server has no reference
#: system: one 100 Gb/s port per GPU assumed
_IB_HDR, _IB_NDR, _ETH_100 = 200 / 8 * GBPS, 400 / 8 * GBPS, 100 / 8 * GBPS
#: a device's link to host memory, per direction (half the datasheets' bidirectional figure): PCIe Gen4 x16 64 GB/s
#: (A100, L40S), PCIe Gen5 x16 128 GB/s (H100 / H200 SXM)
_PCIE4, _PCIE5 = 32 * GBPS, 64 * GBPS

#: named profiles: datasheet peaks (link bandwidth per direction: half the datasheet's bidirectional figure)
PROFILES: dict[str, DeviceProfile] = {
    "a100-40gb": DeviceProfile("a100-40gb", varlen_attention=True, flops=312 * TFLOPS, mem_bw=1555 * GBPS, link_bw=300 * GBPS,
                               node_link_bw=_IB_HDR, host_bw=_PCIE4, memory_gib=40, source=_NVIDIA_A100 + "; HBM2 1,555 GB/s, 40 GB"),
    "a100-80gb": DeviceProfile("a100-80gb", varlen_attention=True, flops=312 * TFLOPS, mem_bw=2039 * GBPS, link_bw=300 * GBPS,
                               node_link_bw=_IB_HDR, host_bw=_PCIE4, memory_gib=80, source=_NVIDIA_A100 + "; HBM2e 2,039 GB/s, 80 GB"),
    "h100": DeviceProfile("h100", varlen_attention=True, flops=989 * TFLOPS, mem_bw=3350 * GBPS, link_bw=450 * GBPS, memory_gib=80,
                          node_link_bw=_IB_NDR, host_bw=_PCIE5,
                          source=_NVIDIA_H100 + ", 80 GB"),
    "h200": DeviceProfile("h200", varlen_attention=True, flops=989 * TFLOPS, mem_bw=4800 * GBPS, link_bw=450 * GBPS, memory_gib=141,
                          node_link_bw=_IB_NDR, host_bw=_PCIE5,
                          source=_NVIDIA_H200 + ", 141 GB"),
    "l40s": DeviceProfile("l40s", varlen_attention=True, flops=362 * TFLOPS, mem_bw=864 * GBPS, link_bw=32 * GBPS, memory_gib=48,
                          node_link_bw=_ETH_100, host_bw=_PCIE4,
                          source=_NVIDIA_L40S + ", 48 GB"),
}


def profiles_dir() -> Path:
    """Where calibrated profiles are saved: ``$TRL_NROLLOUT_PROFILES``, else ``~/.cache/trl_nrollout/profiles``."""
    env = os.environ.get("TRL_NROLLOUT_PROFILES")
    return Path(env) if env else Path.home() / ".cache" / "trl_nrollout" / "profiles"


def save_profile(profile: DeviceProfile, folder: Path | None = None) -> Path:
    folder = folder or profiles_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.name}.json"
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


def load_profile(name: str) -> DeviceProfile:
    """A named profile (:data:`PROFILES`), a saved one (by name, from :func:`profiles_dir`), or a JSON file."""
    if name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if not (path.suffix == ".json" and path.is_file()):
        path = profiles_dir() / f"{name}.json"
    if path.is_file():
        try:
            return DeviceProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as err:
            raise ValueError(f"device profile {str(path)!r} is not a valid profile: {err}") from None
    saved = sorted(p.stem for p in profiles_dir().glob("*.json")) if profiles_dir().is_dir() else []
    raise ValueError(f"device={name!r} is not a known profile: use one of {sorted(PROFILES)}"
                     + (f", a saved one ({', '.join(saved)})" if saved else "")
                     + ", a profile JSON file, or measure this machine with `trl-nrollout plan --calibrate`.")


def with_memory(profile: DeviceProfile, memory_gib: float | None) -> DeviceProfile:
    """The profile with another memory size (``--gpu-memory-gib``), or unchanged."""
    return profile if memory_gib is None else replace(profile, memory_gib=memory_gib)


def datasheet_profile(gpu_name: str, memory_gib: float) -> DeviceProfile | None:
    """The named profile of a CUDA device as torch names it (``torch.cuda.get_device_name``, e.g. ``"NVIDIA H100 80GB
    HBM3"``) with its memory, or None for a device :data:`PROFILES` does not hold."""
    name = gpu_name.lower()
    for key, match in (("h200", "h200"), ("h100", "h100"), ("l40s", "l40s")):
        if match in name:
            return PROFILES[key]
    if "a100" in name:
        return PROFILES["a100-80gb" if memory_gib > 60 else "a100-40gb"]
    return None
