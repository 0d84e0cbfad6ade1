"""The engine protocol: everything the drivers above an engine (the trainer, the episode loops, dispatch, the partial
pool, the rollout ranks' serve loop) may use of it, in one core and a few optional capabilities.

An engine holds what is the engine's: its requests (add / step / abort through its request loop), sampling
parameters, weights and adapters, sleep / wake, ``generate_expanded`` and the gathers within its TP group (and, for
balanced dispatch, over the job). It drives nothing: the drivers that run episodes, dispatch and partial pools over
it are functions above it that take it as an argument (``rollout/dispatch/shares.py``, ``rollout/dispatch/
balanced.py``, ``rollout/partial/pool.py``, ``rollout/dispatch/agent_runs.py``), so a new engine gets them for free by implementing
what they call.

Every engine implements :class:`RolloutEngine` (the core) and names the optional capabilities it has in its
``capabilities`` set; a caller that needs one checks ``CAPABILITY in engine.capabilities`` (never the engine's
class), and then may use the members of that capability's protocol:

==================  =====================  =========================================================================
capability          protocol               what it adds
==================  =====================  =========================================================================
``ADAPTERS``        :class:`Adapters`      load a LoRA adapter as a new version the engine serves (its base stays)
``REQUESTS``        :class:`Requests`      a request-level loop (add / step, :class:`~trl_nrollout.rollout.engines.requests.
                                           EngineLoop`), the engine's prompts and sampling parameters, its seeding
``ABORT``           :class:`Abort`         the loop's ``abort`` keeps a request's tokens (partial rollouts' pool)
``BALANCED``        :class:`Balanced`      the job's collectives and store, for one queue every engine pulls from
``BUCKETS``         :class:`Buckets`       full weights or an adapter handed over as buckets of tensors (a rollout
                                           rank's engine, fed from the trainers' broadcast)
``JOBS``            :class:`Jobs`          the engines live on rollout ranks: jobs written ahead, their reports
``PREFILL_COUNTS``  :class:`PrefillCounts` samples whose prompt was prefilled once for its ``n`` samples
``SCORES``          :class:`Scores`        the log-probs of given completion tokens under the engine's weights (a
                                           teacher's engine: ``teacher_backend="vllm"``)
==================  =====================  =========================================================================

The engines: :class:`~trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup` (``ADAPTERS``, ``REQUESTS``, ``ABORT``,
``BALANCED``, ``BUCKETS``, ``SCORES``), :class:`~trl_nrollout.rollout.engines.hf_engine.HFEngine` (``PREFILL_COUNTS``: it generates with
the training model, so it cannot abort a request nor add one while it generates) and
:class:`~trl_nrollout.rollout.ranks.client.RemoteEngines` (``ADAPTERS``, ``JOBS``: the trainers' proxy of the rollout
ranks' engines). ``tests/test_engine_protocol.py`` checks that no module outside the engines uses a member of an
engine that is not named here, nor a private one, and that each engine has every member of what it declares.
A new engine implements the core and the capabilities it can, and is built by
:func:`~trl_nrollout.rollout.engines.build.build_engine` (``docs/architecture.md``, "Adding an engine").

Shapes: ``sample_prompts`` is a list of token-id lists, each prompt repeated ``n`` times consecutively (TRL's
order: a group's samples contiguous); a :class:`~trl_nrollout.rollout.types.RolloutBatch` has one entry per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions

if TYPE_CHECKING:  # (annotations only: these modules import the engines' helpers)
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.requests import EngineLoop

ADAPTERS = "adapters"
REQUESTS = "requests"
ABORT = "abort"
BALANCED = "balanced"
BUCKETS = "buckets"
JOBS = "jobs"
PREFILL_COUNTS = "prefill_counts"
SCORES = "scores"


@runtime_checkable
class RolloutEngine(Protocol):
    """The core every engine implements: generation in TRL's form, tool turns, weights, memory, its TP group."""

    #: the optional capabilities this engine has (the constants above); a caller checks them, not the class
    capabilities: frozenset[str]
    #: this process's rank among the engine's processes (a trainer's rank, or a rollout rank's role rank)
    rank: int
    #: the ranks of this rank's engine (its tensor-parallel group, in order; ``[rank]`` where it has one rank)
    tp_ranks: Sequence[int]
    #: the index of this rank's engine among the job's engines
    engine_index: int
    #: the longest prompt + completion the engine takes (None: no limit of its own, as the HF engine's)
    max_model_len: int | None

    @property
    def balances_job(self) -> bool:
        """Whether this engine's rollouts pull from one queue shared with other engines (``rollout_dispatch=
        "balanced"`` with several engines): :meth:`Balanced.gather_job` then spans the job, not the TP group, and the
        balanced drivers use the job's queue (else they run the engine's share, which is then the job)."""
        ...

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = None, images: list[list] | None = None,
                          mm: list | None = None) -> RolloutBatch:
        """One sample per entry of ``sample_prompts`` (each prompt ``n`` times), in the same order; seeds from the
        samples' global place (``sample_offset``: this rank's first sample in the job). Images, per sample: as the
        engine expands them itself (``images``: PIL images, placeholders unexpanded; vLLM, rollout ranks) or as the
        processor's tensors (``mm``: the HF engine). Collective over the engine's ranks."""
        ...

    def generate_turns(self, contexts: list[list[int]], budgets: list[int], sampling: SamplingOptions,
                       sample_offset: int = 0, sample_ids: list[int] | None = None,
                       num_samples: int | None = None, images: list[list] | None = None,
                       mm: list | None = None) -> RolloutBatch:
        """One more turn of multi-turn samples: one sample per context, each cut at its own token budget. Every rank
        calls it, possibly with no contexts. Images per context as in :meth:`generate_expanded` (``images``: the
        context's placeholders unexpanded; ``mm``: expanded, the processor's tensors)."""
        ...

    def check_prompt_length(self, longest: int, max_tokens: int) -> None:
        """Raise, naming the options that fix it, where a prompt of ``longest`` tokens leaves no room for
        ``max_tokens`` within :attr:`max_model_len` (nothing where there is no limit)."""
        ...

    def load_weights(self, model: nn.Module, *, merge_lora: bool = True, version: int = 0) -> dict:
        """Copy the training model's weights into the engine (``merge_lora=False``: a PEFT model's base without its
        adapter; ``version``: the policy version, which engines on rollout ranks tag their samples with). Every rank
        of the job calls it (ZeRO-3 / FSDP gather collectively). Returns ``bytes``, ``buckets``,
        ``peak_bucket_bytes`` and ``seconds``."""
        ...

    def gather_tp(self, obj: Any) -> list:
        """``obj`` of every rank of this rank's engine (TP group), in rank order; ``[obj]`` with one rank."""
        ...

    def sleep(self) -> None:
        """Free the engine's memory (weights, KV cache) while the trainer works; a no-op where it cannot."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed (``tags``: ``"weights"`` / ``"kv_cache"``, default all)."""
        ...

    def close(self) -> None:
        """Release the engine's resources now (memory, process groups), not at interpreter exit."""
        ...


@runtime_checkable
class Adapters(Protocol):
    """``ADAPTERS``: the engine serves a LoRA adapter over its base weights (``rollout_lora_sync="adapter"``)."""

    def load_adapter(self, model: nn.Module, *, version: int = 0) -> dict:
        """Hand the engine the training model's adapter as a new version; the base weights stay. Returns ``bytes``
        and ``seconds`` (and the engine's own counts)."""
        ...


@runtime_checkable
class Requests(Protocol):
    """``REQUESTS``: a request-level loop in this process, and what a driver needs to build its requests: the
    engine's prompts, sampling parameters and seeding (the drivers: ``rollout/dispatch/``, the partial pool, the
    endpoint agents)."""

    #: the job's layout (engines, TP groups)
    layout: RolloutLayout
    #: ``rollout_seed_mode``: ``"sample"`` (each request seeded from its sample's place) or ``"engine"`` (the
    #: engine's generators, seeded per call by :meth:`engine_rng`)
    seed_mode: str

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once (a request holds ``n`` of them until it ends)."""
        ...

    def ready(self) -> None:
        """Before a driver's requests: a clear error where the engine was closed; woken where it sleeps."""
        ...

    def request_loop(self, stream: bool = False) -> EngineLoop:
        """A loop over this rank's engine (add / step / abort its requests; ``stream``: every step's new tokens;
        ``engine_unfinished()``: the engine's unfinished requests, any caller's), whose requests use the engine's
        current adapter version. The engine is made ready first (:meth:`ready`)."""
        ...

    def request_prompt(self, ids: Sequence[int], images: list | None = None) -> Any:
        """The engine's prompt for a request of token ``ids`` (with the group's ``images``, where it has any)."""
        ...

    def sampling_params(self, n: int, sampling: SamplingOptions) -> Any:
        """The engine's own sampling parameters for a request of ``n`` samples (vLLM's ``SamplingParams``)."""
        ...

    def engine_rng(self, seed: int | None) -> AbstractContextManager[None]:
        """A context for a call's requests: with ``seed_mode="engine"`` and a seed, the engine's generators seeded
        from ``seed`` and the engine's index (the caller's restored afterwards); otherwise nothing."""
        ...

    def barrier_before_generate(self) -> None:
        """The engine's ranks meet before its collectives, so that no training collective interleaves with them."""
        ...

    def generate_engine(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingOptions,
                        group_offset: int = 0, images: Sequence[list] | None = None) -> RolloutBatch:
        """``n`` samples of each of ``prompts`` (the same on every rank of the engine) on this rank's engine."""
        ...


@runtime_checkable
class Abort(Protocol):
    """``ABORT``: the request loop's ``abort`` stops a request with its tokens kept, so a partial rollout's pool
    (``rollout/dispatch/shares.py``'s ``run_partial``) can continue it after the weight sync. No member of its own:
    the capability is a promise about :meth:`Requests.request_loop`'s loop."""


@runtime_checkable
class Balanced(Protocol):
    """``BALANCED``: what the balanced drivers (``rollout/dispatch/balanced.py``: one queue of the job's groups that
    every engine pulls from, each group's samples sent home) need beyond a request loop: collectives over every rank
    of the job and a store they all reach. With one engine (:attr:`RolloutEngine.balances_job` False) the drivers
    run the engine's share, and these span the TP group (or are not used)."""

    #: set by a driver for a span (``balanced_calls``: a ``rollout_func``'s calls as balanced rollouts): while it
    #: is not None, :meth:`RolloutEngine.generate_expanded` hands its call to it (and clears it during the call)
    generate_hook: Callable[..., RolloutBatch] | None

    def gather_job(self, obj: Any) -> list:
        """``obj`` of every rank of the job, in rank order (the TP group's with one engine)."""
        ...

    def exchange_job(self, parts: list) -> list:
        """``parts[r]`` to rank ``r`` of the job (None: nothing), from every rank at once; returns what each rank
        sent this one. Only while :attr:`RolloutEngine.balances_job`."""
        ...

    @property
    def job_store(self) -> Any:
        """A key-value store every rank of the job reaches (``add(key, k)`` atomic, returns the total;
        ``delete_key``). Only while :attr:`RolloutEngine.balances_job`."""
        ...

    def job_key(self, name: str | None = None) -> str:
        """A key of this engine group in :attr:`job_store`: ``name``'s, or a fresh one for one collective call
        (every rank calls it in the same order)."""
        ...


@runtime_checkable
class Buckets(Protocol):
    """``BUCKETS``: weights handed over as buckets of tensors (a rollout rank's engine, from the trainers)."""

    #: the job's layout (engines, TP groups)
    layout: RolloutLayout

    @property
    def dtype(self) -> str:
        """The engine's weights' dtype (e.g. ``"torch.bfloat16"``): the trainers cast what they send to it."""
        ...

    @property
    def tp_group(self) -> Any:
        """The engine's TP process group (gloo; None with one rank): a version staged on its first rank reaches
        the others over it."""
        ...

    def parameter_names(self) -> set[str]:
        """The names of the engine's parameters (a tied weight is sent under the names the engine has)."""
        ...

    def load_buckets(self, buckets: Any) -> dict:
        """Load full weights from an iterator of buckets (lists of ``(name, tensor)``, whole decoder layers)."""
        ...

    def load_adapter_tensors(self, tensors: dict) -> dict:
        """Load an adapter given as PEFT-named tensors as a new version."""
        ...


@runtime_checkable
class Jobs(Protocol):
    """``JOBS``: the engines live on rollout ranks and this is the trainers' proxy: jobs may be written steps ahead
    (``generate_expanded(..., ahead=, step_job=)``), and each call leaves its report."""

    #: the last job's report: ``wait_s``, ``gen_s``, ``version`` (oldest policy version in it), ``agent_stats``,
    #: ``moved_groups`` (balanced), ``partial`` (the engines' pool counts)
    last_job: dict
    #: the last weight version's transfer: ``version``, ``bytes``, ``seconds`` (None while it is on its way)
    last_transfer: dict
    #: a partial job's pools in flight, one per rollout engine that holds one (trainer rank 0; a checkpoint's)
    partial_pools: list

    def run_job_episodes(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions, agent: dict,
                         ahead: list[tuple] = (), step_job: bool = False, images: list[list] | None = None
                         ) -> tuple[RolloutBatch, list[dict]]:
        """Whole tool episodes (or a partial job's finished groups) generated on the rollout ranks with their tools;
        the batch and each sample's extras."""
        ...

    def end(self) -> None:
        """The trainers' ``train()`` / ``evaluate()`` returned: so do the rollout ranks'."""
        ...

    def jobs_ahead(self) -> list | None:
        """Trainer rank 0, at a checkpoint: the jobs written ahead with their results (None: nothing to keep)."""
        ...

    def restore_jobs_ahead(self, saved: list) -> None:
        """Trainer rank 0, at a resume: a checkpoint's :meth:`jobs_ahead` become this run's jobs written ahead."""
        ...


@runtime_checkable
class PrefillCounts(Protocol):
    """``PREFILL_COUNTS``: counts of samples whose prompt was prefilled once for its ``n`` samples (the trainer logs
    the fraction and resets both)."""

    prefill_shared_samples: int
    generated_samples: int


@runtime_checkable
class Scores(Protocol):
    """``SCORES``: score given tokens instead of sampling them (a teacher served by an engine of its own)."""

    def score_completions(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
                          ) -> list[list[float]]:
        """Each completion token's log-prob given its prompt and the completion's tokens before it, at temperature
        1, ``[B][C_i]``; collective over the engine's TP group (every rank calls with its own samples)."""
        ...


#: each capability's protocol
CAPABILITIES: dict[str, type] = {ADAPTERS: Adapters, REQUESTS: Requests, ABORT: Abort, BALANCED: Balanced,
                                 BUCKETS: Buckets, JOBS: Jobs, PREFILL_COUNTS: PrefillCounts,
                                 SCORES: Scores}


def protocol_members(protocol: type) -> set[str]:
    """The names a protocol class declares (methods, properties and annotated attributes), ``_``-names left out."""
    names = set(getattr(protocol, "__annotations__", {}))
    names.update(k for k, v in vars(protocol).items() if callable(v) or isinstance(v, property))
    return {n for n in names if not n.startswith("_")}


def engine_members() -> set[str]:
    """Every member a driver may use of an engine: the core's and each capability's."""
    out = protocol_members(RolloutEngine)
    for protocol in CAPABILITIES.values():
        out |= protocol_members(protocol)
    return out


def has(engine: object, capability: str) -> bool:
    """Whether ``engine`` declares ``capability`` (False for None: no engine yet)."""
    return capability in getattr(engine, "capabilities", ())

