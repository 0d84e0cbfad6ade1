"""``plan --predict`` with Ulysses sequence parallelism (``sequence_parallel_size = S``): each rank of a group computes
and holds 1/S of its group's tokens, pays the all-to-alls, and a sharded trainer still shards over every rank. Pure:
a known model config and a datasheet profile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.plan.cost import all_to_all_s, predict_step
from trl_nrollout.plan.devices import PROFILES
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.models import model_dims
from trl_nrollout.plan.workload import Workload

SEVEN_B = "Qwen/Qwen2.5-7B-Instruct"


def _pred(sp: int, sharded: bool = True, checkpointing: bool = True):
    dims = model_dims(SEVEN_B)
    layout = RolloutLayout.build(num_processes=8, train_batch_size=16, rollout_n=8, sequence_parallel_size=sp,
                                 ppo_micro_batch_size_per_device=2)
    work = Workload(prompt_len=512, completion_mean=8192, completion_max=16384, sharded=sharded,
                    gradient_checkpointing=checkpointing)
    return dims, predict_step(dims, layout, work, PROFILES["h100"])


@settings(max_examples=20, deadline=None)
@given(sp=st.sampled_from([2, 4]), sharded=st.booleans(), checkpointing=st.booleans())
def test_a_group_splits_its_tokens_and_pays_the_all_to_alls(sp, sharded, checkpointing):
    """Against S = 1 on the same 8 devices and micro batch: the update's activations per device are 1/S, the trainer's
    states are the same (sharded over every rank, or whole), and the update costs what S = 1 costs plus the
    all-to-alls (the same tokens per device)."""
    dims, one = _pred(1, sharded, checkpointing)
    _, many = _pred(sp, sharded, checkpointing)
    assert many.activation_bytes == pytest.approx(one.activation_bytes / sp, rel=1e-6)
    assert many.train_bytes == one.train_bytes
    a2a = many.details["all_to_all_s"]
    assert one.details["all_to_all_s"] == 0 and a2a > 0
    tokens = many.details["update_tokens_per_rank"]
    assert a2a == pytest.approx(all_to_all_s(dims, tokens, sp, PROFILES["h100"]) * (3 if checkpointing else 2),
                                rel=1e-9)  # the update's only (skip_old_on_policy, no reference pass)
    extra_forwards = (many.details["micro_steps"] - one.details["micro_steps"]) * (2 * PROFILES["h100"].forward_s + 2 * (
        dims.num_parameters * dims.dtype_bytes * 7 / 8 / (PROFILES["h100"].link_bw * PROFILES["h100"].link_eff)
        if sharded else 0.0))
    assert many.phases["update"] == pytest.approx(one.phases["update"] + a2a + extra_forwards, rel=1e-6)


def test_plan_prints_the_groups_share():
    import io
    from contextlib import redirect_stdout

    from trl_nrollout.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        main(["plan", "--model", SEVEN_B, "--num-processes", "8", "--train-batch-size", "16", "--rollout-n", "8",
              "--device", "h100", "--predict", "--no-memory", "--max-completion-length", "16384",
              "--sequence-parallel-size", "2", "--ppo-micro-batch-size-per-device", "2"])
    assert "sequence parallel  2 ranks per group (Ulysses): each computes and holds 1/2" in out.getvalue()


def test_suggest_proposes_sequence_parallelism_where_a_sample_fits_no_device_whole(capsys, tmp_path):
    """A 32k-token sample of a 0.5B model on 4 GiB devices beside an engine that stays awake (the recipe's
    vllm_enable_sleep_mode false): no layout fits with whole samples per device (ZeRO-3 and its optimizer offload
    included, at each engine fraction searched); split over 2 ranks it does, and --suggest says so and gives the
    launch. Left to the trainer, the engine sleeping gives the trainer the whole device and whole samples fit."""
    import re

    from trl_nrollout.cli import main

    awake = tmp_path / "awake.yaml"
    awake.write_text("vllm_enable_sleep_mode: false\n")
    args = ["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--num-processes", "2", "--train-batch-size", "2",
            "--rollout-n", "2", "--device", "h100", "--gpu-memory-gib", "4", "--suggest", "--max-prompt-length", "512",
            "--max-completion-length", "32000", "--prompt-tokens-mean", "300", "--completion-tokens-mean", "20000"]
    main([*args, "--config", str(awake)])
    out = capsys.readouterr().out
    fit = int(re.search(r"\((\d+) fit,", out).group(1))
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+ ", line)]
    assert fit >= 1 and len(rows) == fit and all("zero3_offload sp2" in line for line in rows), out
    assert "--sequence_parallel_size 2" in out and "--vllm_enable_sleep_mode" not in out
    assert "no layout fits with whole samples on each device: sequence_parallel_size=2" in out
    main([*args, "--config", str(awake), "--sequence-parallel-size", "1"])  # S fixed by the user: not searched
    assert "(0 fit," in capsys.readouterr().out
    main(args)  # sleep mode searched: whole samples fit while the engine sleeps, no split needed
    out = capsys.readouterr().out
    assert "sp2" not in out and "--vllm_enable_sleep_mode true" in out
