"""Run by tests/test_budget_gpu_paths.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): the log-prob pass of a
model sharded by plain torch FSDP1 and FSDP2 (accelerate cannot run FSDP on a CPU) applies the output head to the
scored positions only, a chunk at a time (:class:`~trl_nrollout.passes.logprobs.ScoredHead`), and gives the
full-forward log-probs.

argv: model folder, output folder. Each rank scores its own ragged samples in three layouts (the plain padded one,
token-budgeted padding-free rows, the shared-prompt layout) with ``chunk_rows=4``, under a dispatch mode that
records the largest tensor of any operation whose last dimension is the vocabulary: with the head on scored rows
only it is one ``[4, V]`` chunk; the model's own logits would be ``[rows, positions, V]``. A control pass with the
scored head switched off (the forward's whole logits, as before) shows that the watch sees them. Writes
``rank{rank}.json``: per mode and layout, the largest vocabulary tensor, the scored tokens of the pass, the rows the
head module itself received, and the largest difference to a one-sample-at-a-time full-forward log-softmax of the
unsharded model.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

import trl_nrollout.passes.logprobs as logprobs_module
from trl_nrollout.passes.logprobs import compute_log_probs, unwrap_model

CHUNK = 4


class VocabWatch(TorchDispatchMode):
    """The most elements of any new tensor (not a view: the head's transposed weight is one) whose last dimension is
    ``vocab``."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel())
        return out


def samples(rank: int):
    """Ragged prompts and completions, a different count per rank; three prompts shared by four samples each."""
    g = torch.Generator().manual_seed(400 + rank)
    n = 10 + 3 * rank
    prompts = [torch.randint(3, 300, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    shared = [torch.randint(3, 300, (30,), generator=g).tolist() for _ in range(3)]
    prompts += [p for p in shared for _ in range(4)]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
                   for _ in prompts]
    return prompts, completions


def full_forward(model, prompts, completions) -> torch.Tensor:
    """One sample at a time, the model's whole logits, a float32 log-softmax: ``[B, C]``."""
    out = torch.zeros(len(prompts), max(len(c) for c in completions))
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0].float(), -1)
            for j, tok in enumerate(c):
                out[i, j] = logp[len(p) + j - 1, tok]
    return out


def wrap(mode: str, model):
    layer_cls = type(model.model.layers[0])
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


LAYOUTS = {
    "plain": dict(micro_batch_size=5),
    "padfree_budget": dict(max_token_len=64, padding_free=True),
    "shared_prompts": dict(micro_batch_size=12, shared_prompts=True),
}


def run(mode: str, model, ref: torch.Tensor, prompts, completions, vocab: int) -> dict:
    head = unwrap_model(unwrap_model(model).get_output_embeddings())
    received: list[int] = []
    hook = head.register_forward_hook(lambda m, args, out: received.append(args[0][..., 0].numel()))
    results = {}
    try:
        for name, options in LAYOUTS.items():
            received.clear()
            with VocabWatch(vocab) as watch:
                got = compute_log_probs(model, prompts, completions, with_entropy=True, chunk_rows=CHUNK, **options)
            results[name] = {"most_vocab_elements": watch.most, "head_module_rows": sum(received),
                             "head_calls": len(received), "forwards": got.num_forwards,
                             "max_abs_diff": float((got.logprobs - ref).abs().max())}
        real = logprobs_module.ScoredHead.of
        logprobs_module.ScoredHead.of = classmethod(lambda cls, *a, **k: None)  # the whole logits, as before
        try:
            with VocabWatch(vocab) as watch:
                got = compute_log_probs(model, prompts, completions, chunk_rows=CHUNK, **LAYOUTS["plain"])
        finally:
            logprobs_module.ScoredHead.of = real
        results["control_whole_logits"] = {"most_vocab_elements": watch.most,
                                           "max_abs_diff": float((got.logprobs - ref).abs().max())}
    finally:
        hook.remove()
    return results


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = plain.config.vocab_size
    prompts, completions = samples(rank)
    ref = full_forward(plain, prompts, completions)
    out = {"vocab": vocab, "chunk": CHUNK, "scored_tokens": sum(len(c) for c in completions), "modes": {}}
    for mode in ("fsdp1", "fsdp2"):
        model = wrap(mode, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
        out["modes"][mode] = run(mode, model, ref, prompts, completions, vocab)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
