"""The shared-prompt layout's arithmetic without torch: the trainer's decision to pack a micro batch
(:mod:`trl_nrollout.passes.packing`) and ``trl-nrollout plan``'s cost model (:mod:`trl_nrollout.plan.cost`) share it,
so the plan predicts the forwards the trainer runs.

A micro batch of ``B`` rows of ``T`` tokens (prompt and completion, padded) whose rows share ``G`` distinct
prompts, at most ``K`` samples each, packs into ``G`` rows of ``L = P - 1 + K (C + 1)`` tokens
(:func:`packed_length`), with a ``G x L x L`` block mask.
"""

from __future__ import annotations

#: Bound of a micro batch's packed block mask (``G x L x L`` in the weights' dtype): beyond it the trainer runs the
#: plain forward (512-token prompts, n = 16 and 1,024-token completions would need about 1 GiB per prompt).
MAX_PACKED_MASK_BYTES = 256 << 20


def packed_length(prompt_width: int, samples_per_prompt: int, completion_width: int) -> int:
    """Row length ``L`` of the packed layout: the prompt's ``P - 1`` shared tokens, then per sample its copy of the
    prompt's last token and its ``C`` completion tokens."""
    return prompt_width - 1 + samples_per_prompt * (completion_width + 1)


def packing_pays(batch: int, width: int, groups: int, length: int) -> bool:
    """Whether a micro batch of ``batch`` rows of ``width`` tokens runs cheaper as ``groups`` packed rows of
    ``length`` tokens: at least a quarter of the tokens saved (the linear layers' work) and no more attention work
    (SDPA computes a block-masked ``L x L`` in full, so ``G x L^2`` must not exceed the plain ``B x T^2``; short
    prompts with long completions fail this: their packed rows are n completions long)."""
    return groups * length <= 0.75 * batch * width and groups * length * length <= batch * width * width


def mask_bytes_of(groups: int, length: int, mask_element: int, query_element: int | None = None) -> int:
    """Peak bytes of a packed micro batch's block mask ``[G, 1, L, L]`` of ``mask_element``-byte elements. A boolean
    mask under SDPA (``query_element``: the bytes of attention's query dtype) is also turned into an additive copy
    in the queries' dtype, and, when ``L`` is not a multiple of 8, a copy padded to one besides (PyTorch aligns the
    mask's last dimension); all of them are counted. ``query_element`` None: an additive mask, the mask alone."""
    total = groups * length * length * mask_element
    if query_element is not None:
        total += groups * length * length * query_element
        if length % 8:
            total += groups * length * (-(-length // 8) * 8) * query_element
    return total
