"""Fixed shares (``rollout_dispatch="shares"``, the default): each engine runs the groups of its own ranks (a TP
group's ranks pool their prompts), as drivers over any engine with a request loop (``REQUESTS``; partial rollouts
also ``ABORT``). Single-turn shares are the engine's own :meth:`~trl_nrollout.rollout.engines.protocol.RolloutEngine.
generate_expanded`; here the episodes that run request by request:

- :func:`run_agents`: TRL tool episodes without a turn barrier;
- :func:`run_partial`: one step of a partial rollout's pool (abort the rest, tokens kept);
- :func:`run_partial_agents`: the same for tool episodes.

Every function is collective over the engine's TP group (every rank calls it with the same pool / its own prompts)
and uses only what :mod:`trl_nrollout.rollout.engines.protocol` names: ``request_loop``, ``request_prompt``,
``sampling_params``, ``ready``, ``engine_rng``, ``barrier_before_generate``, ``gather_tp``, ``check_prompt_length``,
``seed_mode``, ``rank``, ``tp_ranks``, ``engine_index``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace

from trl_nrollout.rollout.dispatch import require
from trl_nrollout.rollout.engines.protocol import ABORT, REQUESTS
from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, PartialRun
from trl_nrollout.rollout.episodes.in_flight import run_partial as run_partial_loop
from trl_nrollout.rollout.episodes.tools import AgentCallbacks, AgentSample, AgentStats, run_agent_requests
from trl_nrollout.rollout.seeds import SEED_BITS, engine_seed, prompt_seed
from trl_nrollout.rollout.seeds import turn_seed as own_turn_seed
from trl_nrollout.rollout.types import SamplingOptions, whole_groups


def own_seed_base(engine, sampling: SamplingOptions, per_request: bool) -> int | None:
    """TP > 1 without per-request seeds (``seed_mode="engine"``, or no seed): the base of the seeds every rank gives
    the requests (from the call's seed and the engine's index; without a seed, a number the TP group's first rank
    draws), so a tool drawing from a global generator on one rank cannot make the ranks sample apart. None
    otherwise. Collective over the TP group where it draws."""
    if per_request or len(engine.tp_ranks) == 1:
        return None
    if sampling.seed is not None:
        return engine_seed(sampling.seed, engine.engine_index)
    return engine.gather_tp(secrets.randbits(SEED_BITS))[0]


def agent_inputs(sample_prompts: list[list[int]], images=None) -> list[tuple[list[int], list[int], list]]:
    """Per sample, what its episode's first request needs: ``(prompt ids, the engine's prompt ids, its images)``
    (``images``: the prompts' encoding, ``passes.multimodal.EncodedPrompts``, whose ``engine_ids`` hold the image
    placeholders unexpanded; None for text: the prompt ids and no images). Picklable: gathered over the ranks that
    share a request loop (the TP group's, or the job's under a balanced queue)."""
    pictures = images.images if images is not None else [[] for _ in sample_prompts]
    engine_ids = images.engine_ids if images is not None else sample_prompts
    return [(list(p), list(e), list(i)) for p, e, i in zip(sample_prompts, engine_ids, pictures)]


def first_prompt(engine, inputs: tuple[list[int], list[int], list]):
    """The engine's prompt of a group's first turn from its :func:`agent_inputs` entry (its images with it)."""
    _, engine_prompt, pics = inputs
    return engine.request_prompt(engine_prompt, pics or None)


def continued_prompt(engine, context: list[int], view=None):
    """The engine's prompt of a sample's turn after its tool results: ``context`` for text, else its
    :class:`~trl_nrollout.rollout.episodes.tool_images.TurnView` (the context with the placeholders unexpanded and
    every image so far: the prompt's, then its tools')."""
    if view is None or not view.images:
        return engine.request_prompt(context)
    return engine.request_prompt(view.engine_context, view.images)


def agents_media(agent: AgentCallbacks, every: list[tuple[list[int], list[int], list]]) -> AgentCallbacks:
    """``agent`` with its images (``agent.media``) indexed by the samples ``every`` (:func:`agent_inputs` of the
    ranks whose samples this engine may run, in their order): where a queue's engine runs other ranks' groups, a
    sample's view (its prompt's images, its engine ids) must be read at its place in the job, not in its rank."""
    if agent.media is None:
        return agent
    media = replace(agent.media, prompt_images=[list(i) for _, _, i in every],
                       engine_prompts=[list(e) for _, e, _ in every])
    return replace(agent, media=media)


def run_agents(engine, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
               turn_seed: Callable[[int], int | None], agent: AgentCallbacks, workers: int,
               sample_offset: int | None = None, images=None) -> tuple[list[AgentSample], list[int], AgentStats]:
    """Multi-turn episodes of this rank's samples (TRL's form: prompts repeated ``n`` times) without a turn
    barrier (:func:`~trl_nrollout.rollout.episodes.tools.run_agent_requests`) on ``engine``: a sample whose turn calls
    tools leaves the engine while they run (``workers`` threads) and re-enters with their results; the others keep
    generating. Collective over the TP group. Returns this rank's samples in order, their groups' indices and the
    engine's :class:`AgentStats`. ``images``: the prompts' encoding (``passes.multimodal.EncodedPrompts``: the
    engine takes ``engine_ids`` and the images, the samples keep the processor's ``ids``), None for text; a tool's
    images re-enter with their sample (``agent.media``).

    Seeds (``rollout_seed_mode="sample"``): the first turn's as ``generate_expanded``'s; the turn after tool round
    ``r`` of engine sample ``s`` draws from ``turn_seed(r)``, the engine's index and ``s``. A seed thus fixes each
    request's draws whatever order the tools finish in; which samples share an engine step still depends on the
    tools' timing (batch composition can move a float's last bits).

    TP > 1 without those seeds: every request still gets a seed of its own (:func:`own_seed_base`), the turn
    (:func:`~trl_nrollout.rollout.seeds.turn_seed`) and the sample's place in the engine, the same on each rank.
    The tools run on threads while the engine samples, on the rank that owns the sample only; a tool drawing from
    NumPy's global generator (whence vLLM's Model Runner V2 seeds a request without a seed) or torch's (whence the
    V1 runner samples one) would make that rank sample other tokens than the others."""
    require(engine, REQUESTS, what="run_agents (tool episodes request by request)")
    engine.barrier_before_generate()
    per_rank = engine.gather_tp(agent_inputs(sample_prompts, images))
    every = [x for chunk in per_rank for x in chunk]
    flat = [p for p, _, _ in every]
    unique = whole_groups(flat, n, engine.engine_index)
    group_inputs = every[::n]  # (a group's samples share their prompt)
    mine_at = engine.tp_ranks.index(engine.rank)
    first = sum(len(c) for c in per_rank[:mine_at])
    offset = engine.rank * len(sample_prompts) if sample_offset is None else sample_offset
    group_offset = (offset - first) // n
    engine.ready()
    engine.check_prompt_length(max((len(p) for p in unique), default=0), sampling.max_tokens)
    per_request = sampling.seed is not None and engine.seed_mode == "sample"
    own_base = own_seed_base(engine, sampling, per_request)

    groups = []
    for g, p in enumerate(unique):
        seed = prompt_seed(sampling.seed, group_offset + g, n) if per_request else None
        if own_base is not None:
            seed = prompt_seed(own_turn_seed(own_base, 0), g, n)
        groups.append((list(p), first_prompt(engine, group_inputs[g]),
                       engine.sampling_params(n, replace(sampling, seed=seed))))

    def continue_request(s: int, round_: int, context: list[int], budget: int, view=None):
        base = turn_seed(round_) if per_request else None
        seed = None if base is None else prompt_seed(base, engine.engine_index * len(flat) + s, 1)
        if own_base is not None:
            seed = prompt_seed(own_turn_seed(own_base, round_), s, 1)
        return (continued_prompt(engine, context, view),
                engine.sampling_params(1, replace(sampling, max_tokens=budget, seed=seed)))

    mine = {first + i: i for i in range(len(sample_prompts))}
    tp = len(engine.tp_ranks) > 1
    with engine.engine_rng(sampling.seed):
        samples, stats = run_agent_requests(
            engine.request_loop(stream=True), groups, n, mine, agent, continue_request=continue_request,
            exchange=engine.gather_tp, workers=workers, poll_s=0.01 if tp else None)
    return ([samples[first + i] for i in range(len(sample_prompts))],
            [group_offset + (first + i) // n for i in range(len(sample_prompts))], stats)


def start_pool(engine, groups: list[InFlightGroup], sampling: SamplingOptions) -> None:
    """Before a partial rollout's call: the engine ready, every unfinished group's prompt within the engine's
    length, the ranks met (TP on GPUs)."""
    engine.ready()
    for g in groups:
        if not g.finished:
            engine.check_prompt_length(len(g.prompt_ids), sampling.max_tokens)
    engine.barrier_before_generate()


def run_partial(engine, groups: list[InFlightGroup], target: int, sampling: SamplingOptions, version: int
                ) -> PartialRun:
    """One step of a partial rollout on this rank's engine (see :mod:`trl_nrollout.rollout.episodes.in_flight`): run the pool
    ``groups`` (the same on every rank of the TP group) until ``target`` of them have finished, stop the others
    with their tokens kept; new tokens are tagged ``version``. Seeds: with a seed and ``seed_mode="sample"``,
    request ``r`` of the call gets a seed from the call's seed, the engine's index and its place (a sample
    continued in a later step draws from another seed than it would have uninterrupted). A group with images sends
    them with every request, a continued sample's included."""
    require(engine, REQUESTS, ABORT, what="run_partial (rollout_partial=True)")
    start_pool(engine, groups, sampling)
    per_request = sampling.seed is not None and engine.seed_mode == "sample"
    base = engine_seed(sampling.seed, engine.engine_index) if per_request else None

    def make_params(n: int, budget: int, slot: int):
        seed = base + slot if per_request else None
        return engine.sampling_params(n, replace(sampling, max_tokens=budget, seed=seed))

    with engine.engine_rng(sampling.seed):
        return run_partial_loop(engine.request_loop(stream=True), groups, target, version, sampling.max_tokens,
                                make_params, engine.request_prompt)


def run_partial_agents(engine, groups: list[InFlightGroup], target: int, sampling: SamplingOptions, version: int,
                       agent: AgentCallbacks, workers: int, owns: Callable[[InFlightGroup], bool],
                       done: Callable[[list[int]], bool] | None = None) -> tuple[PartialRun, AgentStats]:
    """:func:`run_partial` for tool-calling episodes (:mod:`trl_nrollout.rollout.episodes.partial_tools`): the pool's
    samples run turn after turn as requests, a group's tools on the rank ``owns`` names, until ``target`` groups
    have finished (or ``done(finish_order)`` says enough did). Seeds as :func:`run_partial`'s; at TP > 1 every
    request gets a seed (:func:`own_seed_base`)."""
    from trl_nrollout.rollout.episodes.partial_tools import run_partial_agents as run_partial_agents_loop

    require(engine, REQUESTS, ABORT, what="run_partial_agents (rollout_partial=True with tool episodes)")
    start_pool(engine, groups, sampling)
    seeded = sampling.seed is not None and engine.seed_mode == "sample"
    base = engine_seed(sampling.seed, engine.engine_index) if seeded else own_seed_base(engine, sampling, False)

    def make_params(n: int, budget: int, slot: int, _request):
        seed = None if base is None else base + slot
        return engine.sampling_params(n, replace(sampling, max_tokens=budget, seed=seed))

    with engine.engine_rng(sampling.seed):
        return run_partial_agents_loop(
            engine.request_loop(stream=True), groups, target, version, agent, make_params=make_params,
            prompt=engine.request_prompt, owns=owns, exchange=engine.gather_tp, workers=workers,
            poll_s=0.01 if len(engine.tp_ranks) > 1 else None, done=done)
