"""PPO with a critic: GAE and the value loss against verl's definitions, the config rules, and end to end.

verl itself is not installed here (it pulls Ray and its worker stack); its two functions are restated below from
their documented definitions, loop by loop, as the reference:

- ``compute_gae_advantage_return``: for t = T-1..0, ``delta = r_t + gamma * V_{t+1} - V_t``,
  ``A_t = delta + gamma * lam * A_{t+1}`` (``V_T = A_T = 0``), returns ``A + V``, advantages whitened over the
  response tokens (mean and Bessel-corrected variance, ``rsqrt(var + 1e-8)``);
- ``compute_value_loss``: ``0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2))`` and the clip
  fraction ``mean(clipped term > unclipped)`` over the response tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.algos.advantages import compute_advantages, gae_advantages
from trl_nrollout.algos.losses import explained_variance, value_loss

FAST = settings(max_examples=30, deadline=None)


def _verl_gae(rewards: list[list[float]], values: list[list[float]], lengths: list[int], gamma: float, lam: float):
    adv = [[0.0] * len(r) for r in rewards]
    for i, (r, v, n) in enumerate(zip(rewards, values, lengths)):
        last = 0.0
        for t in reversed(range(n)):
            nxt = v[t + 1] if t + 1 < n else 0.0
            last = r[t] + gamma * nxt - v[t] + gamma * lam * last
            adv[i][t] = last
    returns = [[a + v for a, v in zip(ar, vr)] for ar, vr in zip(adv, values)]
    flat = [adv[i][t] for i, n in enumerate(lengths) for t in range(n)]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / max(len(flat) - 1, 1)
    white = [[(adv[i][t] - mean) / math.sqrt(var + 1e-8) if t < n else 0.0 for t in range(len(adv[i]))]
             for i, n in enumerate(lengths)]
    return white, [[returns[i][t] if t < n else 0.0 for t in range(len(adv[i]))] for i, n in enumerate(lengths)]


@st.composite
def _episodes(draw):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    lengths = [draw(st.integers(1, t)) for _ in range(b)]
    num = st.floats(-2, 2, allow_nan=False, width=32)
    rewards = [[draw(num) if j < n else 0.0 for j in range(t)] for n in lengths]
    values = [[draw(num) if j < n else 0.0 for j in range(t)] for n in lengths]
    return rewards, values, lengths, draw(st.sampled_from([1.0, 0.99, 0.5])), draw(st.sampled_from([1.0, 0.95, 0.0]))


def _tensors(rewards, values, lengths):
    t = len(rewards[0])
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), mask.double()


@FAST
@given(_episodes())
def test_gae_equals_verls_definition(case):
    rewards, values, lengths, gamma, lam = case
    r, v, mask = _tensors(rewards, values, lengths)
    adv, ret = gae_advantages(r, v, mask, gamma=gamma, lam=lam)
    want_adv, want_ret = _verl_gae(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    if sum(lengths) > 1 and len({x for row, n in zip(want_ret, lengths) for x in row[:n]}) > 1:
        torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


@FAST
@given(_episodes())
def test_gae_closed_forms(case):
    rewards, values, lengths, gamma, _ = case
    r, v, mask = _tensors(rewards, values, lengths)
    # lam = 1, gamma = 1: the return of every token is the sum of the rewards from it on, whatever the values
    _, ret = gae_advantages(r, v, mask, gamma=1.0, lam=1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(r * mask, [1]), 1), [1]) * mask
    torch.testing.assert_close(ret, to_go, rtol=1e-9, atol=1e-9)
    # lam = 0: one-step TD, A_t = r_t + gamma V_{t+1} - V_t (V past the end is 0)
    _, ret0 = gae_advantages(r, v, mask, gamma=gamma, lam=0.0)
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1) * torch.cat([mask[:, 1:], mask[:, :1] * 0], 1)
    torch.testing.assert_close(ret0 - v * mask, (r + gamma * v_next - v) * mask, rtol=1e-9, atol=1e-9)


def test_gae_skips_masked_positions_inside_a_response():
    """A tool result (masked) between two generated tokens neither adds a TD error nor cuts the chain."""
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.2, 0.5, 0.4]])
    gap_r = torch.tensor([[0.0, 9.0, 0.0, 1.0]])
    gap_v = torch.tensor([[0.2, -7.0, 0.5, 0.4]])
    _, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    _, gap_ret = gae_advantages(gap_r, gap_v, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(gap_ret[:, [0, 2, 3]], ret)
    assert gap_ret[0, 1] == 0


def test_gae_through_the_estimator_registry_needs_values():
    r, mask = torch.zeros(2, 3), torch.ones(2, 3)
    r[:, -1] = torch.tensor([1.0, 0.0])
    adv, ret = compute_advantages("gae", r, mask, [0, 1], values=torch.zeros(2, 3))
    torch.testing.assert_close(ret, torch.tensor([[1.0] * 3, [0.0] * 3]))
    assert adv[0, 0] > 0 > adv[1, 0]
    with pytest.raises(ValueError, match="needs the critic's values: train with NRolloutPPOTrainer"):
        compute_advantages("gae", r, mask, [0, 1])


def _verl_value_loss(vpreds, returns, old, mask, clip, mode, norm_length=None):
    rows = []
    worse_count, n_tok = 0, 0
    for i in range(len(vpreds)):
        row = []
        for t in range(len(vpreds[i])):
            if not mask[i][t]:
                continue
            clipped = min(max(vpreds[i][t], old[i][t] - clip), old[i][t] + clip)
            a, b = (vpreds[i][t] - returns[i][t]) ** 2, (clipped - returns[i][t]) ** 2
            row.append(max(a, b))
            worse_count += b > a
            n_tok += 1
        rows.append(row)
    full = [row for row in rows if row]
    if mode == "token-mean":
        loss = sum(sum(row) for row in full) / max(n_tok, 1)
    elif mode == "seq-mean-token-sum":
        loss = sum(sum(row) for row in full) / max(len(full), 1)
    elif mode == "seq-mean-token-mean":
        loss = sum(sum(row) / len(row) for row in full) / max(len(full), 1)
    else:  # seq-mean-token-sum-norm
        loss = sum(sum(row) for row in full) / (max(len(full), 1) * norm_length)
    return 0.5 * loss, worse_count / max(n_tok, 1)


@FAST
@given(_episodes(), st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                     "seq-mean-token-sum-norm"]), st.sampled_from([0.1, 0.5, 2.0]))
def test_value_loss_equals_verls_in_every_aggregation_mode(case, mode, clip):
    rewards, values, lengths, _, _ = case
    _, v, mask = _tensors(rewards, values, lengths)
    g = torch.Generator().manual_seed(len(lengths) * 7 + sum(lengths))
    vpreds = v + torch.randn(v.shape, generator=g, dtype=torch.float64)
    returns = v + torch.randn(v.shape, generator=g, dtype=torch.float64)
    extra = {"norm_length": v.shape[1]} if mode == "seq-mean-token-sum-norm" else {}
    loss, frac = value_loss(vpreds, returns, v, mask, clip, mode, **extra)
    want, want_frac = _verl_value_loss(vpreds.tolist(), returns.tolist(), v.tolist(), mask.tolist(), clip, mode,
                                       v.shape[1])
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert frac.item() == pytest.approx(want_frac, abs=1e-12)


def test_value_loss_gradient_stops_outside_the_clip_region():
    old = torch.zeros(1, 2)
    vpreds = torch.tensor([[2.0, 0.1]], requires_grad=True)
    returns = torch.tensor([[3.0, 0.0]])
    loss, frac = value_loss(vpreds, returns, old, torch.ones(1, 2), 0.5, "token-mean")
    loss.backward()
    # token 0: clipped to 0.5, (0.5 - 3)^2 > (2 - 3)^2: the clipped term wins, no gradient; token 1: unclipped
    assert vpreds.grad[0, 0] == 0 and vpreds.grad[0, 1] == pytest.approx(0.5 * 2 * 0.1 / 2)
    assert frac.item() == 0.5


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(-returns, returns, mask).item() < 0
    assert explained_variance(returns, torch.ones_like(returns), mask).item() == 0.0  # constant returns: no NaN


def test_critic_values_line_up_with_completion_tokens_and_are_deterministic_in_train_mode():
    from trl_nrollout.passes.critic import build_critic, compute_values, critic_values, pad_batch

    critic = build_critic("builtin:tiny-qwen2", seed=1).train()  # train mode: no dropout noise (verl: 0 too)
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    tensors = pad_batch(prompts, completions, pad_token_id=0)
    first = critic_values(critic, *tensors)
    torch.testing.assert_close(first, critic_values(critic, *tensors), rtol=0, atol=0)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # value of the state before each completion token
        ids = torch.tensor([p + c])
        with torch.no_grad():
            want = critic(input_ids=ids).logits[0, len(p) - 1:len(p) - 1 + len(c), 0]
        torch.testing.assert_close(first[i, :len(c)].detach(), want, rtol=0, atol=1e-5)
    micro = compute_values(critic, prompts, completions, pad_token_id=0, micro_batch_size=1)
    torch.testing.assert_close(micro, (first * tensors[3]).detach(), rtol=0, atol=1e-5)
    assert critic.training  # the value pass restores the mode


# ---------------------------------------------------------------------------------------------- config rules
def test_ppo_config_defaults_and_rules(tmp_path):
    from trl_nrollout import NRolloutPPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", train_batch_size=8, ppo_mini_batch_size=4)
    cfg = NRolloutPPOConfig(**base)
    assert (cfg.num_generations, cfg.rollout_n, cfg.adv_estimator) == (1, 1, "gae")  # TRL's n >= 2 rule waived
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.steps_per_generation) == (4, 1, 2)
    with pytest.raises(ValueError, match="adv_estimator='grpo'.*use adv_estimator='gae'"):
        NRolloutPPOConfig(**base, adv_estimator="grpo", rollout_n=4)
    with pytest.raises(ValueError, match="critic_ppo_micro_batch_size_per_device=3 must divide .*per_device_train"):
        NRolloutPPOConfig(**base, critic_ppo_micro_batch_size_per_device=3)
    for bad, match in (({"lam": 1.5}, r"lam=1.5 must be in \[0, 1\]"), ({"cliprange_value": 0.0}, "must be > 0"),
                       ({"critic_warmup": -1}, "critic_warmup=-1 must be >= 0"),
                       ({"critic_loss_agg_mode": "mean"}, "critic_loss_agg_mode='mean' is not one of")):
        with pytest.raises(ValueError, match=match):
            NRolloutPPOConfig(**base, **bad)


def _hf_ppo(tmp_path, monkeypatch, **kw):
    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutPPOConfig, NRolloutPPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = NRolloutPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                             train_batch_size=8, ppo_mini_batch_size=4, max_completion_length=6, max_steps=2,
                             learning_rate=1e-3, critic_learning_rate=1e-3, logging_steps=1, bf16=False,
                             **kw)
    return NRolloutPPOTrainer("builtin:tiny-qwen2", reward_funcs=digits_reward, args=args,
                              train_dataset=digits_dataset(32))


def test_critic_free_trainer_refuses_gae_and_ppo_needs_its_config(tmp_path, monkeypatch):
    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer, NRolloutPPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", train_batch_size=2,
                          rollout_n=4, adv_estimator="gae", max_completion_length=4)
    grpo = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=digits_reward, args=args,
                               train_dataset=digits_dataset(8))
    with pytest.raises(ValueError, match="adv_estimator='gae' needs a critic .*NRolloutPPOTrainer"):
        grpo._generate_and_score_completions([dict(digits_dataset(2)[i]) for i in range(2) for _ in range(4)])
    with pytest.raises(TypeError, match="NRolloutPPOTrainer needs an NRolloutPPOConfig"):
        NRolloutPPOTrainer("builtin:tiny-qwen2", reward_funcs=digits_reward, args=args,
                           train_dataset=digits_dataset(8))


def test_ppo_step_trains_policy_and_critic_and_logs_verls_names(tmp_path, monkeypatch):
    trainer = _hf_ppo(tmp_path, monkeypatch, critic_ppo_micro_batch_size_per_device=2)
    policy0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    critic0 = {n: p.detach().clone() for n, p in trainer.critic.named_parameters()}
    from trl_nrollout.builtin import digits_dataset

    batch = trainer._generate_and_score_completions([dict(r) for r in digits_dataset(8)])
    assert batch["old_values"].shape == batch["returns"].shape == batch["completion_mask"].shape
    trainer.train()
    assert any(not torch.equal(policy0[n], p) for n, p in trainer.model.named_parameters())
    assert any(not torch.equal(critic0[n], p) for n, p in trainer.critic.named_parameters())
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean", "critic/returns/mean",
            "critic/vf_explained_var", "critic/grad_norm", "timing_s/values", "timing_s/update_critic"} <= logged
    assert all(math.isfinite(h["critic/vf_loss"]) for h in trainer.state.log_history if "critic/vf_loss" in h)


def test_critic_warmup_trains_only_the_critic(tmp_path, monkeypatch):
    trainer = _hf_ppo(tmp_path, monkeypatch, critic_warmup=2)
    policy0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    critic0 = {n: p.detach().clone() for n, p in trainer.critic.named_parameters()}
    trainer.train()
    assert all(torch.equal(policy0[n], p) for n, p in trainer.model.named_parameters())
    assert any(not torch.equal(critic0[n], p) for n, p in trainer.critic.named_parameters())
    # the step's clock runs through the warm-up too (before, its rollouts were left to the first actor update's
    # timing_s/update_actor, which came out negative)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert logged and all(h["timing_s/step"] > 0 and h["perf/throughput"] > 0 for h in logged)
    assert trainer.step_clock.rollout_s == 0.0


@pytest.mark.parametrize("budget", [None, 24])
def test_the_critic_trains_on_each_micro_batch_the_policy_trained_on(tmp_path, monkeypatch, budget):
    """The update's hook (``_after_policy_step``) hands the critic exactly the micro batches the policy's loss ran on,
    each once, in order, with its optimizer step on the last micro batch of each accumulation; under a token budget
    (several micro batches per micro step) likewise. Four micro steps per rollout, two per optimizer step."""
    kw = {"ppo_max_token_len_per_device": budget} if budget else {}
    trainer = _hf_ppo(tmp_path, monkeypatch, ppo_micro_batch_size_per_device=2, **kw)
    policy, critic = [], []
    compute_loss, critic_update = trainer.policy_update.loss, trainer._critic_update

    def recorded_loss(model, inputs, step):
        if model.training:
            policy.append(inputs["completion_ids"])
        return compute_loss(model, inputs, step)

    def recorded_critic(inputs, boundary):
        critic.append((inputs["completion_ids"], boundary))
        return critic_update(inputs, boundary)

    monkeypatch.setattr(trainer.policy_update, "loss", recorded_loss)
    monkeypatch.setattr(trainer, "_critic_update", recorded_critic)
    trainer.train()
    accum = trainer.args.gradient_accumulation_steps
    assert (trainer.args.steps_per_generation, accum, trainer.state.global_step) == (4, 2, 2)
    assert len(critic) == len(policy) >= 4
    assert all(c is p for (c, _), p in zip(critic, policy))  # the same tensors: the same micro batches, in order
    # the critic's optimizer steps where the policy's do: once per optimizer step, on its last micro batch
    assert sum(b for _, b in critic) == trainer.state.global_step and critic[-1][1]
    if budget is not None:
        assert len(critic) > 4  # the budget cut micro steps into several micro batches


# ---------------------------------------------------------------------------------------------- end to end
PPO_RECIPE = ["--config", "recipes/configs/ppo.yaml"]


@pytest.mark.slow
@pytest.mark.vllm
def test_ppo_learns_the_builtin_task_with_n_1(tmp_path):
    """The shipped PPO recipe (vLLM engine, one sample per prompt): the reward climbs from below 0.1 to above 0.8;
    the critic's explained variance rises while the policy learns (measured: about -5 over the first steps, about
    0 over steps 20-50; once every sample scores 1.0 the returns no longer vary and it means nothing) and its value
    loss falls tenfold."""
    import json

    from tests.conftest import launch, rewards

    run = launch(tmp_path, *PPO_RECIPE)
    r = rewards(run)
    smooth = [sum(r[i:i + 5]) / 5 for i in range(len(r) - 4)]
    assert run["summary"]["trainer"] == "ppo" and run["summary"]["rollout_n"] == 1
    assert smooth[0] < 0.1 and max(smooth) > 0.8, smooth
    updates = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "critic/vf_loss" in h]
    ev = [h["critic/vf_explained_var"] for h in updates]
    learning = [h["critic/vf_explained_var"] for h in updates if 20 <= h["step"] <= 50]
    assert sum(learning) / len(learning) > sum(ev[:5]) / 5 + 2, ev
    loss = [h["critic/vf_loss"] for h in updates]
    assert sum(loss[-20:]) / 20 < sum(loss[:5]) / 5 / 10, loss


# one optimizer step per rollout: with more, each process shuffles its own samples into the mini batches, so the
# mini batches (not their union) differ between one and two processes (as with GRPO); and a checkpoint between the
# optimizer steps of one rollout cannot hold the rollout's buffered samples (TRL's trainer has the same limit).
# 6 steps with a checkpoint at 3: each run serves the two-process comparison and the resume test.
PPO_SIX = [*PPO_RECIPE, "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3",
           "--ppo_mini_batch_size", "32"]


@pytest.fixture(scope="module")
def ppo_one_process(tmp_path_factory):
    from tests.conftest import launch

    out = tmp_path_factory.mktemp("ppo_one")
    return {**launch(out, *PPO_SIX), "out": out}


@pytest.fixture(scope="module")
def ppo_zero3(tmp_path_factory):
    from tests.conftest import launch

    out = tmp_path_factory.mktemp("ppo_zero3")
    return {**launch(out, *PPO_SIX, config="zero3_cpu.yaml"), "out": out}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3", "zero3_sp2"])
def test_ppo_two_processes_reproduce_one(mode, ppo_one_process, tmp_path, request):
    """Two processes (two engines; the critic replicated with averaged gradients under DDP, or in its own DeepSpeed
    engine sharded like the policy under ZeRO-2/3) sample and learn what one process does: the same rewards, losses
    and values, within float noise, over 6 steps. ``zero3_sp2``: one Ulysses group of two under ZeRO-3
    (sequence_parallel_size=2: the policy's and the critic's rows split over the ranks, the critic in its own
    DeepSpeed engine): the policy's gradient norm is one process's too (mutations: the job's values not divided by S
    -> the advantages, and with them the gradient norm, differ from step 1; the critic's loss not scaled by S -> its
    values, then the gradient norm, differ from step 4)."""
    from tests.conftest import launch

    one = ppo_one_process
    if mode == "ddp":
        two = launch(tmp_path, *PPO_SIX, procs=2)
    elif mode == "zero3_sp2":
        two = launch(tmp_path, *PPO_SIX, "--sequence_parallel_size", "2", config="zero3_cpu.yaml")
        assert [h["grad_norm"] for h in two["steps"]] == pytest.approx([h["grad_norm"] for h in one["steps"]],
                                                                        rel=1e-4)
    elif mode == "zero2":
        two = launch(tmp_path, *PPO_SIX, config="zero2_cpu.yaml")
    else:
        two = request.getfixturevalue("ppo_zero3")  # also the uninterrupted run of the ZeRO-3 resume test
    assert two["summary"]["processes"] == 2 and len(two["steps"]) == 6
    for key in ("reward", "loss", "critic/values/mean"):
        assert [h[key] for h in two["steps"]] == pytest.approx([h[key] for h in one["steps"]], abs=1e-4), key


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["one_process", pytest.param("zero3", marks=pytest.mark.multiprocess)])
def test_ppo_resume_gives_the_same_subsequent_steps(mode, tmp_path, request):
    """The critic and its optimizer are checkpointed (under ZeRO-3: the critic engine's shards): resuming at step 3
    of 6 trains steps 4-6 only and reproduces them (a run from scratch would train 6). One process resumes from
    `true` (the last checkpoint of the output folder, where the checkpoint was copied), ZeRO-3 from a path. The
    uninterrupted runs are the fixtures the two-process comparison reads."""
    import shutil

    from tests.conftest import assert_resumed, launch

    full = request.getfixturevalue("ppo_one_process" if mode == "one_process" else "ppo_zero3")
    checkpoint = full["out"] / "checkpoint-3"
    saved = checkpoint / "critic"
    assert (saved / "critic").is_dir() if mode == "zero3" else (saved / "optimizer.pt").exists()
    if mode == "one_process":
        shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-3")
        checkpoint = tmp_path / "resumed" / "checkpoint-3"
    resumed = launch(tmp_path / "resumed", *PPO_SIX, "--resume_from_checkpoint",
                     "true" if mode == "one_process" else str(checkpoint),
                     config="zero3_cpu.yaml" if mode == "zero3" else None)
    assert_resumed(full, resumed, checkpoint, keys=("reward", "loss", "critic/values/mean", "critic/vf_loss"))


def test_ppo_with_lora_on_the_policy(tmp_path, monkeypatch):
    """LoRA adapters on the policy (the critic stays a full model, built from the base weights): both train; every
    adapter tensor moves and the policy's base weights stay as loaded. Mutation tried: the base weights left
    trainable (requires_grad on every policy parameter) -> a base weight changes."""
    from peft import LoraConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutPPOConfig, NRolloutPPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = NRolloutPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                             train_batch_size=8, ppo_mini_batch_size=8, max_completion_length=6, max_steps=2,
                             learning_rate=1e-2, critic_learning_rate=1e-3, logging_steps=1, bf16=False)
    trainer = NRolloutPPOTrainer("builtin:tiny-qwen2", reward_funcs=digits_reward, args=args,
                                 train_dataset=digits_dataset(16),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    base0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    critic0 = {n: p.detach().clone() for n, p in trainer.critic.named_parameters()}
    assert lora0 and base0 and not any("lora" in n for n in critic0)
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    assert [n for n in lora0 if torch.equal(lora0[n], policy[n])] == []  # every adapter (B starts at zero) trained
    assert [n for n in base0 if not torch.equal(base0[n], policy[n])] == []  # the base is frozen
    assert any(not torch.equal(critic0[n], p) for n, p in trainer.critic.named_parameters())


def test_critic_from_a_reward_model_keeps_its_head(tmp_path):
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from tests.conftest import save_tiny_model
    from trl_nrollout.passes.critic import build_critic

    base = save_tiny_model(tmp_path / "base")
    rm = Qwen2ForSequenceClassification.from_pretrained(base, num_labels=1)
    torch.nn.init.constant_(rm.score.weight, 0.25)
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "rm")
    critic = build_critic(str(tmp_path / "rm"))
    assert torch.all(critic.score.weight == 0.25)  # the reward model's value head, not a fresh one
    fresh = build_critic(base)
    assert not torch.all(fresh.score.weight == 0.25)


def test_critic_token_budget_splits_like_the_count_split(tmp_path, monkeypatch):
    """critic_ppo_max_token_len_per_device packs sequences by tokens; the values do not depend on the split."""
    from trl_nrollout.passes.critic import compute_values

    trainer = _hf_ppo(tmp_path, monkeypatch, critic_ppo_max_token_len_per_device=40)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (k,), generator=g).tolist() for k in (7, 3, 9, 5)]
    completions = [torch.randint(5, 300, (k,), generator=g).tolist() for k in (6, 2, 4, 6)]
    budget = compute_values(trainer.critic, prompts, completions, pad_token_id=0, max_token_len=15)
    whole = compute_values(trainer.critic, prompts, completions, pad_token_id=0)
    torch.testing.assert_close(budget, whole, rtol=0, atol=1e-5)
    trainer.train()  # the update packs by the same budget
    assert any("critic/vf_loss" in h for h in trainer.state.log_history)


def test_plan_prints_the_critics_micro_batches(capsys):
    import json

    from tests.conftest import ROOT
    from trl_nrollout.cli import main

    recipe = str(ROOT / "recipes/configs/ppo.yaml")
    assert main(["plan", "--config", recipe, "--no-memory"]) == 0
    text = capsys.readouterr().out
    assert "critic value micro batch     16 sequences per device per forward; 32 / 16 -> 2 forwards" in text
    assert main(["plan", "--config", recipe, "--no-memory", "--json"]) == 0
    assert "critic update micro batch" in json.loads(capsys.readouterr().out)["critic"]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_critic_follows_the_policys_precision_and_checkpointing(tmp_path, monkeypatch, checkpointing):
    """From a bf16 checkpoint with bf16=True: the critic gets the policy's (float32) weights, so AdamW at lr 1e-5
    moves most of its entries (bf16 weights would round most updates away), and runs under the trainer's autocast;
    gradient_checkpointing (TRL's default: on) applies to the critic as to the policy."""
    import trl_nrollout.trainer.grpo as trainer_module
    from tests.conftest import save_tiny_model
    from trl_nrollout import NRolloutPPOConfig, NRolloutPPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    model = save_tiny_model(tmp_path / "model", dtype=torch.bfloat16)
    args = NRolloutPPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                             train_batch_size=8, ppo_mini_batch_size=8, max_completion_length=6, max_steps=1,
                             critic_learning_rate=1e-5, logging_steps=1, bf16=True,
                             gradient_checkpointing=checkpointing)
    trainer = NRolloutPPOTrainer(model, reward_funcs=digits_reward, args=args, train_dataset=digits_dataset(16))
    policy_dtype = next(trainer.model.parameters()).dtype
    assert {p.dtype for p in trainer.critic.parameters()} == {policy_dtype} == {torch.float32}
    assert trainer.critic.is_gradient_checkpointing is checkpointing
    before = {n: p.detach().clone() for n, p in trainer.critic.named_parameters()}
    trainer.train()
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.critic.named_parameters())
    total = sum(p.numel() for p in before.values())
    assert moved / total > 0.5, moved / total


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_ppo_critic_trains_under_zero_offload(tmp_path):
    """ZeRO-2 with the optimizer offloaded to the CPU (`offload_optimizer_device: cpu`): DeepSpeed refuses a torch
    optimizer there, so the critic's AdamW is mapped onto DeepSpeed's CPU Adam as accelerate maps the policy's; both
    train (the critic's values move, its loss is finite)."""
    import json
    import math

    from tests.conftest import ACCELERATE_LAUNCH, ENV, RECIPE, ROOT, run_cmd

    config = tmp_path / "zero2_offload.yaml"
    config.write_text((ROOT / "recipes/accelerate/zero2_cpu.yaml").read_text()
                      .replace("offload_optimizer_device: none", "offload_optimizer_device: cpu"))
    out = tmp_path / "run"
    run_cmd([*ACCELERATE_LAUNCH, "--config_file", str(config), RECIPE, *PPO_RECIPE, "--output_dir", str(out),
             "--use_cpu", "false", "--ddp_backend", "gloo", "--max_steps", "3", "--ppo_mini_batch_size", "32"],
            timeout=900, env=ENV)
    steps = [h for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    assert len(steps) == 3 and all(math.isfinite(h["critic/vf_loss"]) for h in steps)
    assert len({h["critic/values/mean"] for h in steps}) == 3  # the critic's values move
