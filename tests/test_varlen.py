"""Varlen attention for padding-free rows (:mod:`trl_nrollout.passes.varlen`): the sequences of a packed row are
separated by their boundaries (``cu_seqlens``), not by an ``L x L`` mask.

On CPU :data:`VARLEN_NAME` runs one causal SDPA per sequence (exact); on CUDA in half precision it calls PyTorch's
flash-attention varlen kernel, which cannot run here: ``scripts/gpu_check.py`` (section ``varlen``) checks it on a
GPU. A model loaded with flash-attention takes the same boundaries through transformers' own flash path; flash-attn
needs a GPU, so one test stands our exact CPU varlen function in for its kernel (said there).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_nrollout.passes.packing import structural_reason
from trl_nrollout.passes.padfree import pack_rows, padfree_layout, rows_attention, rows_mask_dtype
from trl_nrollout.passes.varlen import (
    VARLEN_NAME,
    cu_seqlens,
    packed_attention,
    register,
    torch_varlen_runs,
    varlen_attention,
    varlen_forward,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=8), st.sampled_from([1, 8]))
def test_boundaries_are_each_sequences_start_in_row_order(shape, multiple):
    """``cu_seqlens`` of varlen rows (every sample in one row, rounded to ``pad_to_multiple_of``) lists each sample's
    start and end in the row's order, then the padding tail's. Mutation: ``cu`` without the final total -> fails."""
    prompts = [torch.arange(1, p + 1) for p, _ in shape]
    completions = [torch.arange(1, c + 1) for _, c in shape]
    packed = pack_rows(prompts, completions, 0, mask_dtype=None, pad_to_multiple_of=multiple)
    assert packed.attention_mask is None and len(packed.rows) == 1
    lengths = [shape[b][0] + shape[b][1] for b in packed.rows[0]]
    tail = packed.input_ids.shape[1] - sum(lengths)
    assert 0 <= tail < multiple
    cu, longest = cu_seqlens(packed.position_ids)
    want = torch.tensor([0, *lengths, *([tail] if tail else [])]).cumsum(0)
    assert cu.dtype == torch.int32 and cu.tolist() == want.tolist()
    assert longest == max(lengths + [tail])


def test_which_rows_run_varlen_attention():
    """The decision: flash-attention and :data:`VARLEN_NAME` always; SDPA only where PyTorch's varlen kernel runs
    (CUDA, half precision); eager and SDPA elsewhere take the block mask. Mutation: SDPA on CPU counted varlen ->
    the CPU row fails (and every CPU padding-free forward would lose its mask's exactness check)."""
    from transformers import Qwen2Config

    def config(attn):
        c = Qwen2Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16)
        c._attn_implementation = attn
        return c

    has_kernel = torch_varlen_runs("cuda", torch.bfloat16)  # this torch has PyTorch's varlen kernel (2.9 and later)
    assert packed_attention(config("flash_attention_2"), "cpu", torch.float32) == "varlen"
    assert packed_attention(config(VARLEN_NAME), "cpu", torch.float32) == "varlen"
    assert packed_attention(config("sdpa"), "cpu", torch.bfloat16) == "mask"
    assert packed_attention(config("sdpa"), "cuda", torch.float32) == "mask"  # the flash kernel has no fp32
    assert packed_attention(config("sdpa"), "cuda", torch.bfloat16) == ("varlen" if has_kernel else "mask")
    assert packed_attention(config("eager"), "cuda", torch.bfloat16) == "mask"
    assert rows_mask_dtype(config("sdpa"), torch.float32, torch.float32, "cpu") == torch.bool
    assert rows_mask_dtype(config("flash_attention_2"), torch.bfloat16, torch.bfloat16, "cuda") is None
    assert structural_reason(config("flash_attention_2"), varlen=True) is None
    assert "4D block mask" in structural_reason(config("flash_attention_2"))  # the shared-prompt layout needs one
    # varlen rows: one row, no units (a group's prompt once needs a mask), no mask bound
    fits, units = padfree_layout([5, 5, 5], [1, 30, 2], 35, None, torch.bfloat16,
                                 prompts=[torch.arange(5)] * 3)
    assert fits and units is None


def test_sdpa_runs_varlen_from_the_rows_forward_on(tiny_model_path):
    """``varlen_forward`` switches an SDPA model to :data:`VARLEN_NAME` for the rows' forward and leaves it so (a
    checkpointed backward recomputes the layers after the context: the next test); a flash-attention or eager model
    keeps its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa", dtype=torch.float32)
    with varlen_forward(model.config):
        assert model.config._attn_implementation == VARLEN_NAME
    assert model.config._attn_implementation == VARLEN_NAME
    model.config._attn_implementation = "eager"
    with varlen_forward(model.config):
        assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_checkpointed_backward_of_varlen_rows_gives_the_separate_sequences_gradients(tiny_model_path,
                                                                                      checkpointing):
    """Varlen rows of an SDPA model (the CUDA half-precision path, here on CPU: SDPA per sequence), the backward run
    after the forward's context as the trainer runs it, with gradient checkpointing (TRL's default: the layers'
    forwards recomputed in the backward): the loss and every gradient equal those of each sequence alone. Mutation:
    the context restoring SDPA after the forward -> the checkpointed backward fails (torch's recomputation check;
    the recompute attends across the row's sequences)."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.passes.padfree import pack_rows, rows_attention

    torch.manual_seed(0)
    prompts = [torch.randint(5, 200, (n,)) for n in (5, 9, 3)]
    completions = [torch.randint(5, 200, (n,)) for n in (7, 4, 11)]

    def run(packed: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa", dtype=torch.float32)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if packed:
            rows = pack_rows(prompts, completions, 0, mask_dtype=None)
            with rows_attention(model.config, rows):
                loss = _per_token(model, rows.input_ids, rows, **rows.forward_kwargs()).sum()
        else:
            loss = sum(lp.sum() for lp in _own(model, prompts, completions))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = run(False)
    loss, grads = run(True)
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert max((grads[n] - ref[n]).abs().max().item() for n in ref) < 1e-5


def _per_token(model, input_ids, packed, **kwargs) -> torch.Tensor:
    logits = model(input_ids=input_ids, **kwargs).logits.float()
    flat = input_ids.reshape(-1)
    nxt = torch.cat([flat[1:], flat[:1]]).view_as(input_ids)
    return packed.gather(torch.log_softmax(logits, -1).gather(-1, nxt[..., None]).squeeze(-1))


def _own(model, prompts, completions) -> list[torch.Tensor]:
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.cat([p, c])[None]
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1]
        out.append(lp.gather(-1, ids[0, 1:, None]).squeeze(-1)[p.numel() - 1:])
    return out


@torch.no_grad()
def test_a_flash_attention_model_takes_the_rows_by_their_boundaries(tiny_model_path, monkeypatch):
    """A model configured with ``flash_attention_2`` gets varlen rows (no mask) with ``cu_seq_lens_q/k`` and
    ``max_length_q/k``, transformers' padding-free flash path. flash-attn needs a GPU, so its kernel is replaced by
    our exact CPU varlen function (the mock stands for the GPU kernel only; the rows, the kwargs and the model's
    forward are real): each sample's log-probs equal its own forward's. Mutations: the rows' kwargs without the
    boundaries (``forward_kwargs`` giving positions only, which transformers' flash path reads as one sequence
    here) -> fails; rows built with a mask -> the flash path gets a 4D mask it cannot take."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import AttentionInterface

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    shape = [(6, 30), (3, 1), (9, 12), (4, 0), (5, 22)]
    prompts = [torch.randint(5, 300, (p,), generator=gen) for p, _ in shape]
    completions = [torch.randint(5, 300, (c,), generator=gen) for _, c in shape]
    want = _own(model, prompts, completions)

    seen = []

    def kernel(module, query, key, value, attention_mask, **kwargs):  # stands for flash-attn's GPU kernel
        seen.append((attention_mask, kwargs.get("cu_seq_lens_q")))
        kwargs.pop("position_ids", None)  # flash reads boundaries from these kwargs only, never guesses here
        return varlen_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", kernel)
    model.config._attn_implementation = "flash_attention_2"
    dtype = rows_mask_dtype(model.config, torch.float32, torch.float32, "cpu")
    assert dtype is None
    packed = pack_rows(prompts, completions, 0, mask_dtype=dtype, pad_to_multiple_of=8)
    with rows_attention(model.config, packed):
        assert model.config._attn_implementation == "flash_attention_2"  # its own kernel, not swapped
        got = _per_token(model, packed.input_ids, packed, **packed.forward_kwargs())
    assert seen and all(mask is None and cu is not None for mask, cu in seen)
    for b, w in enumerate(want):
        torch.testing.assert_close(got[b, :w.numel()], w, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_varlen_implementation_serves_padded_batches_generation_and_flattened_rows(tiny_model_path):
    """A model loaded with ``attn_implementation="trl_nrollout_varlen"`` is an SDPA model wherever no rows come:
    a left-padded batch gives SDPA's logits, greedy generation the same tokens; and rows flattened by a data
    collator (positions restarting at 0, no boundaries given) are separated by their positions. Mutation: the
    mask function returning None for a padded batch -> the padded logits differ."""
    from transformers import AutoModelForCausalLM

    register()
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa",
                                                dtype=torch.float32).eval()
    varlen = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=VARLEN_NAME,
                                                  dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(5, 300, (n,), generator=gen) for n in (4, 11, 7)]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_side="left")
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True,
                                           padding_side="left")
    a, b = sdpa(input_ids=ids, attention_mask=mask).logits, varlen(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a * mask[..., None], b * mask[..., None])
    torch.testing.assert_close(varlen.generate(seqs[1][None], max_new_tokens=6, do_sample=False),
                               sdpa.generate(seqs[1][None], max_new_tokens=6, do_sample=False))
    prompts, completions = [s[:2] for s in seqs], [s[2:] for s in seqs]
    packed = pack_rows(prompts, completions, 0, mask_dtype=None)
    got = _per_token(varlen, packed.input_ids, packed, position_ids=packed.position_ids)
    for k, w in enumerate(_own(sdpa, prompts, completions)):
        torch.testing.assert_close(got[k, :w.numel()], w, atol=1e-5, rtol=1e-5)


class _Kernel:
    """Stands for PyTorch's varlen kernel (``varlen_attn``, CUDA-only, so not runnable here; its signature): each
    sequence causally by SDPA (exact), counting its calls; ``fail[n]`` (1-based) or ``always``: an error to raise
    at that call instead."""

    def __init__(self, always: BaseException | None = None):
        self.calls = 0
        self.always = always
        self.fail: dict[int, BaseException] = {}

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        import trl_nrollout.passes.varlen as varlen_module

        self.calls += 1
        err = self.fail.get(self.calls, self.always)
        if err is not None:
            raise err
        assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k)  # causal, one set of boundaries
        flat = [x.transpose(0, 1)[None] for x in (query, key, value)]  # [T, H, D] -> [1, H, T, D]
        return varlen_module._sdpa_per_sequence(*flat, cu_seq_q, scale)[0].transpose(0, 1)


@pytest.fixture
def kernel_here(monkeypatch):
    """PyTorch's varlen kernel made to "run" on this CPU (a mock for the GPU only: the device check says yes, the
    kernel is :class:`_Kernel`); the probe's decisions start empty and are dropped afterwards."""
    import inspect

    import trl_nrollout.passes.varlen as varlen_module

    def install(kernel: _Kernel) -> _Kernel:
        monkeypatch.setattr(varlen_module, "_torch_varlen", lambda: kernel)
        monkeypatch.setattr(varlen_module, "_varlen_params", lambda: frozenset(inspect.signature(kernel).parameters))
        return kernel

    monkeypatch.setattr(varlen_module, "_PROBED", {})
    monkeypatch.setattr(varlen_module, "torch_varlen_runs", lambda device_type, dtype, device=None: True)
    return install


def _qkv(dim: int = 8):
    gen = torch.Generator().manual_seed(7)
    query, key, value = (torch.randn(1, h, 12, dim, generator=gen) for h in (4, 2, 2))
    return query, key, value, torch.tensor([0, 5, 12], dtype=torch.int32)


def _per_sequence(query, key, value, cu) -> torch.Tensor:
    """``[1, L, H, D]``: each sequence by itself (causal SDPA)."""
    bounds = cu.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, enable_gqa=True).transpose(1, 2)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)


@pytest.mark.parametrize("capability, runs", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True),
                                              ((9, 0), True), ((12, 0), True)])
def test_pytorchs_varlen_kernel_is_taken_on_ampere_or_later_only(monkeypatch, capability, runs):
    """Issue 62 item 7: the flash kernel refuses GPUs below compute capability 8.0 (a V100 7.0, a T4 7.5), so there
    SDPA rows keep their block mask (one kernel) instead of one SDPA per sequence in every layer. No GPU here: CUDA's
    presence and the capability are patched (mocks for the GPU only). Mutation: ``torch_varlen_runs`` without the
    capability test -> the 7.0 and 7.5 cases fail."""
    from transformers import Qwen2Config

    import trl_nrollout.passes.varlen as varlen_module

    asked = []
    monkeypatch.setattr(varlen_module, "_torch_varlen", lambda: _Kernel())  # a torch that has the kernel
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    assert torch_varlen_runs("cuda", torch.float16) is runs
    assert torch_varlen_runs("cuda", torch.bfloat16, 1) is runs and asked[-1] == 1  # the device asked about
    assert not torch_varlen_runs("cuda", torch.float32) and not torch_varlen_runs("cpu", torch.bfloat16)
    config = Qwen2Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16)
    config._attn_implementation = "sdpa"
    assert packed_attention(config, "cuda", torch.float16) == ("varlen" if runs else "mask")
    assert (rows_mask_dtype(config, torch.float16, torch.float16, "cuda") is None) is runs


def test_a_kernel_that_refuses_the_shape_is_probed_once_and_rows_run_sdpa_per_sequence(kernel_here, caplog):
    """Where PyTorch's varlen kernel refuses (a head size or a GPU it lacks), the probe at the first forward says so
    once and every forward, that shape's, runs one SDPA per sequence (the same result) without calling the kernel
    again; another head size is probed on its own. Mutation: the decision not kept (``_PROBED`` not written) -> the
    kernel is called, and the warning said, at every forward: fails."""
    import logging

    import trl_nrollout.passes.varlen as varlen_module

    kernel = kernel_here(_Kernel(always=RuntimeError("FlashAttention only supports Ampere GPUs or newer")))
    query, key, value, cu = _qkv()
    with caplog.at_level(logging.WARNING, logger=varlen_module.__name__):
        out = [varlen_attention(None, query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())[0]
               for _ in range(3)]
    assert sum("does not run" in r.getMessage() for r in caplog.records) == 1
    assert kernel.calls == 1 and list(varlen_module._PROBED.values()) == [False]
    for got in out:
        torch.testing.assert_close(got, _per_sequence(query, key, value, cu))
    varlen_attention(None, *_qkv(dim=16)[:3], None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)  # a head size of its own
    assert kernel.calls == 2 and len(varlen_module._PROBED) == 2


def test_an_out_of_memory_error_of_the_kernel_is_raised_never_turned_into_a_fallback(kernel_here):
    """Issue 62 item 6: the forward's kernel call catches nothing. An out-of-memory error (a RuntimeError) of the
    real forward is raised as such, and the next forward still runs the kernel (no process-wide fallback); another
    error of the real forward is raised too. An out-of-memory error of the probe is raised and decides nothing (the
    next forward probes again). No CUDA here: the kernel (:class:`_Kernel`) raises ``torch.OutOfMemoryError`` as a
    GPU's would. Mutations: the forward's call wrapped in the former ``try/except (RuntimeError, ...)`` that falls
    back -> no error raised, fails; the probe catching the OOM with the refusals -> fails."""
    import trl_nrollout.passes.varlen as varlen_module

    kernel = kernel_here(_Kernel())
    query, key, value, cu = _qkv()
    args = (None, query, key, value, None)
    out, _ = varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert kernel.calls == 2  # the probe, then the forward
    torch.testing.assert_close(out, _per_sequence(query, key, value, cu))
    kernel.fail[3] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert kernel.calls == 4 and list(varlen_module._PROBED.values()) == [True]  # the kernel again, no new probe
    kernel.fail[5] = RuntimeError("an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)

    varlen_module._PROBED.clear()
    kernel.fail[6] = torch.OutOfMemoryError("CUDA out of memory (in the probe)")
    with pytest.raises(torch.OutOfMemoryError, match="in the probe"):
        varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert varlen_module._PROBED == {}
    varlen_attention(*args, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert kernel.calls == 8 and list(varlen_module._PROBED.values()) == [True]  # probed again, then the forward


def test_a_checkpointed_model_runs_the_kernel_probed_once_and_its_oom_is_raised(tiny_model_path, kernel_here,
                                                                                 monkeypatch):
    """The real tiny model, varlen rows, gradient checkpointing (the layers recomputed in the backward), through the
    kernel path (the kernel a CPU stand-in, :class:`_Kernel`): the gradients are each sequence's alone, and the
    probe ran once for the forward and every recompute. Then an out-of-memory error at the forward's last layer:
    the forward raises it (formerly it fell back to SDPA per sequence from there on, and on a GPU the backward raised
    torch's ``CheckpointError``: the recompute saved other tensors than the flash kernel's forward; the CPU stand-in
    saves alike, so here the former code just did not raise). Mutation: the former
    ``try/except`` fallback around the forward's kernel call -> no OutOfMemoryError from the forward, fails."""
    from transformers import AutoModelForCausalLM

    import trl_nrollout.passes.varlen as varlen_module

    kernel = kernel_here(_Kernel())
    probes = []
    real_probe = varlen_module._probe
    monkeypatch.setattr(varlen_module, "_probe", lambda *a: probes.append(a) or real_probe(*a))
    torch.manual_seed(0)
    prompts = [torch.randint(5, 200, (n,)) for n in (5, 9, 3)]
    completions = [torch.randint(5, 200, (n,)) for n in (7, 4, 11)]

    def model():
        m = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa", dtype=torch.float32)
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    def packed_loss(m):
        rows = pack_rows(prompts, completions, 0, mask_dtype=None)
        with rows_attention(m.config, rows):
            return _per_token(m, rows.input_ids, rows, **rows.forward_kwargs()).sum()

    ref = model()
    sum(lp.sum() for lp in _own(ref, prompts, completions)).backward()
    m = model()
    layers = m.config.num_hidden_layers
    packed_loss(m).backward()
    assert len(probes) == 1 and kernel.calls == 1 + 2 * layers  # the probe, each layer's forward and recompute
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters() if p.grad is not None) < 1e-5

    m = model()
    kernel.fail[kernel.calls + layers] = torch.OutOfMemoryError("CUDA out of memory (the last layer)")
    with pytest.raises(torch.OutOfMemoryError, match="the last layer"):
        packed_loss(m).backward()
    assert len(probes) == 1


def test_the_same_boundaries_are_not_compared_in_every_layer(monkeypatch):
    """Issue 62 item 9: keys' boundaries that are the queries' own tensor (what :func:`varlen_kwargs` gives, every
    layer) are not compared element by element (``torch.equal``: a host sync per layer on a GPU); another tensor is,
    and one of other boundaries is an error. Mutation: the identity test dropped -> ``torch.equal`` runs: fails."""
    compared = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real(a, b))
    query, key, value, cu = _qkv()
    varlen_attention(None, query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert compared == []
    varlen_attention(None, query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())
    assert len(compared) == 1
    with pytest.raises(ValueError, match="must share their sequences"):
        varlen_attention(None, query, key, value, None, cu_seq_lens_q=cu,
                         cu_seq_lens_k=torch.tensor([0, 6, 12], dtype=torch.int32))
