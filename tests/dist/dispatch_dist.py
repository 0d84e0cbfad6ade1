"""Run by tests/test_dispatch.py under ``torchrun --nproc_per_node P``: ``rollout_dispatch="balanced"`` on real
vLLM engines (TP=1: P engines; TP=2 with 4 processes: two engines of two ranks).

argv: tp, model folder, output folder. Writes rank<r>.json with, per case, what this rank got and what its engine
generated (and partial rollouts of the job's pool, single-turn and tool-calling episodes, fixed shares then a
balanced queue). Engine 0 is slowed (every engine step waits ``SLOW_S`` more: a slower device, or an engine whose
samples run long), so that a balanced queue has work to move.
"""

import json
import os
import sys
import time
from dataclasses import asdict, replace

import torch

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.rollout.dispatch.balanced import (
    generate_balanced,
    run_agents_balanced,
    run_partial_agents_balanced,
    run_partial_balanced,
)
from trl_nrollout.rollout.dispatch.shares import run_agents, run_partial, run_partial_agents
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, split_finished
from trl_nrollout.rollout.episodes.partial_tools import AgentPartialSample
from trl_nrollout.rollout.types import SamplingOptions

N = 3
PROMPTS_PER_RANK = 4
SLOW_S = 0.03
LATE_S = 3.0  # engine 0 starts the continued partial call this much later
STOPS = tuple(range(10, 40))  # completions of many lengths


def prompts_of(rank: int) -> list[list[int]]:
    return [[5 + rank, 6 + p, 7, 8 + (p * 3) % 5][: 2 + (rank + p) % 3] for p in range(PROMPTS_PER_RANK)]


def agent_callbacks():
    """A scripted agent: a turn calls the tool when it has an odd number of tokens; the tool's result renders as
    three fixed tokens; at most two tool rounds."""
    from trl_nrollout.rollout.episodes.tools import AgentCallbacks

    def parse(i, ids, prefix):
        call = {"type": "function", "function": {"name": "t", "arguments": {}}}
        return {"role": "assistant", "content": "", **({"tool_calls": [call]} if len(ids) % 2 else {})}

    return AgentCallbacks(parse=parse, run_tools=lambda i, calls: ([{"role": "tool", "name": "t", "content": "7"}
                                                                    for _ in calls], 0),
                          suffix_ids=lambda messages: [9, 41, 42], max_iterations=2, max_completion_length=24,
                          max_model_len=128)


def record_agents(samples, groups, stats=None) -> dict:
    out = {"prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
           "tool_mask": [s.tool_mask for s in samples], "turns": [s.turns for s in samples],
           "logprobs": [s.logprobs for s in samples], "group_index": groups}
    if stats is not None:
        out["engine_groups"] = stats.groups
    return out


def main() -> None:
    tp, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

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
    # partial rollouts: the job's pool of fresh groups, every rank's prompts; under fixed shares (each engine its own
    # ranks' groups, run to the end: the reference), then (engine 0 slowed, below) from one balanced queue
    job = [InFlightGroup.fresh((0, 0, r, g), p, N) for r in range(world) for g, p in enumerate(prompts_of(r))]
    homes = [layout.engine_of_rank(g.key[2]) for g in job]
    own = [g for g, h in zip(job, homes) if h == group.engine_index]
    result["partial_shares"] = [asdict(g) for g in run_partial(group, own, len(own), options, version=0).groups]
    # the same pool as tool-calling episodes (scripted agent), each engine its own groups run to the end: the
    # reference of the balanced partial episodes below
    agents_job = [InFlightGroup.fresh(g.key, g.prompt_ids, N, sample=AgentPartialSample) for g in job]
    agents_own = [g for g, h in zip(agents_job, homes) if h == group.engine_index]
    run, _ = run_partial_agents(group, agents_own, len(agents_own), options, 0, agent_callbacks(), 4,
                                      owns=lambda g: True)
    result["partial_agents_shares"] = [asdict(g) for g in run.groups]
    # tool-calling episodes request by request: fixed shares, then (engine 0 slowed) a balanced queue
    samples, groups, _ = run_agents(group, mine, N, options, lambda r: 500 + r, agent_callbacks(), workers=4,
                                          sample_offset=rank * len(mine))
    result["agents_shares"] = record_agents(samples, groups)
    engine_step = group.llm.llm_engine.step
    if group.engine_index == 0:  # engine 0 is the slow one from here on
        def slow_step():
            time.sleep(SLOW_S)
            return engine_step()

        group.llm.llm_engine.step = slow_step
    for name, opts in (("balanced", options), ("unseeded", replace(options, seed=None))):
        start = time.perf_counter()
        batch, stats = generate_balanced(group, mine, N, opts)
        record(name, batch, stats, time.perf_counter() - start)
    samples, groups, _, pulled = run_agents_balanced(group, mine, N, options, lambda r: 500 + r, agent_callbacks(),
                                                           workers=4)
    result["agents_balanced"] = record_agents(samples, groups, pulled)
    # partial on the balanced queue, engine 0 slowed: half the job's groups train, the rest stays in flight; then
    # the pool continues at version 1 with engine 0 arriving late (still busy elsewhere): engine 1 takes what it can
    first = run_partial_balanced(group, job, len(job) // 2, options, 0, homes)
    _, waiting = split_finished(first.groups, first.finish_order, len(job) // 2)
    if group.engine_index == 0:
        time.sleep(LATE_S)
    second = run_partial_balanced(group, waiting, len(waiting), replace(options, seed=78), 1,
                                        [layout.engine_of_rank(g.key[2]) for g in waiting])
    # tool-calling episodes the same way: half the job's groups train, then the rest continues at version 1 with
    # engine 0 late, so engine 1 continues episodes engine 0 stopped
    first_agents, _ = run_partial_agents_balanced(group, agents_job, len(job) // 2, options, 0, homes,
                                                        agent_callbacks(), 4)
    _, waiting = split_finished(first_agents.groups, first_agents.finish_order, len(job) // 2)
    if group.engine_index == 0:
        time.sleep(LATE_S)
    second_agents, _ = run_partial_agents_balanced(group, waiting, len(waiting), replace(options, seed=78), 1,
                                                         [layout.engine_of_rank(g.key[2]) for g in waiting],
                                                         agent_callbacks(), 4)
    for name, run in (("partial_balanced", first), ("partial_continued", second),
                      ("partial_agents_balanced", first_agents), ("partial_agents_continued", second_agents)):
        result[name] = {"groups": [asdict(g) for g in run.groups], "finish_order": run.finish_order,
                        "engine_groups": run.engine_groups, "aborted": run.aborted}
    if rank == 0:  # the queue's counters were removed after each call
        result["store_keys_left"] = [group._store.check([f"{group._pull_prefix}/{c}/{e}"])
                                     for c in (1, 2) for e in (0, 1)]
        result["partial_keys_left"] = [group._store.check([f"{group._pull_prefix}/{c}/{e}"])
                                       for c in (4, 5, 6, 7) for e in ("0", "1", "finished")]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    group.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
