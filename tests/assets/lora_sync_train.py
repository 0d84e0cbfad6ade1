"""Run by tests/test_lora_sync.py: NRolloutGRPOTrainer with a LoRA adapter and an explicit ``rollout_lora_sync``.
Writes log_history.json (and the adapter's bytes) from trainer rank 0.

    python lora_sync_train.py OUT adapter                                             # one process
    python lora_sync_train.py OUT auto device=PROFILE.json        # 'auto' priced on a device profile
    ... OUT merged ranks model=builtin:medium-qwen2 r=16 steps=4   # benchmarks/lora_sync_ranks.py
    accelerate launch --multi_gpu --num_processes 3 lora_sync_train.py OUT adapter ranks   # 2 trainers, 1 rollout rank
"""

import json
import sys

from peft import LoraConfig

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.rollout.engines.weight_sync import adapter_bytes

if __name__ == "__main__":
    out, lora_sync = sys.argv[1], sys.argv[2]
    extra = dict(rollout_ranks=1, rollout_lookahead=0) if "ranks" in sys.argv[3:] else {}
    opts = dict(a.split("=", 1) for a in sys.argv[3:] if "=" in a)
    if "device" in opts:  # rollout_lora_sync='auto' priced on this device profile
        extra["rollout_lora_sync_device"] = opts["device"]
    model, steps = opts.get("model", "builtin:tiny-qwen2"), int(opts.get("steps", 3))
    lora = (LoraConfig(r=int(opts["r"]), lora_alpha=2 * int(opts["r"]), lora_dropout=0.0, target_modules="all-linear")
            if "r" in opts else LoraConfig(r=8, lora_alpha=32, use_rslora=True, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "gate_proj"]))
    args = NRolloutConfig(output_dir=out, train_batch_size=8, rollout_n=4, max_completion_length=8, max_steps=steps,
                          learning_rate=1e-2, use_kl_loss=True, kl_loss_coef=0.01, rollout_lora_sync=lora_sync,
                          logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0, use_cpu=True,
                          **extra)
    trainer = NRolloutGRPOTrainer(model, reward_funcs=[digits_reward], args=args, train_dataset=digits_dataset(64),
                                  peft_config=lora)
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):
        trainer.close()
        sys.exit(0)
    if trainer.accelerator.is_main_process:
        lora, full = adapter_bytes(trainer.accelerator.unwrap_model(trainer.model))
        with open(f"{out}/log_history.json", "w") as f:
            json.dump({"history": trainer.state.log_history, "processes": trainer.accelerator.num_processes,
                       "adapter_bytes": lora, "model_bytes": full, "lora_sync": trainer.engine_setup.lora_sync()}, f)
    trainer.close()
