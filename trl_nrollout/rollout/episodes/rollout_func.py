"""A ``rollout_func`` run group by group, its engine calls as requests (``rollout_partial=True``, or
``rollout_multi_turn='requests'``).

TRL's ``rollout_func(prompts, trainer)`` generates a rank's whole batch in one call, its engine calls collective.
Run this way it is called once per group (the group's prompt ``n`` times), each group on a thread of its own, with a
view of the trainer (:class:`TrainerView`) whose ``rollout_engine`` is a :class:`GroupEngine`: its
``generate_expanded`` puts one request per sample on an agent endpoint's queue, and the trainer's thread runs them on
the rank's engine as they come (:meth:`~trl_nrollout.rollout.episodes.endpoint.AgentEndpoint.serve`, no turn barrier).
A group's function waits on its own requests only, so a multi-turn function's slow sample holds back nobody else's.

The groups live in an :class:`~trl_nrollout.rollout.partial.agent_pool.AgentPool` (the runner here is
:class:`FuncRunner`, one episode record per sample): a partial rollout's step ends when its share of groups has
returned, and the others run on across the weight sync. A function never sees a step end: its request running then
is aborted with its tokens kept and queued again (it continues from them on the next step's weights: no token is
drawn twice, and each keeps the log-prob of the policy that drew it). A group that started more than ``max_staleness`` versions ago starts again: its records are
closed, so its function's next engine call raises :class:`GroupClosed` (a ``BaseException``: a user's ``except
Exception`` does not swallow it) and a new call of the function starts with the same prompt.

What trains is what the function returned (TRL's contract, checked by :func:`check_output`), not what the engine
generated: its ``env_mask`` and extra reward fields included.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from trl_nrollout.passes.multimodal import attach_images, dataset_images
from trl_nrollout.rollout.episodes.agent_calls import Call, EpisodeRecord
from trl_nrollout.rollout.seeds import prompt_seed, turn_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions


@dataclass
class FuncSample:
    """One sample as a ``rollout_func`` returned it: ``prompt_ids`` ``[P]``, ``completion_ids`` ``[C]``,
    ``logprobs`` ``[C]`` (0.0 where it gave None), ``finish_reason`` (``length`` at ``max_completion_length``),
    ``env_mask`` ``[C]`` (None: every token trains) and its ``extra`` reward fields."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    env_mask: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def check_output(output: dict, count: int, n: int, limit: int, need_logprobs: bool) -> list[FuncSample]:
    """A ``rollout_func``'s ``output`` for ``count`` prompts (each of ``n`` samples per group) as samples, in order;
    ValueError naming what is wrong and the fix (TRL's contract: ``prompt_ids``, ``completion_ids``, ``logprobs``
    one entry per prompt; optionally ``env_mask`` and extra per-sample fields). ``limit``: ``max_completion_length``
    (a completion that long was cut); ``need_logprobs``: the rollout correction needs the sampler's log-probs."""
    missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(output))
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict (TRL's contract: "
                         "prompt_ids, completion_ids, logprobs; optionally env_mask and extra fields).")
    prompt_ids, completion_ids = [list(p) for p in output["prompt_ids"]], [list(c) for c in output["completion_ids"]]
    if not (len(prompt_ids) == len(completion_ids) == count):
        raise ValueError(f"rollout_func returned {len(prompt_ids)} prompt_ids and {len(completion_ids)} "
                         f"completion_ids for {count} prompts (each prompt appears n={n} times: return one "
                         "sample per entry, in order).")
    logprobs = output["logprobs"]
    if logprobs is None:
        if need_logprobs:
            raise ValueError("rollout_func returned logprobs=None, but the rollout correction (rollout_is / "
                             "vllm_importance_sampling_correction) needs the sampler's log-probs; return them.")
        logprobs = [[0.0] * len(c) for c in completion_ids]
    logprobs = [[0.0 if v is None else float(v) for v in lp] for lp in logprobs]
    extra = {k: list(v) for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
    env_mask = extra.pop("env_mask", None)
    if env_mask is not None:
        env_mask = [[int(v) for v in m] for m in env_mask]
        bad = [i for i, (m, c) in enumerate(zip(env_mask, completion_ids)) if len(m) != len(c)]
        if bad:
            raise ValueError(f"rollout_func's env_mask of sample {bad[0]} has {len(env_mask[bad[0]])} entries for "
                             f"{len(completion_ids[bad[0]])} completion tokens; give one 0/1 per token.")
    short = sorted(k for k, v in extra.items() if len(v) != count)
    if short:
        raise ValueError(f"rollout_func's extra field {short[0]!r} has {len(extra[short[0]])} entries for {count} "
                         "prompts; give one per prompt (reward functions receive it as a keyword argument).")
    return [FuncSample(p, c, lp, "length" if len(c) >= limit else "stop",
                       None if env_mask is None else env_mask[i], {k: v[i] for k, v in extra.items()})
            for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, logprobs))]


def samples_batch(samples: list[FuncSample], n: int, offset: int) -> tuple[RolloutBatch, list | None, dict]:
    """Samples in order as a batch (groups of ``n`` from the job's sample ``offset``), their env masks (None when no
    sample has one; a sample without one trains every token) and their extra fields (one list per key, None where a
    sample lacks it)."""
    batch = RolloutBatch([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                         [s.logprobs for s in samples], [s.finish_reason for s in samples],
                         [(offset + i) // max(n, 1) for i in range(len(samples))])
    masks = None
    if any(s.env_mask is not None for s in samples):
        masks = [s.env_mask if s.env_mask is not None else [1] * len(s.completion_ids) for s in samples]
    keys = sorted({k for s in samples for k in s.extra})
    return batch, masks, {k: [s.extra.get(k) for s in samples] for k in keys}


class GroupClosed(BaseException):
    """The group's records were closed (it started again, too stale, or its pool closed): its function's run ends.
    A ``BaseException``, so that the function's own ``except Exception`` does not swallow it."""


class GroupEngine:
    """The ``rollout_engine`` a group's function sees: :meth:`generate_expanded` as the engine's, each sample one
    request of ``endpoint``'s queue, on behalf of the group's ``records`` (sample ``s`` of a call is record
    ``s % n``'s). ``max_model_len``: the engine's context."""

    def __init__(self, endpoint, records: list[EpisodeRecord], max_model_len: int) -> None:
        self.endpoint = endpoint
        self.records = records
        self.max_model_len = max_model_len

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = None, images: list[list] | None = None) -> RolloutBatch:
        """``sample_prompts`` ``[S][P]`` each sampled ``n`` times with ``sampling`` (seeded: each sample's seed from
        ``sampling.seed``, its record's place and the record's call count, so a sample's tokens do not depend on
        which requests share the engine); returns the ``S * n`` samples in order. ``sample_offset`` is ignored (the
        group is the call's). ``images``: per entry of ``sample_prompts``, its images (vLLM's ``multi_modal_data``,
        the prompt holding their placeholders unexpanded), as the whole-batch engine call takes them; the returned
        ``prompt_ids`` are then vLLM's expansion (what TRL's contract has the function return)."""
        from trl_nrollout.rollout.episodes.endpoint import EndpointError, PendingCall

        if images is not None and len(images) != len(sample_prompts):
            raise ValueError(f"rollout_func's generate_expanded got {len(images)} image lists for "
                             f"{len(sample_prompts)} prompts: give one list per prompt (empty for a text prompt).")
        states = [self.endpoint.episodes.get(r.key) for r in self.records]
        if any(state is None or state.closed for state in states):  # before any request is queued
            raise GroupClosed(self.records[0].key)
        calls = []
        per_sample = [list(imgs or []) for imgs in images for _ in range(n)] if images is not None else None
        for s, prompt in enumerate(p for p in sample_prompts for _ in range(n)):
            record, state = self.records[s % len(self.records)], states[s % len(self.records)]
            room = self.max_model_len - len(prompt)
            if room <= 0:
                raise ValueError(f"a rollout_func prompt of {len(prompt)} tokens does not fit the engine's context "
                                 f"of {self.max_model_len} (max_model_len): shorten it.")
            seed = None
            if sampling.seed is not None:
                seed = prompt_seed(turn_seed(sampling.seed, len(record.calls) + 1), state.index, 1)
            call = PendingCall(record.key, list(prompt), min(sampling.max_tokens, room), list(sampling.stop), seed,
                               sampling, images=per_sample[s] if per_sample is not None else [])
            record.calls.append(Call(list(prompt), [], [], "running"))  # its place; filled below
            calls.append((record, len(record.calls) - 1, call))
        for _, _, call in calls:
            self.endpoint.requests.put(call)
        out = []
        for record, at, call in calls:
            try:
                ids, logprobs, reason = call.future.result()
            except (EndpointError, CancelledError):
                raise GroupClosed(record.key) from None
            record.calls[at] = Call(list(call.prompt_ids), list(ids), list(logprobs), reason, images=list(call.images),
                                    expanded_ids=call.engine_prompt, versions=list(call.versions))
            out.append((call.engine_prompt if call.images else call.prompt_ids, ids, logprobs, reason))
        return RolloutBatch([list(p) for p, *_ in out], [list(c) for _, c, _, _ in out],
                            [list(lp) for _, _, lp, _ in out], [r for *_, r in out],
                            [s // max(n, 1) for s in range(len(out))])


class TrainerView:
    """The trainer as a group's function sees it: every attribute the trainer's, but ``rollout_engine``, the
    group's :class:`GroupEngine`."""

    def __init__(self, trainer, engine: GroupEngine) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "rollout_engine", engine)

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "_trainer"), name)


class FuncRunner:
    """Runs ``func`` (a ``rollout_func``) once per group of the records a pool hands out (``n`` consecutive records
    a group, its prompt their rows' ``prompt``), each group on a thread of its own, with ``trainer``'s view; a group
    that returns gets each record's :class:`FuncSample` as its ``result`` (checked: ``limit`` and ``need_logprobs``
    as :func:`check_output`'s); one whose function raised gets ``outcome="error"`` and the traceback as ``error``
    (the trainer raises it). ``max_model_len``: the engine's context. The runner interface of
    :class:`~trl_nrollout.rollout.dispatch.agent_runs.EpisodeRunner`."""

    def __init__(self, func: Callable, trainer, n: int, max_model_len: int, limit: int, need_logprobs: bool) -> None:
        self.func, self.trainer, self.n = func, trainer, n
        self.max_model_len, self.limit, self.need_logprobs = max_model_len, limit, need_logprobs

    def run(self, pull: Callable[[int], tuple[list[EpisodeRecord], bool]], endpoint,
            finished: threading.Event) -> None:
        """Run the groups of the records ``pull(running samples)`` hands out (``n`` consecutive records a group: at
        once, or as a balanced queue's pulls) and set ``finished`` when the last has ended."""
        running: list[tuple[threading.Thread, int]] = []
        drained = False
        try:
            while True:
                running = [(t, k) for t, k in running if t.is_alive()]
                if not drained:
                    new, drained = pull(sum(k for _, k in running))
                    for i in range(0, len(new), self.n):
                        thread = threading.Thread(target=self._group, args=(new[i:i + self.n], endpoint),
                                                  daemon=True, name="trl-nrollout-rollout-func")
                        thread.start()
                        running.append((thread, len(new[i:i + self.n])))
                if drained and not running:
                    return
                if running:
                    running[0][0].join(timeout=0.005)
        finally:
            finished.set()

    def _group(self, records: list[EpisodeRecord], endpoint) -> None:
        rows = [r.row for r in records]  # the prompts with the rows' images in their messages, as TRL passes them
        prompts = attach_images([r["prompt"] for r in rows], dataset_images(rows))
        try:
            output = self.func(prompts, TrainerView(self.trainer, GroupEngine(endpoint, records, self.max_model_len)))
            samples = check_output(output, len(records), self.n, self.limit, self.need_logprobs)
        except GroupClosed:
            return  # started again, or the pool closed: nothing of this run is kept
        except Exception as err:  # noqa: BLE001 - the trainer raises it, with the function's traceback
            text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            for r in records:
                r.outcome, r.error, r.result = "error", text, None
                endpoint.close_episode(r.key)
            return
        for r, sample in zip(records, samples):
            r.result = sample
            endpoint.close_episode(r.key)


def func_samples(records: list[EpisodeRecord]) -> list[FuncSample]:
    """The samples of finished groups' ``records``; a RuntimeError with the function's traceback where it raised."""
    failed = next((r for r in records if r.outcome == "error" or not isinstance(r.result, FuncSample)), None)
    if failed is not None:
        raise RuntimeError(f"rollout_func raised on the group of row {failed.row!r:.200} (run group by group: "
                           f"rollout_partial=True or rollout_multi_turn='requests'):\n{failed.error}")
    return [r.result for r in records]
