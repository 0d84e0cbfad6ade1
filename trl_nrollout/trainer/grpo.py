"""``NRolloutGRPOTrainer``: TRL's ``GRPOTrainer`` with verl's rollout stage. Thin: it wires the parts together.

One rollout step (``_generate_and_score_completions``) is a sequence of stages, each returning a typed value
(:mod:`trl_nrollout.trainer.stages`) that the next takes; every stage calls into another module:

    _sync_weights (rollout.weight_sync) -> _collect: Round (engines in rollout/, rewards in scoring, DAPO's rounds)
    -> _assign: Assignment (algos.batching) -> logprob_passes: LogProbs (passes.logprobs)
    -> _advantages: Advantages (algos.advantages) -> log_step -> _trl_batch: TRL's batch

TRL's hooks hand their work to parts built once in ``__init__`` (:meth:`_build_parts`): ``logprob_passes``
(:mod:`.logprob_stage`), ``advantage_stage``, ``policy_update`` (:mod:`.update`: ``_compute_loss``,
``training_step``), ``budgeted_update`` (``compute_loss``), under one ``forward_rules``; ``engine_setup`` (which
engine generates, its checked start, each weight push), ``scoring``, ``collector`` (:mod:`.collector`: the rollout,
its episode kind chosen once), ``rollout_ranks`` (:mod:`.rollout_ranks`: engines on rollout ranks, their jobs written
ahead; ``get_batch_samples``, ``train``, ``evaluate``), ``partial_pool`` (:class:`~.partial.PartialPool`:
``rollout_partial``'s groups in flight) and ``teacher`` (:mod:`.teacher`). TRL's loop does the rest (data order,
buffering, accumulation, optimizer, logging).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model
from transformers.trainer_callback import ProgressCallback
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import shuffle_sequence_dict

from trl_nrollout.algos.batching import constant_groups, select_groups
from trl_nrollout.algos.losses import AdaptiveKLController, FixedKLController
from trl_nrollout.config.checks import policy_checks
from trl_nrollout.config.options import NRolloutConfig, to_nrollout_config
from trl_nrollout.config.trl_options import UnsupportedTRLOption, drop_in_arguments
from trl_nrollout.errors import InputError
from trl_nrollout.passes.multimodal import EncodedPrompts, has_images, prompt_images, without_images
from trl_nrollout.passes.ulysses import shared_shuffle
from trl_nrollout.rollout.axes import dispatch_rule
from trl_nrollout.rollout.engines.platform import launch_nodes, vllm_available
from trl_nrollout.rollout.engines.protocol import PREFILL_COUNTS, has
from trl_nrollout.rollout.seeds import step_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.advantage_stage import AdvantageStage, RewardCalls
from trl_nrollout.trainer.agents import agent_refusal, agent_reward_funcs, endpoint_settings
from trl_nrollout.trainer.batches import assign, check_balance, trl_batch
from trl_nrollout.trainer.budgeted_update import (
    BudgetedMicroBatches,
    BudgetedStep,
    resolve_update_budget,
    with_pass_budgets,
)
from trl_nrollout.trainer.checkpoints import (
    check_resume_folder,
    elastic_restarts,
    load_rollout_state,
    resolve_resume,
    save_rank_state,
    write_rollout_state,
)
from trl_nrollout.trainer.clocks import GenerationClock, StepClock, TruncatedSteps
from trl_nrollout.trainer.collector import Placement, RolloutCollector
from trl_nrollout.trainer.engines import EngineSetup, pick_backend, prompt_length_hint
from trl_nrollout.trainer.forward_rules import (
    ForwardRules,
    note_corrections,
    sampling_support,
    sequence_parallel_setup,
)
from trl_nrollout.trainer.logprob_stage import LogProbStage, build_reference
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.multiturn import (
    Episode,
    check_images,
    check_tool_workers,
    log_agent_stats,
    log_turns,
    request_turns_refusal,
)
from trl_nrollout.trainer.partial import PartialPool, check_partial
from trl_nrollout.trainer.progress import LiveProgressCallback
from trl_nrollout.trainer.prompts import check_prompts
from trl_nrollout.trainer.rollout_ranks import RolloutRankPlacement, rank_worker
from trl_nrollout.trainer.scoring import RewardFunctionError, RewardScoring, Scores  # noqa: F401 - public here
from trl_nrollout.trainer.stages import (
    Advantages,
    Assignment,
    LogProbs,
    Round,
    Sample,
    StepContext,
    split_rows,
)
from trl_nrollout.trainer.teacher import TeacherTerm, start_teacher_engine, teacher_engine_refusal
from trl_nrollout.trainer.update import EntropyControl, LossConfig, MicroStep, PolicyUpdate

logger = logging.getLogger(__name__)


class NRolloutGRPOTrainer(GRPOTrainer):
    """Drop-in replacement of ``trl.GRPOTrainer``: same constructor, verl's rollout stage inside.

    ``model`` may also be a built-in name such as ``"builtin:tiny-qwen2"``. ``args`` may be an
    :class:`NRolloutConfig` or a plain ``GRPOConfig`` (converted).
    """
    partial_pool: PartialPool | None = None  # rollout_partial: the groups in flight, their round and checkpoint (a part)

    def __new__(cls, *args, **kwargs):
        """On a rollout rank (``rollout_ranks``) the trainer is a :class:`~.rollout_ranks.RolloutRankWorker`: the
        same script runs on every process, and there ``train()`` serves the trainers."""
        worker = rank_worker(args, kwargs)
        return worker if worker is not None else super().__new__(cls)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, agent=None, **kwargs) -> None:
        reward_funcs, self.agent = agent_reward_funcs(agent, reward_funcs, args), agent
        features = getattr(train_dataset, "column_names", None)
        if isinstance(features, list) and "prompt" in features and hasattr(train_dataset, "__len__"):
            check_prompts(train_dataset["prompt"], source="train_dataset")  # before the model loads
        check_images(features if isinstance(features, list) else None, tools=tools, rollout_func=rollout_func,
                     environment_factory=environment_factory, args=args)
        model, args = drop_in_arguments(model, args, NRolloutConfig, to_nrollout_config, "GRPO")
        check_tool_workers(args, tools, environment_factory, rollout_func)  # before the model loads
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, tools=tools, rollout_func=rollout_func,
                         environment_factory=environment_factory, **kwargs)
        # HF's TrainingArguments.train_batch_size (per-device samples) is shadowed by verl's train_batch_size
        # (prompts per step) in NRolloutConfig; HF Trainer copied it into _train_batch_size: restore its meaning.
        self._train_batch_size = args.per_device_train_batch_size * max(1, args.n_gpu)
        policy_checks(self.model, args, peft=self._is_peft(), main_process=self.accelerator.is_main_process)
        self.layout = args.rollout_layout(self.accelerator.num_processes, launch_nodes(self.accelerator.num_processes))
        self.forward_rules = ForwardRules(args, self.accelerator)  # what the forwards may do, said once each
        self._sp = sequence_parallel_setup(args, [self.accelerator.unwrap_model(m) for m in (self.model, self.ref_model)
                                                  if m is not None], self.aux_loss_enabled)  # Ulysses (or None)
        self.kl_ctrl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
                        if args.kl_ctrl_type == "adaptive" else FixedKLController(args.kl_coef))
        if args.use_kl_in_reward and self.ref_model is None and not self._is_peft():
            self.ref_model = build_reference(self.model, self.accelerator, self.is_deepspeed_enabled)
        if (why := teacher_engine_refusal(args.teacher_backend, is_vlm=self._is_vlm)) is not None:
            raise InputError(why)  # before any engine starts
        self.teacher_model = TeacherTerm.load(args, self.model, self.accelerator, self.is_deepspeed_enabled)
        self.update_budget = resolve_update_budget(args, self.accelerator, self.model, self.forward_rules,
                                                   fsdp=self.is_fsdp_enabled, prompt_length=self._prompt_length_hint,
                                                   frozen=[m for m in (self.ref_model, self.teacher_model) if m is not None])
        self.layout = with_pass_budgets(self.layout, self.update_budget)  # the passes follow it where default
        check_balance(self.layout, args.balance_batch)  # whole groups per rank
        self.scoring = RewardScoring.of(self)  # the reward functions' scoring (a part)
        self.rollout_backend = pick_backend(args.rollout_backend, vllm_available)  # (tests patch it here)
        self.engine_setup = EngineSetup.of(self)  # the engine's checks, start and weight pushes (a part)
        if (why := self.engine_setup.regex_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        if args.rollout_multi_turn == "requests" and (why := request_turns_refusal(self.rollout_backend)) is not None:
            raise UnsupportedTRLOption(why)
        if (why := self.engine_setup.dispatch_refusal(dispatch_rule(args.rollout_dispatch))) is not None:
            raise UnsupportedTRLOption(why)
        self.engine_setup.check_prompt_tokens()  # before the engines start
        self.rollout_ranks = RolloutRankPlacement.of(self) if args.rollout_ranks else None  # engines there (a part)
        self.rollout_engine = (self.rollout_ranks.engines if self.rollout_ranks is not None
                               else self.engine_setup.start(args.rollout_backend))
        self.rollout_backend = self.engine_setup.rollout_backend  # "hf" where a vLLM start fell back
        check_partial(self.rollout_backend, self.tools, args, self.accelerator.is_main_process)  # (rollout_partial)
        if self.agent is not None and (why := agent_refusal(args, self.rollout_backend, getattr(
                self, "environment_factories", None), self.rollout_func)) is not None:
            raise UnsupportedTRLOption(why)
        self.generation_clock = GenerationClock()
        rr = self.rollout_ranks  # the rollout: its episode kind chosen once (the ranks' calls where they generate)
        self.collector = RolloutCollector.of(self, Placement(rr is not None, self._remote_generate,
            self._remote_request_turns, *((rr.agent_job, rr.ahead_jobs, rr.log_job) if rr else (None,) * 3)))
        if self.pop_callback(ProgressCallback) is not None:  # one live line per step instead of printed dicts
            self.add_callback(LiveProgressCallback)
        self.engine_setup.synced_step = 0 if self.rollout_backend == "vllm" else None  # synced at start
        self.step_clock = StepClock()
        self.truncated_steps = TruncatedSteps()  # rollouts whose every completion hit max_completion_length
        self._build_parts(args)
        note_corrections(args, self.accelerator.is_main_process)
        self._prompt_rng = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's ``train``, with ``resume_from_checkpoint`` resolved as the recipe resolves it
        (:func:`~trl_nrollout.trainer.checkpoints.resolve_resume`: ``True``, the newest complete and readable
        checkpoint of ``output_dir``, naming a damaged one it skips; ``"auto"``: that checkpoint if any, else
        afresh, as a run restarted by ``accelerate launch --max_restarts`` with nothing given does; a path must be
        complete and readable)."""
        restarts = elastic_restarts()
        if resume_from_checkpoint is True or resume_from_checkpoint == "auto" or (
                resume_from_checkpoint is None and restarts):
            resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir, restarts)
        elif isinstance(resume_from_checkpoint, str | os.PathLike):
            resume_from_checkpoint = check_resume_folder(resume_from_checkpoint, self.args.output_dir)
        with self.rollout_ranks.training() if self._on_rollout_ranks else nullcontext():  # theirs returns then
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        result = super().evaluate(*args, **kwargs)
        if self._on_rollout_ranks:  # outside train(): the rollout ranks' evaluate() returns
            self.rollout_ranks.evaluated()
        return result

    # ------------------------------------------------------------------ rollout ranks: the part's hooks
    @property
    def _on_rollout_ranks(self) -> bool:  # the engines live on rollout ranks (the part RolloutRankPlacement)
        return getattr(self, "rollout_ranks", None) is not None

    def get_batch_samples(self, epoch_iterator, num_batches, device):  # rollout ranks: the batches read ahead first
        if not self._on_rollout_ranks:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = self.rollout_ranks.batch_samples(epoch_iterator, num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def _start_step_episodes(self, inputs: list[dict], step_job: bool) -> tuple[list, list]:  # (or started ahead)
        return (self.rollout_ranks.start_step_episodes(inputs, step_job) if self._on_rollout_ranks
                else self._start_episodes(inputs))

    def _remote_generate(self, *args):  # the part's generate (a test's subclass records it)
        return self.rollout_ranks.generate(*args)

    def _remote_request_turns(self, *args):  # the part's request_turns
        return self.rollout_ranks.request_turns(*args)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, then the rollout stage's own state (:meth:`_save_rollout_state`); the file
        :data:`~trl_nrollout.trainer.checkpoints.ROLLOUT_STATE` is written last, after every rank saved, so that a folder
        holding it is complete (``resume_from_checkpoint=true`` skips one a killed run left half written)."""
        self.entropy_coef, self._last_world_entropy = self.policy_update.entropy.trl_state()  # TRL saves these
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        self._save_rollout_state(folder)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            write_rollout_state(folder, self.state.global_step, self.kl_ctrl.value)

    def _save_rollout_state(self, folder: str) -> None:
        """This rank's state beside the model's: the generator that draws DAPO's extra prompts (a subclass adds its
        own, e.g. PPO's critic)."""
        save_rank_state(folder, self.accelerator.process_index, self._prompt_rng, self.rollout_engine)
        if self.partial_pool is not None:
            self.partial_pool.save(folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers restores the optimizer and scheduler; the rollout stage restores the KL controller's
        coefficient and the prompt generator (a checkpoint without them, e.g. TRL's, leaves them as built)."""
        self.entropy_coef, self._last_world_entropy = self.policy_update.entropy.trl_state()
        super()._load_optimizer_and_scheduler(checkpoint)  # TRL restores them where the checkpoint has them
        self.policy_update.entropy.restore(self.entropy_coef, self._last_world_entropy)
        if checkpoint is None:
            return
        rank, engine = self.accelerator.process_index, self.rollout_engine  # engine: the jobs written ahead
        if (kl_coef := load_rollout_state(checkpoint, rank, self._prompt_rng, engine)) is not None:
            self.kl_ctrl.value = kl_coef
        if self.partial_pool is not None:
            self.partial_pool.load(checkpoint)

    def close(self) -> None:
        """Release the rollout engines (call after training, before tearing down torch.distributed)."""
        if self.partial_pool is not None:  # (live agents' endpoint)
            self.partial_pool.close()
        if "collector" in self.__dict__:  # (built once the engine started)
            self.collector.close()
        if getattr(self, "teacher", None) is not None:  # (its engine, teacher_backend='vllm')
            self.teacher.close()
        close = getattr(self.rollout_engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ construction helpers
    def _build_parts(self, args: NRolloutConfig) -> None:
        """The parts TRL's hooks hand their work to, each given its collaborators (never the trainer)."""
        acc, rules, metrics = self.accelerator, self.forward_rules, Metrics(self._metrics)
        common = dict(pad_token_id=self._tokenizer.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of, sp=self._sp)
        support = sampling_support(args, self.rollout_backend, self.top_k, self.top_p, self.min_p)
        self.logprob_passes = LogProbStage(args, acc, self.layout, rules, metrics, temperature=self.temperature,
                                           beta=self.beta, support=support, **common)
        self.advantage_stage = AdvantageStage(
            args, acc, metrics, RewardCalls(self._weighted, self._rollout, self._sampling, self._decode, self._score),
            logs=self._logs, reward_func_names=self.reward_func_names, reward_weights=self.reward_weights,
            kl_ctrl=self.kl_ctrl, sp=self._sp, truncated_steps=self.truncated_steps)
        loss = LossConfig(self.epsilon_low, self.epsilon_high, self.beta, self.importance_sampling_level,
                          self.top_entropy_quantile, self.aux_loss_enabled, self.router_aux_loss_coef)
        entropy = EntropyControl(self.entropy_coef, self.use_adaptive_entropy, self._entropy_bonus_enabled,
                                 self._last_world_entropy)
        self.policy_update = PolicyUpdate(args, acc, rules, metrics, loss, entropy, step_clock=self.step_clock,
                                          steps_per_rollout=self.layout.optimizer_steps_per_rollout, **common)
        self.budgeted_update = BudgetedMicroBatches(args, acc, rules, metrics, self.policy_update, self.update_budget,
                                                    sp=self._sp, pad_to_multiple_of=self.pad_to_multiple_of,
                                                    fsdp=self.is_fsdp_enabled)
        self.teacher = TeacherTerm.build(args, self.teacher_model, self.logprob_passes, metrics,
                                         engine=start_teacher_engine(self))  # (teacher_backend='vllm')
        self.partial_pool = PartialPool.of(self) if args.rollout_partial else None

    def _is_peft(self) -> bool:
        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def _prompt_length_hint(self) -> int:  # the update's budget reads it (before the engine part is built)
        return prompt_length_hint(self.train_dataset, self._tokenize_prompts)

    # ------------------------------------------------------------------ metrics, rewards
    def _metric(self, mode: str, name: str, value: float) -> None:
        Metrics(self._metrics).add(mode, name, value)

    def _score(self, inputs, prompts, completions, completion_ids, extra: dict | None = None) -> Scores:
        """The scoring part's ``score`` of this rank's samples ``[B_local]`` (the mode, state, environments: now)."""
        return self.scoring.score(inputs, prompts, completions, completion_ids, extra=extra, state=self.state, mode=(
            "train" if self.model.training else "eval"), environments=getattr(self, "environments", None))

    def _weighted(self, rewards: torch.Tensor) -> torch.Tensor:  # the advantage stage's (while it is a mixin)
        return self.scoring.weighted(rewards)

    # ------------------------------------------------------------------ the rollout step
    def _sampling(self, mode: str, greedy: bool = False, round_: int = 0, step: int | None = None) -> SamplingOptions:
        """The sampling options of the rollout at optimizer step ``step`` (default: now)."""
        args = self.args
        # a per-step seed: reproducible, and the same after resuming from a checkpoint
        step = self.state.global_step if step is None else step
        seed = step_seed(args.seed, step, round_, f"{mode}/greedy" if greedy else mode)
        return SamplingOptions(
            max_tokens=args.max_completion_length or 256, temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p, top_k=self.top_k if self.top_k and self.top_k > 0 else -1, min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty, stop_token_ids=tuple(self.eos_token_ids), seed=seed,
            engine_kwargs=self.engine_setup.engine_kwargs(), regex=args.vllm_structured_outputs_regex,
            suppress_token_ids=self.engine_setup.image_token_ids(),
        )

    def _sync_weights(self, mode: str) -> None:  # the engine setup's (once per optimizer step)
        self.engine_setup.sync_weights(self.rollout_engine, self.model, self.state.global_step, mode,
                                       Metrics(self._metrics), versioned=self._on_rollout_ranks)

    def _rollout(self, inputs: list[dict], n: int, sampling: SamplingOptions, step_job: bool = False
                 ) -> tuple[RolloutBatch, list, Episode]:
        """Generate for this rank's samples: the collector's rollout (:class:`~.collector.RolloutCollector`)."""
        mode = "train" if self.model.training else "eval"
        return self.collector.run(inputs, n, sampling, mode, self.state.global_step, step_job)

    # ------------------------------------------------------------------ the episodes' pieces other rollouts call
    def _start_episodes(self, inputs: list[dict], busy: set[int] | None = None) -> tuple[list, list]:
        """This rank's episodes started (:meth:`~.multiturn.TRLTools.start`; ``busy``: environments not to draw,
        default those a partial rollout's episodes in flight hold); TRL's ``environments`` and
        ``_batch_environments`` are the trainer's (its tokenization and reward calls read them)."""
        held = busy if busy is not None else {id(env) for envs in self.__dict__.get("_partial_envs_by_key", {}).values()
                                               for env in envs}
        started = self.collector.parts.tools.start(inputs, held)
        if started.environments is not None:
            self.environments, self._batch_environments = started.environments, started.names
        return started.prompts, started.tools

    def _reset_kwargs(self, row: dict) -> dict:
        return self.collector.parts.tools.reset_kwargs(row)

    def _parse_turn(self, i: int, ids: list[int], prefix: list[int]) -> dict:
        return self.collector.parts.tools.parse(getattr(self, "_batch_environments", None), i, ids, prefix)

    def _home_tools(self, envs: bool, home, run_tools):
        return self.collector.parts.home(envs, home, run_tools, "train" if self.model.training else "eval")

    def _log_agent_stats(self, mode: str, stats) -> None:
        log_agent_stats(Metrics(self._metrics), mode, stats)

    def _log_turns(self, mode: str, episode: Episode) -> None:
        log_turns(Metrics(self._metrics), mode, episode)

    def _records_batch(self, *args, **kwargs) -> tuple[RolloutBatch, Episode]:  # (AgentRecords.batch)
        return self.collector.parts.records.batch(*args, **kwargs)

    def _endpoint_settings(self, max_model_len: int) -> dict:  # (a partial pool's agents send images colocated)
        processor = None if self.args.rollout_ranks else self.collector.parts.tools.processor  # (called while the
        # rollout-rank part is built, before self.rollout_ranks is set: the option says where the endpoint runs)
        return endpoint_settings(self.args, self.engine_setup.model_path(), max_model_len, processor)

    def _encode_images(self, prompts: list) -> EncodedPrompts | None:
        return self.collector.images.encode(prompts)

    def _decode(self, prompts: list, completion_ids: list[list[int]]) -> list:
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            return [[{"role": "assistant", "content": t}] for t in texts]
        return texts

    def _one_round(self, inputs: list[dict], ctx: StepContext, round_: int = 0) -> Round:
        """Generate and score this rank's samples of ``inputs``: the job's samples of this round (the same on every
        rank)."""
        t0 = time.perf_counter()
        batch, prompts, episode = self._rollout(inputs, ctx.n, self._sampling(ctx.mode, round_=round_),
                                                step_job=round_ == 0 and ctx.mode == "train")
        return self._round_of(inputs, prompts, batch, episode, ctx, t0)

    def _round_of(self, inputs: list[dict], prompts: list, batch: RolloutBatch, episode: Episode, ctx: StepContext,
                  t0: float, rows: list[dict] | None = None) -> Round:
        """A rollout's Round: its samples scored (``inputs``: their dataset rows, ``prompts`` theirs), the job's
        samples gathered; ``t0``: when the rollout started; ``rows``: the Round's rows where they are not the step's
        inputs (a partial rollout's)."""
        t1 = time.perf_counter()
        completions = (episode.completions if episode.completions is not None
                       else self._decode(prompts, batch.completion_ids))
        # rollout_func's extra fields are reward kwargs, as in TRL
        scores = self._score(inputs, prompts, completions, batch.completion_ids, extra=episode.extra_fields)
        t2 = time.perf_counter()
        self._log_turns(ctx.mode, episode)
        masks = episode.tool_mask or [None] * len(batch)
        # a VLM's image tensors travel with their samples (pickled once) only where samples change ranks (batch
        # balancing, DAPO's selection); otherwise each rank trains its own samples and keeps its tensors
        moves = self.args.balance_batch or self.args.filter_groups
        mm = (episode.mm or [None] * len(batch)) if moves else [None] * len(batch)
        segments = episode.segments or [()] * len(batch)  # an agent's split episodes: their later calls
        local = [Sample(p, c, lp, reason, mask, m, seg) for p, c, lp, reason, mask, m, seg in zip(
            batch.prompt_ids, batch.completion_ids, batch.logprobs, batch.finish_reasons, masks, mm, segments)]
        table = None
        if self.log_completions:  # TRL's completions table: the job's prompts and completions, in job order
            images = None
            if self.log_multimodal and any(gather_object([has_images(prompts)])):  # TRL's image column of the table
                images = gather_object([prompt_images(p) for p in prompts])
            table = {"prompt": gather_object([without_images(p) for p in prompts]),
                     "completion": gather_object(list(completions)), "images": images, "extra": scores.extra_logs}
        return Round(gather_object(local), scores.rewards, gen_s=t1 - t0, reward_s=t2 - t1,
                     gen_tokens=batch.num_completion_tokens, table=table,
                     mm_local=None if moves or episode.mm is None else list(episode.mm), rows=rows)

    def _draw_inputs(self, count: int) -> list[dict]:
        """``count`` fresh prompts from the training set (dynamic sampling), each repeated n times."""
        ds = self.train_dataset
        idx = torch.randint(len(ds), (count,), generator=self._prompt_rng).tolist()
        n = self.num_generations
        return [dict(ds[i]) for i in idx for _ in range(n)]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """One rollout step (TRL's hook): this rank's training batch from its ``inputs`` (TRL's rows, each prompt
        repeated n times). The stages hand each other typed values (:mod:`trl_nrollout.trainer.stages`):

            _sync_weights                       the engines get the policy's weights (once per optimizer step)
            _collect           -> Round         generate and score; DAPO: more rounds until the batch is full
            _assign            -> Assignment    which of the job's samples this rank trains on
            logprob_passes     -> LogProbs      old-policy and reference log-probs of those samples
            _advantages        -> Advantages    the estimator over the whole job (PPO: with the critic's values)
            log_step                            the step's metrics and TRL's completions table
            _trl_batch         -> dict          this rank's tensors in TRL's layout
        """
        mode = "train" if self.model.training else "eval"
        ctx = StepContext(mode, self.num_generations if mode == "train" else self.num_generations_eval, inputs)
        start = time.perf_counter()
        self._sync_weights(mode)
        collected = self._collect(ctx)
        assigned = self._assign(collected, ctx)
        logps = self.logprob_passes.run(assigned, ctx, self.model, self.ref_model)
        t = time.perf_counter()
        adv = self._advantages(collected, assigned, logps, ctx)
        self._metric(mode, "timing_s/adv", time.perf_counter() - t)  # PPO: with its critic's value pass, as verl's
        self.advantage_stage.log_step(collected, adv, ctx, self.state)
        self._metric(mode, "timing_s/rollout_total", time.perf_counter() - start)
        self.step_clock.rollout_tokens = assigned.num_tokens  # the step's throughput counts them
        return self._trl_batch(assigned, logps, adv, ctx)

    def _collect(self, ctx: StepContext) -> Round:
        """Generate and score the step's samples, with DAPO's extra rounds when ``filter_groups`` asks, or from the
        pool of groups in flight with ``rollout_partial`` (:mod:`trl_nrollout.trainer.partial`): the job's samples
        ``[G]`` and rewards ``[G, F]``, the same on every rank."""
        partial = ctx.mode == "train" and self.partial_pool is not None
        collected = self.partial_pool.round(ctx) if partial else self._one_round(ctx.inputs, ctx)
        if ctx.mode == "train" and self.args.filter_groups:
            collected = self._dynamic_sampling(collected, ctx)
        self._metric(ctx.mode, "timing_s/gen", collected.gen_s)
        self._metric(ctx.mode, "timing_s/reward", collected.reward_s)
        self._metric(ctx.mode, "perf/gen_tokens_per_s", collected.gen_tokens / max(collected.gen_s, 1e-9))
        if has(self.rollout_engine, PREFILL_COUNTS):  # the samples whose prompt was prefilled once (of the job)
            engine = self.rollout_engine
            counts = torch.tensor([engine.prefill_shared_samples, engine.generated_samples], dtype=torch.long,
                                  device=self.accelerator.device)
            shared, total = self.accelerator.reduce(counts, reduction="sum").tolist()
            self._metric(ctx.mode, "perf/prefill_shared_fraction", shared / max(total, 1.0))
            engine.prefill_shared_samples = engine.generated_samples = 0
        return collected

    def _advantages(self, collected: Round, assigned: Assignment, logps: LogProbs, ctx: StepContext) -> Advantages:
        """The advantage stage (:class:`~trl_nrollout.trainer.advantage_stage.AdvantageStage`; PPO: its critic's)."""
        return self.advantage_stage.run(collected, assigned, logps, ctx)

    def _dynamic_sampling(self, first: Round, ctx: StepContext) -> Round:
        """DAPO: while fewer groups than the step's have a spread of scores, another round of fresh prompts (up to
        ``filter_groups_max_rounds``); then the step's number of groups, those with a spread first (filler groups of
        constant score where too few have one)."""
        n, pool = ctx.n, first
        total_groups = len(first) // n
        while True:
            scores = self.scoring.weighted(pool.rewards).tolist()
            group_of = [i // n for i in range(len(pool))]
            const = constant_groups(scores, group_of)
            if (len(set(group_of)) - len(const) >= total_groups
                    or pool.extra_rounds >= self.args.filter_groups_max_rounds):
                break
            more = self._draw_inputs(len(ctx.inputs) // n)
            r = pool.extra_rounds + 1  # rollout_partial: the pool runs on, with these prompts joining it
            pool = pool.then(self.partial_pool.round(replace(ctx, inputs=more), r) if self.partial_pool is not None
                             else self._one_round(more, ctx, round_=r))
        chosen, filler = select_groups(sorted(set(group_of)), const, total_groups)
        self._metric(ctx.mode, "dynamic_sampling/rounds", pool.extra_rounds)
        self._metric(ctx.mode, "dynamic_sampling/filtered_groups", len(const))
        self._metric(ctx.mode, "dynamic_sampling/filler_groups", filler)
        return pool.select([g * n + k for g in chosen for k in range(n)])

    def _assign(self, collected: Round, ctx: StepContext) -> Assignment:
        """The samples this rank trains on (:func:`~trl_nrollout.trainer.batches.assign`)."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if self._sp is not None:  # a sequence-parallel group trains the same samples: its share
            world, rank = self._sp.dp_size, self._sp.dp_rank  # (and shuffles them alike: shared_shuffle)
        return assign(collected, ctx, world, rank, balance=self.args.balance_batch, metrics=Metrics(self._metrics))

    def _trl_batch(self, assigned: Assignment, logps: LogProbs, adv: Advantages, ctx: StepContext) -> dict[str, Any]:
        """This rank's samples as TRL's training batch (:func:`~trl_nrollout.trainer.batches.trl_batch`)."""
        batch = trl_batch(assigned, logps, adv, ctx, pad_token_id=self._tokenizer.pad_token_id,
                          device=self.accelerator.device, pad_to_multiple_of=self.pad_to_multiple_of, beta=self.beta,
                          mask_truncated=bool(self.args.mask_truncated_completions))
        return batch if self.teacher is None else self.teacher.apply(batch, assigned, logps, ctx)  # distillation

    # ------------------------------------------------------------------ buffering with loss normalizers
    def _prepare_inputs(self, generation_batch):
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self._on_rollout_ranks:
            self.rollout_ranks.count_batch()  # rollout ranks read TRL's batches ahead: where the loop is
        if mode != "train":
            batch = self._generate_and_score_completions(generation_batch)
            return self.policy_update.add_normalizers([batch], 1)[0]
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            start = time.perf_counter()
            batch = self._generate_and_score_completions(generation_batch)
            self.step_clock.rollout_s += time.perf_counter() - start
            batch = shared_shuffle(batch, self._sp) if getattr(self, "_sp", None) else shuffle_sequence_dict(batch)
            chunks = split_rows(batch, self.args.steps_per_generation)
            chunks = self.policy_update.add_normalizers(chunks, self.args.gradient_accumulation_steps)
            self._buffered_inputs = chunks if not self.args.use_dynamic_bsz else \
                self.budgeted_update.steps(self.model, chunks)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # ------------------------------------------------------------------ TRL's update hooks: the policy update's work
    def training_step(self, model, inputs, num_items_in_batch):
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)  # TRL counted the micro step: its batch is
        self._after_policy_step(self._buffered_inputs[(self._step - 1) % self.args.steps_per_generation])  # this
        return self.policy_update.stepped(loss, time.perf_counter() - start,
                                          self._step % self.current_gradient_accumulation_steps == 0,
                                          self._other_update_seconds)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if isinstance(inputs, BudgetedStep):  # a token budget's micro batches
            return self.budgeted_update.loss(model, inputs, self._micro_step())
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _compute_loss(self, model, inputs):
        return self.policy_update.loss(model, inputs, self._micro_step())

    def _micro_step(self) -> MicroStep:
        mode = "train" if self.model.training else "eval"
        accumulation = getattr(self, "current_gradient_accumulation_steps", 1) if mode == "train" else 1.0
        return MicroStep(mode, accumulation, self.state.global_step)

    def _after_policy_step(self, batch) -> None:
        """Where other models train on the micro step the policy just trained on (``batch``: a TRL batch, or a
        ``BudgetedStep``), before the optimizer step (PPO: the critic). Nothing for GRPO."""

    def _other_update_seconds(self) -> float:
        """Seconds of this optimizer step spent on other models (PPO: the critic), left out of the update's."""
        return 0.0

    def _packing_allowed(self, model, **kw) -> bool:  # the HF engine asks (trainer/engines.py)
        return self.forward_rules.packing_allowed(model, **kw)
