"""A script written for TRL's GRPOTrainer. The drop-in test runs it with only the class names replaced."""

import sys

from trl import GRPOConfig, GRPOTrainer

from trl_nrollout.builtin import digits_dataset, digits_reward, resolve_model

if __name__ == "__main__":
    out = sys.argv[1]
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                      save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[digits_reward], args=args,
                          train_dataset=digits_dataset(64))
    trainer.train()
    import json

    with open(f"{out}/log_history.json", "w") as f:
        json.dump(trainer.state.log_history, f)
    print("TRAINER_CLASS", type(trainer).__name__)
