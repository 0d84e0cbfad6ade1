"""Padding-free rows (:mod:`trl_nrollout.passes.padfree`): the layout's arithmetic (properties) and, on the tiny
built-in model, that a packed row gives each sample the log-probs of its own unpadded forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.passes.padfree import (
    balanced_parts,
    block_causal_mask,
    budget_count,
    budgeted_parts,
    choose_units,
    pack_rows,
    padded_budget_count,
    row_bins,
    shared_units,
    unit_lengths,
    unpad,
    workload,
)
from trl_nrollout.passes.varlen import VARLEN_NAME, register

lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(lengths_st, st.integers(0, 40))
def test_rows_hold_every_sample_once_within_the_row_length(lengths, extra):
    row_len = max(lengths) + extra
    rows = row_bins(lengths, row_len)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= row_len for r in rows)
    # first fit leaves at most one row half empty or less: rows <= 2 x total / row_len + 1
    assert len(rows) <= 2 * sum(lengths) / row_len + 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=30), st.integers(1, 8))
def test_balanced_parts_cover_the_items_evenly(weights, k):
    parts = balanced_parts(weights, k)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
    if len(weights) >= k:
        assert all(parts)
    loads = [sum(weights[i] for i in p) for p in parts]
    # longest-processing-time: the heaviest part is at most the mean plus the heaviest item
    assert max(loads) <= sum(weights) / k + max(weights) + 1e-9


@settings(max_examples=300, deadline=None)
@given(lengths_st, st.integers(0, 60), st.integers(0, 3))
def test_budgeted_parts_are_as_many_as_asked_each_within_the_budget(lengths, extra, more):
    """Every data-parallel rank runs ``count`` micro batches (the busiest rank's :func:`budget_count`), each at
    most the budget's real tokens, whatever this rank's own samples need."""
    budget = max(lengths) + extra
    for padded in (False, True):
        need = padded_budget_count(lengths, budget) if padded else budget_count(lengths, budget)
        count = min(need + more, len(lengths))
        parts = budgeted_parts(lengths, budget, count, hidden_size=64, padded=padded)
        assert len(parts) == count and all(parts)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        if padded:  # the padded layout's cost: samples x the longest
            assert all(len(p) * max(lengths[i] for i in p) <= budget for p in parts)
        else:
            assert all(sum(lengths[i] for i in p) <= budget for p in parts)


def test_a_budget_below_the_longest_sample_names_the_option():
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_device=10 is below the longest sample \(12 tokens"):
        budget_count([3, 12], 10)
    assert workload(100, 64) > workload(50, 64) * 2 - 1  # attention pairs make work grow faster than tokens


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=8), st.integers(0, 3),
       st.sampled_from([None, 4, 8]))
def test_positions_restart_with_every_sequence_and_the_mask_keeps_each_to_itself(shape, extra, multiple):
    """Each sequence's positions run 0..len-1 (transformers' own reading of packed positions,
    ``find_packed_sequence_indices``, finds one sequence per sample); the mask lets a token see exactly the earlier
    tokens of its own sequence; each completion token is read at the position before it. Mutation: one running
    position per row -> transformers sees one sequence, the test fails."""
    from transformers.masking_utils import find_packed_sequence_indices

    gen = torch.Generator().manual_seed(len(shape))
    prompts = [torch.randint(5, 50, (p,), generator=gen) for p, _ in shape]
    completions = [torch.randint(5, 50, (c,), generator=gen) for _, c in shape]
    longest = max(p + c for p, c in shape)
    packed = pack_rows(prompts, completions, pad_token_id=0, row_len=longest + extra, pad_to_multiple_of=multiple)
    width = packed.input_ids.shape[1]
    assert width >= longest and (multiple is None or width % multiple == 0)
    seq = find_packed_sequence_indices(packed.position_ids)
    seq = torch.zeros_like(packed.position_ids) if seq is None else seq
    mask = packed.attention_mask[:, 0]
    for r, members in enumerate(packed.rows):
        at = 0
        for b in members:
            n = prompts[b].numel() + completions[b].numel()
            assert packed.position_ids[r, at:at + n].tolist() == list(range(n))
            assert len(set(seq[r, at:at + n].tolist())) == 1
            assert seq[r, at].item() not in seq[r, :at].tolist()
            block = mask[r, at:at + n, at:at + n]
            assert torch.equal(block, torch.ones(n, n, dtype=torch.bool).tril())
            assert not mask[r, at:at + n, :at].any() and not mask[r, at:at + n, at + n:].any()
            tokens = torch.cat([prompts[b], completions[b]])
            assert torch.equal(packed.input_ids[r, at:at + n], tokens)
            k = completions[b].numel()
            flat = packed.input_ids.reshape(-1)
            assert torch.equal(flat[packed.index[b, :k] + 1], completions[b])  # each position predicts the next
            assert packed.valid[b].sum().item() == k
            at += n


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM

    register()
    out = {}
    for attn in ("sdpa", "eager", VARLEN_NAME):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn,
                                                     dtype=torch.float32).eval()
        out[attn] = model
    return out


def _row_logprobs(model, packed):
    logits = model(input_ids=packed.input_ids, **packed.forward_kwargs()).logits.float()
    flat_ids = packed.input_ids.reshape(-1)
    nxt = torch.cat([flat_ids[1:], flat_ids[:1]]).view_as(packed.input_ids)
    per_pos = torch.log_softmax(logits, -1).gather(-1, nxt[..., None]).squeeze(-1)
    return packed.gather(per_pos)


def _assert_each_samples_own_log_probs(model, prompts, completions, got) -> None:
    """Every completion token's log-prob in ``got`` ``[B, C]`` is the one of the sample's own unpadded forward."""
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids = torch.cat([p, c])[None]
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1]
        want = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)[p.numel() - 1:]
        assert torch.allclose(got[b, :c.numel()], want, atol=1e-5), (b, (got[b, :c.numel()] - want).abs().max())


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN_NAME])
@torch.no_grad()
def test_a_packed_row_gives_each_sample_its_own_forwards_log_probs(tiny, attn):
    """Long-tailed samples packed padding-free: every completion token's log-prob equals the one of the sample's
    own unpadded forward (fp32, 1e-5), under SDPA (boolean mask), eager (additive mask) and varlen attention (no
    mask: every sample in one row, separated by its boundaries; on CPU one SDPA per sequence); and a token's
    log-prob does not move when another sequence in its row changes (no attention across sequences). Mutations: a
    causal mask without the blocks -> the other sequences leak in (the test fails by about 1); varlen attention
    over the whole row (one causal SDPA, boundaries ignored) -> fails likewise."""
    model = tiny[attn]
    gen = torch.Generator().manual_seed(3)
    shape = [(7, 40), (3, 2), (12, 9), (5, 60), (4, 1), (9, 17)]
    prompts = [torch.randint(5, 300, (p,), generator=gen) for p, _ in shape]
    completions = [torch.randint(5, 300, (c,), generator=gen) for _, c in shape]
    dtype = {"sdpa": torch.bool, "eager": torch.float32}.get(attn)
    packed = pack_rows(prompts, completions, pad_token_id=0, mask_dtype=dtype, pad_to_multiple_of=8)
    assert len(packed.rows) == 1 if dtype is None else len(packed.rows) < len(shape)  # several samples share a row
    got = _row_logprobs(model, packed)
    _assert_each_samples_own_log_probs(model, prompts, completions, got)
    # change every other sample: the first sample of a shared row must not see it
    row = next(r for r in packed.rows if len(r) > 1)
    changed = [c if i == row[0] else torch.randint(5, 300, c.shape, generator=gen) for i, c in enumerate(completions)]
    again = _row_logprobs(model, pack_rows(prompts, changed, pad_token_id=0, mask_dtype=dtype, pad_to_multiple_of=8))
    assert torch.allclose(again[row[0]], got[row[0]], atol=1e-6)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_groups_packed_with_their_prompt_once_give_each_sample_its_own_log_probs(tiny, attn):
    """Shared-prompt units in padding-free rows (three groups of 1-4 samples, a group's prompt once, its
    completions' real tokens behind it, several groups to a row): every completion token's log-prob is the one of
    the sample's own unpadded forward, and stays put when a sibling's completion (same group) or another group
    changes. Mutation: segments that see each other (``visible`` without the segment test) -> siblings leak in."""
    model = tiny[attn]
    gen = torch.Generator().manual_seed(5)
    groups = [(6, [3, 20, 1]), (2, [9]), (11, [4, 4, 30, 2])]
    prompts, completions, units = [], [], []
    for plen, lens in groups:
        prompt = torch.randint(5, 300, (plen,), generator=gen)
        units.append(list(range(len(prompts), len(prompts) + len(lens))))
        for n in lens:
            prompts.append(prompt)
            completions.append(torch.randint(5, 300, (n,), generator=gen))
    assert shared_units(prompts) == units
    dtype = torch.bool if attn == "sdpa" else torch.float32
    packed = pack_rows(prompts, completions, pad_token_id=0, mask_dtype=dtype, units=units, row_len=60)
    assert len(packed.rows) < len(units)  # several groups share a row
    slots = packed.token_slots
    assert sum(unit_lengths([p.numel() for p in prompts], [c.numel() for c in completions], units)) <= slots
    assert packed.position_ids.max() < max(p.numel() + c.numel() for p, c in zip(prompts, completions, strict=True))
    got = _row_logprobs(model, packed)
    _assert_each_samples_own_log_probs(model, prompts, completions, got)
    changed = [c if i == 0 else torch.randint(5, 300, c.shape, generator=gen) for i, c in enumerate(completions)]
    again = _row_logprobs(model, pack_rows(prompts, changed, pad_token_id=0, mask_dtype=dtype, units=units,
                                           row_len=60))
    assert torch.allclose(again[0], got[0], atol=1e-6)  # its siblings (1, 2) and the other groups changed
    with pytest.raises(ValueError, match="need a mask"):
        pack_rows(prompts, completions, pad_token_id=0, mask_dtype=None, units=units)


def test_units_are_chosen_where_a_groups_prompt_once_makes_the_rows_cheaper():
    """Long prompts with short completions: one prompt per group pays; short prompts under long completions: a
    whole group per row would cost more attention than it saves, so one sample per unit."""
    units = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert choose_units([500] * 8, [20] * 8, units, hidden_size=64) == units
    assert choose_units([4] * 8, [500] * 8, units, hidden_size=64) is None
    assert choose_units([500] * 2, [20] * 2, [[0], [1]], hidden_size=64) is None


def test_unpad_takes_the_real_tokens_of_trls_layout():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[11, 0, 0], [12, 13, 0]])
    prompts, completions = unpad(prompt_ids, prompt_mask, completion_ids, torch.tensor([1, 2]))
    assert [p.tolist() for p in prompts] == [[5, 6], [7, 8, 9, 10]]
    assert [c.tolist() for c in completions] == [[11], [12, 13]]
    assert block_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0].tolist() == [[True, False, False], [True, True, False],
                                                                             [False, False, True]]


@pytest.mark.slow
def test_the_update_and_the_old_policy_pass_padding_free_equal_the_padded(tmp_path, monkeypatch):
    """One real rollout (HF engine, 8 samples of short prompts), completions cut to long-tailed lengths (1 to
    32 tokens): the update's loss and every parameter's gradient, and the old-policy pass under a token budget
    (real tokens, micro batches of even work), are the padded layout's (fp32), and the padding-free rows did run
    with fewer token slots. Mutation: read each completion token one position late (``index + 1``) -> the loss
    differs, the test fails."""
    from datasets import Dataset

    from tests.test_packing import _loss_and_grads
    from trl_nrollout.builtin import digits_prompts, digits_reward, resolve_model
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.passes import logprobs as logprobs_module
    from trl_nrollout.passes.logprobs import compute_log_probs
    from trl_nrollout.trainer import update as update_module
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    data = Dataset.from_dict({"prompt": digits_prompts(8)})
    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_completion_length=32,
                          max_steps=1, save_strategy="no", rollout_backend="hf", train_batch_size=2, rollout_n=4,
                          bf16=False, shared_prompt_forward=False, padding_free=True,
                          generation_kwargs={"min_new_tokens": 32})
    trainer = NRolloutGRPOTrainer(resolve_model("builtin:tiny-qwen2"), reward_funcs=[digits_reward], args=args,
                                  train_dataset=data)
    batch = trainer._generate_and_score_completions([dict(data[i]) for i in range(8)])
    keep = torch.tensor([1, 32, 2, 1, 3, 32, 1, 5])[:, None] > torch.arange(batch["completion_ids"].shape[1])
    batch["completion_mask"] = batch["completion_mask"] * keep
    batch["completion_ids"] = batch["completion_ids"].masked_fill(~keep, trainer._tokenizer.pad_token_id)
    batch = trainer.policy_update.add_normalizers([batch], 1)[0]
    slots = []
    real = update_module.pack_rows
    monkeypatch.setattr(update_module, "pack_rows", lambda *a, **kw: slots.append(real(*a, **kw).token_slots)
                        or real(*a, **kw))
    rows_loss, rows_grads = _loss_and_grads(trainer, batch)
    width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    assert slots and slots[0] < 0.9 * 8 * width, (slots, width)
    trainer.args.padding_free = False
    plain_loss, plain_grads = _loss_and_grads(trainer, batch)
    assert len(slots) == 1
    assert torch.allclose(rows_loss, plain_loss, atol=1e-6, rtol=1e-5)
    for a, b in zip(rows_grads, plain_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in plain_grads)
    # the old-policy pass: real tokens under a budget of two samples' worth, padding-free vs padded
    lengths = batch["completion_mask"].sum(-1).tolist()
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    completions = [ids[:n].tolist() for ids, n in zip(batch["completion_ids"], lengths, strict=True)]
    budget = 2 * max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    used = []
    real_sel = logprobs_module._padfree_selected
    monkeypatch.setattr(logprobs_module, "_padfree_selected", lambda *a, **kw: used.append(1) or real_sel(*a, **kw))
    free = compute_log_probs(trainer.model, prompts, completions, max_token_len=budget, padding_free=True)
    padded = compute_log_probs(trainer.model, prompts, completions, max_token_len=budget)
    assert used and free.num_forwards <= padded.num_forwards
    assert torch.allclose(free.logprobs, padded.logprobs, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN_NAME])
def test_the_critics_values_and_their_gradients_are_the_padded_ones(tiny_model_path, attn, monkeypatch):
    """PPO's critic (a token-classification head over the decoder): its value pass under a real-token budget and
    its training forward, padding-free vs padded, give the same values ``[B, C]`` and the same gradients, and the
    rows did run. Mutation: gather the value one position late (``index + 1``) -> the values differ."""
    import trl_nrollout.passes.critic as critic_module
    from trl_nrollout.passes.critic import build_critic, compute_values, critic_values, pad_batch

    critic = build_critic(tiny_model_path, seed=3, dtype=torch.float32)
    critic.config._attn_implementation = attn
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 7, 2, 5, 4, 6)]
    completions = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (1, 24, 2, 0, 3, 18)]
    rows = []
    real = critic_module.pack_rows
    monkeypatch.setattr(critic_module, "pack_rows", lambda *a, **kw: rows.append(kw["mask_dtype"]) or real(*a, **kw))
    budget = 2 * max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    free = compute_values(critic, prompts, completions, pad_token_id=0, max_token_len=budget, padding_free=True)
    assert rows and all((d is None) == (attn == VARLEN_NAME) for d in rows), rows  # the rows ran, varlen unmasked
    padded = compute_values(critic, prompts, completions, pad_token_id=0, max_token_len=budget)
    torch.testing.assert_close(free, padded, atol=1e-5, rtol=1e-4)
    assert free.abs().sum() > 0

    tensors = pad_batch(prompts, completions, 0)
    grads = []
    for padding_free in (True, False):
        critic.zero_grad()
        values = critic_values(critic, *tensors, padding_free=padding_free) * tensors[3]
        (values ** 2).sum().backward()
        grads.append([p.grad.clone() for p in critic.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _pack_rows_per_sample(prompts, completions, pad_token_id, *, row_len=None, mask_dtype=torch.bool,
                          pad_to_multiple_of=None, completion_width=None, units=None):
    """The former :func:`pack_rows`, sample by sample (a dozen small kernels each): the slow reference of the
    vectorised one (validation left out)."""
    from trl_nrollout.passes.padfree import PackedRows, unit_causal_mask

    device = prompts[0].device
    units = [[b] for b in range(len(prompts))] if units is None else [list(u) for u in units]
    p_lens = [int(p.numel()) for p in prompts]
    c_lens = [int(c.numel()) for c in completions]
    lengths = unit_lengths(p_lens, c_lens, units)
    if row_len is None:
        row_len = sum(lengths) if mask_dtype is None else max(lengths)
    width = max(row_len, max(lengths))
    if pad_to_multiple_of and pad_to_multiple_of > 1:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    bins = row_bins(lengths, width)
    c_width = max(c_lens) if completion_width is None else completion_width
    rows = len(bins)
    input_ids = torch.full((rows, width), pad_token_id, dtype=prompts[0].dtype, device=device)
    position_ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    unit_ids = torch.full((rows, width), -1, dtype=torch.long, device=device)
    segments = torch.full((rows, width), -1, dtype=torch.long, device=device)
    index = torch.zeros(len(prompts), c_width, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), c_width, dtype=torch.bool, device=device)
    for r, members in enumerate(bins):
        at = 0
        for u in members:
            unit = units[u]
            prompt = prompts[unit[0]]
            head = p_lens[unit[0]] - 1
            input_ids[r, at:at + head] = prompt[:-1]
            position_ids[r, at:at + head] = torch.arange(head, device=device)
            unit_ids[r, at:at + lengths[u]] = u
            at += head
            for b in unit:
                n = c_lens[b]
                input_ids[r, at] = prompt[-1]
                input_ids[r, at + 1:at + 1 + n] = completions[b]
                position_ids[r, at:at + 1 + n] = head + torch.arange(n + 1, device=device)
                segments[r, at:at + 1 + n] = b
                k = min(n, c_width)
                index[b, :k] = r * width + at + torch.arange(k, device=device)
                valid[b, :k] = True
                at += n + 1
        if at < width:
            position_ids[r, at:] = torch.arange(width - at, device=device)
            unit_ids[r, at:] = len(units) + r
    shift_labels = torch.full((rows, width), -100, dtype=torch.long, device=device)
    shift_labels.view(-1)[index[valid]] = input_ids.view(-1)[index[valid] + 1].long()
    mask = None if mask_dtype is None else unit_causal_mask(unit_ids, segments, mask_dtype)
    return PackedRows(input_ids, position_ids, mask, index, valid, shift_labels, [
        [b for u in members for b in units[u]] for members in bins])


groups_st = st.lists(st.tuples(st.integers(1, 7), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
                     min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(groups_st, st.sampled_from([torch.bool, torch.float32, None]), st.booleans(), st.sampled_from([None, 1, 4, 8]),
       st.one_of(st.none(), st.integers(0, 12)), st.sampled_from([None, -1, 3]), st.sampled_from([torch.long, torch.int32]))
def test_the_vectorised_rows_are_the_per_sample_ones(groups, mask_dtype, shared, multiple, extra, width_delta, dtype):
    """Issue 62 item 9: :func:`pack_rows` built with whole-batch tensor ops (one host-to-device copy of the layout,
    one concatenation of the tokens, ``repeat_interleave`` of the pieces' offsets) gives exactly the former
    sample-by-sample rows: tokens, positions, mask, index, valid, labels and rows, under every mask, with and
    without shared-prompt units, rounded rows, longer rows, completion widths below and above the longest.
    Mutations: a sample block's positions from 0 instead of after its unit's prompt -> fails; the scored slots'
    labels read at the slot itself (no ``+ 1``) -> fails."""
    gen = torch.Generator().manual_seed(sum(p + sum(c) for p, c in groups))
    prompts, completions, units = [], [], []
    for plen, clens in groups:
        prompt = torch.randint(5, 50, (plen,), generator=gen).to(dtype)
        units.append(list(range(len(prompts), len(prompts) + len(clens))))
        for n in clens:
            prompts.append(prompt)
            completions.append(torch.randint(5, 50, (n,), generator=gen).to(dtype))
    units = units if shared and mask_dtype is not None else None
    longest = max(p.numel() + c.numel() for p, c in zip(prompts, completions, strict=True))
    kwargs = {"mask_dtype": mask_dtype, "pad_to_multiple_of": multiple, "units": units,
              "row_len": None if extra is None else longest + extra,
              "completion_width": None if width_delta is None else
              max(0, max(c.numel() for c in completions) + width_delta)}
    got = pack_rows(prompts, completions, 3, **kwargs)
    want = _pack_rows_per_sample(prompts, completions, 3, **kwargs)
    assert got.rows == want.rows
    for name in ("input_ids", "position_ids", "index", "valid", "shift_labels"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.attention_mask is None) == (want.attention_mask is None)
    if want.attention_mask is not None:
        assert got.attention_mask.dtype == want.attention_mask.dtype
        assert torch.equal(got.attention_mask, want.attention_mask)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.integers(1, 9), st.integers(0, 7), st.booleans(), st.integers(0, 2**16))
def test_unpad_takes_every_samples_tokens_as_masking_them_one_by_one_did(batch, width, c_width, holes, seed):
    """:func:`unpad` in whole-batch ops (one host sync for the lengths, a gather of the kept prompt tokens) gives each
    sample's real tokens as the former per-sample boolean indexing did, for TRL's left-padded prompts and masks with
    holes; :func:`shared_units` (one copy to the host) groups identical prompts as before. Mutation: the kept tokens
    taken as a suffix of each row (the left-padding case only) -> the masks with holes fail."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(5, 9, (batch, width), generator=gen)
    if holes:
        prompt_mask = torch.randint(0, 2, (batch, width), generator=gen)
    else:
        prompt_mask = (torch.arange(width)[None] >= torch.randint(0, width + 1, (batch, 1), generator=gen)).long()
    completion_ids = torch.randint(5, 50, (batch, c_width), generator=gen)
    completion_len = torch.randint(0, c_width + 1, (batch,), generator=gen)
    prompts, completions = unpad(prompt_ids, prompt_mask, completion_ids, completion_len)
    assert [p.tolist() for p in prompts] == [ids[m.bool()].tolist()
                                             for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
    assert [c.tolist() for c in completions] == [ids[:n].tolist()
                                                 for ids, n in zip(completion_ids, completion_len.tolist(), strict=True)]
    want: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        want.setdefault(tuple(p.tolist()), []).append(i)
    assert shared_units(prompts) == list(want.values())
    assert shared_units([p.tolist() for p in prompts]) == list(want.values())


def _kernels(fn, *args, **kwargs) -> tuple[int, list[str], object]:
    """``fn(*args, **kwargs)`` as the dispatcher sees it: how many tensor ops it runs that are not views, the names
    of those that wait on the device (``nonzero``, a boolean index, ``.item()``), and its result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []
            self.waits: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if not func.is_view:
                self.ops.append(name)
            boolean_index = func.overloadpacket.__name__ in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
            if boolean_index or any(w in name for w in ("nonzero", "masked_select", "_local_scalar_dense")):
                self.waits.append(name)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        result = fn(*args, **kwargs)
    return len(ops.ops), ops.waits, result


@pytest.mark.parametrize("mask_dtype", [None, torch.bool])
def test_packing_and_unpadding_run_as_many_ops_for_4_samples_as_for_48(mask_dtype, monkeypatch):
    """Issue 62 item 9: :func:`pack_rows` and :func:`unpad` run a fixed number of tensor ops whatever the number
    of samples (formerly about ten per sample, and a boolean index per sample in ``unpad``: a host sync each on a
    GPU), none of them waiting on the device, and ``unpad`` copies to the host once. Mutation: ``unpad`` back to a
    boolean index per sample -> more ops at 48 samples, and ``nonzero`` among them: fails."""
    ops, copies = {}, {}
    real_tolist = torch.Tensor.tolist
    tolists = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolists.append(1) or real_tolist(self))
    for batch in (4, 48):
        gen = torch.Generator().manual_seed(batch)
        prompt_ids = torch.randint(5, 50, (batch, 6), generator=gen)
        prompt_mask = (torch.arange(6)[None] >= torch.randint(0, 5, (batch, 1), generator=gen)).long()
        completion_ids = torch.randint(5, 50, (batch, 9), generator=gen)
        completion_len = torch.randint(0, 10, (batch,), generator=gen)
        tolists.clear()
        unpad_ops, unpad_waits, (prompts, completions) = _kernels(unpad, prompt_ids, prompt_mask, completion_ids,
                                                                  completion_len)
        copies[batch] = len(tolists)
        pack_ops, pack_waits, _ = _kernels(pack_rows, prompts, completions, 0, mask_dtype=mask_dtype, row_len=16)
        ops[batch] = (unpad_ops, pack_ops)
        assert unpad_waits == [] and pack_waits == [], (unpad_waits, pack_waits)
    assert ops[4] == ops[48], ops
    assert copies == {4: 1, 48: 1}
