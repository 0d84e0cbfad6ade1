"""Shared fixtures: the built-in tiny model (built once per machine, cached) and helpers to run launchers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Keep CPU runs light and quiet; vLLM-specific settings are applied by the library itself.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """An in-process vLLM engine sets RANK / WORLD_SIZE / MASTER_PORT in os.environ (its external launcher reads
    them) and keeps that port bound; later subprocess tests must not inherit them (they would fail to bind it)."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Local folder of ``builtin:tiny-qwen2`` (built on first use)."""
    from trl_nrollout.builtin import resolve_model

    return resolve_model("builtin:tiny-qwen2")


def run_cmd(args: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, fail the test with its output when it exits non-zero."""
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def save_tiny_model(folder: Path, moe: bool = False, **config) -> str:
    """A tiny random Qwen2 (or Qwen2-MoE: 4 experts, 2 per token) with the built-in tokenizer, saved to ``folder``;
    ``config`` overrides the model config (e.g. head sizes a vLLM backend lacks). Returns the folder."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from trl_nrollout.builtin import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
    if moe:
        base.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**base, **config}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**base, **config}))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)
