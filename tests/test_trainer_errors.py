"""Construction-time validation of NRolloutConfig and the trainer's error paths (one process, HF engine)."""

from __future__ import annotations

import pytest

from tests.assets.rewards_for_tests import async_digits, none_for_all, raises_on_long
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.plan.layout import LayoutError


def cfg(tmp_path, **kw) -> NRolloutConfig:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_completion_length=6, max_steps=1,
                save_strategy="no", rollout_backend="hf")
    base.update(kw)
    return NRolloutConfig(**base)


def test_verl_vocabulary_maps_onto_trl_fields(tmp_path):
    c = cfg(tmp_path, train_batch_size=8, rollout_n=4, ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=4)
    assert c.num_generations == 4
    assert c.per_device_train_batch_size == 4
    assert c.gradient_accumulation_steps == 4  # 4 prompts x 4 samples / 1 process / micro 4
    assert c.steps_per_generation == 8  # 32 samples / micro 4
    assert c.generation_batch_size == 32
    layout = c.rollout_layout()
    assert layout.optimizer_steps_per_rollout == 2 and layout.total_samples == 32


def test_trl_fields_map_back_onto_verl_vocabulary(tmp_path):
    c = cfg(tmp_path, per_device_train_batch_size=16, num_generations=4, gradient_accumulation_steps=2)
    assert (c.train_batch_size, c.rollout_n, c.ppo_mini_batch_size) == (8, 4, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(train_batch_size=8, rollout_n=4, num_generations=6), "num_generations=6 conflicts"),
    (dict(train_batch_size=8, rollout_n=4, per_device_train_batch_size=5), "per_device_train_batch_size=5"),
    (dict(train_batch_size=8, rollout_n=4, ppo_mini_batch_size=3), "ppo_mini_batch_size=3"),
    (dict(train_batch_size=8, rollout_n=1), "rollout_n=1"),
    (dict(adv_estimator="nope"), "adv_estimator='nope'"),
    (dict(loss_agg_mode="mean"), "loss_agg_mode='mean'"),
    (dict(kl_loss_type="k9"), "kl_loss_type='k9'"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c=0.5"),
    (dict(rollout_backend="ray"), "rollout_backend='ray'"),
    (dict(rollout_seed_mode="request"), "rollout_seed_mode='request' is not one of"),
    (dict(rollout_backend="hf", rollout_seed_mode="sample"), "rollout_seed_mode=.sample. needs vLLM engines"),
    (dict(rollout_backend="hf", rollout_tp_size=2), r"rollout_backend='hf' \(transformers generate\) has no use for "
                                                   r"rollout_tp_size=2 \(or TRL's vllm_tensor_parallel_size\)"),
    (dict(rollout_backend="hf", vllm_max_model_length=900, vllm_enable_sleep_mode=True, rollout_dtype="bfloat16"),
     "no use for rollout_dtype='bfloat16', rollout_max_model_len=900 .or TRL's vllm_max_model_length., "
     "vllm_enable_sleep_mode=True: they configure the vLLM engines"),
    (dict(per_device_train_batch_size=6, num_generations=4), "not divisible by num_generations=4"),
])
def test_conflicts_are_errors_naming_the_option(tmp_path, kw, match):
    with pytest.raises((ValueError, LayoutError), match=match):
        cfg(tmp_path, **kw)


def _trainer(tmp_path, reward, **kw):
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    return NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[reward],
                               args=cfg(tmp_path, train_batch_size=2, rollout_n=4, **kw),
                               train_dataset=digits_dataset(16))


@pytest.mark.slow
def test_a_raising_reward_function_is_named_with_its_sample(tmp_path):
    from trl_nrollout.trainer.grpo import RewardFunctionError

    trainer = _trainer(tmp_path, raises_on_long)
    with pytest.raises(RewardFunctionError, match=r"'raises_on_long' raised ZeroDivisionError: boom on sample \d+"):
        trainer.train()


@pytest.mark.slow
def test_none_means_not_applicable_and_nan_follows_the_policy(tmp_path, caplog):
    """As in TRL, None means "this reward does not apply": a sample no function applies to is unscorable (a warning,
    no advantage, left out of the logged reward); a NaN that a function computes is a bug: an error by default."""
    import logging
    import math

    from tests.assets.rewards_for_tests import nan_for_all
    from trl_nrollout.recipe.report import write_report
    from trl_nrollout.recipe.summary import RewardHistory, build_summary
    from trl_nrollout.trainer.grpo import RewardFunctionError

    history = RewardHistory()
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        # the live progress line on (pytest's log level turns it off by default): it shows the step as unscored
        trainer = _trainer(tmp_path / "a", none_for_all, max_steps=2, disable_tqdm=False, logging_steps=1)
        trainer.add_callback(history)
        trainer.train()
    steps = [h for h in trainer.state.log_history if "reward" in h]
    assert len(steps) == 2 and all(h["reward"] is None for h in steps)  # no scorable sample: no mean (TRL's None)
    assert all(h["critic/advantages/max"] == 0.0 and math.isfinite(h["loss"]) for h in steps)
    # TRL's warning, in TRL's words (users and tests match them; a TRL upgrade that rewords it fails here), with the
    # sample's reward kwargs as TRL shows them
    import inspect

    from trl import GRPOTrainer

    phrases = ("All reward functions returned None for the following kwargs:\n",
               "\nPlease ensure that at least one reward function returns a valid reward.")
    assert all(p.strip() in inspect.getsource(GRPOTrainer) for p in phrases)
    warned = [r.getMessage() for r in caplog.records if phrases[0] in r.getMessage()]
    assert warned and phrases[1] in warned[0]
    assert "'prompt': '" in warned[0] and "'completion': " in warned[0]
    assert history.unscored_steps == [1, 2] and history.rewards == []
    summary = build_summary(steps=2, rewards=history.rewards, gen_tokens_per_s=1.0, rollout_backend="hf",
                            checkpoint=None, wall_s=1.0, extra={"unscored_steps": history.unscored_steps})
    assert summary["reward_start"] is None and summary["reward_end"] is None  # JSON has no NaN
    assert write_report(trainer.state.log_history, tmp_path / "report.png") is not None  # gaps, not a crash
    with pytest.raises(RewardFunctionError, match=r"'nan_for_all' returned nan \(NaN/inf\).*reward_nan_policy='zero'"):
        _trainer(tmp_path / "b", nan_for_all).train()
    trainer = _trainer(tmp_path / "c", nan_for_all, reward_nan_policy="zero")
    trainer.train()
    assert [h["reward"] for h in trainer.state.log_history if "reward" in h] == [0.0]


@pytest.mark.slow
def test_none_rewards_are_combined_as_trl_combines_them(tmp_path, monkeypatch):
    """TRL's GRPOTrainer and ours on the same tiny model, data and seed, with two reward functions that depend on
    the prompt only and return None for some prompts: the logged rewards (NaN-aware sum over functions, mean over
    scorable samples, per-function means over the samples each applies to) are the same, and so is a metric a
    reward function logs through TRL's log_metric (it also calls log_extra)."""
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from tests.assets.rewards_for_tests import prompt_bonus, prompt_score
    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)  # the HF engine on both sides
    model = resolve_model("builtin:tiny-qwen2")
    logs = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=2, use_cpu=True, report_to="none", bf16=False,
                          save_strategy="no", logging_steps=1, seed=3, reward_weights=[1.0, 2.0])
        trainer = cls(model=model, reward_funcs=[prompt_score, prompt_bonus], args=args,
                      train_dataset=digits_dataset(32))
        trainer.train()
        logs[name] = [h for h in trainer.state.log_history if "reward" in h]
    keys = ["reward", "rewards/prompt_score/mean", "rewards/prompt_bonus/mean", "bonus/applies"]  # + log_metric
    assert len(logs["trl"]) == len(logs["ours"]) == 2
    for theirs, ours in zip(logs["trl"], logs["ours"]):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6, nan_ok=True), key


@pytest.mark.slow
def test_a_plain_grpo_config_is_accepted(tmp_path, monkeypatch, caplog):
    import logging

    from trl import GRPOConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)  # keep vLLM out of the pytest process

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=1,
                      use_cpu=True, report_to="none", max_completion_length=4, vllm_gpu_memory_utilization=0.5)
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                      train_dataset=digits_dataset(16))
    assert trainer.layout.train_batch_size == 2 and trainer.layout.rollout_n == 4
    assert trainer.rollout_backend == "hf"  # 'auto' without vLLM: the vLLM option it set is named, not dropped
    notes = [r.message for r in caplog.records if "has no use for" in r.message]
    assert len(notes) == 1 and "vllm_gpu_memory_utilization=0.5" in notes[0] and "vLLM is not installed" in notes[0]


@pytest.mark.slow
def test_async_reward_functions_are_awaited(tmp_path):
    trainer = _trainer(tmp_path, async_digits)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 1 and 0.0 <= rewards[0] <= 1.0
    assert "rewards/async_digits/mean" in trainer.state.log_history[0]


@pytest.mark.vllm
def test_engine_length_beyond_the_models_context_is_refused(tmp_path):
    """The engine's max_model_len defaults to the model's context (1024 for the built-in model); asking for more
    is refused before any engine starts, naming the option and the limit."""
    from trl_nrollout import NRolloutGRPOTrainer

    args = cfg(tmp_path, rollout_backend="vllm", rollout_max_model_len=5000, per_device_train_batch_size=4,
               num_generations=4)
    with pytest.raises(ValueError, match=r"rollout_max_model_len=5000 exceeds the model's context length \(1024"):
        NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                            train_dataset=digits_dataset(8))


@pytest.mark.vllm
def test_a_prompt_too_long_for_the_engine_is_a_clear_error(tmp_path, monkeypatch):
    """Prompts that leave no room for max_completion_length within the engine's length: vLLM would cut the
    completion short without a word. The trainer refuses them when it is built, before an engine starts, naming the
    rows; the rollout's own check (for datasets it cannot read ahead, e.g. iterable ones) names the options too."""
    from datasets import Dataset

    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.errors import DatasetError
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.trainer.engines import EngineSetup

    started = []
    monkeypatch.setattr(EngineSetup, "start", lambda self, choice: started.append(choice))
    args = cfg(tmp_path, rollout_backend="vllm", rollout_max_model_len=128, per_device_train_batch_size=4,
               num_generations=4)
    prompts = ["write a number"] * 3 + ["write a number " * 60] * 8 + ["write a number"]
    with pytest.raises(DatasetError, match=r"8 prompt\(s\) leave no room for max_completion_length=6 in the vLLM "
                                           r"engine's 128-token context \(rollout_max_model_len; rows 3, 4, 5, 6, 7 "
                                           r"and 3 more.*filter them out"):
        NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                            train_dataset=Dataset.from_dict({"prompt": prompts}))
    assert started == []
    engine = object.__new__(VLLMEngineGroup)
    engine.max_model_len = 128
    engine.check_prompt_length(122, 6)  # exactly fits
    with pytest.raises(ValueError, match=r"max_completion_length=6 exceeds the engine's max_model_len=128 "
                                         r"\(rollout_max_model_len\)"):
        engine.check_prompt_length(123, 6)


@pytest.mark.slow
@pytest.mark.parametrize("target", [100.0, 0.2])
def test_adaptive_entropy_follows_trl(tmp_path, monkeypatch, target):
    """use_adaptive_entropy: TRL's GRPOTrainer and ours on the same model, data and seed move the coefficient the
    same way (the tiny model's token entropy, about 5 nats, is below a target of 100 and above 0.2), and log it."""
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    coefs = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=3, use_cpu=True, report_to="none", bf16=False,
                          save_strategy="no", logging_steps=1, seed=3, entropy_coef=0.1, use_adaptive_entropy=True,
                          entropy_target=target, entropy_coef_delta=0.01, entropy_coef_max=0.125)
        trainer = cls(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[digits_reward], args=args,
                      train_dataset=digits_dataset(32))
        trainer.train()
        coefs[name] = [h["entropy_coef"] for h in trainer.state.log_history if "entropy_coef" in h]
    expected = [0.11, 0.12, 0.125] if target == 100.0 else [0.09, 0.08, 0.07]
    assert coefs["trl"] == pytest.approx(expected)
    assert coefs["ours"] == pytest.approx(coefs["trl"])


@pytest.mark.slow
def test_mask_truncated_completions(tmp_path):
    """TRL's mask_truncated_completions: a completion cut at max_completion_length (no EOS) is masked out of the
    loss, the others keep their mask; a step whose completions are all cut trains with a zero, finite loss."""
    import math

    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], train_dataset=digits_dataset(16),
                                  args=cfg(tmp_path, train_batch_size=4, rollout_n=4, max_completion_length=3,
                                           mask_truncated_completions=True, logging_steps=1, max_steps=2))
    data = digits_dataset(16)
    out = trainer._generate_and_score_completions([dict(data[i]) for i in range(4) for _ in range(4)])
    eos = set(trainer.eos_token_ids)
    masked = 0
    for ids, mask in zip(out["completion_ids"].tolist(), out["completion_mask"].tolist()):
        if sum(mask) == 0:  # masked: three real tokens, none of them an end of sequence
            masked += 1
            assert len(ids) == 3 and not eos & set(ids)
        else:  # kept: it ended with an end-of-sequence token
            assert ids[sum(mask) - 1] in eos
    assert masked > 0
    trainer.train()
    losses = [h.get("loss", h.get("train_loss")) for h in trainer.state.log_history if "reward" in h]
    assert losses and all(math.isfinite(v) for v in losses)


@pytest.mark.slow
def test_a_non_finite_loss_stops_training_with_its_step(tmp_path, monkeypatch):
    """The loss is checked on the metrics fetched in one transfer per micro batch: a NaN from the model still stops
    the step with an error that names it, and no metric of that micro batch is logged."""
    import torch

    from trl_nrollout.trainer.update import PolicyUpdate

    trainer = _trainer(tmp_path, digits_reward)
    real = PolicyUpdate.policy_logps

    def nan_logps(self, *a, **kw):
        logps, entropies, aux = real(self, *a, **kw)
        return logps * torch.tensor(float("nan")), entropies, aux

    monkeypatch.setattr(PolicyUpdate, "policy_logps", nan_logps)
    with pytest.raises(FloatingPointError, match=r"the loss is nan at step 0 \(pg_loss=nan\)"):
        trainer.train()
    assert not trainer._metrics["train"].get("actor/pg_loss")


@pytest.mark.slow
def test_a_reward_function_returning_labels_is_named(tmp_path):
    from tests.assets.rewards_for_tests import says_good
    from trl_nrollout.trainer.grpo import RewardFunctionError

    with pytest.raises(RewardFunctionError, match=r"reward function 'says_good' returned 'good' \(str\) for sample 0"):
        _trainer(tmp_path, says_good).train()


@pytest.mark.slow
def test_a_reward_call_that_hangs_meets_its_timeout_policy(tmp_path, caplog):
    """A reward function that sleeps 600 s, with reward_timeout_s=1: 'error' stops naming the function and the samples;
    'none' trains with the function not applying (no scorable sample: no reward logged, no advantage); 'zero' scores
    the samples 0. Each run waits about a second for the function, not 600."""
    import logging
    import math
    import time

    from tests.assets.rewards_for_tests import slow_digits
    from trl_nrollout.trainer.grpo import RewardFunctionError

    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"reward function 'slow_digits' did not return within "
                                                  r"reward_timeout_s=1 on 8 samples of rank 0.*reward_timeout_policy"):
        _trainer(tmp_path / "a", slow_digits, reward_timeout_s=1).train()
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        none = _trainer(tmp_path / "b", slow_digits, reward_timeout_s=1, reward_timeout_policy="none")
        none.train()
    step = [h for h in none.state.log_history if "reward" in h][0]
    assert step["reward"] is None or math.isnan(step["reward"])
    assert step["critic/advantages/max"] == 0.0
    assert any("did not return within reward_timeout_s=1" in r.getMessage() and "it does not apply" in r.getMessage()
               for r in caplog.records)
    zero = _trainer(tmp_path / "c", slow_digits, reward_timeout_s=1, reward_timeout_policy="zero")
    zero.train()
    assert [h["reward"] for h in zero.state.log_history if "reward" in h] == [0.0]
    assert time.perf_counter() - start < 90  # three runs, none waited the function


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, head_fp32", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_bf16_old_and_reference_passes_run_as_the_update_does(tmp_path, checkpoint, head_fp32):
    """bf16=True (CPU autocast here, as on a GPU) over float32 weights (TRL's default load) or a bf16 checkpoint: the
    old-policy and reference passes run under the same autocast as the update, so on the first step the ratio is
    1 (ppo_kl 0 within the bf16 kernels' shape-dependent rounding, nothing clipped) and the KL against the reference, which has the policy's weights then, is
    0 (it was 8.4e-7 when those passes ran in float32). With cast_lm_head_to_fp32 the head runs in float32 outside
    autocast in every pass, as TRL's fused head runs it in the update."""
    import torch

    from tests.conftest import save_tiny_model
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    model = save_tiny_model(tmp_path / "model", dtype=getattr(torch, checkpoint))
    args = cfg(tmp_path / "out", train_batch_size=4, rollout_n=4, bf16=True, beta=0.04, max_completion_length=8,
               skip_old_log_prob_when_on_policy=False, logging_steps=1, max_steps=1, cast_lm_head_to_fp32=head_fp32)
    trainer = NRolloutGRPOTrainer(model, reward_funcs=[digits_reward], args=args, train_dataset=digits_dataset(16))
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.ref_model is not None
    trainer.train()
    step = [h for h in trainer.state.log_history if "actor/kl_loss" in h][0]
    # bitwise 0 where the CPU's bf16 kernels do not depend on the batch's shape; on a host with AVX512-BF16 the
    # passes' and the update's shapes round differently: measured there, kl_loss <= 3.1e-9 (and |ppo_kl| up to 1e-5,
    # too close to the bug's 2e-5 to tell them apart), against kl_loss 2.3e-8..1.0e-7 with the passes outside
    # autocast (the bug this test guards)
    assert abs(step["actor/kl_loss"]) < 1e-8 and abs(step["actor/ppo_kl"]) < 1e-4, step
    assert step["actor/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("option", ["use_dora", "lora_bias"])
def test_adapters_whose_merge_is_not_a_lora_delta_do_not_reach_vllm(tmp_path, caplog, option):
    """DoRA (a learned per-column magnitude) and lora_bias (a bias on B) merge differently from B @ A, which is what
    the weight sync adds: with rollout_backend='vllm' that is an error naming the option and both fixes, before an
    engine is built; with 'auto' the HF engine generates with the PEFT model itself, after one warning."""
    import logging

    from peft import LoraConfig

    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    def build(backend: str):
        args = cfg(tmp_path / backend, train_batch_size=2, rollout_n=4, rollout_backend=backend)
        return NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                   train_dataset=digits_dataset(16),
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          **{option: True}))

    with pytest.raises(RuntimeError, match=rf"sets {option}=True, whose merge is not a plain LoRA delta.*"
                                           rf"{option}=False.*rollout_backend='hf'"):
        build("vllm")
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = build("auto")
    assert trainer.rollout_backend == "hf"
    assert any(f"{option}=True" in r.getMessage() and "using the HF engine" in r.getMessage() for r in caplog.records)
