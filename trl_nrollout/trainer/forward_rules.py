"""What the trainer's forwards may do, shared by its parts (the log-prob passes, the policy update, the token budget,
the HF engine and PPO's critic): whether a model's forward may pack a group's prompt once (``shared_prompt_forward``)
or run padding-free rows (``padding_free``), each said once in the log; whether those rows run varlen attention; the
sampler's cut the engine's log-probs are over; the Ulysses group of ``sequence_parallel_size``; the note on the
decoupled loss. The trainer builds :class:`ForwardRules` once and hands it to each part."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from trl_nrollout.algos.losses import sampling_support_log_mass
from trl_nrollout.passes.logprobs import SupportFn
from trl_nrollout.passes.packing import query_dtype, structural_reason
from trl_nrollout.passes.padfree import rows_mask_dtype
from trl_nrollout.passes.ulysses import SPGroup, check_heads, install, new_sp_group

logger = logging.getLogger(__name__)


class ForwardRules:
    """Which layout a model's forwards may take (``args``: the trainer's config; ``accelerator``: its accelerator, to
    unwrap a model and read the autocast dtype). Each "not used" reason is said once per run, whichever part asks
    first (``packing_notice_shown``, ``padfree_notice_shown``)."""

    def __init__(self, args: Any, accelerator: Any) -> None:
        self.args, self.accelerator = args, accelerator
        self.packing_notice_shown = False
        self.padfree_notice_shown = False

    def packing_allowed(self, model, *, images: bool = False, aux_loss: bool = False) -> bool:
        """Whether ``shared_prompt_forward`` may pack ``model``'s forwards: not switched off, and the model takes
        the packed layout (:func:`~trl_nrollout.passes.packing.structural_reason`; why not is said once)."""
        if self.args.shared_prompt_forward is False:
            return False
        reason = structural_reason(self.accelerator.unwrap_model(model).config, images=images, aux_loss=aux_loss)
        if reason is not None:
            self.packing_notice(reason)
        return reason is None

    def packing_notice(self, reason: str) -> None:
        """Say once why the shared-prompt layout is not used (a warning if the user asked for it explicitly)."""
        if self.packing_notice_shown:
            return
        self.packing_notice_shown = True
        explicit = self.args.shared_prompt_forward is True
        logger.log(logging.WARNING if explicit else logging.INFO,
                   "shared_prompt_forward%s is not used: %s; the plain forward runs.",
                   "=True" if explicit else " (default)", reason)

    def padfree_allowed(self, model, *, aux_loss: bool = False) -> bool:
        """Whether ``padding_free`` may lay ``model``'s forwards out as padding-free rows: not switched off, and the
        model takes a 4D block mask (the shared-prompt layout's rule; why not is said once)."""
        if self.args.padding_free is False:
            return False
        reason = structural_reason(self.accelerator.unwrap_model(model).config, aux_loss=aux_loss, varlen=True)
        if reason is not None and not self.padfree_notice_shown:
            self.padfree_notice_shown = True
            logger.log(logging.WARNING if self.args.padding_free else logging.INFO,
                       "padding_free%s is not used: %s; the padded forward runs.",
                       "=True" if self.args.padding_free else " (default)", reason)
        return reason is None

    def rows_varlen(self, model) -> bool:
        """Whether ``model``'s padding-free rows run varlen attention (no mask: flash-attention, or SDPA on CUDA in
        half precision; :func:`~trl_nrollout.passes.padfree.rows_mask_dtype`)."""
        config = self.accelerator.unwrap_model(model).config
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        device = self.accelerator.device.type
        with self.accelerator.autocast():
            queries = query_dtype(weights, device)
        return rows_mask_dtype(config, weights, queries, device) is None


def sampling_support(args: Any, rollout_backend: str, top_k: int | None, top_p: float | None,
                     min_p: float | None) -> SupportFn | None:
    """The trainer's replay of the sampler's cut (top-k, top-p, min-p; TRL's options, or ``generation_kwargs``
    where they override them): a function giving the log of the probability mass the sampler keeps at each
    position (:func:`~trl_nrollout.algos.losses.sampling_support_log_mass`), or None where nothing is cut. The
    engines report each token's log-prob over the tokens they kept, renormalized (vLLM's ``processed_logprobs``;
    the HF engine records the same), while the trainer's log-probs are over the whole vocabulary: subtracting this
    mass puts the trainer's on the engine's support, so that the rollout correction and the mismatch metrics compare
    like with like (TRL issue 6789). The HF engine's decoding modes other than sampling (beams...) score their
    samples with the trainer's own pass: nothing to replay."""
    from trl_nrollout.rollout.engines.hf_engine import _NOT_STEPWISE

    extra = dict(args.generation_kwargs or {})
    if rollout_backend == "hf" and any(k in _NOT_STEPWISE and v not in (None, 1, False) for k, v in extra.items()):
        return None
    top_k = extra.get("top_k", top_k) or 0
    top_p = extra.get("top_p", top_p)
    min_p = extra.get("min_p", min_p) or 0.0
    top_p = 1.0 if top_p is None else float(top_p)
    if not (top_k > 0 or top_p < 1.0 or min_p > 0.0):
        return None
    return partial(sampling_support_log_mass, top_k=int(top_k), top_p=top_p, min_p=float(min_p),
                   min_p_first=rollout_backend != "hf")  # vLLM cuts min-p first, generate() last


def sequence_parallel_setup(args: Any, models: list, aux_loss: bool) -> SPGroup | None:
    """``sequence_parallel_size`` S > 1: the ``models``' heads checked (unwrapped: the policy, the reference; a
    ValueError naming the option and the fix), this rank's Ulysses group made (every S consecutive ranks; the
    processes' rule is the layout's), and their attention wrapped (:func:`~trl_nrollout.passes.ulysses.install`).
    None at 1."""
    size = args.sequence_parallel_size
    if size == 1:
        return None
    for model in models:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = cfg.num_attention_heads
        check_heads(heads, getattr(cfg, "num_key_value_heads", None) or heads, size)
    if aux_loss:
        raise ValueError(f"sequence_parallel_size={size} with a MoE router loss (output_router_logits): the "
                         "router's loss is not gathered over the group yet; set sequence_parallel_size=1 or "
                         "turn the router loss off.")
    for model in models:
        if (why := structural_reason(model.config, varlen=True)) is not None:  # the rows' rule: the same
            raise ValueError(f"sequence_parallel_size={size} runs padding-free rows, but {why}; use "
                             "sequence_parallel_size=1.")
    sp = new_sp_group(size, seed=args.seed)
    for model in models:
        install(model)
    logger.info("sequence_parallel_size=%d: ranks %d..%d split each padding-free row (data-parallel rank %d of "
                "%d).", size, sp.dp_rank * size, sp.dp_rank * size + size - 1, sp.dp_rank, sp.dp_size)
    return sp


def note_corrections(args: Any, main_process: bool) -> None:
    """One line, on the main process, when the decoupled loss is on by default because samples can be older
    than the policy that trains on them (``decoupled_loss=None`` resolved by the config)."""
    reason = getattr(args, "_stale_reason", None)
    if reason is None or not args.decoupled_loss or not main_process:
        return
    bound = ("no upper bound" if args.rollout_is_threshold is None else
             f"at most rollout_is_threshold={args.rollout_is_threshold:g}")
    logger.warning("%s: the decoupled PPO loss is on (decoupled_loss=None): the clip against the policy at the "
                   "update, each %s's loss times its importance weight of that policy over the one that sampled "
                   "it (rollout_is=%r, %s, mode %r); decoupled_loss=False turns it off.",
                   reason, args.rollout_is, args.rollout_is, bound, args.rollout_is_mode)
