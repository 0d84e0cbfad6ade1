"""Run by tests/test_rollout_vllm.py, alone or under ``torchrun --nproc_per_node 2``: a rollout at a user's size.

64 prompts of 300 tokens x n=8 (512 samples, 19,200 prompt tokens: more than four times vLLM's default scheduler
token budget of 4,096), seeded and unseeded. On CPU, seeded requests used to crash in vLLM's partial-prefill
bookkeeping ("CPU Generator does not use offset"). Prompts 0 and 1 are equal: their samples must still differ
(vLLM seeds sample k of a request with seed + k; prompt seeds must be n apart).

argv: tp sizes (one, or several joined by commas: one launch runs them in turn, each engine group closed before the
next starts), model folder, output folder. Writes rank<r>.json: per TP size, this rank's completions.
"""

import json
import os
import sys

import torch

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.types import SamplingOptions

PROMPTS, N, PROMPT_LEN, MAX_TOKENS = 64, 8, 300, 4


def all_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]
    prompts[1] = list(prompts[0])  # two equal prompts next to each other
    return prompts


def rollout(tp: int, world: int, rank: int, model_dir: str) -> dict:
    """This rank's share of the rollout on an engine group of TP size ``tp``, closed at the end."""
    layout = RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=PROMPTS, rollout_n=N)
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    group = VLLMEngineGroup(model_dir, layout, rank=rank, max_model_len=PROMPT_LEN + MAX_TOKENS + 8, seed=3)
    per_rank = PROMPTS // world
    mine = all_prompts()[rank * per_rank:(rank + 1) * per_rank]
    seeded = SamplingOptions(max_tokens=MAX_TOKENS, temperature=1.0, seed=12345)
    first = group.generate(mine, N, seeded, group_offset=rank * per_rank)
    again = group.generate(mine, N, seeded, group_offset=rank * per_rank)
    unseeded = group.generate(mine, N, SamplingOptions(max_tokens=MAX_TOKENS, temperature=1.0))
    result = {
        "budget": group.engine_kwargs.get("max_num_batched_tokens"),
        "engine_prompt_tokens": layout.prompts_per_engine * PROMPT_LEN,
        "seeded": first.completion_ids,
        "group_index": first.group_index,
        "seeded_again_equal": first.completion_ids == again.completion_ids,
        "unseeded_count": len(unseeded),
        "unseeded_lengths_ok": all(len(c) == MAX_TOKENS or r == "stop"
                                   for c, r in zip(unseeded.completion_ids, unseeded.finish_reasons)),
    }
    group.close()
    # the engine's shutdown releases vLLM's groups; a process group the launcher made must survive it
    result["process_group_alive_after_close"] = torch.distributed.is_initialized()
    return result


def main() -> None:
    tps, model_dir, out_dir = [int(t) for t in sys.argv[1].split(",")], sys.argv[2], sys.argv[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = {"rank": rank, "tp": {str(tp): rollout(tp, world, rank, model_dir) for tp in tps}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
