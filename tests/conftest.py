"""Shared fixtures: the built-in tiny model (built once per machine, cached) and helpers to run launchers."""

from __future__ import annotations

import hashlib
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


@pytest.fixture(scope="session")
def recipe():
    """``recipes/grpo.py`` as a module (``recipe.main(argv)``, its parsers and checks), loaded once."""
    return load_recipe()


def load_recipe():
    """``recipes/grpo.py`` as a module, registered in ``sys.modules`` (dataclasses look their module up while the
    file executes)."""
    import importlib.util

    if "grpo_recipe" in sys.modules:
        return sys.modules["grpo_recipe"]
    spec = importlib.util.spec_from_file_location("grpo_recipe", ROOT / "recipes" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: The commit hash of the Hub repositories laid out by :func:`populate_cache`.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT,
                   revision: str | None = "main", repo_type: str = "model") -> Path:
    """Lay files out as ``huggingface_hub`` stores a download: ``<type>s--<ns>--<name>/blobs/<etag>``, a
    ``snapshots/<commit>/<path>`` link to the blob, and ``refs/<revision>`` holding the commit hash."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for path, data in files.items():
        blob = storage / "blobs" / hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if revision is not None:
        (storage / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return storage


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, made the default of ``huggingface_hub`` in this process, in offline mode.

    ``huggingface_hub`` reads ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` once, at import; its module constants are
    patched here (the subprocess test below sets the real environment variables instead)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


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
