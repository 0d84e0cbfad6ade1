"""A rollout rank's state between the trainers' messages (:class:`RankState`), and the start message's settings of
the episodes it runs (:class:`EpisodeSettings`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FuncSettings:
    """A ``rollout_func`` run group by group on the rollout ranks: ``n`` samples a group, the completions' token
    ``limit``, and whether what it returns must carry log-probs (``need_logprobs``: ``rollout_is`` is set)."""

    n: int
    limit: int
    need_logprobs: bool


@dataclass
class EpisodeSettings:
    """The start message's ``agent`` entry, kept by a rollout rank that runs episodes (TRL tool episodes request by
    request, ``agent=`` episodes, a ``rollout_func`` group by group): the trainers' tokenizer (or processor) pickled
    as TRL left it (its response template parses the tool calls), the chat template rendering tool results, the
    colocated loop's seed and limits, and the tool workers; for endpoints, ``endpoint`` (``start_endpoint``'s
    keywords), ``timeout`` (``agent_timeout_s``) and ``max_running`` (``agent_max_concurrent``); ``func`` for a
    ``rollout_func``; ``env_tools`` (environment name -> its tools' JSON schemas) where the environments stay on
    the trainers."""

    processing_class: bytes
    chat_template: str | None
    chat_template_kwargs: dict
    seed: int
    max_iterations: int | None
    max_completion_length: int
    max_model_len: int
    workers: int
    endpoint: dict | None = None
    timeout: float | None = None
    max_running: int | None = None
    func: FuncSettings | None = None
    env_tools: dict | None = None


@dataclass
class RankState:
    """What a rollout rank keeps from one of the trainers' messages to the next, and from ``train()`` to
    ``evaluate()`` (:func:`~trl_nrollout.rollout.ranks.serve.serve` and the job modules it calls read and set it).

    It stays in its process: the trainers and the rollout ranks exchange messages through the bridge's store
    (:mod:`trl_nrollout.rollout.ranks.client`), never this value. The first four fields come from the user's script (the
    same on every process); the next from the ``start`` and ``weights`` messages; the last are built lazily by the
    first job that needs them.
    """

    #: the user's ``tools=`` (the same functions on every process): tool episodes run here with them
    tools: list = field(default_factory=list)
    #: the user's ``agent=`` (endpoint agents run here, on this rank's endpoint)
    user_agent: Any = None
    #: the user's ``rollout_func`` (run here group by group: partial, or ``rollout_multi_turn="requests"``)
    user_func: Callable | None = None
    #: the user's config as this process built it (a ``rollout_func``'s ``trainer.args``)
    user_args: Any = None
    #: the index of the next message to read
    msg: int = 0
    #: weight versions the message reader may stage at once (the start message's)
    slots: int = 1
    #: this rank's engine (built at ``start``; None before and after ``stop``)
    engine: Any = None
    #: ``rollout_dispatch`` of the start message: a registered dispatch rule's name (``rollout/axes.py``)
    dispatch: str = "shares"
    #: the start message's ``agent`` entry (the trainers' tokenizer pickled, tool schemas, limits), or None
    agent: EpisodeSettings | None = None
    #: the bridge to the trainers (environments' tool calls go home through its store)
    bridge: Any = None
    #: the policy version of the weights the engine holds
    version: int = 0
    #: the trainers said ``stop``: the engine is closed and nothing more is served
    stopped: bool = False
    #: this rank's ``agent=`` endpoint (an OpenAI-compatible server over the engine), once started
    endpoint: Any = None
    #: the tool episodes' callbacks and worker count (``agent_callbacks``), once built
    agent_callbacks: tuple | None = None
    #: the trainers' tokenizer, unpickled once (environments' tool-call parsing)
    agent_tokenizer: Any = None
    #: the trainer view a ``rollout_func`` sees here (:class:`~trl_nrollout.rollout.ranks.episodes.RankTrainer`)
    func_trainer: Any = None
    #: per trainer host: the sender of environments' tool calls to the trainer that owns the environment
    env_senders: dict = field(default_factory=dict)
    #: a partial job's groups in flight between jobs (:mod:`trl_nrollout.rollout.ranks.partial`), or None
    partial_pool: list | None = None
    #: partial endpoint agents' pool (:class:`~trl_nrollout.rollout.partial.agent_pool.AgentPool`), or None
    agent_pool: Any = None
