"""A script written for TRL's GRPOTrainer with a tool. The tools tests run it with only the class names replaced.

argv: output folder, backend (vllm / hf), tool (sync / async), steps, JSON of extra GRPOConfig fields. After
training it runs one more rollout and writes, for samples that called the tool, the text of the tokens the loss
ignores (tool_mask 0) and of the tokens it trains on, to result.json.
"""

import json
import sys

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_nrollout.builtin import lucky_number, lucky_number_async, resolve_model, tool_dataset, tool_reward

if __name__ == "__main__":
    out, backend, tool, steps, extra = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
    options = dict(per_device_train_batch_size=64, num_generations=8, max_completion_length=40, max_steps=steps,
                   learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
                   use_vllm=backend == "vllm", vllm_importance_sampling_correction=False)
    args = GRPOConfig(output_dir=out, **{**options, **extra})
    trainer = GRPOTrainer(model=resolve_model("builtin:tiny-qwen2-tools"), reward_funcs=[tool_reward], args=args,
                          train_dataset=tool_dataset(128), tools=[lucky_number if tool == "sync" else lucky_number_async])
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):  # rollout_ranks: this process generates for the trainers
        trainer.close()  # serves the final rollout below until the trainers close
        sys.exit(0)
    dataset = tool_dataset(128)
    inputs = [dict(dataset[i]) for i in range(2) for _ in range(args.num_generations)]
    batch = trainer._generate_and_score_completions(inputs)
    samples, ends = [], []
    for ids, keep in zip(batch["completion_ids"], batch["completion_mask"]):  # each row's last trained token
        kept = ids[keep.bool()]
        ends.append(trainer.processing_class.decode(kept[-1:]) if len(kept) else None)  # None: a masked row
    for ids, keep, tool_mask in zip(batch["completion_ids"], batch["completion_mask"], batch["tool_mask"]):
        ids, tool_mask = ids[keep.bool()], tool_mask[keep.bool()]
        if (tool_mask == 0).any():
            samples.append([trainer.processing_class.decode(ids[tool_mask == 0]),
                            trainer.processing_class.decode(ids[tool_mask == 1])])
    params = list(trainer.model.parameters())
    # ZeRO-3: a parameter this rank holds a part of only (DeepSpeed keeps small ones whole, persistent, on every rank)
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel]
    result = {"history": trainer.state.log_history, "rows": len(batch["completion_ids"]), "expected_rows": len(inputs),
              "samples": samples[:8], "ends": ends, "params": len(params), "partitioned_params": len(partitioned),
              "engine": type(getattr(trainer, "rollout_engine", None)).__name__}
    assert torch.is_tensor(batch["tool_mask"])
    if trainer.accelerator.is_main_process:
        with open(f"{out}/result.json", "w") as f:
            json.dump(result, f)
    if hasattr(trainer, "close"):  # NRolloutGRPOTrainer: its engines (rollout_ranks: the rollout ranks stop)
        trainer.close()
