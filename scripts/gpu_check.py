"""The GPU acceptance in one command (under 10 minutes on one H100): what the CPU test suite cannot see.

    python scripts/gpu_check.py [--out gpu_check.json] [--only SECTION ...]   # on a machine with CUDA
    python scripts/gpu_check.py --dry-run [--out FILE]      # the same code paths on the CPU, smaller (the tests)

Sections (each reports ``status`` ok / failed with the error, so one failure does not hide the others):

1. ``logprob_precision``: the micro-batched log-prob pass (lean chunked head) of a bf16 model on the device against
   the same weights in float32: max / mean absolute log-prob difference; and the lean head against the model's
   full forward in bf16.
2. ``logprob_memory``: peak device memory (CUDA allocator) and time of one old-policy pass for n = 4, 8, 12 at a
   fixed micro batch, over the memory held before the pass: with micro batches it must stay flat in n.
3. ``packing``: the shared-prompt layout under bf16 autocast over float32 weights: the log-prob pass packed vs
   plain (difference, time, peak memory), and one packed update forward's gradient vs the plain one.
4. ``passes_autocast``: the old-policy pass under bf16 autocast over float32 weights (as the trainer runs it with
   ``bf16=True``) against the update's forward under the same autocast, and the same pass outside autocast.
5. ``prefill_once``: the HF engine's prefill-once against n prefilled copies: the same samples and log-probs, and
   the time of each.
6. ``trainer``: ``NRolloutGRPOTrainer`` with the HF engine on the device for 3 steps with a KL loss and the KL in
   the reward (the path whose CPU-built mask crashed on CUDA): losses finite, the reward's KL penalty reported.
7. ``training_rates``: the device's side of ``trl-nrollout plan --calibrate`` that needs no vLLM: a bf16 matmul's
   FLOP/s, a copy's bytes/s, and the training rates of a bf16 model of about a billion parameters on padded rows
   (``mfu_train`` per token, ``mfu_attention`` per query-key pair, the fixed cost per micro batch, the optimizer's
   bytes/s), each beside the named profile of the device's kind (its datasheet peaks, the default efficiencies);
   ``profile`` in the report is a partial profile to save under ``$TRL_NROLLOUT_PROFILES`` (the engine's costs
   keep the named profile's defaults).

8. ``padding_free``: padding-free rows against the padded layout per attention implementation (equality, speed
   per real token at long-tailed lengths, peak memory at a token budget).
9. ``varlen``: the same for varlen rows (no mask) through PyTorch's own flash-attention varlen kernel, which the
   trainer runs for an SDPA model on CUDA in half precision; whether the kernel ran; gradients.

10. ``sp_nccl``: Ulysses on an NCCL group (a colocated GPU launch's default group has no CPU backend): the shared
    shuffle without a collective, the exchange, the attention wrapped around sdpa / varlen / flash_attention_2 against
    the plain model (``scripts/gpu_sections/sp_nccl.py``).
11. ``budgets``: the log-prob pass's peak memory with the head applied to scored positions only against full-vocabulary
    logits, at a token budget, for a model with Qwen2.5's vocabulary (``scripts/gpu_sections/budgets.py``).
12. ``tied_head``: ``modules_to_save=["lm_head"]`` on a tied-embedding model is refused before anything trains
    (``scripts/gpu_sections/tied_head.py``).
13. ``lora_vllm``: a LoRA adapter served by a colocated vLLM engine on the device (``rollout_lora_sync="adapter"``):
    the engine's log-probs against the trainer's at every step while the adapter trains, only the adapter's bytes
    sent (``scripts/gpu_sections/lora_vllm.py``, in a child process).
14. ``rollout_rank``: a one-step-off run (``rollout_lookahead=1``) with a trainer and a rollout rank on the one
    device, the recipe as users run it: lags ``[0, 1, 1, 1]``, each version sent (``scripts/gpu_sections/
    rollout_rank.py``).
15. ``sharded_budgets``: the default update budget under ZeRO-3 (``zero3_init_flag``) and FSDP2, one process each:
    the whole model counted, the CUDA peak against the plan's bytes (``scripts/gpu_sections/sharded_budgets.py``).

It ends with a pass/fail table, one line per section. One H100: under 10 minutes.

Each section names what it imports (``SECTIONS``); those whose modules are missing are reported as skipped, so a
GPU machine with torch and transformers only (no TRL, vLLM or DeepSpeed) runs sections 1-5 and 7-11, and one with
the whole stack (``DS_BUILD_OPS=0 pip install -e ".[vllm,peft]"``, docs/install.md) runs them all.
``--no-launches`` skips 13-15 (they start vLLM engines and launches: minutes of a CPU's dry run).
Writes JSON; exits 1 when a section failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _model(vocab: int, hidden: int, layers: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    return Qwen2ForCausalLM(cfg).eval()


def _samples(prompts: int, n: int, vocab: int, prompt_len: int, completion_len: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ps, cs = [], []
    for _ in range(prompts):
        p = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            c_len = int(torch.randint(completion_len // 4, completion_len + 1, (1,), generator=g))
            ps.append(p)
            cs.append(torch.randint(3, vocab, (c_len,), generator=g).tolist())
    return ps, cs


def check_precision(device: str, size: dict) -> dict:
    import copy

    import torch

    from trl_nrollout.passes.logprobs import compute_log_probs

    ref_model = _model(size["vocab"], size["hidden"], size["layers"]).to(device)
    bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    ps, cs = _samples(size["prompts"], 4, size["vocab"], size["prompt_len"], size["completion_len"])
    ref = compute_log_probs(ref_model, ps, cs, micro_batch_size=8).logprobs
    lean = compute_log_probs(bf16, ps, cs, micro_batch_size=8, lean_head=True).logprobs
    full = compute_log_probs(bf16, ps, cs, micro_batch_size=8, lean_head=False).logprobs
    mask = torch.zeros_like(ref, dtype=torch.bool)
    for i, c in enumerate(cs):
        mask[i, :len(c)] = True
    diff = (lean - ref).abs()[mask]
    return {"status": "ok", "tokens": int(mask.sum()), "bf16_vs_fp32_max_abs": float(diff.max()),
            "bf16_vs_fp32_mean_abs": float(diff.mean()),
            "lean_vs_full_bf16_max_abs": float((lean - full).abs()[mask].max()),
            "all_finite": bool(torch.isfinite(lean[mask]).all())}


def check_memory(device: str, size: dict) -> dict:
    import torch

    from trl_nrollout.passes.logprobs import compute_log_probs

    model = _model(size["vocab"], size["hidden"], size["layers"]).to(device).to(torch.bfloat16)
    rows = []
    for n in (4, 8, 12):
        ps, cs = _samples(size["prompts"], n, size["vocab"], size["prompt_len"], size["completion_len"], seed=n)
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = compute_log_probs(model, ps, cs, micro_batch_size=size["micro"])
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
        rows.append({"n": n, "samples": len(ps), "forwards": out.num_forwards, "seconds": seconds,
                     "peak_mib_over_before": peak})
    return {"status": "ok", "micro_batch": size["micro"], "rows": rows}


def check_trainer(device: str, steps: int) -> dict:
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    cpu = not device.startswith("cuda")
    with tempfile.TemporaryDirectory() as out:
        args = NRolloutConfig(
            output_dir=out, train_batch_size=8, rollout_n=4, max_completion_length=16, max_steps=steps,
            learning_rate=5e-3, rollout_backend="hf", use_kl_loss=True, kl_loss_coef=0.01, use_kl_in_reward=True,
            kl_coef=0.05, use_cpu=cpu, bf16=not cpu, report_to="none", save_strategy="no", logging_steps=1, seed=0)
        trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                      train_dataset=digits_dataset(64))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
        trainer.close()
    return {"status": "ok", "device": str(trainer.accelerator.device), "steps": len(logs),
            "losses_finite": all(math.isfinite(h["loss"]) for h in logs),
            "reward": [h["reward"] for h in logs],
            "reward_kl_penalty": [h.get("actor/reward_kl_penalty") for h in logs],
            "kl_loss": [h.get("actor/kl_loss") for h in logs]}


def _padded(ps: list, cs: list, device: str):
    """Left-padded prompts, their mask, right-padded completions and their mask (TRL's layout) on ``device``."""
    import torch

    p_w, c_w = max(map(len, ps)), max(map(len, cs))
    pid = torch.zeros(len(ps), p_w, dtype=torch.long)
    pm, cid, cm = torch.zeros_like(pid), torch.zeros(len(ps), c_w, dtype=torch.long), torch.zeros(len(ps), c_w)
    for i, (p, c) in enumerate(zip(ps, cs)):
        pid[i, p_w - len(p):], pm[i, p_w - len(p):] = torch.tensor(p), 1
        cid[i, :len(c)], cm[i, :len(c)] = torch.tensor(c), 1
    return pid.to(device), pm.to(device), cid.to(device), cm.to(device)


def check_packing(device: str, size: dict) -> dict:
    """The shared-prompt layout under bf16 autocast over float32 weights (the mixed precision FSDP2 and accelerate
    use): the log-prob pass packed vs plain (difference, time, peak memory) and the gradient of one packed update
    forward (boolean block mask through SDPA's CUDA kernels) vs the plain one."""
    import torch

    from trl_nrollout.passes.logprobs import compute_log_probs
    from trl_nrollout.passes.packing import pack_shared_prompts

    model = _model(size["vocab"], size["hidden"], size["layers"]).to(device)
    ps, cs = _samples(size["prompts"], 8, size["vocab"], size["prompt_len"] * 2, max(4, size["completion_len"] // 8))
    kind = device.split(":")[0]
    cuda = kind == "cuda"
    out: dict = {"status": "ok", "samples": len(ps)}
    passes = {}
    for name, shared in (("plain", False), ("packed", True)):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autocast(device_type=kind, dtype=torch.bfloat16):
            passes[name] = compute_log_probs(model, ps, cs, micro_batch_size=size["micro"] * 2,
                                             shared_prompts=shared).logprobs
        if cuda:
            torch.cuda.synchronize()
        out[f"{name}_seconds"] = time.perf_counter() - start
        out[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
    real = torch.zeros_like(passes["plain"], dtype=torch.bool)
    for i, c in enumerate(cs):
        real[i, :len(c)] = True
    out["logprob_max_abs_diff"] = float((passes["packed"] - passes["plain"]).abs()[real].max())
    out["all_finite"] = bool(torch.isfinite(passes["packed"][real]).all())

    pid, pm, cid, cm = _padded(ps[:16], cs[:16], device)
    model.train()
    grads = {}
    for name in ("plain", "packed"):
        model.zero_grad()
        with torch.autocast(device_type=kind, dtype=torch.bfloat16):
            if name == "plain":
                ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm.long()], 1)
                logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
                lp = logits[:, pid.shape[1] - 1:-1].float().log_softmax(-1).gather(-1, cid[..., None])[..., 0]
            else:
                pk = pack_shared_prompts(pid, pm, cid, pad_token_id=0, dtype=torch.bool)
                logits = model(input_ids=pk.input_ids, attention_mask=pk.attention_mask,
                               position_ids=pk.position_ids).logits
                per_pos = logits.float().log_softmax(-1).gather(-1, pk.shift_labels.clamp(min=0)[..., None])[..., 0]
                lp = pk.gather(per_pos)
                out["packed_tokens"], out["plain_tokens"] = pk.input_ids.numel(), pid.numel() + cid.numel()
        (-(lp * cm).sum() / cm.sum()).backward()
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    out["grad_rel_diff"] = float((grads["packed"] - grads["plain"]).norm() / grads["plain"].norm())
    out["grads_finite"] = bool(torch.isfinite(grads["packed"]).all())
    return out


def _padfree_lengths(count: int, cap: int, seed: int) -> list[int]:
    """``count`` long-tailed completion lengths: an exponential of mean ``cap / 4`` clipped to ``[1, cap]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(count).exponential_(1.0 / (cap / 4), generator=g)
    return [int(min(max(1, round(float(x))), cap)) for x in draws]


def _padfree_batch(prompt_lens: list[int], completion_lens: list[int], vocab: int, device: str, seed: int):
    """Random token samples (prompt, completion) of the given lengths on ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, vocab, (p,), generator=g).to(device) for p in prompt_lens]
    cs = [torch.randint(3, vocab, (c,), generator=g).to(device) for c in completion_lens]
    return ps, cs


def _padded_inputs(ps: list, cs: list):
    """The padded layout of samples (prompts left-padded, completions right-padded): ``input_ids``,
    ``attention_mask``, ``position_ids`` ``[B, P + C]`` and ``index``/``valid`` ``[B, C]`` (flat positions predicting
    each completion token, as :attr:`PackedRows.index`)."""
    import torch

    pid, pm, cid, cm = _padded([p.tolist() for p in ps], [c.tolist() for c in cs], str(ps[0].device))
    ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm.long()], 1)
    width, p_w = ids.shape[1], pid.shape[1]
    index = (torch.arange(len(ps), device=ids.device)[:, None] * width + p_w - 1
             + torch.arange(cid.shape[1], device=ids.device)[None, :])
    return ids, am, (am.cumsum(-1) - 1).clamp(min=0), index, cm.bool()


def _scored_logprobs(model, input_ids, attention_mask, position_ids, index, valid):
    """``[B, C]`` log-probs of each completion token (0 past the end) from the forward of rows ``input_ids``: the
    head on the scored positions only (padded and packed rows pay the same head)."""
    import torch

    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
                         ).last_hidden_state
    flat = input_ids.reshape(-1)
    labels = flat[(index + 1).clamp(max=flat.numel() - 1)]
    logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1])[index[valid]]).float()
    out = torch.zeros(index.shape, dtype=torch.float32, device=input_ids.device)
    out[valid] = logits.log_softmax(-1).gather(-1, labels[valid][:, None])[:, 0]
    return out


def _layout(model, ps: list, cs: list, layout: str):
    """The forward arguments of samples in ``layout``: "padded", "packed" (block mask in the attention's form: bool
    for SDPA and flex, additive in the model's dtype for eager), "packed_nomask" (the packed rows without their
    mask: the negative control) or "varlen" (positions only, flash-attention)."""
    import torch

    from trl_nrollout.passes.padfree import pack_rows

    if layout == "padded":
        return _padded_inputs(ps, cs)
    attn = model.config._attn_implementation
    mask_dtype = None if layout in ("varlen", "packed_nomask") else (model.dtype if attn == "eager" else torch.bool)
    pk = pack_rows(ps, cs, pad_token_id=0, mask_dtype=mask_dtype)
    return pk.input_ids, pk.attention_mask, pk.position_ids, pk.index, pk.valid


def _equality_samples(device: str, size: dict):
    """The equality check's samples: prompts of varied lengths, long-tailed completions."""
    cfg = size["padfree"]
    half = cfg["prompt_len"] // 2
    plens = [half + (i * 7) % (half + 1) for i in range(cfg["eq_samples"])]
    clens = _padfree_lengths(cfg["eq_samples"], cfg["eq_cap"], seed=1)
    return _padfree_batch(plens, clens, size["vocab"], device, seed=2)


def _equality(model, device: str, size: dict, attn: str) -> dict:
    """Max abs difference of packed rows' log-probs against the padded layout's under ``attn`` (float32; bf16 for
    flash-attention); for SDPA also the packed rows without their mask (``extra``: the negative control)."""
    import torch

    ps, cs = _equality_samples(device, size)
    dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
    m = model.to(dtype)
    m.set_attn_implementation(attn)
    with torch.no_grad():
        ref = _scored_logprobs(m, *_layout(m, ps, cs, "padded"))
        got = _scored_logprobs(m, *_layout(m, ps, cs, "varlen" if attn.startswith("flash") else "packed"))
        valid = _padded_inputs(ps, cs)[4]
        res = {"dtype": str(dtype).replace("torch.", ""), "max_abs_diff": float((got - ref).abs()[valid].max()),
               "finite": bool(torch.isfinite(got[valid]).all()), "tokens": int(valid.sum())}
        if attn == "sdpa":
            control = _scored_logprobs(m, *_layout(m, ps, cs, "packed_nomask"))
            res["extra"] = {"sdpa_without_mask_max_abs_diff": float((control - ref).abs()[valid].max())}
    return res


def _equality_in_child(device: str, attn: str, timeout: int = 150) -> dict:
    """:func:`_equality` of ``attn`` in a child process (``--equality-child``): its result, or ``{"error": ...}``
    naming how the child ended (a crash of the attention's kernels, a refusal, a timeout)."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--equality-child", attn]
    if not device.startswith("cuda"):
        cmd.append("--dry-run")
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"error": f"child exit {run.returncode}: {(run.stderr or run.stdout).strip()[-300:]}"}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _speed(section: str, cfg: dict, vocab: int, device: str, model, layouts: list[str], time_layout) -> dict:
    """Forward + backward seconds per real token of each of ``layouts`` (``time_layout(prompts, completions,
    layout)``: seconds of one), long-tailed completions (exponential of mean cap / 4, clipped) against uniform ones
    of the same real tokens and the same prompts, the best of ``cfg["repeats"]`` after a warm-up; an out-of-memory
    layout is reported as such and the others still run."""
    import torch

    n = cfg["speed_samples"]
    prompt_lens = [cfg["prompt_len"]] * n
    tailed = _padfree_lengths(n, cfg["cap"], seed=3)
    total = sum(tailed)
    uniform = [total // n + (1 if i < total % n else 0) for i in range(n)]  # the same real tokens
    speed: dict = {"samples": n, "real_tokens": sum(prompt_lens) + total, "tailed_max": max(tailed),
                   "tailed_mean": total / n, "uniform": uniform[0]}
    for layout in layouts:
        row: dict = {}
        try:
            for name, lens in (("uniform", uniform), ("tailed", tailed)):
                ps, cs = _padfree_batch(prompt_lens, lens, vocab, device, seed=4)
                times = [time_layout(ps, cs, layout) for _ in range(cfg["repeats"] + 1)][1:]  # the first warms up
                row[f"{name}_s_per_token"] = min(times) / speed["real_tokens"]
            row["tailed_over_uniform"] = row["tailed_s_per_token"] / row["uniform_s_per_token"]
        except torch.OutOfMemoryError as err:
            row["error"] = f"OutOfMemoryError: {str(err)[:200]}"
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        speed[layout] = row
        print(f"[gpu_check] {section}: speed {layout}: {row}", flush=True)
    return speed


def check_padding_free(device: str, size: dict) -> dict:
    """Padding-free rows (:func:`~trl_nrollout.passes.padfree.pack_rows`) on the device (issue 45), on a decoder of
    ``size["padfree"]`` (about 0.8B parameters on the GPU, random weights):

    a. ``equality``: per-token log-probs of packed rows against the padded layout, float32 weights (bf16 for
       flash-attention, which has no float32 kernels), per attention implementation: SDPA (bool block mask), eager
       (additive), flash_attention_2 (positions only) and flex_attention (bool block mask) where they load; the
       negative control: SDPA on the packed rows without their mask.
    b. ``speed``: forward + backward seconds per real token, bf16, long-tailed completion lengths (exponential of
       mean cap / 4 clipped to the cap) against uniform ones of the same real tokens and the same prompts, per layout
       (padded, packed + SDPA mask, flash varlen where available); goal: long-tailed / uniform <= 1.15 padding-free.
    c. ``memory``: peak CUDA memory of one forward + backward of a token budget of short samples against the same
       budget with one sample at the cap in place of short ones; goal: ratio <= 1.10 for packed rows (padded for
       contrast). None on the CPU."""
    import importlib.util

    import torch

    from trl_nrollout.passes.padfree import pack_rows

    cfg = size["padfree"]
    cuda = device.startswith("cuda")
    with torch.device(device):
        model = _model(size["vocab"], cfg["hidden"], cfg["layers"], seed=11)
    model = model.to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"status": "ok", "params": params, "sizes": cfg}
    print(f"[gpu_check] padding_free: model of {params / 1e6:.0f}M parameters on {device}", flush=True)

    # ---- a. equality (float32; flash in bf16); flex_attention in a child process (its CPU path crashed the
    # process here: malloc(): unaligned tcache chunk), so that a crash is reported, not the end of the report
    impls = {"sdpa": True, "eager": True, "flex_attention": True,
             "flash_attention_2": cuda and importlib.util.find_spec("flash_attn") is not None}
    equality, unavailable = {}, {}
    for attn, possible in impls.items():
        if not possible:
            unavailable[attn] = "no CUDA device" if not cuda else "the flash_attn package is not installed"
        elif attn == "flex_attention":
            got = _equality_in_child(device, attn)
            (equality if "max_abs_diff" in got else unavailable)[attn] = got.get("error", got)
        else:
            try:
                got = _equality(model, device, size, attn)
                out.update(got.pop("extra", {}))
                equality[attn] = got
            except Exception as err:  # noqa: BLE001 - an implementation transformers or torch refuses here
                unavailable[attn] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"[gpu_check] padding_free: equality {attn}: {equality.get(attn, unavailable.get(attn))}", flush=True)
    model.to(torch.float32).set_attn_implementation("sdpa")
    out["equality"], out["unavailable"] = equality, unavailable

    # ---- b. speed (bf16, forward + backward)
    model = model.to(torch.bfloat16).train()
    model.gradient_checkpointing_disable()
    varlen = "flash_attention_2" in equality

    def step(ps, cs, layout: str) -> float:
        m_attn = "flash_attention_2" if layout == "varlen" else "sdpa"
        model.set_attn_implementation(m_attn)
        args = _layout(model, ps, cs, layout)
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        lp = _scored_logprobs(model, *args)
        (-lp.sum() / args[4].sum()).backward()
        _sync(device)
        return time.perf_counter() - start

    def budgeted(ps, cs) -> float:
        """The update's cut: micro batches of at most ``speed_budget`` real tokens (neighbouring lengths,
        :func:`budgeted_parts`), each packed where the trainer's rule says it pays, else padded."""
        from trl_nrollout.passes.padfree import budget_count, budgeted_parts, padfree_fits

        lengths = [p.numel() + c.numel() for p, c in zip(ps, cs)]
        budget = max(cfg.get("speed_budget", 4096), max(lengths))
        total = 0.0
        for idx in budgeted_parts(lengths, budget, budget_count(lengths, budget), cfg["hidden"]):
            sub = [lengths[i] for i in idx]
            how = "packed" if len(idx) > 1 and padfree_fits(sub, max(sub), torch.bool, torch.bfloat16) else "padded"
            total += step([ps[i] for i in idx], [cs[i] for i in idx], how)
        return total

    layouts = ["padded", "packed", "budgeted"] + (["varlen"] if varlen else [])
    speed = _speed("padding_free", cfg, size["vocab"], device, model, layouts,
                   lambda ps, cs, layout: budgeted(ps, cs) if layout == "budgeted" else step(ps, cs, layout))
    speed["goal_packed_ok"] = speed["packed"].get("tailed_over_uniform", math.inf) <= 1.15
    out["speed"] = speed

    # ---- c. memory (one forward + backward at a token budget)
    short = cfg["short_len"]
    count = cfg["budget"] // (cfg["prompt_len"] + short)
    long_total = cfg["prompt_len"] + cfg["cap"]
    replaced = -(-long_total // (cfg["prompt_len"] + short))  # short samples the long one replaces
    cases = {"short": [short] * count, "one_long": [cfg["cap"]] + [short] * (count - replaced)}
    memory: dict = {"budget": cfg["budget"], "short_samples": count, "replaced": replaced,
                    "real_tokens": {k: len(v) * cfg["prompt_len"] + sum(v) for k, v in cases.items()}}
    for layout in ("packed", "padded"):
        row = {}
        for name, lens in cases.items():
            ps, cs = _padfree_batch([cfg["prompt_len"]] * len(lens), lens, size["vocab"], device, seed=5)
            slots = len(lens) * (cfg["prompt_len"] + max(lens))
            if layout == "padded" and slots > 4 * cfg["budget"]:  # ~1.4 MB of activations a slot at 0.8B: no OOM
                row[f"{name}_skipped"] = f"{slots} padded slots > 4 x the budget"
                row[f"{name}_slots"] = slots
                continue
            try:
                step(ps, cs, layout)  # warm (the allocator's caches, kernels' workspaces)
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                step(ps, cs, layout)
                row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
            except torch.OutOfMemoryError as err:
                row[f"{name}_error"] = f"OutOfMemoryError: {str(err)[:200]}"
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            if layout == "packed":
                row[f"{name}_slots"] = pack_rows(ps, cs, pad_token_id=0, mask_dtype=None).token_slots
            else:
                row[f"{name}_slots"] = slots
        if row.get("short_peak_mib") and row.get("one_long_peak_mib"):
            row["one_long_over_short"] = row["one_long_peak_mib"] / row["short_peak_mib"]
        memory[layout] = row
        print(f"[gpu_check] padding_free: memory {layout}: {row}", flush=True)
    memory["goal_packed_ok"] = (memory["packed"].get("one_long_over_short", 0.0) <= 1.10) if cuda else None
    out["memory"] = memory
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("sdpa")

    tol = cfg["tolerance"]
    exact = all(v["finite"] and v["max_abs_diff"] <= (tol * 10 if v["dtype"] == "bfloat16" else tol)
                for v in equality.values())
    control = out.get("sdpa_without_mask_max_abs_diff", 0.0) > 10 * tol
    out["status"] = "ok" if exact and control and "sdpa" in equality and "eager" in equality else "failed"
    return out


def check_varlen(device: str, size: dict) -> dict:
    """Varlen attention for padding-free rows (:mod:`trl_nrollout.passes.varlen`), the layout the trainer runs for an
    SDPA model on CUDA in half precision (PyTorch's own flash-attention varlen kernel, no flash-attn package), on a
    decoder of ``size["padfree"]``:

    a. ``equality``: per-token log-probs of varlen rows (one row, no mask) against the padded layout and against
       block-masked rows, bf16; the same in float32 (one SDPA per sequence); whether PyTorch's kernel ran.
    b. ``gradient``: one forward + backward of varlen rows against the padded layout's: relative difference of the
       gradients (bf16).
    c. ``speed``: forward + backward seconds per real token, long-tailed completions (exponential of mean cap / 4,
       clipped) over uniform ones of the same real tokens: padded, block-masked rows, varlen rows; goal <= 1.15.
    d. ``memory``: peak memory of a token budget of short samples against the same budget with one sample at the
       cap: varlen rows; goal <= 1.10."""
    import torch

    import trl_nrollout.passes.varlen as varlen_module
    from trl_nrollout.passes.padfree import pack_rows
    from trl_nrollout.passes.varlen import VARLEN_NAME, register, varlen_kwargs

    register()
    cfg = size["padfree"]
    cuda = device.startswith("cuda")
    with torch.device(device):
        model = _model(size["vocab"], cfg["hidden"], cfg["layers"], seed=11)
    model = model.to(device).eval()
    out: dict = {"status": "ok", "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
                 "kernel_here": varlen_module.torch_varlen_runs(device.split(":")[0], torch.bfloat16)}
    calls = []
    real = varlen_module._flash_varlen
    varlen_module._flash_varlen = lambda *a, **kw: calls.append(1) or real(*a, **kw)

    def rows(ps, cs, how: str):
        """(forward kwargs, index, valid) of samples laid out ``how``: padded, mask (block mask) or varlen."""
        if how == "padded":
            ids, am, pos, index, valid = _padded_inputs(ps, cs)
            return ids, {"attention_mask": am, "position_ids": pos}, index, valid
        pk = pack_rows(ps, cs, pad_token_id=0, mask_dtype=None if how == "varlen" else torch.bool)
        kw = ({"position_ids": pk.position_ids, **varlen_kwargs(pk.position_ids)} if how == "varlen"
              else {"attention_mask": pk.attention_mask, "position_ids": pk.position_ids})
        return pk.input_ids, kw, pk.index, pk.valid

    def scored(ids, kw, index, valid):
        model.config._attn_implementation = VARLEN_NAME if "cu_seq_lens_q" in kw else "sdpa"
        hidden = model.model(input_ids=ids, **kw).last_hidden_state
        flat = ids.reshape(-1)
        labels = flat[(index + 1).clamp(max=flat.numel() - 1)]
        logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1])[index[valid]]).float()
        lp = torch.zeros(index.shape, dtype=torch.float32, device=ids.device)
        lp[valid] = logits.log_softmax(-1).gather(-1, labels[valid][:, None])[:, 0]
        return lp

    # ---- a. equality
    ps, cs = _equality_samples(device, size)
    valid = _padded_inputs(ps, cs)[4]
    equality = {}
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        calls.clear()
        with torch.no_grad():
            ref = scored(*rows(ps, cs, "padded"))
            masked = scored(*rows(ps, cs, "mask"))
            got = scored(*rows(ps, cs, "varlen"))
        name = str(dtype).replace("torch.", "")
        equality[name] = {"varlen_vs_padded": float((got - ref).abs()[valid].max()),
                          "mask_vs_padded": float((masked - ref).abs()[valid].max()),
                          "varlen_vs_mask": float((got - masked).abs()[valid].max()),
                          "finite": bool(torch.isfinite(got[valid]).all()), "torch_kernel_calls": len(calls)}
        print(f"[gpu_check] varlen: equality {name}: {equality[name]}", flush=True)
    out["equality"] = equality

    # ---- b. gradient (bf16)
    try:
        model.to(torch.bfloat16).train()
        grads = {}
        for how in ("padded", "varlen"):
            model.zero_grad(set_to_none=True)
            ids, kw, index, v = rows(ps, cs, how)
            (-scored(ids, kw, index, v).sum() / v.sum()).backward()
            grads[how] = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
        num = sum(float((a - b).norm() ** 2) for a, b in zip(grads["varlen"], grads["padded"])) ** 0.5
        den = sum(float(b.norm() ** 2) for b in grads["padded"]) ** 0.5
        out["gradient"] = {"relative_diff": num / max(den, 1e-30), "tensors": len(grads["padded"])}
        print(f"[gpu_check] varlen: gradient {out['gradient']}", flush=True)
        del grads
    except Exception as err:  # noqa: BLE001 - a kernel without backward, OOM...: said, the rest runs
        out["gradient"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        model.zero_grad(set_to_none=True)

    # ---- c. speed
    try:
        def step(ps, cs, how: str) -> float:
            ids, kw, index, v = rows(ps, cs, how)
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            (-scored(ids, kw, index, v).sum() / v.sum()).backward()
            _sync(device)
            return time.perf_counter() - start

        speed = _speed("varlen", cfg, size["vocab"], device, model, ["padded", "mask", "varlen"], step)
        if "tailed_s_per_token" in speed["varlen"] and "tailed_s_per_token" in speed["padded"]:
            speed["varlen_over_padded_tailed"] = speed["varlen"]["tailed_s_per_token"] / speed["padded"]["tailed_s_per_token"]
        if "tailed_s_per_token" in speed["varlen"] and "tailed_s_per_token" in speed["mask"]:
            speed["varlen_over_mask_tailed"] = speed["varlen"]["tailed_s_per_token"] / speed["mask"]["tailed_s_per_token"]
        speed["goal_ok"] = speed["varlen"].get("tailed_over_uniform", math.inf) <= 1.15
        out["speed"] = speed
    except Exception as err:  # noqa: BLE001 - a kernel without backward, OOM...: said, the rest runs
        out["speed"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        model.zero_grad(set_to_none=True)

    # ---- d. memory (varlen rows at a token budget)
    try:
        short = cfg["short_len"]
        count = cfg["budget"] // (cfg["prompt_len"] + short)
        replaced = -(-(cfg["prompt_len"] + cfg["cap"]) // (cfg["prompt_len"] + short))
        memory: dict = {"budget": cfg["budget"]}
        for name, lens in (("short", [short] * count), ("one_long", [cfg["cap"]] + [short] * (count - replaced))):
            ps2, cs2 = _padfree_batch([cfg["prompt_len"]] * len(lens), lens, size["vocab"], device, seed=5)
            step(ps2, cs2, "varlen")
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            step(ps2, cs2, "varlen")
            memory[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
        if memory.get("short_peak_mib"):
            memory["one_long_over_short"] = memory["one_long_peak_mib"] / memory["short_peak_mib"]
        out["memory"] = memory
        print(f"[gpu_check] varlen: memory {memory}", flush=True)
    except Exception as err:  # noqa: BLE001 - a kernel without backward, OOM...: said, the rest runs
        out["memory"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        model.zero_grad(set_to_none=True)

    varlen_module._flash_varlen = real
    model.config._attn_implementation = "sdpa"
    model.zero_grad(set_to_none=True)

    tol = cfg["tolerance"]
    fp32 = equality["float32"]["varlen_vs_padded"] <= tol
    bf16_eq = equality["bfloat16"]
    bf16 = bf16_eq["finite"] and bf16_eq["varlen_vs_padded"] <= max(2 * bf16_eq["mask_vs_padded"], 10 * tol)
    kernel = (equality["bfloat16"]["torch_kernel_calls"] > 0) == out["kernel_here"]
    grad_ok = out["gradient"].get("relative_diff", math.inf) < 0.05
    out["status"] = "ok" if fp32 and bf16 and kernel and grad_ok else "failed"
    return out


SIZES = {
    "gpu": dict(vocab=32768, hidden=512, layers=4, prompts=16, prompt_len=256, completion_len=512, micro=8,
                rates=dict(hidden=2048, layers=16, rows=16, long=2048),
                padfree=dict(hidden=2048, layers=16, prompt_len=128, eq_samples=8, eq_cap=256, cap=2048,
                             speed_samples=16, repeats=2, budget=16384, short_len=128, tolerance=2e-3)),
    "dry": dict(vocab=2048, hidden=64, layers=2, prompts=4, prompt_len=16, completion_len=24, micro=4,
                rates=dict(hidden=64, layers=2, rows=1, long=256),
                padfree=dict(hidden=64, layers=2, prompt_len=8, eq_samples=8, eq_cap=48, cap=64,
                             speed_samples=6, repeats=1, budget=256, short_len=8, tolerance=2e-3)),
}


def check_training_rates(device: str, size: dict) -> dict:
    """Section 7: this device's training rates for the cost model (see the module docstring)."""
    import dataclasses

    import torch

    from trl_nrollout.plan.devices import PROFILES
    from trl_nrollout.plan.dims import ModelDims
    from trl_nrollout.plan.measure import bf16_supported, measure_flops, measure_mem_bw, measure_training

    r = size["rates"]
    model = _model(size["vocab"], r["hidden"], r["layers"]).train()
    dtype = torch.bfloat16 if bf16_supported(device) else torch.float32  # as plan --calibrate measures
    model = model.to(device=device, dtype=dtype)
    dims = ModelDims.from_config_dict(model.config.to_dict(), dtype=str(model.dtype))
    # every clock read after a synchronize of the device (calibrate.synchronize): the optimizer step's kernels too
    flops, mem_bw = measure_flops(device, dtype=dtype), measure_mem_bw(device)
    rates = measure_training(model, dims, flops, device, rows=r["rows"], long=r["long"], vocab=size["vocab"])
    name = torch.cuda.get_device_name(0).lower() if device == "cuda" else "cpu"
    kind = next((k for k in ("h200", "h100", "l40s") if k in name), None) or (
        ("a100-40gb" if "40gb" in name else "a100-80gb") if "a100" in name else None)
    named = PROFILES.get(kind) if kind else None
    profile = dataclasses.replace(named, name=f"{kind}-calibrated", flops=flops, mem_bw=mem_bw,
                                  mfu_train=rates["mfu_train"], mfu_attention=rates["mfu_attention"],
                                  forward_s=rates["forward_s"], optimizer_bw=rates["optimizer_bw"],
                                  source=f"gpu_check.py training_rates on {name}: flops, mem_bw and the training "
                                         f"rates measured; the rest {kind}'s defaults") if named else None
    finite = all(math.isfinite(v) and v > 0 for k, v in rates.items() if k != "forward_s")
    return {"status": "ok" if finite and 0 < rates["mfu_train"] <= 1 else "failed", "params": dims.num_parameters,
            "flops": flops, "mem_bw": mem_bw, **rates,
            "named_profile": None if named is None else {"name": named.name, "flops": named.flops,
                                                         "mem_bw": named.mem_bw, "mfu_train": named.mfu_train,
                                                         "mfu_attention": named.attention_mfu},
            "profile": None if profile is None else profile.to_dict()}


def check_passes_autocast(device: str, size: dict) -> dict:
    """The old-policy pass as the trainer runs it with bf16=True over float32 weights (under the trainer's autocast)
    against the update's own forward under the same autocast (the model's forward, log-softmax of its logits), and
    the same pass outside autocast (what it was before: float32 against a bf16 update)."""
    import torch

    from trl_nrollout.passes.logprobs import compute_log_probs

    kind = device.split(":")[0]
    model = _model(size["vocab"], size["hidden"], size["layers"]).to(device)
    ps, cs = _samples(size["prompts"], 4, size["vocab"], size["prompt_len"], size["completion_len"] // 4, seed=5)
    pid, pm, cid, cm = _padded(ps, cs, device)
    with torch.no_grad(), torch.autocast(device_type=kind, dtype=torch.bfloat16):
        passed = compute_log_probs(model, ps, cs, micro_batch_size=size["micro"]).logprobs
        ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm.long()], 1)
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        update = logits[:, pid.shape[1] - 1:-1].float().log_softmax(-1).gather(-1, cid[..., None])[..., 0]
    with torch.no_grad():
        fp32 = compute_log_probs(model, ps, cs, micro_batch_size=size["micro"]).logprobs
    real = cm.bool()
    width = real.shape[1]
    inside = float((passed[:, :width] - update).abs()[real].max())
    outside = float((fp32[:, :width] - update).abs()[real].max())
    return {"status": "ok" if inside <= outside else "failed", "tokens": int(real.sum()),
            "autocast_pass_vs_update_max_abs": inside, "fp32_pass_vs_update_max_abs": outside}


def check_prefill_once(device: str, size: dict) -> dict:
    """The HF engine's prefill-once on the device: long prompts' KV caches computed once for their n samples give
    the samples and log-probs of n copies (TRL's way), in less time."""
    import torch

    from trl_nrollout.rollout.engines import hf_engine
    from trl_nrollout.rollout.types import SamplingOptions

    model = _model(size["vocab"], size["hidden"], size["layers"]).to(device).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    length = max(size["prompt_len"] * 2, hf_engine.PREFILL_ONCE_MIN_TOKENS)  # long enough to be prefilled once
    prompts = [torch.randint(3, size["vocab"], (length,), generator=g).tolist()
               for _ in range(max(2, size["prompts"] // 4))]
    engine = hf_engine.HFEngine(model, pad_token_id=0, eos_token_ids=[1], batch_size=len(prompts))
    opts = SamplingOptions(max_tokens=16, temperature=1.0, seed=4, ignore_eos=True)
    runs, seconds = {}, {}
    minimum = hf_engine.PREFILL_ONCE_MIN_TOKENS
    for name, threshold in (("once", minimum), ("copies", 10**9)):
        hf_engine.PREFILL_ONCE_MIN_TOKENS = threshold
        try:
            start = time.perf_counter()
            runs[name] = engine.generate(prompts, 8, opts)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - start
        finally:
            hf_engine.PREFILL_ONCE_MIN_TOKENS = minimum
    same = runs["once"].completion_ids == runs["copies"].completion_ids
    gap = max(abs(a - b) for r1, r2 in zip(runs["once"].logprobs, runs["copies"].logprobs) for a, b in zip(r1, r2))
    return {"status": "ok" if same and gap < 0.05 else "failed", "same_samples": same, "logprob_max_abs": gap,
            "seconds_once": seconds["once"], "seconds_copies": seconds["copies"],
            "shared_samples": engine.prefill_shared_samples}


#: Each section, what it imports beyond the standard library, and its function. A GPU machine lent without TRL
#: (torch and transformers only) runs every section whose needs are met and reports the others as skipped.
SECTIONS = (
    ("logprob_precision", ("torch", "transformers"), check_precision),
    ("logprob_memory", ("torch", "transformers"), check_memory),
    ("packing", ("torch", "transformers"), check_packing),
    ("passes_autocast", ("torch", "transformers"), check_passes_autocast),
    ("prefill_once", ("torch", "transformers"), check_prefill_once),
    ("trainer", ("torch", "transformers", "trl", "datasets", "accelerate"), lambda device, size: check_trainer(device, 3)),
    ("training_rates", ("torch", "transformers"), check_training_rates),
    ("padding_free", ("torch", "transformers"), check_padding_free),
    ("varlen", ("torch", "transformers"), check_varlen),
    # issue 62's GPU paths, one module each under scripts/gpu_sections/
    ("sp_nccl", ("torch", "transformers"), lambda device, size: _section("sp_nccl", "check_sp_nccl")(device)),
    ("budgets", ("torch", "transformers"), lambda device, size: _section("budgets", "check_budgets")(device)),
    ("tied_head", ("torch", "transformers", "peft"), lambda device, size: _section("tied_head", "check_tied_head")(device)),
    # engines and launches (--no-launches skips them): each in child processes of its own
    ("lora_vllm", ("torch", "transformers", "trl", "vllm", "peft", "datasets", "accelerate"),
     lambda device, size: _child_section("lora_vllm", device)),
    ("rollout_rank", ("torch", "transformers", "trl", "vllm", "datasets", "accelerate"),
     lambda device, size: _section("rollout_rank", "check_rollout_rank")(device)),
    ("sharded_budgets", ("torch", "transformers", "trl", "deepspeed", "datasets", "accelerate"),
     lambda device, size: _section("sharded_budgets", "check_sharded_budgets")(device)),
)
#: the sections that start engines or launches (``--no-launches`` skips them)
LAUNCHES = ("lora_vllm", "rollout_rank", "sharded_budgets")


def _section(module: str, name: str):
    """``scripts/gpu_sections/<module>.py``'s check function, loaded by path (the folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gpu_sections_{module}", ROOT / "scripts/gpu_sections" / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _child_section(module: str, device: str, timeout: float = 420) -> dict:
    """``scripts/gpu_sections/<module>.py`` run in a child process (an engine of its own, away from the memory the
    other sections hold): the JSON it writes."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "section.json")
        cmd = [sys.executable, str(ROOT / "scripts/gpu_sections" / f"{module}.py"), "--json", str(path)]
        proc = subprocess.run(cmd + ([] if device.startswith("cuda") else ["--dry-run"]), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        if not path.is_file():
            return {"status": "failed", "error": f"the child exited with {proc.returncode} and wrote nothing",
                    "logs": proc.stdout[-1000:] + proc.stderr[-2500:]}
        return json.loads(path.read_text())


def table(report: dict) -> str:
    """The pass/fail table of a report: one line per section, its status, seconds and, for a failure, the error."""
    rows = [(k, v) for k, v in report.items() if isinstance(v, dict) and "status" in v]
    width = max((len(k) for k, _ in rows), default=7)
    lines = [f"{'section'.ljust(width)}  status   seconds  note", "-" * (width + 40)]
    for k, v in rows:
        note = v.get("error", "") or (f"needs {', '.join(v['missing'])}" if v.get("missing") else "")
        lines.append(f"{k.ljust(width)}  {v['status'].upper():<7}  {v.get('seconds', 0.0):7.1f}  {note[:100]}")
    failed = sum(v["status"] == "failed" for _, v in rows)
    lines.append(f"{len(rows) - failed} of {len(rows)} sections passed or skipped; {failed} failed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import importlib.util

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at small sizes (no GPU needed)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--only", nargs="*", help="run these sections only")
    parser.add_argument("--no-launches", action="store_true", help=f"skip {', '.join(LAUNCHES)} (engines, launches)")
    parser.add_argument("--equality-child", help=argparse.SUPPRESS)  # padding_free's equality of one attention
    args = parser.parse_args(argv)
    import torch

    if args.equality_child:
        device = "cpu" if args.dry_run else "cuda"
        size = SIZES["dry" if args.dry_run else "gpu"]
        with torch.device(device):
            model = _model(size["vocab"], size["padfree"]["hidden"], size["padfree"]["layers"], seed=11)
        try:
            got = _equality(model.eval(), device, size, args.equality_child)
        except Exception as err:  # noqa: BLE001 - the parent reports it
            got = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        got.pop("extra", None)
        print(json.dumps(got), flush=True)
        return 0

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run to exercise the script on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    size = SIZES["dry" if args.dry_run else "gpu"]
    report: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
                    "torch": torch.__version__, "dry_run": args.dry_run}
    for name, needs, fn in SECTIONS:
        if args.only and name not in args.only:
            continue
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if args.no_launches and name in LAUNCHES:
            report[name] = {"status": "skipped", "missing": ["--no-launches"], "seconds": 0.0}
            continue
        if missing:
            report[name] = {"status": "skipped", "missing": missing, "seconds": 0.0}
            print(f"[gpu_check] {name}: skipped (needs {', '.join(missing)})", flush=True)
            continue
        start = time.perf_counter()
        try:
            report[name] = fn(device, size)
        except Exception as err:  # noqa: BLE001 - report every section
            report[name] = {"status": "failed", "error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = time.perf_counter() - start
        print(f"[gpu_check] {name}: {report[name]['status']} ({report[name]['seconds']:.1f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items()}, indent=2, default=str)[:6000])
    print(table(report), flush=True)
    ran = [v for v in report.values() if isinstance(v, dict) and "status" in v]
    return 0 if all(v["status"] in ("ok", "skipped") for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
