"""Run by tests/test_rollout_vllm.py, alone or under ``torchrun --nproc_per_node 2``: the vLLM engine group's
layout, TP consistency, seeded determinism, and weight sync from the model as the trainer holds it.

argv: tp, modes, model folder, output folder. ``modes`` is one mode (plain | ddp | zero3 | fsdp1 | fsdp2 | peft |
zero3_peft | fsdp2_peft) or several joined by commas: one engine (one start, one set of generation checks) then
receives one sync per mode, in order, each from its own training model with weights of its own (every mode's update
differs from the others', so each sync changes what the engine generates and a layer a sync missed keeps the previous
mode's weights, which the log-prob check sees). Writes rank<r>.json with the generation checks and ``syncs`` (one
entry per mode). The ``*_peft`` modes hold a LoRA model (random, non-zero adapters) sharded by ZeRO-3 or FSDP2: the
engine must receive the merged weights, not the base ones.
"""

import hashlib
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.types import SamplingOptions

N = 3
PROMPTS_PER_RANK = 2
TEMPERATURE = 0.8


def digest(batch) -> str:
    return hashlib.sha256(json.dumps([batch.prompt_ids, batch.completion_ids]).encode()).hexdigest()[:16]


def perturb(model, seed=7, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def max_logprob_gap(reference_model, batch) -> float:
    ref = compute_log_probs(reference_model, batch.prompt_ids, batch.completion_ids, temperature=TEMPERATURE)
    return max(abs(ref.logprobs[i, j].item() - v) for i, row in enumerate(batch.logprobs) for j, v in enumerate(row))


LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


def build_models(mode: str, index: int, model_dir: str):
    """(training model, expected model, peft base snapshot) for one sync mode, built before any ZeRO-3 plugin exists
    (from_pretrained would partition at load). ``index`` (the mode's place in the run) seeds its update, so no two
    modes of one run sync the same weights. The training model is not sharded yet (see shard); under ``zero3`` it is
    None: shard loads it once the plugin exists, partitioned at load as a ZeRO-3 trainer's model is."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = None if mode == "zero3" else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # what the engine should match after the sync: a plain copy with the same update
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_snapshot = None
    if mode in ("peft", "zero3_peft", "fsdp2_peft"):
        torch.manual_seed(index)  # the same adapters on every rank (ZeRO-3 keeps each rank's partition of its copy)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                 init_lora_weights=False))
        expected = copy.deepcopy(model).merge_and_unload()  # the merged weights, on a separate copy
        if mode == "peft":
            base_snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    else:
        perturb(expected, seed=7 + index)
        if mode != "zero3":  # under ZeRO-3 the "optimizer update" changes the partitioned weights (see shard)
            perturb(model, seed=7 + index)
    return model, expected, base_snapshot


def shard(mode: str, index: int, model, accelerator, model_dir: str):
    """The training model as the trainer holds it under ``mode``."""
    if mode == "zero3":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # partitioned at load
    if mode in ("zero3", "zero3_peft"):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=1)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        if mode == "zero3":
            import deepspeed

            # the "optimizer update": change the partitioned weights (gathered, modified, re-partitioned)
            with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=0):
                perturb(model.module, seed=7 + index)
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                     device_id=torch.device("cpu"))
    elif mode in ("fsdp2", "fsdp2_peft"):
        from torch.distributed.fsdp import fully_shard

        inner = model.base_model.model if mode == "fsdp2_peft" else model
        for layer in inner.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def sync_and_check(group, model, expected, prompts, opts, previous) -> dict:
    """One sync from ``model``: its statistics, the reload calls and vLLM warnings it caused, and what the engine
    generates afterwards (``previous``: the seeded generation before this sync)."""
    import logging

    # one reload call per sync, and no vLLM warning (a call per bucket warned about every layer outside it)
    runner = group._model_runner()
    reload_calls = []
    original_reload = runner.reload_weights
    runner.reload_weights = lambda **kw: (reload_calls.append(1), original_reload(**kw))[1]
    warnings_seen: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings_seen.append(record.getMessage()[:200])

    catcher = _Catch()
    logging.getLogger("vllm").addHandler(catcher)
    try:
        stats = group.load_weights(model)
    finally:
        logging.getLogger("vllm").removeHandler(catcher)
        runner.reload_weights = original_reload
    after = group.generate(prompts, N, opts)
    return {"gap_after_sync": max_logprob_gap(expected, after), "generation_changed": digest(previous) != digest(after),
            "sync": stats, "reload_calls": len(reload_calls), "sync_warnings": warnings_seen, "after": after}


def main() -> None:
    tp, modes, model_dir, out_dir = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # every mode's models, loaded before any ZeRO-3 plugin exists
    built = [build_models(mode, i, model_dir) for i, mode in enumerate(modes)]
    # the generation checks before any sync compare with the unchanged model
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    accelerator = None
    if any(mode.startswith("zero3") for mode in modes):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3),
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    elif world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    layout = RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=PROMPTS_PER_RANK * world,
                                 rollout_n=N)
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    # a small bucket: the sync must go layer by layer (peak bounded by one layer, not the model)
    group = VLLMEngineGroup(model_dir, layout, rank=rank, max_model_len=128, seed=1234, weight_bucket_bytes=1 << 16)
    prompts = [[5 + rank, 6, 7 + k] for k in range(PROMPTS_PER_RANK)]
    opts = SamplingOptions(max_tokens=10, temperature=TEMPERATURE, seed=11)
    before = group.generate(prompts, N, opts)
    again = group.generate(prompts, N, opts)
    unseeded = group.generate(prompts, N, SamplingOptions(max_tokens=10, temperature=TEMPERATURE))
    # the engine-level batch (all prompts of the TP group) must be identical on every rank of the group
    engine_prompts = group.gather_tp(prompts)
    engine_batch = group.generate_engine([p for c in engine_prompts for p in c], N, opts)
    gap_before = max_logprob_gap(reference, before)

    # rollout_seed_mode="engine": no per-request seed reaches vLLM; a call draws from the default generators, seeded
    # from its seed and the engine's index, and the caller's generator state is restored afterwards
    group.seed_mode = "engine"
    sent_seeds = []
    engine = group.llm.llm_engine
    real_add = engine.add_request

    def spy(request_id, prompt, params, *args, **kw):  # every request the engine loop adds
        sent_seeds.append(params.seed)
        return real_add(request_id, prompt, params, *args, **kw)

    engine.add_request = spy
    state = torch.get_rng_state()
    eng_a = group.generate(prompts, N, opts)
    rng_restored = torch.equal(state, torch.get_rng_state())
    eng_b = group.generate(prompts, N, opts)
    eng_c = group.generate(prompts, N, SamplingOptions(max_tokens=10, temperature=TEMPERATURE, seed=12))
    eng_engine = group.generate_engine([p for c in engine_prompts for p in c], N, opts)
    turns_a = group.generate_turns(prompts, [4] * len(prompts), opts)
    turns_b = group.generate_turns(prompts, [4] * len(prompts), opts)
    del engine.add_request
    group.seed_mode = "sample"
    engine_mode = {
        "seeds_sent": sorted({str(x) for x in sent_seeds}),
        "rng_restored": rng_restored,
        "repeat_equal": digest(eng_a) == digest(eng_b) and turns_a.completion_ids == turns_b.completion_ids,
        "seed_changes": digest(eng_a) != digest(eng_c),
        "samples_of_a_prompt_differ": len({tuple(c) for c in eng_a.completion_ids[:N]}) > 1,
        "differs_from_sample_mode": digest(eng_a) != digest(before),
        "engine_digest": digest(eng_engine),
        "gap": max_logprob_gap(reference, eng_a),
    }

    syncs, previous = {}, before
    for i, (mode, (model, expected, base_snapshot)) in enumerate(zip(modes, built)):
        model = shard(mode, i, model, accelerator, model_dir)
        res = sync_and_check(group, model, expected, prompts, opts, previous)
        previous = res.pop("after")
        # a PEFT sync merges on a copy: the training model's base weights are untouched
        res["base_untouched"] = None if base_snapshot is None else all(
            torch.equal(p, base_snapshot[n]) for n, p in model.named_parameters() if n in base_snapshot)
        syncs[mode] = res
    result = {
        "rank": rank, "world": world, "tp": tp, "modes": modes,
        "num_engines": layout.num_engines, "engine_index": group.engine_index,
        "num_samples": len(before), "group_index": before.group_index,
        "prompts_match": all(before.prompt_ids[i] == prompts[i // N] for i in range(len(before))),
        "finish_reasons": sorted(set(before.finish_reasons)),
        "max_completion_len": max(len(c) for c in before.completion_ids),
        "seeded_repeat_equal": digest(before) == digest(again),
        "unseeded_differs": digest(before) != digest(unseeded),
        "engine_digest": digest(engine_batch),
        "engine_mode": engine_mode,
        "engine_batch_size": len(engine_batch),
        "gap_before_sync": gap_before,
        "syncs": syncs,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # a clean exit: no rank left with live gloo threads
        torch.distributed.destroy_process_group()
