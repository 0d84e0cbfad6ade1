"""Agents written in any framework, trained as they are: ``NRolloutGRPOTrainer(agent=...)``.

An agent is a function (sync or ``async``) that runs one episode: given an OpenAI client whose base URL is its
episode's on the trainer's endpoint (:mod:`trl_nrollout.rollout.agent_endpoint`) and the dataset row, it talks to
the policy as to any OpenAI-compatible server and returns its reward (a number), a dict of reward-function kwargs,
or None (unscored). Parameters are matched by name: ``client`` (an ``openai.AsyncOpenAI`` for an async agent, an
``openai.OpenAI`` otherwise), ``base_url`` and ``api_key`` (for frameworks that build their own client), ``row``
(the dataset row), ``model`` (the name to send); a function of two positional parameters gets ``(client, row)``.

Each step every rank runs its ``n`` episodes per prompt at once (async agents on one event loop, sync agents in
threads) against its own endpoint and engine, while the trainer's thread runs their requests on the engine as they
come (no turn barrier). What trains is what the engine generated
(:func:`~trl_nrollout.rollout.agent_episodes.assemble`): an episode whose calls chain is one sample (tokens between
calls masked); an episode whose agent edited its history (split) trains each call as a sample of its own with the
episode's advantage (:func:`split_calls`, :func:`~trl_nrollout.trainer.stages.expand_segments`; a rank then trains
more rows than its share of episodes), and ``agent/split_episodes`` counts them. An agent that raises, or runs past ``agent_timeout_s``, is
an unscored episode (its reward None: TRL's rules), never a hang; one past ``agent_max_calls`` gets an error
answer and its reward as it returns it.

With ``rollout_dispatch="balanced"`` over several engines the ranks pull groups of the job's rows from one queue,
run them on their own endpoints and send the finished episodes home (:meth:`AgentRollouts._agent_rollout`).

Reward: without ``reward_funcs`` the agent's number is the reward (:func:`agent_reward`); with them, every function
gets ``agent_reward`` (and a dict result's keys) as keyword arguments.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from accelerate.utils import gather_object

from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.agent_episodes import Assembled, EpisodeRecord, assemble, reward_kwargs
from trl_nrollout.rollout.agent_runs import EpisodeRunner, agent_arguments
from trl_nrollout.rollout.dispatch import PullStats
from trl_nrollout.rollout.seeds import prompt_seed, turn_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.stages import Sample

logger = logging.getLogger(__name__)


def agent_reward(completions: list, agent_reward: list | None = None, **kwargs) -> list[float | None]:
    """The reward function of an agent trainer without ``reward_funcs``: each episode's own reward, as its agent
    returned it (None: unscored)."""
    return list(agent_reward) if agent_reward is not None else [None] * len(completions)


def split_calls(assembled: Assembled, record: EpisodeRecord, limit: int | None) -> tuple[Sample, ...]:
    """A split episode's calls after the first, each a sample of its own (its prompt as the engine saw it, its
    completion and the engine's log-probs; ``length`` where the engine stopped at the token limit or the completion
    reaches ``limit``); empty for an episode that is one sample."""
    if not assembled.split:
        return ()
    out = []
    for call in record.calls[1:]:
        ids = list(call.completion_ids)
        if not ids:  # a call that generated nothing has nothing to train
            continue
        cut = call.finish_reason == "length" or (limit is not None and len(ids) >= limit)
        out.append(Sample(list(call.prompt_ids), ids, list(call.logprobs), "length" if cut else "stop", None))
    return tuple(out)


class AgentRollouts:
    """Mixin of :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer`: the agent episode kind (see the module)."""

    agent = None
    _agent_endpoint = None

    def _agent_init(self, agent, reward_funcs):
        """Keep ``agent`` (checked: a callable with parameters the trainer fills) and return the reward functions:
        ``reward_funcs``, or the agent's own reward (:func:`agent_reward`) when none are given."""
        if agent is None:
            return reward_funcs
        if not callable(agent):
            raise TypeError(f"agent={agent!r} must be a function (sync or async) running one episode.")
        agent_arguments(agent)
        self.agent = agent
        return reward_funcs if reward_funcs else [agent_reward]

    def _agent_close(self) -> None:
        if self._agent_endpoint is not None:
            self._agent_endpoint.close()
            self._agent_endpoint = None

    def _agent_refusal(self) -> str | None:
        """Why this trainer cannot run ``agent=`` (None: it can); the rows of
        :data:`~trl_nrollout.rollout.axes.REFUSALS` whose first side is ``agent``."""
        from trl_nrollout.rollout.axes import machine_refusal

        args = self.args
        if self.rollout_backend != "vllm":
            return machine_refusal("agent", "drop agent=", auto=args.rollout_backend == "auto")
        if self.tools or getattr(self, "environment_factories", None) or self.rollout_func is not None:
            return ("agent= with tools, environment_factory or rollout_func: the agent is the episode's loop and runs "
                    "its own tools; give the agent its tools, or drop agent=.")
        for option, on, why in (
                ("rollout_ranks", args.rollout_ranks, "each rank serves its own episodes on its own engine"),
                ("rollout_partial=True", args.rollout_partial, "an agent's episode cannot stop and continue after a "
                                                               "weight sync yet")):
            if on:
                return (f"agent= with {option} is not built yet: {why}. Remove {option.split('=')[0]} (or set it off) "
                        "for agents.")
        if args.rollout_seed_mode == "engine":
            return ("agent= with rollout_seed_mode='engine': the endpoint seeds each request (a sample's tokens must "
                    "not depend on which other requests share an engine step); use rollout_seed_mode='sample'.")
        return None

    def _agent_start(self):
        """The rank's endpoint, started once (its port stays for the run)."""
        if self._agent_endpoint is None:
            from trl_nrollout.rollout.agent_endpoint import AgentEndpoint

            args = self.args
            engine = self.rollout_engine
            parse = None
            tok = self._tokenizer
            if getattr(tok, "response_schema", None) is None and getattr(tok, "response_template", None) is None:
                from trl.chat_template_utils import add_response_schema

                try:  # TRL knows the tool-call format of Qwen2.5/Qwen3/Llama-3/... templates
                    add_response_schema(tok)
                except ValueError:
                    logger.info("agent endpoint: TRL has no response parser for this chat template: answers are "
                                "plain text (no tool_calls).")
            if getattr(tok, "response_schema", None) is not None or getattr(tok, "response_template", None) is not None:
                from trl.chat_template_utils import parse_response

                def parse(ids, prefix, tools):
                    return parse_response(tok, ids, prefix=prefix, tools=None)
            policy = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                      "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
            self._agent_endpoint = AgentEndpoint(
                self._tokenizer, model_name=self._model_path(), max_model_len=engine.max_model_len,
                max_completion_length=args.max_completion_length, max_calls=args.agent_max_calls, parse=parse,
                policy=policy)
            self._agent_endpoint.start()
            logger.info("agent endpoint: http://127.0.0.1:%d/e/<episode>/v1 (rank %d)", self._agent_endpoint.port,
                        self.accelerator.process_index)
        return self._agent_endpoint

    def _agent_rollout(self, inputs: list[dict], prompts: list, n: int, sampling: SamplingOptions, mode: str
                       ) -> tuple[RolloutBatch, Any]:
        """Run this rank's episodes (one per sample of ``inputs``, TRL's order: each prompt ``n`` times) through the
        endpoint and return what trains: the batch (prompt, completion, log-probs per episode) and the
        :class:`~trl_nrollout.trainer.multiturn.Episode` (masks, the episodes' messages, the agents' reward kwargs).

        ``rollout_dispatch="balanced"`` over several engines: every rank's rows form one queue of groups
        (:meth:`~trl_nrollout.rollout.vllm_balanced.BalancedDispatch.job_queue`); each rank runs the episodes of the
        groups it pulls on its own endpoint and engine, pulling while it holds fewer than its engine's share of
        ``max_num_seqs`` plus a group, and the finished episodes go home to the ranks that own their rows. A
        sample's seeds depend on its place in the job, not on the rank that ran it."""
        from trl_nrollout.trainer.multiturn import Episode

        endpoint = self._agent_start()
        engine = self.rollout_engine
        rank, step = self.accelerator.process_index, self.state.global_step
        balanced = self.args.rollout_dispatch == "balanced" and getattr(engine, "_world_group", None) is not None
        if balanced:  # the job's rows, rank order: rank r's samples follow those of the ranks before it
            every = engine.gather_job([dict(row) for row in inputs])
            counts = [len(rows) for rows in every]
            rows = [row for part in every for row in part]
            offset = sum(counts[:rank])
        else:
            rows, offset = [dict(row) for row in inputs], rank * len(inputs)
        base = sampling.seed

        def seed(s: int, c: int) -> int | None:  # the first call's as a single-turn sample's; later ones per turn
            if base is None:
                return None
            return base + s if c == 0 else prompt_seed(turn_seed(base, c), s, 1)

        def record(s: int) -> EpisodeRecord:  # ``s``: the sample's place in the job
            row = rows[s - offset] if not balanced else rows[s]
            return EpisodeRecord(key=f"{mode}{step}r{rank}e{s}x{time.monotonic_ns() % 10**6}", row=dict(row))

        ran: dict[int, EpisodeRecord] = {}
        if balanced:
            queue = engine.job_queue(counts, n)
            capacity = int(engine.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
            target = -(-capacity // len(engine.tp_ranks)) + n  # this rank's share of its engine's batch, a group more
            claimed: list[int] = []

            def pull(running: int) -> tuple[list[EpisodeRecord], bool]:
                if running >= target:
                    return [], False
                got = list(queue.claim(max(1, -(-(target - running) // n))))
                claimed.extend(got)
                new = {g * n + k: record(g * n + k) for g in got for k in range(n)}
                endpoint.admit(list(new.values()), list(new))
                ran.update(new)
                return list(new.values()), not got
            endpoint.open([], seed)
        else:
            mine = [record(offset + i) for i in range(len(inputs))]
            ran.update(zip(range(offset, offset + len(inputs)), mine))
            endpoint.open(mine, seed, list(ran))
            handed = [False]

            def pull(running: int) -> tuple[list[EpisodeRecord], bool]:
                first, handed[0] = not handed[0], True
                return (mine if first else []), True
        engine._ready()
        loop = engine._loop(stream=False)

        def params(call):
            return engine._sampling_params(1, replace(sampling, max_tokens=call.max_tokens, seed=call.seed,
                                                      stop=tuple(call.stop)))

        finished = threading.Event()
        runner = threading.Thread(target=EpisodeRunner(self.agent, self.args.agent_timeout_s).run,
                                  args=(pull, endpoint, finished), daemon=True, name="trl-nrollout-agents")
        start = time.perf_counter()
        runner.start()
        engine._barrier_before_generate()  # TP > 1 on GPUs: no training collective interleaves with the engine's
        stats = endpoint.serve(loop, params, finished.is_set, exchange=engine._gather_tp,
                               me=engine.tp_ranks.index(engine.rank))
        runner.join(timeout=5)
        endpoint.open([], None)
        wall = time.perf_counter() - start
        if balanced:  # the episodes go home; the engine's groups (its ranks pulled each their own) for the metrics
            home = engine._send_home({g: [ran[g * n + k] for k in range(n)] for g in claimed}, counts, n)
            engine.drop_job_queue(queue)
            places = range(offset, offset + len(inputs))
            missing = sorted({s // n for s in places} - home.keys())
            if missing:
                raise RuntimeError(f"the agent episodes of groups {missing[:5]} were run by no rank.")
            records = [home[s // n][s % n] for s in places]
            groups = sorted(g for part in engine._gather_tp(claimed) for g in part)
            self._log_dispatch(mode, PullStats(groups=groups, claims=1, busy_s=wall), len(inputs), n)
        else:
            records = [ran[offset + i] for i in range(len(inputs))]
            if self.args.rollout_dispatch == "balanced":  # one engine: its queue is this rank's groups
                self._log_dispatch(mode, PullStats(groups=sorted({s // n for s in ran}), claims=1, busy_s=wall),
                                   len(inputs), n)
        prompt_ids = self._tokenize_prompts(prompts)[0]
        eos = self._tokenizer.eos_token_id or 0
        done = [assemble(r.calls, prompt_ids[i], eos) for i, r in enumerate(records)]
        masks = [a.mask for a in done]
        limit = self.args.max_completion_length
        segments = [split_calls(a, r, limit) for a, r in zip(done, records)]  # a split episode's later calls
        # cut at the limit: the episode's last call (a split episode's sample is its first call)
        reasons = [("length" if len(a.completion_ids) >= limit
                    or (r.calls and r.calls[0 if a.split else -1].finish_reason == "length") else "stop")
                   for a, r in zip(done, records)]
        batch = RolloutBatch([a.prompt_ids for a in done], [a.completion_ids for a in done],
                             [a.logprobs for a in done], reasons, [(offset + i) // max(n, 1) for i in range(len(done))])
        extra = self._agent_reward_kwargs(records)
        completions = [[{"role": "assistant", "content": self._tokenizer.decode(c.completion_ids,
                                                                                skip_special_tokens=True)}
                        for c in r.calls] or [{"role": "assistant", "content": ""}] for r in records]
        self._log_agents(mode, records, done, stats, wall)
        return batch, Episode(tool_mask=masks, completions=completions, turns=[max(1, len(r.calls)) for r in records],
                              tool_calls=[0] * len(records), tool_failures=[0] * len(records), extra_fields=extra,
                              segments=segments)

    def _agent_reward_kwargs(self, records: list[EpisodeRecord]) -> dict[str, list]:
        """Every episode's result as reward-function kwargs (one list per key; None where an episode lacks it)."""
        per = []
        for r in records:
            try:
                per.append(reward_kwargs(r.result))
            except TypeError as err:
                raise TypeError(f"episode of row {r.row!r:.100}: {err}") from None
        keys = sorted({k for kw in per for k in kw})
        return {k: [kw.get(k) for kw in per] for k in keys}

    def _log_agents(self, mode: str, records: list[EpisodeRecord], done: list, stats: dict, wall: float) -> None:
        every = gather_object([(len(r.calls), r.outcome, a.split) for r, a in zip(records, done)])
        total = len(every)
        for outcome in ("error", "timeout", "calls", "tokens"):
            self._metric(mode, f"agent/{outcome}_episodes", sum(o == outcome for _, o, _ in every) / max(total, 1))
        self._metric(mode, "agent/calls_per_episode", sum(c for c, _, _ in every) / max(total, 1))
        self._metric(mode, "agent/split_episodes", sum(s for _, _, s in every) / max(total, 1))
        self._metric(mode, "agent/engine_idle_s", stats["idle_s"])
        self._metric(mode, "agent/rollout_s", wall)
        split = sum(s for _, _, s in every)
        if split and self.accelerator.is_main_process:
            logger.info("%d of %d agent episodes split (their agent edited its history): each of their calls trains "
                        "as a sample of its own, with its episode's advantage.", split, total)
        failed = [r for r in records if r.outcome in ("error", "timeout")]
        if failed:
            logger.warning("%d of %d agent episodes on rank %d are unscored (%s), e.g. %s", len(failed), len(records),
                           self.accelerator.process_index, ", ".join(sorted({r.outcome for r in failed})),
                           failed[0].error)
