"""Two ZeRO-3 ranks, every parameter partitioned, the HF engine generating without gathering them (each forward
gathers collectively, transformers' generate steps the ranks together): at a tool turn rank 0 continues 5 samples
(3 generate calls of 2) and rank 1 none. Writes each rank's completions to ``<out>/rank<k>.json``.

argv: output folder.
"""

import json
import sys

import torch
from accelerate import Accelerator, PartialState
from transformers import AutoModelForCausalLM

from trl_nrollout.builtin import resolve_model
from trl_nrollout.rollout.hf_engine import HFEngine
from trl_nrollout.rollout.types import SamplingOptions

if __name__ == "__main__":
    PartialState(backend="gloo")  # CPU processes: gloo (as the recipes' --ddp_backend gloo)
    accelerator = Accelerator()
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1  # no dataloader here
    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = list(model.parameters())
    partitioned = sum(p.ds_tensor.numel() < p.ds_numel for p in params)
    engine = HFEngine(model, pad_token_id=0, eos_token_ids=[1], batch_size=2, seed=0, local_forwards=False)
    rank = accelerator.process_index
    contexts = [[5, 6, 7 + i] for i in range(5)] if rank == 0 else []
    batch = engine.generate_turns(contexts, [3] * len(contexts), SamplingOptions(max_tokens=3))
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump({"completions": batch.completion_ids, "params": len(params), "partitioned": int(partitioned)}, f)
