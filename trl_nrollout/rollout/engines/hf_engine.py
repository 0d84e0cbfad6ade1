"""``HFEngine``: the same protocol on ``transformers``' ``generate``; used without vLLM or when asked for
(``rollout_backend="hf"``). It generates with the training model itself, so weight sync is free."""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import replace

import torch
from torch import nn
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from trl_nrollout.passes.distributed import generate_syncs_forwards, is_fsdp, is_zero3
from trl_nrollout.passes.logprobs import compute_log_probs
from trl_nrollout.passes.multimodal import MMInputs, collate
from trl_nrollout.passes.packing import round_up
from trl_nrollout.rollout.engines.protocol import PREFILL_COUNTS
from trl_nrollout.rollout.engines.weight_sync import unwrap
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions

#: ``generate()`` arguments that leave sampling / greedy decoding (beams reorder rows, assistants skip the
#: logits processors for accepted draft tokens): with any of them the log-probs come from a forward pass instead
_NOT_STEPWISE = ("num_beams", "num_beam_groups", "assistant_model", "prompt_lookup_num_tokens", "custom_generate",
                 "assistant_early_exit", "penalty_alpha", "dola_layers")


#: prompts at least this wide (padded) are prefilled once for their n samples: below it the prefill is a small part of
#: a rollout, and the extra forward call costs more than it saves (on CPU, 8 prompts of ~10 tokens x n = 4: 13%)
PREFILL_ONCE_MIN_TOKENS = 64

#: ``generate()`` arguments that bring their own cache: the prompt is then prefilled once per sample, as TRL does
_OWN_CACHE = {"past_key_values", "cache_implementation", "cache_config"}


def _own_cache_in_config(model: nn.Module) -> bool:
    """Whether the model's ``generation_config`` names a cache of its own (Gemma 2 and 3 ship
    ``cache_implementation="hybrid"``): ``generate`` then refuses a ``past_key_values`` handed to it, so the prompt
    cannot be prefilled once."""
    config = getattr(model, "generation_config", None)
    return any(getattr(config, key, None) is not None for key in ("cache_implementation", "cache_config"))


#: sampling arguments of ``generate()`` that become warpers, in the order ``generate`` applies them
#: (transformers 5.19 ``_get_logits_processor``)
_WARPER_ARGS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def _own_warpers(options: dict, device: torch.device | str = "cpu") -> list[LogitsProcessor]:
    """Take sampling's warpers (temperature, top-h, top-k, top-p, min-p, typical-p, epsilon and eta cutoffs) out of
    ``generate()``'s ``options`` and return them as processors, in ``generate``'s own order, to run before
    :class:`SampledLogProbs` (``generate`` runs a caller's processors before its warpers, so the recorder would not
    see them). Greedy decoding has none."""
    from transformers.generation.logits_process import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopHLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    values = {k: options.get(k) for k in _WARPER_ARGS}
    options.update(dict.fromkeys(values))  # None: no warper of generate's own (a None argument is not a default)
    if not options.get("do_sample"):
        return []
    out: list[LogitsProcessor] = []
    if values["temperature"] is not None and values["temperature"] != 1.0:
        out.append(TemperatureLogitsWarper(values["temperature"]))
    if values["top_h"] is not None:
        out.append(TopHLogitsWarper(top_h=values["top_h"]))
    if values["top_k"]:
        out.append(TopKLogitsWarper(top_k=values["top_k"]))
    if values["top_p"] is not None and values["top_p"] < 1.0:
        out.append(TopPLogitsWarper(top_p=values["top_p"]))
    if values["min_p"] is not None:
        out.append(MinPLogitsWarper(min_p=values["min_p"]))
    if values["typical_p"] is not None and values["typical_p"] < 1.0:
        out.append(TypicalLogitsWarper(mass=values["typical_p"]))
    if values["epsilon_cutoff"] is not None and 0.0 < values["epsilon_cutoff"] < 1.0:
        out.append(EpsilonLogitsWarper(epsilon=values["epsilon_cutoff"]))
    if values["eta_cutoff"] is not None and 0.0 < values["eta_cutoff"] < 1.0:
        out.append(EtaLogitsWarper(epsilon=values["eta_cutoff"], device=device))
    return out


def _max_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks of the default process group."""
    count = torch.tensor([value], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())


def _forwards_collective(model: nn.Module) -> bool:
    """Whether a forward of ``model`` as it stands (outside any generation context) gathers parameters collectively
    over the ranks: ZeRO-3 or FSDP with more than one rank. Every rank must then run as many forwards as the
    busiest one."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return world > 1 and (generate_syncs_forwards(model) or is_zero3(model) or is_fsdp(model))


class SampledLogProbs(LogitsProcessor):
    """Records the log-probability of each generated token under the distribution it was sampled from, during
    ``generate`` itself: no second forward over prompts and completions.

    ``generate`` calls it once per new position with ``scores`` ``[rows, vocab]`` (float32), last of the logits
    processors: after the built-in ones (the repetition penalty, suppressed tokens) and after the sampling warpers
    the engine puts before it (:func:`_own_warpers`: temperature, top-h, top-k, top-p, min-p, typical-p, epsilon
    and eta cutoffs). It keeps
    ``log_softmax(scores)`` until the next call, whose ``input_ids[:, -1]`` is the token sampled from it;
    :meth:`finish` reads the last one from the output. This is vLLM's ``processed_logprobs``, the quantity the
    vLLM engine reports.
    """

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []  # per generated position: [rows] log-probs of the sampled tokens
        self._pending: torch.Tensor | None = None  # [rows, vocab] of the position whose token is not known yet

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self.rows.append(self._pending.gather(1, tokens[:, None].to(self._pending.device)).squeeze(1))
            self._pending = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor | None:
        """``[rows, T]`` log-probs for ``new_tokens`` ``[rows, T]`` (the generated part of the output), or None
        when the calls do not line up with it (a decoding mode that does not call the processors once per
        token and row)."""
        if new_tokens.shape[1]:
            self._take(new_tokens[:, -1])
        if len(self.rows) != new_tokens.shape[1] or any(r.shape[0] != new_tokens.shape[0] for r in self.rows):
            return None
        return torch.stack(self.rows, dim=1) if self.rows else new_tokens.new_zeros(new_tokens.shape, dtype=torch.float)


class HFEngine:
    """Generation with ``model.generate`` (sampling, ``num_return_sequences=n``) on this rank's prompts.

    ``batch_size`` prompts go through ``generate`` at a time. Prompts of :data:`PREFILL_ONCE_MIN_TOKENS` tokens or
    more are prefilled once for their ``n`` samples (:meth:`_prefill_once`; not under ZeRO-3 or FSDP over several
    ranks, whose forwards must stay in step, unless ``local_forwards`` says the generation context makes every
    forward local: ZeRO-3 with TRL's ``ds3_gather_for_generation``, parameters gathered and their hooks off). The
    samples whose prompt was prefilled once are counted in ``prefill_shared_samples``, beside
    ``generated_samples`` (the trainer logs the fraction and resets both each step). The sampled tokens'
    log-probs are recorded while generating (:class:`SampledLogProbs`: penalties, a user's processors and every
    sampling warper applied, vLLM's ``processed_logprobs``), so a rollout costs ``generate`` alone, as TRL's. Decoding modes other than sampling
    and greedy (beams, assisted decoding, set through TRL's ``generation_kwargs``) get them from
    :func:`~trl_nrollout.passes.logprobs.compute_log_probs` after ``generate`` instead (temperature only), and generate as
    TRL does: each prompt repeated ``n`` times, one sequence per row (``num_return_sequences=n`` would ask beam search
    for its ``n`` best beams, which needs ``num_beams >= n`` and is not TRL's sampling). ``pad_to_multiple_of``: each
    prompt batch is left-padded to a multiple of it (TRL's option).
    """

    #: what it can do beyond the core (:mod:`trl_nrollout.rollout.engines.protocol`): no request loop (it cannot add
    #: nor abort a request while it generates), no adapter of its own (it generates with the PEFT model itself)
    capabilities = frozenset({PREFILL_COUNTS})
    #: no context limit of its own (it generates past the model's context, as TRL's generate path does)
    max_model_len = None
    #: each rank generates its own prompts: never a queue shared with other engines
    balances_job = False

    def __init__(self, model: nn.Module, *, pad_token_id: int, eos_token_ids: list[int], batch_size: int = 64,
                 seed: int = 0, generation_context=None, shared_prompts: bool = False,
                 local_forwards: bool = False, pad_to_multiple_of: int | None = None, rank: int = 0) -> None:
        self.model = model
        # every rank is an engine of its own (TP 1): its index is its rank
        self.rank = self.engine_index = rank
        self.tp_ranks = [rank]
        self.pad_to_multiple_of = pad_to_multiple_of  # TRL's option: prompt batches padded to a multiple of it
        self.local_forwards = local_forwards
        self.prefill_shared_samples = self.generated_samples = 0
        # a callable returning a context manager that yields the model to generate with (the trainer passes TRL's
        # unwrap_model_for_generation, which gathers ZeRO-3 parameters once for the whole generate call)
        self.generation_context = generation_context
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.batch_size = batch_size
        self.generator_seed = seed
        # score the n samples of a prompt with the prompt once (trl_nrollout.passes.packing); the trainer checks the model
        self.shared_prompts = shared_prompts
        self._calls = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingOptions,
                 group_offset: int = 0, mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        """``n`` samples of each prompt; ``mm``: per prompt, a vision-language model's image tensors (or None).

        Every rank calls it the same number of times under ZeRO-3 or FSDP, possibly with no prompts (a multi-turn
        step where its samples stopped calling tools): the generation context (TRL's, which gathers ZeRO-3
        parameters), ``generate``'s steps and the log-prob pass are collective there, and a rank with nothing to do
        takes part in each of them with filler work (see :meth:`_generate` and :meth:`_score_after`)."""
        context = (contextlib.nullcontext(unwrap(self.model)) if self.generation_context is None
                   else self.generation_context())
        with context as model:
            batch, recorded = self._generate(model, prompts, n, sampling, group_offset, mm)
        # the forward pass for decoding modes whose log-probs were not recorded (beams...) runs after the context:
        # TRL's context gathers ZeRO-3 parameters with GatheredParameters, which the pass's own gather of the output
        # head would nest in (DeepSpeed refuses overlapping contexts); outside, the forwards are collective again
        return self._score_after(model, batch, recorded, sampling, group_offset, mm)

    @torch.no_grad()
    def _score_after(self, model: nn.Module, batch: RolloutBatch, recorded: bool, sampling: SamplingOptions,
                     group_offset: int, mm: list[MMInputs | None] | None) -> RolloutBatch:
        """Fill ``batch.logprobs`` with a forward pass (:func:`compute_log_probs`) where ``generate`` did not record
        them (``recorded`` False). Where the forwards are collective (ZeRO-3, FSDP over several ranks) the ranks
        agree first whether any of them needs the pass (an all-reduce every rank makes), and a rank with no samples
        scores a one-token filler sample so that it runs as many forwards as the busiest rank."""
        start = time.perf_counter()
        collective = _forwards_collective(model)
        needed = not recorded and len(batch) > 0
        if collective:
            needed = bool(_max_over_ranks(int(needed), next(model.parameters()).device))
        if not needed:
            return batch
        temp = sampling.temperature if sampling.temperature > 0 else 1.0
        if not len(batch):  # filler: one token scored, the result dropped; the pass raises it to the others' count
            compute_log_probs(model, [[self.pad_token_id]], [[self.pad_token_id]], temperature=temp,
                              micro_batch_size=64, pad_token_id=self.pad_token_id, sync_forwards=True)
            return batch
        sample_mm = None if mm is None else [mm[g - group_offset] for g in batch.group_index]
        lp = compute_log_probs(model, batch.prompt_ids, batch.completion_ids, temperature=temp, micro_batch_size=64,
                               pad_token_id=self.pad_token_id, mm_inputs=sample_mm,
                               pad_to_multiple_of=self.pad_to_multiple_of, sync_forwards=collective,
                               shared_prompts=self.shared_prompts and mm is None).logprobs
        batch.logprobs = [lp[i, :len(c)].tolist() for i, c in enumerate(batch.completion_ids)]
        batch.timings["logprob_s"] = batch.timings.get("logprob_s", 0.0) + time.perf_counter() - start
        return batch

    @torch.no_grad()
    def _generate(self, model: nn.Module, prompts: list[list[int]], n: int, sampling: SamplingOptions,
                  group_offset: int, mm: list[MMInputs | None] | None = None) -> tuple[RolloutBatch, bool]:
        """The samples, and whether their log-probs were recorded while generating (False: ``logprobs`` holds
        empty lists, to be filled by :meth:`_score_after`)."""
        if sampling.regex is not None:
            raise ValueError("structured outputs (a regex) need the vLLM engine; use rollout_backend='vllm'.")
        # under ZeRO-3 or FSDP over several ranks generate steps the ranks together (transformers' synced_gpus: an
        # all-reduce per new token), also inside TRL's context that gathered the ZeRO-3 parameters (local_forwards:
        # their hooks are off, but DeepSpeed's start-of-forward hook stays and may broadcast): every rank makes as
        # many generate calls as the busiest one, a rank with nothing to generate included
        synced = generate_syncs_forwards(model)
        if not prompts and not synced:  # nothing on this rank (a multi-turn step where others continue)
            return RolloutBatch([], [], [], [], []), True
        device = next(model.parameters()).device
        starts = range(0, len(prompts), self.batch_size)
        # under synced forwards every rank must make as many generate calls as the busiest one: a rank with fewer
        # contexts (a multi-turn step where its samples stopped calling tools) would leave the others waiting in
        # generate's per-step all-reduce
        extra_calls = _max_over_ranks(len(starts), device) - len(starts) if synced else 0
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        stepwise = not any(k in _NOT_STEPWISE and v not in (None, 1, False) for k, v in sampling.engine_kwargs)
        seed = sampling.seed if sampling.seed is not None else self.generator_seed + self._calls
        self._calls += 1
        torch.manual_seed(seed)
        prompt_ids, completion_ids, reasons, groups, logprobs = [], [], [], [], []
        stop_ids = set(self.eos_token_ids) | set(sampling.stop_token_ids)
        try:
            for _ in range(extra_calls):  # one-token prompt, one new token; generate keeps stepping with the others
                filler = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=device)
                model.generate(input_ids=filler, attention_mask=torch.ones_like(filler), max_new_tokens=1,
                               do_sample=False, pad_token_id=self.pad_token_id, synced_gpus=True)
            for s in starts:
                chunk = prompts[s:s + self.batch_size]
                width = round_up(max(len(p) for p in chunk), self.pad_to_multiple_of)
                # not stepwise (beams...): as TRL, every sample is a row of its own (row g * n + k: sample k of g)
                per_row = n if stepwise else 1
                rows = chunk if stepwise else [p for p in chunk for _ in range(n)]
                ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(rows):
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                greedy = sampling.temperature == 0
                options = dict(
                    do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                    top_p=sampling.top_p if sampling.top_p < 1 else None,
                    top_k=sampling.top_k if sampling.top_k > 0 else None,
                    min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
                    max_new_tokens=sampling.max_tokens, num_return_sequences=per_row,
                    eos_token_id=sorted(stop_ids) if not sampling.ignore_eos else None,
                    pad_token_id=self.pad_token_id,
                )
                if sampling.suppress_token_ids:
                    options["suppress_tokens"] = list(sampling.suppress_token_ids)
                options.update(sampling.engine_kwargs)  # TRL's generation_kwargs win, as in TRL
                options["synced_gpus"] = synced  # but not over whether the ranks step together: that is ours to say
                recorder = None
                if stepwise:
                    recorder = SampledLogProbs()
                    user = options.get("logits_processor") or []
                    options["logits_processor"] = LogitsProcessorList([*user, *_own_warpers(options, device), recorder])
                if mm is not None:  # images: the processor's tensors, per-token fields left-padded like the ids
                    chunk_mm = mm[s:s + self.batch_size]
                    options.update(collate(chunk_mm if stepwise else [m for m in chunk_mm for _ in range(n)], device,
                                           width=width, starts=[width - len(p) for p in rows]))
                ids, mask = ids.to(device), mask.to(device)
                if n > 1 and width >= PREFILL_ONCE_MIN_TOKENS and mm is None and stepwise \
                        and (self.local_forwards or not synced) \
                        and not _OWN_CACHE.intersection(options) and not _own_cache_in_config(model):
                    ids, mask = self._prefill_once(model, ids, mask, n, options)
                    self.prefill_shared_samples += len(chunk) * n
                self.generated_samples += len(chunk) * n
                out = model.generate(input_ids=ids, attention_mask=mask, **options)
                recorded = None if recorder is None else recorder.finish(out[:, width:])
                recorded = None if recorded is None else recorded.tolist()
                new = out[:, width:].tolist()
                for k, toks in enumerate(new):
                    g = k // n
                    cut = next((j + 1 for j, t in enumerate(toks) if t in stop_ids), None)
                    comp = toks[:cut] if cut else toks  # up to and including the stop token
                    prompt_ids.append(list(chunk[g]))
                    completion_ids.append(comp)
                    reasons.append("stop" if cut else "length")
                    groups.append(group_offset + s + g)
                    if recorded is not None:
                        logprobs.append(recorded[k][:len(comp)])
        finally:
            model.train(was_training)
        recorded = len(logprobs) == len(completion_ids)  # not (see _NOT_STEPWISE): a forward, in _score_after
        if not recorded:
            logprobs = [[] for _ in completion_ids]
        return RolloutBatch(prompt_ids, completion_ids, logprobs, reasons, groups,
                            timings={"generate_s": time.perf_counter() - start, "logprob_s": 0.0}), recorded

    @staticmethod
    def _prefill_once(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int,
                      options: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each prompt's KV cache once and give it to its ``n`` samples, instead of ``generate`` prefilling
        ``n`` copies (``num_return_sequences``, or TRL's prompts repeated n times).

        ``ids``, ``mask``: ``[G, P]`` left-padded prompts. The cache of ``ids[:, :-1]`` (positions counted from
        each prompt's first token, as ``generate`` counts them) is repeated ``n`` times along the batch; ``generate``
        then gets the ``[G * n, P]`` ids (sample ``k`` of prompt ``g`` at row ``g * n + k``, ``num_return_sequences``'
        order) and runs only the last prompt token before sampling. Sets ``options`` (the cache, one sequence
        per row); returns the expanded ``ids``, ``mask``.
        """
        prefix_mask = mask[:, :-1]
        cache = DynamicCache(config=model.config)
        inputs = dict(input_ids=ids[:, :-1], attention_mask=prefix_mask, past_key_values=cache, use_cache=True,
                      position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        if "logits_to_keep" in inspect.signature(base.forward).parameters:
            inputs["logits_to_keep"] = 1  # only the cache is wanted: no [G, P, vocab] logits
        model(**inputs)
        cache.batch_repeat_interleave(n)
        options.update(past_key_values=cache, num_return_sequences=1)
        return ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int | None = 0, images: list[list] | None = None,
                          mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        """TRL's form (prompts repeated ``n`` times, whole groups on this rank); ``mm`` per sample (the processor's
        tensors: this engine does not expand ``images`` itself)."""
        if images is not None:
            raise ValueError("the HF engine takes images as the processor's tensors (mm=), not images=.")
        sample_offset = sample_offset or 0
        if len(sample_prompts) % n:
            raise ValueError(f"{len(sample_prompts)} samples are not whole groups of n={n}.")
        return self.generate(sample_prompts[::n], n, sampling, group_offset=sample_offset // n,
                             mm=None if mm is None else mm[::n])

    def generate_turns(self, contexts: list[list[int]], budgets: list[int], sampling: SamplingOptions,
                       sample_offset: int = 0, sample_ids: list[int] | None = None,
                       num_samples: int | None = None, images: list[list] | None = None,
                       mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        """One more turn of multi-turn samples: one sample per context, each cut at its own token budget. Every
        rank calls it, possibly with no contexts (ZeRO-3 gathers the parameters collectively). ``sample_ids`` /
        ``num_samples`` are the vLLM engine's per-sample seeds' inputs: this engine seeds each call once. ``mm``:
        per context, the processor's tensors of its images (expanded in the context)."""
        if images is not None:
            raise ValueError("the HF engine takes images as the processor's tensors (mm=), not images=.")
        longest = max(budgets, default=0)
        batch = self.generate(contexts, 1, replace(sampling, max_tokens=max(longest, 1)), group_offset=sample_offset,
                              mm=mm)
        for i, budget in enumerate(budgets):
            if len(batch.completion_ids[i]) > budget:
                batch.completion_ids[i] = batch.completion_ids[i][:budget]
                batch.logprobs[i] = batch.logprobs[i][:budget]
                batch.finish_reasons[i] = "length"
        return batch

    def load_weights(self, model: nn.Module, merge_lora: bool = True, version: int = 0) -> dict:
        """Nothing to copy: the engine generates with the training model itself (its adapter included)."""
        self.model = model
        return {"bytes": 0, "buckets": 0, "peak_bucket_bytes": 0, "seconds": 0.0}

    def check_prompt_length(self, longest: int, max_tokens: int) -> None:
        """No limit of its own (:attr:`max_model_len` is None): nothing to check."""
        return None

    def gather_tp(self, obj) -> list:
        """``[obj]``: the engine is this rank alone."""
        return [obj]

    def sleep(self) -> None:
        return None

    def close(self) -> None:
        return None

    def wake_up(self, tags=None) -> None:
        return None
