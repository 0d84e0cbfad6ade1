"""An OpenAI-compatible endpoint on a rank's engine, for agents written in any framework, recording what they generate.

During a rollout the trainer serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on
``127.0.0.1`` (FastAPI under uvicorn, in a thread of the trainer's process). Each episode has its own base URL,
``http://127.0.0.1:<port>/e/<key>/v1``: every request on it is the episode's, never another's (the key is in the
path; an unknown or closed key is a 404). The agents (:mod:`trl_nrollout.trainer.agents` runs them, ``n`` episodes
per prompt, all at once) talk to it with any OpenAI client.

A request is turned into token ids here (the chat template with the request's ``tools``), and handed to the engine
thread through a queue (:meth:`AgentEndpoint.serve`: the trainer's thread adds each request to the engine's
request-level loop as it comes, steps the engine, and answers each request when it finishes: no turn barrier, no
batch to wait for). The answer is parsed back into OpenAI's message (text, ``tool_calls``). Every call is recorded
(:class:`~trl_nrollout.rollout.episodes.agent_calls.Call`): its prompt's and completion's token ids and the engine's
log-probs, exactly as generated. When an agent sends back the conversation so far plus new messages (a chat loop),
the prompt is built from the recorded tokens of the previous call and the new messages' tokens only, so the calls
chain token for token and the episode trains as one sample.

Sampling follows the trainer (the log-probs the loss compares against must come from the policy as configured): a
request's ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias`` and ``seed`` are ignored where they differ from it (one warning per run
names them); ``max_tokens`` / ``max_completion_tokens`` and ``stop`` are honoured (they end a completion, they do
not change a token's distribution), within the episode's token budget (``max_completion_length`` over all its calls)
and the engine's context; ``n`` > 1, ``stream`` and ``logprobs`` with top alternatives are refused (400).
Errors are OpenAI's shape (``{"error": {"message", "type", "code", "param"}}``): unknown model (404), malformed
messages (400), a prompt past the context (400 ``context_length_exceeded``), an episode's call or token limit (400
``episode_limit``), a closed episode (404).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import (  # module level: FastAPI reads the handlers' (string) annotations from here
    FastAPI,
    Request,
)
from fastapi.responses import JSONResponse

from trl_nrollout.rollout.episodes.agent_calls import (
    Call,
    EpisodeRecord,
    PendingCall,
    openai_tool_calls,
    safe_cut,
    same_message,
    template_messages,
)
from trl_nrollout.rollout.episodes.agent_images import CallMedia, expansion_apart, render_ids
from trl_nrollout.rollout.episodes.tool_images import message_images

logger = logging.getLogger(__name__)

#: sampling parameters the trainer decides (the policy's distribution); a request's differing value is ignored
POLICY_PARAMETERS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "seed")


@dataclass
class EpisodeState:
    """The endpoint's view of an open episode: its record, its place (for seeds), the messages of its last call and
    the assistant message it returned (to see whether a new request extends them), and a lock (an agent may send
    calls concurrently; they are recorded in the order they were made)."""

    record: EpisodeRecord
    index: int
    seed: Callable[[int, int], int | None] | None
    messages: list[dict] | None = None
    reply: dict | None = None
    lock: asyncio.Lock | None = None
    closed: bool = False


#: The answer to ``/v1/responses`` (the OpenAI Agents SDK's default API): the endpoint serves Chat Completions, which
#: the SDK uses when told to.
RESPONSES_API = ("the endpoint serves /v1/chat/completions, not OpenAI's Responses API (/v1/responses). The OpenAI "
                 "Agents SDK calls the Responses API by default: give your Agent "
                 "model=OpenAIChatCompletionsModel(model=model, openai_client=client), or call "
                 "agents.set_default_openai_api('chat_completions') once.")


class EndpointError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``message``, ``type``, ``code``, ``param``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


class AgentEndpoint:
    """The OpenAI-compatible server of one rank (see the module's docstring).

    ``tokenizer``: the policy's (chat template, decoding); ``parse(ids, prefix, tools)``: the assistant message of a
    completion (TRL's response parser where the tokenizer has one; None: text only); ``model_name``: the name
    ``/v1/models`` lists and requests must use (``"policy"`` is accepted too); ``max_model_len``: the engine's
    context; ``max_completion_length``: an episode's token budget over all its calls; ``max_calls``: calls per
    episode; ``policy``: the trainer's values of :data:`POLICY_PARAMETERS` (for the warning); ``processor``: a
    vision-language policy's processor (None: a text policy, whose endpoint refuses ``image_url`` parts):
    :mod:`~trl_nrollout.rollout.episodes.agent_images`."""

    def __init__(self, tokenizer, *, model_name: str, max_model_len: int, max_completion_length: int, max_calls: int,
                 parse: Callable[[list[int], list[int], list | None], dict] | None = None,
                 policy: dict[str, Any] | None = None, host: str = "127.0.0.1", processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_completion_length = max_completion_length
        self.max_calls = max_calls
        self.parse = parse
        self.policy = dict(policy or {})
        self.host = host
        self.port = 0
        self.requests: queue.Queue[PendingCall] = queue.Queue()
        self.episodes: dict[str, EpisodeState] = {}
        self._seed: Callable[[int, int], int | None] | None = None
        self._warned: set[str] = set()
        self._server = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Serve on a free port of ``host`` in a daemon thread; returns once the server accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=run, name="trl-nrollout-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.host}:{self.port} within 30 s.")
            time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self._server = None

    def base_url(self, key: str) -> str:
        """The episode's OpenAI base URL (give it to the client as ``base_url``)."""
        return f"http://{self.host}:{self.port}/e/{key}/v1"

    def open(self, records: list[EpisodeRecord], seed: Callable[[int, int], int | None] | None = None,
             indices: list[int] | None = None) -> None:
        """Accept requests for ``records`` (this rollout's episodes; those of a rollout before are closed);
        ``seed(i, c)``: the sampling seed of call ``c`` of the episode at place ``i`` (``indices``, default
        0, 1, ...: the places :meth:`admit` gives later episodes; None: unseeded)."""
        self._seed = seed
        self.episodes = {}
        self.admit(records, indices)

    def admit(self, records: list[EpisodeRecord], indices: list[int] | None = None) -> None:
        """Accept requests for more episodes of the open rollout (a balanced queue's pulled groups), ``indices``
        their places (the seeds' ``i``)."""
        places = range(len(self.episodes), len(self.episodes) + len(records)) if indices is None else indices
        for i, r in zip(places, records, strict=True):
            self.episodes[r.key] = EpisodeState(r, i, self._seed)

    def close_episode(self, key: str) -> None:
        """No more requests for ``key`` (its agent returned, raised, or ran out of time)."""
        state = self.episodes.get(key)
        if state is not None:
            state.closed = True

    def forget(self, keys: list[str]) -> None:
        """Drop episodes ``keys`` (closed, trained or started again): their later requests get a 404."""
        for key in keys:
            state = self.episodes.pop(key, None)
            if state is not None:
                state.closed = True

    # ------------------------------------------------------------------------------------------ the engine side
    def serve(self, engine_loop, params: Callable[[PendingCall], Any], done: Callable[[], bool],
              idle_s: float = 0.01, exchange: Callable[[Any], list] | None = None, me: int = 0,
              carry: bool = False, version: int | None = None) -> dict[str, float]:
        """Run the episodes' requests on ``engine_loop`` (a non-streaming
        :class:`~trl_nrollout.rollout.engines.requests.EngineLoop`, stepped only here) until ``done()``: each request joins the
        engine as it arrives; each finished one is answered at once. ``params(call)``: its vLLM ``SamplingParams``.

        A tensor-parallel engine (``exchange``: every rank of its TP group calls it each iteration and gets all ranks'
        objects in rank order; ``me``: this rank's place): each iteration the ranks exchange the requests that came
        to them and whether their episodes are done, every rank adds all of them in rank order (the same requests in
        the same steps, seeds included, so the engine's ranks stay in step) and answers its own; the loop ends when
        every rank's episodes are done. Requests still running then (episodes out of time) are aborted and answered
        with an error; every episode is closed when it returns. ``carry`` (a partial rollout: episodes live on past
        the step): the episodes stay open, and the requests still running are aborted with their tokens kept and
        queued again: at the next ``serve`` each continues from its prompt and kept tokens on the weights then (no
        token is generated twice; each keeps the log-prob of the policy that drew it, which the decoupled loss
        corrects; ``version``: the policy version this serve's tokens are tagged with, ``PendingCall.versions``, None:
        untagged); a
        queued request of a closed episode is answered with an error. Returns counts: ``engine_steps``,
        ``requests``, ``idle_s`` (the engine had nothing to run), ``carried`` (requests queued again),
        ``kept_tokens`` (with ``carry``: their tokens, continued rather than drawn again) and ``redrawn_tokens`` (with
        ``carry``: tokens of calls with stop strings dropped at the cut, to be drawn again)."""
        from vllm.inputs import TokensPrompt

        from trl_nrollout.rollout.engines.vllm_process import vllm_prompts

        if carry and not engine_loop.stream:
            raise ValueError("serve(carry=True) continues an aborted request from the tokens it drew, which only a "
                             "streaming loop reports: pass engine.request_loop(stream=True).")
        running: dict[str, PendingCall | None] = {}  # request id -> this rank's call (None: another rank's)
        stats = {"engine_steps": 0.0, "requests": 0.0, "idle_s": 0.0, "carried": 0.0,
                 **({"kept_tokens": 0.0, "redrawn_tokens": 0.0} if carry else {})}

        def tag(count: int) -> list[int]:  # the versions of ``count`` tokens drawn in this serve
            return [] if version is None else [version] * count

        def take(block: bool) -> list[PendingCall]:
            calls = []
            try:
                calls.append(self.requests.get(timeout=idle_s) if block else self.requests.get_nowait())
                while True:
                    calls.append(self.requests.get_nowait())
            except queue.Empty:
                pass
            if carry:  # a closed episode's call (restarted, or out of time while it waited): not run
                for c in calls:
                    state = self.episodes.get(c.key)
                    if (state is None or state.closed) and not c.future.done():
                        c.future.set_exception(EndpointError(404, "the episode was closed.", code="episode_closed"))
            return [c for c in calls if not c.future.done()]

        def add(calls: list[PendingCall | None], specs: list[tuple]) -> None:
            for call, (prompt_ids, max_tokens, stop, seed, sampling, images) in zip(calls, specs):
                spec = PendingCall("", prompt_ids, max_tokens, stop, seed, sampling)
                prompt = (TokensPrompt(prompt_token_ids=prompt_ids) if not images
                          else vllm_prompts([prompt_ids], [images])[0])
                rid = engine_loop.add(prompt, params(spec))
                running[rid] = call
                stats["requests"] += call is not None

        try:
            while True:
                idle = not engine_loop.has_unfinished
                start = time.perf_counter()
                mine = take(block=idle)
                if idle:
                    stats["idle_s"] += time.perf_counter() - start
                for c in [c for c in mine if c.kept_ids and c.continuation()[1] <= 0]:  # cut on its last token
                    c.versions = list(c.kept_versions)
                    c.future.set_result((list(c.kept_ids), list(c.kept_logprobs), "length"))
                mine = [c for c in mine if not c.future.done()]
                specs = [(*c.continuation(), c.sampling, c.images) for c in mine]
                finished = done() and not mine
                everyone = [(specs, finished)] if exchange is None else exchange((specs, finished))
                for k, (rank_specs, _) in enumerate(everyone):
                    add(mine if k == me else [None] * len(rank_specs), rank_specs)
                if all(f for _, f in everyone):
                    break
                if engine_loop.has_unfinished:
                    for rid, k in engine_loop.step():
                        progress = engine_loop.samples[(rid, k)]
                        call = running.pop(rid)
                        if call is not None and not call.future.done():
                            apart = expansion_apart(call.expanded, len(call.images), engine_loop.prompt_ids(rid),
                                                    len(call.kept_ids))
                            if apart is not None:  # (the trainer would score another prompt than vLLM's)
                                call.future.set_exception(EndpointError(500, apart, "server_error", "image_expansion"))
                            else:
                                if call.images:  # vLLM's expansion of the prompt (the kept tokens after it)
                                    seen = engine_loop.prompt_ids(rid)
                                    call.engine_prompt = list(seen[:len(seen) - len(call.kept_ids)])
                                call.versions = call.kept_versions + tag(len(progress.token_ids))
                                call.future.set_result((call.kept_ids + list(progress.token_ids),
                                                        call.kept_logprobs + list(progress.logprobs),
                                                        progress.finish_reason))
                    stats["engine_steps"] += 1
        finally:
            aborted = dict(engine_loop.abort()) if engine_loop.has_unfinished else {}
            if carry:  # the episodes go on: their running requests continue at the next serve, tokens kept
                for rid, call in running.items():
                    if call is not None and not call.future.done():
                        if rid in aborted:
                            progress = engine_loop.samples[(rid, aborted[rid])]
                            ids, have = call.kept_ids + list(progress.token_ids), len(call.kept_ids)
                            if call.images and call.engine_prompt is None and progress.token_ids:  # (one cut on
                                seen = engine_loop.prompt_ids(rid)  # its last token is answered without a run)
                                call.engine_prompt = list(seen[:len(seen) - have])
                            keep = safe_cut(ids, call.stop, self.tokenizer.decode, have) if call.stop else len(ids)
                            call.kept_ids = ids[:keep]  # (a stop string could straddle the cut: kept up to before it)
                            call.kept_logprobs = (call.kept_logprobs + list(progress.logprobs))[:keep]
                            call.kept_versions = call.kept_versions + tag(keep - have)
                            stats["kept_tokens"] += keep - have
                            stats["redrawn_tokens"] += len(ids) - keep
                        self.requests.put(call)
                        stats["carried"] += 1
            else:
                self._end_rollout(running)
        return stats

    def _end_rollout(self, running: dict[str, PendingCall | None]) -> None:
        """No episode outlives its rollout: every one closed (later requests get a 404), the requests still running
        and those that arrived after the last episode ended answered with an error."""
        for state in self.episodes.values():
            state.closed = True
        for call in running.values():
            if call is not None and not call.future.done():
                call.future.set_exception(EndpointError(404, "the episode was closed (its time ran out) while this "
                                                             "request ran.", code="episode_closed"))
        while not self.requests.empty():
            call = self.requests.get_nowait()
            if not call.future.done():
                call.future.set_exception(EndpointError(404, "the rollout ended.", code="episode_closed"))

    # ------------------------------------------------------------------------------------------ the server side
    def _app(self) -> FastAPI:
        app = FastAPI(title="trl-nrollout agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(err: EndpointError) -> JSONResponse:
            return JSONResponse(err.body(), status_code=err.status)

        @app.get("/e/{key}/v1/models")
        async def models(key: str):
            self._episode(key)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "trl-nrollout"}]}

        async def handle(key: str, request: Request, chat: bool):
            try:
                try:
                    body = await request.json()
                except ValueError:
                    raise EndpointError(400, "the request body is not JSON.") from None
                if not isinstance(body, dict):
                    raise EndpointError(400, "the request body must be a JSON object.")
                return await (self._chat(key, body) if chat else self._completion(key, body))
            except EndpointError as err:
                return error(err)

        @app.post("/e/{key}/v1/chat/completions")
        async def chat_completions(key: str, request: Request):
            return await handle(key, request, chat=True)

        @app.post("/e/{key}/v1/completions")
        async def completions(key: str, request: Request):
            return await handle(key, request, chat=False)

        @app.post("/e/{key}/v1/responses")
        async def responses(key: str):
            return error(EndpointError(404, RESPONSES_API, code="responses_api_not_served"))

        @app.exception_handler(EndpointError)
        async def endpoint_error(_request, err: EndpointError):
            return error(err)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def unknown(path: str):
            return error(EndpointError(404, f"no route /{path}: use the episode's base URL "
                                            "(http://127.0.0.1:<port>/e/<key>/v1) and /chat/completions, /completions "
                                            "or /models.", code="not_found"))

        return app

    def _episode(self, key: str) -> EpisodeState:
        state = self.episodes.get(key)
        if state is None or state.closed:
            raise EndpointError(404, f"episode {key!r} is not open: its agent returned, failed or ran out of time, or "
                                     "the key is not this rollout's. Use the base URL the agent was given.",
                                code="episode_closed")
        return state

    def _check_request(self, body: dict) -> None:
        model = body.get("model")
        if model not in (self.model_name, "policy"):
            raise EndpointError(404, f"The model {model!r} does not exist: this endpoint serves {self.model_name!r} "
                                     "(or 'policy').", code="model_not_found", param="model")
        if body.get("stream"):
            raise EndpointError(400, "stream=true is not supported: the trainer records whole completions; send "
                                     "stream=false.", param="stream")
        if (body.get("n") or 1) != 1:
            raise EndpointError(400, f"n={body.get('n')}: one call is one completion of its episode (the trainer runs "
                                     "n episodes per prompt); send n=1.", param="n")
        if body.get("top_logprobs"):
            raise EndpointError(400, "top_logprobs is not supported.", param="top_logprobs")
        ignored = sorted(k for k in POLICY_PARAMETERS if body.get(k) is not None and body.get(k) != self.policy.get(k))
        new = [k for k in ignored if k not in self._warned]
        if new:
            self._warned.update(new)
            logger.warning("agent requests set %s: ignored, the policy samples as the trainer's config says (%s); the "
                           "loss compares against those log-probs.", ", ".join(new),
                           ", ".join(f"{k}={self.policy.get(k)!r}" for k in new))

    async def _chat(self, key: str, body: dict) -> dict:
        self._check_request(body)
        state = self._episode(key)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "messages must be a non-empty list of chat messages.", param="messages")
        try:
            messages = template_messages(messages, images=self.processor is not None)
        except ValueError as err:
            raise EndpointError(400, str(err), param="messages") from None
        tools = body.get("tools") or None
        if state.lock is None:
            state.lock = asyncio.Lock()
        async with state.lock:
            prompt_ids, extends, media = self._chat_prompt(state, messages, tools)
            ids, logprobs, reason, created = await self._generate(state, prompt_ids, extends, body, media)
            message = self._message(state, ids, prompt_ids, tools)
            state.messages, state.reply = messages, template_messages([message])[0]
        calls = message.get("tool_calls")
        finish = "length" if reason == "length" else "tool_calls" if calls else "stop"
        choice = {"index": 0, "message": {"role": "assistant", "content": message.get("content"),
                                          **({"tool_calls": calls} if calls else {})},
                  "finish_reason": finish, "logprobs": None}
        return {"id": f"chatcmpl-{key}-{len(state.record.calls)}", "object": "chat.completion", "created": created,
                "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)}}

    async def _completion(self, key: str, body: dict) -> dict:
        self._check_request(body)
        state = self._episode(key)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise EndpointError(400, "prompt must be one string or one list of token ids.", param="prompt")
        if state.lock is None:
            state.lock = asyncio.Lock()
        async with state.lock:
            context = state.record.context
            extends = context is not None and prompt_ids[:len(context)] == context
            ids, _, reason, created = await self._generate(state, prompt_ids, extends, body)
            state.messages, state.reply = None, None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"id": f"cmpl-{key}-{len(state.record.calls)}", "object": "text_completion", "created": created,
                "model": body["model"], "choices": [{"index": 0, "text": text, "finish_reason": reason,
                                                     "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)}}

    def _render(self, messages: list[dict], tools: list | None, generation: bool, expanded: bool = False
                ) -> list[int]:
        """The messages' tokens; with images (a vision-language policy), through the processor's template with the
        placeholders unexpanded (vLLM's form) or ``expanded`` (the processor's, what the trainer's forward takes)."""
        if self.processor is not None and message_images(messages):
            return render_ids(self.processor, messages, tools, generation, expanded)
        return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                       tokenize=True, return_dict=False))

    def _chat_prompt(self, state: EpisodeState, messages: list[dict], tools: list | None
                     ) -> tuple[list[int], bool, CallMedia | None]:
        """The request's prompt ids, whether they extend the episode's last call, and its images (None: it has
        none): when the request's messages are the last call's messages, the assistant message returned and new
        messages, the prompt is the last call's prompt + completion + the new messages' tokens (rendered after an
        assistant turn, as TRL renders tool results), so the recorded tokens are reused, not re-tokenized from the
        agent's text; its images are the last call's, then the new messages' (the processor's expansion of the
        new placeholders appended to the last call's expanded prompt)."""
        context, prev = state.record.context, state.messages
        if (context is not None and prev is not None and len(messages) > len(prev) + 1
                and messages[:len(prev)] == prev and same_message(messages[len(prev)], state.reply or {})):
            assistant, new = messages[len(prev)], messages[len(prev) + 1:]
            suffix, last, images = self._suffix(assistant, new, tools), state.record.calls[-1], message_images(new)
            media = None
            if images or last.images:
                expanded = self._suffix(assistant, new, tools, expanded=True) if images else suffix
                media = CallMedia(state.record.trained_context + expanded, list(last.images) + images)
            return context + suffix, True, media
        try:
            ids = self._render(messages, tools, generation=True)
            images = message_images(messages) if self.processor is not None else []
            media = CallMedia(self._render(messages, tools, True, expanded=True), images) if images else None
            return ids, False, media
        except Exception as err:  # the template rejects the conversation (roles out of order, ...)
            raise EndpointError(400, f"the chat template cannot render these messages: {err}",
                                param="messages") from None

    def _suffix(self, assistant: dict, new: list[dict], tools: list | None, expanded: bool = False) -> list[int]:
        """The tokens after an assistant turn that render ``new`` messages and the next assistant header: a
        stand-in conversation ending with that turn, rendered with and without them (the part after the turn's end
        token), as TRL's tool-result suffix (``expanded``: their images' placeholders as the processor expands
        them)."""
        stand_in = [{"role": "user", "content": "x"}, {**assistant, "content": assistant.get("content") or ""}]
        before = self._render(stand_in, tools, generation=False)
        after = self._render(stand_in + new, tools, generation=True, expanded=expanded)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, t in enumerate(before) if t == eos]
        if ends:
            before = before[:ends[-1] + 1]
        if after[:len(before)] != before:
            raise EndpointError(400, "the chat template renders the new messages so that the conversation's earlier "
                                     "tokens change; cannot extend the recorded episode.", param="messages")
        return after[len(before):]

    async def _generate(self, state: EpisodeState, prompt_ids: list[int], extends: bool, body: dict,
                        media: CallMedia | None = None) -> tuple[list[int], list[float], str, int]:
        """Run one call of the episode (``media``: its images, None without) within its limits and record it. The
        token counts are the trained ones (image placeholders expanded): what the engine's context and the
        episode's ``max_completion_length`` hold."""
        record = state.record
        trained = prompt_ids if media is None else media.expanded
        if len(record.calls) >= self.max_calls:
            record.outcome, record.error = "calls", f"more than agent_max_calls={self.max_calls} calls"
            raise EndpointError(400, f"this episode made its {self.max_calls} calls (agent_max_calls): end the "
                                     "episode.", code="episode_limit")
        between = len(trained) - len(record.trained_context) if extends else 0
        spent = record.completion_tokens + between  # the episode's tokens: completions and what lies between them
        budget = min(self.max_completion_length - spent, self.max_model_len - len(trained))
        if len(trained) >= self.max_model_len:
            raise EndpointError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                     f"your messages resulted in {len(trained)} tokens.",
                                code="context_length_exceeded", param="messages")
        if budget <= 0:
            record.outcome, record.error = "tokens", f"spent max_completion_length={self.max_completion_length} tokens"
            raise EndpointError(400, f"this episode spent its {self.max_completion_length} tokens "
                                     "(max_completion_length over all its calls): end the episode.",
                                code="episode_limit")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = budget if asked is None else max(1, min(int(asked), budget))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        seed = None if state.seed is None else state.seed(state.index, len(record.calls))
        call = PendingCall(record.key, list(prompt_ids), max_tokens, stop, seed,
                           images=list(media.images) if media is not None else [],
                           expanded=list(media.expanded) if media is not None else None)
        self.requests.put(call)
        ids, logprobs, reason = await asyncio.wrap_future(call.future)
        if state.closed:  # its time ran out while the engine generated: nothing more is recorded
            raise EndpointError(404, f"episode {record.key!r} was closed while this request ran.",
                                code="episode_closed")
        record.calls.append(Call(list(prompt_ids), ids, logprobs, reason, extends=extends,
                                 images=list(call.images), expanded_ids=call.expanded, versions=list(call.versions)))
        record.completion_tokens = spent + len(ids)
        return ids, logprobs, reason, int(time.time())

    def _message(self, state: EpisodeState, ids: list[int], prompt_ids: list[int], tools: list | None) -> dict:
        """The assistant message of a completion: parsed (content, tool calls as OpenAI's) where a parser is set,
        else its text."""
        parsed = None
        if self.parse is not None:
            try:
                parsed = self.parse(ids, prompt_ids, tools)
            except Exception:  # the model wrote a malformed call: the text goes back as it is
                parsed = None
        if parsed is None:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        calls = openai_tool_calls(parsed.get("tool_calls"), state.record.key, len(state.record.calls))
        return {"role": "assistant", "content": parsed.get("content") or "", **({"tool_calls": calls} if calls else {})}
