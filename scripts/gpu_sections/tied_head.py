"""Section ``tied_head`` of scripts/gpu_check.py: a trained copy of a tied head is refused (issue 62, item 10).

``check_tied_head("cuda")`` builds a small Qwen2 model on the device in bf16 whose ``lm_head`` is tied to
``embed_tokens`` (``tie_word_embeddings=True``, as Qwen2.5-1.5B-Instruct), wraps it with PEFT's
``LoraConfig(modules_to_save=["lm_head"])`` and checks, without vLLM:

- ``refused``: the trainer's check (:func:`~trl_nrollout.rollout.engines.weight_sync.tied_weights_refusal`) refuses it, the
  message naming ``modules_to_save``, the value, the tie and the fix;
- ``sync_refused``: the weight sync itself (``iter_weight_buckets``, on the device's tensors) raises the same error
  before it yields a bucket;
- ``shared_accepted``: ``ensure_weight_tying=True`` (one trained copy for both names) is accepted and sent as one matrix;
- ``untied_accepted``: the same adapter on an untied model is accepted, and the sync sends the trained copy as
  ``lm_head.weight`` (on the device) and the embeddings as they are.

``check_tied_head("cpu")`` (the dry run) does the same in float32. Run alone:
``python scripts/gpu_sections/tied_head.py [--dry-run]`` prints the JSON.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: What the refusal must name: the option and its value, the tie, and the fix.
NAMED = ("modules_to_save=['lm_head']", "tie_word_embeddings=True", "model.embed_tokens.weight and lm_head.weight",
         "drop 'lm_head' from modules_to_save")


def _model(device: str, dtype, tied: bool):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)


def _peft(model, **extra):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                            modules_to_save=["lm_head"], **extra))


def check_tied_head(device: str) -> dict:
    """The checks of the module docstring on ``device``; ``status`` ok when all hold, else failed (with what)."""
    import torch

    from trl_nrollout.errors import InputError
    from trl_nrollout.rollout.engines.weight_sync import iter_weight_buckets, tied_weights_refusal

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out: dict = {"device": device, "dtype": str(dtype).removeprefix("torch.")}
    try:
        tied = _peft(_model(device, dtype, tied=True))
        why = tied_weights_refusal(tied) or ""
        out["refused"] = all(part in why for part in NAMED)
        out["message"] = why
        try:
            next(iter_weight_buckets(tied))
            out["sync_refused"] = False
        except InputError as err:
            out["sync_refused"] = all(part in str(err) for part in NAMED)

        shared = _peft(_model(device, dtype, tied=True), ensure_weight_tying=True)
        sent = {n: t for bucket in iter_weight_buckets(shared) for n, t in bucket}
        out["shared_accepted"] = (tied_weights_refusal(shared) is None and sent["lm_head.weight"].data_ptr()
                                  == sent["model.embed_tokens.weight"].data_ptr())

        base = _model(device, dtype, tied=False)
        untied = _peft(base)
        copy = untied.base_model.model.lm_head.modules_to_save["default"].weight
        with torch.no_grad():
            copy.add_(1.0)  # trained
        sent = {n: t for bucket in iter_weight_buckets(untied) for n, t in bucket}
        out["untied_accepted"] = (tied_weights_refusal(untied) is None
                                  and sent["lm_head.weight"].device == copy.device
                                  and torch.equal(sent["lm_head.weight"], copy)
                                  and torch.equal(sent["model.embed_tokens.weight"], base.model.embed_tokens.weight))
    except Exception as err:  # noqa: BLE001 - reported in the section
        out.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-2000:])
        return out
    keys = ("refused", "sync_refused", "shared_accepted", "untied_accepted")
    out["status"] = "ok" if all(out[k] for k in keys) else "failed"
    return out


if __name__ == "__main__":
    import torch

    dry = "--dry-run" in sys.argv or not torch.cuda.is_available()
    print(json.dumps(check_tied_head("cpu" if dry else "cuda"), indent=2))
