"""Section ``budgets`` of scripts/gpu_check.py: the log-prob pass through the model's own forward (what FSDP runs)
applies its output head to the scored positions only (issue 62, item 3).

``check_budgets("cuda")`` builds a Qwen2 model of about 0.5 B parameters with random weights (Qwen2.5-0.5B's shape,
vocabulary 152,064) in bf16 on the device and scores 16 samples (256-token prompts, 768-token completions: 16,384
tokens) as token-budgeted padding-free rows (``max_token_len=16384``, one micro batch) through the model's own forward
(``lean_head=False``), twice:

- ``scored_head``: as the pass runs now (:class:`~trl_nrollout.passes.logprobs.ScoredHead`: the head on the
  completion positions, 1,024 rows at a time; 16 on the CPU);
- ``whole_logits``: as it ran before (``ScoredHead.of`` switched off: the forward's ``[tokens, V]`` logits).

Each reports the peak CUDA memory above the model's weights (``torch.cuda.max_memory_allocated``), and the largest
vocabulary-wide tensor any operation made (elements); ``max_abs_diff`` compares the two passes' log-probs. ``status``
ok when the scored head's peak is below the whole logits' and below a quarter of one bf16 ``[tokens, V]`` block, its
largest vocabulary tensor is one chunk, and the log-probs agree within bf16 rounding (0.1).

``check_budgets("cpu")`` (the dry run) does the same on a small model (2 layers, hidden 64, the same vocabulary) and
fewer tokens, in float32, without the CUDA peaks. Run alone: ``python scripts/gpu_sections/budgets.py [--dry-run]``
prints the JSON.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 152064
SIZES = {
    # Qwen2.5-0.5B's shape (its vocabulary padded to 152,064 as the 7B's): about 0.5 B parameters, untied
    "cuda": dict(model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2), samples=16, prompt=256, completion=768, chunk=1024),
    "cpu": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2), samples=6, prompt=12, completion=20, chunk=16),
}


def _watch(vocab: int):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class VocabWatch(TorchDispatchMode):
        """The most elements of any new (not a view) tensor whose last dimension is the vocabulary."""

        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):
                for t in tree_leaves(out):
                    if hasattr(t, "shape") and t.dim() >= 1 and t.shape[-1] == vocab:
                        self.most = max(self.most, t.numel())
            return out

    return VocabWatch()


def _pass(model, prompts, completions, device: str, budget: int, chunk: int, scored: bool) -> tuple[dict, object]:
    import torch

    import trl_nrollout.passes.logprobs as logprobs_module

    real = logprobs_module.ScoredHead.of
    if not scored:
        logprobs_module.ScoredHead.of = classmethod(lambda cls, *a, **k: None)
    cuda = device.startswith("cuda")
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with _watch(VOCAB) as watch:
            got = logprobs_module.compute_log_probs(model, prompts, completions, lean_head=False, padding_free=True,
                                                    max_token_len=budget, chunk_rows=chunk)
        out = {"forwards": got.num_forwards, "most_vocab_elements": watch.most}
        if cuda:
            torch.cuda.synchronize()
            out["peak_above_weights_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    finally:
        logprobs_module.ScoredHead.of = real
    return out, got.logprobs


def check_budgets(device: str) -> dict:
    """The checks of the module docstring on ``device``; ``status`` ok when all hold, else failed (with what)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = device.startswith("cuda")
    size = SIZES["cuda" if cuda else "cpu"]
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict = {"device": device, "dtype": str(dtype).removeprefix("torch.")}
    try:
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=4096, **size["model"])
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(dtype).eval()
        out["params"] = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        n, p_len, c_len = size["samples"], size["prompt"], size["completion"]
        prompts = torch.randint(3, VOCAB, (n, p_len), generator=g).tolist()
        completions = [torch.randint(3, VOCAB, (c_len - 7 * (i % 3),), generator=g).tolist() for i in range(n)]
        tokens = sum(len(a) + len(b) for a, b in zip(prompts, completions))
        out.update(tokens=tokens, scored_tokens=sum(len(c) for c in completions), budget=tokens)
        scored, lp_scored = _pass(model, prompts, completions, device, tokens, size["chunk"], scored=True)
        whole, lp_whole = _pass(model, prompts, completions, device, tokens, size["chunk"], scored=False)
        out.update(scored_head=scored, whole_logits=whole,
                   max_abs_diff=float((lp_scored - lp_whole).abs().max()),
                   whole_logits_block_gib=tokens * VOCAB * (2 if cuda else 4) / 2**30)
        ok = scored["most_vocab_elements"] <= size["chunk"] * VOCAB < whole["most_vocab_elements"] \
            and out["max_abs_diff"] < 0.1
        if cuda:
            ok = ok and scored["peak_above_weights_gib"] < whole["peak_above_weights_gib"] \
                and scored["peak_above_weights_gib"] < out["whole_logits_block_gib"] / 4
        out["status"] = "ok" if ok else "failed"
    except Exception as exc:  # noqa: BLE001 - the section reports, the others go on
        out.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    return out


if __name__ == "__main__":
    dry = "--dry-run" in sys.argv
    import torch

    print(json.dumps(check_budgets("cpu" if dry or not torch.cuda.is_available() else "cuda"), indent=2))
