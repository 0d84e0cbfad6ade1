"""Partial rollouts in training runs (the recipe, one process and two ZeRO-3 processes sharing a TP=2 engine): steps
stop before their slowest samples, and a checkpoint taken with samples in flight resumes to the same steps.

In a module of its own: tests/test_partial.py holds a vLLM engine in this process for its module, and vLLM runs one
engine per process.
"""

from __future__ import annotations

import pytest

# ---------------------------------------------------------------------------------------------- training runs
#: the long-tail model with the recipe: 4 prompts x 4 samples a step, completions up to 64 tokens
PARTIAL = ["--model_name_or_path", "builtin:tiny-qwen2-longtail", "--rollout_partial", "true", "--max_staleness", "1",
           "--max_completion_length", "64", "--train_batch_size", "4", "--rollout_n", "4", "--learning_rate", "5e-3",
           "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
           "--reward_funcs", "digits"]  # (not the default's short_answer: long samples must stay in flight)


def _pool(checkpoint, rank: int = 0) -> list[dict]:
    import json

    return json.loads((checkpoint / f"nrollout_partial_rank{rank}.json").read_text())


def _check_partial_run(run: dict, max_staleness: int = 1) -> None:
    steps = run["steps"]
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    assert sum(h["partial/aborted_samples"] for h in steps) > 0  # steps stopped before their slowest samples
    assert all(h["partial/staleness_max"] <= max_staleness for h in steps)
    assert any(h["partial/staleness_max"] > 0 for h in steps)  # samples continued across a weight sync trained
    # stale tokens are corrected by default (decoupled_loss: each token's loss x min(pi_prox / pi_behav, 2))
    assert all(0 < h["rollout_corr/is_weight_mean"] <= 2 for h in steps)
    assert any(h["rollout_corr/is_weight_mean"] != 1.0 for h in steps)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["one_process", pytest.param("zero3_tp2", marks=pytest.mark.multiprocess),
                                  pytest.param("ddp_balanced", marks=pytest.mark.multiprocess)])
def test_partial_rollouts_train_and_resume_with_samples_in_flight(mode, tmp_path):
    """Partial rollouts on the long-tail model: steps stop before their slowest samples, which continue after the
    weight sync (staleness within max_staleness=1). The checkpoint at step 2 holds the samples in flight (tokens,
    log-probs, versions); resuming from it trains steps 3-4 exactly as the uninterrupted run did, which it could
    not if the pool were lost (other groups would train). One process, and two ZeRO-3 processes sharing one
    engine of TP=2 (every rank of the engine holds its pool) with DAPO's filter_groups, whose extra rounds continue
    samples aborted earlier in the same step. ``ddp_balanced``: two processes, two engines pulling the job's pool
    (new groups and those in flight) from one balanced queue; every rank holds, and saves, the job's pool (after the
    resume, the values that do not depend on which groups finish first across engines, a matter of timing, are
    compared. Mutation tried: the checkpoint's pool not loaded -> the resumed step 3 trains fresh samples only,
    staleness_max 0 against 1)."""
    import shutil

    from tests.conftest import assert_resumed, launch

    # TP=2 with DAPO's dynamic sampling: its extra rounds run the pool on right after an abort, without the weight
    # sync's prefix-cache reset in between (the ranks' caches must agree there; see docs/partial.md)
    config, extra = ((None, []) if mode == "one_process" else
                     ("zero3_cpu.yaml", ["--rollout_tp_size", "2", "--filter_groups", "true"]))
    procs = 2 if mode == "ddp_balanced" else 1
    if mode == "ddp_balanced":
        extra = ["--rollout_dispatch", "balanced", "--rollout_max_num_seqs", "4"]
    full = launch(tmp_path / "full", *PARTIAL, *extra, config=config, procs=procs)
    _check_partial_run(full)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    ranks = 1 if mode == "one_process" else 2
    pools = [_pool(checkpoint, r) for r in range(ranks)]
    assert all(p == pools[0] for p in pools)  # the ranks of one engine hold the same pool
    in_flight = [s for g in pools[0] for s in g["samples"] if s["finish_reason"] is None and s["token_ids"]]
    assert in_flight and all(len(s["versions"]) == len(s["token_ids"]) == len(s["logprobs"]) for s in in_flight)
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-2")
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    resumed = launch(tmp_path / "resumed", *PARTIAL, *extra, "--resume_from_checkpoint", str(checkpoint),
                     config=config, procs=procs)
    if mode == "zero3_tp2":
        assert sum(h["dynamic_sampling/rounds"] for h in full["steps"]) > 0  # extra rounds ran after aborts
    if mode == "ddp_balanced":  # which of the job's groups finish first across two engines depends on timing: the
        # resumed run continues the saved job pool (every rank's copy) but need not train the same groups; what does
        # not depend on it is compared: the scheduler's rate, the pool's size after each step, and that step 3 trains
        # samples begun under older weights (the checkpoint's samples in flight). Step 4's staleness depends on which
        # groups step 3 took (a full run gave 1 where its resumed run gave 0 once), so it is not compared.
        assert_resumed(full, resumed, checkpoint, keys=("learning_rate", "partial/pool_groups"))
        third = [next(h for h in run["steps"] if h["step"] == 3) for run in (full, resumed)]
        assert [h["partial/staleness_max"] for h in third] == [1.0, 1.0], third
        _check_partial_run({"steps": full["steps"][:2] + resumed["steps"][-2:]})
        assert all(_pool(tmp_path / "resumed" / "checkpoint-4", r) == _pool(tmp_path / "resumed" / "checkpoint-4")
                   for r in range(2))
        return
    assert_resumed(full, resumed, checkpoint, keys=("reward", "loss", "partial/aborted_samples",
                                                    "partial/staleness_mean", "completions/mean_length"))


@pytest.mark.slow
@pytest.mark.vllm
def test_ppo_trains_on_partial_rollouts(tmp_path):
    """PPO (a critic, GAE, n = 1) on the same partial rollout stage: its steps stop before their slowest samples,
    samples continued across a weight sync train (staleness within the bound), and the critic's values and loss
    stay finite on them (the critic values every token of a continued sample under the current critic)."""
    import math

    from tests.conftest import launch

    options = [o for o in PARTIAL if o not in ("--save_strategy", "steps", "--save_steps", "2")]
    options[options.index("--rollout_n") + 1] = "1"
    options[options.index("--train_batch_size") + 1] = "8"
    run = launch(tmp_path / "ppo", *options, "--trainer", "ppo", "--adv_estimator", "gae", "--save_strategy", "no")
    _check_partial_run(run)
    assert all(math.isfinite(h["critic/vf_loss"]) and math.isfinite(h["loss"]) for h in run["steps"])


@pytest.mark.slow
@pytest.mark.vllm
def test_dapo_dynamic_sampling_on_partial_rollouts(tmp_path):
    """filter_groups with rollout_partial: groups whose samples all scored alike are filtered as they finish, and
    DAPO's extra rounds run the pool on with fresh prompts (the filtered groups' slots refilled at once), until
    the step has its groups with a spread of scores (no filler groups needed), staleness still within the bound."""
    from tests.conftest import launch

    options = [o for o in PARTIAL if o not in ("--save_strategy", "steps", "--save_steps", "2")]
    run = launch(tmp_path / "dapo", *options, "--filter_groups", "true", "--save_strategy", "no")
    _check_partial_run(run)
    steps = run["steps"]
    assert sum(h["dynamic_sampling/filtered_groups"] for h in steps) > 0
    assert sum(h["dynamic_sampling/rounds"] for h in steps) > 0
    assert all(h["dynamic_sampling/filler_groups"] == 0 for h in steps if h["dynamic_sampling/rounds"] < 3)


@pytest.mark.slow
@pytest.mark.vllm
def test_remax_takes_its_greedy_baselines_for_the_groups_a_partial_rollout_trains(tmp_path, monkeypatch):
    """ReMax on partial rollouts: each step trains the groups that finished first (some started steps earlier),
    and the greedy baselines are generated for exactly those groups' prompts, not for the step's new prompts
    (a reward function records the prompts of every call: the samples' call, then the greedy call)."""
    import json

    from tests.conftest import launch

    log = tmp_path / "prompts.jsonl"
    monkeypatch.setenv("NROLLOUT_TEST_PROMPT_LOG", str(log))
    options = [o for o in PARTIAL if o not in ("--save_strategy", "steps", "--save_steps", "2")]
    options[options.index("--max_steps") + 1] = "3"
    run = launch(tmp_path / "remax", *options, "--adv_estimator", "remax", "--save_strategy", "no",
                 "--reward_funcs", "tests.assets.rewards_for_tests:digits_recording_prompts")
    assert sum(h["partial/aborted_samples"] for h in run["steps"]) > 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * len(run["steps"])  # per step: the samples, then one greedy completion per prompt
    for sampled, greedy in zip(calls[::2], calls[1::2]):
        assert sampled[::4] == greedy  # n = 4 samples per prompt; the baselines' prompts are the trained ones
