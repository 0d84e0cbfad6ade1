"""A TRL-style script with a ``rollout_func`` that generates on ``trainer.rollout_engine``, run with one trainer and
one rollout rank (tests/test_rollout_ranks.py): the function's calls become jobs of the rollout rank.

argv: output folder. Writes result.json (trainer rank 0) with the log history and what the function saw.
"""

import json
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import digit_fraction, digits_dataset, resolve_model
from trl_nrollout.rollout.types import SamplingOptions

SEEN: list[str] = []


def rollout_func(prompts, trainer):
    """Tokenize, generate one completion per entry (prompts come n times each) on the trainer's engine, and return
    TRL's fields plus an extra one the reward reads."""
    ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    engine = trainer.rollout_engine
    SEEN.append(type(engine).__name__)
    batch = engine.generate_expanded(ids, 1, SamplingOptions(max_tokens=12, temperature=1.0))
    return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
            "engine": [type(engine).__name__] * len(prompts)}


def reward(completions, engine, **kwargs):
    """The digit fraction, where the function's extra field reached the reward (else 0)."""
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [digit_fraction(t) if e == "RemoteEngines" else 0.0 for t, e in zip(text, engine)]


if __name__ == "__main__":
    out = sys.argv[1]
    args = NRolloutConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
                          max_steps=3, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                          save_strategy="no", seed=0, rollout_ranks=1)
    trainer = NRolloutGRPOTrainer(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[reward], args=args,
                                  train_dataset=digits_dataset(64), rollout_func=rollout_func)
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):
        trainer.close()
        sys.exit(0)
    if trainer.accelerator.is_main_process:
        with open(f"{out}/result.json", "w") as fh:
            json.dump({"history": trainer.state.log_history, "seen": SEEN}, fh)
    trainer.close()
