"""``trl-nrollout plan --calibrate``: measure this machine's :class:`~trl_nrollout.plan.devices.DeviceProfile`.

Short micro-benchmarks, each the median of a few repeats:

- ``flops``: a float32 (CPU) or bfloat16 (CUDA) matmul of 2048 x 2048 matrices;
- ``mem_bw``: a copy of a 256 MiB tensor (bytes read + written per second);
- the engine's costs, on a real vLLM engine of the given model (one process): decode steps at 1, 32 and 128 running
  sequences (``ignore_eos``, two completion lengths each, so the call's fixed cost cancels) give ``step_s`` and
  ``seq_step_s`` beyond the roofline of those steps (a least-squares line); a call with no decode gives ``call_s``; a prefill of 16
  prompts of 256 tokens gives ``mfu_prefill``;
- training steps (forward and backward of a language-model loss, rows padded as the trainer's are) at three
  shapes give ``forward_s`` (the fixed part), ``mfu_train`` (per token: 2 x 64 against 4 x 256) and
  ``mfu_attention`` (per query-key pair: 4 x 256 against 1 x 1,024, the same tokens); an AdamW step over the
  model gives ``optimizer_bw``;
- a weight sync into the engine gives ``sync_s`` beyond the bytes at ``mem_bw``;
- the same rollout (16 prompts x 8 samples x 40 tokens) on an engine serving a rank-16 LoRA adapter on every linear
  layer (vLLM's LoRA kernels) against the merged engine gives ``lora_gen_slowdown`` (``rollout_lora_sync="auto"``
  prices it against the sync the adapter saves);
- three short GRPO runs of the model (n = 4 and 12 at the task's short prompts, n = 8 at 256-token prompts) give
  what the trainer adds around the engine and the model, per sample, per token and per step (``gen_sample_s``,
  ``train_token_s``, ``train_fixed_s``, more ``call_s``), and correct ``mfu_attention`` and ``sync_s``.

``link_bw`` is not measured (one process): a quarter of ``mem_bw`` is assumed, and said in ``source``.

The measurements that need only torch are in :mod:`trl_nrollout.plan.measure`; this module builds the real engine
and trainer around them, so it sits above ``trainer`` (``plan`` imports no engine and no trainer).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.measure import (
    _median_time,
    bf16_supported,
    measure_flops,
    measure_mem_bw,
    measure_training,
    trainer_device_args,
)


def calibrate(model: str, *, name: str = "local", progress: Callable[[str], None] = print,
              trainer_runs: bool = True, lora_r: int | None = 16) -> DeviceProfile:
    """Measure this machine with ``model`` (a ``builtin:`` name, local folder or hub id) and return its profile;
    ``trainer_runs``: also what our trainer adds around the engine and the model (three short training runs);
    ``lora_r``: also the generation slowdown of an engine serving a rank-``lora_r`` adapter (None: not measured,
    the profile keeps the assumed figure)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.plan.cost import decode_step_s
    from trl_nrollout.plan.dims import ModelDims
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.plan.memory import load_config_dict
    from trl_nrollout.rollout.engines.build import VLLMEngineSettings, build_engine
    from trl_nrollout.rollout.types import SamplingOptions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if bf16_supported(device) else torch.float32  # as the trainer runs (trainer_device_args)
    progress("calibrate 1/6: matmul")
    flops = measure_flops(device, dtype=dtype)
    progress(f"  {flops / 1e9:.1f} GFLOP/s")
    progress("calibrate 2/6: memory copy")
    mem_bw = measure_mem_bw(device)
    progress(f"  {mem_bw / 1e9:.1f} GB/s")
    path = resolve_model(model)
    config, _ = load_config_dict(path)
    dims = ModelDims.from_config_dict(config, dtype=str(dtype).removeprefix("torch."), name=model)
    progress("calibrate 3/6: engine decode steps")
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=16, rollout_n=8)
    engine = build_engine(VLLMEngineSettings(path, layout, rank=0, max_model_len=512, seed=0))

    calls = iter(range(1 << 30))

    def call(prompts: int, n: int, tokens: int, prompt_len: int = 8) -> float:
        options = SamplingOptions(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True)

        def run():  # new prompts every run: vLLM's prefix cache would skip a repeated prompt's prefill
            c = next(calls)
            ids = [[5 + (c * 131 + p * 7 + k * 3) % 90 for k in range(prompt_len)] for p in range(prompts)]
            engine.generate_engine(ids, n, options)

        return _median_time(run, repeats=3)

    matmul = dims.matmul_params

    # prefill first (a call of one step less its fixed cost), then decode beyond the same roofline as the model's
    call_one = call(1, 1, 1)
    prefill_t = max(call(16, 1, 1, prompt_len=256) - call_one, 1e-6)
    mfu_prefill = min(1.0, 16 * 256 * (2 * matmul + dims.attention_flops(128)) / flops / prefill_t)

    bare = DeviceProfile(name=name, flops=flops, mem_bw=mem_bw, link_bw=mem_bw / 4, memory_gib=1.0,
                         mfu_prefill=mfu_prefill, bw_eff=1.0)

    def roof(running: int, context: float) -> float:
        return decode_step_s(dims, running, context, 1, bare)[0]

    per_step = {}
    for running, (prompts, n) in ((1, (1, 1)), (32, (4, 8)), (128, (16, 8))):
        short, long = call(prompts, n, 8), call(prompts, n, 40)
        per_step[running] = max((long - short) / 32 - roof(running, 8 + 24), 0.0)
        progress(f"  {running} running: {(long - short) / 32 * 1e3:.2f} ms per step")
    # least squares of step_s + seq_step_s x running over the three points
    xs, ys = list(per_step), list(per_step.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    seq_step_s = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
    step_s = max(my - seq_step_s * mx, 0.0)
    call_s = max(call_one - step_s - seq_step_s - roof(1, 8), 0.0)
    progress("calibrate 4/6: weight sync")
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    sync_t = _median_time(lambda: engine.load_weights(policy), repeats=3)
    sync_s = max(sync_t - dims.num_parameters * dims.dtype_bytes / (mem_bw / 2), 0.0)
    rollout = (16, 8, 40)  # prompts, n, new tokens: the rollout both engines run for the LoRA slowdown
    merged_t = call(*rollout) if lora_r is not None else 0.0
    engine.close()
    lora_figures = {}
    if lora_r is not None:
        progress(f"calibrate 4b/6: an engine serving a rank-{lora_r} LoRA adapter")
        lora_figures = _lora_slowdown(path, policy, layout, lora_r, merged_t, rollout)
        progress(f"  {lora_figures['lora_gen_slowdown']:.2f}x the merged engine's rollout")
    progress("calibrate 5/6: training steps and an optimizer step")
    policy.to(device)

    long = min(1024, int(config.get("max_position_embeddings") or 1024))
    rates = measure_training(policy, dims, flops, device, long=long)
    mfu_train, mfu_attention = rates["mfu_train"], rates["mfu_attention"]
    forward_s, optimizer_bw = rates["forward_s"], rates["optimizer_bw"]
    memory_gib = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    from trl_nrollout.passes.varlen import torch_varlen_runs

    profile = DeviceProfile(
        name=name, flops=flops, mem_bw=mem_bw, link_bw=mem_bw / 4, memory_gib=memory_gib, mfu_prefill=mfu_prefill,
        mfu_train=mfu_train, mfu_attention=mfu_attention, bw_eff=1.0, link_eff=1.0, step_s=step_s, seq_step_s=seq_step_s, call_s=call_s,
        forward_s=forward_s, sync_s=sync_s, allreduce_s=5e-5, optimizer_bw=optimizer_bw,
        varlen_attention=torch_varlen_runs(device, dtype), **lora_figures,  # CUDA >= 8.0, half precision
        source=f"calibrated on this machine ({device}, {os.cpu_count()} CPUs, torch threads "
               f"{torch.get_num_threads()}) with {model} at {time.strftime('%Y-%m-%d %H:%M')}; link_bw assumed "
               f"mem_bw / 4 (not measured)")
    progress(f"  step_s {step_s * 1e3:.2f} ms, seq_step_s {seq_step_s * 1e3:.3f} ms, call_s {call_s * 1e3:.1f} ms, "
             f"mfu_prefill {mfu_prefill:.2f}, mfu_train {mfu_train:.2f}, mfu_attention {mfu_attention:.2f}, "
             f"forward_s {forward_s * 1e3:.1f} ms")
    if trainer_runs:
        progress("calibrate 6/6: the trainer around them (three short runs: n = 4 and 12, and n = 8 at 256-token "
                 "prompts)")
        profile = _trainer_residuals(profile, path, dims, progress, device)
    return profile


def _lora_slowdown(path: str, policy, layout, rank: int, merged_t: float, rollout: tuple[int, int, int]) -> dict:
    """``lora_gen_slowdown`` and ``lora_gen_rank``: the same rollout (``rollout``: prompts, n, new tokens; the merged
    engine took ``merged_t`` seconds) on an engine built to serve LoRA adapters of ``rank`` (vLLM's LoRA kernels), with
    a rank-``rank`` adapter on every linear layer of ``policy`` loaded as the trainer's adapter sync loads it (nonzero
    ``B``: the kernels' real work). At least 1 (a faster LoRA run is noise)."""
    from peft import LoraConfig, get_peft_model

    from trl_nrollout.rollout.engines.build import VLLMEngineSettings, build_engine
    from trl_nrollout.rollout.types import SamplingOptions

    trainable = {name: p.requires_grad for name, p in policy.named_parameters()}  # PEFT freezes the base
    peft = get_peft_model(policy, LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear",
                                             init_lora_weights=False, lora_dropout=0.0))
    engine = build_engine(VLLMEngineSettings(path, layout, rank=0, max_model_len=512, seed=0, lora_rank=rank))
    try:
        engine.load_adapter(peft)
        prompts, n, tokens = rollout
        calls = iter(range(1 << 30))

        def run():  # fresh prompts each run, as the merged engine's calls
            c = next(calls) + 7919
            ids = [[5 + (c * 131 + p * 7 + k * 3) % 90 for k in range(8)] for p in range(prompts)]
            engine.generate_engine(ids, n, SamplingOptions(max_tokens=tokens, temperature=1.0, seed=1,
                                                           ignore_eos=True))

        lora_t = _median_time(run, repeats=3)
    finally:
        engine.close()
        peft.unload()
        for name, p in policy.named_parameters():
            p.requires_grad_(trainable[name])
    return {"lora_gen_slowdown": max(1.0, lora_t / merged_t), "lora_gen_rank": rank}


def _trainer_residuals(profile: DeviceProfile, path: str, dims, progress: Callable[[str], None],
                       device: str = "cpu") -> DeviceProfile:
    """What the trainer adds around the engine and the model: three short GRPO runs of ``path`` (8 prompts of the
    built-in ``digits`` task, 32 new tokens, 4 steps, the first a warm-up: n = 4 and 12 with the task's short
    prompts, and n = 8 with 256-token prompts, whose micro batch packs), their ``timing_s/gen`` and
    ``timing_s/update_actor`` against the profile's prediction. The two short runs: the generation's difference per
    sample gives ``gen_sample_s`` (its intercept: more ``call_s``), the update's per token of its forwards (as
    :func:`~trl_nrollout.plan.shapes.pass_shape` lays them out) ``train_token_s`` (its intercept: ``train_fixed_s``).
    The long run: what its update takes beyond those, per query-key pair of attention, lowers (or raises)
    ``mfu_attention`` (the trainer's packed rows: block masks, fresh memory). The weight sync's mean difference is
    added to ``sync_s`` (the trainer gathers and buckets the weights). The runs train on ``device``
    (:func:`trainer_device_args`: the CPU only without an accelerator, bfloat16 where the device has it)."""
    import tempfile
    from dataclasses import replace

    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import digits_dataset, digits_prompts, digits_reward, long_prompts
    from trl_nrollout.config.options import NRolloutConfig
    from trl_nrollout.plan.cost import predict_step
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.plan.shapes import pass_shape
    from trl_nrollout.plan.workload import Workload
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    short = digits_dataset(64)
    long = Dataset.from_dict({"prompt": long_prompts(digits_prompts(64), tok, 256)})
    points, syncs = [], []
    for n, data in ((4, short), (12, short), (8, long)):
        lengths = [len(tok(p)["input_ids"]) for p in data["prompt"]]
        prompt_len = statistics.mean(lengths)
        with tempfile.TemporaryDirectory() as out:
            cfg = NRolloutConfig(output_dir=out, train_batch_size=8, rollout_n=n, max_completion_length=32,
                                 max_steps=4, logging_steps=1, report_to="none", save_strategy="no",
                                 learning_rate=1e-7, disable_tqdm=True, seed=0, log_completions=False,
                                 **trainer_device_args(device, bf16_supported(device)))
            trainer = NRolloutGRPOTrainer(model=path, reward_funcs=[digits_reward], args=cfg, train_dataset=data,
                                          processing_class=tok)
            trainer.train()
            logs = [h for h in trainer.state.log_history if "timing_s/gen" in h][1:]
            trainer.close()
        layout = RolloutLayout.build(num_processes=1, train_batch_size=8, rollout_n=n)
        mean_len = statistics.mean(h["response_length/mean"] for h in logs)
        work = Workload(prompt_len, mean_len, 32, prompt_max=max(lengths))  # rows padded to the longest prompt
        pred = predict_step(dims, layout, work, profile)
        shape = pass_shape(layout.samples_per_rank, layout.ppo_micro_batch_size_per_device, n, work,
                           query_bytes=dims.dtype_bytes)
        gen = statistics.mean(h["timing_s/gen"] for h in logs) - pred.phases["generation"]
        upd = statistics.mean(h["timing_s/update_actor"] for h in logs) - pred.phases["update"]
        syncs.append(statistics.mean(h.get("timing_s/weight_sync", 0.0) for h in logs) - pred.phases["weight_sync"])
        points.append((8 * n, shape.tokens, shape.pairs, gen, upd))
        progress(f"  n={n}, {prompt_len:.0f}-token prompts: generation {gen * 1e3:+.0f} ms, update {upd * 1e3:+.0f} ms "
                 "beyond the prediction")
    (s1, t1, _, g1, u1), (s2, t2, _, g2, u2), (_, t3, p3, _, u3) = points
    gen_slope, upd_slope = max((g2 - g1) / (s2 - s1), 0.0), max((u2 - u1) / (t2 - t1), 0.0)
    fixed = u1 - upd_slope * t1
    if fixed < 0:  # a step's cost per token grew with its tokens: the line through zero closest to both points
        upd_slope, fixed = max((t1 * u1 + t2 * u2) / (t1 * t1 + t2 * t2), 0.0), 0.0
    # the long run's update beyond the short runs' fit, per query-key pair: attention slower (or faster) than measured
    per_pair = 3 * dims.attention_flops_per_pair / (profile.flops * profile.attention_mfu)
    per_pair = max(per_pair + (u3 - fixed - upd_slope * t3) / max(p3, 1.0), per_pair / 4)
    mfu_attention = min(1.0, 3 * dims.attention_flops_per_pair / profile.flops / per_pair)
    return replace(profile, gen_sample_s=gen_slope, call_s=profile.call_s + max(g1 - gen_slope * s1, 0.0),
                   train_token_s=upd_slope, train_fixed_s=fixed, mfu_attention=mfu_attention,
                   sync_s=profile.sync_s + max(statistics.mean(syncs), 0.0),
                   source=profile.source + "; trainer costs from three 4-step GRPO runs (8 prompts, n = 4 and 12, "
                                           "and n = 8 at 256-token prompts)")
