"""The vLLM engines' settings: ``LLM(...)``'s keyword arguments for a layout on this platform (CPU or CUDA: block
size, KV cache bytes, memory fraction, lengths), the KV cache's default size on a CPU, which sampling options
vLLM's ``SamplingParams`` does not take, a request's ``SamplingParams`` and the prompt-length check. Pure functions of
the options (no engine is built here)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.engines.weight_sync import next_vllm_lora_rank
from trl_nrollout.rollout.types import SamplingOptions

logger = logging.getLogger(__name__)

#: KV block size of a CPU engine: the smallest vLLM's CPU attention accepts (a multiple of 32; vLLM's CPU default
#: is 128). vLLM's n samples of a prompt share its cached full blocks, but each sample recomputes the prompt's last
#: partial block, up to ``block_size`` tokens: at 512-token prompts, n = 12, 32-token blocks made a rollout of
#: builtin:medium-qwen2 1.7x faster than 128-token ones, timed by hand (docs/backends.md; short prompts gain too).
CPU_BLOCK_SIZE = 32


def _kv_bytes_default(model_path: str, max_seqs: int, expected_len: int, max_model_len: int, tp: int,
                      dtype: str) -> int:
    """A CPU KV-cache size: every concurrent sequence at ``expected_len`` tokens, and at least one sequence at
    ``max_model_len`` (vLLM's start-up check), x1.25; at least 16 MiB."""
    from trl_nrollout.plan.memory import kv_bytes_per_token, kv_heads_per_gpu, load_model_shape

    try:
        shape = load_model_shape(model_path, dtype=dtype if dtype != "auto" else None, count_params=False)
    except (OSError, ValueError) as err:  # config unreadable: a generous fixed size
        logger.warning("could not read the model config of %s (%s); KV cache set to 256 MiB", model_path, err)
        return 256 << 20
    per_token = kv_bytes_per_token(shape.num_hidden_layers, kv_heads_per_gpu(shape.num_key_value_heads, tp),
                                   shape.head_dim, shape.dtype_bytes)
    tokens = max(max_model_len, max_seqs * min(expected_len, max_model_len))
    return max(16 << 20, int(per_token * tokens * 1.25))


def unknown_sampling_keys(options: dict) -> list[str]:
    """The keys of ``options`` (TRL's ``generation_kwargs``) that vLLM's ``SamplingParams`` has no public field
    for, sorted (``SamplingParams(**options)`` would fail on them at the first rollout)."""
    import msgspec
    from vllm import SamplingParams

    known = {f.name for f in msgspec.structs.fields(SamplingParams) if not f.name.startswith("_")}
    return sorted(k for k in options if k not in known)


def engine_kwargs(model: str, layout: RolloutLayout, *, cpu: bool, dtype: str = "auto", max_model_len: int = 1024,
                  expected_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                  gpu_memory_utilization: float = 0.3, enable_prefix_caching: bool = True,
                  enforce_eager: bool = False, enable_sleep_mode: bool = False, seed: int = 0,
                  max_num_seqs: int | None = None, tokenizer: str | None = None,
                  trust_remote_code: bool = False, lora_rank: int | None = None) -> dict:
    """The keyword arguments of each rank's ``vllm.LLM`` (pure: no engine is built; pinned by the unit tests).

    - ``max_num_seqs`` (sequences run at once) defaults to the engine's samples, capped at
      :data:`~trl_nrollout.plan.memory.DEFAULT_MAX_NUM_SEQS`: vLLM's sampler holds ``[max_num_seqs, vocab]`` float32
      buffers, so thousands of samples per engine must not become thousands of concurrent rows; vLLM schedules
      the rest as sequences finish.
    - CPU: float32 by default, eager mode, an explicit KV size (see :func:`_kv_bytes_default`), and no chunked
      prefill with a token budget of at least ``max_model_len``: vLLM rewinds the random generator of a seeded
      request after a partial prefill (``Generator.set_offset``), which CPU generators do not support ("CPU
      Generator does not use offset"); without chunking, a prompt is never prefilled in parts. KV blocks of
      :data:`CPU_BLOCK_SIZE` tokens: the n samples of a prompt each recompute its last partial block.
    - ``trust_remote_code``: the user's choice for the policy (a checkpoint with its own code), passed on.
    - CUDA: ``gpu_memory_utilization`` is always passed (vLLM's default 0.92 fails its start-up check when the
      training model already holds GPU memory), and ``kv_cache_memory_bytes`` as well when given.
    - ``lora_rank`` (``rollout_lora_sync="adapter"``): LoRA enabled, one adapter slot (every request uses the
      newest adapter version; the previous one is dropped when the next arrives), ``max_lora_rank`` the smallest
      value vLLM accepts that holds the rank.
    """
    max_seqs = max_num_seqs or max(1, min(layout.samples_per_engine, DEFAULT_MAX_NUM_SEQS))
    kwargs: dict = dict(
        model=model, tokenizer=tokenizer or model, dtype=dtype, max_model_len=max_model_len, seed=seed,
        enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=layout.rollout_tp_size,
        distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
        max_num_seqs=max_seqs, skip_tokenizer_init=False, trust_remote_code=trust_remote_code,
    )
    if lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=next_vllm_lora_rank(lora_rank), max_loras=1, max_cpu_loras=1)
    if cpu:
        kwargs["dtype"] = "float32" if dtype == "auto" else dtype
        kwargs["enforce_eager"] = True
        kwargs["enable_chunked_prefill"] = False
        kwargs["block_size"] = CPU_BLOCK_SIZE
        kwargs["max_num_batched_tokens"] = max(max_model_len, max_seqs, 4096)
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or _kv_bytes_default(
            model, min(max_seqs, layout.samples_per_engine), expected_len or max_model_len, max_model_len,
            layout.rollout_tp_size, kwargs["dtype"])
    else:
        kwargs["enforce_eager"] = enforce_eager
        kwargs["enable_sleep_mode"] = enable_sleep_mode
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return kwargs


def check_prompt_length(longest: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt of ``longest`` tokens that leaves no room for ``max_tokens`` within an engine's
    ``max_model_len`` (vLLM would cut the completion short, or reject it with its own message), naming the fixes."""
    if longest + max_tokens > max_model_len:
        raise ValueError(
            f"a prompt of {longest} tokens + max_completion_length={max_tokens} exceeds the engine's "
            f"max_model_len={max_model_len} (rollout_max_model_len): the completion would be cut short. "
            f"Raise rollout_max_model_len to at least {longest + max_tokens} (within the model's context "
            f"length), shorten or filter out the long prompts, or lower max_completion_length."
        )


def vllm_sampling_params(n: int, sampling: SamplingOptions):
    """vLLM's ``SamplingParams`` for a request of ``n`` samples with ``sampling`` (log-probs of the sampled tokens,
    flat; TRL's ``generation_kwargs`` applied over ours; suppressed tokens as a -100 logit bias; a regex as
    structured outputs)."""
    from vllm import SamplingParams

    options = dict(
        n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
        stop_token_ids=list(sampling.stop_token_ids) or None, stop=list(sampling.stop) or None,
        seed=sampling.seed, ignore_eos=sampling.ignore_eos, logprobs=0,
        # flat log-probs and no detokenization: the trainer decodes itself; on CPU these two halve the
        # Python overhead of a rollout of a small model (stop strings need the text, so they keep it)
        flat_logprobs=True, detokenize=bool(sampling.stop),
    )
    options.update(sampling.engine_kwargs)  # TRL's generation_kwargs win, as in TRL
    if sampling.suppress_token_ids:  # vLLM clamps a bias to -100: probability e^-100 relative, never sampled
        options["logit_bias"] = {**{t: -100.0 for t in sampling.suppress_token_ids},
                                 **(options.get("logit_bias") or {})}
    if options.get("stop"):
        options["detokenize"] = True  # stop strings are matched on the text
    if sampling.regex is not None:  # takes precedence over generation_kwargs' structured_outputs, as in TRL
        from vllm.sampling_params import StructuredOutputsParams

        options["structured_outputs"] = StructuredOutputsParams(regex=sampling.regex)
    return SamplingParams(**options)


def prompt_logprob_params():
    """vLLM's ``SamplingParams`` that score a request's own tokens: ``prompt_logprobs=0`` (each prompt token's
    log-prob given the tokens before it, from the raw logits: temperature 1) and one generated token, not decoded."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)


def completion_logprobs(prompt_logprobs: Sequence, prompt_len: int, completion: Sequence[int]) -> list[float]:
    """The log-prob of each token of ``completion`` ``[C]`` from vLLM's ``prompt_logprobs`` of the request
    ``prompt + completion`` (one entry per token, None first; each a mapping token id -> ``Logprob``)."""
    out = []
    for j, token in enumerate(completion):
        entry = prompt_logprobs[prompt_len + j]
        out.append(float(entry[token].logprob))
    return out
