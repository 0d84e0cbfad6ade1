"""Ulysses sequence parallelism on the paths a GPU launch takes (issue 62, items 1 and 2), checked on the CPU.

1. The update's shared shuffle under an NCCL-only default group (a colocated GPU launch: accelerate starts ``nccl``,
   which in this torch has no CPU backend): it must run no collective at all, and the ranks of a group must still
   hold the same order. No NCCL exists here, so the group is a mock whose every collective raises torch's error for
   a CPU tensor on such a group.
2. The Ulysses attention around flash-attention (``attn_implementation="flash_attention_2"``): transformers'
   flash-attention loads its kernel by the name the module's config gives, which must be the inner attention's,
   not ``trl_nrollout_ulysses``. flash-attn cannot run on a CPU: the model is loaded with SDPA and its config then
   switched to ``flash_attention_2``, and transformers' kernel lookup (``_lazy_imports``) returns a stub kernel
   (causal attention per sequence, as flash-attn's varlen and dense functions compute it) for the flash names and
   runs the real lookup for any other name; everything between the model and the kernel is transformers' own code.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from trl_nrollout.passes.padfree import pack_rows
from trl_nrollout.passes.ulysses import (
    ULYSSES_NAME,
    SPGroup,
    group_permutation,
    inner_for_rows,
    install,
    shard_rows,
    shared_shuffle,
)

FLASH = "flash_attention_2"
NCCL_CPU_ERROR = "No backend type associated with device type cpu"


# ---------------------------------------------------------------------------------------------- item 1: the shuffle
def _batch(n: int = 12) -> dict:
    ids = torch.arange(n * 3).reshape(n, 3)
    return {"prompt_ids": ids, "advantages": torch.arange(n, dtype=torch.float32), "names": [f"s{i}" for i in range(n)],
            "num_items_in_batch": torch.tensor(7), "images": None}


def test_shared_shuffle_runs_no_collective_and_the_group_agrees(monkeypatch):
    """Two ranks of one group (their global generators seeded apart, as TRL's ``set_seed(device_specific=True)``
    seeds them) on a mock NCCL-only group: the shuffle issues no collective (each raises NCCL's error for a CPU
    tensor), both ranks get the same permutation of every entry (rows kept aligned across entries), the next
    rollout's differs, and another data-parallel group's differs. Mutations tried: the old broadcast of the first
    rank's ``torch.randperm`` -> raises the mock's NCCL error; the broadcast removed (each rank its own global draw)
    -> the ranks disagree."""

    def nccl_only(*args, **kwargs):
        raise RuntimeError(NCCL_CPU_ERROR)

    for name in ("broadcast", "broadcast_object_list", "all_reduce", "all_gather", "all_gather_object", "scatter",
                 "all_to_all_single", "send", "recv", "barrier"):
        monkeypatch.setattr(dist, name, nccl_only)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    group = object()  # the mock NCCL group (two ranks)
    ranks = [SPGroup(group, 2, r, 0, 1, seed=42) for r in range(2)]
    draws = []
    for _rollout in range(2):
        got = []
        for rank, sp in enumerate(ranks):
            torch.manual_seed(1000 + rank)  # each process's own global generator
            got.append(shared_shuffle(_batch(), sp))
        draws.append(got[0])
        for key in ("prompt_ids", "advantages"):
            assert torch.equal(got[0][key], got[1][key]), key
        assert got[0]["names"] == got[1]["names"]
        order = got[0]["advantages"].long()
        assert sorted(order.tolist()) == list(range(12)) and order.tolist() != list(range(12))
        assert torch.equal(got[0]["prompt_ids"], _batch()["prompt_ids"][order])
        assert got[0]["names"] == [f"s{i}" for i in order.tolist()]
        assert got[0]["num_items_in_batch"].item() == 7 and got[0]["images"] is None
    assert not torch.equal(draws[0]["advantages"], draws[1]["advantages"])  # a fresh shuffle each rollout
    assert [sp.shuffles for sp in ranks] == [2, 2]
    other = shared_shuffle(_batch(), SPGroup(group, 2, 0, 1, 2, seed=42))  # data-parallel group 1
    assert not torch.equal(other["advantages"], draws[0]["advantages"])


def test_group_permutation_is_a_function_of_its_arguments():
    """The same arguments give the same permutation whatever the global generator holds, and it is left as it was
    (TRL's later draws unchanged). Mutation tried: ``torch.randperm(n)`` from the global generator -> differs."""
    torch.manual_seed(0)
    a = group_permutation(50, 7, 1, 3)
    state = torch.get_rng_state()
    torch.manual_seed(123)
    b = group_permutation(50, 7, 1, 3)
    assert torch.equal(a, b) and sorted(a.tolist()) == list(range(50))
    torch.set_rng_state(state)
    group_permutation(50, 7, 1, 3)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(a, group_permutation(50, 8, 1, 3)) and not torch.equal(a, group_permutation(50, 7, 1, 4))


# ---------------------------------------------------------------------------------------------- item 2: flash
def _stub_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
    """One sequence: ``q`` ``[Lq, H, D]``, ``k``/``v`` ``[Lk, H_kv, D]`` -> ``[Lq, H, D]``, causal aligned to the
    bottom right (the last query sees every key: flash-attn's rule when a cache holds earlier keys)."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def stub_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                      softmax_scale=None, causal=False):
    """flash-attn's ``flash_attn_varlen_func``: ``q`` ``[Tq, H, D]``, sequence ``i`` the queries
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` over the keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``."""
    assert dropout_p == 0.0
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat([_stub_attention(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], causal,
                                      softmax_scale) for i in range(len(cq) - 1)])


def stub_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn's ``flash_attn_func``: ``q`` ``[B, Lq, H, D]``, each row one sequence."""
    assert dropout_p == 0.0
    return torch.stack([_stub_attention(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.shape[0])])


@pytest.fixture
def flash_lookup(monkeypatch):
    """transformers' flash kernel lookup with the stub kernel for ``flash_attention_2`` (the real lookup for any
    other name: a name that is no kernel raises "Could not find the currently requested flash attention
    implementation", as on a GPU); returns the names looked up. The lookup's cached globals are restored after."""
    import transformers.modeling_flash_attention_utils as fa

    real = fa._lazy_imports
    names: list[str | None] = []

    def lookup(implementation, attention_wrapper=None, allow_all_kernels=False):
        names.append(implementation)
        if implementation == FLASH:
            return stub_flash, stub_flash_varlen, None, fa._pad_input, fa._unpad_input
        return real(implementation, attention_wrapper, allow_all_kernels)

    monkeypatch.setattr(fa, "_lazy_imports", lookup)
    for name in ("_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn",
                 "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        monkeypatch.setattr(fa, name, getattr(fa, name, None), raising=False)
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    return names


def _model(attn: str, critic: bool = False):
    """The built-in tiny Qwen2 (4 heads, 2 KV heads), fp32, loaded with SDPA; ``attn`` set on its config after
    loading (flash-attn cannot be loaded on a CPU)."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.passes.critic import build_critic

    model = (build_critic("builtin:tiny-qwen2", seed=3, dtype=torch.float32) if critic else
             AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32,
                                                  attn_implementation="sdpa"))
    model.config._attn_implementation = attn
    return model.eval()


def _samples():
    g = torch.Generator().manual_seed(5)
    lens = [(4, 9), (6, 3), (2, 11), (5, 5)]
    return ([torch.randint(3, 300, (p,), generator=g) for p, _ in lens],
            [torch.randint(3, 300, (c,), generator=g) for _, c in lens])


def _sharded_logps(model, mask_dtype) -> Tensor:
    """The completions' log-probs ``[B, C]`` from a sharded forward (a group of one: the exchange is the identity,
    the attention the inner one with the whole rows' mask or boundaries)."""
    prompts, completions = _samples()
    rows = pack_rows(prompts, completions, 0, mask_dtype=mask_dtype)
    shard = shard_rows(rows, SPGroup(None, 1, 0, 0, 1), inner_for_rows(model.config, rows))
    with torch.no_grad():
        logits = model(input_ids=shard.input_ids, **shard.forward_kwargs()).logits
    logps = logits.log_softmax(-1).gather(-1, shard.shift_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return rows.gather(logps)


def test_flash_inner_attention_runs_a_sharded_forward(flash_lookup):
    """The update's sharded forward with flash-attention inside the Ulysses attention: transformers' flash path
    looks up ``flash_attention_2`` (never the wrapper's name) and gives SDPA's log-probs (a block mask over the
    same samples). Mutation tried: the inner function called with the module itself (its config's name
    ``trl_nrollout_ulysses``) -> "Could not find the currently requested flash attention implementation"."""
    sdpa = _model("sdpa")
    flash = _model(FLASH)
    flash.load_state_dict(sdpa.state_dict())
    assert install(sdpa) == "sdpa" and install(flash) == FLASH
    assert flash.config._attn_implementation == ULYSSES_NAME
    want = _sharded_logps(sdpa, torch.bool)
    got = _sharded_logps(flash, None)  # varlen rows: flash-attention's sequence boundaries
    assert flash_lookup and set(flash_lookup) == {FLASH}
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_flash_inner_attention_in_the_critic(flash_lookup):
    """PPO's critic split over a group (``sharded_values``) with flash-attention inside the Ulysses attention gives
    the plain SDPA critic's values. Mutation tried: as above (the module itself) -> the kernel lookup fails."""
    from trl_nrollout.passes.critic import critic_values, pad_batch, sharded_values

    sdpa = _model("sdpa", critic=True)
    flash = _model(FLASH, critic=True)
    flash.load_state_dict(sdpa.state_dict())
    prompts, completions = _samples()
    batch = pad_batch([p.tolist() for p in prompts], [c.tolist() for c in completions], 0)
    with torch.no_grad():
        want = critic_values(sdpa, *batch)
        got = sharded_values(flash, *batch, 0, None, SPGroup(None, 1, 0, 0, 1))
    assert flash.config._attn_implementation == ULYSSES_NAME and set(flash_lookup) == {FLASH}
    mask = batch[3].bool()
    assert torch.allclose(got[mask], want[mask], atol=1e-5), (got[mask] - want[mask]).abs().max()


def test_flash_inner_attention_generates_with_the_hf_engine(flash_lookup):
    """The HF engine generates with the training model, whose attention Ulysses wraps (the forwards are not
    sharded: the inner attention runs as it is, here flash-attention on left-padded prompts and a cache): the
    samples and log-probs are the plain SDPA model's. Mutation tried: as above (the module itself) -> the kernel
    lookup fails."""
    from trl_nrollout.rollout import HFEngine, SamplingOptions

    sdpa = _model("sdpa")
    flash = _model(FLASH)
    flash.load_state_dict(sdpa.state_dict())
    install(flash)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    opts = SamplingOptions(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
    runs = [HFEngine(m, pad_token_id=0, eos_token_ids=[1], batch_size=3, seed=2).generate(prompts, 2, opts)
            for m in (sdpa, flash)]
    assert set(flash_lookup) == {FLASH}
    assert runs[0].completion_ids == runs[1].completion_ids and all(len(c) == 6 for c in runs[1].completion_ids)
    assert max(abs(a - b) for r0, r1 in zip(runs[0].logprobs, runs[1].logprobs) for a, b in zip(r0, r1)) < 1e-4
