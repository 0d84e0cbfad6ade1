"""Two CPU processes, one vLLM engine at TP=2 (``rollout_backend='auto'``), where starting the engine fails on rank 1
only. Writes ``<out>/rank<k>.json`` with what each case gave, before the last case. argv: output folder.

1. ``preflight``: a setting only rank 1 gets, a KV cache larger than this machine's memory. vLLM-CPU's own start-up
   check refuses it inside the engine's build, on rank 1 alone, while rank 0 goes on into the engine's collectives;
   the trainer's checks made before any collective see it first, and both ranks fall back to the HF engine alike
   (and train a step), with a warning naming rank 1.
2. ``vllm``: the same with ``rollout_backend='vllm'``: an error on both ranks, naming rank 1 and the reason.
3. ``alike``: a failure inside the collective phase on both ranks (vLLM-CPU has no attention kernel for a head size
   of 24: both TP ranks fail at the same forward): they report it, and fall back alike, as one process does.
4. ``inside``: a failure inside the collective phase on rank 1 only, which no check before it can see. Injected:
   vLLM-CPU's memory step replaced on rank 1 by one that raises, standing in for failures a CPU cannot produce (the
   CUDA memory check made after NCCL's buffers are allocated, an out-of-memory error in the profiling run). Rank 0
   is then inside the TP group's collectives and cannot leave: rank 1 stops with an error naming itself and the
   reason (the launcher stops rank 0) instead of hanging.
"""

import json
import logging
import os
import sys

import torch

from tests.conftest import save_tiny_model
from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.trainer import engines

if __name__ == "__main__":
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    engines.ENGINE_START_WAIT_S = 15.0  # a failed rank's wait for the others' reports (rank 0 never reports in case 4)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("trl_nrollout.trainer").addHandler(Keep(logging.WARNING))

    def fallbacks() -> list[str]:
        """The fallback warnings logged so far (one per trainer that fell back)."""
        return [w for w in warnings if w.startswith("rollout_backend='auto': vLLM cannot run")]

    def args(backend: str, **kw) -> NRolloutConfig:
        return NRolloutConfig(output_dir=f"{out}/{backend}", train_batch_size=4, rollout_n=2, max_completion_length=4,
                              max_steps=1, rollout_backend=backend, vllm_tensor_parallel_size=2, use_cpu=True,
                              bf16=False, save_strategy="no", report_to="none", logging_steps=1, **kw)

    def trainer(config: NRolloutConfig, model: str = "builtin:tiny-qwen2") -> NRolloutGRPOTrainer:
        return NRolloutGRPOTrainer(model, reward_funcs=[digits_reward], args=config, train_dataset=digits_dataset(16))

    huge = {"rollout_kv_cache_memory_bytes": 1 << 50} if rank == 1 else {}  # 1 PiB: on rank 1 only
    result: dict = {}
    first = trainer(args("auto", **huge))
    result["preflight"] = {"backend": first.rollout_backend, "engine": type(first.rollout_engine).__name__,
                           "warnings": fallbacks()}
    first.train()
    result["preflight"]["steps"] = first.state.global_step
    first.close()
    try:
        trainer(args("vllm", **huge))
        result["vllm"] = "started"
    except RuntimeError as err:
        result["vllm"] = str(err)
    if rank == 0:
        save_tiny_model(f"{out}/head24", hidden_size=48)  # 2 heads of 24
    torch.distributed.barrier()
    warnings.clear()
    alike = trainer(args("auto"), f"{out}/head24")
    result["alike"] = {"backend": alike.rollout_backend, "warnings": fallbacks()}
    alike.close()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    print(f"rank {rank}: cases 1-3 done", flush=True)

    if rank == 1:  # injected (see the docstring): vLLM-CPU's memory step fails on rank 1 only
        from vllm.v1.worker.cpu_worker import CPUWorker

        def refuse(self):
            raise ValueError("injected on rank 1: free memory on device is less than desired (a stand-in for a "
                             "CUDA start-up failure)")

        CPUWorker.determine_available_memory = refuse
    trainer(args("auto"))
    print(f"rank {rank}: case 4 started its engine", flush=True)
