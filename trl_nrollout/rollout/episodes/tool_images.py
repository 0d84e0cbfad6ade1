"""Images in multi-turn episodes: a tool that returns content blocks with images (TRL 1.16's contract).

TRL's rule (``GRPOTrainer._tool_call_loop``): a tool may return a list of content blocks
(``[{"type": "image", "image": <PIL image>}, {"type": "text", "text": ...}]``); the tool message keeps them, its
images are appended to the sample's images (after its prompt's, in call order), the chat template renders their
placeholders into the tool-response tokens, and the next turn's prompt carries them. Results dropped because they do
not fit drop their images too.

An engine that expands image placeholders itself (vLLM) takes each context with the placeholders unexpanded and the
images; the HF engine and the trainer's forward take the processor's expansion and its image tensors. A sample keeps
both forms (:class:`~trl_nrollout.rollout.episodes.tools.AgentSample`'s ``engine_completion``); this module holds what
turns one into the other for one episode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnMedia", "TurnView", "message_images"]


def message_images(messages: list[dict]) -> list:
    """The images of tool ``messages``, in order (TRL's rule: ``{"type": "image", "image": ...}`` blocks of a list
    content)."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, dict) and part.get("type") == "image"]


@dataclass(frozen=True)
class TurnView:
    """One continuing sample as an engine takes its next turn: ``images`` (its prompt's, then its tools', in order)
    and ``engine_context`` (its context with the placeholders unexpanded)."""

    images: list
    engine_context: list[int]


@dataclass(frozen=True)
class TurnMedia:
    """The images of one rollout's multi-turn samples (this rank's, index ``i``): ``prompt_images[i]`` (its prompt's,
    maybe empty), ``engine_prompts[i]`` (its prompt with the placeholders unexpanded) and ``engine_suffix(tool
    messages)``: the tool results' tokens as :func:`~trl_nrollout.rollout.episodes.tools.run_tool_turns`'
    ``suffix_ids`` renders them, placeholders unexpanded."""

    prompt_images: list[list]
    engine_prompts: list[list[int]]
    engine_suffix: Callable[[list[dict]], list[int]]

    def view(self, i: int, sample: Any) -> TurnView:
        """Sample ``i`` (an ``AgentSample``) as its next turn's engine call takes it."""
        tail = sample.engine_completion if sample.engine_completion is not None else sample.completion_ids
        return TurnView(list(self.prompt_images[i]) + list(sample.images), list(self.engine_prompts[i]) + list(tail))

    def sample_images(self, i: int, sample: Any) -> list:
        """Every image of sample ``i``'s episode, in the order its tokens hold them."""
        return list(self.prompt_images[i]) + list(sample.images)
