"""No TRL option is silently ignored (:mod:`trl_nrollout.config.trl_options`): every field GRPOConfig adds to TrainingArguments
and every GRPOTrainer argument is honored, mapped onto a verl option, or refused at construction with an error
naming it. This walks TRL 1.16's actual fields, so a TRL upgrade that adds one fails here until it is classified."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch
from transformers import TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from trl_nrollout.config import NRolloutConfig
from trl_nrollout.config.trl_options import TRAINER_ARGS, TRL_OPTIONS, UnsupportedTRLOption

TRL_FIELDS = [f for f in fields(GRPOConfig) if f.name not in {g.name for g in fields(TrainingArguments)}]
REFUSED = [name for name, (status, _, _) in TRL_OPTIONS.items() if status == "refused"]


def cfg(tmp_path, **kw) -> NRolloutConfig:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, rollout_backend="hf",
                per_device_train_batch_size=4, num_generations=4)
    return NRolloutConfig(**{**base, **kw})


def test_every_grpo_config_field_is_classified():
    names = {f.name for f in TRL_FIELDS}
    assert names - set(TRL_OPTIONS) == set(), "classify these in trl_nrollout/config/trl_options.py"
    assert set(TRL_OPTIONS) - names == set(), "options that GRPOConfig no longer has"


def test_every_grpo_trainer_argument_is_classified():
    ours = set(inspect.signature(__import__("trl_nrollout.trainer", fromlist=["x"]).NRolloutGRPOTrainer.__init__)
               .parameters) - {"self", "kwargs"}
    theirs = set(inspect.signature(GRPOTrainer.__init__).parameters) - {"self"}
    # every one named by our constructor and honored (quantization_config goes through **kwargs to TRL)
    assert theirs - ours == {"quantization_config"}
    assert set(TRAINER_ARGS) <= ours


def _non_neutral(name: str, neutral):
    default = next(f for f in TRL_FIELDS if f.name == name)
    if isinstance(neutral, bool):
        return not neutral
    if isinstance(neutral, int | float) and not isinstance(neutral, bool):
        return neutral + 1.5
    if neutral is None:
        return {"router_aux_loss_coef": 0.01}.get(name, 2)
    assert isinstance(neutral, str), (name, default)
    return "something_else"


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_option_is_an_error_naming_it(name, tmp_path):
    _, neutral, why = TRL_OPTIONS[name]
    value = _non_neutral(name, neutral)
    with pytest.raises(UnsupportedTRLOption) as err:
        cfg(tmp_path, **{name: value})
    assert f"{name}={value!r} is not supported" in str(err.value) and why in str(err.value)
    cfg(tmp_path, **{name: neutral})  # TRL's default is accepted


def test_mapped_options(tmp_path):
    assert cfg(tmp_path, scale_rewards="none").norm_adv_by_std_in_grpo is False
    assert cfg(tmp_path, scale_rewards=False).norm_adv_by_std_in_grpo is False
    assert cfg(tmp_path, scale_rewards="batch").adv_estimator_kwargs == {"std_scope": "batch"}
    assert cfg(tmp_path).norm_adv_by_std_in_grpo is True
    with pytest.raises(ValueError, match="scale_rewards='none' applies to adv_estimator='grpo' only"):
        cfg(tmp_path, scale_rewards="none", adv_estimator="rloo")
    assert cfg(tmp_path, vllm_max_model_length=900, rollout_backend="auto").rollout_max_model_len == 900
    with pytest.raises(ValueError, match="vllm_max_model_length=900 conflicts with rollout_max_model_len=800"):
        cfg(tmp_path, vllm_max_model_length=900, rollout_max_model_len=800, rollout_backend="auto")
    c = cfg(tmp_path, use_vllm=True, rollout_backend="auto")
    assert (c.rollout_backend, c.rollout_is, c.rollout_is_mode, c.rollout_is_threshold) == ("vllm", "sequence",
                                                                                           "mask", 3.0)
    c = cfg(tmp_path, use_vllm=True, rollout_backend="auto", vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=5.0)
    assert (c.rollout_is, c.rollout_is_mode, c.rollout_is_threshold) == ("token", "truncate", 5.0)
    assert cfg(tmp_path, use_vllm=True, rollout_backend="auto",
               vllm_importance_sampling_correction=False).rollout_is is None


def test_a_plain_grpo_config_keeps_trls_loss_details(tmp_path):
    from trl_nrollout.trainer.grpo import to_nrollout_config

    c = to_nrollout_config(GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                      beta=0.04, use_cpu=True, report_to="none"))
    assert (c.beta, c.kl_loss_type, c.use_bias_correction_kl, c.clip_ratio_c) == (0.04, "k3", True, None)
    c = to_nrollout_config(GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                      loss_type="dr_grpo", use_cpu=True, report_to="none"))
    assert (c.policy_loss_mode, c.loss_agg_mode) == ("vanilla", "seq-mean-token-sum-norm")


def test_steps_per_generation_conflict_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="steps_per_generation=3 conflicts"):
        cfg(tmp_path, train_batch_size=8, rollout_n=4, steps_per_generation=3, per_device_train_batch_size=8,
            num_generations=8)


@pytest.mark.slow
def test_moe_router_aux_loss_is_added_as_trl_adds_it(tmp_path, monkeypatch):
    """A tiny Qwen2-MoE: TRL adds the router's load-balancing loss (router_aux_loss_coef=None: the model's own
    coefficient, 0.0: none); so do we. Both trainers log `aux_loss` on the same model, data and seed: the values are
    of the same size (about 1 for a random router: experts x sum of fraction x probability); with 0.0 it is off."""
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from tests.conftest import save_tiny_model
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    folder = save_tiny_model(tmp_path / "moe", moe=True, router_aux_loss_coef=0.5)
    logged = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=2, use_cpu=True, report_to="none", bf16=False,
                          save_strategy="no", logging_steps=1, seed=3)
        trainer = cls(model=folder, reward_funcs=[digits_reward], args=args, train_dataset=digits_dataset(16))
        assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5  # the model's own coefficient
        trainer.train()
        logged[name] = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
    assert len(logged["ours"]) == len(logged["trl"]) == 2
    for ours, theirs in zip(logged["ours"], logged["trl"]):
        assert 0.5 < ours < 4 and 0.5 < theirs < 4 and abs(ours - theirs) < 0.5
    off = NRolloutGRPOTrainer(folder, reward_funcs=[digits_reward], train_dataset=digits_dataset(16),
                              args=cfg(tmp_path / "off", router_aux_loss_coef=0.0))
    assert not off.aux_loss_enabled


@pytest.mark.slow
def test_log_completions_writes_trls_table(tmp_path, monkeypatch):
    """log_completions=True: both trainers save TRL's completions table (parquet) after each logged step, with the
    same columns (step, prompt, completion, each reward function, log_extra columns, advantage) and one row per
    sample of the step; ours holds our samples, their rewards and advantages."""
    import pandas as pd
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digit_fraction, digits_dataset, resolve_model

    def reward(completions, log_extra, **kwargs):
        log_extra("chars", [len(c) for c in completions])
        return [digit_fraction(c) for c in completions]

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    tables = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=6, max_steps=2, use_cpu=True, report_to="none", save_strategy="no",
                          logging_steps=1, log_completions=True, num_completions_to_print=2, seed=0)
        trainer = cls(model="builtin:tiny-qwen2" if name == "ours" else resolve_model(
            "builtin:tiny-qwen2"), reward_funcs=[reward], args=args, train_dataset=digits_dataset(16))
        trainer.train()
        tables[name] = pd.read_parquet(tmp_path / name / "completions" / "completions_00002.parquet")
    ours, theirs = tables["ours"], tables["trl"]
    assert list(ours.columns) == list(theirs.columns) == ["step", "prompt", "completion", "reward", "chars",
                                                          "advantage"]
    assert len(ours) == len(theirs) == 8
    assert (ours["chars"] == ours["completion"].str.len()).all()  # log_extra's values stay with their samples
    assert ours["reward"].tolist() == [digit_fraction(c) for c in ours["completion"]]
    for group in range(2):  # GRPO advantages: zero-mean within each group of 4
        assert abs(ours["advantage"][group * 4:(group + 1) * 4].sum()) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_generation_kwargs_reach_the_engine(backend, tmp_path, monkeypatch):
    """TRL's generation_kwargs go to the engine's sampler as TRL passes them: vLLM SamplingParams fields on the vLLM
    engine (here allowed_token_ids), generate() arguments on the HF engine (suppress_tokens). Keys the rollout stage
    owns are an error naming the option to use."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    allowed = sorted({tok.convert_tokens_to_ids(t) for t in "0123456789"} | {tok.eos_token_id})
    others = [i for i in range(len(tok)) if i not in allowed]
    kwargs = {"allowed_token_ids": allowed} if backend == "vllm" else {"suppress_tokens": others}
    if backend == "hf":
        monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                      use_vllm=backend == "vllm", vllm_importance_sampling_correction=False, generation_kwargs=kwargs)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(16))
    batch = trainer._generate_and_score_completions([dict(digits_dataset(2)[i]) for i in range(2) for _ in range(4)])
    used = set(batch["completion_ids"][batch["completion_mask"].bool()].tolist())
    trainer.close()
    assert used and used <= set(allowed)  # a random model writes letters (reward ~0.03) unless the engine is told
    with pytest.raises(ValueError, match="generation_kwargs sets 'max_tokens'.*max_completion_length"):
        cfg(tmp_path, generation_kwargs={"max_tokens": 3})


@pytest.mark.slow
def test_optimizer_steps_holding_part_of_a_group_as_trl(tmp_path, monkeypatch):
    """TRL accepts per_device_train_batch_size=2 with num_generations=4 and steps_per_generation=2: each rollout is
    one group of 4, trained in two optimizer steps of 2 samples (advantages computed over the whole group first).
    Ours accepts it too and trains the same way: same optimizer steps, rollouts every second step, and the
    advantages of each rollout sum to zero over its group (GRPO)."""
    from trl import GRPOConfig, GRPOTrainer

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    runs = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, num_generations=4,
                          steps_per_generation=2, max_completion_length=6, max_steps=4, use_cpu=True,
                          report_to="none", save_strategy="no", logging_steps=1, seed=0, learning_rate=1e-3)
        trainer = cls(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[digits_reward], args=args,
                      train_dataset=digits_dataset(16))
        trainer.train()
        runs[name] = trainer
    ours, theirs = runs["ours"], runs["trl"]
    assert ours.state.global_step == theirs.state.global_step == 4
    assert ours.layout.optimizer_steps_per_rollout == 2 and ours.layout.mini_batch_samples == 2
    losses = {k: [h["loss"] for h in t.state.log_history if "loss" in h] for k, t in runs.items()}
    assert len(losses["ours"]) == len(losses["trl"]) == 4
    rollouts = [h for h in ours.state.log_history if "timing_s/gen" in h]
    assert len(rollouts) == 2  # one generation per two optimizer steps, as TRL's steps_per_generation says
    batch = ours._generate_and_score_completions([dict(digits_dataset(1)[0])] * 4)
    assert abs(batch["advantages"][:, 0].sum().item()) < 1e-5  # the whole group's baseline, not a half's


@pytest.mark.slow
@pytest.mark.vllm
def test_structured_outputs_regex_on_the_vllm_engine(tmp_path, monkeypatch):
    """vllm_structured_outputs_regex constrains our vLLM engines as it does TRL's; the HF engine refuses it (TRL
    would ignore it there); cache_implementation reaches the HF engine's generate()."""
    from trl import GRPOConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    def config(**kw):
        return GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=6, max_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                          **kw)

    trainer = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], train_dataset=digits_dataset(8),
                                  args=config(use_vllm=True, vllm_importance_sampling_correction=False,
                                              vllm_structured_outputs_regex="[0-9]{3}"))
    batch = trainer._generate_and_score_completions([dict(digits_dataset(2)[i]) for i in range(2) for _ in range(4)])
    texts = trainer.processing_class.batch_decode(
        [ids[m.bool()] for ids, m in zip(batch["completion_ids"], batch["completion_mask"])], skip_special_tokens=True)
    assert all(len(t) == 3 and t.isdigit() for t in texts), texts
    trainer.close()
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    with pytest.raises(UnsupportedTRLOption, match="vllm_structured_outputs_regex='.*' needs the vLLM engine"):
        NRolloutGRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], train_dataset=digits_dataset(8),
                            args=config(vllm_structured_outputs_regex="[0-9]+"))
    hf = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], train_dataset=digits_dataset(8),
                             args=config(cache_implementation="static"))
    assert ("cache_implementation", "static") in hf._sampling("train").engine_kwargs
    out = hf._generate_and_score_completions([dict(digits_dataset(1)[0])] * 4)
    assert out["completion_ids"].shape[0] == 4


def test_pad_to_multiple_of_pads_every_scoring_forward_and_changes_no_value():
    """TRL's ``pad_to_multiple_of``: the log-prob passes (plain and shared-prompt layouts) and the critic's value pass
    run forwards whose sequence length is a multiple of it, and give the same log-probs and values as unpadded ones
    (the extra columns are masked padding)."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.passes.critic import build_critic, compute_values
    from trl_nrollout.passes.logprobs import compute_log_probs

    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32)
    long_prompt, short_prompt = list(range(5, 45)), [50, 51, 52]
    prompts = [long_prompt] * 4 + [short_prompt] * 2  # the n samples of a prompt share it: the packed layout pays
    completions = [[60, 61, 62], [63, 64], [65, 66, 67, 68, 69], [70], [71, 72], [73, 74, 75]]
    widths: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    seen = {}
    for shared in (False, True):
        widths.clear()
        plain = compute_log_probs(model, prompts, completions, shared_prompts=shared).logprobs
        seen[shared] = list(widths)
        widths.clear()
        padded = compute_log_probs(model, prompts, completions, shared_prompts=shared, pad_to_multiple_of=8).logprobs
        assert widths and all(w % 8 == 0 for w in widths), widths
        torch.testing.assert_close(padded, plain, atol=2e-5, rtol=0)
    assert seen[True] != seen[False] and all(w % 8 for w in seen[False] + seen[True])  # packed, and not aligned
    hook.remove()
    critic = build_critic(resolve_model("builtin:tiny-qwen2"), seed=1, dtype=torch.float32)
    widths.clear()
    hook = critic.model.embed_tokens.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    values = compute_values(critic, prompts, completions, pad_token_id=0)
    padded = compute_values(critic, prompts, completions, pad_token_id=0, pad_to_multiple_of=16)
    assert widths[0] % 16 and widths[1] % 16 == 0
    torch.testing.assert_close(padded, values, atol=2e-5, rtol=0)
    hook.remove()


@pytest.mark.slow
def test_pad_to_multiple_of_shapes_the_rollout_tensors_and_the_update_as_trl(tmp_path, monkeypatch):
    """With ``pad_to_multiple_of=8`` the rollout tensors (prompts, completions and every per-token field) and every
    forward of the update have widths that are multiples of 8, as TRL pads them; a step trains to a finite loss."""
    from trl import GRPOConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=5, max_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                      pad_to_multiple_of=8, logging_steps=1, beta=0.1)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(16))
    batch = trainer._generate_and_score_completions([dict(digits_dataset(2)[i]) for i in range(2) for _ in range(4)])
    per_token = {k: v.shape for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
    assert {"prompt_ids", "completion_ids", "advantages", "ref_per_token_logps"} <= set(per_token)
    assert all(shape[1] % 8 == 0 for shape in per_token.values()), per_token
    assert batch["completion_ids"].shape[1] == 8 and batch["completion_mask"].sum(-1).max() <= 5  # padded up
    widths: list[int] = []
    embed = trainer.model.get_input_embeddings()
    embed.register_forward_hook(lambda mod, a, out: widths.append(a[0].shape[1]) if torch.is_grad_enabled() else None)
    trainer.train()
    assert widths and all(w % 8 == 0 for w in widths), widths  # the update's forwards (with gradient)
    assert torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])).all()


@pytest.mark.slow
def test_resume_true_passes_over_a_damaged_checkpoint_in_the_recipe_and_the_trainer(tmp_path, monkeypatch, caplog):
    """A real run's two checkpoints, the newest one's model.safetensors cut short (a disk that filled up, a copy that
    did not finish): `resume_from_checkpoint=true` resumes from the older one with a warning naming the damaged file,
    in the recipe and in the drop-in class's ``trainer.train(resume_from_checkpoint=True)`` (transformers'
    get_last_checkpoint took the newest folder and failed in safetensors); a path to the damaged one is an error
    naming the file, in both, before anything loads."""
    import logging
    import os

    from transformers import TrainerCallback

    import trl_nrollout.trainer.grpo as trainer_module
    from tests.conftest import launch, load_recipe
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward
    from trl_nrollout.errors import InputError

    small = ["--rollout_backend", "hf", "--train_batch_size", "2", "--rollout_n", "4", "--max_completion_length", "6"]
    out = tmp_path / "run"
    launch(out, *small, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1")
    older, newest = out / "checkpoint-1", out / "checkpoint-2"
    weights = newest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    damaged = (rf"checkpoint-2' is a damaged checkpoint: .*checkpoint-2/model.safetensors cannot be read \(it holds "
               rf"{weights.stat().st_size} bytes but its header describes \d+ \(it was cut short\)\)\. Resume from "
               r"another checkpoint \(checkpoint-1 beside it\)")
    with pytest.raises(InputError, match=damaged):  # the recipe: before the model loads
        load_recipe().main(["--output_dir", str(out), "--use_cpu", "true", *small, "--resume_from_checkpoint",
                            str(newest)])

    def skipped_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()
                and f"{weights}: it holds" in r.getMessage() and f"resuming from {older}" in r.getMessage()]

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = NRolloutConfig(output_dir=str(out), use_cpu=True, report_to="none", rollout_backend="hf",
                          train_batch_size=2, rollout_n=4, max_completion_length=6, max_steps=2, save_strategy="no",
                          learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=1, seed=42)
    trained = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained.append(state.global_step)

    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(16), callbacks=[Steps()])
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer.checkpoints"):
        trainer.train(resume_from_checkpoint=True)  # the drop-in class, as a TRL script calls it
    assert len(skipped_warnings()) == 1
    assert trained == [2]  # step 1 came from checkpoint-1
    with pytest.raises(InputError, match=damaged):
        trainer.train(resume_from_checkpoint=str(newest))
    trainer.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer.checkpoints"):
        resumed = launch(out, *small, "--max_steps", "2", "--save_strategy", "no", "--resume_from_checkpoint", "true")
    assert len(skipped_warnings()) == 1
    assert resumed["summary"]["resumed_from"] == str(older) and resumed["summary"]["steps_trained"] == 1


class _CountingEnv:
    """A TRL environment with one tool (routing by the dataset's `environment` column picks it)."""

    def reset(self, **row) -> None:
        self.calls = 0

    def count(self) -> str:
        """Counts a call.

        Returns:
            The number of calls so far, as digits.
        """
        self.calls += 1
        return str(self.calls)


@pytest.mark.slow
def test_an_unknown_environment_is_refused_in_trls_words(tmp_path, monkeypatch):
    """Users and tests match TRL's error for a sample that names an environment environment_factory does not have:
    TRL's GRPOTrainer and ours, on the same model, factories and sample, raise a message that starts with the same
    words (ours adds a fix)."""
    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.builtin import resolve_model, tool_dataset

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    model = resolve_model("builtin:tiny-qwen2-tools")
    dataset = tool_dataset(8).map(lambda row: {"environment": "counter"})
    row = {**dict(dataset[0]), "environment": "calculator"}
    messages = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, max_steps=1, use_cpu=True, report_to="none", save_strategy="no")
        trainer = cls(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                      train_dataset=dataset, environment_factory={"counter": _CountingEnv})
        with pytest.raises(ValueError) as err:
            trainer._generate_and_score_completions([row] * 4)
        messages[name] = str(err.value)
    assert "which is not among the environments passed to `environment_factory`" in messages["trl"]
    assert messages["ours"].startswith(messages["trl"]), messages
    assert "Fix the dataset's `environment` column" in messages["ours"]
