"""Images returned by tools (TRL 1.16's contract): the tool's content blocks reach the next turn's prompt, on the HF
engine as in TRL's ``GRPOTrainer`` and on vLLM, and the trainer's forward sees the pixels the engine saw.

The model is ``builtin:tiny-idefics3-tools`` (the built-in VLM with a tool-calling template and one token that calls
``show_picture``, a tool returning an image and a caption). A ``sequence_bias`` on that token makes the random
model call the tool at most turns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

import trl_nrollout.builtin as builtin
import trl_nrollout.trainer.grpo as trainer_module
from trl_nrollout import NRolloutGRPOTrainer
from trl_nrollout.builtin import (
    PICTURE_CALL_TOKEN,
    colour_image,
    colour_reward,
    image_dataset,
    resolve_model,
    show_picture,
)
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.rollout.episodes.tool_images import TurnMedia, message_images
from trl_nrollout.rollout.episodes.tools import AgentSample, run_tool_turns
from trl_nrollout.rollout.types import RolloutBatch


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model("builtin:tiny-idefics3-tools")


def _config(tmp_path, call: int, cls=GRPOConfig, **kw) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3, max_completion_length=64,
                use_cpu=True, report_to="none", bf16=False, save_strategy="no", seed=3, max_steps=1,
                max_tool_calling_iterations=2, generation_kwargs={"sequence_bias": {(call,): 4.0}})
    base.update(kw)
    return cls(**base)


def _call_token(path: str) -> int:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path).tokenizer.convert_tokens_to_ids(PICTURE_CALL_TOKEN)


# ---------------------------------------------------------------------------------------------- pure loop
@pytest.mark.fast
def test_tool_images_enter_the_next_turns_context_and_leave_with_dropped_results():
    """A tool's images follow the prompt's into the next turn's engine view (placeholders unexpanded there, expanded
    in the trained tokens); results that do not fit are dropped with their images, as TRL rolls them back.
    Mutation tried: ``add_tool_results`` not appending ``images`` -> the view's images assertion fails."""
    red, blue = object(), object()
    tool_message = {"role": "tool", "name": "t", "content": [{"type": "image", "image": blue},
                                                              {"type": "text", "text": "x"}]}
    assert message_images([tool_message]) == [blue]
    first = RolloutBatch([[1, 9, 9, 9, 2], [1, 2]], [[5], [5]], [[-0.1], [-0.1]], ["stop", "stop"], [0, 1])
    media = TurnMedia([[red], []], [[1, 9, 2], [1, 2]], lambda msgs: [7, 9, 8])
    seen = []

    def generate(contexts, budgets, turn, samples, views):
        seen.append((contexts, views))
        return RolloutBatch(contexts, [[3, 4] for _ in contexts], [[-1.0, -1.0] for _ in contexts],
                            ["stop"] * len(contexts), list(range(len(contexts))))

    turns = run_tool_turns(
        first, parse=lambda i, ids, prefix: {"role": "assistant", "content": "",
                                             "tool_calls": [{"type": "function", "function": {"name": "t"}}]
                                             if ids == [5] else None},
        run_tools=lambda i, calls: ([tool_message], 0), suffix_ids=lambda msgs: [7, 9, 9, 9, 8] if msgs[0] else [],
        generate=generate, any_rank=bool, max_iterations=1, max_completion_length=8, max_model_len=100, media=media)
    contexts, views = seen[0]
    assert contexts == [[1, 9, 9, 9, 2, 5, 7, 9, 9, 9, 8], [1, 2, 5, 7, 9, 9, 9, 8]]  # expanded: what is trained
    assert [v.images for v in views] == [[red, blue], [blue]]  # the prompt's, then the tool's
    assert [v.engine_context for v in views] == [[1, 9, 2, 5, 7, 9, 8], [1, 2, 5, 7, 9, 8]]  # unexpanded
    assert turns.images == [[blue], [blue]] and turns.tool_mask[1] == [1, 0, 0, 0, 0, 0, 1, 1]
    sample = AgentSample.first_turn([1], [5], [-0.1], "stop", {"role": "assistant", "tool_calls": [{}]})
    assert sample.add_tool_results([tool_message], 0, [7] * 9, 8, 100, [blue], [7]) is None  # does not fit
    assert sample.images == [] and sample.engine_completion is None
    with pytest.raises(ValueError, match="does not carry tool images yet"):  # a loop without images refuses them
        sample.add_tool_results([tool_message], 0, [7], 8, 100)


# ---------------------------------------------------------------------------------------------- TRL's own
def _turn_inputs(calls: list[dict], skip: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The generate calls after the first ``skip``: each row's ids without padding, and the real images' pixels in
    the order the model assigns them to image tokens (rows in order, images in order; zero padding dropped)."""
    rows, pixels = [], []
    for call in calls[skip:]:
        rows += [call["input_ids"][r][call["attention_mask"][r].bool()].tolist() for r in range(len(call["input_ids"]))]
        pixels += [p for p in call["pixel_values"].reshape(-1, 3, 56, 56) if p.abs().sum() > 0]
    return rows, pixels


class _PictureEnv:
    """A TRL environment: its reset's observation is a picture of the row's colour (an image prompt without an image
    column), and its ``show_picture`` method returns pictures of the other colour."""

    def reset(self, **row) -> list:
        self.shown = 0
        return [{"type": "image", "image": colour_image(row["colour"], seed=5)}, {"type": "text", "text": " look"}]

    def show_picture(self) -> list:
        """Shows the picture to describe.

        Returns:
            The picture and a caption.
        """
        self.shown += 1
        return [{"type": "image", "image": colour_image("blue", seed=self.shown)}, {"type": "text", "text": "here"}]


@pytest.mark.slow
@pytest.mark.parametrize("episode", ["tools", "environment_factory"])
def test_tool_images_reach_the_model_as_in_trls_grpo_trainer_on_the_hf_engine(path, tmp_path, monkeypatch, episode):
    """TRL's ``GRPOTrainer`` and ours, the same tool results (``show_picture`` from the same start; or an
    environment whose reset shows a picture and whose method shows more), near-greedy sampling: every later turn's
    generate gets the same tokens (the tool's image placeholders expanded) and the same pixels, sample by sample;
    the samples, tool masks and the forward's per-sample pixels are equal. (TRL passes Gemma's ``token_type_ids``,
    all zeros here, which Idefics3's generate refuses: the spy drops them.) Mutation tried: ``TurnMedia.view``
    without the tool's images -> the later turns' pixels differ."""
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    call = _call_token(path)
    dataset = image_dataset(12)
    kwargs: dict = {"tools": [show_picture]}
    if episode == "environment_factory":
        dataset, kwargs = dataset.remove_columns("image"), {"environment_factory": _PictureEnv}
    rows = [dict(r) for r in dataset.select(range(2)) for _ in range(3)]
    seen = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        trainer = cls(model=path, reward_funcs=[colour_reward], args=_config(tmp_path / name, call, temperature=1e-3),
                      train_dataset=dataset, **kwargs)
        calls, generate = [], trainer.model.generate

        def spy(*args, _generate=generate, _calls=calls, **kwargs):
            zeros = kwargs.pop("token_type_ids", None)
            assert zeros is None or not zeros.any()
            _calls.append({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            return _generate(*args, **kwargs)

        trainer.model.generate = spy
        monkeypatch.setattr(builtin, "_pictures_shown", 0)
        torch.manual_seed(0)
        seen[name] = (trainer._generate_and_score_completions(rows), calls)
    (theirs, trl_calls), (ours, our_calls) = seen["trl"], seen["ours"]
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    mask = theirs["tool_mask"]
    assert torch.equal(ours["tool_mask"], mask) and (mask == 0).any(), "no tool result: the test tests nothing"
    (trl_rows, trl_pixels), (our_rows, our_pixels) = _turn_inputs(trl_calls, 1), _turn_inputs(our_calls, 1)
    assert our_rows == trl_rows and len(our_rows) > 0  # the turns after the first: image placeholders expanded
    assert len(our_pixels) == len(trl_pixels) >= 2 * len(our_rows)  # each row: its prompt's image and its tools'
    for a, b in zip(our_pixels, trl_pixels):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flat = theirs["pixel_values"].reshape(-1, 3, 56, 56)
    flat = [p for p in flat if p.abs().sum() > 0]
    mine = [p for m in ours["mm_inputs"] for p in m["pixel_values"].reshape(-1, 3, 56, 56) if p.abs().sum() > 0]
    assert len(mine) == len(flat) == sum(theirs["num_images"]) > 6
    for a, b in zip(mine, flat):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the forward
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("multi_turn", ["turns", "requests"])
def test_the_trainers_forward_sees_the_tool_images_vllm_saw(path, tmp_path, multi_turn):
    """On vLLM, turn by turn and request by request: multi-turn samples whose tools returned images; the trainer's
    log-probs over the recorded tokens (prompt + turns + tool results with their image tokens) with the episode's
    image tensors equal vLLM's within the bound text samples meet; a swapped tool image moves them. Then a training
    step runs. Mutation tried: the request loop's ``continue_request`` given no view (the tool image never reaches
    vLLM, which reads its image tokens as text) -> the log-probs differ by 0.058: fails."""
    from dataclasses import replace

    from trl_nrollout import NRolloutConfig

    call = _call_token(path)
    args = _config(tmp_path, call, NRolloutConfig, use_vllm=True, max_steps=1, logging_steps=1, generation_kwargs={},
                   rollout_multi_turn=multi_turn)
    trainer = NRolloutGRPOTrainer(model=path, reward_funcs=[colour_reward], train_dataset=image_dataset(12),
                                  tools=[show_picture], args=args)
    with torch.no_grad():  # the model itself calls the tool often (vLLM's logit_bias would move its log-probs): the
        # call token's (tied) embedding along the mean final hidden state, then synced to vLLM
        ids = torch.tensor([trainer.processing_class.tokenizer("user: write a number").input_ids])
        hidden = trainer.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        direction = trainer.model.model.text_model.norm(hidden).mean(0)
        trainer.model.get_input_embeddings().weight[call] = 3.0 * direction / direction.norm() ** 2
    trainer.rollout_engine.load_weights(trainer.model)
    rows = [dict(r) for r in image_dataset(2, seed=4) for _ in range(3)]
    sampling = replace(trainer._sampling("train"), suppress_token_ids=())  # scored without suppression (test_vlm)
    builtin._pictures_shown = 0
    batch, _, episode = trainer._rollout(rows, 3, sampling)
    masks = episode.tool_mask
    mm = episode.mm
    with_tool = [i for i, m in enumerate(mm) if m["pixel_values"].shape[1] > 1]  # the prompt's image and a tool's
    assert with_tool, "no tool image: the test tests nothing"

    def drift(mm_inputs) -> float:
        mine = compute_log_probs(trainer.model, batch.prompt_ids, batch.completion_ids, mm_inputs=mm_inputs,
                                 temperature=trainer.temperature).logprobs
        return max((mine[i, :len(lp)] - torch.tensor(lp)).abs()[torch.tensor(m, dtype=torch.bool)].max().item()
                   for i, (lp, m) in enumerate(zip(batch.logprobs, masks)))

    assert drift(mm) < 1e-4  # measured: see the report
    swapped, with_tool = list(mm), with_tool[0]
    pixels = swapped[with_tool]["pixel_values"].clone()
    other = trainer.collector.parts.tools.image_tensors([colour_image("blue", seed=99)])["pixel_values"][0, 0]
    pixels[0, -1] = other  # the tool's (last) image replaced
    swapped[with_tool] = {**swapped[with_tool], "pixel_values": pixels}
    assert drift(swapped) > 1e-3
    if multi_turn == "requests":  # the same rollout from a balanced queue, on the same engine, equals the shares'
        _balanced_equals_shares(trainer, rows, sampling, batch, episode, drift)
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] > 0
    trainer.close()


def _balanced_equals_shares(trainer, rows, sampling, batch, episode, drift) -> None:
    """``rollout_dispatch='balanced'`` on the same trainer and engine (one engine: the queue's driver runs its share,
    ``run_agents_balanced``'s fallback; two engines pulling each other's groups: tests/test_combinations.py::
    test_partial_tool_episodes_on_a_balanced_queue_over_two_engines): sample by sample the same tokens, the same
    images in the forward (the prompt's and the tools', pixel for pixel) and the trainer's log-probs the engine's.
    Mutation tried: the balanced driver's fallback without ``images=`` (the prompts' images dropped) -> vLLM is
    given the prompts' placeholders without their images: the rollout fails."""
    from dataclasses import replace

    from trl_nrollout.rollout.axes import dispatch_rule

    collector = trainer.collector
    shares_kind = collector.kind
    collector.kind = replace(shares_kind, rule=dispatch_rule("balanced"))
    builtin._pictures_shown = 0  # the tool shows the same pictures in the same order
    try:
        queued, _, queued_episode = trainer._rollout(rows, 3, sampling)
    finally:
        collector.kind = shares_kind
    assert queued.completion_ids == batch.completion_ids and queued_episode.tool_mask == episode.tool_mask
    for mine, theirs in zip(queued_episode.mm, episode.mm, strict=True):
        torch.testing.assert_close(mine["pixel_values"], theirs["pixel_values"], rtol=0, atol=0)
    assert drift(queued_episode.mm) < 1e-4


# ---------------------------------------------------------------------------------------------- rollout_func
@pytest.mark.slow
def test_a_rollout_funcs_image_prompts_reach_the_forward_as_in_trl(path, tmp_path, monkeypatch):
    """TRL's contract for a ``rollout_func`` with image prompts: the function gets the prompts with their images,
    returns ``prompt_ids`` holding the processor's expansion, and the forward takes the dataset's images. TRL's
    ``GRPOTrainer`` and ours with the same function: the same prompt ids, and the same pixels per sample in the
    forward. Mutation tried: ``RolloutFunc`` leaving ``Episode.mm`` unset -> no image tensors: fails."""
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    rows = [dict(r) for r in image_dataset(2, seed=4) for _ in range(3)]

    def rollout_func(prompts, trainer):
        processor = trainer.processing_class
        ids = [processor.apply_chat_template([p], tokenize=True, add_generation_prompt=True)[0] for p in prompts]
        assert all(any(part.get("type") == "image" for m in p for part in m["content"] if isinstance(part, dict))
                   for p in prompts)  # the function sees the images
        return {"prompt_ids": ids, "completion_ids": [[44, 45, 46]] * len(ids), "logprobs": [[-1.0] * 3] * len(ids)}

    seen = {}
    for name, cls in (("trl", GRPOTrainer), ("ours", NRolloutGRPOTrainer)):
        trainer = cls(model=path, reward_funcs=[colour_reward], train_dataset=image_dataset(12),
                      args=_config(tmp_path / name, 1, generation_kwargs={}), rollout_func=rollout_func)
        seen[name] = trainer._generate_and_score_completions(rows)
    theirs, ours = seen["trl"], seen["ours"]
    assert torch.equal(ours["prompt_ids"], theirs["prompt_ids"])
    assert ours["mm_inputs"] is not None and len(ours["mm_inputs"]) == 6
    mine = torch.cat([m["pixel_values"] for m in ours["mm_inputs"]])
    torch.testing.assert_close(mine, theirs["pixel_values"], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_rollout_func_run_group_by_group_carries_its_image_prompts_to_vllm_and_the_forward(tmp_path):
    """A ``rollout_func`` run group by group (``rollout_multi_turn='requests'``, and ``rollout_partial=True``'s pool)
    on a VLM, TRL's contract as the
    whole-batch call keeps it: each group's function gets its prompts with the row's image in the messages, sends
    them to ``trainer.rollout_engine.generate_expanded(..., images=)`` (placeholders unexpanded), gets back vLLM's
    expansion as ``prompt_ids`` (the processor's), and the forward takes the rows' images: the trainer's log-probs on
    the returned samples equal vLLM's within 1e-4, a swapped image moves them past 1e-3. Mutations tried: see the
    report."""
    from dataclasses import replace

    from trl_nrollout import NRolloutConfig
    from trl_nrollout.passes.multimodal import encode_prompts, image_tensors, prompt_images
    from trl_nrollout.rollout.types import SamplingOptions

    seen: list[list] = []

    def rollout_func(prompts, trainer):
        processor = trainer.processing_class
        images = [prompt_images(p) for p in prompts]
        seen.append(images)
        ids = [processor.tokenizer(processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)["input_ids"] for p in prompts]
        batch = trainer.rollout_engine.generate_expanded(
            ids, 1, SamplingOptions(max_tokens=8, temperature=trainer.temperature, seed=5), images=images)
        # the random model may sample an image token, which no forward can read: each completion is cut before it
        # (the trainer's own sampling suppresses them; vLLM's log-probs are then not the forward's)
        cut = [next((k for k, t in enumerate(c) if t in image_tokens), len(c)) for c in batch.completion_ids]
        return {"prompt_ids": batch.prompt_ids, "completion_ids": [c[:k] for c, k in zip(batch.completion_ids, cut)],
                "logprobs": [lp[:k] for lp, k in zip(batch.logprobs, cut)]}

    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=8, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          seed=3, max_steps=1, logging_steps=1, use_vllm=True, rollout_multi_turn="requests",
                          rollout_partial=True)  # (the collector's rollout runs group by group, as requests)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-idefics3", reward_funcs=[colour_reward],
                                  train_dataset=image_dataset(12), rollout_func=rollout_func, args=args)
    image_tokens = set(trainer.engine_setup.image_token_ids())
    rows = [dict(r) for r in image_dataset(2, seed=4) for _ in range(3)]
    batch, prompts, episode = trainer._rollout(rows, 3, replace(trainer._sampling("train"), suppress_token_ids=()))
    pixels = [np.asarray(r["image"]).tolist() for r in rows]
    assert len(seen) == 2 and [np.asarray(i).tolist() for g in seen for imgs in g for i in imgs] == pixels
    processor = trainer.processing_class
    assert batch.prompt_ids == encode_prompts(processor, prompts).ids  # vLLM's expansion: the processor's
    mm = episode.mm
    for row, m in zip(rows, mm, strict=True):  # the forward takes the rows' images
        torch.testing.assert_close(m["pixel_values"], image_tensors(processor, [row["image"]])["pixel_values"],
                                   rtol=0, atol=0)

    def drift(mm_inputs) -> float:
        mine = compute_log_probs(trainer.model, batch.prompt_ids, batch.completion_ids, mm_inputs=mm_inputs,
                                 temperature=trainer.temperature).logprobs
        return max((mine[i, :len(lp)] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(batch.logprobs)
                   if lp)

    measured, moved = drift(mm), drift(mm[3:] + mm[:3])  # the groups' images swapped (red and blue here)
    print(f"rollout_func group by group, image drift: {measured:.2e}; swapped: {moved:.2e}")
    assert {r["colour"] for r in rows[:3]} != {r["colour"] for r in rows[3:]}, "one colour: the swap swaps nothing"
    assert measured < 1e-4 and moved > 1e-3
    # partial rollouts (rollout_partial=True) run the function group by group in the pool: a training step's rows
    # train on the forward's images of their rows; before the update their log-probs equal vLLM's
    from trl_nrollout.trainer import grpo as grpo_module

    trained, assign = [], grpo_module.assign

    def spy_assign(*a, **kw):
        rows_ = assign(*a, **kw)
        samples = [s for s in rows_.samples if s.logprobs]
        for row, m in zip(a[0].rows, rows_.mm, strict=True):  # (one rank: the round's rows are the trained ones)
            torch.testing.assert_close(m["pixel_values"], image_tensors(processor, [row["image"]])["pixel_values"],
                                       rtol=0, atol=0)
        mine = compute_log_probs(trainer.model, [s.prompt_ids for s in rows_.samples],
                                 [s.completion_ids for s in rows_.samples], mm_inputs=rows_.mm,
                                 temperature=trainer.temperature).logprobs
        other = {c: image_tensors(processor, [colour_image(c, seed=99)])["pixel_values"] for c in ("red", "blue")}
        far = [max(other.values(), key=lambda p, m=m: (p - m["pixel_values"]).abs().mean().item()) for m in rows_.mm]
        swapped = compute_log_probs(trainer.model, [s.prompt_ids for s in rows_.samples],
                                    [s.completion_ids for s in rows_.samples], temperature=trainer.temperature,
                                    mm_inputs=[{**m, "pixel_values": p} for m, p in zip(rows_.mm, far)]).logprobs
        trained.append((len(samples), *(max((lp[i, :len(s.logprobs)] - torch.tensor(s.logprobs)).abs().max().item()
                                            for i, s in enumerate(rows_.samples) if s.logprobs)
                                        for lp in (mine, swapped))))
        return rows_

    seen.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo_module, "assign", spy_assign)
        trainer.train()
    print(f"rollout_func partial, trained rows, image drift and swapped: {trained}")
    assert seen and all(len(imgs) == 1 for g in seen for imgs in g)  # every group's prompts held their image
    assert len(trained) == 1 and trained[0][0] > 0 and trained[0][1] < 1e-4 and trained[0][2] > 1e-3
    assert trainer.state.log_history[0]["partial/pool_groups"] >= 0
    trainer.close()
