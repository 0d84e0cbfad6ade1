"""What a step will cost in time, phase by phase, before anything runs (``trl-nrollout plan --predict``).

A roofline model with fixed costs, per device, for one step of the layout (:class:`RolloutLayout`):

- **generation** (each engine in parallel; the step waits for one engine's share): ``call_s`` + prefill + decode.
  Prefill is compute-bound: ``2 x params`` FLOPs per prompt token plus attention, the prompt prefilled once per
  group (vLLM's ``n`` shares its KV blocks). Decode runs ``steps`` engine steps with ``running`` sequences on
  average: with every sample of the share running at once (``max_num_seqs`` not below it) the step count is the
  longest completion (the tail); otherwise the engine works through its samples in waves, ``samples x mean /
  max_num_seqs`` steps plus the last wave's tail. One step costs the larger of its matmul FLOPs and its memory
  traffic (the weights once, each running sequence's KV cache), plus the TP all-reduces (two per layer), plus
  ``step_s + seq_step_s x running``.
- **weight sync**: the engine's weights once over ``weight_sync_bw`` (plus a ZeRO-3/FSDP gather over the link),
  plus ``sync_s``.
- **old-policy / reference log-prob passes**: ``2 x params`` FLOPs per token (plus attention), the prompt once per
  group where the shared-prompt forward packs it, one ``forward_s`` per micro batch, a sharded trainer's weight
  gather per forward; no old-policy pass on-policy (one optimizer step per rollout), as the trainer skips it.
- **update**: ``6 x params`` FLOPs per token (forward and backward) per PPO epoch, ``2 x forward_s`` per micro
  batch, the optimizer's pass over its states (16 bytes per parameter read and written, on the rank's shard), and
  a sharded trainer's gathers and reduce-scatters.

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

from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.layout import LayoutError, RolloutLayout, divisors
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS, dtype_bytes, estimate_kv

#: model types whose MLP has two matrices (up, down) instead of three (gate, up, down)
UNGATED_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2")
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

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, context: float) -> float:
        """FLOPs of one token's attention over ``context`` earlier tokens (QK^T and AV, all layers)."""
        return 4.0 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * context

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
                   if experts else 0)


# ---------------------------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Workload:
    """What a step processes beyond the layout: mean prompt tokens, completion tokens (mean and the longest, the
    tail a synchronous rollout waits for), the engines' ``max_num_seqs``, and which passes run: ``kl`` (a reference
    pass), ``packed`` (the shared-prompt forward: a group's prompt once in the passes), ``sharded`` (ZeRO-3 or FSDP:
    parameters gathered per forward, optimizer states split), ``critic`` (PPO: a critic of the policy's size),
    ``skip_old_on_policy`` (the trainer's ``skip_old_log_prob_when_on_policy``: no old-policy pass when a rollout
    makes one optimizer step)."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    compute = running * (2 * matmul + dims.attention_flops(context)) / (tp * dev.flops * dev.mfu_prefill)
    weights = dims.weights_read(running) * dims.dtype_bytes / tp  # a MoE step reads the experts its tokens use
    kv = running * context * dims.kv_bytes_per_token / tp
    memory = (weights + kv) / (dev.mem_bw * dev.bw_eff)
    comm = 0.0
    if tp > 1:  # two all-reduces of [running, hidden] per layer (attention out, MLP out)
        volume = running * dims.hidden_size * dims.dtype_bytes * 2 * (tp - 1) / tp
        comm = 2 * dims.num_hidden_layers * (volume / (dev.link_bw * dev.link_eff) + dev.allreduce_s)
    step_s = max(compute, memory) + comm + dev.step_s + dev.seq_step_s * running
    decode_s = steps * step_s
    details = {"prefill_tokens_per_engine": prefill_tokens, "prefill_s": prefill_s, "decode_steps": steps,
               "mean_running": running, "decode_step_s": step_s, "decode_s": decode_s,
               "decode_bound": "memory" if memory >= compute else "compute", "tp_comm_per_step_s": comm}
    return dev.call_s + prefill_s + decode_s + dev.gen_sample_s * samples, details


def _pass_tokens(layout: RolloutLayout, work: Workload) -> tuple[float, float]:
    """Tokens one training rank processes in a pass, and the mean sequence length its attention sees."""
    samples = layout.samples_per_rank
    prompt_tokens = (samples / layout.rollout_n if work.packed else samples) * work.prompt_len
    return prompt_tokens + samples * work.completion_mean, work.prompt_len + work.completion_mean


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


def predict_step(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile) -> StepPrediction:
    """Seconds per phase of one training step of ``layout`` on devices ``dev`` (see the module docstring)."""
    gen_s, details = _generation(dims, layout, work, dev)
    sync_bytes = dims.num_parameters * dims.dtype_bytes
    sync_s = dev.sync_s + sync_bytes / dev.weight_sync_bw + _gather_s(dims, layout, work, dev)
    tokens, seq = _pass_tokens(layout, work)
    forward_flops = tokens * (2 * dims.matmul_params + dims.attention_flops(seq / 2))
    train_rate = dev.flops * dev.mfu_train
    gather = _gather_s(dims, layout, work, dev)
    old = layout.old_log_prob.num_micro_batches
    ref = layout.ref_log_prob.num_micro_batches
    on_policy = layout.optimizer_steps_per_rollout == 1 and work.skip_old_on_policy
    old_s = 0.0 if on_policy else forward_flops / train_rate + old * (dev.forward_s + gather)
    ref_s = (forward_flops / train_rate + ref * (dev.forward_s + gather)) if work.kl else 0.0
    micro = math.ceil(layout.samples_per_rank / layout.ppo_micro_batch_size_per_device) * layout.ppo_epochs
    dp = layout.data_parallel_size
    shard = dims.num_parameters / (dp if work.sharded else 1)
    optimizer_s = layout.optimizer_steps_per_rollout * shard * OPTIMIZER_BYTES_PER_PARAM / dev.optimizer_rate
    reduce_s = 0.0 if dp == 1 else (layout.optimizer_steps_per_rollout * dims.num_parameters * 4 * (dp - 1) / dp
                                    / _dp_link(work, dev))
    update_s = (layout.ppo_epochs * 3 * forward_flops / train_rate + micro * (2 * dev.forward_s + 2 * gather)
                + optimizer_s + reduce_s + layout.ppo_epochs * layout.samples_per_rank * dev.train_sample_s
                + layout.optimizer_steps_per_rollout * dev.train_fixed_s)
    if work.critic:  # a value pass and the critic's own update, a model of the policy's size
        old_s += forward_flops / train_rate + old * (dev.forward_s + gather)
        update_s *= 2
    phases = {"generation": gen_s, "weight_sync": sync_s, "old_log_prob": old_s, "ref_log_prob": ref_s,
              "update": update_s}
    total = sum(phases.values())
    kv = estimate_kv(num_layers=dims.num_hidden_layers, num_kv_heads=dims.num_key_value_heads,
                     head_dim=dims.head_dim, dtype_bytes=dims.dtype_bytes, prompt_len=math.ceil(work.prompt_len),
                     response_len=work.completion_max, prompts_per_engine=layout.prompts_per_engine,
                     n=layout.rollout_n, tp_size=layout.rollout_tp_size, max_num_seqs=work.max_num_seqs)
    engine_weights = math.ceil(dims.num_parameters * dims.dtype_bytes / layout.rollout_tp_size)
    engine_bytes = engine_weights + kv.bytes_per_gpu_shared
    train_bytes = math.ceil(dims.num_parameters * TRAIN_BYTES_PER_PARAM * (2 if work.critic else 1)
                            / (dp if work.sharded else 1))
    details.update(engine_weight_bytes=engine_weights, kv_bytes=kv.bytes_per_gpu_shared, tokens_per_rank=tokens, forward_flops_per_rank=forward_flops, micro_steps=micro,
                   optimizer_s=optimizer_s, weight_sync_bytes=sync_bytes)
    return StepPrediction(phases=phases, total_s=total, samples_per_s=layout.total_samples / total,
                          engine_bytes=engine_bytes, train_bytes=train_bytes, details=details)


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


def fits_memory(prediction: StepPrediction, dev: DeviceProfile, gpu_memory_utilization: float,
                sleep_mode: bool) -> str | None:
    """Why the prediction's memory does not fit the device (None: it fits). The engine may use
    ``gpu_memory_utilization`` of the device; the trainer the rest (all of it when the engine sleeps while the
    trainer works)."""
    total = dev.memory_gib * 2**30
    if prediction.engine_bytes > total * gpu_memory_utilization:
        return (f"engine weights + KV cache {prediction.engine_bytes / 2**30:.1f} GiB > {gpu_memory_utilization:g} x "
                f"{dev.memory_gib:g} GiB (raise rollout_tp_size or lower max_num_seqs)")
    room = total if sleep_mode else total * (1 - gpu_memory_utilization)
    if prediction.train_bytes > room:
        return (f"trainer states {prediction.train_bytes / 2**30:.1f} GiB > the {room / 2**30:.1f} GiB left beside "
                f"the engine (shard the trainer: ZeRO-3 / FSDP, or vllm_enable_sleep_mode)")
    return None


def suggest(dims: ModelDims, num_processes: int, train_batch_size: int, work: Workload, dev: DeviceProfile, *,
            n_values: Sequence[int], max_num_seqs_values: Sequence[int] = (64, 128, 256, 512, 1024),
            gpu_memory_utilization: float = 0.5, sleep_mode: bool = False, layout_extra: dict | None = None
            ) -> list[Candidate]:
    """Every layout of ``num_processes`` devices and ``train_batch_size`` prompts over TP sizes, ``n_values`` and
    ``max_num_seqs_values``: the ones that fit ranked by predicted samples per second (best first), then the refused
    ones with their reasons."""
    if num_processes < 1 or train_batch_size < 1:
        raise ValueError(f"num_processes={num_processes} and train_batch_size={train_batch_size} must be >= 1.")
    if not n_values:
        raise ValueError("n_values is empty: give at least one rollout_n.")
    fit, refused = [], []
    for tp in divisors(num_processes):
        if dims.num_attention_heads % tp or (dims.num_key_value_heads % tp and tp % dims.num_key_value_heads):
            refused.append(Candidate({"rollout_tp_size": tp}, None,
                                     f"rollout_tp_size={tp} does not split {dims.num_attention_heads} attention "
                                     f"heads / {dims.num_key_value_heads} KV heads"))
            continue
        for n in n_values:
            kwargs = {**(layout_extra or {}), "num_processes": num_processes, "rollout_tp_size": tp,
                      "train_batch_size": train_batch_size, "rollout_n": n}
            try:
                layout = RolloutLayout.build(**kwargs)
            except LayoutError as err:
                refused.append(Candidate({"rollout_tp_size": tp, "rollout_n": n}, None, str(err).split("; ")[0]))
                continue
            caps = sorted(set(max_num_seqs_values))
            covering = [s for s in caps if s >= layout.samples_per_engine]
            for seqs in caps:
                options = {"rollout_tp_size": tp, "rollout_n": n, "max_num_seqs": seqs}
                if seqs > layout.samples_per_engine and seqs != covering[0]:
                    continue  # the same as a smaller cap that already runs every sample at once
                pred = predict_step(dims, layout, replace(work, max_num_seqs=seqs), dev)
                why = fits_memory(pred, dev, gpu_memory_utilization, sleep_mode)
                (refused if why else fit).append(Candidate(options, pred, why))
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
