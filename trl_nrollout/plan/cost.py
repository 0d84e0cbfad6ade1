"""What a step will cost in time, phase by phase, before anything runs (``trl-nrollout plan --predict``).

A roofline model with fixed costs, per device, for one step of the layout (:class:`RolloutLayout`):

- **generation** (each engine in parallel; the step waits for one engine's share): ``call_s`` + prefill + decode.
  Prefill is compute-bound: ``2 x params`` FLOPs per prompt token plus attention, the prompt prefilled once per
  group (vLLM's ``n`` shares its KV blocks). Decode runs ``steps`` engine steps with ``running`` sequences on
  average: with every sample of the share running at once (``max_num_seqs`` not below it) the step count is the
  longest completion (the tail); otherwise the engine works through its samples in waves, ``samples x mean /
  max_num_seqs`` steps plus the last wave's tail. One step costs its roofline (:func:`decode_step_s`: the linear
  layers' larger of their FLOPs and the weights read once, then attention's larger of its FLOPs and each running
  sequence's KV cache read: separate kernels, one after the other), plus the TP all-reduces (two per layer), plus
  ``step_s + seq_step_s x running``.
- **weight sync**: the engine's weights once over ``weight_sync_bw`` (plus a ZeRO-3/FSDP gather over the link),
  plus ``sync_s``.
- **old-policy / reference log-prob passes**: the forwards the trainer runs (:func:`pass_shape`), micro batch by
  micro batch: packed with each prompt once where the trainer's own rule
  (:func:`~trl_nrollout.passes.packing_rules.packing_pays`) packs it, else as padding-free rows
  (``Workload.padfree_rows``: real tokens plus the last row's end, :func:`padfree_rows_of`) where they fit, else
  padded to the micro batch's longest sample; under a token budget with no count set, micro batches of even real
  tokens. ``2 x params`` FLOPs per token slot through the linear layers and attention over every query-key pair of
  a row (a masked SDPA computes its ``L x L`` in full), one ``forward_s`` per micro batch, a sharded trainer's
  weight gather per forward; no old-policy pass on-policy (one optimizer step per rollout), as the trainer skips it.
- **update**: the same forwards (:func:`update_shape`: ``ppo_micro_batch_size_per_device`` samples per micro batch,
  the rank's batch padded once to the step's longest where rows are padded; or each optimizer step's samples cut
  under ``update_token_budget``, at least ``gradient_accumulation_steps`` micro batches), three times the FLOPs
  (forward and backward) per PPO epoch, ``2 x forward_s`` per micro batch, the optimizer's pass over its states (16
  bytes per parameter read and written, on the rank's shard), and a sharded trainer's gathers and reduce-scatters.

Memory per device: the engine's weights and KV cache (:mod:`trl_nrollout.plan.memory`) and the trainer's
parameters, gradients and Adam states (bf16 weights and grads + fp32 master and moments: 16 bytes per parameter,
over the data-parallel ranks when sharded).

Pure: no torch at import; the model comes in as :class:`ModelDims` (read from a config dict).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trl_nrollout.passes.packing_rules import (
    MAX_PACKED_MASK_BYTES,
    mask_bytes_of,
    packed_length,
    packing_pays,
)
from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.layout import LayoutError, RolloutLayout, divisors
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS, dtype_bytes, estimate_kv
from trl_nrollout.plan.roles import COLOCATED_GPU_MEMORY_UTILIZATION, ROLLOUT_RANK_GPU_MEMORY_UTILIZATION

#: model types whose MLP has two matrices (up, down) instead of three (gate, up, down)
UNGATED_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2")
#: model types that normalize the queries and keys per head before the rotary embedding (Qwen3's q_norm / k_norm)
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_text", "gemma3", "gemma3_text", "olmo2")
#: the phases of a predicted step, in order
PHASES = ("generation", "weight_sync", "old_log_prob", "ref_log_prob", "update")
#: bytes per trained parameter: bf16 weights and gradients, fp32 master weights and two Adam moments
TRAIN_BYTES_PER_PARAM = 2 + 2 + 4 + 4 + 4
#: what the optimizer reads and writes per parameter of its shard in a step (states, master, grads, weights)
OPTIMIZER_BYTES_PER_PARAM = 2 * TRAIN_BYTES_PER_PARAM


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelDims:
    """A decoder-only transformer's dimensions (``config.json``'s), enough for its FLOPs and bytes."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    name: str = ""
    gated_mlp: bool = True
    #: a mixture of experts (0: dense): experts per layer, experts each token goes through, an expert's
    #: intermediate size, and an always-on shared expert's (Qwen2-MoE; 0: none)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    #: the queries and keys are normalized per head (:data:`QK_NORM`): more saved activations, no more FLOPs to speak of
    qk_norm: bool = False

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def _attention_params(self) -> int:
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + (q + 2 * kv)  # Q/K/V/O (+ QKV bias)

    def _mlp_params(self, experts: float) -> float:
        """One layer's MLP parameters with ``experts`` of its experts counted (all of them: the layer's size; the
        token's: what it multiplies by); a dense layer's whatever ``experts``."""
        per = (3 if self.gated_mlp else 2) * self.hidden_size
        if not self.num_experts:
            return per * self.intermediate_size
        shared = per * self.shared_expert_intermediate_size + (self.hidden_size if self.shared_expert_intermediate_size
                                                                else 0)
        return experts * per * self.moe_intermediate_size + self.hidden_size * self.num_experts + shared  # + router

    @property
    def params_per_layer(self) -> int:
        return int(self._attention_params + self._mlp_params(self.num_experts) + 2 * self.hidden_size)  # two norms

    @property
    def active_params_per_layer(self) -> int:
        """The parameters one token multiplies by in a layer (a MoE token: its experts only)."""
        return int(self._attention_params + self._mlp_params(self.experts_per_token) + 2 * self.hidden_size)

    def weights_read(self, tokens: float) -> float:
        """Matmul parameters one forward over ``tokens`` tokens reads: all of a dense model's; a MoE layer's experts
        that at least one token routes to (expected, with uniform routing: ``E (1 - (1 - k/E)^tokens)``)."""
        if not self.num_experts:
            return float(self.matmul_params)
        k, e = self.experts_per_token, self.num_experts
        touched = e * (1 - (1 - k / e) ** max(tokens, 1.0))
        per_layer = self._attention_params + self._mlp_params(touched) + 2 * self.hidden_size
        return self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Every parameter: layers, embeddings (counted twice when the output head is not tied), final norm."""
        embed = self.vocab_size * self.hidden_size
        return (self.num_hidden_layers * self.params_per_layer + embed * (1 if self.tie_word_embeddings else 2)
                + self.hidden_size)

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by (the embedding lookup is not a matmul; the output head is; a MoE token's
        own experts only)."""
        return self.num_hidden_layers * self.active_params_per_layer + self.vocab_size * self.hidden_size

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token uses, embeddings included (a MoE model's "activated" count; a dense model's all)."""
        embed = self.vocab_size * self.hidden_size
        return (self.num_hidden_layers * self.active_params_per_layer
                + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size)

    def lora_parameters(self, r: int) -> int:
        """Trainable parameters of rank-``r`` LoRA adapters on every linear layer of the decoder (PEFT's
        ``target_modules="all-linear"``: Q, K, V, O and the MLP's; ``r x (in + out)`` each; a MoE layer's experts'
        adapters counted for all its experts)."""
        if r < 1:
            raise ValueError(f"lora_r={r} must be >= 1 (the adapters' rank).")
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = (self.hidden_size + q) * 2 + (self.hidden_size + kv) * 2
        mats = 3 if self.gated_mlp else 2
        if self.num_experts:
            mlp = (self.num_experts * mats * (self.hidden_size + self.moe_intermediate_size)
                   + (mats * (self.hidden_size + self.shared_expert_intermediate_size)
                      if self.shared_expert_intermediate_size else 0))
        else:
            mlp = mats * (self.hidden_size + self.intermediate_size)
        return r * self.num_hidden_layers * (attention + mlp)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, context: float) -> float:
        """FLOPs of one token's attention over ``context`` earlier tokens (QK^T and AV, all layers)."""
        return 4.0 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * context

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of attention per query-key pair (all layers): a row of ``L`` tokens under a full mask costs
        ``L^2`` pairs."""
        return self.attention_flops(1.0)

    @classmethod
    def from_config_dict(cls, config: dict[str, Any], *, dtype: str | None = None, name: str = "") -> ModelDims:
        """Read a ``config.json``-style dict (a multimodal config's ``text_config`` when the top level has no
        layers). ``dtype`` None/"auto": the config's, else bfloat16."""
        cfg = config
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**config, **cfg["text_config"]}
        missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                               "vocab_size") if not cfg.get(k)]
        if missing:
            raise ValueError(f"the model config{' of ' + name if name else ''} has no {', '.join(missing)}: the cost "
                             "model needs a decoder-only transformer's dimensions.")
        heads = int(cfg["num_attention_heads"])
        # Qwen2/3-MoE name it num_experts, Mixtral num_local_experts (its intermediate_size is an expert's)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts and not cfg.get("num_experts_per_tok"):
            raise ValueError(f"the model config{' of ' + name if name else ''} has {experts} experts but no "
                             "num_experts_per_tok: the cost model needs the experts each token uses.")
        if dtype in (None, "auto"):
            dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
        dtype_bytes(dtype)
        return cls(num_hidden_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
                   intermediate_size=int(cfg["intermediate_size"]), num_attention_heads=heads,
                   num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   vocab_size=int(cfg["vocab_size"]), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   dtype=dtype, name=name, gated_mlp=cfg.get("model_type") not in UNGATED_MLP,
                   num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
                   if experts else 0,
                   shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                   if experts else 0,
                   qk_norm=cfg.get("model_type") in QK_NORM)


# ---------------------------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Workload:
    """What a step processes beyond the layout: mean prompt tokens, completion tokens (mean and the longest, the
    tail a synchronous rollout waits for), the engines' ``max_num_seqs``, and which passes run: ``kl`` (a reference
    pass), ``packed`` (the shared-prompt forward: a group's prompt once in the passes), ``sharded`` (ZeRO-3 or FSDP:
    parameters gathered per forward, optimizer states split), ``critic`` (PPO: a critic of the policy's size),
    ``skip_old_on_policy`` (the trainer's ``skip_old_log_prob_when_on_policy``: no old-policy pass when a rollout
    makes one optimizer step), ``padding_free`` (an ideal trainer that concatenates sequences without padding, with
    causal attention per sequence, as Megatron's and verl's remove-padding with flash-attention do), ``padfree_rows``
    (ours: see the field), ``update_token_budget`` (``use_dynamic_bsz``), ``prompt_max`` (the longest prompt, the
    padded rows' prompt width)."""

    prompt_len: float
    completion_mean: float
    completion_max: int
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kl: bool = False
    packed: bool = True
    sharded: bool = False
    critic: bool = False
    skip_old_on_policy: bool = True
    #: nodes the trainers span: beyond one, their gradient reduce and parameter gathers cross the nodes' links
    nodes: int = 1
    padding_free: bool = False
    #: the longest prompt of a micro batch (its rows are left-padded to it); None: ``prompt_len``
    prompt_max: float | None = None
    #: our trainer's padding-free rows (``padding_free``, on by default where the model takes a block mask): a micro
    #: batch's real tokens end to end in rows as long as its longest sample, a block-diagonal mask over each row
    #: (computed in full by SDPA), where that saves a tenth of the slots and the mask stays within its bound;
    #: otherwise the padded rows. Unlike ``padding_free`` (an ideal varlen trainer), the rows' last tokens and the
    #: rows' ``L x L`` attention are paid.
    padfree_rows: bool = False
    #: the padding-free rows run varlen attention (:attr:`DeviceProfile.varlen_attention`: every sample in one row,
    #: each sequence's causal pairs only, no mask and so no cap from its bound), as the trainer does on CUDA in half
    #: precision; the shared-prompt units (a mask's layout) are then not used where the rows pay
    varlen_rows: bool = False
    #: the update's token budget per device (``use_dynamic_bsz`` / ``ppo_max_token_len_per_device``): each optimizer
    #: step's samples on a rank cut into micro batches of at most this many tokens (real tokens with padding-free
    #: rows, samples x the longest when padded), as many as the budget needs and at least
    #: ``gradient_accumulation_steps``; None: micro batches of ``ppo_micro_batch_size_per_device`` samples
    update_token_budget: int | None = None
    #: the update's activations are checkpointed (TRL's ``gradient_checkpointing``, on by default): the activation
    #: memory per token of :func:`~trl_nrollout.plan.activations.activation_bytes_per_token`
    gradient_checkpointing: bool = True
    #: LoRA adapters of this rank on every linear layer (None: full training): the base weights are frozen (held in
    #: their dtype, no gradients, no optimizer states), the adapters trained with AdamW
    lora_r: int | None = None
    #: ZeRO-2: gradients and optimizer states split over the data-parallel ranks, the weights whole on each (no
    #: gathers per forward); ``sharded`` (ZeRO-3 / FSDP) splits the weights too
    optimizer_sharded: bool = False
    #: groups an engine keeps in flight per group of its share: partial rollouts (``rollout_partial``) keep
    #: ``1 + rollout_partial_oversample`` of them, and their KV cache (1: the step's share only)
    pool_factor: float = 1.0

    @property
    def sample_len(self) -> float:
        """A sample's mean real tokens (prompt and completion)."""
        return self.prompt_len + self.completion_mean

    @property
    def row_width(self) -> float:
        """A micro batch's longest sample (the tail), the width of its padded rows and of its padding-free rows."""
        return self.prompt_width + self.completion_max

    @property
    def prompt_width(self) -> float:
        """Prompt columns of a padded training row."""
        return self.prompt_len if self.prompt_max is None else self.prompt_max

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.completion_mean < 0:
            raise ValueError(f"prompt_len={self.prompt_len} and completion_mean={self.completion_mean} must be >= 0.")
        if self.completion_max < self.completion_mean:
            raise ValueError(f"completion_max={self.completion_max} must be >= completion_mean="
                             f"{self.completion_mean} (the longest completion bounds the mean).")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1.")
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes} must be >= 1.")
        if self.update_token_budget is not None and self.update_token_budget < self.row_width:
            raise ValueError(f"ppo_max_token_len_per_device={self.update_token_budget} is below the longest sample "
                             f"({self.row_width:g} tokens, prompt + completion); every sample must fit one micro "
                             f"batch: use at least {math.ceil(self.row_width)}.")
        if self.prompt_max is not None and self.prompt_max < self.prompt_len:
            raise ValueError(f"prompt_max={self.prompt_max} must be >= prompt_len={self.prompt_len} (the longest "
                             "prompt bounds the mean).")


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
    if samples <= work.max_num_seqs:
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


@dataclass(frozen=True)
class PassShape:
    """The forwards of one training pass over a rank's samples, as the trainer lays them out: ``forwards`` micro
    batches, ``tokens`` through the linear layers in all (padding and prompt copies included), ``pairs``: the
    query-key pairs attention computes in all, whether the micro batches are ``packed`` (shared prompts) or
    ``padfree`` (padding-free rows), and the token slots of the largest micro batch (``slots_per_forward``: what
    its activations scale with)."""

    forwards: int
    tokens: float
    pairs: float
    packed: bool
    padfree: bool = False
    slots_per_forward: float = 0.0

    def flops(self, dims: ModelDims) -> float:
        """FLOPs of one forward pass over all of it."""
        return self.tokens * 2 * dims.matmul_params + self.pairs * dims.attention_flops_per_pair


def padfree_rows_of(samples: float, work: Workload, query_bytes: int = 2) -> tuple[float, float] | None:
    """Our trainer's padding-free rows for a micro batch of ``samples`` samples (:mod:`~trl_nrollout.passes.padfree`
    lays them out): ``(rows, width)``, rows expected (a fraction), or None where the trainer runs the padded rows.

    The rows are as wide as the micro batch's longest sample (``work.row_width``: the tail, prompt and completion)
    and hold its real tokens (``samples x work.sample_len``) end to end, so the token slots are the real tokens plus
    the last row's unused end, half a row expected: ``real / width + 1/2`` rows (first-fit decreasing, the trainer's
    packing, fills all but the last row to within a sample of the width at long-tailed lengths), at most one per
    sample. The trainer's rule (``padfree_fits``), on the whole rows: they save at least a tenth of the padded slots
    (``samples x width``) and their block mask (``rows x width^2``, boolean with SDPA's copy in the queries' dtype,
    ``query_bytes``) stays within :data:`~trl_nrollout.passes.packing_rules.MAX_PACKED_MASK_BYTES`."""
    width = math.ceil(work.row_width)
    real = samples * work.sample_len
    rows = max(1.0, min(samples, real / max(width, 1) + 0.5))
    whole = math.ceil(rows - 1e-9)  # the trainer decides on whole rows
    if whole * width > 0.9 * samples * width or mask_bytes_of(whole, width, 1, query_bytes) > MAX_PACKED_MASK_BYTES:
        return None
    return rows, float(width)


def padfree_token_cap(row_width: int, query_bytes: int = 2) -> int:
    """The most real tokens a micro batch may hold and still run as padding-free rows of ``row_width`` (its longest
    sample) under SDPA: the rows whose boolean block mask (with its copy in the queries' dtype, ``query_bytes``)
    stays within :data:`~trl_nrollout.passes.packing_rules.MAX_PACKED_MASK_BYTES`, less half a row (the last row's
    expected unused end). Beyond it the trainer runs the micro batch padded. At least ``row_width`` (one sample)."""
    if row_width < 1:
        raise ValueError(f"row_width={row_width} must be >= 1 (the longest sample's tokens).")
    rows = 1
    while mask_bytes_of(rows + 1, row_width, 1, query_bytes) <= MAX_PACKED_MASK_BYTES:
        rows += 1
    return max(row_width, rows * row_width - row_width // 2)


def _micro_batch_cost(size: float, n: int, work: Workload, query_bytes: int) -> tuple[float, float, bool, bool]:
    """One micro batch of ``size`` samples as the trainer lays it out: ``(tokens, pairs, packed, padfree)``. The
    shared-prompt layout where it pays (the trainer's first choice), else the padding-free rows
    (``work.padfree_rows``) where they fit, else the padded rows (``size x row_width``; a masked SDPA computes every
    pair of a row: ``L^2`` per row). ``work.padding_free``: the ideal varlen trainer's real tokens and causal pairs."""
    if work.padding_free:
        length = work.sample_len
        return size * length, size * length * length / 2, False, False
    plain_width = work.row_width
    if work.padfree_rows and work.varlen_rows and size * work.sample_len <= 0.9 * max(1, round(size)) * plain_width:
        length = work.sample_len  # one varlen row: the real tokens, each sequence's causal pairs (the trainer's first
        return size * length, size * length * length / 2, False, True  # choice, before the shared-prompt layout)
    whole = max(1, round(size))
    per_prompt = min(n, whole)  # a micro batch holds whole groups, or a part of one prompt's
    groups = math.ceil(whole / per_prompt)
    if work.packed and whole > 1:
        length = packed_length(work.prompt_width, per_prompt, work.completion_max)
        mask = mask_bytes_of(groups, math.ceil(length), 1, query_bytes)
        if packing_pays(whole, plain_width, groups, length) and mask <= MAX_PACKED_MASK_BYTES:
            rows = groups * size / whole
            return rows * length, rows * length * length, True, False
    if work.padfree_rows:
        free = padfree_rows_of(size, work, query_bytes)
        if free is not None:
            rows, width = free
            return rows * width, rows * width * width, False, True
    return size * plain_width, size * plain_width * plain_width, False, False


def pass_shape(samples: int, per_forward: int, n: int, work: Workload, *, max_token_len: int | None = None,
               query_bytes: int = 4, budgeted: bool = False, min_forwards: int = 1) -> PassShape:
    """The forwards of a pass over ``samples`` samples (a rank's; a prompt's ``n`` samples side by side) cut into
    micro batches of ``per_forward`` samples, or under a token budget ``max_token_len``.

    The budget: with ``budgeted`` and padding-free rows (``work.padfree_rows``; the trainer's
    ``budgeted_parts``) the micro batches count real tokens, ``ceil(samples x sample_len / max_token_len)`` of
    them (at least ``min_forwards``: the update's ``gradient_accumulation_steps``; at most one per sample) of even
    work; otherwise each holds as many samples as fit padded to the longest (``max_token_len // row_width``).

    Each micro batch (:func:`_micro_batch_cost`) runs the shared-prompt layout where the trainer's own rule
    (:func:`~trl_nrollout.passes.packing_rules.packing_pays` and the mask's bound) packs it (``G`` rows of ``L = P
    - 1 + K (C + 1)`` tokens, ``G L^2`` pairs), else our padding-free rows (:func:`padfree_rows_of`: the real tokens
    plus the last row's end, ``R W^2`` pairs under the block mask), else the padded rows: ``B`` rows of the longest
    prompt and completion (the update pads the rank's whole batch to the step's longest, the log-prob passes each
    micro batch to its own: at long-tailed lengths both hold a sample at the cap), ``B (P + C)^2`` pairs (a padding
    mask: no causal skipping). ``work.padding_free``: an ideal trainer's real tokens and causal pairs per sequence.
    ``query_bytes``: attention's query dtype (the masks' copies under SDPA)."""
    if samples <= 0:
        return PassShape(0, 0.0, 0.0, False)
    if max_token_len is not None and budgeted and (work.padfree_rows or work.padding_free):
        forwards = math.ceil(samples * work.sample_len / max_token_len)
        forwards = min(samples, max(forwards, min_forwards, 1))
        size = samples / forwards
    else:
        if max_token_len is not None:
            per_forward = min(per_forward, max(1, int(max_token_len // max(work.row_width, 1.0))))
        whole = max(1, min(per_forward, samples))
        forwards = max(math.ceil(samples / whole), min(min_forwards, samples))
        size = samples / forwards if budgeted else float(whole)  # count-cut: full micro batches, a short last one
    tokens, pairs, packed, padfree = _micro_batch_cost(size, n, work, query_bytes)
    scale = samples / size  # the last micro batch may be short: every figure in proportion to the samples
    return PassShape(forwards, tokens * scale, pairs * scale, packed, padfree, slots_per_forward=tokens)


def update_shape(layout: RolloutLayout, work: Workload, query_bytes: int = 2) -> PassShape:
    """The update's forwards on one rank for one pass over the rollout (one PPO epoch), as the trainer cuts them.

    Without a budget (``work.update_token_budget`` None): micro batches of ``ppo_micro_batch_size_per_device``
    samples (:func:`pass_shape`). With one (``use_dynamic_bsz``): each optimizer step's samples on the rank pooled
    (``mini_batch_samples_per_rank``) and cut under the budget into at least ``gradient_accumulation_steps`` micro
    batches (the trainer's ``_budgeted_steps``; every rank runs the busiest rank's count, which even lengths make
    this one's), or, where optimizer steps span rollouts, each count-based micro batch cut alone."""
    samples, n = layout.samples_per_rank, layout.rollout_n
    budget = work.update_token_budget
    if budget is None:
        return pass_shape(samples, layout.ppo_micro_batch_size_per_device, n, work, query_bytes=query_bytes)
    accum = layout.gradient_accumulation_steps
    micro = layout.ppo_micro_batch_size_per_device
    if (samples // micro) % accum == 0:
        pool, least = layout.mini_batch_samples_per_rank, accum
    else:
        pool, least = micro, 1
    one = pass_shape(pool, pool, n, work, max_token_len=budget, query_bytes=query_bytes, budgeted=True,
                     min_forwards=least)
    pools = samples / pool
    return PassShape(math.ceil(one.forwards * pools - 1e-9), one.tokens * pools, one.pairs * pools, one.packed,
                     one.padfree, one.slots_per_forward)


def _dp_link(work: Workload, dev: DeviceProfile) -> float:
    """B/s of the trainers' collectives: a ring over every data-parallel rank runs at its slowest link, the nodes'
    when the ranks span several."""
    slowest = dev.node_link_bw if work.nodes > 1 and dev.node_link_bw else dev.link_bw
    return slowest * dev.link_eff


def _gather_s(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> float:
    """A sharded trainer's all-gather of the parameters for one forward (ZeRO-3 / FSDP)."""
    dp = layout.data_parallel_size
    if not work.sharded or dp == 1:
        return 0.0
    return dims.num_parameters * dims.dtype_bytes * (dp - 1) / dp / _dp_link(work, dev)


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
    if work.sharded:
        return (weights + rest) / dp
    if work.optimizer_sharded:
        return weights + rest / dp
    return weights + rest


def predict_step(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> StepPrediction:
    """Seconds per phase of one training step of ``layout`` on devices ``dev`` (see the module docstring)."""
    gen_s, details = _generation(dims, layout, work, dev)
    sync_bytes = dims.num_parameters * dims.dtype_bytes
    sync_s = dev.sync_s + sync_bytes / dev.weight_sync_bw + _gather_s(dims, layout, work, dev)
    gather = _gather_s(dims, layout, work, dev)
    samples = layout.samples_per_rank
    n = layout.rollout_n

    def shape(micro) -> PassShape:  # a log-prob pass, cut as its MicroBatch says (a budget with no count set: even
        # micro batches of real tokens on padding-free rows, the trainer's budgeted passes)
        budgeted = micro.max_token_len is not None and micro.source.startswith("default")
        return pass_shape(samples, micro.per_device, n, work, max_token_len=micro.max_token_len,
                          query_bytes=dims.dtype_bytes, budgeted=budgeted)

    def forward_s(p: PassShape) -> float:
        return _compute_s(p, dims, dev) + p.forwards * (dev.forward_s + gather)

    on_policy = layout.optimizer_steps_per_rollout == 1 and work.skip_old_on_policy
    old_shape, ref_shape = shape(layout.old_log_prob), shape(layout.ref_log_prob)
    old_s = 0.0 if on_policy else forward_s(old_shape)
    ref_s = forward_s(ref_shape) if work.kl else 0.0
    update = update_shape(layout, work, dims.dtype_bytes)
    micro = update.forwards * layout.ppo_epochs
    dp = layout.data_parallel_size
    trained = dims.num_parameters if work.lora_r is None else dims.lora_parameters(work.lora_r)
    shard = trained / (dp if work.sharded else 1)
    optimizer_s = layout.optimizer_steps_per_rollout * shard * OPTIMIZER_BYTES_PER_PARAM / dev.optimizer_rate
    reduce_s = 0.0 if dp == 1 else (layout.optimizer_steps_per_rollout * trained * 4 * (dp - 1) / dp
                                    / _dp_link(work, dev))
    update_s = (layout.ppo_epochs * (3 * _compute_s(update, dims, dev) + update.tokens * dev.train_token_s
                                     + samples * dev.train_sample_s)
                + micro * (2 * dev.forward_s + 2 * gather) + optimizer_s + reduce_s
                + layout.optimizer_steps_per_rollout * dev.train_fixed_s)
    if work.critic:  # a value pass and the critic's own update, a model of the policy's size
        old_s += forward_s(old_shape)
        update_s *= 2
    phases = {"generation": gen_s, "weight_sync": sync_s, "old_log_prob": old_s, "ref_log_prob": ref_s,
              "update": update_s}
    total = sum(phases.values())
    kv = estimate_kv(num_layers=dims.num_hidden_layers, num_kv_heads=dims.num_key_value_heads,
                     head_dim=dims.head_dim, dtype_bytes=dims.dtype_bytes, prompt_len=math.ceil(work.prompt_len),
                     response_len=work.completion_max,
                     prompts_per_engine=math.ceil(layout.prompts_per_engine * work.pool_factor - 1e-9),
                     n=layout.rollout_n, tp_size=layout.rollout_tp_size, max_num_seqs=work.max_num_seqs)
    engine_weights = math.ceil(dims.num_parameters * dims.dtype_bytes / layout.rollout_tp_size)
    engine_bytes = engine_weights + kv.bytes_per_gpu_shared
    train_bytes = math.ceil(trainer_state_bytes(dims, work, dp) * (2 if work.critic else 1))
    from trl_nrollout.plan.activations import activation_bytes_per_token

    activation_bytes = math.ceil(update.slots_per_forward * activation_bytes_per_token(
        dims, dtype_bytes=min(dims.dtype_bytes, 2), gradient_checkpointing=work.gradient_checkpointing))
    details.update(engine_weight_bytes=engine_weights, kv_bytes=kv.bytes_per_gpu_shared,
                   update_tokens_per_rank=update.tokens, update_pairs_per_rank=update.pairs,
                   update_packed=update.packed, update_padfree=update.padfree,
                   update_forwards_per_epoch=update.forwards, update_slots_per_forward=update.slots_per_forward, forward_flops_per_rank=update.flops(dims), micro_steps=micro,
                   optimizer_s=optimizer_s, weight_sync_bytes=sync_bytes)
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


# ---------------------------------------------------------------------------------------------- the search
@dataclass(frozen=True)
class Candidate:
    """One layout the search tried: its options, its prediction (None when refused) and why it was refused."""

    options: dict[str, Any]
    prediction: StepPrediction | None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"options": self.options, "reason": self.reason,
                "prediction": None if self.prediction is None else self.prediction.to_dict()}


#: the trainer's sharding choices (``trainer_sharding``) and the accelerate config of this repository that gives each
SHARDING_CONFIGS = {"none": "recipes/accelerate/ddp.yaml", "zero2": "recipes/accelerate/zero2.yaml",
                    "zero3": "recipes/accelerate/zero3.yaml", "fsdp": "recipes/accelerate/fsdp.yaml"}


@dataclass(frozen=True)
class MemoryCheck:
    """One device memory limit of a prediction: what holds it (``what``: ``engine`` or ``trainer``), the bytes it
    needs (``used``) and may use (``limit``), and how both are made (``used_parts``, ``limit_parts``)."""

    what: str
    used: int
    limit: int
    used_parts: str
    limit_parts: str

    @property
    def fits(self) -> bool:
        return self.used <= self.limit

    @property
    def ratio(self) -> float:
        return self.used / max(self.limit, 1)

    def line(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"{self.what} {self.used / 2**30:.3g} GiB ({self.used_parts}) vs {self.limit / 2**30:.3g} GiB "
                f"({self.limit_parts}): {verdict}")


def memory_checks(prediction: StepPrediction, dev: DeviceProfile, gpu_memory_utilization: float,
                  sleep_mode: bool, *, colocated: bool = True) -> list[MemoryCheck]:
    """The engine's and the trainer's memory per device against what each may use: the engine
    ``gpu_memory_utilization`` of its device (vLLM reserves it at start); a trainer the rest of a device it shares
    with an engine, all of it where the engine sleeps while the trainer works (``vllm_enable_sleep_mode``) or where
    it has the device to itself (``colocated=False``: rollout ranks). The trainer needs its states and its largest
    update micro batch's activations."""
    total = dev.memory_gib * 2**30
    engine = MemoryCheck("engine", prediction.engine_bytes, int(total * gpu_memory_utilization),
                         "weights + KV cache", f"gpu_memory_utilization {gpu_memory_utilization:g} x "
                                               f"{dev.memory_gib:g} GiB")
    if not colocated:
        room, where = total, "the whole device"
    elif sleep_mode:
        room, where = total, "the whole device: the engine sleeps"
    else:
        room, where = total * (1 - gpu_memory_utilization), "what the engine leaves"
    trainer = MemoryCheck("trainer", prediction.trainer_bytes, int(room),
                          f"states {prediction.train_bytes / 2**30:.3g} GiB + update activations "
                          f"{prediction.activation_bytes / 2**30:.3g} GiB", where)
    return [engine, trainer]


def fits_memory(prediction: StepPrediction, dev: DeviceProfile, gpu_memory_utilization: float,
                sleep_mode: bool, *, colocated: bool = True) -> str | None:
    """Why the prediction's memory does not fit the device (None: it fits): the first limit of
    :func:`memory_checks` it breaks, with the usual fixes."""
    for check in memory_checks(prediction, dev, gpu_memory_utilization, sleep_mode, colocated=colocated):
        if check.fits:
            continue
        if check.what == "engine":
            return (f"engine weights + KV cache {check.used / 2**30:.1f} GiB > {gpu_memory_utilization:g} x "
                    f"{dev.memory_gib:g} GiB" + ("" if colocated else " on a rollout rank")
                    + " (raise rollout_tp_size or lower max_num_seqs)")
        return (f"trainer states {prediction.train_bytes / 2**30:.1f} GiB + update activations "
                f"{prediction.activation_bytes / 2**30:.1f} GiB > the {check.limit / 2**30:.1f} GiB "
                + ("left beside the engine" if colocated and not sleep_mode else "of a trainer's device")
                + " (shard the trainer: ZeRO-3 / FSDP, LoRA, a smaller update micro batch"
                + (", or vllm_enable_sleep_mode)" if colocated and not sleep_mode else ", or more trainers)"))
    return None


def _caps(max_num_seqs_values: Sequence[int], samples_per_engine: int) -> list[int]:
    """The ``max_num_seqs`` values worth trying: each one below the engine's samples, and the smallest that covers
    them (larger ones run every sample at once just the same)."""
    caps = sorted(set(max_num_seqs_values))
    covering = [s for s in caps if s >= samples_per_engine]
    return [s for s in caps if s <= samples_per_engine or s == covering[0]]


def _tp_refusal(dims: ModelDims, tp: int) -> str | None:
    if dims.num_attention_heads % tp or (dims.num_key_value_heads % tp and tp % dims.num_key_value_heads):
        return (f"rollout_tp_size={tp} does not split {dims.num_attention_heads} attention heads / "
                f"{dims.num_key_value_heads} KV heads")
    return None


def default_budget(dims: ModelDims, layout: RolloutLayout, work: Workload, trainer_memory_bytes: int) -> int:
    """The trainer's default update token budget (:func:`~trl_nrollout.plan.activations.default_update_token_budget`)
    on a device that leaves the trainer ``trainer_memory_bytes``, beside ``work``'s states on ``layout``, capped
    where padding-free rows' masks outgrow their bound (:func:`padfree_token_cap`)."""
    from trl_nrollout.plan.activations import default_update_token_budget

    longest = math.ceil(work.row_width)
    states = trainer_state_bytes(dims, work, layout.data_parallel_size) * (2 if work.critic else 1)
    queries = min(dims.dtype_bytes, 2)
    return default_update_token_budget(dims, device_memory_bytes=trainer_memory_bytes,
                                       state_bytes_per_device=int(states), longest_sample=longest,
                                       gradient_checkpointing=work.gradient_checkpointing, dtype_bytes=queries,
                                       max_tokens=padfree_token_cap(longest, queries)
                                       if work.padfree_rows and not work.varlen_rows else None)


def _shardings(work: Workload, shardings: Sequence[str] | None) -> list[tuple[str | None, Workload]]:
    """``work`` under each trainer sharding to try (None: ``work`` as it is, unnamed)."""
    if shardings is None:
        return [(None, work)]
    unknown = [x for x in shardings if x not in SHARDING_CONFIGS]
    if unknown:
        raise ValueError(f"trainer sharding {unknown} unknown: use {list(SHARDING_CONFIGS)}.")
    return [(x, replace(work, sharded=x in ("zero3", "fsdp"), optimizer_sharded=x == "zero2")) for x in shardings]


def suggest(dims: ModelDims, num_processes: int, train_batch_size: int, work: Workload, dev: DeviceProfile, *,
            n_values: Sequence[int], max_num_seqs_values: Sequence[int] = (64, 128, 256, 512, 1024),
            gpu_memory_utilization: float = COLOCATED_GPU_MEMORY_UTILIZATION, sleep_mode: bool = False,
            layout_extra: dict | None = None, rollout_gpu_memory_utilization: float | None = None,
            rollout_ranks: bool = False, max_staleness: int = 1, local_world: int | None = None,
            shardings: Sequence[str] | None = None, try_dynamic_bsz: bool = False) -> list[Candidate]:
    """Every layout of ``num_processes`` devices and ``train_batch_size`` prompts over TP sizes, ``n_values`` and
    ``max_num_seqs_values``: the ones that fit ranked by predicted samples per second (best first), then the refused
    ones with their reasons. ``rollout_ranks``: also every split of the devices into trainers and rollout ranks
    (:func:`split_candidates`, generating ``max_staleness`` steps ahead; ``local_world`` devices per node), whose
    engines take ``rollout_gpu_memory_utilization`` of their device (default: a dedicated device's 0.9, what the
    trainer gives them). ``shardings``: the trainer's sharding choices to try (:data:`SHARDING_CONFIGS`' keys; each
    candidate's options then name it and its accelerate config); None: only ``work``'s own. ``try_dynamic_bsz``:
    each layout also with token-budgeted update micro batches at the trainer's default budget
    (:func:`default_budget`; the options then say ``use_dynamic_bsz`` and the budget)."""
    if num_processes < 1 or train_batch_size < 1:
        raise ValueError(f"num_processes={num_processes} and train_batch_size={train_batch_size} must be >= 1.")
    if not n_values:
        raise ValueError("n_values is empty: give at least one rollout_n.")
    fit, refused = [], []
    for tp in divisors(num_processes):
        why = _tp_refusal(dims, tp)
        if why:
            refused.append(Candidate({"rollout_tp_size": tp}, None, why))
            continue
        for n in n_values:
            kwargs = {**(layout_extra or {}), "num_processes": num_processes, "rollout_tp_size": tp,
                      "train_batch_size": train_batch_size, "rollout_n": n}
            try:
                layout = RolloutLayout.build(**kwargs)
            except LayoutError as err:
                refused.append(Candidate({"rollout_tp_size": tp, "rollout_n": n}, None, str(err).split("; ")[0]))
                continue
            for seqs in _caps(max_num_seqs_values, layout.samples_per_engine):
                for sharding, w in _shardings(work, shardings):
                    updates: list[int | None] = [work.update_token_budget]
                    if try_dynamic_bsz and work.update_token_budget is None:
                        room = dev.memory_gib * 2**30 * (1 if sleep_mode else 1 - gpu_memory_utilization)
                        updates.append(default_budget(dims, layout, w, int(room)))
                    for budget in updates:
                        options = {"rollout_tp_size": tp, "rollout_n": n, "max_num_seqs": seqs}
                        if sharding is not None:
                            options.update(trainer_sharding=sharding, accelerate_config=SHARDING_CONFIGS[sharding])
                        if budget is not None and budget != work.update_token_budget:
                            options.update(use_dynamic_bsz=True, ppo_max_token_len_per_device=budget)
                        if rollout_ranks:
                            options["rollout_ranks"] = 0
                        pred = predict_step(dims, layout, replace(w, max_num_seqs=seqs, update_token_budget=budget),
                                            dev)
                        why = fits_memory(pred, dev, gpu_memory_utilization, sleep_mode)
                        (refused if why else fit).append(Candidate(options, pred, why))
    if rollout_ranks:
        for c in split_candidates(dims, num_processes, train_batch_size, work, dev, n_values=n_values,
                                  max_num_seqs_values=max_num_seqs_values,
                                  gpu_memory_utilization=rollout_gpu_memory_utilization or ROLLOUT_RANK_GPU_MEMORY_UTILIZATION,
                                  layout_extra=layout_extra,
                                  max_staleness=max_staleness, local_world=local_world or num_processes):
            (refused if c.reason else fit).append(c)
    fit.sort(key=lambda c: -c.prediction.samples_per_s)
    return fit + refused


# ---------------------------------------------------------------------------------------------- rollout ranks
@dataclass(frozen=True)
class SplitPrediction:
    """A step with ``rollout_ranks``: the engines' generation (on the rollout ranks), the trainers' phases (on the
    others), the weight transfer between them, and the step they make synchronous (``sync_s``: generation, then
    the transfer, then training) and with ``max_staleness >= 1`` (``pipelined_s``: generation of the next step
    beside training of this one, so the longer of the two, plus the transfer). Memory per device of each world."""

    generation_s: float
    train_s: float
    transfer_s: float
    sync_s: float
    pipelined_s: float
    samples: int
    engine_bytes: int
    train_bytes: int

    def step_s(self, staleness: int) -> float:
        return self.sync_s if staleness == 0 else self.pipelined_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict_split(dims: ModelDims, engines: RolloutLayout, trainers: RolloutLayout, work: Workload,
                  dev: DeviceProfile) -> SplitPrediction:
    """:func:`predict_step` for a launch split into ``engines`` (the rollout ranks' layout: their engines and each
    engine's share of the step's samples) and ``trainers`` (the trainers' layout). The transfer is the trainers'
    weight sync estimate (gathering, then the model's bytes over the bucket path)."""
    gen = predict_step(dims, engines, work, dev)
    train = predict_step(dims, trainers, work, dev)
    train_s = sum(train.phases[p] for p in ("old_log_prob", "ref_log_prob", "update"))
    transfer = train.phases["weight_sync"]
    generation = gen.phases["generation"]
    return SplitPrediction(generation_s=generation, train_s=train_s, transfer_s=transfer,
                           sync_s=generation + transfer + train_s, pipelined_s=max(generation, train_s) + transfer,
                           samples=trainers.total_samples, engine_bytes=gen.engine_bytes,
                           train_bytes=train.train_bytes)


def split_candidates(dims: ModelDims, num_processes: int, train_batch_size: int, work: Workload,
                     dev: DeviceProfile, *, n_values: Sequence[int], max_num_seqs_values: Sequence[int],
                     gpu_memory_utilization: float, layout_extra: dict | None, max_staleness: int,
                     local_world: int) -> list[Candidate]:
    """Every split of ``num_processes`` devices into trainers and ``rollout_ranks`` (a multiple of the engines'
    TP size, as the launch allows: :func:`~trl_nrollout.plan.roles.roles_refusal`), each TP size, ``n`` and
    ``max_num_seqs``, predicted by :func:`predict_split`: the step is the pipelined one with ``max_staleness >= 1``
    (generation of the next step beside training), else the synchronous one. Memory per device: a rollout rank
    holds its engine (within ``gpu_memory_utilization``), a trainer its states (the whole device); the trainers'
    collectives cross the nodes' links only when the trainers span several nodes. The candidates' ``phases`` are
    the engines' generation and the trainers' phases; ``details`` say the split."""
    from trl_nrollout.plan.roles import roles_refusal

    extra = dict(layout_extra or {})
    out = []
    for tp in divisors(num_processes):
        if _tp_refusal(dims, tp):
            continue  # said once by the colocated search
        for ranks in range(tp, num_processes, tp):
            options = {"rollout_ranks": ranks, "rollout_tp_size": tp}
            why = roles_refusal(num_processes, ranks, local_world, tp)
            if why:
                out.append(Candidate(options, None, why))
                continue
            engines_n = ranks // tp
            busiest = -(-train_batch_size // engines_n)  # the engine with the most groups sets the time
            for n in n_values:
                try:
                    engines = RolloutLayout.build(num_processes=ranks, rollout_tp_size=tp,
                                                  train_batch_size=busiest * engines_n, rollout_n=n,
                                                  adv_estimator="reinforce_plus_plus")  # any n: trainers check it
                    trainers = RolloutLayout.build(**{**extra, "num_processes": num_processes - ranks,
                                                      "rollout_tp_size": 1, "train_batch_size": train_batch_size,
                                                      "rollout_n": n})
                except LayoutError as err:
                    out.append(Candidate({**options, "rollout_n": n}, None, str(err).split("; ")[0]))
                    continue
                trainer_nodes = max(1, -(-(num_processes - ranks) // local_world))  # the rollout ranks: the last
                for seqs in _caps(max_num_seqs_values, engines.samples_per_engine):
                    w = replace(work, max_num_seqs=seqs, nodes=trainer_nodes)
                    gen, train = predict_step(dims, engines, w, dev), predict_step(dims, trainers, w, dev)
                    split = predict_split(dims, engines, trainers, w, dev)
                    total = split.step_s(max_staleness)
                    phases = {**train.phases, "generation": gen.phases["generation"]}
                    details = {**gen.details, "rollout_ranks": ranks, "trainers": num_processes - ranks,
                               "max_staleness": max_staleness, "sync_s": split.sync_s,
                               "pipelined_s": split.pipelined_s}
                    pred = StepPrediction(phases=phases, total_s=total, samples_per_s=split.samples / total,
                                          engine_bytes=split.engine_bytes, train_bytes=split.train_bytes,
                                          details=details, activation_bytes=train.activation_bytes)
                    why = fits_memory(pred, dev, gpu_memory_utilization, False, colocated=False)
                    out.append(Candidate({**options, "rollout_n": n, "max_num_seqs": seqs}, pred, why))
    return out
