"""Run by tests/test_trainer.py: NRolloutGRPOTrainer with a LoRA peft_config, the vLLM engine (merged-weight
sync) and a KL loss (the reference is the base model, adapters disabled). Writes log_history.json.

    python peft_train.py OUT                                              # one process
    accelerate launch --multi_gpu --num_processes 2 peft_train.py OUT      # DDP
    accelerate launch --config_file recipes/accelerate/zero3_cpu.yaml peft_train.py OUT zero3 [hf]
    accelerate launch --multi_gpu --num_processes 3 peft_train.py OUT ddp vllm ranks   # 2 trainers, 1 rollout rank
"""

import json
import sys

from peft import LoraConfig

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward

if __name__ == "__main__":
    out = sys.argv[1]
    deepspeed = len(sys.argv) > 2 and sys.argv[2] == "zero3"
    backend = sys.argv[3] if len(sys.argv) > 3 else "vllm"  # "hf": transformers generate on the trained model
    device = dict(use_cpu=False, ddp_backend="gloo") if deepspeed else dict(use_cpu=True)
    if "ranks" in sys.argv[4:]:  # the last process only generates; synchronous, so every step checks a transfer
        device.update(rollout_ranks=1, rollout_lookahead=0)
    args = NRolloutConfig(output_dir=out, train_batch_size=8, rollout_n=4, max_completion_length=8, max_steps=3,
                          learning_rate=1e-2, use_kl_loss=True, kl_loss_coef=0.01, rollout_backend=backend,
                          logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0, **device)
    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(64),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):
        trainer.close()
        sys.exit(0)
    if trainer.accelerator.is_main_process:
        with open(f"{out}/log_history.json", "w") as f:
            json.dump({"history": trainer.state.log_history, "processes": trainer.accelerator.num_processes}, f)
    trainer.close()
