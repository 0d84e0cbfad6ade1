"""Run by tests/test_dispatch.py under ``torchrun --nproc_per_node P``: ``rollout_dispatch="balanced"`` on real
vLLM engines (TP=1: P engines; TP=2 with 4 processes: two engines of two ranks).

argv: tp, model folder, output folder. Writes rank<r>.json with, per case, what this rank got and what its engine
generated. Engine 0 is slowed (every engine step waits ``SLOW_S`` more: a slower device, or an engine whose
samples run long), so that a balanced queue has work to move.
"""

import json
import os
import sys
import time
from dataclasses import replace

import torch

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.types import SamplingOptions

N = 3
PROMPTS_PER_RANK = 4
SLOW_S = 0.03
STOPS = tuple(range(10, 40))  # completions of many lengths


def prompts_of(rank: int) -> list[list[int]]:
    return [[5 + rank, 6 + p, 7, 8 + (p * 3) % 5][: 2 + (rank + p) % 3] for p in range(PROMPTS_PER_RANK)]


def main() -> None:
    tp, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from trl_nrollout.rollout.vllm_group import VLLMEngineGroup

    layout = RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=world * PROMPTS_PER_RANK,
                                 rollout_n=N)
    # one group at a time in each engine: the queue is pulled group by group
    group = VLLMEngineGroup(model_dir, layout, rank=rank, max_model_len=128, seed=1234, max_num_seqs=N,
                            dispatch="balanced")
    mine = [p for p in prompts_of(rank) for _ in range(N)]
    options = SamplingOptions(max_tokens=24, temperature=1.0, seed=77, stop_token_ids=STOPS)
    result = {"rank": rank, "engine_index": group.engine_index, "prompts": mine}

    def record(name, batch, stats=None, seconds=None):
        result[name] = {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids,
                        "logprobs": batch.logprobs, "finish_reasons": batch.finish_reasons,
                        "group_index": batch.group_index, "seconds": seconds}
        if stats is not None:
            result[name].update(engine_groups=stats.groups, claims=stats.claims, busy_s=stats.busy_s,
                                peak_outstanding=stats.peak_outstanding)

    record("shares", group.generate_expanded(mine, N, options, sample_offset=rank * len(mine)))
    engine_step = group.llm.llm_engine.step
    if group.engine_index == 0:  # engine 0 is the slow one from here on
        def slow_step():
            time.sleep(SLOW_S)
            return engine_step()

        group.llm.llm_engine.step = slow_step
    for name, opts in (("balanced", options), ("unseeded", replace(options, seed=None))):
        start = time.perf_counter()
        batch, stats = group.generate_balanced(mine, N, opts)
        record(name, batch, stats, time.perf_counter() - start)
    if rank == 0:  # the queue's counters were removed after each call
        result["store_keys_left"] = [group._store.check([f"{group._pull_prefix}/{c}/{e}"])
                                     for c in (1, 2) for e in (0, 1)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    group.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
