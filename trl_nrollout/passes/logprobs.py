"""Micro-batched, token-budgeted log-prob passes (old policy and reference) with lean memory.

After rollout, each rank scores its ``samples_per_rank`` sequences with the training model (old-policy
log-probs) and the reference model. This module cuts that pass into forwards bounded either by a number of
sequences (``micro_batch_size``) or by a token budget (``max_token_len``: sequences packed first-fit decreasing
by their padded size), and scores the completion tokens without ever holding a float32
``[batch, length, vocab]`` log-softmax: the final hidden states of the completion positions go through the
output head a chunk of rows at a time (through the model's own forward, FSDP's, inside it: :class:`ScoredHead`), and
each chunk is reduced to the chosen token's log-prob (and the entropy, only when asked) before the next one.

Results are returned in the caller's order, ``[B, C]`` aligned with right-padded completions (zeros past each
completion's end), whatever the padding of the inputs and however the sequences were grouped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from trl_nrollout.passes.budget import pack_by_tokens, split_by_count
from trl_nrollout.passes.distributed import is_fsdp, is_zero3, synced_count
from trl_nrollout.passes.multimodal import MMInputs, collate
from trl_nrollout.passes.packing import (
    decide,
    mask_dtype,
    pack_shared_prompts,
    query_dtype,
    round_up,
)
from trl_nrollout.passes.padfree import (
    budget_count,
    budgeted_parts,
    pack_rows,
    padfree_layout,
    rows_attention,
    rows_mask_dtype,
)
from trl_nrollout.passes.ulysses import (
    SPGroup,
    gather_sequence,
    inner_for_rows,
    install,
    shard_rows,
    sp_multiple,
)

Ids = Sequence[int] | Tensor


@dataclass
class LogProbOutput:
    """Per-token log-probs ``[B, C]`` (and entropies when asked), zero past each completion's end;
    ``support_log_mass`` ``[B, C]``: what the ``support`` function said of each position (None without one)."""

    logprobs: Tensor
    entropy: Tensor | None
    num_forwards: int
    support_log_mass: Tensor | None = None


#: ``(logits [N, V] divided by the temperature, targets [N]) -> [N]``: a value per position computed from the whole
#: distribution, e.g. the log of the mass a truncating sampler keeps (:func:`~trl_nrollout.algos.losses.sampling_support_log_mass`)
SupportFn = Callable[[Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------------- math
def chunked_token_logprobs(
    hidden: Tensor,
    targets: Tensor,
    head: nn.Module | None,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    with_entropy: bool = False,
    support: SupportFn | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Log-prob of ``targets`` (and the entropy) from rows of hidden states or logits, a chunk at a time.

    ``hidden``: ``[N, H]`` hidden states (then ``head`` maps them to logits) or ``[N, V]`` logits (``head``
    None). ``targets``: ``[N]``. Returns float32 ``[N]`` log-probs, ``[N]`` entropies (or None) and ``[N]``
    values of ``support`` over each chunk's tempered logits (or None). Peak extra memory is one float32
    ``[chunk_rows, V]`` block (and what ``support`` takes).
    """
    n = hidden.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
    mass = torch.empty(n, dtype=torch.float32, device=hidden.device) if support is not None else None
    for s in range(0, n, chunk_rows):
        rows = hidden[s:s + chunk_rows]
        logits = (head(rows) if head is not None else rows).float()
        if temperature != 1.0:
            logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
        out[s:s + chunk_rows] = logits.gather(-1, targets[s:s + chunk_rows, None]).squeeze(-1) - lse
        if ent is not None:
            probs = torch.softmax(logits, dim=-1)
            ent[s:s + chunk_rows] = lse - (probs * logits).sum(-1)
        if mass is not None:
            mass[s:s + chunk_rows] = support(logits, targets[s:s + chunk_rows])
        del logits
    return out, ent, mass


# ---------------------------------------------------------------------------------------------- model access
def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed engine wrappers (``.module``); PEFT models stay PEFT models."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def plain_output_head(model: nn.Module) -> nn.Module | None:
    """The output head of a causal LM whose logits are just ``head(hidden)`` (no soft-capping, no logit scale: those
    post-process the logits), an FSDP1 wrapper of it stripped; None otherwise. Under ZeRO-3 only a plain Linear (a
    functional head, see :func:`_whole_head`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    if cfg is None or not hasattr(base, "get_output_embeddings"):
        return None
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(text_cfg, "final_logit_softcapping", None) or getattr(text_cfg, "logit_scale", None) not in (None, 1.0):
        return None
    head = base.get_output_embeddings()
    head = unwrap_model(head) if isinstance(head, nn.Module) else None
    return None if head is None or is_zero3(head) and not isinstance(head, nn.Linear) else head


def _lean_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, output head) of a causal LM when its logits are just ``head(hidden)``; None otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = plain_output_head(model)
    decoder = base.get_decoder() if head is not None and hasattr(base, "get_decoder") else None
    return None if decoder is None or decoder is base else (decoder, head)


class ScoredHead:
    """The model's own forward (FSDP, images, ``lean_head=False``) with its output head on the scored rows only, never
    ``[tokens, V]`` logits (under FSDP the head's weight is whole only inside the forward, so the head is taken there).
    While :meth:`on` is open, the head's call (after its hooks: FSDP's unshard) takes rows ``index`` of its input
    ``[..., H]``, scores them a chunk at a time (:func:`chunked_token_logprobs` through the module's own ``forward``:
    no hooks, no collectives), runs the module on zero rows and returns, for logits, ``[..., K]`` float32 values, zero
    but at ``index``: the log-prob of ``targets``, then the entropy (``with_entropy``), then ``support``'s value.
    Indexing the "logits" as before gives ``[tokens, K]``; :attr:`fired`: the head ran (else the logits are real)."""

    def __init__(self, head: nn.Module, targets: Tensor, *, temperature: float, chunk_rows: int,
                 with_entropy: bool, support: SupportFn | None, fp32: bool):
        self.head, self.targets, self.temperature, self.chunk_rows = head, targets, temperature, chunk_rows
        self.with_entropy, self.support, self.fp32, self.fired = with_entropy, support, fp32, False

    @classmethod
    def of(cls, model: nn.Module, parts, targets: Tensor, **options) -> ScoredHead | None:
        """One for ``model``'s own forward (no lean ``parts``) where its logits are a plain head's; else None."""
        head = plain_output_head(unwrap_model(model)) if parts is None else None
        return None if head is None else cls(head, targets, **options)

    @contextlib.contextmanager
    def on(self, index: Tensor):
        """Score rows ``index`` ``[tokens]`` (of the head's input, leading dimensions flattened) in the forward inside."""
        done: list[Tensor] = []

        def pre(module, args, kwargs):
            x = args[0] if args else kwargs["input"]
            if done:
                raise RuntimeError("the output head ran twice in one forward; score this model with lean_head=True.")
            rows = x[torch.unravel_index(index, x.shape[:-1])]  # [tokens, H]: no copy of the other rows
            with torch.autocast(x.device.type, enabled=False) if self.fp32 else contextlib.nullcontext():
                values = chunked_token_logprobs(rows.float() if self.fp32 else rows, self.targets, module.forward,
                                                temperature=self.temperature, chunk_rows=self.chunk_rows,
                                                with_entropy=self.with_entropy, support=self.support)
            values = [v for v in values if v is not None]
            out = torch.zeros((*x.shape[:-1], len(values)), dtype=torch.float32, device=x.device)
            out.view(-1, len(values))[index] = torch.stack(values, -1)
            done.append(out)
            empty = x[..., :0, :]  # the head itself runs on no rows
            return ((empty, *args[1:]), kwargs) if args else (args, {**kwargs, "input": empty})

        handles = [self.head.register_forward_pre_hook(pre, with_kwargs=True),
                   self.head.register_forward_hook(lambda module, args, output: done[-1] if done else output)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self.fired = bool(done)


@contextlib.contextmanager
def _whole_head(head: nn.Module | None):
    """The output head as a function of hidden rows, callable any number of times without collectives (None: no
    head, the rows are logits already).

    Under DeepSpeed ZeRO-3 every call of the head *module* gathers its partitioned weight (a collective), so
    ranks scoring different numbers of tokens would make different numbers of head calls and hang. Here the
    weight is gathered once per micro batch (every rank runs the same number of micro batches) and applied
    functionally, without the module's hooks. Elsewhere the module itself is returned.
    """
    if head is None or not is_zero3(head):
        yield head
        return
    import deepspeed

    weight, bias = head.weight, getattr(head, "bias", None)
    with deepspeed.zero.GatheredParameters([p for p in (weight, bias) if p is not None], modifier_rank=None):
        yield lambda rows: F.linear(rows, weight, bias)


# ---------------------------------------------------------------------------------------------- the pass
def _as_list(x: Ids) -> list[int]:
    return x.tolist() if isinstance(x, Tensor) else list(x)


def from_padded(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                completion_mask: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Turn TRL-style padded tensors (prompts ``[B, P]``, completions ``[B, C]``, any padding side) into lists
    of real token ids per sample."""
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
    completions = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
    return prompts, completions


@torch.no_grad()
def compute_log_probs(
    model: nn.Module,
    prompts: Sequence[Ids],
    completions: Sequence[Ids],
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    pad_token_id: int = 0,
    pad_side: str = "right",
    chunk_rows: int = 1024,
    lean_head: bool | None = None,
    sync_forwards: bool | None = None,
    mm_inputs: Sequence[MMInputs | None] | None = None,
    shared_prompts: bool = False,
    head_fp32: bool = False,
    pad_to_multiple_of: int | None = None,
    support: SupportFn | None = None,
    padding_free: bool = False,
    sequence_parallel: SPGroup | None = None,
) -> LogProbOutput:
    """Score every completion token under ``model``; return ``[B, C_max]`` log-probs in the input order.

    - ``prompts[i]``, ``completions[i]``: real token ids (no padding) of sample ``i``.
    - ``micro_batch_size``: sequences per forward (default: all at once); ``max_token_len``: token budget per
      forward (padded size), which replaces the count-based split (``micro_batch_size`` then caps sequences).
    - ``with_entropy``: also return per-token entropies, computed chunk by chunk like the log-probs.
    - ``temperature``: logits are divided by it (match the sampling temperature for the rollout's log-probs).
    - ``lean_head``: run the decoder, keep only completion positions, and apply the output head in chunks
      (default when the model allows it; FSDP-sharded models run their own forward, its head on the completion
      positions only, in chunks: :class:`ScoredHead`).
    - ``mm_inputs``: per sample, the processor's image tensors (:mod:`trl_nrollout.passes.multimodal`) of a
      vision-language model, or None; with images the model's own forward runs (it merges the image features) and
      positions are the model's own (right padding: they start at 0 on every row).
    - ``shared_prompts``: a micro batch whose samples share prompts runs each prompt once
      (:mod:`trl_nrollout.passes.packing`) where :func:`~trl_nrollout.passes.packing.packing_pays` says it is cheaper, on the
      lean path and through the model's own forward alike (FSDP; images never pack); the caller vouches that the
      model takes a 4D block mask (:func:`~trl_nrollout.passes.packing.structural_reason`).
    - ``head_fp32``: apply the output head in float32 outside autocast (TRL's ``cast_lm_head_to_fp32``, as its
      fused head does in the update); otherwise the head runs under whatever autocast the caller opened.
    - ``pad_to_multiple_of``: every forward's sequence length is rounded up to a multiple of it (TRL's option:
      tensor-core friendly shapes); the extra columns are padding, masked out.
    - ``sync_forwards``: make every rank run as many forwards as the busiest one (needed under ZeRO-3, where
      each forward gathers parameters collectively, and under FSDP; detected automatically).
    - ``support``: a function of each completion position's tempered logits and token (:data:`SupportFn`), returned
      as ``support_log_mass`` ``[B, C]`` (the trainer's replay of a truncating sampler's cut).
    - ``padding_free``: a micro batch whose samples leave padding runs as padding-free rows
      (:mod:`trl_nrollout.passes.padfree`) where that saves a tenth of its token slots (after the shared-prompt
      layout, which wins where it applies); the caller vouches that the model takes a 4D block mask or varlen
      boundaries (:mod:`~trl_nrollout.passes.varlen`). With ``max_token_len`` the budget then counts real tokens,
      and the micro batches, as many on every rank as the busiest needs, hold even work
      (:func:`~trl_nrollout.passes.padfree.budgeted_parts`).
    - ``sequence_parallel``: this rank's Ulysses group (:mod:`trl_nrollout.passes.ulysses`; every rank of it
      passes the same samples): every micro batch runs as padding-free rows split over the group, each rank's
      shard scored and the whole rows' values gathered, so every rank returns what one process would. The model's
      attention is wrapped (:func:`~trl_nrollout.passes.ulysses.install`) on first use.

    The model is put in eval mode for the pass and its mode restored; positions are counted from each
    sequence's first real token, so the result does not depend on padding.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions; they must pair up.")
    prompts = [_as_list(p) for p in prompts]
    completions = [_as_list(c) for c in completions]
    b = len(prompts)
    c_max = max((len(c) for c in completions), default=0)
    device = next(unwrap_model(model).parameters()).device
    logprobs = torch.zeros(b, c_max, dtype=torch.float32, device=device)
    entropy = torch.zeros(b, c_max, dtype=torch.float32, device=device) if with_entropy else None
    mass = torch.zeros(b, c_max, dtype=torch.float32, device=device) if support is not None else None
    if b == 0 or c_max == 0:
        return LogProbOutput(logprobs, entropy, 0, mass)

    if any(len(p) == 0 for p in prompts):
        raise ValueError("every sample needs at least one prompt token before its completion (an empty prompt "
                         "has no position that predicts the first completion token).")
    sp = sequence_parallel if sequence_parallel is not None and sequence_parallel.size > 1 else None
    if sp is not None:
        if mm_inputs is not None and any(mm_inputs) or support is not None:
            raise ValueError("sequence_parallel_size > 1 scores text rows only: images (mm_inputs) and a sampler's "
                             "support replay are not sharded yet; use sequence_parallel_size=1.")
        install(unwrap_model(model))
        if max_token_len is not None:  # per device: a group's micro batch holds its S ranks' tokens
            max_token_len *= sp.size
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    budgeted = padding_free and max_token_len is not None and micro_batch_size is None and mm_inputs is None
    if budgeted:
        count = budget_count(lengths, max_token_len)
    elif max_token_len is not None:
        batches = pack_by_tokens(lengths, max_token_len, micro_batch_size)
    else:
        batches = split_by_count(b, micro_batch_size or b)

    inner = unwrap_model(model)
    parts = None
    mm = list(mm_inputs) if mm_inputs is not None and any(mm_inputs) else None
    if mm is not None and len(mm) != b:
        raise ValueError(f"{len(mm)} mm_inputs for {b} samples; give one (or None) per sample.")
    if mm is not None and lean_head:
        raise ValueError("lean_head=True cannot take images: a vision-language model needs its own forward.")
    if lean_head is not False and not is_fsdp(inner) and mm is None:
        parts = _lean_parts(inner)
        if lean_head and parts is None:
            raise ValueError("lean_head=True but the model's logits are not a plain head over its decoder.")
    # ZeRO-3 and FSDP gather parameters inside every forward: all ranks must run the same number of forwards.
    if sync_forwards is None:
        sync_forwards = is_zero3(inner) or is_fsdp(inner)
    if budgeted:  # every rank as many micro batches as the busiest needs, each of even work, within the budget
        num_forwards = synced_count(count, device, sync_forwards)
        hidden = getattr(getattr(inner, "config", None), "hidden_size", None) or 4096
        batches = budgeted_parts(lengths, max_token_len, min(num_forwards, b), hidden)  # fillers make up the rest
    else:
        num_forwards = synced_count(len(batches), device, sync_forwards)
    was_training = inner.training
    inner.eval()
    try:
        for idx in batches:
            _score_micro_batch(
                model, parts, [prompts[i] for i in idx], [completions[i] for i in idx], idx, logprobs, entropy,
                temperature=temperature, pad_token_id=pad_token_id, pad_side=pad_side, chunk_rows=chunk_rows,
                device=device, mm=None if mm is None else [mm[i] for i in idx], shared_prompts=shared_prompts,
                head_fp32=head_fp32, multiple_of=pad_to_multiple_of, support=support, mass=mass,
                padding_free=padding_free, sp=sp,
            )
        for _ in range(num_forwards - len(batches)):  # keep collectives in step with busier ranks
            _score_micro_batch(model, parts, [prompts[0]], [completions[0]], [0], logprobs.clone(), None,
                               temperature=temperature, pad_token_id=pad_token_id, pad_side=pad_side,
                               chunk_rows=chunk_rows, device=device, mm=None if mm is None else mm[:1],
                               head_fp32=head_fp32, multiple_of=pad_to_multiple_of, sp=sp)
    finally:
        inner.train(was_training)
    return LogProbOutput(logprobs, entropy, num_forwards, mass)


def _packed_layout(module: nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int,
                   device: torch.device, multiple_of: int | None = None):
    """The shared-prompt layout (:func:`~trl_nrollout.passes.packing.pack_shared_prompts`) of a micro batch, with the
    block mask in the dtype ``module`` takes, and the prompt width ``P``; None where packing does not pay."""
    b, width = len(prompts), max(len(p) + len(c) for p, c in zip(prompts, completions))
    p_w, c_w = max(len(p) for p in prompts), max(len(c) for c in completions)
    prompt_ids = torch.full((b, p_w), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, p_w, dtype=torch.long)
    completion_ids = torch.full((b, max(c_w, 1)), pad_token_id, dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[r, p_w - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[r, p_w - len(p):] = 1
        completion_ids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
    weights = next((q.dtype for q in module.parameters() if q.is_floating_point()), torch.float32)
    dtype = mask_dtype(getattr(module, "config", None), weights)
    if not decide(prompt_ids, prompt_mask, completion_ids, width, dtype, query_dtype(weights, device.type))[0]:
        return None  # too little shared (or a mask over its bound: the trainer's update says so)
    pk = pack_shared_prompts(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                             pad_token_id, dtype=dtype, pad_to_multiple_of=multiple_of)
    return pk, p_w


def _packed_hidden(decoder: nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int,
                   device: torch.device, multiple_of: int | None = None) -> tuple[Tensor, Tensor] | None:
    """The decoder's last hidden states over the shared-prompt layout of a micro batch, flattened ``[G * L, H]``,
    and where sample ``r``'s completion token ``j`` is predicted ``[B, C]``; None where packing does not pay."""
    layout = _packed_layout(decoder, prompts, completions, pad_token_id, device, multiple_of)
    if layout is None:
        return None
    pk, _ = layout
    hidden = decoder(input_ids=pk.input_ids, attention_mask=pk.attention_mask,
                     position_ids=pk.position_ids).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]), pk.index


def _packed_logits(model: nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int,
                   device: torch.device, multiple_of: int | None = None, scored: ScoredHead | None = None,
                   rows_t: Tensor | None = None, cols_t: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """The model's own forward (FSDP, or a head that is not a plain linear layer) over the shared-prompt layout:
    logits of the completion segments only (``logits_to_keep``; the shared prompt's positions predict no
    completion token but the last, which opens every segment), flattened ``[G * K, V]``, and where sample
    ``r``'s completion token ``j`` is predicted in them ``[B, C]`` (``scored``: values, its tokens ``(rows_t[k],
    cols_t[k])``, :class:`ScoredHead`); None where packing does not pay."""
    layout = _packed_layout(unwrap_model(model), prompts, completions, pad_token_id, device, multiple_of)
    if layout is None:
        return None
    pk, p_w = layout
    length = pk.input_ids.shape[1]
    keep = length - (p_w - 1)  # the segments: each begins with the prompt's last token
    row, col = pk.index // length, pk.index % length
    index = row * keep + col - (length - keep)
    with scored.on(index[rows_t, cols_t]) if scored else contextlib.nullcontext():
        logits = model(input_ids=pk.input_ids, attention_mask=pk.attention_mask, position_ids=pk.position_ids,
                       logits_to_keep=keep).logits  # [G, keep, V]
    return logits.reshape(-1, logits.shape[-1]), index



def _padfree_selected(model, parts, prompts, completions, rows_t, cols_t, pad_token_id, device, width,
                      multiple_of, shared_prompts: bool = False, scored: ScoredHead | None = None) -> Tensor | None:
    """The features (hidden states on the lean path, else logits) ``[tokens, H or V]`` of every completion token
    ``(rows_t[k], cols_t[k])`` from padding-free rows (a group's prompt once where ``shared_prompts`` allows and it
    pays); None where they would not save a tenth of the slots."""
    module = parts[0] if parts is not None else unwrap_model(model)
    weights = next((q.dtype for q in module.parameters() if q.is_floating_point()), torch.float32)
    config = getattr(unwrap_model(model), "config", None)
    queries = query_dtype(weights, device.type)
    dtype = rows_mask_dtype(config, weights, queries, device.type)  # None: varlen attention
    fits, units = padfree_layout([len(p) for p in prompts], [len(c) for c in completions], width, dtype,
                                 queries, prompts=prompts if shared_prompts else None,
                                 pad_to_multiple_of=multiple_of,
                                 hidden_size=getattr(config, "hidden_size", None) or 4096)
    if not fits:
        return None
    pk = pack_rows([torch.tensor(p, dtype=torch.long, device=device) for p in prompts],
                   [torch.tensor(c, dtype=torch.long, device=device) for c in completions], pad_token_id,
                   mask_dtype=dtype, pad_to_multiple_of=multiple_of, units=units)
    index = pk.index[rows_t, cols_t]
    with rows_attention(config, pk):
        if parts is not None:
            flat = parts[0](input_ids=pk.input_ids, **pk.forward_kwargs()).last_hidden_state
        else:
            with scored.on(index) if scored else contextlib.nullcontext():
                flat = model(input_ids=pk.input_ids, **pk.forward_kwargs()).logits
    return flat.reshape(-1, flat.shape[-1])[index]


def completion_positions(prompts: list[list[int]], completions: list[list[int]], starts: list[int],
                         device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of every completion token of a micro batch (rows begin at ``starts``), flattened ``[tokens]`` each: its row,
    the position predicting it, the token, its column in the completion."""
    rows, pos, tgt, cols = [], [], [], []
    for r, (p, c) in enumerate(zip(prompts, completions)):
        first = starts[r] + len(p)  # position of the first completion token
        rows += [r] * len(c)
        pos += range(first - 1, first - 1 + len(c))
        tgt += c
        cols += range(len(c))
    return tuple(torch.tensor(v, dtype=torch.long, device=device) for v in (rows, pos, tgt, cols))  # type: ignore


def completion_features(model, parts, prompts, completions, rows_t, pos_t, cols_t, *, starts, width, pad_token_id,
                        device, mm=None, shared_prompts=False, multiple_of=None, padding_free=False,
                        scored: ScoredHead | None = None) -> Tensor:
    """The features of every completion token ``(rows_t[k], cols_t[k])`` (predicted at ``pos_t[k]`` of the padded
    rows of ``width`` beginning at ``starts``): hidden states ``[tokens, H]`` when a plain head follows (``parts``);
    from the model's own forward otherwise (FSDP, images, lean_head=False), its head's values on those tokens only
    (``scored``, :class:`ScoredHead`) where its logits are a plain head's, else logits ``[tokens, V]``. Padding-free
    rows where they pay, else the shared-prompt layout where allowed and it pays, else one padded row per sequence."""
    selected = None
    if padding_free and mm is None and len(prompts) > 1:  # padding-free rows (shared prompts once, where it pays)
        selected = _padfree_selected(model, parts, prompts, completions, rows_t, cols_t, pad_token_id, device,
                                     width, multiple_of, shared_prompts=shared_prompts, scored=scored)
    if selected is None and shared_prompts and len(prompts) > 1 and (parts is not None or mm is None):
        packed = (_packed_hidden(parts[0], prompts, completions, pad_token_id, device, multiple_of)
                  if parts is not None else _packed_logits(model, prompts, completions, pad_token_id, device,
                                                           multiple_of, scored, rows_t, cols_t))
        if packed is not None:  # the shared-prompt layout (fixed-width segments)
            flat, index = packed
            selected = flat[index[rows_t, cols_t]]
    if selected is not None:
        return selected
    seqs = [p + c for p, c in zip(prompts, completions)]  # the plain layout: one padded row per sequence
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, (seq, off) in enumerate(zip(seqs, starts)):
        input_ids[r, off:off + len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[r, off:off + len(seq)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    input_ids, attn, position_ids = input_ids.to(device), attn.to(device), position_ids.to(device)
    if parts is not None:
        hidden = parts[0](input_ids=input_ids, attention_mask=attn, position_ids=position_ids).last_hidden_state
        return hidden[rows_t, pos_t]  # only completion positions go through the head
    keep = width - int(pos_t.min())  # positions from the earliest predicting position to the end
    # a VLM places its image tokens itself (some, like Qwen2-VL, with positions of their own)
    extra = {"position_ids": position_ids} if mm is None else collate(mm, device, width=width, starts=starts)
    with scored.on(rows_t * keep + pos_t - (width - keep)) if scored else contextlib.nullcontext():
        logits = model(input_ids=input_ids, attention_mask=attn, logits_to_keep=keep, **extra).logits
    return logits[rows_t, pos_t - (width - keep)]  # [n, keep, V] -> [tokens, V]


def _score_micro_batch(model, parts, prompts, completions, idx, logprobs, entropy, *, temperature, pad_token_id,
                       pad_side, chunk_rows, device, mm=None, shared_prompts=False, head_fp32=False,
                       multiple_of=None, support=None, mass=None, padding_free=False, sp=None) -> None:
    if sp is not None:
        _score_sharded(model, parts, prompts, completions, idx, logprobs, entropy, temperature=temperature,
                       pad_token_id=pad_token_id, chunk_rows=chunk_rows, device=device, head_fp32=head_fp32,
                       multiple_of=multiple_of, sp=sp)
        return
    width = round_up(max(len(p) + len(c) for p, c in zip(prompts, completions)), multiple_of)
    starts = [width - len(p) - len(c) if pad_side == "left" else 0 for p, c in zip(prompts, completions)]
    rows_t, pos_t, tgt_t, out_c_t = completion_positions(prompts, completions, starts, device)
    if not len(rows_t):
        return
    scored = ScoredHead.of(model, parts, tgt_t, temperature=temperature, chunk_rows=chunk_rows, fp32=head_fp32,
                           with_entropy=entropy is not None, support=support if mass is not None else None)
    selected = completion_features(model, parts, prompts, completions, rows_t, pos_t, out_c_t, starts=starts,
                                   width=width, pad_token_id=pad_token_id, device=device, mm=mm,
                                   shared_prompts=shared_prompts, multiple_of=multiple_of,
                                   padding_free=padding_free, scored=scored)
    lp, ent, kept = _head_values(selected, tgt_t, parts[1] if parts else None, scored, temperature=temperature,
                                 chunk_rows=chunk_rows, with_entropy=entropy is not None, head_fp32=head_fp32,
                                 support=support if mass is not None else None)
    out_r_t = torch.tensor(idx, device=device)[rows_t]
    logprobs[out_r_t, out_c_t] = lp
    if entropy is not None and ent is not None:
        entropy[out_r_t, out_c_t] = ent
    if mass is not None and kept is not None:
        mass[out_r_t, out_c_t] = kept


def _head_values(selected: Tensor, targets: Tensor, head: nn.Module | None, scored: ScoredHead | None, *,
                 temperature: float, chunk_rows: int, with_entropy: bool, support: SupportFn | None,
                 head_fp32: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``[tokens]`` log-probs, entropies and ``support``'s values: the columns of a :class:`ScoredHead`'s ``selected``
    ``[tokens, K]`` where it ran, else of hidden states ``[tokens, H]`` through ``head`` or logits ``[tokens, V]``."""
    if scored is not None and scored.fired:
        lp, *rest = selected.unbind(-1)
        return lp, rest.pop(0) if with_entropy else None, rest.pop(0) if support is not None else None
    fp32 = head_fp32 and head is not None
    no_autocast = torch.autocast(selected.device.type, enabled=False) if fp32 else contextlib.nullcontext()
    with _whole_head(head) as head_fn, no_autocast:
        return chunked_token_logprobs(selected.float() if fp32 else selected, targets, head_fn,
                                      temperature=temperature, chunk_rows=chunk_rows, with_entropy=with_entropy,
                                      support=support)


def _score_sharded(model, parts, prompts, completions, idx, logprobs, entropy, *, temperature, pad_token_id,
                   chunk_rows, device, head_fp32, multiple_of, sp: SPGroup) -> None:
    """A micro batch as padding-free rows split over the Ulysses group ``sp`` (:mod:`~trl_nrollout.passes.ulysses`):
    this rank's shard through the decoder (or the model), its scored positions through the head, and the whole
    rows' log-probs (and entropies) gathered from the group into ``logprobs`` / ``entropy`` rows ``idx``."""
    module = parts[0] if parts is not None else unwrap_model(model)
    weights = next((q.dtype for q in module.parameters() if q.is_floating_point()), torch.float32)
    config = getattr(unwrap_model(model), "config", None)
    dtype = rows_mask_dtype(config, weights, query_dtype(weights, device.type), device.type)  # None: varlen
    pk = pack_rows([torch.tensor(p, dtype=torch.long, device=device) for p in prompts],
                   [torch.tensor(c, dtype=torch.long, device=device) for c in completions], pad_token_id,
                   mask_dtype=dtype, pad_to_multiple_of=sp_multiple(multiple_of, sp.size))
    shard = shard_rows(pk, sp, inner_for_rows(config, pk))
    labels = shard.shift_labels.reshape(-1)
    scored = labels != -100
    index = scored.nonzero().squeeze(-1)
    hooked = ScoredHead.of(model, parts, labels[index], temperature=temperature, chunk_rows=chunk_rows,
                           with_entropy=entropy is not None, support=None, fp32=head_fp32)
    if parts is not None:
        feats = parts[0](input_ids=shard.input_ids, **shard.forward_kwargs()).last_hidden_state
    else:
        with hooked.on(index) if hooked else contextlib.nullcontext():
            feats = model(input_ids=shard.input_ids, **shard.forward_kwargs()).logits
    flat = feats.reshape(-1, feats.shape[-1])[index]
    lp, ent, _ = _head_values(flat, labels[index], parts[1] if parts else None, hooked, temperature=temperature,
                              chunk_rows=chunk_rows, with_entropy=entropy is not None, support=None, head_fp32=head_fp32)
    values = [lp] if ent is None else [lp, ent]
    for v, out in zip(values, (logprobs, entropy)):
        local = torch.zeros(labels.shape, dtype=torch.float32, device=device)
        local[scored] = v
        whole = pk.gather(gather_sequence(local.reshape(shard.input_ids.shape), sp))  # [b, C]
        for r, (i, c) in enumerate(zip(idx, completions)):
            out[i, :len(c)] = whole[r, :len(c)]
