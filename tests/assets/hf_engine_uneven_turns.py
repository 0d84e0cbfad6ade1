"""Two ZeRO-3 ranks, every parameter partitioned, the HF engine at a tool turn where rank 0 continues 5 samples
(3 generate calls of 2) and rank 1 none (its samples stopped calling tools). Four cases in turn, each a place where
the ranks must stay in step:

- ``partitioned/sample``: generating without gathering the parameters (``ds3_gather_for_generation=False``): each
  forward gathers collectively and transformers' generate steps the ranks together (``synced_gpus``);
- ``gathered/sample``: TRL's generation context (``ds3_gather_for_generation=True``, its default): parameters
  gathered once, their hooks off, so every forward is local, but transformers' generate still syncs its steps over
  the ranks under ZeRO-3 unless told the forwards are local;
- ``partitioned/beams`` and ``gathered/beams``: beam search (``num_beams=2``, TRL's ``generation_kwargs``), whose
  log-probs come from a forward pass after generate (collective when the parameters are partitioned).

Writes each rank's completions per case to ``<out>/rank<k>.json``. argv: output folder.
"""

import json
import sys

import torch
from accelerate import Accelerator, PartialState
from transformers import AutoModelForCausalLM
from trl.models import unwrap_model_for_generation

from trl_nrollout.builtin import resolve_model
from trl_nrollout.rollout.engines.hf_engine import HFEngine
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
    rank = accelerator.process_index
    contexts = [[5, 6, 7 + i] for i in range(5)] if rank == 0 else []
    cases = {}
    for gather in (False, True):
        # the trainer's engine: TRL's generation context, local forwards exactly where it gathers the parameters
        engine = HFEngine(model, pad_token_id=0, eos_token_ids=[1], batch_size=2, seed=0, local_forwards=gather,
                          generation_context=lambda g=gather: unwrap_model_for_generation(
                              model, accelerator, gather_deepspeed3_params=g))
        for decoding, kwargs in (("sample", ()), ("beams", (("num_beams", 2),))):
            batch = engine.generate_turns(contexts, [3] * len(contexts),
                                          SamplingOptions(max_tokens=3, engine_kwargs=kwargs))
            name = f"{'gathered' if gather else 'partitioned'}/{decoding}"
            cases[name] = {"completions": batch.completion_ids, "logprobs": batch.logprobs}
            print(f"rank {rank}: {name} done", flush=True)
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump({"cases": cases, "params": len(params), "partitioned": int(partitioned)}, f)
