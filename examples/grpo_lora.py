"""A TRL GRPO script as a reader already has it, on one GPU: Qwen2.5-1.5B-Instruct with LoRA, generation on a vLLM
engine colocated with the trainer, bf16. The only lines that differ from TRL's own script are the import and the
class name (``GRPOTrainer`` -> ``NRolloutGRPOTrainer``).

    accelerate launch --num_processes 1 --mixed_precision bf16 examples/grpo_lora.py        # one GPU (24 GB is enough)
    python examples/grpo_lora.py --cpu-smoke                                                   # the same code on a CPU

``--cpu-smoke`` swaps only what a CPU needs (the built-in tiny model for the Hub's, ``use_cpu=True``, two steps of
short completions) and keeps every other line, bf16 included (CPU autocast): the project's tests run it that way.
"""

from __future__ import annotations

import re
import sys

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig

from trl_nrollout import NRolloutGRPOTrainer


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number is the answer, else 0.0 (a GSM8K-style exact-match reward)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return rewards


def sums_dataset(size: int) -> Dataset:
    """Chat prompts asking for the sum of two numbers, with the answer as a column (passed to the reward)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
             "answer": a + b} for a in range(1, 40) for b in range(1, 40)]
    return Dataset.from_list(rows[:size])


def main(cpu_smoke: bool = False) -> NRolloutGRPOTrainer:
    options = dict(
        output_dir="runs/grpo_lora",
        per_device_train_batch_size=16,      # 16 completions per step on this GPU
        num_generations=8,                   # 2 prompts x 8 samples (verl: rollout.n=8)
        max_completion_length=128,
        learning_rate=1e-5,
        bf16=True,
        gradient_checkpointing=True,
        use_vllm=True,
        vllm_mode="colocate",                # one vLLM engine on the trainer's GPU, sleeping while it trains
        vllm_gpu_memory_utilization=0.3,
        max_steps=200,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    model = "Qwen/Qwen2.5-1.5B-Instruct"
    if cpu_smoke:  # what a CPU needs; every other line runs as on the GPU
        options.update(use_cpu=True, max_steps=2, max_completion_length=8, output_dir="runs/grpo_lora_cpu")
        model = "builtin:tiny-qwen2"
    args = GRPOConfig(**options)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = NRolloutGRPOTrainer(model=model, reward_funcs=[answer_reward], args=args,
                                  train_dataset=sums_dataset(512), peft_config=peft_config)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(cpu_smoke="--cpu-smoke" in sys.argv[1:])
