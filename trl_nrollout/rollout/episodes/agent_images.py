"""Images in agents' calls: OpenAI ``image_url`` parts on a vision-language policy's endpoint.

An agent sends an image as OpenAI does, a content part ``{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}``. The endpoint (:mod:`trl_nrollout.rollout.episodes.endpoint`) fetches nothing: a data URL (base64
PNG, JPEG or any format PIL reads) is decoded here into a PIL image and becomes TRL's ``{"type": "image", "image":
<PIL image>}`` block, in the agent's order; an http(s) URL is refused with the fix (send a data URL).

A call's prompt then has two forms, as a tool episode's do (:mod:`trl_nrollout.rollout.episodes.tool_images`): the
rendered text tokenized with the image placeholders unexpanded (what vLLM takes with the images, expanding them
itself) and the processor's expansion (what the trainer's forward takes with the processor's image tensors).
:func:`render_ids` gives either form of a conversation; :class:`CallMedia` is what a call records of its images.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass, field

__all__ = ["CallMedia", "data_url_image", "expansion_apart", "image_blocks", "render_ids"]

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.DOTALL)


@dataclass(frozen=True)
class CallMedia:
    """The images of one call's prompt: ``expanded`` ``[P']`` (its prompt with the processor's expansion of the
    placeholders) and ``images`` (every image of the prompt, in order: the episode's earlier calls' first)."""

    expanded: list[int]
    images: list = field(default_factory=list)


def url_refusal(i: int, url: str) -> str | None:
    """Why the ``image_url`` ``url`` of ``messages[i]`` cannot be taken (None: it is a data URL)."""
    if url.startswith(("http://", "https://")):
        return (f"messages[{i}].content has an image_url part with an http(s) URL ({url[:60]!r}): this endpoint "
                "fetches nothing; send the image inline as a data URL (data:image/png;base64,...).")
    if not url.startswith("data:"):
        return (f"messages[{i}].content has an image_url part whose url is {url[:40]!r}: send the image inline as a "
                "data URL (data:image/png;base64,... or data:image/jpeg;base64,...).")
    return None


def part_url(i: int, part: dict) -> str:
    """The URL of an ``image_url`` part (OpenAI's ``{"image_url": {"url": ...}}``; a bare string is taken too)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ValueError(f"messages[{i}].content has an image_url part without a url: send "
                         '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}.')
    return url


def data_url_image(i: int, url: str):
    """The PIL image of a base64 data URL in ``messages[i]`` (decoded now, nothing fetched). ValueError naming the
    message for an http(s) URL, a URL that is not base64 data, or bytes PIL cannot read."""
    from PIL import Image, UnidentifiedImageError

    why = url_refusal(i, url)
    if why is not None:
        raise ValueError(why)
    match = _DATA_URL.match(url)
    if match is None:
        raise ValueError(f"messages[{i}].content has an image_url data URL that is not base64 ({url[:40]!r}...): "
                         "send data:image/png;base64,<the PNG's bytes in base64>.")
    try:
        raw = base64.b64decode(match["data"], validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as err:
        raise ValueError(f"messages[{i}].content has an image_url data URL whose bytes are not an image PIL reads "
                         f"({type(err).__name__}: {err}); send a base64 PNG or JPEG.") from None
    return image


def image_blocks(i: int, content: list) -> list[dict]:
    """A message's OpenAI content parts as TRL's typed blocks: text parts as ``{"type": "text"}``, ``image_url``
    parts (data URLs) as ``{"type": "image", "image": <PIL image>}``, in order."""
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            out.append({"type": "image", "image": data_url_image(i, part_url(i, part))})
        else:
            raise ValueError(f"messages[{i}].content has a part of type {kind!r}: send text and image_url parts "
                             "only.")
    return out


def expansion_apart(expanded: list[int] | None, images: int, engine_prompt: list[int], kept: int) -> str | None:
    """Why a call's prompt with ``images`` images, which vLLM expanded into ``engine_prompt`` (its ``kept`` tokens of
    an earlier step after it), is not the processor's ``expanded`` (None: the same, or no images): the trainer would
    score the completion under another prompt than it was sampled from."""
    if expanded is None or list(engine_prompt[:len(expanded)]) == list(expanded):
        return None
    return (f"vLLM expanded this call's {images} image(s) into a prompt of {len(engine_prompt) - kept} tokens, the "
            f"model's processor into {len(expanded)}: the trainer would score another prompt than vLLM sampled "
            "from. Check that the processor's settings (image size, image_seq_len) match the model's.")


def render_ids(processor, messages: list[dict], tools: list | None, generation: bool, expanded: bool) -> list[int]:
    """``messages`` (with image blocks) through the processor's chat template: the text tokenized with the image
    placeholders unexpanded (``expanded=False``: what vLLM takes) or the processor's expansion (``expanded=True``:
    what the trainer's forward takes), as :func:`~trl_nrollout.passes.multimodal.encode_prompts` renders prompts."""
    common = dict(tools=tools or None, add_generation_prompt=generation)
    if expanded:
        out = processor.apply_chat_template([messages], tokenize=True, return_dict=True, return_tensors="pt", **common)
        return out["input_ids"][0].tolist()
    text = processor.apply_chat_template(messages, tokenize=False, **common)
    tokenizer = getattr(processor, "tokenizer", processor)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
