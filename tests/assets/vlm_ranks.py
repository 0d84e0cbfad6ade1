"""A vision-language model trained by the launch's trainers and one rollout rank (tests/test_vlm.py: two trainers;
every process but the last trains): image prompts travel to the rollout rank as the engine's ids (placeholders not
expanded) and each group's images, the second step's job written one step ahead (``rollout_lookahead=1``).

argv: output folder. Writes result.json (trainer rank 0): the log history and, per generation, the samples' prompt
ids (the engine's expansion), the processor's ids and the engine ids sent, and the pickled size of one image;
rank_jobs.json (the rollout rank): each job's image payloads as it decoded them.
"""

import json
import pickle
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import colour_reward, image_dataset, resolve_model

SEEN: list[dict] = []
JOBS: list[dict] = []  # the rollout rank's: each job's image payloads as it decoded them


def count_job_images() -> None:
    """Wrap the rollout rank's reading of a job's images (``serve.read_job_images``): per job its groups, ``n``, its
    PNG payloads (bytes) and the images its slice's samples got (objects, and distinct ones)."""
    import trl_nrollout.rollout.ranks.serve as serve
    from trl_nrollout.rollout.ranks.buckets import PNG_SIGNATURE

    read = serve.read_job_images

    def counted(message, start, stop):
        sent = [x for imgs in message.get("images") or [] for x in imgs]
        out, images = read(message, start, stop)
        JOBS.append({"groups": len(message["prompts"]), "n": message["n"],
                     "png": sum(isinstance(x, bytes) and x.startswith(PNG_SIGNATURE) for x in sent),
                     "payloads": len(sent), "png_bytes": sum(len(x) for x in sent if isinstance(x, bytes)),
                     "samples": len(images or []), "distinct": len({id(i) for imgs in images or [] for i in imgs})})
        return out, images

    serve.read_job_images = counted


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
    count_job_images()
    trainer = Recording(model=resolve_model("builtin:tiny-idefics3"), reward_funcs=[colour_reward], args=args,
                        train_dataset=image_dataset(24))
    trainer.train()
    if getattr(trainer, "is_rollout_rank", False):
        with open(f"{out}/rank_jobs.json", "w") as fh:
            json.dump(JOBS, fh)
        trainer.close()
        sys.exit(0)
    if trainer.accelerator.is_main_process:
        with open(f"{out}/result.json", "w") as fh:
            json.dump({"history": trainer.state.log_history, "seen": SEEN}, fh)
    trainer.close()
