"""What a step will cost in time, phase by phase, before anything runs (``trl-nrollout plan --predict``).

A roofline model with fixed costs, per device, for one step of the layout (:class:`RolloutLayout`):

- **generation** (each engine in parallel; the step waits for one engine's share): ``call_s`` + prefill + decode.
  Prefill is compute-bound: ``2 x params`` FLOPs per prompt token plus attention, the prompt prefilled once per
  group (vLLM's ``n`` shares its KV blocks). Decode runs ``steps`` engine steps with ``running`` sequences on
  average: with every sample of the share running at once (``max_num_seqs`` not below it) the step count is the
  longest completion (the tail); otherwise the engine works through its samples in waves, ``samples x mean /
  max_num_seqs`` steps plus the last wave's tail. Partial rollouts (``work.partial``): the pool in flight (the
  share x ``pool_factor``, up to ``max_num_seqs``) runs, and a step ends with its share's tokens, no tail:
  ``samples x mean / running`` steps (the steady state). One step costs its roofline (:func:`decode_step_s`: the linear
  layers' larger of their FLOPs and the weights read once, then attention's larger of its FLOPs and each running
  sequence's KV cache read: separate kernels, one after the other), plus the TP all-reduces (two per layer), plus
  ``step_s + seq_step_s x running``.
- **weight sync** (colocated: an on-device copy into the engine): the engine's weights once over ``weight_sync_bw``
  (plus a ZeRO-3/FSDP gather over the link), plus ``sync_s``. Rollout ranks' transfer (through host memory over
  gloo): :func:`trl_nrollout.plan.search.host_transfer_s`.
- **old-policy / reference log-prob passes**: the forwards the trainer runs
  (:func:`~trl_nrollout.plan.shapes.pass_shape`), micro batch by micro batch: packed with each prompt once where the
  trainer's own rule (:func:`~trl_nrollout.plan.packing_rules.packing_pays`) packs it, else as padding-free rows
  (``Workload.padfree_rows``: real tokens plus the last row's end,
  :func:`~trl_nrollout.plan.shapes.padfree_rows_of`) where they fit, else padded to the micro batch's longest
  sample; under a token budget with no count set, micro batches of even real tokens. ``2 x params`` FLOPs per token
  slot through the linear layers and attention over every query-key pair of a row (a masked SDPA computes its
  ``L x L`` in full), one ``forward_s`` per micro batch, a sharded trainer's weight gather per forward; no
  old-policy pass on-policy (one optimizer step per rollout), as the trainer skips it.
- **update**: the same forwards (:func:`~trl_nrollout.plan.shapes.update_shape`: ``ppo_micro_batch_size_per_device``
  samples per micro batch, the rank's batch padded once to the step's longest where rows are padded; or each
  optimizer step's samples cut under ``update_token_budget``, at least ``gradient_accumulation_steps`` micro
  batches), three times the FLOPs (forward and backward) per PPO epoch, ``2 x forward_s`` per micro batch, the
  optimizer's pass over its states (16 bytes per parameter read and written, on the rank's shard), and a sharded
  trainer's gathers and reduce-scatters.

Memory per device: the engine's weights and KV cache (:mod:`trl_nrollout.plan.memory`) and the trainer's
parameters, gradients and Adam states (bf16 weights and grads + fp32 master and moments: 16 bytes per parameter,
over the data-parallel ranks when sharded).

Pure: no torch at import; the model comes in as :class:`~trl_nrollout.plan.dims.ModelDims` (read from a config dict).

This module holds the step's prediction (:class:`StepPrediction`, :func:`predict_step`, :func:`predict_vs_n`) and
the trainer's states (:func:`trainer_state_bytes`); the model's dimensions are in :mod:`trl_nrollout.plan.dims`,
the workload in :mod:`trl_nrollout.plan.workload`, the passes' forwards in :mod:`trl_nrollout.plan.shapes`, and
the search over layouts (``--suggest``, rollout ranks) in :mod:`trl_nrollout.plan.search`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.memory import estimate_kv
from trl_nrollout.plan.shapes import PassShape, pass_shape, update_shape
from trl_nrollout.plan.workload import Workload

#: the phases of a predicted step, in order
PHASES = ("generation", "weight_sync", "old_log_prob", "ref_log_prob", "teacher_log_prob", "update")
#: bytes per trained parameter: bf16 weights and gradients, fp32 master weights and two Adam moments
TRAIN_BYTES_PER_PARAM = 2 + 2 + 4 + 4 + 4
#: what the optimizer reads and writes per parameter of its shard in a step (states, master, grads, weights)
OPTIMIZER_BYTES_PER_PARAM = 2 * TRAIN_BYTES_PER_PARAM


# ---------------------------------------------------------------------------------------------- the prediction
@dataclass(frozen=True)
class StepPrediction:
    """Seconds per phase of one step (:data:`PHASES`), their sum, samples per second, memory per device (bytes)
    and the intermediate figures (``details``) a reader can check."""

    phases: dict[str, float]
    total_s: float
    samples_per_s: float
    engine_bytes: int
    train_bytes: int
    details: dict[str, float] = field(default_factory=dict)
    #: the update's largest micro batch's activations per device (its token slots x
    #: :func:`~trl_nrollout.plan.activations.activation_bytes_per_token`), beside ``train_bytes`` (the states)
    activation_bytes: int = 0

    @property
    def trainer_bytes(self) -> int:
        """What a trainer holds per device at the update's peak: its states and one micro batch's activations."""
        return self.train_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trainer_bytes": self.trainer_bytes}


def decode_step_s(dims: ModelDims, running: float, context: float, tp: int, dev: DeviceProfile) -> tuple[float, str]:
    """The roofline of one decode step of an engine of ``tp`` devices with ``running`` sequences of ``context``
    tokens on average: the linear layers (the larger of their FLOPs and the weights they read) then attention (the
    larger of its FLOPs and the KV cache it reads), and which bound the step ("memory", "compute" or "mixed")."""
    rate = tp * dev.flops * dev.mfu_prefill
    bandwidth = tp * dev.mem_bw * dev.bw_eff
    linear_compute = running * 2 * dims.matmul_params / rate
    linear_memory = dims.weights_read(running) * dims.dtype_bytes / bandwidth  # a MoE step: the experts it uses
    attention_compute = running * dims.attention_flops(context) / rate
    attention_memory = running * context * dims.kv_bytes_per_token / bandwidth
    memory = (linear_memory >= linear_compute, attention_memory >= attention_compute)
    bound = "memory" if all(memory) else "compute" if not any(memory) else "mixed"
    return max(linear_compute, linear_memory) + max(attention_compute, attention_memory), bound


def _generation(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> tuple[float, dict]:
    tp = layout.rollout_tp_size
    groups = layout.prompts_per_engine
    samples = layout.samples_per_engine
    running_cap = min(samples, work.max_num_seqs)
    matmul = dims.matmul_params
    prefill_tokens = groups * work.prompt_len
    prefill_flops = groups * work.prompt_len * (2 * matmul + dims.attention_flops(work.prompt_len / 2))
    prefill_s = prefill_flops / (tp * dev.flops * dev.mfu_prefill)
    tokens = samples * work.completion_mean
    if work.partial:  # steady state: the pool (its share x pool_factor) runs; a step's tokens at its width, no tail
        running_cap = min(math.ceil(samples * work.pool_factor - 1e-9), work.max_num_seqs)
        steps = tokens / running_cap
    elif samples <= work.max_num_seqs:
        steps = float(work.completion_max)
    else:  # waves of max_num_seqs, then the last wave's tail
        steps = max(float(work.completion_max), tokens / running_cap + work.completion_max - work.completion_mean)
    running = tokens / steps if steps else 0.0
    context = work.prompt_len + work.completion_mean / 2
    roofline, bound = decode_step_s(dims, running, context, tp, dev)
    comm = 0.0
    if tp > 1:  # two all-reduces of [running, hidden] per layer (attention out, MLP out)
        volume = running * dims.hidden_size * dims.dtype_bytes * 2 * (tp - 1) / tp
        comm = 2 * dims.num_hidden_layers * (volume / (dev.link_bw * dev.link_eff) + dev.allreduce_s)
    step_s = roofline + comm + dev.step_s + dev.seq_step_s * running
    decode_s = steps * step_s
    details = {"prefill_tokens_per_engine": prefill_tokens, "prefill_s": prefill_s, "decode_steps": steps,
               "mean_running": running, "decode_step_s": step_s, "decode_s": decode_s,
               "decode_bound": bound, "tp_comm_per_step_s": comm}
    return dev.call_s + prefill_s + decode_s + dev.gen_sample_s * samples, details


def _dp_link(work: Workload, dev: DeviceProfile) -> float:
    """B/s of the trainers' collectives: a ring over every data-parallel rank runs at its slowest link, the nodes'
    when the ranks span several."""
    slowest = dev.node_link_bw if work.nodes > 1 and dev.node_link_bw else dev.link_bw
    return slowest * dev.link_eff


def _gather_s(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> float:
    """A sharded trainer's all-gather of the parameters for one forward (ZeRO-3 / FSDP: over every trainer, the
    ranks of a sequence-parallel group included)."""
    dp = layout.data_parallel_size * layout.sequence_parallel_size
    if not work.sharded or dp == 1:
        return 0.0
    return dims.num_parameters * dims.dtype_bytes * (dp - 1) / dp / _dp_link(work, dev)


def all_to_all_s(dims: ModelDims, tokens: float, sp: int, dev: DeviceProfile) -> float:
    """Seconds of one forward's Ulysses all-to-alls over ``tokens`` (a data-parallel rank's, split over its ``sp``
    ranks): per layer, q, k and v before attention and the output after it, each rank sending ``(sp - 1) / sp`` of
    its shard, over the node's link (the group is ``sp`` consecutive ranks); 0 without sequence parallelism."""
    if sp <= 1:
        return 0.0
    q, kv = dims.num_attention_heads * dims.head_dim, dims.num_key_value_heads * dims.head_dim
    per_token = (2 * q + 2 * kv) * dims.dtype_bytes * dims.num_hidden_layers
    return tokens / sp * per_token * (sp - 1) / sp / (dev.link_bw * dev.link_eff)


def _compute_s(shape: PassShape, dims: ModelDims, dev: DeviceProfile) -> float:
    """Seconds of one forward over ``shape``'s tokens: the linear layers at ``mfu_train``, attention's pairs at
    ``mfu_attention``."""
    linear = shape.tokens * 2 * dims.matmul_params / (dev.flops * dev.mfu_train)
    return linear + shape.pairs * dims.attention_flops_per_pair / (dev.flops * dev.attention_mfu)


def trainer_state_bytes(dims: ModelDims, work: Workload, dp: int = 1) -> float:
    """A trainer's states per device over ``dp`` data-parallel ranks: :data:`TRAIN_BYTES_PER_PARAM` per trained
    parameter (bf16 weights and gradients, fp32 master weights and two Adam moments), with LoRA (``work.lora_r``)
    the frozen base weights in their dtype besides; ZeRO-3 / FSDP (``work.sharded``) split all of it, ZeRO-2
    (``work.optimizer_sharded``) all but the bf16 weights."""
    trained = dims.num_parameters if work.lora_r is None else dims.lora_parameters(work.lora_r)
    frozen = 0 if work.lora_r is None else dims.num_parameters * dims.dtype_bytes
    weights, rest = frozen + trained * 2, trained * (TRAIN_BYTES_PER_PARAM - 2)
    if work.optimizer_offloaded:  # fp32 master weights and Adam moments on the host: the bf16 gradients stay
        rest = trained * 2
    if work.sharded:
        return (weights + rest) / dp
    if work.optimizer_sharded:
        return weights + rest / dp
    return weights + rest


def frozen_weight_bytes(dims: ModelDims, work: Workload, trainers: int) -> tuple[int, int]:
    """(reference, teacher) weight bytes per trainer device: TRL's reference model, a copy of the policy's weights
    where a KL term keeps one (``work.kl``; with LoRA the base with the adapter off: no copy), and the teacher's
    weights (``work.teacher``), each split over the ``trainers`` where ZeRO-3 / FSDP shards them (``work.sharded``)."""
    split = trainers if work.sharded else 1
    ref = math.ceil(dims.num_parameters * dims.dtype_bytes / split) if work.kl and work.lora_r is None else 0
    teacher = (0 if work.teacher is None or work.teacher_engine
               else math.ceil(work.teacher.num_parameters * work.teacher.dtype_bytes / split))
    return ref, teacher


def teacher_engine_bytes(work: Workload, layout: RolloutLayout) -> int:
    """A teacher engine's bytes per device (``work.teacher_engine``): its weights split over the TP group (a tied
    head counted twice at a temperature other than 1: the engine's copy unties it) and the float32 logits of its
    longest sample's prompt log-probs (vLLM scores a request's tokens at once); 0 without."""
    t = work.teacher
    if t is None or not work.teacher_engine:
        return 0
    untied = t.vocab_size * t.hidden_size if t.tie_word_embeddings and work.temperature != 1.0 else 0
    return (math.ceil((t.num_parameters + untied) * t.dtype_bytes / layout.rollout_tp_size)
            + math.ceil(work.row_width) * t.vocab_size * 4)


def predict_step(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> StepPrediction:
    """Seconds per phase of one training step of ``layout`` on devices ``dev`` (see the module docstring)."""
    gen_s, details = _generation(dims, layout, work, dev)
    gather = _gather_s(dims, layout, work, dev)
    adapter = work.lora_r is not None and work.lora_sync == "adapter"
    if adapter:  # the engines serve the adapter: only its tensors travel (gathered alone), generation at the kernels'
        # slowdown (the base went once, before the first step)
        sync_bytes = (work.lora_adapter_bytes if work.lora_adapter_bytes is not None
                      else dims.lora_parameters(work.lora_r) * dims.dtype_bytes)
        sync_s = dev.sync_s + sync_bytes / dev.weight_sync_bw
        gen_s *= dev.lora_slowdown(work.lora_r)
    else:
        sync_bytes = dims.num_parameters * dims.dtype_bytes
        sync_s = dev.sync_s + sync_bytes / dev.weight_sync_bw + gather
    samples = layout.samples_per_rank
    n = layout.rollout_n

    def shape(micro) -> PassShape:  # a log-prob pass, cut as its MicroBatch says (a budget with no count set: even
        # micro batches of real tokens on padding-free rows, the trainer's budgeted passes)
        budgeted = micro.max_token_len is not None and micro.source.startswith("default")
        return pass_shape(samples, micro.per_device, n, work, max_token_len=micro.max_token_len,
                          query_bytes=dims.dtype_bytes, budgeted=budgeted)

    sp = layout.sequence_parallel_size  # Ulysses: each rank of a group computes 1/sp of its samples' tokens

    def forward_s(p: PassShape) -> float:
        return _compute_s(p, dims, dev) / sp + p.forwards * (dev.forward_s + gather) + all_to_all_s(dims, p.tokens, sp,
                                                                                                   dev)

    # the teacher term compares the student's log-probs with the teacher's: the old-policy pass runs with a teacher
    on_policy = layout.optimizer_steps_per_rollout == 1 and work.skip_old_on_policy and work.teacher is None
    old_shape, ref_shape = shape(layout.old_log_prob), shape(layout.ref_log_prob)
    old_s = 0.0 if on_policy else forward_s(old_shape)
    ref_s = forward_s(ref_shape) if work.kl else 0.0
    ref_bytes, teacher_bytes = frozen_weight_bytes(dims, work, layout.data_parallel_size * sp)
    teacher_s = 0.0
    if work.teacher is not None and work.teacher_engine:  # one engine call over the samples' tokens (TP splits
        # the group's gathered samples' work: a rank's share), no trainer gathers nor micro batches
        teacher_s = _compute_s(ref_shape, work.teacher, dev) + dev.call_s
    elif work.teacher is not None:  # the reference pass's cut, the teacher's size; sharded as the reference is
        t = work.teacher
        teacher_s = (_compute_s(ref_shape, t, dev) / sp + ref_shape.forwards * (dev.forward_s + _gather_s(t, layout,
                                                                                                          work, dev))
                     + all_to_all_s(t, ref_shape.tokens, sp, dev))
    update = update_shape(layout, work, dims.dtype_bytes)
    micro = update.forwards * layout.ppo_epochs
    dp = layout.data_parallel_size * sp  # ZeRO / FSDP shard and DDP reduces over every trainer (Ulysses groups too)
    trained = dims.num_parameters if work.lora_r is None else dims.lora_parameters(work.lora_r)
    shard = trained / (dp if work.sharded else 1)
    optimizer_s = layout.optimizer_steps_per_rollout * shard * OPTIMIZER_BYTES_PER_PARAM / dev.optimizer_rate
    if work.optimizer_offloaded:  # the host's Adam over its states, the gradients down and the weights up (bf16)
        optimizer_s = layout.optimizer_steps_per_rollout * shard * (OPTIMIZER_BYTES_PER_PARAM / dev.host_optimizer_bw
                                                                    + 4 / dev.host_rate)
    reduce_s = 0.0 if dp == 1 else (layout.optimizer_steps_per_rollout * trained * 4 * (dp - 1) / dp
                                    / _dp_link(work, dev))
    # the update's all-to-alls: the forward's, the backward's, and the recomputed forward's with checkpointing
    update_a2a = layout.ppo_epochs * all_to_all_s(dims, update.tokens, sp, dev) * (3 if work.gradient_checkpointing
                                                                                   else 2)
    update_s = (layout.ppo_epochs * (3 * _compute_s(update, dims, dev) + update.tokens * dev.train_token_s
                                     + samples * dev.train_sample_s) / sp
                + micro * (2 * dev.forward_s + 2 * gather) + optimizer_s + reduce_s + update_a2a
                + layout.optimizer_steps_per_rollout * dev.train_fixed_s)
    if work.critic:  # a value pass and the critic's own update, a model of the policy's size
        old_s += forward_s(old_shape)
        update_s *= 2
    phases = {"generation": gen_s, "weight_sync": sync_s, "old_log_prob": old_s, "ref_log_prob": ref_s,
              "teacher_log_prob": teacher_s, "update": update_s}
    total = sum(phases.values())
    kv = estimate_kv(num_layers=dims.num_hidden_layers, num_kv_heads=dims.num_key_value_heads,
                     head_dim=dims.head_dim, dtype_bytes=dims.dtype_bytes, prompt_len=math.ceil(work.prompt_len),
                     response_len=work.completion_max,
                     prompts_per_engine=math.ceil(layout.prompts_per_engine * work.pool_factor - 1e-9),
                     n=layout.rollout_n, tp_size=layout.rollout_tp_size, max_num_seqs=work.max_num_seqs)
    engine_weights = math.ceil(dims.num_parameters * dims.dtype_bytes / layout.rollout_tp_size)
    engine_bytes = engine_weights + kv.bytes_per_gpu_shared + teacher_engine_bytes(work, layout)
    train_bytes = math.ceil(trainer_state_bytes(dims, work, dp) * (2 if work.critic else 1)) + ref_bytes + teacher_bytes
    from trl_nrollout.plan.activations import activation_bytes_per_token

    activation_bytes = math.ceil(update.slots_per_forward / sp * activation_bytes_per_token(
        dims, dtype_bytes=min(dims.dtype_bytes, 2), gradient_checkpointing=work.gradient_checkpointing))
    details.update(engine_weight_bytes=engine_weights, kv_bytes=kv.bytes_per_gpu_shared,
                   update_tokens_per_rank=update.tokens, update_pairs_per_rank=update.pairs,
                   update_packed=update.packed, update_padfree=update.padfree,
                   update_forwards_per_epoch=update.forwards, update_slots_per_forward=update.slots_per_forward, forward_flops_per_rank=update.flops(dims), micro_steps=micro,
                   optimizer_s=optimizer_s, weight_sync_bytes=sync_bytes, sequence_parallel_size=sp,
                   all_to_all_s=update_a2a + (0.0 if on_policy else all_to_all_s(dims, old_shape.tokens, sp, dev))
                   + (all_to_all_s(dims, ref_shape.tokens, sp, dev) if work.kl else 0.0),
                   lora_sync=work.lora_sync if work.lora_r is not None else None, ref_weight_bytes=ref_bytes,
                   teacher_weight_bytes=teacher_bytes, teacher_engine_bytes=teacher_engine_bytes(work, layout))
    return StepPrediction(phases=phases, total_s=total, samples_per_s=layout.total_samples / total,
                          engine_bytes=engine_bytes, train_bytes=train_bytes, details=details,
                          activation_bytes=activation_bytes)


def predict_vs_n(dims: ModelDims, layout_kwargs: dict[str, Any], work: Workload, dev: DeviceProfile,
                 n_values: Iterable[int]) -> list[tuple[int, StepPrediction]]:
    """The step at each ``n`` with the same prompts per step (the article's table, predicted); an ``n`` whose
    layout is invalid is left out."""
    out = []
    for n in n_values:
        try:
            layout = RolloutLayout.build(**{**layout_kwargs, "rollout_n": n})
        except LayoutError:
            continue
        out.append((n, predict_step(dims, layout, work, dev)))
    return out
