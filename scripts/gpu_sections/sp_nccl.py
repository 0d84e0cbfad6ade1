"""Section ``sp_nccl`` of scripts/gpu_check.py: Ulysses sequence parallelism on an NCCL group (issue 62, items 1-2).

On one CUDA GPU, in a process group of one rank with backend ``nccl`` (what a colocated GPU launch's default group
is: no CPU backend), ``check_sp_nccl("cuda")`` runs

- the update's shared shuffle (``shared_shuffle``: no collective; two ranks of a group agree), beside what the old
  shuffle's broadcast of a CPU tensor does on that group (``old_cpu_broadcast``: NCCL's error expected);
- the Ulysses exchange and gather (``_AllToAll``, ``_GatherSequence``) on the group, bf16;
- the Ulysses attention wrapped around ``sdpa`` (block-mask rows), ``trl_nrollout_varlen`` (varlen rows: PyTorch's
  flash varlen kernel) and ``flash_attention_2`` (where flash-attn is installed; else ``skipped``): a sharded
  forward's completion log-probs against the plain model's on the padded batch (``max_abs_logp_diff``), and greedy
  generation through the wrapped model against the plain one's (``generation_equal``: the same inner attention,
  so the same tokens).

``check_sp_nccl("cpu")`` (the dry run) does the same on a ``gloo`` group in float32 (flash-attention skipped).
Run alone: ``python scripts/gpu_sections/sp_nccl.py [--dry-run]`` prints the JSON.
"""

from __future__ import annotations

import copy
import json
import socket
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(device: str, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _samples(device: str):
    import torch

    g = torch.Generator().manual_seed(1)
    lens = [(12, 40), (30, 7), (5, 61), (21, 22), (9, 3), (17, 33)]
    prompts = [torch.randint(3, 1024, (p,), generator=g).to(device) for p, _ in lens]
    completions = [torch.randint(3, 1024, (c,), generator=g).to(device) for _, c in lens]
    return prompts, completions


def _shuffle_case(device: str) -> dict:
    import torch
    import torch.distributed as dist

    from trl_nrollout.passes.ulysses import SPGroup, shared_shuffle

    batch = {"prompt_ids": torch.arange(48, device=device).reshape(16, 3), "names": [str(i) for i in range(16)]}
    group = [SPGroup(None, 2, r, 0, 1, seed=42) for r in range(2)]
    got = []
    for rank, sp in enumerate(group):
        torch.manual_seed(100 + rank)  # TRL seeds each process apart
        got.append(shared_shuffle(batch, sp))
    agree = torch.equal(got[0]["prompt_ids"], got[1]["prompt_ids"]) and got[0]["names"] == got[1]["names"]
    try:  # the old shuffle's collective: a CPU tensor broadcast on the default group
        dist.broadcast(torch.randperm(16), src=0)
        old = "ran"
    except Exception as err:  # NCCL: "No backend type associated with device type cpu"
        old = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return {"shuffle_ranks_agree": agree, "old_cpu_broadcast": old}


def _exchange_case(device: str, dtype) -> dict:
    import torch

    from trl_nrollout.passes.ulysses import _AllToAll, _GatherSequence

    x = torch.randn(1, 2, 8, 16, 4, device=device, dtype=dtype, requires_grad=True)
    y = _AllToAll.apply(x, None)
    y.sum().backward()
    z = _GatherSequence.apply(torch.randn(3, 10, device=device, dtype=dtype), None, 1, 0)
    return {"exchange_ok": bool(torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x)) and z.shape == (3, 10))}


def _attention_case(base, attn: str, device: str, tol: float) -> dict:
    """The plain ``base`` model against a copy with the Ulysses attention installed (a group of one)."""
    import torch

    from trl_nrollout.passes.logprobs import compute_log_probs
    from trl_nrollout.passes.padfree import pack_rows
    from trl_nrollout.passes.ulysses import SPGroup, inner_for_rows, install, shard_rows

    prompts, completions = _samples(device)
    plain = compute_log_probs(base, [p.tolist() for p in prompts], [c.tolist() for c in completions]).logprobs
    wrapped = copy.deepcopy(base)
    install(wrapped)
    rows = pack_rows(prompts, completions, 0, mask_dtype=torch.bool if attn == "sdpa" else None)
    inner = inner_for_rows(wrapped.config, rows)
    shard = shard_rows(rows, SPGroup(None, 1, 0, 0, 1), inner)
    with torch.no_grad():
        logits = wrapped(input_ids=shard.input_ids, **shard.forward_kwargs()).logits.float()
    logps = rows.gather(logits.log_softmax(-1).gather(-1, shard.shift_labels.clamp(min=0)[..., None])[..., 0])
    diff = float((logps - plain.to(logps.device)).abs().masked_fill(~rows.valid, 0).max())
    out = {"inner": inner, "max_abs_logp_diff": diff}
    if attn != "trl_nrollout_varlen":  # generation is not sharded: the varlen case runs SDPA's, as the first
        ids = torch.nn.utils.rnn.pad_sequence([p.flip(0) for p in prompts], batch_first=True).flip(1)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True).flip(1)
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            out["generation_equal"] = bool(torch.equal(base.generate(ids, **kw), wrapped.generate(ids, **kw)))
    out["status"] = "ok" if diff < tol and out.get("generation_equal", True) else "failed"
    return out


def check_sp_nccl(device: str) -> dict:
    """The section's figures (see the module's docstring); ``status`` ok or failed (with the error)."""
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    backend, dtype, tol = ("nccl", torch.bfloat16, 0.1) if cuda else ("gloo", torch.float32, 1e-4)
    report: dict = {"backend": backend}
    made = not dist.is_initialized()
    try:
        if made:
            if cuda:
                torch.cuda.set_device(0)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    **({"device_id": torch.device("cuda", 0)} if cuda else {}))
        report["backend"] = str(dist.get_backend())
        report.update(_shuffle_case(device))
        report.update(_exchange_case(device, dtype))
        base = _model(device, dtype)
        cases = {}
        for attn in ("sdpa", "trl_nrollout_varlen", "flash_attention_2"):
            model = base
            if attn == "flash_attention_2":
                try:
                    model = copy.deepcopy(base)
                    model.set_attn_implementation(attn)
                except Exception as err:  # flash-attn not installed (or no CUDA, or no hub kernel)
                    cases[attn] = {"status": "skipped", "why": str(err).splitlines()[0][:160]}
                    continue
            try:
                cases[attn] = _attention_case(model, attn, device, tol)
            except Exception as err:
                cases[attn] = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:400],
                               "traceback": traceback.format_exc()[-1500:]}
        report["attention"] = cases
        good = report["shuffle_ranks_agree"] and report["exchange_ok"]
        good = good and all(c["status"] in ("ok", "skipped") for c in cases.values())
        report["status"] = "ok" if good else "failed"
    except Exception as err:
        report.update(status="failed", error=f"{type(err).__name__}: {err}"[:400],
                      traceback=traceback.format_exc()[-1500:])
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()
    return report


if __name__ == "__main__":
    import torch

    dry = "--dry-run" in sys.argv or not torch.cuda.is_available()
    result = check_sp_nccl("cpu" if dry else "cuda")
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["status"] == "ok" else 1)
