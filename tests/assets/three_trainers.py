"""Run by tests/test_trainer.py: three trainers with the vLLM engine built and trained one after another in one
process (a notebook, a sweep, an eval after training), without calling close(). Prints TRAINED <i> per trainer."""

import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    trainers = []
    for i in range(3):
        args = NRolloutConfig(output_dir=f"{out}/t{i}", train_batch_size=4, rollout_n=4, max_completion_length=8,
                              max_steps=1, rollout_backend="vllm", report_to="none", use_cpu=True, bf16=False,
                              save_strategy="no", logging_steps=1)
        t = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                train_dataset=digits_dataset(16))
        t.train()
        print("TRAINED", i, t.state.log_history[0]["reward"], flush=True)
        if mode == "close":
            t.close()
        trainers.append(t)  # still referenced: the next trainer must release its engine by itself
    try:
        trainers[0].rollout_engine.generate([[5, 6]], 2, trainers[0]._sampling("train"))
    except RuntimeError as err:
        print("OLD ENGINE:", err)
