"""Multi-turn rollouts with tools: verl's agent loop on our engines, with TRL's interfaces.

After the first turn (``n`` samples per prompt, as always), every sample whose last assistant turn called tools
gets the tools' results appended (the chat template's tool-response tokens) and generates its next turn; samples
that called no tool are done. All samples of all ranks advance turn by turn together: one engine call per turn
for every sample that continues, so TP groups and ZeRO-3 generation stay collective (a rank with nothing to
continue still takes part). The ``n`` samples of a prompt stay one group; tool-response tokens are part of the
completion but masked out of the loss (``tool_mask`` 0), as TRL does.

The orchestration here is pure: the trainer passes in how to parse a turn, run tools, render their results,
generate, and agree across ranks (:func:`run_tool_turns`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl_nrollout.rollout.types import RolloutBatch


@dataclass
class Turns:
    """The multi-turn samples of this rank, one entry per sample (in the first turn's order).

    ``completion_ids[i]``: every turn's tokens and the tool-response tokens between them; ``tool_mask[i]``: 1 for
    the model's tokens, 0 for tool-response tokens (same length); ``logprobs[i]``: the engine's log-probs (0.0 on
    tool tokens); ``completions[i]``: the messages (assistant turns and tool results), what reward functions get;
    ``turns[i]``: assistant turns; ``tool_calls[i]`` / ``tool_failures[i]``: calls made / that failed.
    """

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    completions: list[list[dict]]
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)


def call_tools(tool_calls: list[dict], sync_tools: dict[str, Callable], async_tools: dict[str, Callable],
               loop: asyncio.AbstractEventLoop | None = None) -> tuple[list[dict], int]:
    """Run one assistant turn's ``tool_calls`` (TRL's parsed form ``{"type": "function", "function": {"name",
    "arguments"}}``). Returns the tool messages ``{"role": "tool", "name", "content": str(result)}`` in call order and
    the number of failed calls. A tool that raises, an unknown tool or an unsupported call type gives
    ``{"error": ...}`` as its content, as TRL does; async tools run concurrently (on ``loop`` when given)."""
    results: list[Any] = [None] * len(tool_calls)
    names: list[str] = []
    failures = 0
    pending: list[tuple[int, Any]] = []
    for k, call in enumerate(tool_calls):
        if call.get("type") != "function":
            names.append(call.get("name", "unknown"))
            results[k] = {"error": f"Unsupported tool call type: {call.get('type')}"}
            failures += 1
            continue
        name, arguments = call["function"]["name"], call["function"].get("arguments") or {}
        names.append(name)
        try:
            if name in sync_tools:
                results[k] = sync_tools[name](**arguments)
            elif name in async_tools:
                pending.append((k, async_tools[name](**arguments)))
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as e:  # the model's call is wrong, not the trainer: it sees the error as the result
            results[k] = {"error": str(e)}
            failures += 1
    if pending:
        async def gather():
            return await asyncio.gather(*(c for _, c in pending), return_exceptions=True)

        done = (asyncio.run_coroutine_threadsafe(gather(), loop).result() if loop is not None
                else asyncio.run(gather()))
        for (k, _), value in zip(pending, done):
            if isinstance(value, Exception):
                value, failures = {"error": str(value)}, failures + 1
            results[k] = value
    messages = [{"role": "tool", "name": name, "content": value if isinstance(value, list) else str(value)}
                for name, value in zip(names, results)]
    return messages, failures


def split_tools(tools: list[Callable]) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """``(sync, async)`` tools by name."""
    sync = {t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)}
    asyn = {t.__name__: t for t in tools if inspect.iscoroutinefunction(t)}
    return sync, asyn


def run_tool_turns(
    first: RolloutBatch,
    *,
    parse: Callable[[int, list[int], list[int]], dict],
    run_tools: Callable[[int, list[dict]], tuple[list[dict], int]],
    suffix_ids: Callable[[list[dict]], list[int]],
    generate: Callable[[list[list[int]], list[int], int], RolloutBatch],
    any_rank: Callable[[bool], bool],
    max_iterations: int | None,
    max_completion_length: int,
    max_model_len: int,
) -> Turns:
    """Continue ``first`` (this rank's first-turn samples) turn by turn while samples call tools.

    - ``parse(i, ids, prefix)``: the assistant message of sample ``i``'s turn ``ids`` (after ``prefix`` tokens);
    - ``run_tools(i, tool_calls)``: sample ``i``'s tool messages and failure count (its own tools/environment);
    - ``suffix_ids(tool_messages)``: the tokens rendering those results and the next assistant header;
    - ``generate(contexts, budgets, turn)``: one sample per context (token ids), at most ``budgets[k]`` tokens;
      called on every rank, every turn, possibly with no contexts (collective engines);
    - ``any_rank(flag)``: whether ``flag`` holds on any rank (every rank calls it with its own flag).

    A sample stops when its turn calls no tool, after ``max_iterations`` tool rounds (None: until the completion
    budget ends), or when the tool results would not fit in ``max_completion_length`` (the results are dropped, as
    TRL does) or in ``max_model_len``. A turn cut by the budget makes the sample ``"length"``.
    """
    n = len(first)
    completion_ids = [list(c) for c in first.completion_ids]
    tool_mask = [[1] * len(c) for c in completion_ids]
    logprobs = [list(lp) for lp in first.logprobs]
    reasons = list(first.finish_reasons)
    messages = [[parse(i, completion_ids[i], list(first.prompt_ids[i]))] for i in range(n)]
    turns, calls, failures = [1] * n, [0] * n, [0] * n
    active = [i for i in range(n) if messages[i][-1].get("tool_calls")]
    iteration = 0
    while True:
        limit_reached = max_iterations is not None and iteration >= max_iterations
        continuing: list[int] = []
        contexts: list[list[int]] = []
        for i in ([] if limit_reached else active):
            tool_messages, failed = run_tools(i, messages[i][-1]["tool_calls"])
            calls[i] += len(tool_messages)
            failures[i] += failed
            suffix = suffix_ids(tool_messages)
            context = list(first.prompt_ids[i]) + completion_ids[i] + suffix
            if len(completion_ids[i]) + len(suffix) >= max_completion_length or len(context) >= max_model_len:
                continue  # no room for the results and a reply: the sample ends with its completion as it is
            messages[i].extend(tool_messages)
            completion_ids[i] += suffix
            tool_mask[i] += [0] * len(suffix)
            logprobs[i] += [0.0] * len(suffix)
            continuing.append(i)
            contexts.append(context)
        if not any_rank(bool(continuing)):
            break
        iteration += 1
        if iteration > max_completion_length:  # every turn adds tokens: more turns than tokens means ranks disagree
            raise RuntimeError(f"the tool turns did not end after {iteration - 1} turns with a budget of "
                               f"{max_completion_length} tokens: the ranks disagree about which samples continue.")
        budgets = [min(max_completion_length - len(completion_ids[i]), max_model_len - len(ctx))
                   for i, ctx in zip(continuing, contexts)]
        out = generate(contexts, budgets, iteration)
        active = []
        for k, i in enumerate(continuing):
            new, new_lp = list(out.completion_ids[k])[:budgets[k]], list(out.logprobs[k])[:budgets[k]]
            reasons[i] = out.finish_reasons[k] if len(out.completion_ids[k]) <= budgets[k] else "length"
            turns[i] += 1
            if new:
                messages[i].append(parse(i, new, contexts[k]))
            completion_ids[i] += new
            tool_mask[i] += [1] * len(new)
            logprobs[i] += new_lp
            if new and messages[i][-1].get("tool_calls") and reasons[i] != "length":
                active.append(i)
    return Turns(completion_ids, tool_mask, logprobs, reasons, messages, turns, calls, failures)
