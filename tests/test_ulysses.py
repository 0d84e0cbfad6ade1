"""Ulysses sequence parallelism (trl_nrollout/passes/ulysses.py): the groups, the sharding of padding-free rows, the
heads rule, the attention's wrapping of what the model runs, and (2 processes) equality with one process."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.passes.padfree import pack_rows
from trl_nrollout.passes.ulysses import (
    ULYSSES_NAME,
    SPGroup,
    check_heads,
    dp_groups,
    install,
    shard_rows,
    sp_groups,
    sp_multiple,
)
from trl_nrollout.passes.varlen import attention_of


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 16))
def test_groups_partition_the_world(world, size):
    """Every rank in one sequence-parallel group of ``size`` consecutive ranks and in one data-parallel group (the
    ranks at its place in every group); its data-parallel rank is ``rank // size``. Mutation tried: groups strided
    (``range(g, world, world // size)``) -> fails."""
    if world % size:
        with pytest.raises(ValueError, match="sequence_parallel_size"):
            sp_groups(world, size)
        return
    sp, dp = sp_groups(world, size), dp_groups(world, size)
    assert sorted(r for g in sp for r in g) == list(range(world)) == sorted(r for g in dp for r in g)
    for rank in range(world):
        (mine,) = [g for g in sp if rank in g]
        assert mine == list(range(rank - rank % size, rank - rank % size + size))
        assert sp.index(mine) == rank // size  # the data-parallel rank
        (peers,) = [g for g in dp if rank in g]
        assert len(peers) == world // size and all(p % size == rank % size for p in peers)


def _rows(mask_dtype=torch.bool):
    g = torch.Generator().manual_seed(3)
    lens = [(4, 9), (6, 3), (2, 11), (5, 5)]
    prompts = [torch.randint(3, 90, (p,), generator=g) for p, _ in lens]
    completions = [torch.randint(3, 90, (c,), generator=g) for _, c in lens]
    return pack_rows(prompts, completions, 0, mask_dtype=mask_dtype, pad_to_multiple_of=sp_multiple(None, 2))


@pytest.mark.parametrize("mask_dtype", [torch.bool, None], ids=["mask", "varlen"])
def test_shards_cover_the_row_with_its_positions(mask_dtype):
    """The shards of a row, in rank order, are the row: its tokens, the positions the whole row gives them (a
    sequence crossing the border continues its positions on the next shard) and the labels they predict; every
    shard carries the whole rows' mask or boundaries. Mutation tried: positions restarted with each shard -> fails
    (and the 2-process equality fails: test_two_processes_match_one)."""
    rows = _rows(mask_dtype)
    width = rows.input_ids.shape[1]
    assert width % 2 == 0
    shards = [shard_rows(rows, SPGroup(None, 2, r, 0, 1), "sdpa" if mask_dtype else "trl_nrollout_varlen")
              for r in range(2)]
    for name in ("input_ids", "position_ids", "shift_labels"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shards], dim=1), getattr(rows, name)), name
    crossing = rows.position_ids[:, width // 2] != 0  # rows where a sequence continues over the border
    assert crossing.any()
    assert (shards[1].position_ids[crossing, 0] > 0).all()
    for s in shards:
        kw = s.forward_kwargs()
        assert kw["ulysses"].attention_mask is rows.attention_mask
        assert (kw["ulysses"].varlen is None) == (mask_dtype is not None)


def test_uneven_rows_are_refused():
    rows = pack_rows([torch.tensor([5, 6, 7])], [torch.tensor([8, 9])], 0)
    with pytest.raises(ValueError, match="sequence_parallel_size=2.*pad_to_multiple_of=2"):
        shard_rows(rows, SPGroup(None, 2, 0, 0, 1), "sdpa")


def test_heads_rule():
    """Heads split over S; KV heads split or replicated. Mutation tried: the attention heads' check removed ->
    the first case passes silently and fails."""
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide the model's 4 attention heads.*"
                                         r"\[1, 2, 4\]"):
        check_heads(4, 2, 3)
    with pytest.raises(ValueError, match="sequence_parallel_size=4 and the model's 6 KV heads"):
        check_heads(12, 6, 4)
    check_heads(4, 2, 4)  # 2 KV heads replicated over 4 ranks
    check_heads(8, 4, 2)  # split


def test_installed_attention_is_the_inner_one_outside_a_sharded_forward():
    """A model wrapped by the Ulysses attention runs its own attention (and mask) in forwards that are not sharded:
    a padded batch gives the same logits; the config reports the inner attention. Mutation tried: the mask
    function returning None -> the padded rows' logits differ."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model

    for attn in ("sdpa", "eager"):
        plain = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32,
                                                     attn_implementation=attn)
        wrapped = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32,
                                                       attn_implementation=attn)
        assert install(wrapped) == attn and install(wrapped) == attn  # idempotent
        assert wrapped.config._attn_implementation == ULYSSES_NAME and attention_of(wrapped.config) == attn
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        with torch.no_grad():
            want = plain(input_ids=ids, attention_mask=mask).logits
            got = wrapped(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-6), attn


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """S = 2 in 2 processes (gloo; one launch: tests/dist/ulysses_dist.py) on packed rows of six sequences of
    unequal lengths, several crossing the shards' border: the update's forward (TRL's fused head on each shard, the
    shards gathered) gives one process's per-token log-probs, entropies and loss, and the group's summed gradients
    one process's; the log-prob pass with ``sequence_parallel`` gives the plain pass's, under a per-device token
    budget (12) that one device refuses for the longest sample (20 tokens) and the group of two holds. For SDPA and eager with the
    whole rows' block mask, varlen rows (the whole row's boundaries), a model whose single KV head is
    replicated, and the model's parameters sharded by FSDP2 over the group (its averaged gradients times S are the
    group's sum: a sequence-parallel group shares one data shard); PPO's critic split over the group likewise
    (values, gradients, and the value pass under a budget one device refuses). Mutations tried: no all-to-all (each rank attends over its own shard) -> every case differs (log-probs
    by ~0.5); positions restarted with each shard -> differ (~0.015); the last rank's heads dropped in the exchange
    back -> differ (~0.57); the log-prob pass taking the decoder and head apart under FSDP2 (the root's sharded
    parameters never unsharded) -> the FSDP2 case fails; the critic's rows sharded without the Ulysses attention
    installed (each rank attends within its shard) -> the critic's values differ by ~0.38."""
    from tests.conftest import ACCELERATE_LAUNCH, ENV, ROOT, run_cmd

    run_cmd([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", str(ROOT / "tests/dist/ulysses_dist.py"),
             str(tmp_path)], timeout=300, env=ENV)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["sp_rank"], r["dp_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert all(r["cases"]["sdpa_fsdp2"]["sharded"] for r in ranks)  # FSDP2 really sharded the parameters
    for r in ranks:  # PPO's critic split over the group: its values, gradients and budgeted value pass
        critic = r["critic"]
        assert critic["one_device_refuses"] and critic["grad_scale"] > 1e-3 and all(critic[k] < 1e-5 for k in ("values", "grads", "pass_values")), critic
    for name in ("sdpa", "eager", "varlen", "sdpa_kv_replicated", "sdpa_fsdp2"):
        for r in ranks:
            case = r["cases"][name]
            assert case["grad_scale"] > 1e-3, name  # the gradients are not all zero
            assert case["one_device_refuses_the_budget"] and case["pass_forwards"] >= 3, name
            for key in ("logps", "entropy", "loss", "grads", "pass_logps", "pass_entropy"):
                assert case[key] < 1e-5, (name, key, case)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.vllm
def test_lora_with_a_group_of_two_learns_what_one_process_learns(tmp_path):
    """LoRA (r=8, no dropout: dropout draws differ with the rows' shapes) with sequence_parallel_size=2 in 2
    processes: the adapter's gradients from the two shards, summed over the group, are one process's (gradient norm
    and loss of each step), and the engine, given the adapter after the first step, samples what one process's
    does (rewards of step 2). Mutation: the update's loss not scaled by S (each rank's shard counted as the whole
    row's) -> the gradient norms halve."""
    from tests.conftest import launch

    extra = ["--max_steps", "2", "--use_peft", "true", "--lora_r", "8", "--lora_dropout", "0.0", "--learning_rate",
             "1e-3", "--save_strategy", "no"]
    one = launch(tmp_path / "one", *extra)
    two = launch(tmp_path / "two", *extra, "--sequence_parallel_size", "2", procs=2)
    assert len(two["steps"]) == 2 and two["summary"]["processes"] == 2
    for key, tol in (("grad_norm", 1e-5), ("loss", 1e-6), ("reward", 1e-6)):
        assert [h[key] for h in two["steps"]] == pytest.approx([h[key] for h in one["steps"]], rel=tol, abs=tol), key


def test_trl_batch_counts_a_group_once():
    """TRL counts its batch over every process (per_device_train_batch_size x processes x steps_per_generation): at
    S = 2 each rank's share of the group's micro batch is half of it, so TRL's batch is still the layout's job (and
    each rank's chunk, the group's micro batch, the layout's). Mutation tried: the per-device batch not divided by S
    -> TRL's batch is twice the job (the e2e test then samples other prompts)."""
    from trl_nrollout.config import NRolloutConfig

    cfg = NRolloutConfig(output_dir="/tmp/unused", use_cpu=True, train_batch_size=8, rollout_n=8,
                         ppo_micro_batch_size_per_device=32)
    assert (cfg.per_device_train_batch_size, cfg.steps_per_generation) == (32, 2)
    cfg.sequence_parallel_size, cfg.per_device_train_batch_size = 2, 8  # as a 2-process launch builds it
    cfg._derive_trl_fields(2)
    assert cfg.per_device_train_batch_size * 2 * cfg.steps_per_generation == 64  # the job: 8 prompts x 8
    assert 64 // 1 // cfg.steps_per_generation == 32  # one group (D = 1): its chunk is the micro batch


def test_options_refused_with_sequence_parallelism():
    from types import SimpleNamespace

    from trl_nrollout.passes.ulysses import sequence_parallel_refusal

    base = dict(sequence_parallel_size=2, padding_free=None, rollout_ranks=0, use_liger_kernel=False)
    assert sequence_parallel_refusal(SimpleNamespace(**base)) is None
    assert sequence_parallel_refusal(SimpleNamespace(**{**base, "rollout_ranks": 1})) is None  # the trainers' groups
    for change, words in [({"padding_free": False}, "padding_free=False"),
                          ({"use_liger_kernel": True}, "use_liger_kernel"), ({"sequence_parallel_size": 0}, "positive")]:
        why = sequence_parallel_refusal(SimpleNamespace(**{**base, **change}))
        assert why is not None and "sequence_parallel_size" in why and words in why, change
