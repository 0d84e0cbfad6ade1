"""The paths that differ on GPUs and across nodes, pinned on CPU: engine arguments per platform, the order of vLLM's
sleep / wake / weight-reload calls, the NCCL barrier before TP>1 generation, sampling seeds, prompt-length errors,
device placement of the KL-in-reward, and the launcher's node count and ranks.

vLLM's sleep mode and NCCL exist only on CUDA: those tests drive a recording stand-in for ``vllm.LLM`` (and for
``torch.distributed.barrier``) and assert the exact calls our engine group makes; vLLM's own side of those calls
was checked by reading its 0.32 sources (docs/backends.md).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.algos.advantages import response_mask
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.engines import platform
from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
from trl_nrollout.rollout.engines.vllm_settings import engine_kwargs
from trl_nrollout.rollout.seeds import SEED_BITS, prompt_seed, step_seed
from trl_nrollout.rollout.types import SamplingOptions
from trl_nrollout.trainer.advantage_stage import sequence_kl

LAYOUT = RolloutLayout.build(num_processes=2, rollout_tp_size=2, train_batch_size=64, rollout_n=16)  # 1024 samples


# ---------------------------------------------------------------------------------------------- engine arguments
def test_cuda_engine_always_gets_gpu_memory_utilization(tiny_model_path):
    """With a KV size given, vLLM's default 0.92 would apply to its start-up check and fail beside the training
    model: the fraction is passed either way."""
    for kv in (None, 2 << 30):
        kw = engine_kwargs(tiny_model_path, LAYOUT, cpu=False, kv_cache_memory_bytes=kv, gpu_memory_utilization=0.35)
        assert kw["gpu_memory_utilization"] == 0.35
        assert kw.get("kv_cache_memory_bytes") == kv
        assert "enable_chunked_prefill" not in kw  # chunked prefill stays on where generators have offsets


def test_cpu_engine_never_chunks_a_prefill(tiny_model_path):
    kw = engine_kwargs(tiny_model_path, LAYOUT, cpu=True, max_model_len=6000)
    assert kw["enable_chunked_prefill"] is False
    assert kw["max_num_batched_tokens"] >= 6000  # vLLM requires budget >= max_model_len without chunking
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True and kw["kv_cache_memory_bytes"] >= 16 << 20
    # each of a prompt's n samples recomputes its last partial KV block: the smallest block vLLM's CPU attention takes
    assert kw["block_size"] == 32
    assert "block_size" not in engine_kwargs(tiny_model_path, LAYOUT, cpu=False)  # CUDA keeps vLLM's own (16)


def test_max_num_seqs_is_capped(tiny_model_path):
    """1024 samples per engine would mean 1024 rows of [vocab] float32 sampler buffers; the cap bounds them."""
    big = RolloutLayout.build(num_processes=1, train_batch_size=512, rollout_n=16)  # 8192 samples, one engine
    assert engine_kwargs(tiny_model_path, big, cpu=False)["max_num_seqs"] == DEFAULT_MAX_NUM_SEQS
    small = RolloutLayout.build(num_processes=1, train_batch_size=4, rollout_n=4)
    assert engine_kwargs(tiny_model_path, small, cpu=False)["max_num_seqs"] == 16
    assert engine_kwargs(tiny_model_path, big, cpu=True, max_num_seqs=64)["max_num_seqs"] == 64


def test_cpu_kv_default_follows_expected_length_not_the_context(tiny_model_path):
    long_ctx = engine_kwargs(tiny_model_path, LAYOUT, cpu=True, max_model_len=1024, expected_len=64)
    full = engine_kwargs(tiny_model_path, LAYOUT, cpu=True, max_model_len=1024)
    assert long_ctx["kv_cache_memory_bytes"] < full["kv_cache_memory_bytes"]


# ---------------------------------------------------------------------------------------------- sleep, wake, reload
class _Recorder:
    """Stands in for ``vllm.LLM`` and its model runner (sleep mode needs CUDA); records every call."""

    def __init__(self):
        self.calls: list[tuple] = []
        runner = self

        class _Worker:
            model_runner = runner

        class _Executor:
            driver_worker = _Worker()

        class _Engine:
            model_executor = _Executor()

            class model_config:  # noqa: N801 - vLLM's attribute name
                is_multimodal_model = False

            @staticmethod
            def reset_encoder_cache():
                runner.calls.append(("reset_encoder_cache",))

            @staticmethod
            def add_request(request_id, prompt, params):  # the engine loop's first call when it generates
                runner.calls.append(("add_request",))
                raise _Stop

        self.llm_engine = _Engine()
        self.request_counter = itertools.count()
        self.engine_model = None  # set by a test that syncs weights

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def get_model(self):
        """The engine's model (a stand-in: the checkpoint's own modules, which have every name it may receive)."""
        return self.engine_model

    def reload_weights(self, weights_iterator=None):
        names = [n for n, _ in weights_iterator]
        self.calls.append(("reload_weights", len(names)))


class _Stop(Exception):
    pass


def _group(cpu: bool, sleep: bool) -> VLLMEngineGroup:
    g = object.__new__(VLLMEngineGroup)
    layout = RolloutLayout.build(num_processes=1, train_batch_size=2, rollout_n=2)
    g.layout, g.rank, g.local_rank, g.engine_index, g.tp_ranks = layout, 0, 0, 0, (0,)
    g.cpu, g.enable_sleep_mode, g._asleep, g._tp_group, g._dist = cpu, sleep, set(), None, False
    g.weight_bucket_bytes, g.max_model_len = 1 << 16, 64
    g.llm = _Recorder()
    return g


def test_cuda_weight_sync_wakes_weights_then_loads_then_wakes_kv(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    g = _group(cpu=False, sleep=True)
    g.sleep()
    g.llm.engine_model = model
    stats = g.load_weights(model)
    calls = g.llm.calls
    assert calls[0] == ("sleep", 1)
    assert calls[1] == ("wake_up", ("weights",))
    reloads = [c for c in calls if c[0] == "reload_weights"]
    # one reload_weights call (not load_weights) fed every bucket of whole layers in turn
    assert len(reloads) == 1 and stats["buckets"] >= 3
    assert reloads[0][1] == len(dict(model.named_parameters(remove_duplicate=False)))  # every tensor, tied ones too
    assert calls[-2:] == [("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    assert not g.sleeping
    g.sleep()
    with pytest.raises(_Stop):  # generating again without a sync wakes everything first
        g.generate_engine([[1, 2]], 2, SamplingOptions(max_tokens=4))
    assert g.llm.calls[-3:] == [("sleep", 1), ("wake_up", ("kv_cache", "weights")), ("add_request",)]


def test_a_vision_language_engine_forgets_its_image_features_after_a_weight_sync(tiny_model_path):
    """vLLM caches the vision tower's outputs per image: after new weights they are stale, and the reload empties
    the runner's side of the cache (the scheduler's side must forget too, or the next image is a cache miss)."""
    from transformers import AutoModelForCausalLM

    g = _group(cpu=True, sleep=False)
    g.llm.llm_engine.model_config.is_multimodal_model = True
    try:
        g.llm.engine_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        g.load_weights(g.llm.engine_model)
    finally:
        g.llm.llm_engine.model_config.is_multimodal_model = False
    assert g.llm.calls[-2:] == [("reset_prefix_cache",), ("reset_encoder_cache",)]


def test_cpu_sleep_is_a_no_op_and_weights_still_reload(tiny_model_path):
    from transformers import AutoModelForCausalLM

    g = _group(cpu=True, sleep=False)
    g.sleep()
    g.llm.engine_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    g.load_weights(g.llm.engine_model)
    assert [c[0] for c in g.llm.calls if c[0] != "reload_weights"] == ["reset_prefix_cache"]


def test_barrier_before_tp_generation_on_gpus_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: seen.append(k))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    g = _group(cpu=False, sleep=False)
    g._dist, g.local_rank = True, 3
    g.layout = RolloutLayout.build(num_processes=2, rollout_tp_size=2, train_batch_size=2, rollout_n=2)
    g.barrier_before_generate()
    assert seen == [{"device_ids": [3]}]
    g.cpu = True
    g.barrier_before_generate()
    g.cpu, g.layout = False, RolloutLayout.build(num_processes=2, rollout_tp_size=1, train_batch_size=2, rollout_n=2)
    g.barrier_before_generate()
    assert len(seen) == 1


def test_a_prompt_too_long_for_the_engine_is_a_clear_error():
    g = _group(cpu=True, sleep=False)
    with pytest.raises(ValueError, match=r"60 tokens \+ max_completion_length=8 exceeds.*rollout_max_model_len"):
        g.generate_engine([[1] * 60], 2, SamplingOptions(max_tokens=8))
    assert not g.llm.calls  # refused before vLLM sees it


# ---------------------------------------------------------------------------------------------- seeds
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(0, 10**6), n=st.integers(1, 64), prompts=st.integers(1, 600))
def test_no_two_samples_of_a_call_share_a_seed(seed, step, n, prompts):
    base = step_seed(seed, step)
    assert 0 <= base < 2**SEED_BITS
    seeds = [prompt_seed(base, g, n) + k for g in range(prompts) for k in range(n)]  # vLLM's child seeds
    assert len(set(seeds)) == len(seeds)
    assert max(seeds) < 2**63  # vLLM keeps seeds as int64


def test_step_seeds_do_not_repeat_across_steps_rounds_and_modes():
    bases = {step_seed(0, s, r, m) for s in range(5000) for r in range(3) for m in ("train", "eval")}
    assert len(bases) == 5000 * 3 * 2
    # the old scheme (seed + 101 * step + g) repeated: step 1, prompt 0 == step 0, prompt 101
    assert step_seed(0, 1) != step_seed(0, 0) + 101
    assert step_seed(7, 3) == step_seed(7, 3)  # reproducible (resume)


# ---------------------------------------------------------------------------------------------- devices
def test_kl_in_reward_stays_on_the_training_device():
    """On the meta device any tensor built on the CPU and mixed in raises, as a CPU/CUDA mix does on a GPU."""
    old = torch.zeros(3, 5, device="meta")
    ref = torch.zeros(3, 5, device="meta")
    out = sequence_kl(old, ref, response_mask([[1, 2], [3], [4, 5, 6, 7, 8]], [None] * 3, 5), "k3")  # CPU mask
    assert out.device.type == "meta" and out.shape == (3,)
    # the second sample's middle token is a tool result: not sampled by the policy, no KL
    mask = response_mask([[1], [1, 2, 3]], [None, [1, 0, 1]], 3)
    real = sequence_kl(torch.log(torch.full((2, 3), 0.5)), torch.log(torch.full((2, 3), 0.25)), mask, "kl")
    assert real.tolist() == pytest.approx([math.log(2), 2 * math.log(2)], abs=1e-6)  # masked sum of log(0.5 / 0.25)


# ---------------------------------------------------------------------------------------------- launcher
def test_launch_nodes_from_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert platform.launch_nodes(4) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert platform.launch_nodes(4) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE=3 does not divide the 4 processes"):
        platform.launch_nodes(4)


def test_ranks_for_vllm_come_from_accelerate_when_the_launcher_set_none(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for key in ("RANK", "LOCAL_RANK"):  # setenv first: monkeypatch then restores the variables (or their absence)
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    platform.ensure_dist_env(5, 1)
    assert os.environ["RANK"] == "5" and os.environ["LOCAL_RANK"] == "1"
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 in the environment but this process is local_rank 0"):
        platform.ensure_dist_env(5, 0)


# ---------------------------------------------------------------------------------------------- engine start
def test_a_start_memory_check_names_the_setting_and_the_shortfall():
    """The checks made on each rank before any collective (``EngineSetup.start``): vLLM's start-up memory request on a
    GPU (``vllm_gpu_memory_utilization`` of the total must be free), the KV cache against the memory available on
    the CPU."""
    from trl_nrollout.trainer.engines import by_rank, memory_refusal

    gib = 2 ** 30
    assert memory_refusal(cpu=False, free=40 * gib, total=80 * gib, utilization=0.5, kv_bytes=None, where="GPU 0") is None
    why = memory_refusal(cpu=False, free=30 * gib, total=80 * gib, utilization=0.5, kv_bytes=None, where="GPU 3")
    assert "30.0 GiB free of 80.0 GiB on GPU 3" in why and "vllm_gpu_memory_utilization=0.5" in why
    assert memory_refusal(cpu=True, free=8 * gib, total=16 * gib, utilization=0.9, kv_bytes=gib, where="m") is None
    why = memory_refusal(cpu=True, free=8 * gib, total=16 * gib, utilization=0.3, kv_bytes=9 * gib, where="m")
    assert "rollout_kv_cache_memory_bytes=" in why and "9.0 GiB" in why and "8.0 GiB available" in why
    assert by_rank([(1, "b"), (0, None), (2, "b"), (3, "c")], 4) == "ranks 1, 2: b; rank 3: c"
    assert by_rank([(0, "a")], 1) == "a"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_an_engine_start_that_fails_on_one_rank_never_hangs_the_others(tmp_path):
    """Two CPU processes, one vLLM engine at TP=2, rollout_backend='auto' (tests/assets/engine_start_one_rank.py):
    a KV cache setting only rank 1 gets, larger than the machine, is refused before any collective and both ranks
    fall back alike (and train), or stop alike under 'vllm', naming rank 1 (vLLM's own check found it on rank 1
    alone, inside its memory all-reduce over every rank: the launch hung, rank 1 in the verdicts' gather); a
    failure on both ranks inside the engine's collectives still falls back alike; one on rank 1 only (injected in
    the script: a stand-in for the CUDA failures a CPU cannot produce) stops the job with an error naming rank 1
    and the reason, instead of hanging (rank 0 waits in vLLM's collective). A hang fails the test at the timeout.
    Shown failing: with each rank's check decided alone (its verdict not gathered) case 1 hangs; with a failed
    rank going straight to the gather (the old code) case 4 hangs."""
    import json
    import subprocess

    from tests.conftest import ACCELERATE_LAUNCH, ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"}
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2",
                           str(ROOT / "tests/assets/engine_start_one_rank.py"), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "case 4 started its engine" not in output, output[-4000:]
    assert "rank 1 could not start its vLLM engine" in output and "injected on rank 1" in output, output[-4000:]
    assert "did not report within 15 s" in output and "rollout_backend='hf'" in output
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        first = result["preflight"]
        assert first["backend"] == "hf" and first["engine"] == "HFEngine" and first["steps"] == 1
        assert len(first["warnings"]) == 1 and "(rank 1: the engine's KV cache of" in first["warnings"][0]
        assert "rank 1: " in result["vllm"] and "rollout_kv_cache_memory_bytes" in result["vllm"]
        assert result["alike"]["backend"] == "hf" and len(result["alike"]["warnings"]) == 1
        assert "ranks 0, 1: " in result["alike"]["warnings"][0] and "head_dim=24" in result["alike"]["warnings"][0]


def test_only_this_ranks_stale_cpu_shm_segment_is_removed(tmp_path):
    """vLLM's CPU TP segments are named by the run's identity (its first rank's pid, alive: this process), the
    group's ranks and the rank's index: a rank removes its own leftover name, nothing of another rank or group of
    its run, nor a name of another form (vLLM's shared one of other programs). Mutation: the index left out of the
    pattern -> rank 1's segment is removed too."""
    from trl_nrollout.rollout.engines.cpu_shm import remove_stale_cpu_shm, shm_identity

    ident = shm_identity(os.getpid())
    names = [f"{ident}-tp:0-[0-1]-cpushm_0", f"{ident}-tp:0-[0-1]-cpushm_1", f"{ident}-tp:3-[2-3]-cpushm_0",
             f"{ident}-tp:0-[0-1-2]-cpushm_0", "-tp:0-[0-1]-cpushm_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_cpu_shm(ident, [0, 1], 0, folder=str(tmp_path))
    assert [p.split("/")[-1] for p in removed] == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
