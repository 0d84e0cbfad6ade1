"""``HFEngine``: the same protocol on ``transformers``' ``generate``; used without vLLM or when asked for
(``rollout_backend="hf"``). It generates with the training model itself, so weight sync is free."""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from trl_nrollout.logprobs import compute_log_probs
from trl_nrollout.multimodal import MMInputs, collate
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions
from trl_nrollout.rollout.weight_sync import unwrap


class HFEngine:
    """Generation with ``model.generate`` (sampling, ``num_return_sequences=n``) on this rank's prompts.

    ``batch_size`` prompts go through ``generate`` at a time. Log-probs of the sampled tokens are computed by
    :func:`~trl_nrollout.logprobs.compute_log_probs` at the sampling temperature, so they are the same
    quantity vLLM reports (``processed_logprobs``; top-p/top-k filtering aside).
    """

    def __init__(self, model: nn.Module, *, pad_token_id: int, eos_token_ids: list[int], batch_size: int = 64,
                 seed: int = 0, generation_context=None, shared_prompts: bool = False) -> None:
        self.model = model
        # a callable returning a context manager that yields the model to generate with (the trainer passes TRL's
        # unwrap_model_for_generation, which gathers ZeRO-3 parameters once for the whole generate call)
        self.generation_context = generation_context
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.batch_size = batch_size
        self.generator_seed = seed
        # score the n samples of a prompt with the prompt once (trl_nrollout.packing); the trainer checks the model
        self.shared_prompts = shared_prompts
        self._calls = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingOptions,
                 group_offset: int = 0, mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        """``n`` samples of each prompt; ``mm``: per prompt, a vision-language model's image tensors (or None)."""
        if self.generation_context is None:
            return self._generate(unwrap(self.model), prompts, n, sampling, group_offset, mm)
        with self.generation_context() as model:
            return self._generate(model, prompts, n, sampling, group_offset, mm)

    @torch.no_grad()
    def _generate(self, model: nn.Module, prompts: list[list[int]], n: int, sampling: SamplingOptions,
                  group_offset: int, mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        if sampling.regex is not None:
            raise ValueError("structured outputs (a regex) need the vLLM engine; use rollout_backend='vllm'.")
        if not prompts:  # nothing on this rank (a multi-turn step where others continue): no forward at all
            return RolloutBatch([], [], [], [], [])
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        seed = sampling.seed if sampling.seed is not None else self.generator_seed + self._calls
        self._calls += 1
        torch.manual_seed(seed)
        prompt_ids, completion_ids, reasons, groups = [], [], [], []
        stop_ids = set(self.eos_token_ids) | set(sampling.stop_token_ids)
        try:
            for s in range(0, len(prompts), self.batch_size):
                chunk = prompts[s:s + self.batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(chunk):
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                greedy = sampling.temperature == 0
                options = dict(
                    do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                    top_p=sampling.top_p if sampling.top_p < 1 else None,
                    top_k=sampling.top_k if sampling.top_k > 0 else None,
                    min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
                    max_new_tokens=sampling.max_tokens, num_return_sequences=n,
                    eos_token_id=sorted(stop_ids) if not sampling.ignore_eos else None,
                    pad_token_id=self.pad_token_id,
                )
                if sampling.suppress_token_ids:
                    options["suppress_tokens"] = list(sampling.suppress_token_ids)
                options.update(sampling.engine_kwargs)  # TRL's generation_kwargs win, as in TRL
                if mm is not None:  # images: the processor's tensors, per-token fields left-padded like the ids
                    options.update(collate(mm[s:s + self.batch_size], device, width=width,
                                           starts=[width - len(p) for p in chunk]))
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **options)
                new = out[:, width:].tolist()
                for k, toks in enumerate(new):
                    g = k // n
                    cut = next((j + 1 for j, t in enumerate(toks) if t in stop_ids), None)
                    comp = toks[:cut] if cut else toks  # up to and including the stop token
                    prompt_ids.append(list(chunk[g]))
                    completion_ids.append(comp)
                    reasons.append("stop" if cut else "length")
                    groups.append(group_offset + s + g)
        finally:
            model.train(was_training)
        gen_s = time.perf_counter() - start
        temp = sampling.temperature if sampling.temperature > 0 else 1.0
        sample_mm = None if mm is None else [mm[g - group_offset] for g in groups]
        lp = compute_log_probs(model, prompt_ids, completion_ids, temperature=temp, micro_batch_size=64,
                               pad_token_id=self.pad_token_id, mm_inputs=sample_mm,
                               shared_prompts=self.shared_prompts and mm is None).logprobs
        logprobs = [lp[i, :len(c)].tolist() for i, c in enumerate(completion_ids)]
        return RolloutBatch(prompt_ids, completion_ids, logprobs, reasons, groups,
                            timings={"generate_s": gen_s, "logprob_s": time.perf_counter() - start - gen_s})

    def generate_expanded(self, sample_prompts: list[list[int]], n: int, sampling: SamplingOptions,
                          sample_offset: int = 0, mm: list[MMInputs | None] | None = None) -> RolloutBatch:
        """TRL's form (prompts repeated ``n`` times, whole groups on this rank); ``mm`` per sample."""
        if len(sample_prompts) % n:
            raise ValueError(f"{len(sample_prompts)} samples are not whole groups of n={n}.")
        return self.generate(sample_prompts[::n], n, sampling, group_offset=sample_offset // n,
                             mm=None if mm is None else mm[::n])

    def generate_turns(self, contexts: list[list[int]], budgets: list[int], sampling: SamplingOptions,
                       sample_offset: int = 0) -> RolloutBatch:
        """One more turn of multi-turn samples: one sample per context, each cut at its own token budget. Every
        rank calls it, possibly with no contexts (ZeRO-3 gathers the parameters collectively)."""
        longest = max(budgets, default=0)
        batch = self.generate(contexts, 1, replace(sampling, max_tokens=max(longest, 1)), group_offset=sample_offset)
        for i, budget in enumerate(budgets):
            if len(batch.completion_ids[i]) > budget:
                batch.completion_ids[i] = batch.completion_ids[i][:budget]
                batch.logprobs[i] = batch.logprobs[i][:budget]
                batch.finish_reasons[i] = "length"
        return batch

    def load_weights(self, model: nn.Module) -> dict:
        """Nothing to copy: the engine generates with the training model itself."""
        self.model = model
        return {"bytes": 0, "buckets": 0, "peak_bucket_bytes": 0, "seconds": 0.0}

    def sleep(self) -> None:
        return None

    def close(self) -> None:
        return None

    def wake_up(self) -> None:
        return None
