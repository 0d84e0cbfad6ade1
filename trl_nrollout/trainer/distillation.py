"""``NRolloutDistillationTrainer``: TRL's ``DistillationTrainer`` whose student samples on our engine group.

Drop-in as :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer` is for GRPO: the same constructor, TRL's
``DistillationConfig`` fields (each honored, mapped or refused: :mod:`trl_nrollout.config.distillation`) plus our
engine options. What changes is where the student's completions are sampled: TRL's generation hook
(``_generate_single_turn``, called for the first turn and for every turn of TRL's tool loop) hands the prompts to
a part, :class:`StudentSampler`, which samples them on this rank's engine of our vLLM group (built by
:func:`~trl_nrollout.rollout.engines.build.build_engine` through GRPO's :class:`~trl_nrollout.trainer.engines.EngineSetup`:
its checked start, its tensor-parallel layout, its bucketed weight sync after each optimizer step, LoRA adapter or
merged sync). The teacher's forward inside TRL's loss runs as our reference pass does (:class:`TeacherPass`:
padding-free rows, ``ref_log_prob_max_token_len_per_device``'s token budget, sharded as TRL prepares the teacher:
ZeRO-3, FSDP1 or FSDP2, every rank as many forwards as the busiest),
its hidden states handed to TRL's chunked divergence. Everything else is TRL's own code, inherited unchanged: the
data order and buffering, the tool loop, the chunked generalized JSD for every ``beta``, the temperature, the
masking of prompt, padding and tool tokens. With ``rollout_backend='hf'`` TRL's transformers ``generate`` samples.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import fields, replace
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers.trainer_callback import ProgressCallback
from trl import DistillationConfig, DistillationTrainer

from trl_nrollout.builtin import resolve_model
from trl_nrollout.config.checks import lora_sync_refusal
from trl_nrollout.config.distillation import NRolloutDistillationConfig
from trl_nrollout.config.trl_options import UnsupportedTRLOption, drop_in_arguments
from trl_nrollout.errors import InputError
from trl_nrollout.passes.hidden import HiddenOutput, completion_hidden_states, lean_parts
from trl_nrollout.passes.logprobs import from_padded
from trl_nrollout.rollout.engines.platform import launch_nodes, vllm_available
from trl_nrollout.rollout.engines.protocol import RolloutEngine
from trl_nrollout.rollout.seeds import step_seed
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.trainer.engines import EngineSetup, pick_backend
from trl_nrollout.trainer.forward_rules import ForwardRules
from trl_nrollout.trainer.metrics import Metrics
from trl_nrollout.trainer.progress import LiveProgressCallback


class StudentSampler:
    """Samples the student's completions on this rank's engine (a part of the trainer).

    Collaborators: the ``engine`` (a :class:`~trl_nrollout.rollout.engines.protocol.RolloutEngine`), the engine set-up
    ``setup`` (its weight sync), the ``metrics`` sink, the run ``seed``, the call's ``sampling`` options without a
    seed (TRL's temperature, top-p/k, min-p, repetition penalty, stop tokens, ``generation_kwargs``) and this rank's
    ``rank`` (its samples' seeds start at ``rank x`` the call's prompts: accelerate gives every rank as many).
    ``calls`` counts the engine calls per mode and ``last`` is the last call's batch (its sampled tokens'
    log-probs: the tests compare them with the student's)."""

    def __init__(self, engine: RolloutEngine, setup: EngineSetup, metrics: Metrics, *, seed: int,
                 sampling: SamplingOptions, rank: int) -> None:
        self.engine, self.setup, self.metrics = engine, setup, metrics
        self.seed, self.sampling, self.rank = seed, sampling, rank
        self.calls: Counter[str] = Counter()
        self._rounds: Counter[tuple[str, int]] = Counter()
        self.last: RolloutBatch | None = None

    def sample(self, prompt_ids: list[list[int]], model, step: int, mode: str) -> list[list[int]]:
        """One completion per prompt of ``prompt_ids`` ``[B]`` (token-id lists, unpadded), sampled by the engine
        holding the weights of optimizer step ``step`` (``model``'s, pushed first where the engine holds older
        ones). Each call within a step gets its own seed (TRL's tool loop calls again per turn). Returns the
        completions' token ids ``[B]`` (unpadded, the stop token kept, as TRL's vLLM path returns them)."""
        self.setup.sync_weights(self.engine, model, step, mode, self.metrics, versioned=False)
        round_ = self._rounds[(mode, step)]
        self._rounds[(mode, step)] += 1
        sampling = replace(self.sampling, seed=step_seed(self.seed, step, round_, mode))
        longest = max((len(p) for p in prompt_ids), default=0)
        limit = self.engine.max_model_len
        if limit is not None and round_ > 0:  # a tool turn's context: TRL cuts its completion to the budget after
            sampling = replace(sampling, max_tokens=max(1, min(sampling.max_tokens, limit - longest)))
        self.engine.check_prompt_length(longest, sampling.max_tokens)
        start = time.perf_counter()
        # seeds from this rank's place: the same on every rank of a TP engine, whose ranks get equal batches
        batch = self.engine.generate_expanded([list(p) for p in prompt_ids], 1, sampling,
                                              sample_offset=self.rank * len(prompt_ids))
        self.engine.sleep()  # the teacher and student forwards run without the engine's KV cache (sleep mode)
        seconds = time.perf_counter() - start
        self.calls[mode] += 1
        self.last = batch
        self.metrics.add(mode, "timing_s/gen", seconds)
        self.metrics.add(mode, "perf/gen_tokens_per_s", batch.num_completion_tokens / max(seconds, 1e-9))
        return [list(c) for c in batch.completion_ids]

    def close(self) -> None:
        """Release the engine (memory, process groups)."""
        self.engine.close()


class TeacherPass:
    """The teacher's forward of TRL's loss, as the reference pass runs (a part of the trainer): the final hidden
    states at the completion positions from padding-free rows under the token budget ``max_token_len``
    (:func:`~trl_nrollout.passes.hidden.completion_hidden_states`; every rank as many forwards as the busiest under
    ZeRO-3), ``[B, C, H]`` as TRL's padded backbone call returns them, for TRL's chunked divergence to project.
    ``padding_free``: whether the teacher takes padding-free rows (:class:`~trl_nrollout.trainer.forward_rules.
    ForwardRules`); ``last``: the last call's output (the tests compare it with a plain forward)."""

    def __init__(self, *, max_token_len: int | None, padding_free: bool, pad_token_id: int,
                 pad_to_multiple_of: int | None, metrics: Metrics) -> None:
        self.max_token_len, self.padding_free, self.pad_token_id = max_token_len, padding_free, pad_token_id
        self.pad_to_multiple_of, self.metrics = pad_to_multiple_of, metrics
        self.last: HiddenOutput | None = None

    @staticmethod
    def takes(teacher, input_ids, attention_mask, logits_to_keep: int, multimodal: dict[str, Any]) -> bool:
        """Whether this pass can stand in for TRL's call: a text teacher whose logits are a plain head over its
        decoder, completions right-padded (their mask a prefix of ones: TRL's layout). FSDP-sharded teachers too:
        TRL's loss calls the teacher's backbone inside the teacher's own forward (``_forward_redirection``), where
        FSDP has gathered the root's parameters and each layer gathers its own (:func:`~trl_nrollout.passes.hidden.
        lean_parts`)."""
        if any(v is not None for v in multimodal.values()) or lean_parts(teacher, in_forward=True) is None:
            return False
        mask = attention_mask[:, input_ids.shape[1] - logits_to_keep:]
        return bool((mask[:, 1:] <= mask[:, :-1]).all())

    def hidden_states(self, teacher, input_ids, attention_mask, logits_to_keep: int, mode: str):
        """``[B, K]`` completion positions' hidden states ``[B, K, H]`` of TRL's ``input_ids`` / ``attention_mask``
        ``[B, P + K]`` (prompts left-padded, completions right-padded); zero past each completion's end. Called by
        TRL's loss inside the teacher's own forward (``_forward_redirection``: FSDP's parameters gathered there)."""
        start = time.perf_counter()
        split = input_ids.shape[1] - logits_to_keep
        prompts, completions = from_padded(input_ids[:, :split], attention_mask[:, :split], input_ids[:, split:],
                                           attention_mask[:, split:])
        longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
        if self.max_token_len is not None and longest > self.max_token_len:
            raise InputError(f"ref_log_prob_max_token_len_per_device={self.max_token_len} is below the longest "
                             f"sample ({longest} tokens, prompt + completion): every sample must fit one forward of "
                             f"the teacher; set it to at least {longest} (e.g. the longest prompt + "
                             "max_completion_length), or leave it unset (one forward per micro batch).")
        out = completion_hidden_states(teacher, prompts, completions, max_token_len=self.max_token_len,
                                       pad_token_id=self.pad_token_id, padding_free=self.padding_free,
                                       pad_to_multiple_of=self.pad_to_multiple_of, in_forward=True)
        self.last = out
        self.metrics.add(mode, "timing_s/teacher", time.perf_counter() - start)
        hidden = out.hidden
        if hidden.shape[1] < logits_to_keep:  # TRL's width (padding to a multiple): zero columns
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, logits_to_keep - hidden.shape[1]))
        return hidden


class NRolloutDistillationTrainer(DistillationTrainer):
    """Drop-in replacement of ``trl.DistillationTrainer``: same constructor; the student samples on our engine
    group (see the module docstring). ``model`` and ``teacher_model`` may be built-in names such as
    ``"builtin:tiny-qwen2"``; ``args`` an :class:`NRolloutDistillationConfig` or a plain ``DistillationConfig``
    (converted); without ``teacher_model``, ``args.teacher_model_name_or_path`` names the teacher."""

    student_sampler: StudentSampler | None = None  # None: TRL's generate samples (rollout_backend='hf')

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None) -> None:
        model, args = drop_in_arguments(model, args, NRolloutDistillationConfig, to_distillation_config,
                                        "Distillation")
        if teacher_model is None and args.teacher_model_name_or_path is not None:
            teacher_model = args.teacher_model_name_or_path
        if isinstance(teacher_model, str):
            teacher_model = resolve_model(teacher_model)
        super().__init__(model=model, teacher_model=teacher_model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config,
                         tools=tools)
        self.teacher_pass = TeacherPass(
            max_token_len=args.ref_log_prob_max_token_len_per_device,
            padding_free=ForwardRules(args, self.accelerator).padfree_allowed(self.teacher_model),
            pad_token_id=self._tokenizer.pad_token_id or 0, pad_to_multiple_of=self.pad_to_multiple_of,
            metrics=Metrics(self._metrics))
        if self.pop_callback(ProgressCallback) is not None:  # one live line per step, as GRPO's
            self.add_callback(LiveProgressCallback)
        peft = is_peft_model(self.accelerator.unwrap_model(self.model))
        if (why := lora_sync_refusal(args, peft)) is not None:
            raise InputError(why)
        self.rollout_backend = pick_backend(args.rollout_backend, vllm_available)
        world = self.accelerator.num_processes
        self.engine_setup = EngineSetup(
            args, self.accelerator, self.model, args.rollout_layout(world, launch_nodes(world)), self._tokenizer,
            rollout_backend=self.rollout_backend, eos_token_ids=self.eos_token_ids,
            pad_to_multiple_of=self.pad_to_multiple_of, is_vlm=self._is_vlm, train_dataset=self.train_dataset,
            environment_factories=None, tokenize=self._tokenize_prompts, wrapped_model=lambda: self.model_wrapped,
            packing_allowed=lambda model, **kw: False, held=lambda: (False, self.teacher_model))
        if (why := self.engine_setup.regex_refusal()) is not None:
            raise UnsupportedTRLOption(why)
        if self.rollout_backend != "vllm":
            if args.rollout_backend == "auto":
                self.engine_setup.note_unused_vllm_settings("vLLM is not installed")
            return  # TRL's generate samples
        context = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        if (why := engine_refusal(args, is_vlm=self._is_vlm, tools=bool(self.tools), context=context)) is not None:
            raise UnsupportedTRLOption(why)
        self.engine_setup.check_prompt_tokens()  # before the engine starts
        engine = self.engine_setup.start(args.rollout_backend)
        self.rollout_backend = self.engine_setup.rollout_backend  # "hf" where a vLLM start fell back
        if self.rollout_backend != "vllm":
            engine.close()  # our HF engine: TRL's own generate samples instead
            return
        self.engine_setup.synced_step = 0  # the start pushed the student's weights
        self.student_sampler = StudentSampler(
            engine, self.engine_setup, Metrics(self._metrics), seed=args.seed, sampling=self._sampling(),
            rank=self.accelerator.process_index)

    @property
    def rollout_engine(self) -> RolloutEngine | None:
        """This rank's engine (None where TRL's generate samples)."""
        return None if self.student_sampler is None else self.student_sampler.engine

    def _sampling(self) -> SamplingOptions:
        """TRL's generation settings in our engine's vocabulary (the seed is set per call)."""
        return SamplingOptions(
            max_tokens=self.max_completion_length or 256, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else -1, min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty, stop_token_ids=tuple(self.eos_token_ids),
            engine_kwargs=self.engine_setup.engine_kwargs(), regex=self.args.vllm_structured_outputs_regex)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        """TRL's generation hook: on our engine (:class:`StudentSampler`), else TRL's own generate."""
        if self.student_sampler is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        mode = "train" if self.model.training else "eval"
        return self.student_sampler.sample(prompt_ids, self.model, self.state.global_step, mode)

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **multimodal):
        """TRL's backbone call, for the student and the teacher of its loss; the teacher's runs as our reference
        pass does (:class:`TeacherPass`) wherever it can, else TRL's padded call."""
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        if unwrapped_model is not teacher or not TeacherPass.takes(teacher, input_ids, attention_mask,
                                                                   logits_to_keep, multimodal):
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep,
                                                  **multimodal)
        mode = "train" if self.model.training else "eval"
        return self.teacher_pass.hidden_states(teacher, input_ids, attention_mask, logits_to_keep, mode)

    def close(self) -> None:
        """Release the engine (call after training, before tearing down torch.distributed)."""
        if self.student_sampler is not None:
            self.student_sampler.close()


def engine_refusal(args: NRolloutDistillationConfig, *, is_vlm: bool, tools: bool, context: int | None = None
                   ) -> str | None:
    """Why our engine cannot sample for this run (None: it can): images (TRL's processor tensors are not passed to
    our engine here), tools with tensor-parallel engines (TRL's tool loop calls generation only on the ranks
    whose samples called a tool, while a TP group generates together), and tools with an engine context below the
    model's ``context`` (TRL's tool loop drops a result that does not fit the model's context, not the engine's)."""
    if is_vlm:
        return ("a vision-language student (a processor as processing_class) is not sampled on our engine by "
                "NRolloutDistillationTrainer yet; set rollout_backend='hf' (TRL's generate), or use "
                "NRolloutGRPOTrainer with a teacher term for image prompts.")
    if tools and args.rollout_tp_size > 1:
        return (f"tools= with rollout_tp_size={args.rollout_tp_size}: TRL's tool loop generates a turn only on the "
                "ranks whose samples called a tool, while every rank of a tensor-parallel engine must take part in "
                "its calls; use rollout_tp_size=1 with tools (one engine per rank), or rollout_backend='hf'.")
    limit = args.rollout_max_model_len
    if tools and limit is not None and context is not None and limit < context:
        return (f"tools= with rollout_max_model_len={limit}, below the model's context ({context} tokens): TRL's "
                "tool loop keeps a tool result that fits the model's context, so a conversation could outgrow the "
                "engine's and fail mid-training; leave rollout_max_model_len unset (the engine takes the model's "
                f"context) or set it to {context}.")
    return None


def to_distillation_config(args: DistillationConfig) -> NRolloutDistillationConfig:
    """A plain ``trl.DistillationConfig`` as an :class:`NRolloutDistillationConfig` with the same settings."""
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(DistillationConfig) if f.init}
    return NRolloutDistillationConfig(**values)
