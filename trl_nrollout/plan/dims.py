"""The model of the step's cost model (:mod:`trl_nrollout.plan.cost`): :class:`ModelDims`, a decoder-only
transformer's dimensions read from its ``config.json`` (dense or a mixture of experts), and what follows from them:
parameter counts (all, per token, LoRA's), FLOPs per token and per query-key pair, weights read and KV cache bytes
per token. Pure: no torch at import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_nrollout.plan.memory import dtype_bytes

#: model types whose MLP has two matrices (up, down) instead of three (gate, up, down)
UNGATED_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2")
#: model types that normalize the queries and keys per head before the rotary embedding (Qwen3's q_norm / k_norm)
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_text", "gemma3", "gemma3_text", "olmo2")


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
