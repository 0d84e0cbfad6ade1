"""The workload of the step's cost model (:mod:`trl_nrollout.plan.cost`): :class:`Workload`, what a step
processes beyond the layout (prompt and completion lengths, the engines' ``max_num_seqs``) and how the trainer runs
its passes (reference pass, shared-prompt packing, padding-free rows, sharding, LoRA, token budget), checked when
built. Pure: no torch at import."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS


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
    #: the padding-free rows run varlen attention
    #: (:attr:`~trl_nrollout.plan.devices.DeviceProfile.varlen_attention`: every sample in one row, each
    #: sequence's causal pairs only, no mask and so no cap from its bound), as the trainer does on CUDA in half
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
    #: how the LoRA policy reaches the engines (``rollout_lora_sync`` once decided): ``"merged"`` full weights per
    #: sync, or ``"adapter"`` (the adapter's bytes per sync, generation at the device's LoRA slowdown)
    lora_sync: str = "merged"
    #: the adapter's bytes where known (a trainer pricing its own adapter); None: rank-``lora_r`` adapters on every
    #: linear layer in the model's dtype
    lora_adapter_bytes: int | None = None
    #: ZeRO-2: gradients and optimizer states split over the data-parallel ranks, the weights whole on each (no
    #: gathers per forward); ``sharded`` (ZeRO-3 / FSDP) splits the weights too
    optimizer_sharded: bool = False
    #: the optimizer offloaded to host memory (ZeRO-Offload, ``trainer_sharding="zero3_offload"``): the fp32 master
    #: weights and Adam moments live on the host and step there; the device holds the bf16 weights and gradients
    optimizer_offloaded: bool = False
    #: groups an engine keeps in flight per group of its share: partial rollouts (``rollout_partial``) keep
    #: ``1 + rollout_partial_oversample`` of them, and their KV cache (1: the step's share only)
    pool_factor: float = 1.0
    #: partial rollouts (``rollout_partial``): a step ends when its share of groups is complete, the pool's other
    #: samples go on in the next step, so no step waits for the longest completion (the tail is cut)
    partial: bool = False
    #: on-policy distillation's teacher (``teacher_model_name_or_path``): its forward over every sample's tokens,
    #: cut as the reference pass is (its micro batches or token budget), with its weights gathered per forward where
    #: the trainer is sharded; its weights held as the reference model's are (split over the ranks with ZeRO-3 /
    #: FSDP). The old-policy pass runs whenever a teacher is set (the term compares the student's log-probs).
    #: None: no teacher
    teacher: ModelDims | None = None
    #: the teacher served by a vLLM engine of its own (``teacher_backend="vllm"``): its weights (split over the
    #: engine's TP group) and its scoring logits held beside the rollout engine's, none in the trainer; its pass one
    #: engine call over the samples' tokens (prompt log-probs), without the trainer's gathers or micro batches
    teacher_engine: bool = False
    #: the sampling temperature: at another than 1 the teacher's engine serves a copy whose output head is divided
    #: by it, untied from the embeddings, so a tied teacher's engine holds its ``[V, H]`` matrix twice
    temperature: float = 1.0

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
        if self.lora_sync not in ("merged", "adapter"):
            raise ValueError(f"lora_sync={self.lora_sync!r} must be 'merged' or 'adapter' (decide 'auto' with "
                             "trl_nrollout.plan.lora.price_lora_sync first).")
        if self.update_token_budget is not None and self.update_token_budget < self.row_width:
            raise ValueError(f"ppo_max_token_len_per_device={self.update_token_budget} is below the longest sample "
                             f"({self.row_width:g} tokens, prompt + completion); every sample must fit one micro "
                             f"batch: use at least {math.ceil(self.row_width)}.")
        if self.prompt_max is not None and self.prompt_max < self.prompt_len:
            raise ValueError(f"prompt_max={self.prompt_max} must be >= prompt_len={self.prompt_len} (the longest "
                             "prompt bounds the mean).")
