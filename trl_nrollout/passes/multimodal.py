"""Images in the prompts (vision-language models), by TRL's rules.

TRL's ``GRPOTrainer`` takes images from a dataset's ``image`` (one per row) or ``images`` (a list per row) column,
or from ``{"type": "image", "image": ...}`` parts of conversational prompts, and feeds the processor's outputs
(``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ...) to every forward of the model, so the whole
model trains, vision tower included. Here the same happens, a prompt at a time:

- :func:`dataset_images` and :func:`attach_images`: TRL's rules for finding the images and putting them into the
  messages;
- :func:`encode_prompts`: per prompt, the processor's token ids (image placeholders expanded, what the model
  sees), the ids the vLLM engine takes (placeholders not expanded: vLLM expands them itself from
  ``multi_modal_data``) and the processor's image tensors;
- :func:`collate`: the image tensors of the samples of one forward, in one batch (concatenated along the first
  dimension; trailing dimensions zero-padded, which the models read as padding), and the per-token fields
  (``token_type_ids``, ``mm_token_type_ids``) laid out like the ``input_ids`` of that forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

#: Dataset columns that hold images (TRL's names).
IMAGE_COLUMNS = ("image", "images")
#: Processor outputs that run along the prompt's tokens (laid out like ``input_ids``; 0 on completions/padding).
TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")
_TEXT_FIELDS = ("input_ids", "attention_mask")

MMInputs = dict[str, Tensor]


def dataset_images(inputs: Sequence[dict]) -> list[list | None] | None:
    """Images of each row by TRL's rule: ``images`` (a list) or ``image`` (one) column; None when no row has one."""
    if not inputs:
        return None
    if "images" in inputs[0]:
        images = [row.get("images") for row in inputs]
    elif "image" in inputs[0]:
        images = [[row["image"]] if row.get("image") is not None else None for row in inputs]
    else:
        return None
    if all(not imgs for imgs in images):
        return None
    return images


def attach_images(prompts: list, images: list[list | None] | None) -> list:
    """Put each row's dataset images into its messages (TRL's ``prepare_multimodal_messages``: before the first user
    message's text). Conversational prompts only: a prompt already rendered to text has lost its image places."""
    from trl.data_utils import is_conversational, prepare_multimodal_messages

    if images is None:
        return prompts
    if not is_conversational({"prompt": prompts[0]}):
        raise ValueError(
            "the dataset has an image column ('image' or 'images') but its prompts are plain text: images need "
            "conversational prompts (a list of messages), as in TRL; pass the raw messages and let the trainer "
            "apply the chat template.")
    return [prepare_multimodal_messages(p, images=list(imgs or [])) for p, imgs in zip(prompts, images, strict=True)]


def prompt_images(messages: Any) -> list:
    """The images of one conversational prompt, in order (empty for text prompts)."""
    if not isinstance(messages, list):
        return []
    return [part["image"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image" and "image" in part]


def has_images(prompts: Sequence) -> bool:
    """True when any prompt carries an image."""
    return any(prompt_images(p) for p in prompts)


def without_images(messages: Any) -> Any:
    """The prompt with each image replaced by an ``{"type": "image"}`` placeholder (for logs and tables)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p
                                  for p in m["content"]]}
        out.append(m)
    return out


@dataclass
class EncodedPrompts:
    """Per prompt: ``ids`` (what the model sees, image placeholders expanded), ``engine_ids`` (vLLM's input,
    placeholders not expanded), ``images`` (vLLM's ``multi_modal_data``) and ``mm`` (the image tensors of the
    processor, each with a leading dimension of images, patches or 1; None for a prompt without images)."""

    ids: list[list[int]]
    engine_ids: list[list[int]]
    images: list[list]
    mm: list[MMInputs | None] = field(default_factory=list)


def encode_prompts(processor, prompts: Sequence[list], *, tools: list | None = None, chat_template: str | None = None,
                   chat_template_kwargs: dict | None = None) -> EncodedPrompts:
    """Apply the processor's chat template to each conversational prompt ``[P]`` and process its images (a prompt
    equal to the one before it shares its results: the same objects)."""
    kwargs = dict(chat_template_kwargs or {})
    ids, engine_ids, images, mm = [], [], [], []
    tokenizer = getattr(processor, "tokenizer", processor)
    for i, messages in enumerate(prompts):
        if i and messages == prompts[i - 1]:  # TRL repeats each prompt n times: process its images once
            for out in (ids, engine_ids, images, mm):
                out.append(out[-1])
            continue
        common = dict(tools=tools or None, chat_template=chat_template, add_generation_prompt=True, **kwargs)
        imgs = prompt_images(messages)
        if not imgs:
            row = processor.apply_chat_template(messages, tokenize=True, return_dict=True, **common)
            row_ids = list(row["input_ids"])
            row_ids = row_ids[0] if row_ids and isinstance(row_ids[0], list) else row_ids
            ids.append(list(row_ids))
            engine_ids.append(list(row_ids))
            images.append([])
            mm.append(None)
            continue
        out = processor.apply_chat_template([messages], tokenize=True, return_dict=True, return_tensors="pt",
                                            **common)
        text = processor.apply_chat_template(messages, tokenize=False, **common)
        ids.append(out["input_ids"][0].tolist())
        engine_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        images.append(imgs)
        mm.append({k: v for k, v in out.items() if k not in _TEXT_FIELDS and isinstance(v, Tensor)})
    return EncodedPrompts(ids, engine_ids, images, mm)


def _pad_to(t: Tensor, shape: Sequence[int]) -> Tensor:
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    out = t.new_zeros((t.shape[0], *shape))
    out[(slice(None), *[slice(0, s) for s in t.shape[1:]])] = t
    return out


def collate(mms: Sequence[MMInputs | None], device: torch.device | str = "cpu", *, width: int | None = None,
            starts: Sequence[int] | None = None) -> MMInputs:
    """The image tensors of the samples of one forward ``[B]`` as one batch of keyword arguments.

    Image fields are concatenated along their first dimension (images, patches or rows), trailing dimensions
    zero-padded to the largest. Per-token fields (:data:`TOKEN_FIELDS`, ``[1, P_i]``) become ``[B, width]``
    zeros with sample ``i``'s values at ``starts[i]`` (where its prompt begins in the forward's ``input_ids``).
    Samples without images (None) contribute nothing; an empty dict when no sample has images.
    """
    present = [m for m in mms if m]
    if not present:
        return {}
    out: MMInputs = {}
    for key in present[0]:
        if key in TOKEN_FIELDS:
            if width is None or starts is None:
                raise ValueError(f"the processor's {key!r} runs along the tokens: collate needs width and starts.")
            rows = torch.zeros(len(mms), width, dtype=present[0][key].dtype)
            for r, m in enumerate(mms):
                if m and key in m:
                    v = m[key].reshape(-1)
                    rows[r, starts[r]:starts[r] + v.numel()] = v
            out[key] = rows.to(device)
            continue
        parts = [m[key] for m in present if key in m]
        if parts[0].dim() == 0:
            out[key] = parts[0].to(device)
            continue
        trailing = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        out[key] = torch.cat([_pad_to(p, trailing) for p in parts]).to(device)
    return out


def check_expansion(engine_ids: Sequence[Sequence[int]], processor_ids: Sequence[Sequence[int]]) -> None:
    """vLLM expands each image placeholder itself; the trainer scores the processor's expansion. They must agree
    token for token, or the trainer would score completions under another prompt than they were sampled from."""
    for i, (a, b) in enumerate(zip(engine_ids, processor_ids, strict=True)):
        if list(a) != list(b):
            raise ValueError(
                f"sample {i}: vLLM expanded the prompt's image placeholders into {len(a)} tokens, the model's "
                f"processor into {len(b)}: the engine would sample under another prompt than the trainer scores. "
                "Check that the processor's settings (image size, image_seq_len, patch and merge sizes) match the "
                "model's config, or set rollout_backend='hf'.")


def image_tensors(processor, images: Sequence) -> MMInputs:
    """The processor's image tensors of one sample's ``images`` (its prompt's and its tools', in order), as TRL's
    tool loop and forward compute them (``processor.image_processor`` over the images), with a leading dimension of
    1: one sample, as :func:`collate` takes it."""
    out = processor.image_processor(images=[list(images)], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, Tensor)}


def engine_suffix_ids(processor, tool_messages: list[dict], *, chat_template: str | None = None,
                      chat_template_kwargs: dict | None = None) -> list[int]:
    """The tokens of tool results and the next assistant header with image placeholders unexpanded (what an engine
    that expands images itself takes): TRL's ``_get_tool_suffix_ids`` rule (a dummy conversation with and without the
    results, the prefix cut after its last EOS), on the rendered text tokenized without the processor."""
    from trl.data_utils import prepare_multimodal_messages

    tokenizer = getattr(processor, "tokenizer", processor)
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = prepare_multimodal_messages([{"role": "user", "content": "dummy"},
                                         {"role": "assistant", "content": "", "tool_calls": calls}])
    kwargs = dict(chat_template=chat_template, tokenize=False, **(chat_template_kwargs or {}))
    prefix_text = processor.apply_chat_template(dummy, add_generation_prompt=False, **kwargs)
    full_text = processor.apply_chat_template(dummy + prepare_multimodal_messages(list(tool_messages)),
                                              add_generation_prompt=True, **kwargs)
    prefix = tokenizer(prefix_text, add_special_tokens=False)["input_ids"]
    full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template does not preserve prefixes: the tool results' tokens cannot be cut out "
                         "of the rendered conversation (TRL's rule for multi-turn templates).")
    return full[len(prefix):]
