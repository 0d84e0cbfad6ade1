"""A vision-language model trained by the launch's trainers and one rollout rank (tests/test_vlm.py: two trainers;
every process but the last trains): image prompts travel to the rollout rank as the engine's ids (placeholders not
expanded) and each group's images, the second step's job written one step ahead (``rollout_lookahead=1``).

argv: output folder. Writes result.json (trainer rank 0): the log history and, per generation, the samples' prompt
ids (the engine's expansion), the processor's ids and the engine ids sent, and the pickled size of one image;
rank_jobs.json (the rollout rank): each job's image payloads as it decoded them. Then a second trainer runs TRL tool
episodes request by request on the rollout rank with image prompts and ``show_picture`` (its image returned):
tools.json (trainer rank 0), the log history and each step's trained samples' image and tool-result counts. Then a
third runs them turn by turn (a job a turn on the rollout rank, the tools here): turns.json (trainer rank 0) as
tools.json, turn_jobs.json (the rollout rank): each tool turn's job, per context its images and which of the job's
distinct payloads each is. Then a fourth, partial (``rollout_partial=True``: the episodes in flight kept on the
rollout rank from job to job): partial.json as tools.json. Then a ``rollout_func`` on the image prompts, on the
whole batch (func.json) and partial, group by group on the rollout rank (func_partial.json; func_partial_rank.json,
the rollout rank's: each call's prompts' image counts).
"""

import json
import pickle
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import colour_reward, image_dataset, resolve_model, show_picture

SEEN: list[dict] = []
JOBS: list[dict] = []  # the rollout rank's: each job's image payloads as it decoded them
TURN_JOBS: list[dict] = []  # the rollout rank's: each tool turn's job, its contexts' images


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


def count_turn_images() -> None:
    """Wrap the rollout rank's tool-turn jobs (``jobs.JOB_KINDS[TurnEntry]``): per job, per context of its slice the
    index of each of its image payloads among the message's distinct payload objects, and how many images the
    engine got for it."""
    import trl_nrollout.rollout.ranks.jobs as jobs

    handler = jobs.JOB_KINDS[jobs.TurnEntry]

    def counted(job):
        sent = job.message.get("images") or []
        distinct = {i: k for k, i in enumerate(dict.fromkeys(id(x) for imgs in sent for x in imgs))}
        TURN_JOBS.append({"contexts": len(job.message["prompts"]), "payloads": sum(len(i) for i in sent),
                          "distinct": len(distinct), "images": [len(i) for i in job.images or []],
                          "objects": [[distinct[id(x)] for x in imgs] for imgs in sent]})
        return handler(job)

    jobs.JOB_KINDS[jobs.TurnEntry] = counted


class Recording(NRolloutGRPOTrainer):
    """The trainer, recording what each generation on the rollout rank gave back."""

    def _remote_generate(self, prompt_ids, images, n, sampling, offset, mode, step_job):
        batch = super()._remote_generate(prompt_ids, images, n, sampling, offset, mode, step_job)
        SEEN.append({"samples": batch.prompt_ids, "processor": [list(p) for p in prompt_ids],
                     "engine": [list(p) for p in images.engine_ids] if images is not None else None,
                     "image_bytes": len(pickle.dumps(images.images[0][0])) if images is not None else 0})
        return batch


FUNC_SEEN: list[list[int]] = []  # per rollout_func call (where it ran), each prompt's image count


def image_rollout(prompts, trainer):
    """A user's ``rollout_func`` on image prompts (TRL's contract): each prompt's images are in its messages; it
    renders the engine's ids (placeholders unexpanded), generates on ``trainer.rollout_engine`` with ``images=``
    (the image token suppressed, as the trainer's own sampling does) and returns the engine's expanded prompts."""
    from trl_nrollout.passes.multimodal import prompt_images
    from trl_nrollout.rollout.types import SamplingOptions

    processor = trainer.processing_class
    images = [prompt_images(p) for p in prompts]
    FUNC_SEEN.append([len(i) for i in images])
    ids = [processor.tokenizer(processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"] for p in prompts]
    suppress = (processor.tokenizer.convert_tokens_to_ids("<image>"),)
    batch = trainer.rollout_engine.generate_expanded(
        ids, 1, SamplingOptions(max_tokens=6, temperature=1.0, suppress_token_ids=suppress), images=images)
    return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs}


def record_samples(trainer, out: list, describe) -> None:
    """Wrap ``trainer._assign``: per step, each of this rank's trained samples' forward image count (``images``) and
    what ``describe(sample)`` says of it (a dict)."""
    assign = trainer._assign

    def spy(collected, ctx):
        world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        per_rank = len(collected.samples) // world
        mine = collected.samples[rank * per_rank:(rank + 1) * per_rank]
        mm = collected.mm_local or [s.mm for s in mine]
        out.append([{"images": None if m is None else int(m["pixel_values"].shape[1]), **describe(s)}
                    for s, m in zip(mine, mm, strict=True)])
        return assign(collected, ctx)

    trainer._assign = spy


def record_func_samples(trainer, out: list) -> None:
    """:func:`record_samples` with each sample's prompt's image tokens."""
    image_token = trainer.processing_class.tokenizer.convert_tokens_to_ids("<image>")
    record_samples(trainer, out, lambda s: {"image_tokens": s.prompt_ids.count(image_token)})


def biased_tools_model(path: str):
    """The built-in tool-calling VLM, made to call ``show_picture`` often (the call token's tied embedding along the
    mean final hidden state, as tests/test_tool_images.py does; a logit bias would move vLLM's log-probs): the
    trainer pushes these weights to the rollout rank as version 0."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.assets.axes_combinations import bias_toward_the_picture_call

    model = AutoModelForImageTextToText.from_pretrained(path)
    bias_toward_the_picture_call(model, AutoProcessor.from_pretrained(path).tokenizer)
    return model


def record_tool_samples(trainer, out: list) -> None:
    """:func:`record_samples` with each sample's tool results (the runs of 0 in its tool mask)."""
    record_samples(trainer, out, lambda s: {
        "results": sum(1 for a, b in zip([1, *s.tool_mask], s.tool_mask) if a == 1 and b == 0)})


if __name__ == "__main__":
    out = sys.argv[1]
    args = NRolloutConfig(output_dir=out, per_device_train_batch_size=6, num_generations=3, max_completion_length=6,
                          max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                          bf16=False, save_strategy="no", seed=3, rollout_ranks=1, rollout_lookahead=1)
    count_job_images()
    trainer = Recording(model=resolve_model("builtin:tiny-idefics3"), reward_funcs=[colour_reward], args=args,
                        train_dataset=image_dataset(24))
    trainer.train()
    rollout_rank = getattr(trainer, "is_rollout_rank", False)
    if rollout_rank:
        with open(f"{out}/rank_jobs.json", "w") as fh:
            json.dump(JOBS, fh)
    elif trainer.accelerator.is_main_process:
        with open(f"{out}/result.json", "w") as fh:
            json.dump({"history": trainer.state.log_history, "seen": SEEN}, fh)
    # tool episodes request by request on the rollout rank (issue 66): image prompts, a tool that returns an image
    path = resolve_model("builtin:tiny-idefics3-tools")
    tools_args = NRolloutConfig(**{**args.to_dict(), "output_dir": f"{out}/tools", "max_completion_length": 64,
                                   "max_tool_calling_iterations": 2, "rollout_multi_turn": "requests"})
    # whole episodes on the rollout rank; then a job a turn there; then partial episodes kept there between jobs
    for name, more in (("tools", {}), ("turns", {"rollout_multi_turn": "turns"}), ("partial", {"rollout_partial": True})):
        trainer = NRolloutGRPOTrainer(model=biased_tools_model(path), reward_funcs=[colour_reward],
                                      args=NRolloutConfig(**{**tools_args.to_dict(), "output_dir": f"{out}/{name}",
                                                             **more}),
                                      train_dataset=image_dataset(24), tools=[show_picture])
        samples: list = []
        if not rollout_rank:
            record_tool_samples(trainer, samples)
        elif name == "turns":
            count_turn_images()
        trainer.train()
        if not rollout_rank and trainer.accelerator.is_main_process:
            with open(f"{out}/{name}.json", "w") as fh:
                json.dump({"history": trainer.state.log_history, "samples": samples}, fh)
        if rollout_rank and name == "turns":
            with open(f"{out}/turn_jobs.json", "w") as fh:
                json.dump(TURN_JOBS, fh)
    # a rollout_func on image prompts: on the whole batch (its engine calls jobs of the rollout rank), then partial
    # (run group by group on the rollout rank, its groups in flight there)
    for name, more in (("func", {}), ("func_partial", {"rollout_partial": True})):
        FUNC_SEEN.clear()
        trainer = NRolloutGRPOTrainer(model=resolve_model("builtin:tiny-idefics3"), reward_funcs=[colour_reward],
                                      args=NRolloutConfig(**{**args.to_dict(), "output_dir": f"{out}/{name}", **more}),
                                      train_dataset=image_dataset(24), rollout_func=image_rollout)
        samples = []
        if not rollout_rank:
            record_func_samples(trainer, samples)
        trainer.train()
        if rollout_rank and name == "func_partial":  # (the function ran group by group here)
            with open(f"{out}/{name}_rank.json", "w") as fh:
                json.dump({"seen": FUNC_SEEN}, fh)
        elif not rollout_rank and trainer.accelerator.is_main_process:
            with open(f"{out}/{name}.json", "w") as fh:
                json.dump({"history": trainer.state.log_history, "samples": samples, "seen": FUNC_SEEN}, fh)
    trainer.close()
