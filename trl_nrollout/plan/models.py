"""The dimensions of a few common models, from their public ``config.json`` on the Hugging Face Hub, so that
``trl-nrollout plan --predict`` / ``--suggest`` answers for them offline and without torch. Any other model is read
from its own config (a local folder, a ``builtin:`` name, or the Hub cache)."""

from __future__ import annotations

from typing import Any

from trl_nrollout.plan.dims import ModelDims

#: hub id -> the config.json fields the cost model reads (copied from each repo's config.json)
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896,
                                       intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                                       vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=1536,
                                       intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                                       vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "Qwen/Qwen2.5-3B-Instruct": dict(model_type="qwen2", num_hidden_layers=36, hidden_size=2048,
                                     intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                                     vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                                     intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                                     vocab_size=152064, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Qwen/Qwen3-32B": dict(model_type="qwen3", num_hidden_layers=64, hidden_size=5120, intermediate_size=25600,
                           num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                           tie_word_embeddings=False, torch_dtype="bfloat16"),
    "meta-llama/Llama-3.1-8B-Instruct": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096,
                                             intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                                             vocab_size=128256, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # a mixture of experts: 128 experts per layer, 8 per token (30.5B parameters, 3.3B activated, as published)
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                               tie_word_embeddings=False, torch_dtype="bfloat16"),
}
for _name in list(KNOWN_CONFIGS):  # the base models share their instruct models' shapes
    KNOWN_CONFIGS[_name.removesuffix("-Instruct")] = KNOWN_CONFIGS[_name]


def model_dims(name_or_path: str, dtype: str | None = None) -> ModelDims:
    """:class:`ModelDims` of a known hub id (:data:`KNOWN_CONFIGS`, offline) or of any model whose config can be
    read (:func:`~trl_nrollout.plan.memory.load_config_dict`)."""
    if name_or_path in KNOWN_CONFIGS:
        return ModelDims.from_config_dict(KNOWN_CONFIGS[name_or_path], dtype=dtype, name=name_or_path)
    from trl_nrollout.plan.memory import load_config_dict

    config, _ = load_config_dict(name_or_path)
    return ModelDims.from_config_dict(config, dtype=dtype, name=name_or_path)
