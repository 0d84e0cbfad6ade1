"""A vision-language model trained by the launch's trainers and one rollout rank (tests/test_vlm.py: two trainers;
every process but the last trains): image prompts travel to the rollout rank as the engine's ids (placeholders not
expanded) and each group's images, the second step's job written one step ahead (``rollout_lookahead=1``).

argv: output folder. Writes result.json (trainer rank 0): the log history and, per generation, the samples' prompt
ids (the engine's expansion), the processor's ids and the engine ids sent, and the pickled size of one image.
"""

import json
import pickle
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import colour_reward, image_dataset, resolve_model

SEEN: list[dict] = []


class Recording(NRolloutGRPOTrainer):
    """The trainer, recording what each generation on the rollout rank gave back."""

    def _remote_generate(self, prompt_ids, images, n, sampling, offset, mode, step_job):
        batch = super()._remote_generate(prompt_ids, images, n, sampling, offset, mode, step_job)
        SEEN.append({"samples": batch.prompt_ids, "processor": [list(p) for p in prompt_ids],
                     "engine": [list(p) for p in images.engine_ids] if images is not None else None,
                     "image_bytes": len(pickle.dumps(images.images[0][0])) if images is not None else 0})
        return batch


if __name__ == "__main__":
    out = sys.argv[1]
    args = NRolloutConfig(output_dir=out, per_device_train_batch_size=6, num_generations=3, max_completion_length=6,
                          max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                          bf16=False, save_strategy="no", seed=3, rollout_ranks=1, rollout_lookahead=1)
    trainer = Recording(model=resolve_model("builtin:tiny-idefics3"), reward_funcs=[colour_reward], args=args,
                        train_dataset=image_dataset(24))
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):
        trainer.close()
        sys.exit(0)
    if trainer.accelerator.is_main_process:
        with open(f"{out}/result.json", "w") as fh:
            json.dump({"history": trainer.state.log_history, "seen": SEEN}, fh)
    trainer.close()
