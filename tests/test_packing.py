"""Shared-prompt packing (``shared_prompt_forward``): each prompt once per micro batch, its samples' completions
packed after it behind a block mask, must give the plain forward's log-probs, loss and gradients."""

from __future__ import annotations

import contextlib
import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.passes import packing
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.passes.packing import pack_shared_prompts, packed_shape, packing_pays


@functools.lru_cache(maxsize=1)
def tiny():
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32).eval()


@contextlib.contextmanager
def packed_batches():
    """The packed micro batches the log-prob passes build while inside (a spy on ``pack_shared_prompts``)."""
    import trl_nrollout.passes.logprobs as logprobs_module

    built = []
    real = logprobs_module.pack_shared_prompts

    def spy(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs_module, "pack_shared_prompts", spy)
        yield built


def _batch(seed: int, lengths: list[int], order: list[int], width: int, c: int, vocab: int):
    """Left-padded prompts ``[B, width]`` in ``order`` (indices into ``lengths``), right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab - 5, (n,), generator=g) for n in lengths]
    b = len(order)
    pid = torch.zeros(b, width, dtype=torch.long)
    pm = torch.zeros(b, width, dtype=torch.long)
    for row, k in enumerate(order):
        pid[row, width - lengths[k]:] = prompts[k]
        pm[row, width - lengths[k]:] = 1
    cid = torch.randint(5, vocab - 5, (b, c), generator=g)
    cm = torch.ones(b, c, dtype=torch.long)
    ends = torch.randint(1, c + 1, (b,), generator=g)
    for row in range(b):
        cm[row, ends[row]:] = 0
        cid[row, ends[row]:] = 0
    return pid, pm, cid, cm


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
       data=st.data(), c=st.integers(1, 6))
def test_packed_log_probs_equal_the_plain_forward(seed, lengths, data, c):
    """Any grouping (uneven counts, interleaved order), left padding and right-padded completions: every real
    completion token's log-prob is the plain forward's."""
    model = tiny()
    order = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=8))
    width = max(lengths)
    pid, pm, cid, cm = _batch(seed, lengths, order, width, c, model.config.vocab_size)
    with torch.no_grad():
        ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm], 1)
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        plain = logits[:, width - 1:-1].log_softmax(-1).gather(-1, cid[..., None])[..., 0]
        pk = pack_shared_prompts(pid, pm, cid, pad_token_id=0, dtype=data.draw(st.sampled_from([torch.float32,
                                                                                                    torch.bool])))
        hidden = model.model(input_ids=pk.input_ids, attention_mask=pk.attention_mask,
                             position_ids=pk.position_ids).last_hidden_state
        per_position = model.lm_head(hidden).log_softmax(-1).gather(-1, pk.shift_labels.clamp(min=0)[..., None])
        packed = pk.gather(per_position[..., 0])
    assert torch.isfinite(packed).all()
    assert ((packed - plain).abs() * cm).max() < 2e-5
    rows = len(set(order))
    k = max(order.count(i) for i in set(order))
    assert pk.input_ids.shape == (rows, width - 1 + k * (c + 1))
    assert packed_shape(pid, cid) == (rows, width - 1 + k * (c + 1))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       data=st.data(), micro=st.integers(1, 9), lean=st.booleans())
def test_old_and_reference_passes_with_shared_prompts_equal_the_plain_pass(seed, lengths, data, micro, lean):
    """``compute_log_probs(shared_prompts=True)`` (the old-policy and reference passes): for any grouping, order,
    ragged completions (empty ones too) and micro batch size, the log-probs and entropies are the plain pass's,
    and the packed layout ran wherever it pays; on the lean path (decoder, then the head on completion positions)
    and through the model's own forward (``lean_head=False``: what FSDP runs) alike."""
    model = tiny()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(5, vocab - 5, (n,), generator=g).tolist() for n in lengths]
    order = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=12))
    prompts = [distinct[k] for k in order]
    completions = [torch.randint(5, vocab - 5, (int(torch.randint(0, 8, (1,), generator=g)),),
                                 generator=g).tolist() for _ in order]
    with packed_batches() as calls:
        lean_head = None if lean else False
        plain = compute_log_probs(model, prompts, completions, micro_batch_size=micro, with_entropy=True,
                                  temperature=0.7, lean_head=lean_head)
        assert not calls
        packed = compute_log_probs(model, prompts, completions, micro_batch_size=micro, with_entropy=True,
                                   temperature=0.7, shared_prompts=True, lean_head=lean_head)
    assert torch.allclose(packed.logprobs, plain.logprobs, atol=2e-5)
    assert torch.allclose(packed.entropy, plain.entropy, atol=2e-5)
    expected = 0
    for s in range(0, len(order), micro):
        idx = range(s, min(s + micro, len(order)))
        rows = {tuple(prompts[i]) for i in idx}
        k = max(sum(1 for i in idx if tuple(prompts[i]) == r) for r in rows)
        c = max(max(len(completions[i]) for i in idx), 1)
        width = max(len(prompts[i]) + len(completions[i]) for i in idx)
        length = max(len(prompts[i]) for i in idx) - 1 + k * (c + 1)
        scored = any(completions[i] for i in idx)  # a micro batch of empty completions scores nothing
        expected += len(idx) > 1 and scored and packing_pays(len(idx), width, len(rows), length)
    assert len(calls) == expected


@pytest.mark.slow
def test_reference_pass_at_a_users_size_packs_and_matches_the_plain_pass():
    """64 prompts of 512 tokens x n = 8 with completions of 1-32 tokens, micro batches of 64 samples (8 prompts
    each), as a step at a user's size scores them: the packed pass gives the plain pass's log-probs, ran in every
    micro batch, and runs about a fifth of the tokens."""
    model = tiny()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(5, vocab - 5, (512,), generator=g).tolist() for _ in range(64)]
    prompts = [p for p in distinct for _ in range(8)]
    completions = [torch.randint(5, vocab - 5, (int(torch.randint(1, 33, (1,), generator=g)),),
                                 generator=g).tolist() for _ in prompts]
    with packed_batches() as batches:
        packed = compute_log_probs(model, prompts, completions, micro_batch_size=64, shared_prompts=True)
    plain = compute_log_probs(model, prompts, completions, micro_batch_size=64)
    shapes = [pk.input_ids.shape for pk in batches]
    assert len(shapes) == 8 and all(s[0] == 8 for s in shapes)
    assert sum(s[0] * s[1] for s in shapes) < 0.25 * sum(len(p) + 32 for p in prompts)
    assert torch.allclose(packed.logprobs, plain.logprobs, atol=2e-5)
    assert (plain.logprobs != 0).sum() == sum(len(c) for c in completions)


@pytest.mark.parametrize("attn, mask", [("sdpa", torch.bool), ("eager", torch.float32)])
def test_the_mask_suits_the_attention_implementation(attn, mask):
    """SDPA gets a boolean mask (PyTorch casts it to the queries' dtype under any mixed precision); eager attention,
    which adds its mask to the scores, an additive one in the weights' dtype. Both give the plain pass's
    log-probs."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (30, 24)]
    prompts = [p for p in distinct for _ in range(4)]
    completions = [torch.randint(5, 200, (k,), generator=g).tolist() for k in (3, 5, 1, 6, 2, 6, 4, 5)]
    with packed_batches() as batches:
        packed = compute_log_probs(model, prompts, completions, shared_prompts=True)
    plain = compute_log_probs(model, prompts, completions)
    assert [pk.attention_mask.dtype for pk in batches] == [mask]
    assert torch.allclose(packed.logprobs, plain.logprobs, atol=2e-5)


@given(batch=st.integers(1, 64), width=st.integers(1, 2048), groups=st.integers(1, 64), length=st.integers(1, 8192))
def test_packing_pays_only_with_fewer_tokens_and_no_more_attention(batch, width, groups, length):
    """Packing is chosen only when it saves a quarter of the tokens and adds no attention work."""
    pays = packing_pays(batch, width, groups, length)
    assert pays == (groups * length <= 0.75 * batch * width and groups * length ** 2 <= batch * width ** 2)


def test_a_prompt_starting_with_the_pad_id_is_not_merged_with_a_shorter_one():
    """Left padding is compared as padding: ``[pad, 7]`` (a real pad-id token first) and ``[7]`` padded to
    ``[pad, 7]`` are two prompts, not one."""
    pid = torch.tensor([[0, 7], [0, 7]])
    pm = torch.tensor([[1, 1], [0, 1]])
    cid = torch.tensor([[3], [4]])
    assert packed_shape(pid, cid, pm)[0] == 2
    pk = pack_shared_prompts(pid, pm, cid, pad_token_id=0)
    assert pk.input_ids.shape[0] == 2
    assert packed_shape(pid, cid)[0] == 1  # without the mask the ids alone look alike


def _trainer(tmp_path, peft_config=None, **kw):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, digits_reward, long_prompts, resolve_model
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    path = resolve_model("builtin:tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_dict({"prompt": long_prompts(digits_prompts(8), tok, 96)})
    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_completion_length=12,
                          max_steps=1, save_strategy="no", rollout_backend="hf", train_batch_size=2, rollout_n=4,
                          temperature=1.0, bf16=False, **kw)
    return NRolloutGRPOTrainer(path, reward_funcs=[digits_reward], args=args, train_dataset=data,
                               processing_class=tok, peft_config=peft_config), data


def _loss_and_grads(trainer, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]


@pytest.mark.slow
@pytest.mark.parametrize(("lora", "layout"), [(False, "segments"), (True, "segments"), (False, "rows"),
                                              (True, "rows")])
def test_shared_prompt_forward_gives_the_plain_loss_and_gradients(tmp_path, monkeypatch, lora, layout):
    """One real rollout (2 prompts of ~96 tokens x n=4, HF engine): the loss and every trained parameter's gradient
    are the same with and without packing (a full model, and LoRA adapters through PEFT's forward), and packing did
    run (half the tokens here): ``segments``, the shared-prompt layout alone (``padding_free=False``: fixed-width
    completion segments, one group per row), and ``rows``, the default: padding-free rows whose units are whole
    groups (each prompt once, its completions' real tokens behind it). Mutation (rows): a completion attending to
    its group's other completions (``visible`` without the segment test) -> the loss differs."""
    import trl_nrollout.trainer.update as update_module

    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer, data = _trainer(tmp_path, peft_config=peft, shared_prompt_forward=True,
                             padding_free=False if layout == "segments" else None)
    batch = trainer._generate_and_score_completions([dict(data[i]) for i in range(2) for _ in range(4)])
    batch = trainer.policy_update.add_normalizers([batch], 1)[0]
    calls = []
    if layout == "segments":
        real = update_module.pack_shared_prompts
        monkeypatch.setattr(update_module, "pack_shared_prompts",
                            lambda *a, **kw: calls.append(1) or real(*a, **kw))
    else:
        real = update_module.pack_rows
        monkeypatch.setattr(update_module, "pack_rows",
                            lambda *a, **kw: (calls.append(1) if kw.get("units") else None) or real(*a, **kw))
    packed_loss, packed_grads = _loss_and_grads(trainer, batch)
    assert calls, "the packed forward did not run"
    trainer.args.shared_prompt_forward = trainer.args.padding_free = False
    plain_loss, plain_grads = _loss_and_grads(trainer, batch)
    assert len(calls) == 1
    assert torch.allclose(packed_loss, plain_loss, atol=1e-6, rtol=1e-5)
    for a, b in zip(packed_grads, plain_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in plain_grads)


@pytest.mark.slow
def test_shared_prompt_forward_steps_aside_where_it_cannot_apply(tmp_path, monkeypatch, caplog):
    """Distinct prompts in a micro batch (nothing to share), a block mask over its memory bound and an attention
    implementation that ignores a 4D mask all run the plain forward; the last two say why, once."""
    import trl_nrollout.trainer.update as update_module

    trainer, data = _trainer(tmp_path, shared_prompt_forward=True, padding_free=False)
    batch = trainer._generate_and_score_completions([dict(data[i]) for i in range(2) for _ in range(4)])
    batch = trainer.policy_update.add_normalizers([batch], 1)[0]
    calls = []
    monkeypatch.setattr(update_module, "pack_shared_prompts", lambda *a, **kw: calls.append(1))
    distinct = {k: (v[::4] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}
    trainer._compute_loss(trainer.model, distinct)  # one sample per prompt: no sharing
    assert not calls
    monkeypatch.setattr(packing, "MAX_PACKED_MASK_BYTES", 1024)  # a mask too big to build: said, not built
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer._compute_loss(trainer.model, batch)
    assert not calls
    assert any("block mask would take" in r.message for r in caplog.records)
    caplog.clear()
    trainer.forward_rules.packing_notice_shown = False
    # what the check reads (the model itself keeps SDPA: flash-attention kernels do not exist on this CPU)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    monkeypatch.setattr(trainer.accelerator, "unwrap_model", lambda model: flash)
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer._compute_loss(trainer.model, batch)
        trainer._compute_loss(trainer.model, batch)
    assert not calls
    notes = [r.message for r in caplog.records if "shared_prompt_forward" in r.message]
    assert len(notes) == 1 and "flash_attention_2" in notes[0]
    caplog.clear()
    trainer.forward_rules.packing_notice_shown = False
    trainer.args.shared_prompt_forward = None  # the default: the same note, at INFO level, not as a warning
    with caplog.at_level(logging.INFO, logger="trl_nrollout.trainer"):
        trainer._compute_loss(trainer.model, batch)
    assert not calls
    notes = [r for r in caplog.records if "shared_prompt_forward" in r.message]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "(default)" in notes[0].message


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_shared_prompt_forward_under_zero3_reproduces_the_plain_run(zero3_long_prompt_runs):
    """The recipe in two processes under ZeRO-3 (one forward per micro batch either way, so the partitioned
    parameters are gathered as before), prompts of 80 tokens (where packing pays; the default's short prompts with
    n=8 run plain), the old-policy and reference passes on (a KL loss, no on-policy skip): with packing off, the
    drift from the engine's log-probs, the KL, the rewards, losses and gradient norms of 2 steps are those of the run
    with packing on (the default)."""
    packed, plain = zero3_long_prompt_runs("gathered"), zero3_long_prompt_runs("plain")
    assert len(plain["steps"]) == len(packed["steps"]) == 2
    for a, b in zip(plain["steps"], packed["steps"], strict=True):
        # the old-policy pass (packed in one run, plain in the other) scores the engine's own samples: both agree
        # with the engine's log-probs to float32 noise (a packed position off by one drifts by about 3e-3)
        assert a["rollout_corr/logprob_abs_diff_max"] < 1e-4 and b["rollout_corr/logprob_abs_diff_max"] < 1e-4
        assert a["actor/kl_loss"] == pytest.approx(b["actor/kl_loss"], abs=1e-5)
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


def test_any_configured_sliding_window_keeps_the_plain_layout():
    """Mistral-v0.1 and Phi-3 apply `sliding_window` from the config alone (no layer_types, no use_sliding_window
    flag): a packed row, n completions long, would see past the window, so such a model never packs; Qwen2 with its
    window switched off (its default) and Llama (no window) do."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    from trl_nrollout.passes.packing import structural_reason

    assert structural_reason(MistralConfig(sliding_window=16)) == "the model has sliding-window layers"
    assert structural_reason(Phi3Config(sliding_window=2047)) == "the model has sliding-window layers"
    assert structural_reason(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0)) is not None
    assert structural_reason(Qwen2Config()) is None  # sliding_window=4096 is configured but switched off
    assert structural_reason(MistralConfig(sliding_window=None)) is None
    assert structural_reason(LlamaConfig()) is None


def test_the_mask_bound_counts_what_sdpa_allocates():
    """A boolean block mask of L x L per packed row is 1 byte an entry, but SDPA turns it into an additive copy in the
    queries' dtype (2 bytes under bf16 autocast, 4 in float32) and pads a copy to a multiple of 8 columns when L is
    not one: the bound counts all three, so a micro batch whose boolean mask alone fits but whose copies do not runs
    plain."""
    import torch

    from trl_nrollout.passes import packing
    from trl_nrollout.passes.packing import decide, mask_bytes, query_dtype

    g, length = 3, 100
    assert mask_bytes(g, length, torch.bool, torch.bfloat16) == g * length * (length + 2 * length + 2 * 104)
    assert mask_bytes(g, 96, torch.bool, torch.float32) == g * 96 * (96 + 4 * 96)  # a multiple of 8: no padded copy
    assert mask_bytes(g, length, torch.float32) == g * length * length * 4  # eager: the additive mask itself
    assert query_dtype(torch.float32, "cpu") == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert query_dtype(torch.float32, "cpu") == torch.bfloat16

    prompt = torch.arange(5, 69).repeat(8, 1)  # 8 samples of one 64-token prompt, 12-token completions
    completions = torch.randint(70, 90, (8, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    groups, packed = packing.packed_shape(prompt, completions, mask)
    bool_only = groups * packed * packed
    original = packing.MAX_PACKED_MASK_BYTES
    try:
        packing.MAX_PACKED_MASK_BYTES = bool_only * 2  # the boolean mask fits, with its bf16 copies it does not
        assert decide(prompt, mask, completions, 76, torch.bool, torch.bfloat16)[0] is False
        packing.MAX_PACKED_MASK_BYTES = mask_bytes(groups, packed, torch.bool, torch.bfloat16)
        assert decide(prompt, mask, completions, 76, torch.bool, torch.bfloat16) == (True, None)
    finally:
        packing.MAX_PACKED_MASK_BYTES = original
