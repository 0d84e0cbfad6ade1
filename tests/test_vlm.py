"""Vision-language models: images reach both engines and every forward; the vision tower trains and syncs.

The model is ``builtin:tiny-idefics3`` (a random Idefics3: vision tower, connector, Llama text model; built here).
Idefics3 is the VLM family that vLLM runs on this machine: vLLM's Qwen2-VL and LLaVA code import torchvision,
whose only wheels here are CUDA builds that do not load with the CPU torch (see the closing note of the session).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trl import GRPOConfig, GRPOTrainer

import trl_nrollout.trainer.grpo as trainer_module
from tests.conftest import ACCELERATE_LAUNCH, ENV, ROOT
from trl_nrollout import NRolloutGRPOTrainer
from trl_nrollout.builtin import colour_image, colour_reward, image_dataset, resolve_model
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.passes.multimodal import (
    attach_images,
    check_expansion,
    collate,
    dataset_images,
    encode_prompts,
    has_images,
    prompt_images,
    without_images,
)
from trl_nrollout.rollout.dispatch.shares import run_partial


@pytest.fixture(scope="module")
def vlm_path() -> str:
    return resolve_model("builtin:tiny-idefics3")


def _config(tmp_path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3, max_completion_length=6,
                use_cpu=True, report_to="none", bf16=False, save_strategy="no", seed=3, max_steps=2,
                learning_rate=1e-3)
    base.update(kw)
    return GRPOConfig(**base)


def _hf(tmp_path, monkeypatch, path, cls=NRolloutGRPOTrainer, trainer_kwargs=None, **kw):
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    return cls(model=path, reward_funcs=[colour_reward], args=_config(tmp_path / cls.__name__, **kw),
               train_dataset=image_dataset(12), **(trainer_kwargs or {}))


# ---------------------------------------------------------------------------------------------- pure parts
def test_images_are_found_by_trls_rules():
    red, blue = colour_image("red"), colour_image("blue")
    one = [{"prompt": [{"role": "user", "content": "a"}], "image": red}, {"prompt": [{"role": "user",
                                                                                     "content": "b"}], "image": None}]
    assert dataset_images(one) == [[red], None]
    many = [{"prompt": [{"role": "user", "content": "a"}], "images": [red, blue]}]
    assert dataset_images(many) == [[red, blue]]
    assert dataset_images([{"prompt": "x"}]) is None and dataset_images([{"prompt": "x", "images": []}]) is None
    prompts = attach_images([r["prompt"] for r in many], dataset_images(many))
    assert [p["type"] for p in prompts[0][0]["content"]] == ["image", "image", "text"]  # before the text, as TRL
    assert has_images(prompts) and not has_images([r["prompt"] for r in many])
    assert "image" not in without_images(prompts[0])[0]["content"][0]  # logs keep the place, not the pixels
    with pytest.raises(ValueError, match="images need conversational prompts"):
        attach_images(["plain text"], [[red]])


def test_collate_pads_image_tensors_and_lays_token_fields_along_the_ids():
    a = {"pixel_values": torch.ones(1, 1, 3, 4, 4), "token_type_ids": torch.tensor([[0, 1, 1]])}
    b = {"pixel_values": torch.full((1, 2, 3, 2, 2), 2.0), "token_type_ids": torch.tensor([[1, 1]])}
    out = collate([a, None, b], width=6, starts=[1, 0, 4])
    assert out["pixel_values"].shape == (2, 2, 3, 4, 4)  # concatenated; images and sides zero-padded
    assert out["pixel_values"][0, 1].abs().sum() == 0 and out["pixel_values"][1, 1, :, 2:].abs().sum() == 0
    assert out["pixel_values"][1, 1, :, :2, :2].eq(2).all()
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0], [0] * 6, [0, 0, 0, 0, 1, 1]]
    assert collate([None, None]) == {}
    with pytest.raises(ValueError, match="needs width and starts"):
        collate([a])


def test_an_engine_expansion_that_differs_from_the_processors_is_an_error():
    check_expansion([[1, 2, 2]], [[1, 2, 2]])
    with pytest.raises(ValueError, match="sample 0: vLLM expanded .* into 3 tokens, the model's processor into 4"):
        check_expansion([[1, 2, 2]], [[1, 2, 2, 2]])


# ---------------------------------------------------------------------------------------------- log-probs
def test_a_partial_pool_with_images_is_saved_and_read_back_with_its_images():
    """A checkpoint's pool (JSON) keeps a group's images, its prompt's and its dataset row's: PIL images written as
    lossless PNGs and read back with the same pixels and mode; text fields stay as they were.
    Mutation tried: the JSON read back without the image hook -> the images come back as dicts and this fails."""
    from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialSample
    from trl_nrollout.trainer.partial import pool_from_json, pool_to_json

    red, blue = colour_image("red", 1), colour_image("blue", 2)
    row = {"prompt": [{"role": "user", "content": "a"}], "image": red, "colour": "red"}
    prompt = attach_images([row["prompt"]], [[red, blue]])[0]
    group = InFlightGroup((3, 0, 1, 0), [1, 4, 4, 2], [PartialSample([7, 8], [-0.5, -1.0], None, [2, 2]),
                                                       PartialSample()], {"row": row, "prompt": prompt},
                          images=[red, blue])
    (back,) = pool_from_json(pool_to_json([group]))
    assert back.key == group.key and back.prompt_ids == group.prompt_ids and back.samples == group.samples
    images = [*back.images, back.payload["row"]["image"], *prompt_images(back.payload["prompt"])]
    for got, want in zip(images, [red, blue, red, red, blue]):
        assert got.mode == want.mode and list(got.getdata()) == list(want.getdata())
    assert back.payload["row"]["colour"] == "red"


def test_log_probs_of_a_vlm_see_the_images_and_do_not_depend_on_batching(vlm_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path).eval()
    data = image_dataset(5, seed=1)
    prompts = attach_images([r["prompt"] for r in data], dataset_images(list(data)))
    enc = encode_prompts(processor, prompts)
    assert all(len(e) < len(i) for e, i in zip(enc.engine_ids, enc.ids))  # the processor expanded each <image>
    g = torch.Generator().manual_seed(0)
    completions = [torch.randint(10, 300, (k,), generator=g).tolist() for k in (3, 5, 1, 4, 2)]
    batched = compute_log_probs(model, enc.ids, completions, mm_inputs=enc.mm, micro_batch_size=2).logprobs
    for i, (p, c) in enumerate(zip(enc.ids, completions)):  # one unpadded forward per sample, by hand
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **enc.mm[i]).logits[0]
        want = torch.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        torch.testing.assert_close(batched[i, :len(c)], want, rtol=0, atol=2e-5)
    swapped = [enc.mm[(i + 1) % 5] if data[i]["colour"] != data[(i + 1) % 5]["colour"] else enc.mm[i]
               for i in range(5)]
    assert any(m is not o for m, o in zip(swapped, enc.mm)), "the seed must give both colours"
    blind = compute_log_probs(model, enc.ids, completions, mm_inputs=swapped).logprobs
    assert (blind - batched).abs().max() > 1e-3  # another picture, other log-probs: the images are used


# ---------------------------------------------------------------------------------------------- equal to TRL
def test_loss_and_gradients_equal_trls_and_the_vision_tower_trains(vlm_path, tmp_path, monkeypatch):
    """TRL's ``_compute_loss`` with its forward kwargs (pixel_values of the batch, num_images) and ours with the
    per-sample image tensors give the same loss and the same gradient on every parameter, vision tower included."""
    trl = _hf(tmp_path, monkeypatch, vlm_path, cls=GRPOTrainer)
    ours = _hf(tmp_path, monkeypatch, vlm_path)
    assert ours._is_vlm and ours.engine_setup.image_token_ids() == (ours.model.config.image_token_id,)
    rows = list(image_dataset(6, seed=2))
    prompts = attach_images([r["prompt"] for r in rows], dataset_images(rows))
    enc = encode_prompts(ours.processing_class, prompts)
    pad = ours.processing_class.tokenizer.pad_token_id
    width = max(len(p) for p in enc.ids)
    prompt_ids = torch.full((6, width), pad)
    prompt_mask = torch.zeros(6, width, dtype=torch.long)
    for i, p in enumerate(enc.ids):  # left padding, as both trainers pad prompts
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    g = torch.Generator().manual_seed(5)
    completion_ids = torch.randint(10, 300, (6, 5), generator=g)
    completion_mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 5, 4, 2])[:, None]).long()
    advantages = torch.randn(6, generator=g)
    common = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages)
    trl_mm = {k: v for k, v in trl.processing_class(images=[[r["image"]] for r in rows], text=[
        trl.processing_class.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts],
        padding=True, return_tensors="pt").items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        old, _, _ = trl._get_per_token_logps_and_entropies(
            trl.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), 5,
            num_images=[1] * 6, **trl_mm)
    common["old_per_token_logps"] = old + 0.3 * torch.randn(old.shape, generator=g)
    common["sampling_per_token_logps"] = old
    theirs_in = {**common, **trl_mm, "num_images": [1] * 6, "num_items_in_batch": completion_mask.sum()}
    ours_in = ours.policy_update.add_normalizers([{**common, "mm_inputs": enc.mm}], 1)[0]
    losses, grads = [], []
    for trainer, inputs in ((trl, theirs_in), (ours, ours_in)):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert abs(losses[0].item()) > 1e-4, "a degenerate case tests nothing"
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    vision = [n for n in grads[1] if "vision_model" in n]
    assert vision and all(grads[1][n].abs().sum() > 0 for n in vision)  # the vision tower is trained
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


def test_hf_engine_trains_the_whole_vlm_and_never_samples_image_tokens(vlm_path, tmp_path, monkeypatch):
    trainer = _hf(tmp_path, monkeypatch, vlm_path, logging_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert any("vision_model" in n for n in moved) and any("connector" in n for n in moved)
    assert any("text_model" in n for n in moved)
    batch = trainer._generate_and_score_completions([dict(r) for r in image_dataset(2, seed=4) for _ in range(3)])
    assert len(batch["mm_inputs"]) == 6 and batch["mm_inputs"][0] is batch["mm_inputs"][1]  # one per prompt
    assert not (batch["completion_ids"] == trainer.model.config.image_token_id).any()
    assert trainer.state.log_history[0]["num_tokens"] > 0


def test_images_with_a_plain_tokenizer_are_refused(vlm_path, tmp_path, monkeypatch):
    """(What images do not run with yet is the refusal table's, tests/test_axes.py.)"""
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    text_only = NRolloutGRPOTrainer(model=resolve_model("builtin:tiny-qwen2"), reward_funcs=[colour_reward],
                                    args=_config(tmp_path / "text"), train_dataset=image_dataset(6))
    with pytest.raises(ValueError, match="processing_class is a tokenizer, not a processor"):
        text_only._generate_and_score_completions([dict(r) for r in image_dataset(2) for _ in range(3)])


# ---------------------------------------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_vllm_engine_sees_the_images_and_gets_the_trained_vision_tower(vlm_path, tmp_path):
    """vLLM expands the images as the processor does; its log-probs match the trainer's; after the vision tower
    changes, a weight sync brings vLLM back in line (without one they drift apart); training runs past syncs."""
    trainer = NRolloutGRPOTrainer(model=vlm_path, reward_funcs=[colour_reward], train_dataset=image_dataset(24),
                                  args=_config(tmp_path, use_vllm=True, max_steps=3, logging_steps=1))
    rows = [dict(r) for r in image_dataset(4, seed=6) for _ in range(3)]
    sampling = trainer._sampling("train")

    def drift(options=sampling) -> float:
        batch, _, episode = trainer._rollout(rows, 3, options)  # checks vLLM's expansion against the processor's
        mine = compute_log_probs(trainer.model, batch.prompt_ids, batch.completion_ids, mm_inputs=episode.mm,
                                 temperature=trainer.temperature).logprobs
        return max((mine[i, :len(lp)] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(batch.logprobs))

    # vLLM samples with the image token suppressed (as TRL's generate does), which moves about 1/vocab of the
    # probability mass of this random model (~3e-3 in log-prob); the trainer scores without the suppression. With it
    # off (this seed samples no image token), the two agree to float rounding: same images, expansion and weights.
    exact = replace(sampling, suppress_token_ids=())
    assert drift() < 1e-2
    synced = drift(exact)
    stopped = _partial_images_first(trainer, sampling)  # partial rollouts with images: stopped at version 0
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "vision_model" in name and name.endswith("weight") and p.dim() == 2:
                p.add_(torch.randn_like(p) * p.std() * 2)
    stale = drift(exact)
    trainer.rollout_engine.load_weights(trainer.model)
    resynced = drift(exact)
    assert synced < 1e-4 and resynced < 1e-4, (synced, resynced)  # measured: 1e-6
    assert stale > 1e-2, stale  # the vision weights really travel (measured: 0.16)
    _partial_images_continued(trainer, sampling, *stopped)  # ... and continued at version 1, with their images
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "vision_model" in n}
    trainer.train()  # three steps: two syncs with new vision weights (once an encoder-cache miss in vLLM)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    assert all(h["sampling/sampling_logp_difference/max"] < 1e-2 for h in trainer.state.log_history[:-1])
    trainer.close()


#: stop tokens the random VLM (vocabulary 384) samples often: completions of many lengths, so a partial run stops some
PARTIAL_STOPS = tuple(range(10, 100))


def _image_logprobs(trainer, enc, groups) -> list[list[float]]:
    """The trainer's log-probs of every sample of ``groups`` (keys index ``enc``) with its prompt's images."""
    samples = [(g.key, s) for g in groups for s in g.samples if s.token_ids]
    out = compute_log_probs(trainer.model, [enc.ids[k] for k, _ in samples], [s.token_ids for _, s in samples],
                            mm_inputs=[enc.mm[k] for k, _ in samples], temperature=trainer.temperature).logprobs
    return [out[i, :len(s.token_ids)].tolist() for i, (_, s) in enumerate(samples)]


def _partial_images_first(trainer, sampling):
    """A partial run of six image groups at version 0 (the trainer's weights): one group trains, the others stop
    with their tokens; each kept log-prob is the trainer's with the images (the image token is suppressed in vLLM,
    which moves ~3e-3: tolerance 1e-2). Returns the prompts' encoding, the waiting groups and the options."""
    from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, split_finished

    data = [dict(r) for r in image_dataset(6, seed=8)]
    enc = encode_prompts(trainer.processing_class, attach_images([r["prompt"] for r in data], dataset_images(data)))
    options = replace(sampling, max_tokens=24, stop_token_ids=PARTIAL_STOPS)
    pool = [InFlightGroup.fresh(g, enc.engine_ids[g], 3, images=enc.images[g]) for g in range(6)]
    assert all(g.images for g in pool)
    first = run_partial(trainer.rollout_engine, pool, 1, options, version=0)
    _, waiting = split_finished(first.groups, first.finish_order, 1)
    assert first.aborted > 0 and any(s.token_ids and not s.finished for g in waiting for s in g.samples)
    kept = [s.logprobs for g in first.groups for s in g.samples if s.token_ids]
    for got, want in zip(kept, _image_logprobs(trainer, enc, first.groups)):
        assert got == pytest.approx(want, abs=1e-2)
    return enc, waiting, options


def _partial_images_continued(trainer, sampling, enc, waiting, options):
    """The waiting groups continue at version 1 (the vision tower changed and synced), each continued sample
    resubmitted with its prompt's images: every group finishes; a sample holds its version-0 tokens and log-probs
    unchanged, then tokens of version 1 (tokens, log-probs and versions of one length, as on the text path); the
    version-1 tokens' log-probs are the new model's with the images (the old model's differ: the tags matter).
    Mutation tried: a continued sample resubmitted without its images -> vLLM refuses the placeholders without
    images (or, were they dropped from the ids too, the log-probs are those of another prompt)."""
    second = run_partial(trainer.rollout_engine, waiting, len(waiting),
                         replace(options, seed=(options.seed or 0) + 1), version=1)
    assert all(g.finished for g in second.groups)
    both = 0
    for before, after in zip(waiting, second.groups):
        for s0, s in zip(before.samples, after.samples):
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) <= options.max_tokens
            assert s.token_ids[:len(s0.token_ids)] == s0.token_ids and s.logprobs[:len(s0.logprobs)] == s0.logprobs
            assert s.versions == [0] * len(s0.token_ids) + [1] * (len(s.token_ids) - len(s0.token_ids))
            both += {0, 1} <= set(s.versions)
    assert both, "no sample was stopped at version 0 and continued at version 1"
    new = [s for g in second.groups for s in g.samples if s.token_ids]
    gap = 0.0
    for s, want in zip(new, _image_logprobs(trainer, enc, second.groups)):
        for lp, ref, v in zip(s.logprobs, want, s.versions):
            if v == 1:
                assert lp == pytest.approx(ref, abs=1e-2)
            else:
                gap = max(gap, abs(lp - ref))
    assert gap > 1e-2, gap  # version-0 tokens are not the new model's: each token keeps its own policy's log-prob


@pytest.mark.vllm
def test_partial_rollouts_train_a_vlm_and_keep_its_images_in_flight(vlm_path, tmp_path):
    """rollout_partial=True on image prompts: two steps stop before their slowest samples (stop tokens make the
    lengths differ), the groups that train are encoded again with their images (the update's forward needs the image
    tensors), and the checkpoint's pool holds the samples in flight with their images, read back as PIL images.
    Mutation tried: the trained groups' prompts without their image tensors (engine ids, no tensors) -> the trainer's
    log-probs part from vLLM's (the update itself runs: the random VLM reads the placeholders as text)."""
    from PIL import Image

    from trl_nrollout import NRolloutConfig
    from trl_nrollout.trainer.partial import POOL_FILE, pool_from_json

    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=16, use_cpu=True, report_to="none", bf16=False, seed=3, max_steps=2,
                          learning_rate=1e-3, use_vllm=True, rollout_partial=True, max_staleness=1, logging_steps=1,
                          save_strategy="steps", save_steps=2,
                          generation_kwargs={"stop_token_ids": list(PARTIAL_STOPS)})
    trainer = NRolloutGRPOTrainer(model=vlm_path, reward_funcs=[colour_reward], train_dataset=image_dataset(24),
                                  args=args)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "partial/aborted_samples" in h]
    assert len(steps) == 2 and sum(h["partial/aborted_samples"] for h in steps) > 0
    # step 1's tokens are all the current policy's: the trainer's log-probs (its prompts encoded again with their
    # images) are vLLM's up to the suppressed image token (~3e-3); without the image tensors they are not
    assert steps[0]["sampling/sampling_logp_difference/max"] < 1e-2, steps[0]
    pool = pool_from_json((tmp_path / "checkpoint-2" / POOL_FILE.format(rank=0)).read_text())
    in_flight = [g for g in pool if g.started and not g.finished]
    assert in_flight and all(g.images and isinstance(g.images[0], Image.Image) for g in pool)
    trainer.close()


def _trained_with_tool_images(path) -> None:
    """A tool-image entry of the rollout-rank VLM launch (its JSON at ``path``): 2 steps that called the tool, the
    first step's engine log-probs the trainer's (< 1e-2: the engine saw the prompt's and the tools' images), and
    each of the 12 trained samples' forward holding its prompt's image and one per tool result."""
    run = json.loads(path.read_text())
    steps = [h for h in run["history"] if "reward" in h]
    assert len(steps) == 2 and all(h["tools/call_frequency"] > 0 for h in steps)
    assert steps[0]["rollout_corr/logprob_abs_diff_max"] < 1e-2
    trained = [s for step in run["samples"] for s in step]
    assert len(trained) == 2 * 6 and all(s["images"] == 1 + s["results"] for s in trained)
    assert any(s["results"] for s in trained), "no tool image: the test tests nothing"

@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.vllm
def test_a_vlm_trains_on_a_rollout_rank_one_step_off(tmp_path):
    """Two DDP trainers and one rollout rank (``rollout_ranks=1``, ``rollout_lookahead=1``), two steps of image prompts:
    each job carries the engine's ids (placeholders not expanded) and each group's images (gathered to trainer rank
    0), the second written one step ahead. The samples' prompt ids are the rollout rank's engine's expansion, equal
    to the processor's (longer than the ids sent; each trainer checks its own); the first step's engine log-probs
    are the trainer's with the images (up to the suppressed image token, ~3e-3 on this random model); the second
    step's samples are one version old. Mutations tried: the images left out of the job (``_write_job`` posts no
    ``images``) -> vLLM generates without them and returns the ids unexpanded, so the trainer's expansion check
    stops the launch; the same for the job written ahead only; each group generated with the next group's images
    (same expansion) -> the first step's log-prob gap is 0.43; trainer rank 1 handed trainer rank 0's expanded
    prompts -> its expansion check stops the launch. The rollout rank decodes each group's image once, PNG bytes
    (``rank_jobs.json``: one payload a group, shared by its n samples). Mutation tried: ``encode_job_images``
    leaving the PIL images as they are (pickled pixels) -> no PNG payload (0 == 4): fails.

    Then, in the same launch, TRL tool episodes request by request on the rollout rank (issue 66): image prompts and
    ``show_picture`` returning an image; every trained sample's forward holds its prompt's image and one per tool
    result, and the first step's engine log-probs are the trainer's (0.0034 measured, the suppressed image token).
    Mutation tried: the rollout rank's answer without the tools' images (``episode_extras``) -> the trainer's forward
    gets image tokens without their pixels: the launch fails.

    Then the same episodes turn by turn (a job a turn on the rollout rank, the tools on the trainers): each later
    turn's context reaches the rollout rank with its prompt's image and its tools' (``turn_jobs.json``), each image
    object once in the job's message (a group's prompt image shared by its samples' contexts), the engine's
    expansion is the processor's (checked in the launch), the trained samples' forward holds every image, and the
    first step's log-probs are the engine's. Then partial (``rollout_partial=True``, the episodes in flight on the
    rollout rank between jobs): the same for the trained samples. Mutations tried: the tool turn's job written
    without its images (``generate_turns`` posts none) -> the rollout rank's expansion differs from the processor's
    (280 vs 292 tokens): the launch fails; each context's tool image swapped with the next context's (same counts,
    same expansion) -> the first step's log-prob gap is 0.028: fails; partial, the forward without the tools' images
    (``remote_partial`` ignoring ``tool_images``) -> image tokens without their pixels: the launch fails."""
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "3",
                           str(ROOT / "tests/assets/vlm_ranks.py"), str(tmp_path)], cwd=ROOT,
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["seen"]) == 2
    for seen in result["seen"]:
        assert seen["samples"] == seen["processor"]  # the engine's expansion is the processor's
        assert all(len(e) < len(p) for e, p in zip(seen["engine"], seen["processor"]))  # (expanded on the rank)
    steps = [h for h in result["history"] if "reward" in h]
    assert [h["rollout/staleness"] for h in steps] == [0, 1]
    assert steps[0]["rollout_corr/logprob_abs_diff_max"] < 1e-2  # the engine saw the images (see the docstring)
    assert all(math.isfinite(h["loss"]) for h in steps)
    # the rollout rank received each group's image once, as PNG bytes (issue 66), and gave it to each of the
    # group's n samples: the job's 4 groups (2 trainers x 2 prompts) of n=3
    jobs = json.loads((tmp_path / "rank_jobs.json").read_text())
    assert len(jobs) == 2
    for job in jobs:
        assert (job["groups"], job["n"], job["samples"]) == (4, 3, 12)
        assert job["png"] == job["payloads"] == job["distinct"] == 4  # one payload a group, not one a sample
        assert job["png_bytes"] < 4 * result["seen"][0]["image_bytes"]  # PNG: smaller than the pickled pixels
    # tool episodes request by request on the rollout rank, a tool returning an image: each trained sample's forward
    # holds its prompt's image and one per tool result, in the tool results' tokens; the engine saw them (its
    # log-probs are the trainer's, as above; without the tool images vLLM reads their tokens as text: 0.058 apart)
    _trained_with_tool_images(tmp_path / "tools.json")
    # turn by turn: the tools' images reach the rollout rank with each later turn's context, each object once
    _trained_with_tool_images(tmp_path / "turns.json")  # the engine saw the prompt's and the tools' images
    turn_jobs = json.loads((tmp_path / "turn_jobs.json").read_text())
    assert turn_jobs and all(job["contexts"] == len(job["images"]) for job in turn_jobs)
    for job in turn_jobs:  # a later turn: its prompt's image, then one per tool result so far; each object once
        assert all(k >= 2 for k in job["images"])
        assert [len(o) for o in job["objects"]] == job["images"]
        prompts, tools_ = {o[0] for o in job["objects"]}, [x for o in job["objects"] for x in o[1:]]
        assert job["distinct"] == len(prompts) + len(set(tools_)) and len(set(tools_)) == len(tools_)
    assert any(job["payloads"] > job["distinct"] for job in turn_jobs)  # a group's prompt image sent once
    # partial: the episodes in flight on the rollout rank, their tools' images come back with them
    _trained_with_tool_images(tmp_path / "partial.json")
    # a rollout_func on image prompts, on the whole batch and partial (group by group on the rollout rank): it saw
    # each prompt's image, the trained samples' forward holds the row's image (4 image tokens), and the engine saw it
    for name, ran_here in (("func", True), ("func_partial", False)):
        run = json.loads((tmp_path / f"{name}.json").read_text())
        seen = run["seen"] if ran_here else json.loads((tmp_path / f"{name}_rank.json").read_text())["seen"]
        assert seen and all(k == 1 for call in seen for k in call)
        steps = [h for h in run["history"] if "reward" in h]
        assert len(steps) == 2 and steps[0]["rollout_corr/logprob_abs_diff_max"] < 1e-2, (name, steps[0])
        trained = [s for step in run["samples"] for s in step]
        assert len(trained) == 2 * 6 and all(s == {"images": 1, "image_tokens": 4} for s in trained), trained


@pytest.mark.fast
def test_a_jobs_images_travel_once_a_group_as_png_bytes_and_read_back_pixel_for_pixel():
    """A job's message holds each group's images once, as PNG bytes (pickled as the rank transport carries it); the
    rollout rank reads back the same pixels, modes and sizes, each group's images shared by its ``n`` samples; what
    PNG cannot hold (a CMYK image) travels as it is; an image object several groups hold (a tool turn's job: the
    contexts of a group share its prompt's image) travels and is read once. Mutations tried: ``encode_job_images``
    leaving the PIL images as they are -> no PNG payload: fails; ``_once_each`` coding every occurrence -> the shared
    image is two payloads: fails."""
    import pickle

    import numpy as np
    from PIL import Image

    from trl_nrollout.rollout.ranks.buckets import PNG_SIGNATURE, job_message, read_job_images

    groups = [[colour_image("red", 1)], [colour_image("blue", 2), colour_image("red", 3).convert("L")], [],
              [Image.new("CMYK", (4, 4), (1, 2, 3, 4))]]
    message = pickle.loads(pickle.dumps(job_message(7, [[1, 2]] * 4, 3, None, images=groups)))
    sent = [x for imgs in message["images"] for x in imgs]
    assert sum(isinstance(x, bytes) and x.startswith(PNG_SIGNATURE) for x in sent) == 3 and len(sent) == 4
    read, images = read_job_images(message, 3, 12)  # samples 3..11: groups 1, 2, 3
    assert len(images) == 9 and all(images[k] is images[3 * (k // 3)] for k in range(9))
    for got, want in zip(read["images"], groups, strict=True):
        assert [(i.mode, i.size) for i in got] == [(i.mode, i.size) for i in want]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
    assert read_job_images(job_message(7, [[1]], 3, None), 0, 3)[1] is None
    # a tool turn's job (one group a context): an image object several contexts hold (their prompt's) is one
    # payload in the pickled message and one image read back; another with equal pixels is its own
    shared, same_pixels = colour_image("red", 4), colour_image("red", 4)
    turn = pickle.loads(pickle.dumps(job_message(8, [[1]] * 3, 1, None, images=[[shared], [shared, same_pixels],
                                                                               [same_pixels]])))
    assert turn["images"][0][0] is turn["images"][1][0] and turn["images"][1][1] is not turn["images"][0][0]
    _, read = read_job_images(turn, 0, 3)
    assert read[0][0] is read[1][0] and read[1][1] is read[2][0] and read[0][0] is not read[1][1]


@given(st.lists(st.lists(st.sampled_from(["red", "blue"]), max_size=3), min_size=1, max_size=4),
       st.integers(0, 3), st.integers(0, 2**16))
def test_a_jobs_images_digest_changes_with_any_pixel_and_not_otherwise(groups, at, seed):
    """A job written ahead is the step's own only if its images are (their digest, trainer rank 0): equal images
    give equal digests; one pixel changed, or an image moved to another group, gives another."""
    from trl_nrollout.rollout.ranks.buckets import images_digest

    images = [[colour_image(c, seed + 7 * g + i) for i, c in enumerate(group)] for g, group in enumerate(groups)]
    again = [[colour_image(c, seed + 7 * g + i) for i, c in enumerate(group)] for g, group in enumerate(groups)]
    assert images_digest(images) == images_digest(again) and images_digest(None) is None
    flat = [(g, i) for g, group in enumerate(images) for i in range(len(group))]
    if flat:
        g, i = flat[at % len(flat)]
        changed = [list(group) for group in images]
        img = changed[g][i].copy()
        x, y = at % img.width, seed % img.height
        r, gr, b = img.getpixel((x, y))
        img.putpixel((x, y), ((r + 1) % 256, gr, b))
        changed[g][i] = img
        assert images_digest(changed) != images_digest(images)
    if len(images) > 1 and images[0]:
        moved = [images[0][1:], [images[0][0], *images[1]], *images[2:]]
        assert images_digest(moved) != images_digest(images)


def test_log_multimodal_puts_the_images_in_the_completions_table(vlm_path, tmp_path, monkeypatch):
    trainer = _hf(tmp_path, monkeypatch, vlm_path, log_completions=True, log_multimodal=True)
    rows = [dict(r) for r in image_dataset(2, seed=8) for _ in range(3)]
    trainer._generate_and_score_completions(rows)
    assert [imgs[0] for imgs in trainer._logs["images"]] == [r["image"] for r in rows]  # TRL's column, in order
    assert len(trainer._logs["prompt"]) == 6
    assert "image" not in str(trainer._logs["prompt"][0][0]["content"][0].keys() - {"type"})  # no pixels in prompts
    quiet = _hf(tmp_path / "quiet", monkeypatch, vlm_path, log_completions=True, log_multimodal=False)
    quiet._generate_and_score_completions(rows)
    assert len(quiet._logs["images"]) == 0 and len(quiet._logs["prompt"]) == 6


@pytest.mark.parametrize("balance", [False, True])
def test_image_tensors_stay_on_their_rank_unless_samples_move(vlm_path, tmp_path, monkeypatch, balance):
    """The pool of a step is gathered to every rank; a VLM's image tensors go with it only where samples change
    ranks (balance_batch, DAPO's selection). Otherwise each rank keeps its own tensors, and the update still sees the
    images (its loss and gradients depend on them)."""
    from trl_nrollout.trainer.stages import Sample

    gathered = []
    real_gather = trainer_module.gather_object

    def spy(obj):
        if isinstance(obj, list) and obj and isinstance(obj[0], Sample):  # the round's samples
            gathered.append([s.mm is not None for s in obj])
        return real_gather(obj)

    monkeypatch.setattr(trainer_module, "gather_object", spy)
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    from trl_nrollout.config import NRolloutConfig

    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=6, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          seed=3, max_steps=2, balance_batch=balance)
    trainer = NRolloutGRPOTrainer(model=vlm_path, reward_funcs=[colour_reward], args=args,
                                  train_dataset=image_dataset(12))
    rows = [dict(r) for r in image_dataset(2, seed=8) for _ in range(3)]
    batch = trainer._generate_and_score_completions(rows)
    assert gathered and all(all(g) if balance else not any(g) for g in gathered)
    assert batch["mm_inputs"] is not None and all(m is not None for m in batch["mm_inputs"])
    assert len(batch["mm_inputs"]) == len(batch["completion_ids"])
