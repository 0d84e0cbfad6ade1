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

from trl_nrollout.rollout.episodes.tool_images import TurnMedia, message_images
from trl_nrollout.rollout.types import RolloutBatch

#: ``rollout_multi_turn`` values: turn by turn for the whole batch (TRL's loop), or request by request
MULTI_TURN_MODES = ("turns", "requests")


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
    #: per sample, the images its tools returned (after its prompt's; empty: none)
    images: list[list] = field(default_factory=list)


@dataclass
class AgentSample:
    """One multi-turn sample's episode so far: its first-turn prompt ``[P]`` and everything after it.

    ``completion_ids`` ``[L]``: every turn's tokens and the tool-response tokens between them; ``tool_mask`` ``[L]``:
    1 for the model's tokens, 0 for tool-response tokens; ``logprobs`` ``[L]``: the engine's (0.0 on tool tokens);
    ``messages``: the assistant turns and tool results (what reward functions get); ``calls_tools``: its last turn
    called tools and it may go on; ``rounds``: tool rounds it continued after. Both multi-turn modes (turn by turn,
    :func:`run_tool_turns`; request by request, :func:`run_agent_requests`) advance samples through these methods
    only, so they give the same masks, counts and messages for the same turns.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    logprobs: list[float]
    finish_reason: str
    messages: list[dict]
    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    rounds: int = 0
    calls_tools: bool = False
    #: the images its tools returned, in order (after its prompt's); ``engine_completion``: the completion with their
    #: placeholders unexpanded (an engine that expands images itself takes that), None while it has none
    images: list = field(default_factory=list)
    engine_completion: list[int] | None = None

    @classmethod
    def first_turn(cls, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], finish_reason: str,
                   message: dict) -> AgentSample:
        """A sample after its first turn, whose parsed assistant message is ``message``."""
        return cls(list(prompt_ids), list(completion_ids), [1] * len(completion_ids), list(logprobs), finish_reason,
                   [message], calls_tools=bool(message.get("tool_calls")))

    def may_call(self, max_iterations: int | None) -> bool:
        """Whether its last turn's tool calls run: it called tools and has rounds left (``max_iterations`` None:
        until the completion budget ends)."""
        return self.calls_tools and (max_iterations is None or self.rounds < max_iterations)

    def add_tool_results(self, tool_messages: list[dict], failed: int, suffix: list[int], max_completion_length: int,
                         max_model_len: int, images: list | None = None,
                         engine_suffix: list[int] | None = None) -> list[int] | None:
        """Count the calls of its last turn, and append their results (``suffix``: their rendered tokens and the next
        assistant header, masked 0) when they fit with room for a reply. Returns the next turn's context (prompt,
        completion so far, ``suffix``), or None: the results do not fit, and the sample ends as it was (TRL drops
        them too, images included). ``images``: the images in the results (TRL's content blocks), whose placeholders
        ``suffix`` holds expanded and ``engine_suffix`` unexpanded."""
        if images is None and message_images(tool_messages):
            raise ValueError(
                "a tool returned an image (a content block {'type': 'image', ...}), but this episode loop does not "
                "carry tool images yet (a text model's, or episodes on rollout ranks). With a vision-language "
                "model, run the tools colocated (rollout_ranks=0: turn by turn, request by request or in partial "
                "rollouts), or return text from the tool.")
        self.tool_calls += len(tool_messages)
        self.tool_failures += failed
        self.calls_tools = False
        context = self.prompt_ids + self.completion_ids + list(suffix)
        if len(self.completion_ids) + len(suffix) >= max_completion_length or len(context) >= max_model_len:
            return None
        self.messages.extend(tool_messages)
        if images and self.engine_completion is None:
            self.engine_completion = list(self.completion_ids)
        if self.engine_completion is not None:
            self.engine_completion += list(engine_suffix if images else suffix)
        self.images += list(images or [])
        self.completion_ids += suffix
        self.tool_mask += [0] * len(suffix)
        self.logprobs += [0.0] * len(suffix)
        return context

    def budget(self, context: list[int], max_completion_length: int, max_model_len: int) -> int:
        """Tokens its next turn may generate after ``context``."""
        return min(max_completion_length - len(self.completion_ids), max_model_len - len(context))

    def add_turn(self, new: list[int], new_logprobs: list[float], finish_reason: str, budget: int,
                 message: Callable[[list[int]], dict]) -> None:
        """Append a continuation turn (cut at ``budget`` tokens: then it is ``"length"``); ``message(new)`` parses
        the turn (not called for an empty turn)."""
        cut = len(new) > budget
        new, new_logprobs = list(new)[:budget], list(new_logprobs)[:budget]
        self.finish_reason = "length" if cut else finish_reason
        self.turns += 1
        self.rounds += 1
        if new:
            self.messages.append(message(new))
        self.completion_ids += new
        if self.engine_completion is not None:
            self.engine_completion += new
        self.tool_mask += [1] * len(new)
        self.logprobs += new_logprobs
        self.calls_tools = bool(new) and bool(self.messages[-1].get("tool_calls")) and self.finish_reason != "length"


def collect_turns(samples: list[AgentSample]) -> Turns:
    """The episodes as :class:`Turns` (one entry per sample, in order)."""
    return Turns([s.completion_ids for s in samples], [s.tool_mask for s in samples], [s.logprobs for s in samples],
                 [s.finish_reason for s in samples], [s.messages for s in samples], [s.turns for s in samples],
                 [s.tool_calls for s in samples], [s.tool_failures for s in samples], [s.images for s in samples])


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
    generate: Callable[[list[list[int]], list[int], int, list[int]], RolloutBatch],
    any_rank: Callable[[bool], bool],
    max_iterations: int | None,
    max_completion_length: int,
    max_model_len: int,
    media: TurnMedia | None = None,
) -> Turns:
    """Continue ``first`` (this rank's first-turn samples) turn by turn while samples call tools.

    - ``parse(i, ids, prefix)``: the assistant message of sample ``i``'s turn ``ids`` (after ``prefix`` tokens);
    - ``run_tools(i, tool_calls)``: sample ``i``'s tool messages and failure count (its own tools/environment);
    - ``suffix_ids(tool_messages)``: the tokens rendering those results and the next assistant header;
    - ``generate(contexts, budgets, turn, samples)``: one sample per context (token ids), at most ``budgets[k]``
      tokens; ``samples[k]``: the index of context ``k``'s sample on this rank (its seed's input); called on every
      rank, every turn, possibly with no contexts (collective engines);
    - ``any_rank(flag)``: whether ``flag`` holds on any rank (every rank calls it with its own flag);
    - ``media``: images (the prompts', the tools'), None for text: ``generate`` then gets a fifth argument, per
      context its images and the context as an engine that expands them takes it (:class:`TurnMedia`).

    A sample stops when its turn calls no tool, after ``max_iterations`` tool rounds (None: until the completion
    budget ends), or when the tool results would not fit in ``max_completion_length`` (the results are dropped, as
    TRL does) or in ``max_model_len``. A turn cut by the budget makes the sample ``"length"``.
    """
    samples = [AgentSample.first_turn(first.prompt_ids[i], first.completion_ids[i], first.logprobs[i],
                                      first.finish_reasons[i],
                                      parse(i, list(first.completion_ids[i]), list(first.prompt_ids[i])))
               for i in range(len(first))]
    iteration = 0
    while True:
        continuing: list[int] = []
        contexts: list[list[int]] = []
        for i, sample in enumerate(samples):
            if not sample.may_call(max_iterations):
                continue
            tool_messages, failed = run_tools(i, sample.messages[-1]["tool_calls"])
            images = message_images(tool_messages) if media is not None else None  # None: image blocks refused
            context = sample.add_tool_results(tool_messages, failed, suffix_ids(tool_messages), max_completion_length,
                                              max_model_len, images,
                                              media.engine_suffix(tool_messages) if images else None)
            if context is not None:
                continuing.append(i)
                contexts.append(context)
        if not any_rank(bool(continuing)):
            break
        iteration += 1
        if iteration > max_completion_length:  # every turn adds tokens: more turns than tokens means ranks disagree
            raise RuntimeError(f"the tool turns did not end after {iteration - 1} turns with a budget of "
                               f"{max_completion_length} tokens: the ranks disagree about which samples continue.")
        budgets = [samples[i].budget(ctx, max_completion_length, max_model_len) for i, ctx in zip(continuing, contexts)]
        if media is None:
            out = generate(contexts, budgets, iteration, continuing)
        else:
            out = generate(contexts, budgets, iteration, continuing, [media.view(i, samples[i]) for i in continuing])
        for k, i in enumerate(continuing):
            samples[i].add_turn(out.completion_ids[k], out.logprobs[k], out.finish_reasons[k], budgets[k],
                                lambda ids, i=i, ctx=contexts[k]: parse(i, ids, ctx))
    return collect_turns(samples)


# ---------------------------------------------------------------------------------------------------------- requests
@dataclass
class AgentCallbacks:
    """What a request-level episode needs from the trainer, for this rank's samples (index ``i`` in its order).

    ``parse(i, ids, prefix)``, ``run_tools(i, tool_calls)``, ``suffix_ids(tool_messages)``: as in
    :func:`run_tool_turns` (``run_tools`` runs on a worker thread: it must not touch the engine);
    ``max_iterations``, ``max_completion_length``, ``max_model_len``: the same limits."""

    parse: Callable[[int, list[int], list[int]], dict]
    run_tools: Callable[[int, list[dict]], tuple[list[dict], int]]
    suffix_ids: Callable[[list[dict]], list[int]]
    max_iterations: int | None
    max_completion_length: int
    max_model_len: int
    #: images (the prompts', the tools'), None for text: ``continue_request`` then gets each re-entering sample's
    #: :class:`~trl_nrollout.rollout.episodes.tool_images.TurnView` as ``view=``
    media: TurnMedia | None = None


@dataclass
class AgentStats:
    """How a request-level episode went on this rank's engine: ``engine_steps`` taken, ``steps_with_tools`` of them
    while a tool of this rank ran (the overlap a turn barrier forbids), ``idle_s`` seconds the engine had nothing to
    run while tools ran, ``tool_s`` seconds of tool calls summed (they overlap), ``requests`` added."""

    engine_steps: int = 0
    steps_with_tools: int = 0
    idle_s: float = 0.0
    tool_s: float = 0.0
    requests: int = 0


class ToolRunner:
    """Runs samples' tool calls in the background, ``workers`` at a time (sync tools on these threads; async tools
    on the trainer's event loop, awaited from them), and hands back the finished ones in the order they finished."""

    def __init__(self, run_tools: Callable[[int, list[dict]], tuple[list[dict], int]], workers: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._run_tools = run_tools
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="trl-nrollout-tool")
        self._pending: dict[Any, int] = {}
        self.tool_s = 0.0

    def _timed(self, i: int, calls: list[dict]) -> tuple[list[dict], int, float]:
        import time

        start = time.perf_counter()
        messages, failed = self._run_tools(i, calls)
        return messages, failed, time.perf_counter() - start

    def submit(self, key: int, i: int, calls: list[dict]) -> None:
        self._pending[self._pool.submit(self._timed, i, calls)] = key

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finished(self, timeout: float | None = 0.0) -> list[tuple[int, list[dict], int]]:
        """The calls done so far as ``(key, tool_messages, failures)``; waits up to ``timeout`` seconds (None: until
        one is done) when none is and some are pending. A tool runner's own error (not the tool's: those are results)
        is raised here."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if not self._pending:
            return []
        done, _ = wait(list(self._pending), timeout=timeout, return_when=FIRST_COMPLETED)
        out = []
        for future in sorted(done, key=lambda f: self._pending[f]):
            key = self._pending.pop(future)
            messages, failed, seconds = future.result()
            self.tool_s += seconds
            out.append((key, messages, failed))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_agent_requests(
    loop,
    groups: list[tuple[list[int], Any, Any]],
    n: int,
    mine: dict[int, int],
    agent: AgentCallbacks,
    *,
    continue_request: Callable[[int, int, list[int], int], tuple[Any, Any]],
    exchange: Callable[[Any], list],
    workers: int,
    poll_s: float | None = None,
    pull: Callable[[], tuple[list[tuple[int, list[int], Any, Any]], bool]] | None = None,
    run_pulled: bool = False,
) -> tuple[dict[int, AgentSample], AgentStats]:
    """Multi-turn episodes without a turn barrier, on one engine: each sample is its own request from turn to turn.

    ``loop``: a streaming :class:`~trl_nrollout.rollout.engines.requests.EngineLoop`; ``groups``: the engine's first-turn
    requests ``(prompt_ids, prompt, params)`` with ``n`` samples each, so sample ``s = g * n + k`` is child ``k`` of
    group ``g``; ``mine``: this rank's samples, ``s -> i`` (its index for ``agent``); ``continue_request(s, round,
    context, budget)``: the request ``(prompt, params)`` of sample ``s``'s turn after tool round ``round``;
    ``exchange(obj)``: every rank of the engine's TP group calls it each iteration and gets all ranks' objects in
    rank order (``lambda o: [o]`` for one rank); ``poll_s``: how long an idle engine waits for a tool before the
    next exchange (None: until one finishes, right for one rank; a TP group must hear from every rank).
    ``pull()``: more groups from a queue shared with other engines (``rollout_dispatch="balanced"``), called on every
    rank of the TP group each iteration (it agrees across them): ``([(g, prompt_ids, prompt, params)], drained)``,
    the job's group ``g`` with its samples ``g * n + k``; ``run_pulled``: this rank runs the pulled groups' tools
    (the TP group's leader).

    When a sample's turn ends, its tool calls go to a :class:`ToolRunner` and the engine goes on with the others;
    when the results are in, the sample re-enters as a new request (prompt + completion + results) at the next
    engine step. The ranks of a TP group run the same requests in the same steps: each iteration they exchange
    which of their samples re-enter (with their contexts) and which ended, and add the re-entering ones in rank
    order. Returns this rank's samples (``s -> AgentSample``) and the :class:`AgentStats`.
    """
    import time

    samples: dict[int, AgentSample] = {}
    keys: dict[tuple[str, int], int] = {}  # (request id, child) -> sample
    running: dict[int, tuple[list[int], int]] = {}  # this rank's sample -> its running turn's (context, budget)
    first_prompt: dict[int, list[int]] = {}
    for g, (prompt_ids, prompt, params) in enumerate(groups):
        rid = loop.add(prompt, params)
        for k in range(n):
            keys[(rid, k)] = g * n + k
            first_prompt[g * n + k] = list(prompt_ids)
    remaining = len(groups) * n
    drained = pull is None
    stats = AgentStats(requests=len(groups))
    runner = ToolRunner(agent.run_tools, workers)
    updates: list[tuple] = []  # (sample, context or None: ended, budget, round, its TurnView or None)

    def turn_ended(s: int, rid: str, k: int) -> None:
        i, progress = mine[s], loop.samples[(rid, k)]
        if s not in samples:  # its first turn
            message = agent.parse(i, list(progress.token_ids), first_prompt[s])
            samples[s] = AgentSample.first_turn(first_prompt[s], progress.token_ids, progress.logprobs,
                                                progress.finish_reason, message)
        else:
            context, budget = running.pop(s)
            samples[s].add_turn(progress.token_ids, progress.logprobs, progress.finish_reason, budget,
                                lambda ids: agent.parse(i, ids, context))
        sample = samples[s]
        if sample.may_call(agent.max_iterations):
            runner.submit(s, i, sample.messages[-1]["tool_calls"])
        else:
            sample.calls_tools = False
            updates.append((s, None, 0, 0, None))

    def tools_done(timeout: float | None) -> None:
        media = agent.media
        for s, tool_messages, failed in runner.finished(timeout):
            sample = samples[s]
            images = message_images(tool_messages) if media is not None else None
            context = sample.add_tool_results(tool_messages, failed, agent.suffix_ids(tool_messages),
                                              agent.max_completion_length, agent.max_model_len, images,
                                              media.engine_suffix(tool_messages) if images else None)
            if context is None:
                updates.append((s, None, 0, 0, None))
            else:
                budget = sample.budget(context, agent.max_completion_length, agent.max_model_len)
                view = media.view(mine[s], sample) if media is not None else None
                updates.append((s, context, budget, sample.rounds + 1, view))

    try:
        while remaining or not drained:
            if not drained:
                pulled, drained = pull()
                for g, prompt_ids, prompt, params in pulled:
                    rid = loop.add(prompt, params)
                    stats.requests += 1
                    for k in range(n):
                        keys[(rid, k)] = g * n + k
                        first_prompt[g * n + k] = list(prompt_ids)
                        if run_pulled:
                            mine[g * n + k] = g * n + k
                    remaining += n
                if not remaining:
                    continue
            if loop.has_unfinished or updates:
                tools_done(0.0)
            else:  # the engine has nothing to run: wait for a tool
                idle_from = time.perf_counter()
                tools_done(poll_s)
                stats.idle_s += time.perf_counter() - idle_from
            everyone = exchange((updates, runner.pending))
            updates = []
            for rank_updates, _ in everyone:
                for s, context, budget, round_, view in rank_updates:
                    if context is None:
                        remaining -= 1
                        continue
                    prompt, params = (continue_request(s, round_, context, budget) if view is None
                                      else continue_request(s, round_, context, budget, view=view))
                    rid = loop.add(prompt, params)
                    keys[(rid, 0)] = s
                    stats.requests += 1
                    if s in mine:
                        running[s] = (context, budget)
            if loop.has_unfinished:
                tools_running = runner.pending > 0
                for rid, k in loop.step():
                    if keys[(rid, k)] in mine:
                        turn_ended(keys[(rid, k)], rid, k)
                stats.engine_steps += 1
                stats.steps_with_tools += tools_running
            elif remaining and not any(pending or rank_updates for rank_updates, pending in everyone):
                raise RuntimeError(f"{remaining} multi-turn samples neither run on the engine nor wait for a tool: "
                                   "the ranks of the engine's TP group disagree about them (a bug).")
    finally:
        runner.close()
    stats.tool_s = runner.tool_s
    return samples, stats
