"""The micro-batched, token-budgeted log-prob pass: same numbers however it is cut, lean, mode-safe."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, run_cmd, torchrun
from trl_nrollout.passes.logprobs import compute_log_probs, from_padded, pack_by_tokens

TOL = 2e-5


@functools.lru_cache(maxsize=1)
def tiny_model():
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32)


def naive(model, prompts, completions, temperature=1.0):
    """One sample at a time, no padding, a full float32 log-softmax: the obviously-right reference."""
    c_max = max(len(c) for c in completions)
    lp = torch.zeros(len(prompts), c_max)
    ent = torch.zeros(len(prompts), c_max)
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if not c:
                continue
            logits = model(torch.tensor([p + c])).logits[0].float() / temperature
            logp = torch.log_softmax(logits, -1)
            for j, tok in enumerate(c):
                lp[i, j] = logp[len(p) + j - 1, tok]
                ent[i, j] = -(logp[len(p) + j - 1].exp() * logp[len(p) + j - 1]).sum()
    return lp, ent


samples_st = st.lists(
    st.tuples(st.lists(st.integers(3, 380), min_size=1, max_size=9), st.lists(st.integers(3, 380), max_size=8)),
    min_size=1, max_size=9,
).filter(lambda s: any(c for _, c in s))


@settings(max_examples=25, deadline=None)
@given(samples=samples_st, micro=st.integers(1, 10), budget=st.integers(17, 60),
       pad_side=st.sampled_from(["left", "right"]), lean=st.booleans())
def test_any_cut_gives_the_same_logprobs(samples, micro, budget, pad_side, lean):
    model = tiny_model()
    prompts = [p for p, _ in samples]
    completions = [c for _, c in samples]
    ref_lp, ref_ent = naive(model, prompts, completions)
    for kwargs in (dict(micro_batch_size=1), dict(micro_batch_size=micro), dict(),
                   dict(max_token_len=budget), dict(max_token_len=budget, micro_batch_size=micro)):
        out = compute_log_probs(model, prompts, completions, with_entropy=True, pad_side=pad_side, lean_head=lean,
                                **kwargs)
        assert out.logprobs.shape == ref_lp.shape
        assert torch.allclose(out.logprobs, ref_lp, atol=TOL, rtol=0), kwargs
        assert torch.allclose(out.entropy, ref_ent, atol=TOL, rtol=0), kwargs
        # zeros past each completion's end
        for i, c in enumerate(completions):
            assert (out.logprobs[i, len(c):] == 0).all()


def test_temperature_scales_logits_before_softmax():
    model = tiny_model()
    prompts, completions = [[5, 6, 7], [9]], [[10, 11], [12, 13, 14]]
    ref, _ = naive(model, prompts, completions, temperature=0.7)
    out = compute_log_probs(model, prompts, completions, temperature=0.7, micro_batch_size=1)
    assert torch.allclose(out.logprobs, ref, atol=TOL)
    plain = compute_log_probs(model, prompts, completions)
    assert not torch.allclose(out.logprobs, plain.logprobs, atol=1e-3)


def test_token_budget_bounds_every_forward_and_counts_forwards():
    model = tiny_model()
    prompts = [[4] * n for n in (2, 9, 3, 7, 1, 5)]
    completions = [[6] * n for n in (8, 1, 4, 2, 6, 3)]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    shapes: list[tuple[int, int]] = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        out = compute_log_probs(model, prompts, completions, max_token_len=20)
    finally:
        hook.remove()
    assert out.num_forwards == len(shapes) == len(pack_by_tokens(lengths, 20))
    assert all(n * w <= 20 for n, w in shapes)
    assert sum(n for n, _ in shapes) == len(prompts)


def test_only_completion_positions_reach_the_head_in_chunks():
    model = tiny_model()
    prompts = [[5] * 30, [6] * 12]
    completions = [[7] * 4, [8] * 9]
    rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    try:
        compute_log_probs(model, prompts, completions, chunk_rows=5)
    finally:
        hook.remove()
    assert sum(rows) == 13  # the 13 completion tokens, not the 55 positions
    assert max(rows) <= 5


@pytest.mark.parametrize("start_training", [True, False])
def test_mode_is_restored_and_no_grad(start_training):
    model = tiny_model()
    model.train(start_training)
    out = compute_log_probs(model, [[3, 4]], [[5, 6]])
    assert model.training is start_training
    assert not out.logprobs.requires_grad
    model.eval()


def test_pack_by_tokens_partitions_and_respects_limits():
    lengths = [5, 17, 3, 9, 9, 1, 12, 4]
    bins = pack_by_tokens(lengths, 24, max_seqs=3)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 24 and len(b) <= 3 for b in bins)
    with pytest.raises(ValueError, match=r"log_prob_max_token_len_per_device=10 .* at least 17"):
        pack_by_tokens(lengths, 10)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), budget=st.integers(40, 200))
def test_pack_by_tokens_property(lengths, budget):
    bins = pack_by_tokens(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in bins)
    # first-fit decreasing never needs more bins than one per sequence, and no two bins could merge
    assert len(bins) <= len(lengths)
    widths = [max(lengths[i] for i in b) for b in bins]
    for a in range(len(bins)):
        for b in range(a + 1, len(bins)):
            assert (len(bins[a]) + len(bins[b])) * max(widths[a], widths[b]) > budget


def test_from_padded_reads_either_padding_side():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    completion_ids = torch.tensor([[10, 11, 0], [12, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    prompts, completions = from_padded(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert prompts == [[5, 6], [7, 8, 9]]
    assert completions == [[10, 11], [12]]


def test_empty_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one prompt token"):
        compute_log_probs(tiny_model(), [[]], [[5]])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("modes", [["ddp"], ["zero3", "fsdp1", "fsdp2"]], ids=["ddp", "zero3+fsdp1+fsdp2"])
def test_two_processes_match_one(modes, tiny_model_path, tmp_path):
    """Under 2-process DDP, DeepSpeed ZeRO-3 and plain torch FSDP1/FSDP2 (gloo, CPU) the pass gives the
    single-process numbers, in the plain and the shared-prompt layout; ranks with different numbers of micro
    batches do not hang (ZeRO-3 / FSDP gather per
    forward), nor do ranks that need different numbers of output-head chunks (under ZeRO-3 each call of the head
    module gathers its weight; the timeout turns such a hang into a failure). The sharded wrappers share one launch
    (each model wrapped and checked in turn); DDP, accelerate's CPU launch, has its own. Under FSDP1 and FSDP2 the
    distillation teacher's pass (hidden states, padding-free, a 24-token budget) run inside the sharded model's own
    forward equals the plain model's, every rank as many forwards. Mutation tried (that entry): the pass's forwards
    not synced under FSDP (``sync_forwards = is_zero3(inner)``) -> the ranks' gathers no longer pair up, the launch
    hangs -> fails at the timeout."""
    env = {"ACCELERATE_USE_CPU": "1"} if modes == ["ddp"] else {"ACCELERATE_USE_CPU": None}
    run_cmd([*torchrun(2), str(ROOT / "tests/dist/logprobs_dist.py"), ",".join(modes),
             tiny_model_path, str(tmp_path)], timeout=240, env=env)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    full = sum(p.numel() for p in tiny_model().parameters())
    for res in results:
        assert res["world"] == 2 and list(res["modes"]) == modes
    for mode in modes:
        for res in results:
            one = res["modes"][mode]
            assert one["max_abs_diff"] < TOL and one["max_abs_diff_entropy"] < TOL, mode
            assert one["max_abs_diff_mb1_left"] < TOL and one["max_abs_diff_small_head_chunks"] < TOL, mode
            assert one["training_mode_restored"], mode
            # the shared-prompt layout ran in every micro batch (FSDP: through the model's own forward) and matches
            assert one["packed_forwards"] == one["packed_micro_batches"] > 0, mode
            assert one["max_abs_diff_packed"] < TOL and one["max_abs_diff_packed_entropy"] < TOL, mode
        if mode in ("zero3", "fsdp1", "fsdp2"):
            assert results[0]["modes"][mode]["num_forwards"] == results[1]["modes"][mode]["num_forwards"], mode
            assert all(r["modes"][mode]["local_numel_after_wrap"] < full for r in results), mode  # really sharded
        if mode in ("fsdp1", "fsdp2"):  # the distillation teacher's pass inside the sharded model's own forward
            assert all(r["modes"][mode]["max_abs_diff_hidden"] < TOL for r in results), mode
            forwards = [r["modes"][mode]["hidden_forwards"] for r in results]
            assert forwards[0] == forwards[1] > 1, mode
