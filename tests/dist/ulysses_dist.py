"""Run by tests/test_ulysses.py under a 2-process launch (gloo, CPU): Ulysses sequence parallelism at S = 2 gives
what one process gives.

argv: output folder. Both ranks form one sequence-parallel group and hold the same samples: six sequences of unequal
lengths packed into padding-free rows (several sequences a row, some crossing the border between the two shards).
Per case (an attention the model runs, and a model whose KV heads are split or replicated), each rank

- runs the update's forward (:func:`~trl_nrollout.passes.ulysses.sharded_policy_logps`: its shard through TRL's
  fused LM head, the shards gathered) and a GRPO-like loss of the per-token log-probs and entropies, backward, the
  group's gradients summed;
- runs the log-prob pass (:func:`~trl_nrollout.passes.logprobs.compute_log_probs` with ``sequence_parallel``) under
  a token budget of 12 per device, below the longest sample's 20 tokens (one device refuses it; the group's two
  devices hold it);

(``sdpa_fsdp2``: the model's parameters sharded over the two ranks by FSDP2, its averaged gradients gathered)
and compares them with one process's: the same model unsharded (built again with the same weights, without the
Ulysses attention) over the same padding-free rows, and the plain log-prob pass. Each rank writes ``rank{r}.json``: per case the
largest absolute differences of log-probs, entropies, loss and gradients.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trl_nrollout.builtin import resolve_model
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.passes.padfree import pack_rows
from trl_nrollout.passes.ulysses import install, new_sp_group, sharded_policy_logps, sp_multiple
from trl_nrollout.passes.varlen import VARLEN_NAME

PAD = 0
#: case -> (attention implementation, None: the built-in tiny Qwen2 (4 heads, 2 KV heads: split) or a dict: a random
#: Qwen2 of that config (2 heads, 1 KV head: replicated over the 2 ranks)), rows with a mask or varlen
CASES = {
    "sdpa": ("sdpa", None),
    "eager": ("eager", None),
    "varlen": (VARLEN_NAME, None),
    "sdpa_kv_replicated": ("sdpa", {"num_attention_heads": 2, "num_key_value_heads": 1}),
    "sdpa_fsdp2": ("sdpa", None),  # the sharded model under FSDP2 (fully_shard over the group's two ranks)
}


def samples() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    lens = [(5, 13), (9, 4), (3, 17), (7, 9), (4, 2), (11, 6)]
    prompts = [torch.randint(3, 300, (p,), generator=g) for p, _ in lens]
    completions = [torch.randint(3, 300, (c,), generator=g) for _, c in lens]
    return prompts, completions


def build(attn: str, config: dict | None):
    torch.manual_seed(0)
    if config is None:
        model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"), dtype=torch.float32,
                                                     attn_implementation="sdpa")
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=64,
                                             num_hidden_layers=2, max_position_embeddings=256, **config))
    if attn == VARLEN_NAME:
        from trl_nrollout.passes.varlen import register

        register()
    model.config._attn_implementation = attn
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model.float()


def loss_of(logps: torch.Tensor, entropy: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A GRPO-like loss: ratio times a per-sample advantage, an entropy bonus, token-mean over the micro batch."""
    adv = torch.linspace(-1.0, 1.0, logps.shape[0])[:, None]
    mask = valid.float()
    ratio = torch.exp(logps - logps.detach())
    return (-(ratio * adv * mask).sum() - 0.01 * (entropy * mask).sum()) / mask.sum()


def one_case(attn: str, config: dict | None, sp, fsdp2: bool = False) -> dict:
    prompts, completions = samples()
    plain = build(attn, config)
    # the same weights built again (seeded), not a deep copy: TRL's fused-head patch keeps the original forward bound
    # to the model it patched, so a copy's full forward would run the original model
    model = build(attn, config)
    install(model)
    full_numel = sum(p.numel() for p in model.parameters())
    if fsdp2:  # parameters sharded over the two ranks (the group shares one data shard), unsharded per forward
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        local_numel = sum(p.to_local().numel() for p in model.parameters())
    varlen = attn == VARLEN_NAME
    mask_dtype = None if varlen else (torch.bool if attn == "sdpa" else torch.float32)
    # one process: the whole rows (several sequences a row, the widest sample's width: 3 + 17)
    rows = pack_rows(prompts, completions, PAD, mask_dtype=mask_dtype, pad_to_multiple_of=sp_multiple(None, 2))
    kw = rows.forward_kwargs()
    if varlen:
        from trl_nrollout.passes.varlen import varlen_forward

        ctx = varlen_forward(plain.config)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        out = plain(input_ids=rows.input_ids, shift_labels=rows.shift_labels, fused_lm_head=True, **kw)
    ref_lp, ref_ent = rows.gather(out.log_probs), rows.gather(out.entropy)
    ref_loss = loss_of(ref_lp, ref_ent, rows.valid)
    ref_loss.backward()
    # S = 2: this rank's shard, the group's gradients summed
    lp, ent = sharded_policy_logps(model, rows, sp)
    loss = loss_of(lp, ent, rows.valid)
    # FSDP2 averages the ranks' gradients (reduce-scatter): the trainer's loss scale S makes the mean the group's sum
    (loss * sp.size if fsdp2 else loss).backward()
    grads = {}
    for name, p in model.named_parameters():
        if fsdp2:
            grads[name] = p.grad.full_tensor()
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=sp.group)
        grads[name] = g
    ref_grads = dict(plain.named_parameters())
    grad_diff = max(float((grads[n] - ref_grads[n].grad).abs().max()) for n in grads)
    grad_scale = max(float(ref_grads[n].grad.abs().max()) for n in grads)
    # the log-prob pass (no gradient), against the plain single-process pass
    pl = [p.tolist() for p in prompts]
    cl = [c.tolist() for c in completions]
    want = compute_log_probs(plain, pl, cl, with_entropy=True)
    # a token budget per device of 12: the longest sample (20 tokens) fits the group's 2 x 12, not one device's
    got = compute_log_probs(model, pl, cl, with_entropy=True, sequence_parallel=sp, max_token_len=12,
                            padding_free=True)
    try:
        compute_log_probs(plain, pl, cl, max_token_len=12, padding_free=True)
        refused = False
    except ValueError as err:
        refused = "log_prob_max_token_len_per_device=12" in str(err) or "max_token_len" in str(err)
    return {
        "rows": list(rows.input_ids.shape),
        "logps": float((lp - ref_lp).abs().max()), "entropy": float((ent - ref_ent).abs().max()),
        "loss": abs(float(loss - ref_loss)), "grads": grad_diff, "grad_scale": grad_scale,
        "pass_logps": float((got.logprobs - want.logprobs).abs().max()),
        "pass_entropy": float((got.entropy - want.entropy).abs().max()),
        "pass_forwards": got.num_forwards, "one_device_refuses_the_budget": refused,
        "sharded": fsdp2 and local_numel < full_numel,
    }


def critic_case(sp) -> dict:
    """PPO's critic (built-in tiny Qwen2 with a value head) at S = 2: :func:`~trl_nrollout.passes.critic.critic_values`
    with ``sequence_parallel`` (each rank's shard through the critic, the values gathered) against one process's
    padded forward: the values, and the gradients of a masked mean of them (each rank's part, summed over the
    group); and the micro-batched value pass under a per-device budget one device refuses."""
    from trl_nrollout.passes.critic import build_critic, compute_values, critic_values, pad_batch

    prompts, completions = samples()
    pl, cl = [p.tolist() for p in prompts], [c.tolist() for c in completions]
    plain, sharded = build_critic("builtin:tiny-qwen2"), build_critic("builtin:tiny-qwen2")
    tensors = pad_batch(pl, cl, PAD, torch.device("cpu"), None)
    mask = tensors[3].float()
    want = critic_values(plain, *tensors, pad_token_id=PAD)
    ((want * mask).sum() / mask.sum()).backward()
    got = critic_values(sharded, *tensors, pad_token_id=PAD, sequence_parallel=sp)
    ((got * mask).sum() / mask.sum()).backward()
    ref = dict(plain.named_parameters())
    grad_diff = 0.0
    for name, p in sharded.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=sp.group)
        grad_diff = max(grad_diff, float((g - ref[name].grad).abs().max()))
    pass_want = compute_values(plain, pl, cl, pad_token_id=PAD)
    pass_got = compute_values(sharded, pl, cl, pad_token_id=PAD, max_token_len=12, padding_free=True,
                              sequence_parallel=sp)
    try:
        compute_values(plain, pl, cl, pad_token_id=PAD, max_token_len=12, padding_free=True)
        refused = False
    except ValueError:
        refused = True
    return {"values": float(((got - want) * mask).abs().max()), "grads": grad_diff, "one_device_refuses": refused,
            "grad_scale": max(float(p.grad.abs().max()) for p in plain.parameters() if p.grad is not None),
            "pass_values": float((pass_got - pass_want).abs().max())}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = new_sp_group(2)
    torch.set_num_threads(1)
    result = {"world": dist.get_world_size(), "sp_rank": sp.rank, "dp_rank": sp.dp_rank,
              "cases": {name: one_case(attn, cfg, sp, fsdp2=name.endswith("fsdp2")) for name, (attn, cfg) in
                        CASES.items()}, "critic": critic_case(sp)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
