"""Run by tests/test_rollout_ranks.py: 2 trainers and 1 rollout rank on the built-in task; at the trainers' third
reward call a fault is injected, and the launch must stop within a bounded time with a message naming the rank.

    accelerate launch --multi_gpu --num_processes 3 rollout_ranks_fault.py OUT MODE

MODE: ``rollout_stop`` (trainer rank 0 freezes the rollout rank with SIGSTOP: a hang), ``rollout_kill`` (SIGKILL:
a death), ``trainer_stop`` (trainer rank 1 freezes itself), ``slow_job`` (trainer rank 0 freezes the rollout rank
for 15 s, longer than the process groups' ``ddp_timeout=6``, then lets it go on: a job slower than the collectives'
timeout, which must not stop the launch). The frozen process's pid is written to OUT/frozen.pid so that the test can
release it whatever happens.
"""

import os
import signal
import sys
import threading

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.rollout.bridge import current_bridge


def bridge_rank0() -> bool:
    return current_bridge().rank == 0


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    slow = mode == "slow_job"
    args = NRolloutConfig(output_dir=out, train_batch_size=8, rollout_n=4, max_completion_length=8,
                          max_steps=5 if slow else 20, logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0, use_cpu=True,
                          rollout_ranks=1, rollout_rank_timeout_s=60 if slow else 5,
                          ddp_timeout=6 if slow else 1800)
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        bridge = current_bridge()
        if len(calls) == 3:
            if mode.startswith("rollout") and bridge.rank == 0:
                pid = int(bridge.store.get("pid/2").decode().rpartition(":")[2])
                with open(os.path.join(out, "frozen.pid"), "w") as fh:
                    fh.write(str(pid))
                os.kill(pid, signal.SIGSTOP if mode == "rollout_stop" else signal.SIGKILL)
            elif mode == "slow_job" and bridge.rank == 0:
                pid = int(bridge.store.get("pid/2").decode().rpartition(":")[2])
                with open(os.path.join(out, "frozen.pid"), "w") as fh:
                    fh.write(str(pid))
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(15.0, os.kill, (pid, signal.SIGCONT)).start()
            elif mode == "trainer_stop" and bridge.rank == 1:
                with open(os.path.join(out, "frozen.pid"), "w") as fh:
                    fh.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
        return digits_reward(completions, **kwargs)

    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[reward], args=args,
                                  train_dataset=digits_dataset(64))
    trainer.train()
    trainer.close()
    if slow and not getattr(trainer, "is_rollout_rank", False) and bridge_rank0():
        with open(os.path.join(out, "done"), "w") as fh:
            fh.write(str(trainer.state.global_step))
