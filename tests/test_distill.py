"""On-policy distillation inside RL: the teacher term (``teacher_model_name_or_path``, ``teacher_kl_coef``).

The math (hypothesis) and the trainer end to end: a real teacher (the built-in tiny model with its weights moved,
saved locally) scores the sampled tokens in the trainer's reference-pass machinery; with rewards that carry no
signal, each token's advantage must be exactly ``-coef * (student - teacher)`` log-prob of a plain forward of the two
models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.algos.distill import masked_mean, reverse_kl_estimate, teacher_advantages
from trl_nrollout.errors import InputError


def _tensors(seed: int, rows: int, cols: int):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(rows, cols, generator=g)
    s = -torch.rand(rows, cols, generator=g) * 5
    q = -torch.rand(rows, cols, generator=g) * 5
    mask = (torch.rand(rows, cols, generator=g) > 0.3).long()
    return adv, s, q, mask


@pytest.mark.fast
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 5), cols=st.integers(1, 9),
       coef=st.one_of(st.just(0.0), st.floats(0.01, 4.0, allow_nan=False)))
def test_the_teacher_term_moves_each_sampled_token_toward_the_teacher(seed, rows, cols, coef):
    """Off the mask the advantage is unchanged; on it, it moves by ``coef * (teacher - student)``: up where the
    teacher likes the token more than the student, down where less, linearly in ``coef`` (0: unchanged).
    Mutation: ``+ coef * term`` (the sign) or forgetting the mask -> fails."""
    adv, s, q, mask = _tensors(seed, rows, cols)
    out = teacher_advantages(adv, s, q, mask, coef)
    on = mask.bool()
    assert torch.equal(out[~on], adv[~on])
    torch.testing.assert_close(out[on] - adv[on], coef * (q - s)[on], atol=1e-5, rtol=1e-5)
    if coef > 0:
        assert bool(((out > adv) == (q > s))[on & ((q - s).abs() > 1e-3)].all())
    double = teacher_advantages(adv, s, q, mask, 2 * coef)
    torch.testing.assert_close(double - adv, 2 * (out - adv), atol=1e-5, rtol=1e-5)


@pytest.mark.fast
def test_the_reverse_kl_estimate_is_zero_for_the_student_itself_and_negative_coefficients_are_refused():
    adv, s, _, mask = _tensors(3, 4, 6)
    assert masked_mean(reverse_kl_estimate(s, s, mask), mask) == 0.0
    assert masked_mean(adv, torch.zeros_like(mask)) == 0.0
    with pytest.raises(ValueError, match="coefficient must be >= 0"):
        teacher_advantages(adv, s, s, mask, -1.0)


@pytest.mark.fast
def test_teacher_options_without_a_teacher_or_out_of_range_are_refused_with_the_fix(tmp_path):
    from trl_nrollout import NRolloutConfig

    with pytest.raises(InputError, match=r"teacher_kl_coef=0.5 .* teacher_model_name_or_path is not set"):
        NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, teacher_kl_coef=0.5)
    with pytest.raises(InputError, match=r"teacher_kl_coef=-1.0 must be a finite number >= 0"):
        NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, teacher_model_name_or_path="builtin:tiny-qwen2",
                       teacher_kl_coef=-1.0)


@pytest.mark.fast
def test_a_teacher_with_another_vocabulary_is_refused_naming_both():
    from trl_nrollout.trainer.teacher import check_vocabulary

    with pytest.raises(ValueError, match=r"'builtin:small-qwen2' has a vocabulary of 1024 tokens, the policy 384"):
        check_vocabulary("builtin:small-qwen2", SimpleNamespace(vocab_size=1024), SimpleNamespace(vocab_size=384))
    check_vocabulary("same", SimpleNamespace(vocab_size=384), SimpleNamespace(vocab_size=384))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """The built-in tiny model with every weight moved by seeded noise: another distribution, the same tokenizer
    (the drop-in's tests' teacher, one helper)."""
    from tests.assets.distill_train import perturbed_teacher

    return perturbed_teacher(str(tmp_path_factory.mktemp("teacher")))


def _plain_logps(model, batch: dict, temperature: float) -> torch.Tensor:
    """Each sample's sampled-token log-probs by a plain forward of ``model`` over its unpadded prompt and
    completion, laid out as the batch's completions ``[B, C]`` (0 on padding)."""
    out = torch.zeros(batch["completion_ids"].shape)
    with torch.no_grad():
        for i in range(out.shape[0]):
            p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
            c = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
            logits = model(torch.cat([p, c]).unsqueeze(0)).logits[0, len(p) - 1:-1].float() / temperature
            out[i, :len(c)] = torch.log_softmax(logits, -1).gather(1, c.unsqueeze(1)).squeeze(1)
    return out


def capturing_trainer(seen: list, teacher=None):
    """``NRolloutGRPOTrainer`` that appends to ``seen``, per step, the batch's tensors and the sampled tokens'
    log-probs by plain forwards of the student and of the teacher ``[B, C]`` (:func:`_plain_logps`; ``teacher``: the
    teacher model to compare with, default the trainer's own)."""
    from trl_nrollout import NRolloutGRPOTrainer

    class Capture(NRolloutGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            student = self.accelerator.unwrap_model(self.model)
            seen.append(({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)},
                         _plain_logps(student, batch, self.temperature),
                         _plain_logps(teacher if teacher is not None else self.teacher.model, batch,
                                      self.temperature)))
            return batch

    return Capture


@pytest.mark.vllm
def test_with_rewards_off_each_tokens_advantage_is_the_teachers_pull_from_its_own_engine(teacher_dir, tmp_path):
    """Rewards without signal (all 0: GRPO's advantages are 0) and a teacher served by a vLLM engine of its own
    (``teacher_backend='vllm'``: ``prompt_logprobs`` over prompt + completion; the student samples on the HF engine,
    so one engine in this process), at temperature 0.7 (the engine serves the teacher with its head divided by 0.7:
    vLLM scores from raw logits): the batch's teacher log-probs equal a plain fp32 forward of the teacher at 0.7 (1e-4),
    and each sampled token's advantage is ``-coef * (student - teacher)`` of plain forwards of the two models
    (padding 0); ``distill/reverse_kl`` is logged; no teacher weights are loaded in the trainer. Mutations: the
    term's sign or scale, the engine's log-probs read one position off, the old-policy pass skipped on-policy (the
    term would read None); the copy's head not divided (``head.weight.detach() / 1.0``) -> fails."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout import NRolloutConfig
    from trl_nrollout.builtin import digits_dataset

    seen: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
    coef = 0.7
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    args = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=4, rollout_n=2, max_completion_length=6,
                          max_steps=2, rollout_backend="hf", report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no", logging_steps=1, learning_rate=1e-2, seed=3,
                          teacher_model_name_or_path=teacher_dir, teacher_kl_coef=coef, teacher_backend="vllm",
                          temperature=0.7)
    trainer = capturing_trainer(seen, teacher)("builtin:tiny-qwen2", args=args, train_dataset=digits_dataset(16),
                                               reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    assert trainer.teacher_model is None and trainer.teacher.engine is not None
    trainer.train()
    trainer.close()
    assert len(seen) == 2
    for batch, student, teacher_logps in seen:
        mask = batch["completion_mask"].bool()
        torch.testing.assert_close(batch["teacher_per_token_logps"][mask], teacher_logps[mask], atol=1e-4, rtol=1e-4)
        assert bool((student - teacher_logps)[mask].abs().max() > 1e-2)  # the two models differ on these tokens
        torch.testing.assert_close(batch["advantages"][mask], -coef * (student - teacher_logps)[mask], atol=1e-4,
                                   rtol=1e-4)
        assert torch.equal(batch["advantages"][~mask], torch.zeros_like(batch["advantages"][~mask]))
    logged = [h["distill/reverse_kl"] for h in trainer.state.log_history if "distill/reverse_kl" in h]
    assert len(logged) == 2
    batch, student, teacher_logps = seen[0]
    mask = batch["completion_mask"].bool()
    assert logged[0] == pytest.approx(float((student - teacher_logps)[mask].mean()), abs=1e-4)


@pytest.mark.fast
def test_a_teacher_engine_without_a_teacher_unknown_or_with_rollout_ranks_is_refused(tmp_path):
    """``teacher_backend='vllm'`` needs a teacher, takes 'trainer' or 'vllm' (any temperature: its engine serves a
    copy of the teacher with its head divided by the temperature), and is refused with rollout ranks when the config is built (before the
    launch splits): each refused naming the option and the fix. Mutation tried (the rollout-rank rule): the rule
    removed from ``rollout_ranks_refusal`` -> the single-process message instead -> fails."""
    from trl_nrollout import NRolloutConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True)
    NRolloutConfig(**base, teacher_model_name_or_path="builtin:tiny-qwen2", teacher_backend="vllm", temperature=0.7)
    with pytest.raises(InputError, match=r"teacher_backend='vllm' .* teacher_model_name_or_path is not set"):
        NRolloutConfig(**base, teacher_backend="vllm")
    with pytest.raises(InputError, match=r"teacher_backend='engine' is not one of \['trainer', 'vllm'\]"):
        NRolloutConfig(**base, teacher_model_name_or_path="builtin:tiny-qwen2", teacher_backend="engine")
    with pytest.raises(InputError, match=r"teacher_backend='vllm' with rollout_ranks=1: .* trainer ranks hold no "
                                         r"engine .* Use teacher_backend='trainer' with rollout ranks"):
        NRolloutConfig(**base, teacher_model_name_or_path="builtin:tiny-qwen2", teacher_backend="vllm",
                       rollout_ranks=1)
    NRolloutConfig(**base, teacher_model_name_or_path="builtin:tiny-qwen2", teacher_backend="vllm")
    from trl_nrollout.config.checks import rollout_ranks_refusal  # the teacher in the trainers: not refused

    assert rollout_ranks_refusal(SimpleNamespace(rollout_ranks=1, rollout_backend="vllm", teacher_backend="trainer")) \
        is None


@pytest.mark.fast
def test_the_teacher_engines_copy_at_a_temperature_divides_the_head_only(teacher_dir, tmp_path):
    """``scaled_head_teacher``: the copy the teacher's engine serves at temperature 0.7 gives the teacher's logits
    divided by 0.7 (1e-5) on the same tokens, its embeddings untouched (the built-in head is tied: the copy unties
    it), and a second call reuses the copy. Mutation tried: the tied head divided in place
    (``head.weight.data /= temperature``, embeddings divided too) -> fails."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.trainer.teacher import scaled_head_teacher

    folder = scaled_head_teacher(teacher_dir, 0.7, str(tmp_path))
    plain = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    copy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert plain.config.tie_word_embeddings and not copy.config.tie_word_embeddings
    ids = torch.tensor([[3, 17, 5, 40, 9, 11, 2]])
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, plain(ids).logits / 0.7, atol=1e-5, rtol=1e-5)
    assert torch.equal(copy.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    stamp = (tmp_path / "temperature_0.7" / "config.json").stat().st_mtime_ns
    assert scaled_head_teacher(teacher_dir, 0.7, str(tmp_path)) == folder
    assert (tmp_path / "temperature_0.7" / "config.json").stat().st_mtime_ns == stamp


def test_a_teacher_engine_for_a_vision_language_policy_is_refused_before_any_engine_starts(tmp_path, monkeypatch):
    """``teacher_backend='vllm'`` scores text samples; a vision-language policy's can carry images: the trainer's build
    refuses it (the option, the value, the rule, the fix) before the rollout engine or the teacher's starts, not at
    the first step. Mutation tried: the build's check removed (the step's check left) -> the build goes on to start
    the engines (here: the patched start raises) -> fails."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import image_dataset
    from trl_nrollout.trainer import engines, teacher

    def no_start(*args, **kwargs):
        raise AssertionError("an engine started before the refusal")

    monkeypatch.setattr(engines.EngineSetup, "start", no_start)
    monkeypatch.setattr(teacher, "start_teacher_engine", no_start)
    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", rollout_backend="hf",
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                          teacher_model_name_or_path="builtin:tiny-idefics3", teacher_backend="vllm")
    with pytest.raises(InputError, match=r"teacher_backend='vllm' with a vision-language policy .* scores text "
                                         r"samples only .* Use teacher_backend='trainer'"):
        NRolloutGRPOTrainer("builtin:tiny-idefics3", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=args, train_dataset=image_dataset(4))


@pytest.mark.vllm
def test_an_endpoint_agents_calls_each_get_the_teachers_pull_stale_ones_included(teacher_dir, tmp_path):
    """A black-box agent distilled: an endpoint agent of two calls per episode (an edited history splits some
    episodes into a row per call), on vLLM with partial rollouts (episodes continue across a weight sync) and rewards
    without signal. Every recorded call's row gets the teacher's log-probs of a plain teacher forward, and its tokens'
    advantages are ``-coef * (student - teacher)`` with the *current* student's log-probs (a plain forward of the
    weights being trained), not the engine's behaviour log-probs a stale call was drawn with: the stale sample is
    scored by the policy that trains on it and corrected by the decoupled loss as rewards are. Mutations tried: the
    term read from ``sampling_per_token_logps`` (the behaviour policy) -> the stale rows fail; the teacher skipped
    for split rows -> fails."""
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.builtin import tool_dataset

    async def agent(client, row):
        first = await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=6)
        text = first.choices[0].message.content or ""
        messages = row["prompt"] + [first.choices[0].message.model_dump(exclude_none=True)]
        if len(text) % 2:  # an edited history: a new conversation (the episode splits into a row per call)
            messages = [{"role": "user", "content": "Once more: " + row["prompt"][-1]["content"]}]
        else:
            messages = messages + [{"role": "user", "content": "Once more."}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        return 0.0

    seen: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
    coef = 0.5
    args = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=4, rollout_n=4, max_completion_length=8,
                          max_steps=3, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                          logging_steps=1, learning_rate=1e-2, rollout_partial=True,
                          teacher_model_name_or_path=teacher_dir, teacher_kl_coef=coef)
    trainer = capturing_trainer(seen)("builtin:tiny-qwen2", args=args, train_dataset=tool_dataset(32), agent=agent)
    trainer.train()
    trainer.close()
    assert len(seen) == 3
    stale = 0
    for batch, student, teacher in seen:
        mask = batch["completion_mask"].bool()
        torch.testing.assert_close(batch["teacher_per_token_logps"][mask], teacher[mask], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch["advantages"][mask], -coef * (student - teacher)[mask], atol=1e-4,
                                   rtol=1e-4)
        behaviour = batch["sampling_per_token_logps"]
        stale += int(((behaviour - student).abs() * mask).amax(1).gt(1e-3).sum())
    assert stale > 0  # calls drawn by an older policy trained here (the property is about them)
    assert any(h.get("agent/split_episodes", 0) > 0 for h in trainer.state.log_history)
