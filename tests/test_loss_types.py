"""Every TRL ``loss_type`` (and the loss options around it) gives the loss TRL 1.16 gives.

Both trainers are built from the same plain ``GRPOConfig`` on the same tiny model (ours converts it, as a drop-in
user's script does), then each one's ``_compute_loss`` runs on the same batch: prompt and completion tokens, old,
sampling and reference log-probs that differ from the current ones (so ratios are clipped), advantages of both
signs, a short and an empty completion. The losses agree within 1e-6 and so do the gradients of every parameter.

Prompts are unpadded: our training forward counts positions from each sequence's first real token and TRL's
does not, a documented difference that only left padding shows.
"""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

import trl_nrollout.trainer.grpo as trainer_module
from tests.conftest import save_tiny_model
from trl_nrollout import NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.config.trl_options import TRL_LOSS_TYPES

ROWS, PROMPT, COMPLETION = 12, 5, 7  # two micro batches of 6 (n = 3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    return save_tiny_model(tmp_path_factory.mktemp("loss_types") / "model")


def _trainers(model_dir: str, tmp_path, monkeypatch, **options):
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    built = []
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=COMPLETION, use_cpu=True, report_to="none", bf16=False,
                          save_strategy="no", seed=1, temperature=0.9, **options)
        trainer = cls(model=model_dir, reward_funcs=[digits_reward], args=args, train_dataset=digits_dataset(12))
        trainer.model.train()
        built.append(trainer)
    return built


def _batch(trl: GRPOTrainer, seed: int) -> dict:
    """One generation batch of ROWS samples; log-probs around the model's own (computed by TRL's forward)."""
    g = torch.Generator().manual_seed(seed)
    vocab = trl.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (ROWS, PROMPT), generator=g)
    completion_ids = torch.randint(3, vocab, (ROWS, COMPLETION), generator=g)
    lengths = torch.randint(1, COMPLETION + 1, (ROWS,), generator=g)
    lengths[1], lengths[4], lengths[7] = 0, 2, COMPLETION  # an empty completion, a short and a full one
    completion_mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    with torch.no_grad():
        logps, _, _ = trl._get_per_token_logps_and_entropies(
            trl.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], 1), COMPLETION)

    def noisy(scale: float) -> torch.Tensor:
        return logps + scale * torch.randn(logps.shape, generator=g)

    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(ROWS, generator=g),
        "old_per_token_logps": noisy(0.3), "sampling_per_token_logps": noisy(0.4), "ref_per_token_logps": noisy(0.3),
    }


def _trl_is_ratio(batch: dict, level: str, mode: str, low: float | None, high: float | None) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio as its docs define it (TRL computes it during generation)."""
    diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * batch["completion_mask"]
    ratio = (diff.sum(-1, keepdim=True) if level == "sequence" else diff).exp()
    if mode == "truncate":
        return ratio.clamp(min=low, max=high)
    outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return ratio.masked_fill(outside, 0.0)


def _loss_and_grads(trainer, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def _compare(model_dir, tmp_path, monkeypatch, accumulation: int = 1, is_mode: tuple | None = None, **options):
    trl, ours = _trainers(model_dir, tmp_path, monkeypatch, gradient_accumulation_steps=accumulation, **options)
    for t in (trl, ours):
        t.current_gradient_accumulation_steps = accumulation
    batch = _batch(trl, seed=len(str(options)) + accumulation)
    halves = [{k: v[:6] for k, v in batch.items()}, {k: v[6:] for k, v in batch.items()}][:accumulation]
    for half in halves:  # TRL's count: the generation batch's tokens (one optimizer step's here)
        half["num_items_in_batch"] = sum(h["completion_mask"].sum() for h in halves)
    if is_mode is not None:  # TRL's vLLM rollout correction: TRL computes the ratio while generating
        level, mode, low, high = is_mode
        trl.use_vllm, trl.vllm_importance_sampling_correction = True, True
        trl.vllm_importance_sampling_clip_min, trl.vllm_importance_sampling_clip_max = low, high
        ours.args.rollout_is, ours.args.rollout_is_mode = level, mode
        ours.args.rollout_is_threshold, ours.args.rollout_is_threshold_lower = high, low
        for half in halves:
            half["importance_sampling_ratio"] = _trl_is_ratio(half, level, mode, low, high)
    ours_halves = ours.policy_update.add_normalizers([{k: v for k, v in h.items() if k not in ("num_items_in_batch",
                                                                                 "importance_sampling_ratio")}
                                         for h in halves], accumulation)
    total = 0.0
    for theirs_in, ours_in in zip(halves, ours_halves):
        trl_loss, trl_grads = _loss_and_grads(trl, theirs_in)
        our_loss, our_grads = _loss_and_grads(ours, ours_in)
        assert torch.isfinite(our_loss) and abs(trl_loss.item()) > 1e-4, "a degenerate case tests nothing"
        torch.testing.assert_close(our_loss, trl_loss, rtol=0, atol=1e-6)
        assert len(our_grads) == len(trl_grads)
        for mine, theirs in zip(our_grads, trl_grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
        total += our_loss.item()
    return total


@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_loss_type_equals_trls(loss_type, level, model_dir, tmp_path, monkeypatch):
    _compare(model_dir, tmp_path, monkeypatch, loss_type=loss_type, importance_sampling_level=level,
             epsilon_high=5.0 if loss_type == "cispo" else 0.28)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"])
def test_gradient_accumulation_scales_as_trls(loss_type, model_dir, tmp_path, monkeypatch):
    """Two micro batches per optimizer step: each micro loss equals TRL's (which the HF loop sums, unscaled)."""
    _compare(model_dir, tmp_path, monkeypatch, accumulation=2, loss_type=loss_type)


@pytest.mark.parametrize("options", [
    dict(beta=0.05),  # the KL loss, with TRL's bias correction
    dict(beta=0.05, use_bias_correction_kl=False, loss_type="grpo"),
    dict(delta=1.3),  # two-sided clip
    dict(top_entropy_quantile=0.4),
    dict(top_entropy_quantile=0.4, entropy_coef=0.1, loss_type="bnpo"),
    dict(off_policy_mask_threshold=0.05),
    dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, loss_type="sapo"),
    dict(vespo_k_pos=1.0, vespo_lambda_neg=1.0, loss_type="vespo"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_loss_options_equal_trls(options, model_dir, tmp_path, monkeypatch):
    _compare(model_dir, tmp_path, monkeypatch, **options)


@pytest.mark.parametrize(("loss_type", "is_mode"), [
    ("dapo", ("token", "truncate", None, 2.0)),
    ("dapo", ("sequence", "mask", 0.5, 3.0)),
    ("grpo", ("token", "mask", 0.8, 1.5)),
    ("vespo", ("token", "truncate", 0.5, 2.0)),  # VESPO folds the correction into its gamma weight
    ("vespo", ("sequence", "mask", None, 3.0)),
])
def test_rollout_correction_equals_trls(loss_type, is_mode, model_dir, tmp_path, monkeypatch):
    _compare(model_dir, tmp_path, monkeypatch, is_mode=is_mode, loss_type=loss_type)


def test_loss_type_sets_the_verl_options_and_conflicts_are_errors(tmp_path):
    from trl_nrollout.config import NRolloutConfig

    def cfg(**kw):
        return NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", rollout_backend="hf",
                              per_device_train_batch_size=4, num_generations=4, **kw)

    for loss_type, (mode, agg) in TRL_LOSS_TYPES.items():
        c = cfg(loss_type=loss_type)
        assert (c.policy_loss_mode, c.loss_agg_mode) == (mode, agg)
    with pytest.raises(ValueError, match="loss_type='grpo' means loss_agg_mode='seq-mean-token-mean', which conflicts"):
        cfg(loss_type="grpo", loss_agg_mode="token-mean-micro")
    with pytest.raises(ValueError, match="loss_type='nope' is not one of"):
        cfg(loss_type="nope")
    with pytest.raises(ValueError, match="top_entropy_quantile=0.0 must be in"):
        cfg(top_entropy_quantile=0.0)
    with pytest.raises(ValueError, match="normalize_then_sum.*needs adv_estimator='grpo'"):
        cfg(multi_objective_aggregation="normalize_then_sum", adv_estimator="rloo")


def _length_reward(completions, **kwargs):
    """A second objective for GDPO: shorter is better; None (does not apply) for every fourth sample."""
    return [None if i % 4 == 3 else -len(str(c)) / 10 for i, c in enumerate(completions)]


@pytest.mark.slow
def test_trl_loss_options_train_end_to_end(model_dir, tmp_path, monkeypatch):
    """A GRPOConfig with TRL's loss options trains (HF engine, two optimizer steps per rollout): GDPO over two reward
    functions (one returning None), grpo loss, entropy-quantile and off-policy masks, two-sided clip. The masks act
    (their fractions are logged), GDPO's advantages are batch-normalized, and the weights change."""
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                      gradient_accumulation_steps=1, steps_per_generation=2, max_completion_length=6, max_steps=4,
                      learning_rate=1e-2, use_cpu=True, report_to="none", bf16=False, save_strategy="no", seed=1,
                      logging_steps=1, loss_type="grpo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.0,
                      multi_objective_aggregation="normalize_then_sum", delta=1.5, beta=0.02)
    trainer = NRolloutGRPOTrainer(model=model_dir, reward_funcs=[digits_reward, _length_reward], args=args,
                                  train_dataset=digits_dataset(24))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 4 and all(math.isfinite(h["loss"]) for h in steps)
    # the second micro step of each rollout is off-policy: the threshold 0 drops its negative sequences that drifted
    assert max(h["off_policy_mask/dropped_fraction"] for h in steps) > 0
    assert all(abs(h["critic/advantages/mean"]) < 0.5 for h in steps if "critic/advantages/mean" in h)  # token mean of batch-normalized advantages
    assert any((p - b).abs().max() > 0 for p, b in zip(trainer.model.parameters(), before))
