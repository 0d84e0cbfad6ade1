"""A request-level loop over one in-process vLLM engine: we add the requests and step the engine ourselves.

``LLM.generate`` adds its requests and steps the engine until the last one finishes. :class:`EngineLoop` does the
same through the same calls (the prompt rendered as ``generate`` renders it, the request ids from the ``LLM``'s own
counter, ``LLMEngine.add_request`` / ``step`` / ``abort_request``), so a loop run to the end samples exactly what
``generate`` samples. What it adds: the caller decides when to stop. In streaming mode every step reports each
sample's new tokens and log-probs, so an unfinished sample can be aborted with its tokens kept (a partial
rollout continues it later from prompt + those tokens).

Samples are keyed ``(request, index)``: the request id :meth:`EngineLoop.add` returned and the sample's index
among the request's ``n`` (vLLM's child requests).

Tensor parallelism: each rank of a TP engine (vLLM's external launcher) runs its own scheduler, and the ranks stay
in step only while their schedulers make the same decisions. An abort breaks that: vLLM frees the aborted requests'
KV blocks in an order of its own per process (``Scheduler.finish_requests`` iterates a ``set`` of request ids, which
carry a random suffix ``InputProcessor`` draws per process and are hashed with Python's per-process salt), and the
order of the free blocks decides which cached prefix the next allocation evicts; a request could then hit the prefix
cache on one rank and miss on another, and the ranks would run different batches (a collective of mismatched sizes:
a crash, a hang, or mixed tokens). So at TP > 1 :meth:`EngineLoop.abort` resets the prefix cache: every rank's cache
is empty again, hence alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampleProgress:
    """One sample of a request as far as the engine got: its tokens ``[L]``, their log-probs ``[L]`` (the engine's,
    processed as sampled), and ``finish_reason`` (None while it runs; ``"stop"``, ``"length"``, or ``"abort"``)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineLoop:
    """The requests of one vLLM ``LLM`` (V1 engine in this process), stepped by the caller.

    ``stream=False``: outputs arrive when a request's ``n`` samples have all finished (``generate``'s mode, the
    least Python work per step). ``stream=True``: every step delivers each running sample's new tokens, so
    :attr:`samples` always holds what each sample has so far. ``lora_request``: the vLLM ``LoRARequest`` every
    request of the loop carries (the adapter version it samples from; None: the base weights).
    """

    def __init__(self, llm, *, stream: bool = False, lora_request=None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.stream = stream
        self.lora_request = lora_request
        self.samples: dict[tuple[str, int], SampleProgress] = {}
        self._n: dict[str, int] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._open: set[str] = set()
        self.steps = 0
        parallel = getattr(getattr(self.engine, "vllm_config", None), "parallel_config", None)
        self.tensor_parallel_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)

    def add(self, prompt: Any, params) -> str:
        """Queue ``prompt`` (a vLLM prompt: ``TokensPrompt`` with optional ``multi_modal_data``) with ``params``
        (``SamplingParams``, copied); returns the request id."""
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        request_id = str(next(self.llm.request_counter))  # generate's ids: unique among the LLM's requests
        if self.lora_request is None:
            self.engine.add_request(request_id, self._render(prompt), params)
        else:
            self.engine.add_request(request_id, self._render(prompt), params, lora_request=self.lora_request)
        self._n[request_id] = params.n
        self._open.add(request_id)
        for k in range(params.n):
            self.samples[(request_id, k)] = SampleProgress()
        return request_id

    def _render(self, prompt: Any):
        """The prompt as ``generate`` hands it to the engine (rendered by the ``LLM``'s renderer)."""
        render = getattr(self.llm, "_preprocess_cmpl_one", None)
        return prompt if render is None else render(prompt)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._open)

    @property
    def num_open(self) -> int:
        """Requests of this loop not yet finished (each holds its ``n`` samples until its last one ends, unless
        streaming)."""
        return len(self._open)

    def engine_unfinished(self) -> int:
        """Requests unfinished in the whole engine (this loop's and any other caller's): what a driver that pulls
        work while the engine has room counts."""
        return int(self.engine.get_num_unfinished_requests())

    def engine_has_unfinished(self) -> bool:
        """Whether the engine holds any unfinished request (this loop's or another caller's)."""
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> list[tuple[str, int]]:
        """One engine step; returns the samples that finished in it."""
        finished = []
        for out in self.engine.step():
            rid = out.request_id
            if rid not in self._open:
                continue
            if out.prompt_token_ids is not None and rid not in self._prompt_ids:
                self._prompt_ids[rid] = list(out.prompt_token_ids)
            for comp in out.outputs:
                sample = self.samples[(rid, comp.index)]
                new_tokens = list(comp.token_ids)  # streaming: this step's tokens; else all of them, once
                sample.token_ids.extend(new_tokens)
                sample.logprobs.extend(sampled_logprobs(comp.logprobs, new_tokens))
                if comp.finish_reason is not None and sample.finish_reason is None:
                    sample.finish_reason = "stop" if comp.finish_reason == "stop" else "length"
                    finished.append((rid, comp.index))
            if out.finished:
                self._open.discard(rid)
        self.steps += 1
        return finished

    def run(self) -> None:
        """Step until every request has finished (what ``generate`` does)."""
        while self._open and self.engine.has_unfinished_requests():
            self.step()
        lost = sorted(rid for rid, k in self.samples if not self.samples[(rid, k)].finished)
        if lost:
            raise RuntimeError(f"the vLLM engine has no unfinished requests left, but requests {lost[:5]} of this "
                               "loop never finished: another caller stepped or aborted them.")

    def abort(self, request_ids: Sequence[str] | None = None) -> list[tuple[str, int]]:
        """Abort ``request_ids`` (default: every unfinished request); their unfinished samples keep their tokens
        and get ``finish_reason="abort"``. Returns those samples.

        At tensor-parallel size > 1 the prefix cache is reset afterwards (see the module's docstring: the ranks free
        the aborted blocks in different orders); requests still running in the engine are then preempted and
        recomputed, alike on every rank."""
        ids = sorted(self._open if request_ids is None else set(request_ids) & self._open, key=int)
        if not ids:
            return []
        self.engine.abort_request(ids)
        if self.tensor_parallel_size > 1:
            running = self.engine.has_unfinished_requests()
            if not self.llm.reset_prefix_cache(reset_running_requests=running):
                raise RuntimeError(
                    f"the prefix cache of this tensor-parallel engine (size {self.tensor_parallel_size}) could not be "
                    "reset after an abort: vLLM still holds KV blocks of finished requests (a KV connector's "
                    "delayed frees?), and the ranks, which freed the aborted blocks in different orders, could "
                    "schedule different batches from here on. Run partial rollouts at TP > 1 without a KV "
                    "connector, or set rollout_tp_size=1.")
        aborted = []
        for rid in ids:
            self._open.discard(rid)
            for k in range(self._n[rid]):
                if not self.samples[(rid, k)].finished:
                    self.samples[(rid, k)].finish_reason = "abort"
                    aborted.append((rid, k))
        return aborted

    def prompt_ids(self, request_id: str) -> list[int]:
        """The request's prompt as the engine saw it (a vision-language model's image placeholders expanded)."""
        return self._prompt_ids[request_id]

    def request(self, request_id: str) -> list[SampleProgress]:
        """The ``n`` samples of one request, in index order."""
        return [self.samples[(request_id, k)] for k in range(self._n[request_id])]


def sampled_logprobs(source, tokens: Sequence[int]) -> list[float]:
    """Log-prob of each sampled token, from vLLM's ``FlatLogprobs`` (fast path) or a list of per-step dicts."""
    if source is None:
        return [math.nan] * len(tokens)
    if hasattr(source, "start_indices"):  # FlatLogprobs: parallel lists, one range per position
        out = []
        for pos, tok in enumerate(tokens):
            lo, hi = source.start_indices[pos], source.end_indices[pos]
            ids = source.token_ids[lo:hi]
            out.append(float(source.logprobs[lo + ids.index(tok)]) if tok in ids else math.nan)
        return out
    return [_chosen_logprob(step, tok) for step, tok in zip(source, tokens)]


def _chosen_logprob(step: dict, token: int) -> float:
    """The sampled token's log-prob from a vLLM per-step ``{token_id: Logprob}`` dict."""
    if token in step:
        return float(step[token].logprob)
    return float(next(iter(step.values())).logprob) if step else math.nan
