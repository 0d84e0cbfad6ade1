"""Ulysses sequence parallelism for padding-free rows: a row's tokens split over ``S`` ranks, attention over the
whole row by exchanging sequence for heads (DeepSpeed-Ulysses' scheme).

Every ``S`` consecutive ranks form a sequence-parallel group (:func:`sp_groups`) and hold the same samples; the
data-parallel rank is ``rank // S`` (:func:`dp_groups`: the ranks of one position in every group). A micro batch's
padding-free rows (:func:`~trl_nrollout.passes.padfree.pack_rows`, width a multiple of ``S``) are cut into ``S``
contiguous shards (:func:`shard_rows`); each rank runs the model on its shard, with the positions the whole row
gives its tokens (a sequence crossing a shard border continues its positions)::

    row:      [p0 c0 | p1 c1 c1 | p2 c2 | pad]      positions [0 1 | 0 1 2 | 0 1 | 0]
    rank 0:   [p0 c0 | p1 c1]                        positions [0 1 | 0 1]
    rank 1:               [c1 | p2 c2 | pad]                        [2 | 0 1 | 0]

In every attention layer (:func:`ulysses_attention`, registered with transformers as :data:`ULYSSES_NAME`) the
rank's queries, keys and values ``[B, H, L/S, D]`` go through an all-to-all that returns ``[B, H/S, L, D]``: the
whole row for ``H/S`` heads. The attention the model runs (SDPA or eager with the whole row's block mask; varlen or
flash-attention with the whole row's sequence boundaries) computes them, and a second all-to-all returns each rank
its own tokens for all heads. Per-position values (log-probs, entropies) are computed on each shard and gathered
(:func:`gather_sequence`) so that every rank of the group holds the whole row's, and a pass returns what one
process would.

Gradients: the all-to-all's backward is the same all-to-all of the gradients; :func:`gather_sequence`'s backward
keeps the rank's own slice (every rank of the group computes the same loss from the gathered values, so the slice
is that loss's gradient of the rank's tokens). Each rank's parameter gradients are then its share of the group's;
their sum over the group is the gradient one process computes (a data-parallel mean over the whole world divides
by ``S`` too many: :func:`sp_loss_scale`).

KV heads fewer than ``S`` are replicated (each KV head repeated ``S / H_kv`` times before the exchange, as verl
does; the gradients of the copies add up); ``S`` must then be a multiple of the KV heads, and the attention heads a
multiple of ``S`` (:func:`check_heads`).

Cost: the all-to-all moves, per layer and direction, ``(S - 1) / S`` of the rank's queries, keys, values (forward)
and outputs; gloo in this torch implements ``all_to_all_single`` itself (one call per exchange).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trl_nrollout.passes.padfree import PackedRows
from trl_nrollout.passes.varlen import VARLEN_NAME, varlen_kwargs

#: the attention implementation registered with transformers by :func:`register`.
ULYSSES_NAME = "trl_nrollout_ulysses"
#: the config attribute that keeps the attention a model ran before :func:`install`.
INNER_ATTR = "_ulysses_inner"


# ---------------------------------------------------------------------------------------------- groups
def sp_groups(world: int, size: int) -> list[list[int]]:
    """The sequence-parallel groups of ``world`` ranks: every ``size`` consecutive ranks."""
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the {world} processes; use a divisor of "
                         f"{world}.")
    return [list(range(g * size, (g + 1) * size)) for g in range(world // size)]


def dp_groups(world: int, size: int) -> list[list[int]]:
    """The data-parallel groups: the ranks at one position of every sequence-parallel group."""
    return [list(range(r, world, size)) for r in range(size)] if world % size == 0 else sp_groups(world, size)


@dataclass
class SPGroup:
    """This rank's sequence-parallel group: ``group`` (None: the default group of a world of ``size``), its
    ``size`` ``S``, this rank's place ``rank`` in it, and the data-parallel rank (``global rank // S``) and size;
    ``seed`` and ``shuffles`` (the shuffles drawn so far) make the group's shared shuffle (:func:`shared_shuffle`)."""

    group: object | None
    size: int
    rank: int
    dp_rank: int
    dp_size: int
    seed: int = 0
    shuffles: int = 0


def new_sp_group(size: int, seed: int = 0) -> SPGroup:
    """This rank's :class:`SPGroup` (every rank calls it: each group is created on every rank, in order); ``seed``
    (the run's, the same on every rank) seeds the group's shuffles."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = sp_groups(world, size)
    mine = None
    for ranks in groups:
        made = dist.new_group(ranks) if len(groups) > 1 else None
        if rank in ranks:
            mine = made
    return SPGroup(mine, size, rank % size, rank // size, world // size, seed)


def group_permutation(n: int, seed: int, dp_rank: int, draw: int) -> Tensor:
    """The permutation ``[n]`` of the ``draw``-th shuffle of data-parallel group ``dp_rank`` in a run of ``seed``: a
    function of its arguments alone (its own generator; the global one is left as it is), so the group's ranks
    compute the same one without exchanging it, and other groups and draws get others."""
    mixed = (seed * 0x9E3779B97F4A7C15 + dp_rank * 0xBF58476D1CE4E5B9 + draw * 0x94D049BB133111EB) % (1 << 63)
    return torch.randperm(n, generator=torch.Generator().manual_seed(mixed))


def shared_shuffle(batch: dict, sp: SPGroup) -> dict:
    """TRL's shuffle of a rollout's batch (``shuffle_sequence_dict``: one permutation of every sequence-valued
    entry), the same on every rank of the group: its ranks split the same samples' rows, so they must hold them in
    the same order. The permutation is :func:`group_permutation` of the group's seed and count of shuffles, which
    its ranks share, so no collective runs (a broadcast of a CPU tensor fails on the NCCL-only group a GPU launch
    makes); the global generator (TRL's, seeded per process) is not drawn from."""
    size = len(next(v for v in batch.values() if v is not None))
    perm = group_permutation(size, sp.seed, sp.dp_rank, sp.shuffles)
    sp.shuffles += 1

    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.ndim == 0):
            return v
        if isinstance(v, Tensor):
            return v[perm]
        return [v[i] for i in perm.tolist()]

    return {key: permute(val) for key, val in batch.items()}


def sp_loss_scale(size: int) -> float:
    """The factor on each rank's loss under a data-parallel mean over the whole world (DDP, ZeRO, FSDP average over
    ``D x S`` ranks): the group's gradient is the sum of its ``S`` ranks' shares, so ``S`` makes the mean over the
    ``D`` data-parallel groups."""
    return float(size)


def check_heads(heads: int, kv_heads: int, size: int) -> None:
    """Ulysses splits ``heads`` attention heads over ``size`` ranks: they must divide; KV heads divide too, or are
    replicated when fewer (``size`` a multiple of them). A ValueError names the option and the fix."""
    if heads % size:
        ok = [s for s in range(1, heads + 1) if heads % s == 0]
        raise ValueError(f"sequence_parallel_size={size} does not divide the model's {heads} attention heads "
                         f"(Ulysses gives each rank heads/S of them); use sequence_parallel_size in {ok}.")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"sequence_parallel_size={size} and the model's {kv_heads} KV heads: neither divides the "
                         f"other, so KV heads can be neither split nor replicated; use a divisor or a multiple of "
                         f"{kv_heads} that divides {heads}.")


def sequence_parallel_refusal(args) -> str | None:
    """Why a config's ``sequence_parallel_size`` cannot train (the option, its value, the rule and a fix), or None.
    Checked when the config is built; the heads (:func:`check_heads`) when the trainer reads the model's config,
    the processes by the layout (``sp_divides_world``)."""
    size = args.sequence_parallel_size
    if not isinstance(size, int) or size < 1:
        return f"sequence_parallel_size={size!r} must be a positive integer (1: no sequence parallelism)."
    if size == 1:
        return None
    if getattr(args, "padding_free", None) is False:
        return (f"sequence_parallel_size={size} splits padding-free rows over the group, but padding_free=False; "
                "remove padding_free=False (or use sequence_parallel_size=1).")
    if getattr(args, "use_liger_kernel", False):
        return (f"sequence_parallel_size={size} with use_liger_kernel=True: Liger's fused loss takes whole "
                "sequences; set use_liger_kernel=False.")
    return None


# ---------------------------------------------------------------------------------------------- the exchange
class _AllToAll(torch.autograd.Function):
    """``x`` ``[S, ...]``: block ``j`` goes to rank ``j``; returns ``[S, ...]``, block ``j`` from rank ``j``. Its
    own inverse, so the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # like x's strides: contiguous (all_to_all_single writes memory order)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()  # a permuted gradient: empty_like would keep its strides
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: Tensor, group, size: int) -> Tensor:
    """:class:`_AllToAll` (nothing at ``size`` 1)."""
    return x if size == 1 else _AllToAll.apply(x, group)


def seq_to_heads(x: Tensor, group, size: int) -> Tensor:
    """``[B, H, L/S, D]`` (this rank's tokens, every head) -> ``[B, H/S, L, D]`` (every token, this rank's heads:
    ``rank * H/S ..``), the tokens in rank order."""
    b, h, n, d = x.shape
    blocks = x.reshape(b, size, h // size, n, d).permute(1, 0, 2, 3, 4)  # [S, B, H/S, L/S, D]
    got = all_to_all(blocks.contiguous(), group, size)  # block j: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def heads_to_seq(y: Tensor, group, size: int) -> Tensor:
    """``[B, L, H/S, D]`` (every token, this rank's heads; transformers' attention output) -> ``[B, L/S, H, D]``
    (this rank's tokens, every head in order)."""
    b, n, h, d = y.shape
    blocks = y.reshape(b, size, n // size, h, d).permute(1, 0, 2, 3, 4)  # [S, B, L/S, H/S, D]
    got = all_to_all(blocks.contiguous(), group, size)  # block j: my tokens of rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, n // size, size * h, d)


class _GatherSequence(torch.autograd.Function):
    """``[R, L/S]`` per rank -> ``[R, L]``, the shards in rank order; the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group, size: int, rank: int) -> Tensor:
        ctx.rank, ctx.width = rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None, None, None


def gather_sequence(x: Tensor, sp: SPGroup) -> Tensor:
    """The group's per-position values ``[R, L/S]`` (this rank's shard) as the whole rows' ``[R, L]``. Every rank of
    the group must compute the same function of the result (the backward keeps this rank's slice of its
    gradient)."""
    return x if sp.size == 1 else _GatherSequence.apply(x, sp.group, sp.size, sp.rank)


# ---------------------------------------------------------------------------------------------- the attention
@dataclass
class UlyssesRows:
    """What every attention layer of a sharded forward needs of the whole rows (passed through the model's keyword
    arguments as ``ulysses=``, so gradient checkpointing's recomputation sees it too): the group, the attention the
    model runs (``inner``), and the whole rows' block mask ``[R, 1, L, L]`` or, for varlen attention, their
    sequence boundaries (``varlen``: :func:`~trl_nrollout.passes.varlen.varlen_kwargs`) and positions ``[R, L]``."""

    sp: SPGroup
    inner: str
    attention_mask: Tensor | None
    varlen: dict | None
    position_ids: Tensor


class _View:
    """An object seen with some attributes replaced (``overrides``), all else its own (read through: its methods,
    properties, ``training``, ``modules()``)."""

    def __init__(self, target, **overrides):
        object.__setattr__(self, "_target", target)
        for name, value in overrides.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_target"), name)


def inner_view(module: nn.Module, inner: str, kv_groups: int | None = None) -> nn.Module:
    """``module`` as the inner attention ``inner`` must see it: its config's ``_attn_implementation`` is ``inner``
    (transformers' flash-attention loads its kernel by the config's name; under :data:`ULYSSES_NAME` it looks for a
    hub kernel of that name and fails), and ``num_key_value_groups`` is ``kv_groups`` where KV heads are
    replicated."""
    extra = {} if kv_groups is None else {"num_key_value_groups": kv_groups}
    return _View(module, config=_View(module.config, _attn_implementation=inner), **extra)


def _inner_function(module: nn.Module, name: str):
    """The attention function ``name`` (eager: the model's own ``eager_attention_forward``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{ULYSSES_NAME}: {type(module).__name__} has no eager_attention_forward; load the "
                             "model with attn_implementation='sdpa'.")
        return fn
    if name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    if name == VARLEN_NAME:
        from trl_nrollout.passes.varlen import register as register_varlen
        from trl_nrollout.passes.varlen import varlen_attention

        register_varlen()
        return varlen_attention
    return ALL_ATTENTION_FUNCTIONS[name]


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, ulysses: UlyssesRows | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """A transformers attention function (``ALL_ATTENTION_FUNCTIONS[ULYSSES_NAME]``): ``query`` ``[B, H, L/S, D]``,
    ``key``/``value`` ``[B, H_kv, L/S, D]`` (this rank's shard) -> ``[B, L/S, H, D]``. Without ``ulysses`` (a
    forward that is not sharded: generation, a padded batch) it is the attention the model ran before
    :func:`install`, unchanged."""
    if ulysses is None:
        inner = getattr(module.config, INNER_ATTR, None) or "sdpa"
        return _inner_function(module, inner)(inner_view(module, inner), query, key, value, attention_mask,
                                              dropout=dropout, scaling=scaling, **kwargs)
    sp = ulysses.sp
    size = sp.size
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, kv_heads, size)
    kv_groups = None
    if kv_heads % size:  # fewer KV heads than ranks: each repeated size / kv_heads times (their gradients add up)
        key = key.repeat_interleave(size // kv_heads, dim=1)
        value = value.repeat_interleave(size // kv_heads, dim=1)
        kv_groups = heads // size
    view = inner_view(module, ulysses.inner, kv_groups)
    q, k, v = (seq_to_heads(x, sp.group, size) for x in (query, key, value))
    kwargs.pop("position_ids", None)
    if ulysses.varlen is not None:  # the whole rows' sequence boundaries
        out, _ = _inner_function(module, ulysses.inner)(view, q, k, v, None, dropout=dropout, scaling=scaling,
                                                        position_ids=ulysses.position_ids,
                                                        **{**kwargs, **ulysses.varlen})
    else:  # the whole rows' block mask
        out, _ = _inner_function(module, ulysses.inner)(view, q, k, v, ulysses.attention_mask, dropout=dropout,
                                                        scaling=scaling, **kwargs)
    return heads_to_seq(out, sp.group, size), None


def ulysses_mask(*, config=None, **kwargs):
    """The mask function of :data:`ULYSSES_NAME`: the inner attention's (a sharded forward passes no mask and its
    attention reads the whole rows' from ``ulysses``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    inner = getattr(config, INNER_ATTR, None) or "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS.get(inner) if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else None
    return None if fn is None else fn(config=config, **kwargs)


def register() -> None:
    """Register :data:`ULYSSES_NAME` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ULYSSES_NAME, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_NAME, ulysses_mask)


def install(model: nn.Module) -> str:
    """Make ``model``'s attention :data:`ULYSSES_NAME` around the one it runs (kept as the config's
    :data:`INNER_ATTR`, which :func:`~trl_nrollout.passes.varlen.attention_of` reports); idempotent. Forwards without
    ``ulysses=`` run the inner attention unchanged. Returns the inner attention's name."""
    register()
    config = model.config
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current == ULYSSES_NAME:
        return getattr(config, INNER_ATTR)
    for cfg in {id(c): c for c in (config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {})))
                }.values():
        if cfg is not None:
            setattr(cfg, INNER_ATTR, getattr(cfg, "_attn_implementation", None) or "sdpa")
    config._attn_implementation = ULYSSES_NAME
    return current


# ---------------------------------------------------------------------------------------------- sharding
def sp_multiple(pad_to_multiple_of: int | None, size: int) -> int:
    """The multiple a sharded row's width is rounded to: ``size`` and the user's ``pad_to_multiple_of``."""
    return math.lcm(size, pad_to_multiple_of or 1)


@dataclass
class ShardedRows:
    """This rank's shard of padding-free rows: ``input_ids``, ``position_ids`` (the whole rows'), ``shift_labels``
    ``[R, L/S]``, and the model's keyword arguments (:meth:`forward_kwargs`)."""

    input_ids: Tensor
    position_ids: Tensor
    shift_labels: Tensor
    ulysses: UlyssesRows

    def forward_kwargs(self) -> dict:
        return {"position_ids": self.position_ids, "ulysses": self.ulysses}


def inner_for_rows(config, rows: PackedRows) -> str:
    """The attention a sharded forward of ``rows`` runs after the exchange: varlen rows (no mask) the model's
    flash-attention or :data:`~trl_nrollout.passes.varlen.VARLEN_NAME`, masked rows SDPA or eager."""
    from trl_nrollout.passes.varlen import VARLEN_ATTENTION, attention_of

    attn = attention_of(config)
    if rows.attention_mask is None:
        return attn if attn in VARLEN_ATTENTION else VARLEN_NAME
    if attn not in ("sdpa", "eager"):
        raise ValueError(f"{ULYSSES_NAME}: rows with a block mask need SDPA or eager attention, not {attn!r}.")
    return attn


def shard_rows(rows: PackedRows, sp: SPGroup, inner: str) -> ShardedRows:
    """This rank's contiguous ``1/S`` of every row of ``rows`` (``[R, L]``, ``L`` a multiple of ``S``: pack with
    :func:`sp_multiple`): tokens, their positions in the whole row, the labels they predict; the whole rows' mask or
    boundaries go to every layer through :class:`UlyssesRows`."""
    width = rows.input_ids.shape[1]
    if width % sp.size:
        raise ValueError(f"shard_rows: rows of {width} tokens do not split over sequence_parallel_size={sp.size}; "
                         f"pack them with pad_to_multiple_of={sp_multiple(None, sp.size)}.")
    n = width // sp.size
    cut = slice(sp.rank * n, (sp.rank + 1) * n)
    varlen = varlen_kwargs(rows.position_ids) if rows.attention_mask is None else None
    ctx = UlyssesRows(sp, inner, rows.attention_mask, varlen, rows.position_ids)
    return ShardedRows(rows.input_ids[:, cut], rows.position_ids[:, cut], rows.shift_labels[:, cut], ctx)


def sharded_policy_logps(model: nn.Module, rows: PackedRows, sp: SPGroup) -> tuple[Tensor, Tensor | None]:
    """The update's forward of ``rows`` split over ``sp``: this rank's shard through TRL's fused LM head (the model
    patched by ``trl.trainer.utils.add_fused_lm_head``; per-position log-probs of ``shift_labels``), the group's
    shards gathered, with gradient. Returns log-probs and entropies ``[B, C]`` as :meth:`PackedRows.gather` lays
    them out (entropies None where the head does not compute them); every rank of the group returns the same."""
    inner_model = model
    while hasattr(inner_model, "module") and isinstance(inner_model.module, nn.Module):
        inner_model = inner_model.module
    shard = shard_rows(rows, sp, inner_for_rows(inner_model.config, rows))
    out = model(input_ids=shard.input_ids, shift_labels=shard.shift_labels, fused_lm_head=True,
                **shard.forward_kwargs())
    logps = rows.gather(gather_sequence(out.log_probs, sp))
    entropy = None if out.entropy is None else rows.gather(gather_sequence(out.entropy, sp))
    return logps, entropy
