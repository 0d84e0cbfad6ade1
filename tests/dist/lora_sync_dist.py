"""Run by tests/test_lora_sync.py, alone or under ``torchrun --nproc_per_node 2``: adapter-only weight sync
(``rollout_lora_sync="adapter"``) on real vLLM, checked against the training PEFT model after every step.

argv: tp, mode (peft | ddp | zero3 | fsdp2), model folder, output folder. Writes rank<r>.json.

The adapter: rank 8, alpha 32, rsLoRA (scaling alpha / sqrt(r)), ``rank_pattern`` / ``alpha_pattern`` on some
layers, on every projection of the decoder (q/k/v and gate/up are packed in vLLM). The engine starts from the
checkpoint, gets the trainer's base weights once (unmerged), then only the adapter after each of several Adam steps
with a learning rate that moves it; after each sync the engine's log-probs of its own samples must equal the PEFT
model's, the engine's base weights must be untouched, and the bytes sent must be the adapter's.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.engines.weight_sync import adapter_bytes, unwrap
from trl_nrollout.rollout.types import SamplingOptions

N, PROMPTS_PER_RANK, TEMPERATURE, STEPS = 3, 2, 0.8, 3
LORA = dict(r=8, lora_alpha=32, use_rslora=True, rank_pattern={"v_proj": 4}, alpha_pattern={"o_proj": 6.0},
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            init_lora_weights=False, lora_dropout=0.0)


def gap(model, batch) -> float:
    ref = compute_log_probs(model, batch.prompt_ids, batch.completion_ids, temperature=TEMPERATURE)
    return max(abs(ref.logprobs[i, j].item() - v) for i, row in enumerate(batch.logprobs) for j, v in enumerate(row))


def sampled_logprob_sum(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Sum of the completion's log-probs (at the sampling temperature) under ``model``, with gradients."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None]).sum()


def partial_rollout(group, model, opt, prompts, batch, opts) -> dict:
    """A partial rollout across a sync: group 1 starts 6 tokens in (it finishes first), group 0 fresh; the engine
    stops when one group has finished, the adapter moves (an Adam step) and is synced, and group 0's samples
    continue. Returns the gaps between the engine's log-probs of each version's tokens and the PEFT model's at that
    version (the continuation must be sampled by the new adapter)."""
    import copy

    from trl_nrollout.rollout.dispatch.shares import run_partial
    from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample

    group.load_adapter(model)
    v1 = copy.deepcopy(model).eval()
    started = [PartialSample(list(c[:6]), list(lp[:6]), None, [0] * 6)
               for c, lp in zip(batch.completion_ids[N:2 * N], batch.logprobs[N:2 * N])]
    pool = [InFlightGroup.fresh(0, prompts[0], N), InFlightGroup(1, list(prompts[1]), started)]
    first = run_partial(group, pool, 1, opts, version=1)
    loss = -sum(sampled_logprob_sum(model, prompts[0], s.token_ids) for s in first.groups[0].samples if s.token_ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    group.load_adapter(model)
    second = run_partial(group, first.groups, 2, opts, version=2)
    samples = second.groups[0].samples
    gaps = {}  # (version of the tokens, version of the model scoring them) -> largest gap
    for scorer, ref_model in ((1, v1), (2, model)):
        ref = compute_log_probs(ref_model, [prompts[0]] * N, [s.token_ids for s in samples], temperature=TEMPERATURE)
        for version in (1, 2):
            gaps[version, scorer] = max(abs(ref.logprobs[i, j].item() - lp) for i, s in enumerate(samples)
                                        for j, (lp, v) in enumerate(zip(s.logprobs, s.versions)) if v == version)
    return {"aborted": first.aborted, "finished_first": first.finish_order,
            "continued": sum(1 in s.versions and 2 in s.versions for s in samples),
            "all_finished": all(s.finished for s in samples), "gap_v1": gaps[1, 1], "gap_v2": gaps[2, 2],
            "moved_by": gaps[2, 1]}  # the old adapter's log-probs of the continuation: far from the engine's


def main() -> None:
    tp, mode, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the same adapter on every rank
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(**LORA))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    accelerator = None
    if mode == "zero3":
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3),
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=1)
        model, opt, loader = accelerator.prepare(model, opt, loader)
    elif world > 1:
        torch.distributed.init_process_group("gloo")
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif mode == "fsdp2":  # LoRA tensors sharded as DTensors; the step below scales them in place
            from torch.distributed.fsdp import fully_shard

            for layer in model.base_model.model.model.layers:
                fully_shard(layer)
            fully_shard(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    layout = RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=PROMPTS_PER_RANK * world,
                                 rollout_n=N)
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    group = VLLMEngineGroup(model_dir, layout, rank=rank, max_model_len=128, seed=1234, lora_rank=8)
    runner_model = group._model_runner().get_model()
    base_name = next(n for n, _ in runner_model.named_parameters() if n.endswith("qkv_proj.base_layer.weight"))

    def engine_base() -> torch.Tensor:
        return dict(runner_model.named_parameters())[base_name].detach().clone()

    # the trainer's base, unmerged, once (the engine loaded the checkpoint: here the same weights)
    base_stats = group.load_weights(model, merge_lora=False)
    base_after_load = engine_base()
    prompts = [[5 + rank, 6, 7 + k] for k in range(PROMPTS_PER_RANK)]
    opts = SamplingOptions(max_tokens=10, temperature=TEMPERATURE, seed=11)

    def logprob_gap(batch) -> float:  # ZeRO-3: the log-prob pass gathers the partitioned parameters itself
        return gap(model if mode == "zero3" else unwrap(model), batch)

    gathered: list[int] = []  # ZeRO-3: the elements each adapter sync gathers (the adapter's only)
    if mode == "zero3":
        import deepspeed

        real_gather = deepspeed.zero.GatheredParameters

        def spy_gather(params, *args, **kwargs):
            params = list(params) if isinstance(params, (list, tuple)) else [params]
            gathered.append(sum(int(getattr(p, "ds_numel", p.numel())) for p in params))
            return real_gather(params, *args, **kwargs)

    base_only = group.generate(prompts, N, opts)  # no adapter yet: the engine serves the base
    steps = []
    for _ in range(STEPS):
        gathered.clear()
        if mode == "zero3":
            deepspeed.zero.GatheredParameters = spy_gather
        try:
            stats = group.load_adapter(model)
        finally:
            if mode == "zero3":
                deepspeed.zero.GatheredParameters = real_gather
        batch = group.generate(prompts, N, opts)
        steps.append({"gap": logprob_gap(batch), "bytes": stats["bytes"], "gathered_bytes": 4 * sum(gathered),
                      "adapter_id": stats["adapter_id"], "lora_request_id": group.lora_request.lora_int_id,
                      "base_unchanged": bool(torch.equal(engine_base(), base_after_load)),
                      "completions": batch.completion_ids})
        if mode == "fsdp2":  # an update of the sharded adapter (each rank scales its own shards)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.mul_(1.5)
            steps[-1]["moved_by"] = logprob_gap(batch)
            continue
        # an Adam step that moves the adapter: raise the log-probs of the sampled tokens
        unwrap(model).train()
        loss = -sum(sampled_logprob_sum(model, p, c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        unwrap(model).eval()
        steps[-1]["moved_by"] = logprob_gap(batch)  # how far the step moved the trainer from the engine's adapter
    partial = partial_rollout(group, model, opt, prompts, batch, opts) if mode == "peft" else None
    lora_bytes, model_bytes = adapter_bytes(unwrap(model))
    result = {"rank": rank, "mode": mode, "tp": tp, "steps": steps, "base_sync_bytes": base_stats["bytes"],
              "adapter_bytes": lora_bytes, "model_bytes": model_bytes,
              "engine_kwargs": {k: group.engine_kwargs.get(k) for k in ("enable_lora", "max_lora_rank", "max_loras")},
              "base_only_gap_to_peft": logprob_gap(base_only), "partial": partial}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    group.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
