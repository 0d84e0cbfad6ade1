"""Engine-independent parts of the rollout stage: batch layout, sampling validation, bucketed weight sync
(bounded buckets, tied weights, PEFT merge without touching the base), and the HF engine's output layout."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.rollout import HFEngine, RolloutBatch, SamplingOptions, iter_weight_buckets
from trl_nrollout.rollout.engines.weight_sync import clean_name, plan_buckets


@functools.lru_cache(maxsize=1)
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_nrollout.builtin import resolve_model

    path = resolve_model("builtin:tiny-qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def test_rollout_batch_padded_layout():
    b = RolloutBatch(prompt_ids=[[1, 2, 3], [4]], completion_ids=[[5], [6, 7]], logprobs=[[-0.5], [-1.0, -2.0]],
                     finish_reasons=["stop", "length"], group_index=[0, 1])
    t = b.padded(pad_token_id=0)
    assert t["prompt_ids"].tolist() == [[1, 2, 3], [0, 0, 4]]  # left-padded prompts
    assert t["completion_ids"].tolist() == [[5, 0], [6, 7]]  # right-padded completions
    assert t["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert t["logprobs"].tolist() == [[-0.5, 0.0], [-1.0, -2.0]]
    assert b.num_completion_tokens == 3 and len(b.slice(1, 2)) == 1
    with pytest.raises(ValueError, match="different lengths"):
        RolloutBatch([[1]], [[2]], [], ["stop"], [0])


@pytest.mark.parametrize("bad, match", [
    (dict(max_tokens=0), "max_tokens=0"), (dict(temperature=-1), "temperature=-1"), (dict(top_p=0), "top_p=0"),
    (dict(top_k=0), "top_k=0"), (dict(min_p=2), "min_p=2"),
])
def test_sampling_options_reject_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingOptions(**bad)


def test_buckets_bounded_whole_layers_and_tied_weights():
    model, _ = tiny()
    layer_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    buckets = list(iter_weight_buckets(model, bucket_bytes=layer_bytes))
    names = [n for b in buckets for n, _ in b]
    # every checkpoint name once, tied lm_head included, and the tensors are the model's current values
    assert sorted(names) == sorted(model.state_dict().keys())
    sd = model.state_dict()
    assert all(torch.equal(t, sd[n]) for b in buckets for n, t in b)
    # no bucket splits a decoder layer, and each bucket stays within the bound unless it is one whole group
    for b in buckets:
        layers = {n.split(".")[2] for n, _ in b if n.startswith("model.layers.")}
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= layer_bytes or len(layers) <= 1
    for i in range(2):
        holders = [k for k, b in enumerate(buckets) if any(n.startswith(f"model.layers.{i}.") for n, _ in b)]
        assert len(holders) == 1
    # a huge bound gives one bucket
    assert len(plan_buckets(list(model.named_parameters(remove_duplicate=False)), 1 << 40)) == 1


def test_clean_name_strips_wrappers():
    assert clean_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert clean_name("_fsdp_wrapped_module.model.norm.weight") == "model.norm.weight"


def test_peft_buckets_are_merged_and_leave_base_untouched():
    from peft import LoraConfig, get_peft_model

    base, _ = tiny()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                           init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sent = {n: t.clone() for b in iter_weight_buckets(model, 1 << 16) for n, t in b}
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(sent) == sorted(merged)  # base-model names only, no lora_ tensors
    assert all(torch.allclose(sent[n], merged[n], atol=1e-6) for n in merged)
    assert not torch.allclose(sent["model.layers.0.self_attn.q_proj.weight"],
                              base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_hf_engine_layout_and_logprobs():
    model, tok = tiny()
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], batch_size=2, seed=3)
    prompts = [[5, 6, 7], [8, 9], [10]]
    opts = SamplingOptions(max_tokens=6, temperature=0.9, seed=5)
    batch = engine.generate(prompts, 4, opts, group_offset=10)
    assert len(batch) == 12
    assert batch.group_index == [10 + g for g in range(3) for _ in range(4)]
    assert all(batch.prompt_ids[i] == prompts[i // 4] for i in range(12))
    assert all(1 <= len(c) <= 6 for c in batch.completion_ids)
    assert all((r == "length") == (len(c) == 6 and c[-1] != tok.eos_token_id)
               for r, c in zip(batch.finish_reasons, batch.completion_ids))
    ref = compute_log_probs(model, batch.prompt_ids, batch.completion_ids, temperature=0.9).logprobs
    assert all(abs(ref[i, j].item() - v) < 1e-5 for i, row in enumerate(batch.logprobs) for j, v in enumerate(row))
    again = engine.generate(prompts, 4, opts, group_offset=10)
    assert again.completion_ids == batch.completion_ids  # seeded
    expanded = engine.generate_expanded([p for p in prompts for _ in range(4)], 4, opts, sample_offset=40)
    assert expanded.completion_ids == batch.completion_ids and expanded.group_index == batch.group_index
    with pytest.raises(ValueError, match="whole groups"):
        engine.generate_expanded([[1]] * 5, 4, opts)


def _processed_logprobs(model, prompt: list[int], completion: list[int], temperature: float, penalty: float,
                        banned: int | None = None, top_k: int | None = None, warper=None) -> list[float]:
    """Reference for the HF engine's recorded log-probs, from one plain forward: each position's logits with the
    repetition penalty applied by hand to the tokens seen so far (prompt and earlier completion tokens), a banned
    token masked, divided by the temperature, all but the ``top_k`` largest masked, then ``warper`` (a
    transformers warper, e.g. typical-p) if given, then ``log_softmax`` at the sampled token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    out = []
    for j, token in enumerate(completion):
        row = logits[len(prompt) - 1 + j].clone()
        seen = torch.tensor(sorted(set(prompt + completion[:j])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        if banned is not None:
            row[banned] = float("-inf")
        row = row / temperature
        if top_k is not None:
            row[row < row.topk(top_k).values[-1]] = float("-inf")
        if warper is not None:
            row = warper(torch.tensor([prompt + completion[:j]]), row[None])[0]
        out.append(torch.log_softmax(row, dim=-1)[token].item())
    return out


def test_hf_engine_records_the_sampling_distribution():
    """The log-probs recorded during ``generate`` are those of the distribution each token was drawn from (the
    repetition penalty, temperature, top-k and the typical-p / epsilon / eta cutoffs applied, vLLM's
    ``processed_logprobs``), also behind a user's own logits processor; beam search, which reorders rows, falls
    back to a forward pass (temperature only)."""
    from dataclasses import replace

    from transformers import LogitsProcessor

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 7] = float("-inf")
            return scores

    model, tok = tiny()
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], batch_size=2)
    prompts = [[5, 6, 7, 5], [8, 9], [10, 7, 7]]
    opts = SamplingOptions(max_tokens=8, temperature=0.8, repetition_penalty=1.5, seed=1, ignore_eos=True,
                           engine_kwargs=(("logits_processor", [Ban()]),))
    batch = engine.generate(prompts, 3, opts)
    assert all(7 not in c for c in batch.completion_ids)
    penalised = [_processed_logprobs(model, p, c, 0.8, 1.5, banned=7)
                 for p, c in zip(batch.prompt_ids, batch.completion_ids)]
    assert all(abs(a - b) < 1e-4 for row, ref in zip(batch.logprobs, penalised) for a, b in zip(row, ref))
    plain = compute_log_probs(model, batch.prompt_ids, batch.completion_ids, temperature=0.8).logprobs
    assert max(abs(plain[i, j].item() - v) for i, row in enumerate(batch.logprobs) for j, v in enumerate(row)) > 1e-2

    top5 = engine.generate(prompts, 3, replace(opts, top_k=5, seed=3))  # top-k is in the distribution sampled from
    assert all(abs(a - b) < 1e-4 for p, c, row in zip(top5.prompt_ids, top5.completion_ids, top5.logprobs)
               for a, b in zip(row, _processed_logprobs(model, p, c, 0.8, 1.5, banned=7, top_k=5)))

    # typical-p, epsilon and eta cutoffs given through generation_kwargs (TRL's) are in it too
    from transformers.generation.logits_process import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        TypicalLogitsWarper,
    )

    for name, value, warper in (("typical_p", 0.5, TypicalLogitsWarper(mass=0.5)),
                                ("epsilon_cutoff", 3e-3, EpsilonLogitsWarper(epsilon=3e-3)),
                                ("eta_cutoff", 0.5, EtaLogitsWarper(epsilon=0.5))):
        cut = engine.generate(prompts, 3, replace(opts, seed=4, engine_kwargs=(*opts.engine_kwargs, (name, value))))
        with_cut = [_processed_logprobs(model, p, c, 0.8, 1.5, banned=7, warper=warper)
                    for p, c in zip(cut.prompt_ids, cut.completion_ids)]
        without = [_processed_logprobs(model, p, c, 0.8, 1.5, banned=7) for p, c in zip(cut.prompt_ids,
                                                                                          cut.completion_ids)]
        assert all(abs(a - b) < 1e-4 for row, ref in zip(cut.logprobs, with_cut) for a, b in zip(row, ref)), name
        assert max(abs(a - b) for r1, r2 in zip(with_cut, without) for a, b in zip(r1, r2)) > 1e-2, name

    beams = SamplingOptions(max_tokens=5, temperature=0.0, repetition_penalty=1.5, ignore_eos=True,
                            engine_kwargs=(("num_beams", 2),))
    batch = engine.generate(prompts, 2, beams)
    plain = compute_log_probs(model, batch.prompt_ids, batch.completion_ids, temperature=1.0).logprobs
    assert all(abs(plain[i, j].item() - v) < 1e-5 for i, row in enumerate(batch.logprobs) for j, v in enumerate(row))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hf_engine_prefills_each_prompt_once(monkeypatch, lora):
    """Long prompts: the HF engine runs each prompt's KV cache once and hands it to its n samples. The model embeds
    (n - 1) x (P - 1) fewer tokens per prompt than with n copies prefilled (TRL's way), and the samples and their
    log-probs are the same, ragged prompts (one of a single token) and all; also through a PEFT (LoRA) model,
    whose adapter is not a no-op here."""
    from trl_nrollout.rollout.engines import hf_engine

    model, tok = tiny()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (70, 9, 1, 66)]
    width, groups, n = 70, len(prompts), 3
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], batch_size=8)
    opts = SamplingOptions(max_tokens=6, temperature=0.9, seed=2, ignore_eos=True)
    once = engine.generate(prompts, n, opts)
    tokens_once = sum(embedded)
    embedded.clear()
    monkeypatch.setattr(hf_engine, "PREFILL_ONCE_MIN_TOKENS", 10_000)  # n copies, as generate does by itself
    copies = engine.generate(prompts, n, opts)
    assert sum(embedded) - tokens_once == (n - 1) * groups * (width - 1)
    assert once.completion_ids == copies.completion_ids and once.group_index == copies.group_index
    assert all(abs(a - b) < 1e-5 for r1, r2 in zip(once.logprobs, copies.logprobs) for a, b in zip(r1, r2))
    ref = compute_log_probs(model, once.prompt_ids, once.completion_ids, temperature=0.9).logprobs
    assert all(abs(ref[i, j].item() - v) < 1e-5 for i, row in enumerate(once.logprobs) for j, v in enumerate(row))
    if lora:  # the adapter takes part in the prefill: without it the log-probs differ
        with model.disable_adapter():
            base = compute_log_probs(model, once.prompt_ids, once.completion_ids, temperature=0.9).logprobs
        assert float((base - ref).abs().max()) > 1e-2


@settings(max_examples=25, deadline=None)
@given(target=st.integers(min_value=0, max_value=700), seed=st.integers(min_value=0, max_value=3),
       which=st.integers(min_value=0, max_value=40))
def test_long_prompts_reach_the_length_and_keep_the_question(target, seed, which):
    """The benchmarks' long prompts: never over the target, short of it by less than one more word would add, the
    task's question last, deterministic; a question already that long is left alone."""
    from trl_nrollout.builtin import _WORDS, digits_prompts, long_prompts

    _, tok = tiny()
    text = digits_prompts(41)[which]
    out = long_prompts([text], tok, target, seed=seed)[0]
    length = len(tok(out, add_special_tokens=False)["input_ids"])
    own = len(tok(text, add_special_tokens=False)["input_ids"])
    assert out.endswith(text)
    word = max(len(tok(" " + w, add_special_tokens=False)["input_ids"]) for w in _WORDS)  # up to 5 for the tiny BPE
    assert length <= max(target, own)
    if target <= own + 1:
        assert out == text
    else:
        assert target - length <= word + 1
    assert long_prompts([text], tok, target, seed=seed) == [out]


def test_long_prompts_do_not_share_their_context():
    """Each prompt gets its own context: the engine's prefix cache must not make long prompts look cheap."""
    from trl_nrollout.builtin import digits_prompts, long_prompts

    _, tok = tiny()
    texts = long_prompts(digits_prompts(8), tok, 256)
    heads = {t[:40] for t in texts}
    assert len(heads) == len(texts)


def test_hf_engine_leaves_prefill_once_to_models_whose_generation_config_names_a_cache():
    """Gemma 2 and 3 ship `cache_implementation: "hybrid"` in their generation config; `generate` refuses a prefilled
    `past_key_values` beside it. The engine then lets `generate` build the cache (n copies), and says so in its
    counts, instead of crashing."""
    model, tok = tiny()
    model.generation_config.cache_implementation = "static"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (70, 66)]
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], batch_size=8)
    batch = engine.generate(prompts, 3, SamplingOptions(max_tokens=4, temperature=0.9, seed=2, ignore_eos=True))
    assert [len(c) for c in batch.completion_ids] == [4] * 6
    assert engine.prefill_shared_samples == 0 and engine.generated_samples == 6


def test_engine_seed_mode_seeds_and_restores_numpys_generator():
    """rollout_seed_mode='engine': vLLM's Model Runner V2 (CUDA) draws unseeded requests' seeds from np.random, so
    the engine's seeded block seeds it too (the same draws for one engine, others for another engine, on every
    call alike) and hands the caller's NumPy state back afterwards."""
    import numpy as np

    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    def engine(index: int) -> VLLMEngineGroup:
        group = object.__new__(VLLMEngineGroup)
        group.seed_mode, group.cpu, group.engine_index = "engine", True, index
        return group

    def draws(group: VLLMEngineGroup, seed: int | None = 7) -> list[int]:
        with group.engine_rng(seed):
            return np.random.randint(0, 2**31, size=4).tolist()

    np.random.seed(123)
    expected_next = np.random.RandomState(123).randint(0, 2**31, size=4).tolist()
    first = draws(engine(0))
    assert draws(engine(0)) == first and draws(engine(1)) != first and draws(engine(0), seed=8) != first
    assert np.random.randint(0, 2**31, size=4).tolist() == expected_next  # the caller's stream, untouched
    np.random.seed(123)
    assert draws(engine(0), seed=None) == expected_next  # no seed: the engine leaves NumPy alone
