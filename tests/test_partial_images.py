"""Tool images in partial rollouts (issue 66 item 1, "carried and checkpointed"): request-level tool episodes with
``rollout_partial=True`` on a vision-language model. A sample in flight keeps its prompt's and its tools' images
across steps; a checkpoint's pool holds them (PNGs) and a resumed run continues the sample with them.

The model is ``builtin:tiny-idefics3-tools`` (a tool-calling VLM whose ``show_picture`` returns an image) on a real
vLLM-CPU engine, in this process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trl_nrollout.builtin import colour_reward, image_dataset, resolve_model, show_picture


def _pixels(images: list) -> list:
    return [np.asarray(i).tolist() for i in images]


def _bias_the_call(trainer, path: str) -> None:
    """The model itself calls the tool often (the call token's tied embedding along the mean final hidden state, as
    tests/test_tool_images.py does), synced to vLLM."""
    from transformers import AutoProcessor

    from trl_nrollout.builtin import PICTURE_CALL_TOKEN

    call = AutoProcessor.from_pretrained(path).tokenizer.convert_tokens_to_ids(PICTURE_CALL_TOKEN)
    with torch.no_grad():
        ids = torch.tensor([trainer.processing_class.tokenizer("user: write a number").input_ids])
        hidden = trainer.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        direction = trainer.model.model.text_model.norm(hidden).mean(0)
        trainer.model.get_input_embeddings().weight[call] = 3.0 * direction / direction.norm() ** 2
    trainer.rollout_engine.load_weights(trainer.model)


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
