"""Run by tests/test_logprobs.py under ``torchrun --nproc_per_node 2``: the micro-batched log-prob pass of a
DDP- or ZeRO-3-wrapped model gives the same numbers as a plain single-process model.

argv: modes (ddp | zero3 | fsdp1 | fsdp2, or several of zero3, fsdp1, fsdp2 joined by commas: one launch then checks
each wrapped model in turn; ddp, accelerate's own CPU launch, runs alone), model folder, output folder. Each rank
scores a different, ragged set of samples with a token budget (so ranks run different numbers of micro batches: ZeRO-3 must keep its
collectives in step) and writes its max abs difference to the plain model's result (per mode). A pass with a tiny output-head
chunk (``chunk_rows=3``) makes the ranks need different numbers of head chunks per forward: under ZeRO-3 each call
of the head module would be a collective, and such a pass used to hang.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import AutoModelForCausalLM

import trl_nrollout.passes.logprobs as logprobs_module
from trl_nrollout.passes.logprobs import compute_log_probs


def samples(rank: int, num: int):
    g = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(3, 300, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num)]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(num)]
    return prompts, completions


def grouped_samples(rank: int, prompts: int, n: int):
    """``prompts`` long prompts, each with ``n`` ragged completions: the shared-prompt layout pays."""
    g = torch.Generator().manual_seed(200 + rank)
    distinct = [torch.randint(3, 300, (int(torch.randint(24, 40, (1,), generator=g)),), generator=g).tolist()
                for _ in range(prompts)]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(prompts * n)]
    return [p for p in distinct for _ in range(n)], completions


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def wrap(mode: str, model, accelerator):
    """(the model as ``mode`` wraps it, its local parameter count after wrapping)."""
    if mode == "fsdp1":  # plain torch FSDP1 (the wrapper class), one unit per decoder layer
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_cls = type(model.model.layers[0])
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=torch.device("cpu"))
        return model, sum(p.numel() for p in model.parameters())
    if mode == "fsdp2":  # plain torch FSDP2 (accelerate cannot run FSDP on CPU)
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, sum(p.to_local().numel() for p in model.parameters())
    if mode == "zero3":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        return model, sum(p.numel() for p in model.module.parameters())  # 0: ZeRO-3 keeps only shards
    return accelerator.prepare(model), -1


def hidden_states(mode: str, model, plain, rank: int) -> dict:
    """The distillation teacher's pass (:func:`~trl_nrollout.passes.hidden.completion_hidden_states`: padding-free
    rows, a 24-token budget, a different count of samples per rank) run inside the wrapped model's own forward, as
    TRL's loss calls its teacher (``_forward_redirection``), against the plain model's hidden states."""
    from trl.models.utils import _ForwardRedirection

    from trl_nrollout.passes.hidden import completion_hidden_states
    from trl_nrollout.passes.logprobs import unwrap_model

    prompts, completions = samples(rank, 9 + 5 * rank)
    ref = completion_hidden_states(plain, prompts, completions).hidden
    got = _ForwardRedirection()(model, unwrap_model(model), lambda: completion_hidden_states(
        model, prompts, completions, max_token_len=24, padding_free=True, in_forward=True))
    return {"max_abs_diff_hidden": float((got.hidden - ref).abs().max()), "hidden_forwards": got.num_forwards}


def check(mode: str, model, plain, rank: int, sharded: int) -> dict:
    """The log-prob passes of ``model`` against the plain single-process model's."""
    model.train()  # the pass must put it in eval mode and restore training mode after
    prompts, completions = samples(rank, 12 + 7 * rank)  # ragged, and a different count per rank
    ref = compute_log_probs(plain, prompts, completions, with_entropy=True)
    got = compute_log_probs(model, prompts, completions, with_entropy=True, max_token_len=48, micro_batch_size=4)
    also = compute_log_probs(model, prompts, completions, micro_batch_size=1, pad_side="left")
    chunked = compute_log_probs(model, prompts, completions, micro_batch_size=5, chunk_rows=3)
    # the shared-prompt layout: FSDP runs it through the model's own forward, the others on the lean path; ranks
    # with different numbers of micro batches
    g_prompts, g_completions = grouped_samples(rank, 3 + rank, 4)
    g_ref = compute_log_probs(plain, g_prompts, g_completions, with_entropy=True)
    packed_calls = []
    real_pack = logprobs_module.pack_shared_prompts
    logprobs_module.pack_shared_prompts = lambda *a, **k: packed_calls.append(1) or real_pack(*a, **k)
    try:
        packed = compute_log_probs(model, g_prompts, g_completions, with_entropy=True, micro_batch_size=8,
                                   shared_prompts=True)
    finally:
        logprobs_module.pack_shared_prompts = real_pack
    return {
        "mode": mode,
        "local_numel_after_wrap": sharded,
        "num_forwards": got.num_forwards,
        "max_abs_diff": float((got.logprobs - ref.logprobs).abs().max()),
        "max_abs_diff_entropy": float((got.entropy - ref.entropy).abs().max()),
        "max_abs_diff_mb1_left": float((also.logprobs - ref.logprobs).abs().max()),
        "max_abs_diff_small_head_chunks": float((chunked.logprobs - ref.logprobs).abs().max()),
        "training_mode_restored": bool(model.training),
        "packed_forwards": len(packed_calls),
        "packed_micro_batches": -(-len(g_prompts) // 8),
        "max_abs_diff_packed": float((packed.logprobs - g_ref.logprobs).abs().max()),
        "max_abs_diff_packed_entropy": float((packed.entropy - g_ref.entropy).abs().max()),
        **(hidden_states(mode, model, plain, rank) if mode in ("fsdp1", "fsdp2") else {}),
    }


def main() -> None:
    modes, model_dir, out_dir = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    if "ddp" in modes and len(modes) > 1:
        raise SystemExit(f"ddp runs alone (accelerate's CPU launch), not with {modes}")
    # the plain model, and FSDP's models, are loaded before the accelerator: with a ZeRO-3 plugin active,
    # from_pretrained partitions
    plain = load(model_dir)
    models = {mode: load(model_dir) for mode in modes if mode in ("fsdp1", "fsdp2")}
    kwargs = [InitProcessGroupKwargs(backend="gloo")]
    accelerator = None
    if "zero3" in modes:
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1)
        accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=kwargs)
    elif "ddp" in modes:
        accelerator = Accelerator(cpu=True, kwargs_handlers=kwargs)
    else:
        torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for mode in modes:
        model = models.pop(mode) if mode in models else load(model_dir)  # ZeRO-3's: partitioned at load
        model, sharded = wrap(mode, model, accelerator)
        results[mode] = check(mode, model, plain, rank, sharded)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "modes": results}, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # a clean exit: no rank left with live gloo threads
        torch.distributed.destroy_process_group()
