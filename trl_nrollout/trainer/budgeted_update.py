"""Token-budgeted micro batches for the update (``use_dynamic_bsz`` / ``ppo_max_token_len_per_device``): the
budget (explicit, or the default from the model and the device), each optimizer step's samples re-cut under it (as
many micro batches on every rank), and the Trainer's ``compute_loss`` running a micro step's micro batches with the
gradients held until the last (under FSDP reduced every micro batch instead:
:func:`~trl_nrollout.passes.budget.sync_each_micro_batch`). A part of the trainer, beside the
:class:`~trl_nrollout.trainer.update.PolicyUpdate` it runs (docs/training.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate.utils import DistributedType, gather
from torch import Tensor, nn

from trl_nrollout.passes.budget import (
    BudgetedStep,
    budget_units,
    concat_batches,
    frozen_weight_bytes,
    logits_bytes_per_token,
    logprob_pass_tokens,
    sample_lengths,
    select_rows,
    slot_sizes,
    sync_each_micro_batch,
    update_state_bytes,
    with_micro_tokens,
)
from trl_nrollout.passes.distributed import is_fsdp
from trl_nrollout.passes.logprobs import plain_output_head
from trl_nrollout.passes.padfree import (
    budget_count,
    budgeted_parts,
    padded_budget_count,
    shared_units,
    split_to,
    unit_lengths,
)
from trl_nrollout.passes.ulysses import SPGroup
from trl_nrollout.plan.activations import (
    BUDGET_ROUNDING,
    DEFAULT_ACTIVATION_FRACTION,
    activation_bytes_per_token,
    default_update_token_budget,
)
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.shapes import padfree_token_cap
from trl_nrollout.trainer.forward_rules import ForwardRules
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.update import MicroStep, PolicyUpdate, loss_mask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceTokenBudget:
    """The token budget this trainer's device runs with (the plan's figure of it, with its arithmetic, is
    :class:`~trl_nrollout.plan.update_budget.UpdateBudget`): the update's ``tokens`` per micro batch, and whether
    the user set it (a default grows to the longest sample instead of refusing it); ``logprob_tokens``: the log-prob
    passes' default budget, by their own bytes per token (:func:`~trl_nrollout.passes.budget.logprob_pass_tokens`;
    None: ``tokens``)."""

    tokens: int
    explicit: bool  # a child of trl_nrollout.trainer: filtering that name filters all
    logprob_tokens: int | None = None

    @property
    def passes(self) -> int:
        """The log-prob passes' default token budget."""
        return self.tokens if self.logprob_tokens is None else self.logprob_tokens


def resolve_update_budget(args: Any, accelerator: Any, model, rules: ForwardRules, *, fsdp: bool,
                          prompt_length: Callable[[], int], frozen: Sequence[nn.Module] = ()
                          ) -> DeviceTokenBudget | None:
    """The update's token budget per device (None: count-based micro batches): ``ppo_max_token_len_per_device``,
    or with ``use_dynamic_bsz`` and no budget the default for ``model`` (the policy) and this device
    (:func:`~trl_nrollout.plan.activations.default_update_token_budget`: half of what the device has left after
    the trainer's states, in activation bytes per token; on a CPU 16,384 tokens), said once in the log. The
    old-policy and reference passes take it too where their size is a default, lowered where their forward keeps
    whole logits (``logprob_tokens``). The states count the whole model even where ZeRO-3 has partitioned it at
    load (``zero3_init_flag``: :func:`~trl_nrollout.passes.budget.full_numel`). Under FSDP (``fsdp``: the Trainer's
    ``is_fsdp_enabled``) the Trainer's micro steps reduce their gradients each
    (:func:`fsdp_gradients_each_micro_batch`), as the budget assumes. ``prompt_length``: the longest prompt's tokens
    (asked only for a default budget); ``frozen``: the models the trainer holds beside the policy (the reference, a
    teacher), whose weights take the device's memory too (:func:`~trl_nrollout.passes.budget.frozen_weight_bytes`)."""
    fsdp_gradients_each_micro_batch(accelerator, fsdp)
    if not args.use_dynamic_bsz:
        return None
    if args.ppo_max_token_len_per_device is not None:
        return DeviceTokenBudget(args.ppo_max_token_len_per_device, explicit=True)
    inner = accelerator.unwrap_model(model)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    sharded = (plugin is not None and plugin.zero_stage == 3) or fsdp
    total, state = update_state_bytes(inner.parameters(), accelerator.num_processes, sharded)
    state += frozen_weight_bytes([p for m in frozen for p in m.parameters()], accelerator.num_processes, sharded)
    device = accelerator.device
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if memory is not None and not args.rollout_ranks and not args.vllm_enable_sleep_mode \
            and args.rollout_backend != "hf":  # a colocated engine keeps its share while the trainer works
        memory = int(memory * (1 - args.vllm_gpu_memory_utilization))
    longest = prompt_length() + (args.max_completion_length or 256)
    padfree = rules.padfree_allowed(model)
    dtype_bytes = 2 if (args.bf16 or args.fp16) else 4
    tokens = default_update_token_budget(
        inner.config.to_dict(), device_memory_bytes=memory, state_bytes_per_device=state, longest_sample=longest,
        gradient_checkpointing=bool(args.gradient_checkpointing), dtype_bytes=dtype_bytes,
        # beyond it the rows' block mask is over its bound and the micro batch would run padded (plan's rule);
        # varlen rows have no mask
        max_tokens=padfree_token_cap(longest) if padfree and memory is not None
        and not rules.rows_varlen(model) else None)
    text = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    passes = logprob_pass_tokens(
        tokens, room_bytes=None if memory is None else memory - state, longest_sample=longest,
        activation_bytes_per_token=activation_bytes_per_token(
            inner.config.to_dict(), dtype_bytes=dtype_bytes, gradient_checkpointing=bool(args.gradient_checkpointing)),
        logits_bytes=logits_bytes_per_token(text.vocab_size, dtype_bytes, plain_output_head(inner) is not None),
        fraction=DEFAULT_ACTIVATION_FRACTION, rounding=BUDGET_ROUNDING)
    if accelerator.is_main_process:
        where = "a CPU" if memory is None else f"{memory / 2**30:.0f} GiB of {device.type} memory"
        logger.info("use_dynamic_bsz: ppo_max_token_len_per_device=%d by default (%d parameters, %s; "
                    "`trl-nrollout plan` prints the same); set it to change.", tokens, total, where)
        if passes < tokens:
            logger.info("use_dynamic_bsz: the log-prob passes take %d tokens per forward by default (their "
                        "forward keeps whole [tokens, %d] logits); set log_prob_max_token_len_per_device to "
                        "change.", passes, text.vocab_size)
    return DeviceTokenBudget(tokens, explicit=False, logprob_tokens=passes)


def with_pass_budgets(layout: RolloutLayout, budget: DeviceTokenBudget | None) -> RolloutLayout:
    """``layout`` with the old-policy and reference passes under the update's ``budget`` (its ``passes`` tokens)
    where their size is a default (the reference pass follows only where its own is a default too)."""
    old, ref = layout.old_log_prob, layout.ref_log_prob
    if budget is None or old.max_token_len is not None or not old.source.startswith("default"):
        return layout
    return replace(layout, old_log_prob=replace(old, max_token_len=budget.passes),
                   ref_log_prob=replace(ref, max_token_len=budget.passes)
                   if ref.max_token_len is None and ref.source.startswith("default") else ref)


def fsdp_gradients_each_micro_batch(accelerator: Any, fsdp: bool) -> None:
    """Under FSDP (accelerate's, 1 or 2: ``fsdp``) every micro step reduce-scatters its gradients, as verl does
    (:func:`~trl_nrollout.passes.budget.sync_each_micro_batch`: accelerate's ``sync_each_batch``, which the
    Trainer reads before each micro step, in place of ``no_sync`` that would keep the unsharded gradients of the
    whole model until the optimizer step's last micro step)."""
    if sync_each_micro_batch(fsdp):
        accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True


class BudgetedMicroBatches:
    """The update's micro batches under the token budget, a part of the trainer (see the module docstring): built
    once with the ``budget`` (:func:`resolve_update_budget`; None: count-based micro batches) and the
    :class:`~trl_nrollout.trainer.update.PolicyUpdate` whose loss each micro batch runs; the model handed to each
    call."""

    def __init__(self, args: Any, accelerator: Any, rules: ForwardRules, metrics: Metrics, update: PolicyUpdate,
                 budget: DeviceTokenBudget | None, *, sp: SPGroup | None, pad_to_multiple_of: int | None,
                 fsdp: bool) -> None:
        self.args, self.accelerator, self.rules, self.metrics, self.update = args, accelerator, rules, metrics, update
        self.budget, self.sp, self.pad_to_multiple_of, self.fsdp = budget, sp, pad_to_multiple_of, fsdp
        self.said = False

    def budget_for(self, lengths: list[int]) -> int:
        """The budget one rank's samples are cut under: the configured one (a sample over it is an error naming the
        option), or the default, raised to this step's longest sample (a default never refuses a sample)."""
        budget, sp = self.budget, self.sp  # Ulysses: a group's micro batch holds its S ranks' tokens
        tokens = budget.tokens * (sp.size if sp is not None else 1)
        return tokens if budget.explicit else max(tokens, max(lengths, default=1))

    def steps(self, model, chunks: list[dict]) -> list[BudgetedStep]:
        """A rollout's count-based micro batches (TRL's ``steps_per_generation`` of them, normalizers attached) re-cut
        under the token budget (:mod:`trl_nrollout.passes.budget`): the samples of each optimizer step pooled, cut
        into micro batches of at most the budget's tokens (real tokens where the forward is padding-free, padded
        size otherwise) of even work, as many on every rank, spread over the optimizer step's micro steps. Where
        TRL's optimizer steps span rollouts (``gradient_accumulation_steps`` does not divide the micro batches),
        each micro step's samples are cut alone. ``model``: the policy (its layout rules and width)."""
        accum = self.args.gradient_accumulation_steps
        window = accum if len(chunks) % accum == 0 else 1
        padded = any("mm_inputs" in c for c in chunks) or not self.rules.padfree_allowed(model)
        varlen = not padded and self.rules.rows_varlen(model)  # rows cost their pairs only, no L x L mask
        # a group's samples in one micro batch (its prompt once: a mask's layout)
        shared = not padded and not varlen and self.args.shared_prompt_forward is not False and \
            self.sp is None  # Ulysses rows hold one sample a unit
        pools, needs = [], []
        for start in range(0, len(chunks), window):
            group = [with_micro_tokens(c, loss_mask(c).sum()) for c in chunks[start:start + window]]
            pool = concat_batches(group)
            lengths = sample_lengths(pool)
            budget = self.budget_for(lengths)
            if padded:
                items, need = None, padded_budget_count(lengths, budget)
            else:
                budget_count(lengths, budget)  # a sample over an explicit budget: the error naming the option
                items = self._budget_items(pool, lengths, budget) if shared else [[b] for b in range(len(lengths))]
                need = budget_count(self._item_lengths(pool, lengths, items), budget)
            pools.append((pool, lengths, budget, items))
            needs.append(max(need, window))
        # every rank runs as many forwards (ZeRO-3 / FSDP gather in each): the busiest rank's count, per optimizer step
        every = gather(torch.tensor([needs], device=self.accelerator.device))  # [ranks, optimizer steps]
        counts = every.amax(0).cpu()
        self.metrics.add("train", "update/micro_batches", float(counts.sum()))
        self.metrics.add("train", "update/micro_batches_least_rank", float(every.amin(0).sum()))
        hidden = getattr(self.accelerator.unwrap_model(model).config, "hidden_size", None) or 4096
        steps: list[BudgetedStep] = []
        for (pool, lengths, budget, items), count in zip(pools, counts.tolist()):
            if items is None:
                own = budgeted_parts(lengths, budget, min(count, len(lengths)), hidden, padded=True)
            else:  # whole groups (or single samples) as the items cut; split further only to reach the count
                by_item = budgeted_parts(self._item_lengths(pool, lengths, items), budget,
                                         min(count, len(items)), hidden, varlen=varlen)
                own = split_to([[b for i in part for b in items[i]] for part in by_item], min(count, len(lengths)))
            parts = [select_rows(pool, idx, self.pad_to_multiple_of) for idx in own]
            # a rank with fewer samples than the busiest rank's count: forwards that weigh nothing keep it in step
            parts += [{**select_rows(pool, [0], self.pad_to_multiple_of), "loss_scale": 0.0}
                      for _ in range(count - len(own))]
            at = 0
            for size in slot_sizes(count, window):
                steps.append(BudgetedStep(parts[at:at + size]))
                at += size
        if not self.said and self.accelerator.is_main_process:
            self.said = True
            logger.info("use_dynamic_bsz: the update runs micro batches of at most %d %s tokens per device (%d for "
                        "this rollout's %d micro steps, the busiest rank's count on every rank).",
                        self.budget.tokens,
                        "padded" if padded else "real", int(counts.sum()), len(chunks))
        return steps

    @staticmethod
    def _budget_items(pool: dict, lengths: list[int], budget: int) -> list[list[int]]:
        """The pool's samples grouped by prompt (runs of a group within the budget): what the budget cuts."""
        prompts = [tuple(ids[m.bool()].tolist()) for ids, m in zip(pool["prompt_ids"], pool["prompt_mask"])]
        prompt_lens = [len(p) for p in prompts]
        return budget_units(shared_units(prompts), prompt_lens,
                            [n - p for n, p in zip(lengths, prompt_lens)], budget)

    @staticmethod
    def _item_lengths(pool: dict, lengths: list[int], items: list[list[int]]) -> list[int]:
        """Tokens of each item in padding-free rows: a group's prompt once (:func:`unit_lengths`)."""
        prompt_lens = pool["prompt_mask"].sum(-1).tolist()
        return unit_lengths(prompt_lens, [n - p for n, p in zip(lengths, prompt_lens)], items)

    def loss(self, model, inputs: BudgetedStep, step: MicroStep) -> Tensor:
        """The Trainer's ``compute_loss`` of a budgeted micro step ``inputs`` at ``step``: its micro batches'
        losses, each run by the policy update (:meth:`~trl_nrollout.trainer.update.PolicyUpdate.loss`)."""
        # every micro batch but the last: forward and backward here, gradients held; the last one's loss goes back to
        # the Trainer, which backpropagates it (and, at the accumulation boundary, syncs and steps)
        done: list[Tensor] = []
        for part, last in self._each_part(model, inputs):
            loss = self._part_loss(model, part, step)
            if last:
                return loss + torch.stack(done).sum() if done else loss
            self.accelerator.backward(loss, **self._backward_kwargs())
            done.append(loss.detach())
        raise AssertionError("a budgeted micro step holds at least one micro batch")

    def _part_loss(self, model, part: dict, step: MicroStep) -> Tensor:
        loss = self.update.loss(model, part, step)
        scale = part.get("loss_scale")
        return loss if scale is None else loss * scale

    def _backward_kwargs(self) -> dict:
        """What the Trainer passes to ``accelerator.backward`` (our losses are already scaled for accumulation)."""
        return {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}

    def _each_part(self, model, inputs) -> Iterator[tuple[dict, bool]]:
        """The micro batches of one micro step with whether each is the last; every one but the last runs with the
        gradients held (:meth:`gradients_held`). A plain TRL batch is one micro batch."""
        parts = inputs.parts if isinstance(inputs, BudgetedStep) else [inputs]
        for i, part in enumerate(parts):
            if i == len(parts) - 1:
                yield part, True
            else:
                with self.gradients_held(model):
                    yield part, False

    @contextmanager
    def gradients_held(self, model) -> Iterator[None]:
        """A micro batch that is not its micro step's last: no optimizer step after its backward, even at the
        accumulation boundary (accelerate's ``sync_gradients`` off: DeepSpeed neither reduces as at a boundary nor
        steps), and no gradient sync (DDP ``no_sync``) but under FSDP, where each micro batch reduce-scatters its
        gradients (:func:`~trl_nrollout.passes.budget.sync_each_micro_batch`: FSDP's ``no_sync`` would hold the whole
        model's unsharded gradients, which the budget does not count). Off the boundary the Trainer already holds
        them (but under FSDP: :func:`fsdp_gradients_each_micro_batch`)."""
        acc = self.accelerator
        if not acc.sync_gradients:
            yield
            return
        acc.gradient_state._set_sync_gradients(False)
        held = nullcontext() if sync_each_micro_batch(
            self.fsdp or is_fsdp(model)) else acc.no_sync(model)
        try:
            with held:
                yield
        finally:
            acc.gradient_state._set_sync_gradients(True)
