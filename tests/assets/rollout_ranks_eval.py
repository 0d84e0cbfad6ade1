"""Run by tests/test_rollout_ranks.py: 2 trainers + 1 rollout rank, one-step-off, evaluating every 2 steps inside
train() and once more after it (``trainer.evaluate()`` on every process: on the rollout rank it serves). Writes
OUT/log_history.json.

    accelerate launch --multi_gpu --num_processes 3 rollout_ranks_eval.py OUT
"""

import json
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward

if __name__ == "__main__":
    out = sys.argv[1]
    args = NRolloutConfig(output_dir=out, train_batch_size=8, rollout_n=4, max_completion_length=8, max_steps=4,
                          logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0, use_cpu=True,
                          rollout_ranks=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(64), eval_dataset=digits_dataset(4, seed=1))
    trainer.train()
    final = trainer.evaluate()
    if not getattr(trainer, "is_rollout_rank", False) and trainer.accelerator.is_main_process:
        with open(f"{out}/log_history.json", "w") as fh:
            json.dump({"history": trainer.state.log_history, "final": final}, fh)
    trainer.close()
