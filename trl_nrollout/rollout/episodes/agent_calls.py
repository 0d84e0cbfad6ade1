"""What an agent's episode trains on: its calls to the endpoint, recorded token in, token out, and laid out as samples.

An agent (the user's loop in any framework) talks to the policy through the OpenAI-compatible endpoint
(:mod:`trl_nrollout.rollout.episodes.endpoint`); every call of an episode is recorded as a :class:`Call`: the prompt's
token ids as the engine saw them, the completion's token ids and the engine's log-probs, exactly as generated (no
re-tokenization of the agent's text). :func:`assemble` turns an episode's calls into what trains:

- **one sample** when each call's prompt extends the previous call's prompt + completion token for token (the agent
  appended messages, as a chat loop does; the endpoint then builds the prompt from the recorded tokens): the first
  call's prompt, then every completion, with the tokens between them (tool results, user turns, the next assistant
  header) in the completion masked 0, as TRL's tool mask;
- **split** when a call's prompt does not (the agent edited its history): each call would train as its own sample
  with the episode's advantage. :class:`Assembled` then holds the calls' segments, and the trainer says how many
  episodes split.

:class:`PendingCall` is a call on its way to the engine (the endpoint queues it, the engine's loop answers it), with
the tokens a call cut by a step's end keeps (:func:`safe_cut`) and their versions. Pure: no engine, no server, no
torch.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

#: how an episode ended beyond its agent returning: ``ok``; ``error`` (the agent raised: an unscored episode, TRL's
#: None rules); ``timeout`` (past ``agent_timeout_s``); ``calls`` (a call past ``agent_max_calls`` was refused);
#: ``tokens`` (a call past the episode's ``max_completion_length`` tokens was refused). After a refused call the
#: episode's reward is what its agent returns (None if it raises: the limit stays its outcome)
OUTCOMES = ("ok", "error", "timeout", "calls", "tokens")


@dataclass
class Call:
    """One call of an episode: ``prompt_ids`` ``[P]`` as the engine saw them, ``completion_ids`` ``[C]`` and their
    ``logprobs`` ``[C]`` (the engine's), ``finish_reason`` (``stop`` / ``length`` / ``tool_calls``), ``extends``
    (its prompt starts with the previous call's prompt + completion: built from the recorded tokens). A vision-language
    policy's call with images (OpenAI ``image_url`` parts): ``images``, every image of its prompt in order (PIL), and
    ``expanded_ids``, its prompt with the processor's expansion of their placeholders (what the trainer's forward
    takes; ``prompt_ids`` keep them unexpanded, as vLLM takes them); None for a call without images. ``versions``
    ``[C]``: the policy version that drew each completion token (a call continued across a step's end, partial
    rollouts, has tokens of two or more versions; empty where the caller did not tag them)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    extends: bool = False
    images: list = field(default_factory=list)
    expanded_ids: list[int] | None = None
    versions: list[int] = field(default_factory=list)

    @property
    def trained_prompt(self) -> list[int]:
        """The prompt as the trainer's forward takes it (image placeholders expanded, where it has images)."""
        return self.prompt_ids if self.expanded_ids is None else self.expanded_ids


@dataclass
class PendingCall:
    """A request on its way to the engine: ``prompt_ids`` ``[P]``, at most ``max_tokens`` new tokens, ``stop``
    strings, the sample's ``seed``, its own ``sampling`` (a ``SamplingOptions``: a ``rollout_func``'s call, run
    group by group; None: the trainer's); ``future`` gets ``(completion_ids, logprobs, finish_reason)`` or an
    exception. ``kept_ids`` / ``kept_logprobs`` ``[K]``: the tokens the call drew before a step ended and the engine
    aborted it (partial rollouts); it continues from ``prompt_ids + kept_ids`` on the next step's weights (its seed
    moved by ``K``, so the continuation does not replay the first draws' random stream), and its answer is the kept
    tokens then the new ones, each with the log-prob of the policy that drew it; ``kept_versions`` ``[K]``: the
    policy version that drew each kept token, and once answered ``versions`` ``[C]`` every token's (the kept ones'
    then the serve's own ``version``). A call with ``stop`` strings keeps its tokens up to the last place where no
    stop string could straddle the cut (:func:`safe_cut`); the tokens after it are drawn again."""

    key: str
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    seed: int | None
    sampling: Any = None
    future: Future = field(default_factory=Future)
    kept_ids: list[int] = field(default_factory=list)
    kept_logprobs: list[float] = field(default_factory=list)
    kept_versions: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: a vision-language policy's call: its prompt's images (vLLM's ``multi_modal_data``) and the processor's
    #: expansion of ``prompt_ids`` (checked against vLLM's own when the call ends); empty / None without images
    images: list = field(default_factory=list)
    expanded: list[int] | None = None
    #: a call with images, once it ran: its prompt as vLLM expanded it (what a ``rollout_func``'s call returns as
    #: ``prompt_ids``, as the whole-batch engine call does); None before, or without images
    engine_prompt: list[int] | None = None

    def continuation(self) -> tuple[list[int], int, list[str], int | None]:
        """What the engine runs now: the prompt with the kept tokens, the tokens left of ``max_tokens``, the stop
        strings and the seed (moved by the kept tokens' count)."""
        seed = self.seed if self.seed is None or not self.kept_ids else self.seed + len(self.kept_ids)
        return self.prompt_ids + self.kept_ids, self.max_tokens - len(self.kept_ids), self.stop, seed


@dataclass
class EpisodeRecord:
    """One episode: its ``key`` (the endpoint's path segment, unique in the run), the dataset ``row`` it runs, its
    calls in order, the agent's ``result`` (a reward, a dict of reward-function kwargs, or None), ``outcome`` (one of
    :data:`OUTCOMES`) and ``error`` (what the agent raised, or which limit it hit)."""

    key: str
    row: dict
    calls: list[Call] = field(default_factory=list)
    result: Any = None
    outcome: str = "ok"
    error: str | None = None
    completion_tokens: int = 0  # tokens of the episode's sample so far (completions and the tokens between them)

    @property
    def oldest_version(self) -> int | None:
        """The policy version of the episode's oldest tagged token (None: no tagged token yet)."""
        return min((min(c.versions) for c in self.calls if c.versions), default=None)

    @property
    def context(self) -> list[int] | None:
        """The last call's prompt + completion: the prefix a next call extends (None before the first call)."""
        if not self.calls:
            return None
        last = self.calls[-1]
        return last.prompt_ids + last.completion_ids

    @property
    def trained_context(self) -> list[int] | None:
        """:attr:`context` with image placeholders expanded (what the trainer's forward takes)."""
        if not self.calls:
            return None
        last = self.calls[-1]
        return last.trained_prompt + last.completion_ids


@dataclass
class Assembled:
    """An episode laid out for training. ``prompt_ids`` ``[P]``, ``completion_ids`` ``[L]``, ``mask`` ``[L]`` (1:
    generated by the policy, 0: tokens between calls), ``logprobs`` ``[L]`` (0.0 where masked); ``split``: the
    calls did not chain (the agent edited its history), ``segments`` then each call's own ``(prompt_ids,
    completion_ids, logprobs)``; ``calls``: how many calls the episode made."""

    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    split: bool
    calls: int
    segments: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)


def chains(calls: list[Call]) -> bool:
    """Whether every call's prompt starts with the previous call's prompt + completion (token for token)."""
    for prev, call in zip(calls, calls[1:]):
        context = prev.prompt_ids + prev.completion_ids
        if call.prompt_ids[:len(context)] != context:
            return False
    return True


def assemble(calls: list[Call], fallback_prompt: list[int], eos: int) -> Assembled:
    """An episode's calls as one sample (see the module's docstring). ``fallback_prompt``: the row's prompt rendered
    (an episode without a call); ``eos``: the token of its empty completion (masked: nothing trains). A split
    episode keeps the first call's sample fields (the trainer masks what it does not train) and its segments."""
    if not calls:
        return Assembled(list(fallback_prompt), [eos], [0], [0.0], split=False, calls=0)
    first = calls[0]
    if not chains(calls):
        segments = [(list(c.prompt_ids), list(c.completion_ids), list(c.logprobs)) for c in calls]
        return Assembled(list(first.prompt_ids), list(first.completion_ids), [1] * len(first.completion_ids),
                         list(first.logprobs), split=True, calls=len(calls), segments=segments)
    completion, mask, logprobs = list(first.completion_ids), [1] * len(first.completion_ids), list(first.logprobs)
    context = first.prompt_ids + first.completion_ids
    for call in calls[1:]:
        between = call.prompt_ids[len(context):]
        completion += between + call.completion_ids
        mask += [0] * len(between) + [1] * len(call.completion_ids)
        logprobs += [0.0] * len(between) + list(call.logprobs)
        context = call.prompt_ids + call.completion_ids
    if not completion:  # a single call that generated nothing
        completion, mask, logprobs = [eos], [0], [0.0]
    return Assembled(list(first.prompt_ids), completion, mask, logprobs, split=False, calls=len(calls))


def safe_cut(ids: list[int], stop: list[str], decode, floor: int = 0) -> int:
    """How many of a stopped call's tokens ``ids`` ``[K]`` may be kept when a step's end aborts it and it continues
    later from them: the most (at least ``floor``, tokens already known safe) whose text neither holds a stop string
    nor ends with the start of one (nor, where a stop string has a non-ASCII character, with an unfinished one),
    since the continuation's stop check sees only its own text. ``decode(ids) -> str``: the tokenizer's."""
    wide = any(not s.isascii() for s in stop)
    for keep in range(len(ids), floor, -1):
        text = decode(ids[:keep])
        if not (wide and text.endswith("\ufffd")) and not any(
                s in text or any(text.endswith(s[:j]) for j in range(1, len(s))) for s in stop if s):
            return keep
    return floor


def reward_kwargs(result: Any) -> dict[str, Any]:
    """The agent's return value as reward-function kwargs: a number is ``agent_reward``; a dict is its own kwargs
    (its ``reward`` key, if any, also ``agent_reward``); None (unscored) is ``agent_reward=None``. TypeError naming
    the value for anything else."""
    if isinstance(result, dict):
        out = dict(result)
        if "reward" in out and "agent_reward" not in out:
            out["agent_reward"] = out["reward"]
        return out
    if result is None:
        return {"agent_reward": None}
    if not isinstance(result, (int, float)):
        raise TypeError(f"an agent returned {type(result).__name__} {result!r:.80}: return a number (its reward), a "
                        "dict of reward-function kwargs, or None (unscored).")
    return {"agent_reward": float(result)}


def openai_tool_calls(parsed: list[dict] | None, key: str, call_index: int) -> list[dict]:
    """TRL's parsed tool calls (``{"type": "function", "function": {"name", "arguments": dict}}``) as OpenAI's
    (``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``), with ids unique in the run."""
    out = []
    for k, call in enumerate(parsed or []):
        fn = call.get("function", {})
        arguments = fn.get("arguments", {})
        out.append({"id": f"call_{key}_{call_index}_{k}", "type": "function",
                    "function": {"name": fn.get("name", ""),
                                 "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    return out


def _image_url_refusal(i: int) -> str:
    """Why an OpenAI ``image_url`` part of ``messages[i]`` is refused by an endpoint that takes no images (a text
    policy, or agents where images are not carried yet)."""
    return (f"messages[{i}].content has an image_url part, and this endpoint takes no images: its policy is a text "
            "model, or its episodes run where agents' images are not carried yet (on rollout ranks). Send text "
            "parts only, or train a vision-language model (its processor as processing_class) with agents "
            "colocated (docs/vlm.md).")


def template_messages(messages: list[dict], images: bool = False) -> list[dict]:
    """OpenAI chat messages as chat templates take them: text content parts joined, an assistant's tool calls'
    JSON-string arguments parsed into dicts (templates write them with ``tojson``), a tool message's
    ``tool_call_id`` kept, ``name`` given where the template reads it. ``images`` (a vision-language policy): an
    ``image_url`` part with a data URL becomes TRL's ``{"type": "image", "image": <PIL image>}`` block, the message's
    content then a list of typed blocks in the agent's order (an http(s) URL is refused: nothing is fetched).
    ValueError naming the message for what cannot be a chat message."""
    from trl_nrollout.rollout.episodes.agent_images import image_blocks, part_url, url_refusal

    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] must be an object with a role of system, developer, user, assistant or "
                             f"tool; got {m!r:.120}.")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_url" and url_refusal(i, part_url(i, p)):
                    raise ValueError(url_refusal(i, part_url(i, p)))  # (nothing is fetched, whatever the policy)
            if not images:
                raise ValueError(_image_url_refusal(i))
            content = image_blocks(i, content)
        elif isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ValueError(f"messages[{i}].content has a part that is not text: this endpoint serves a text "
                                 "model; send text parts only.")
            content = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts or null.")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": content if isinstance(content, list) else content or ""}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        fn["arguments"] = {"raw": args}
                calls.append({"type": "function", "function": fn})
            msg["tool_calls"] = calls
        if m["role"] == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = m["tool_call_id"]
            if m.get("name") is not None:
                msg["name"] = m["name"]
        out.append(msg)
    return out


def same_message(sent: dict, returned: dict) -> bool:
    """Whether the assistant message an agent sent back is the one the endpoint returned (content and tool calls'
    names and arguments; ids and whitespace around the content ignored)."""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "").strip() != (returned.get("content") or "").strip():
        return False

    def calls(m):
        return [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                for c in m.get("tool_calls") or []]

    return calls(sent) == calls(returned)
