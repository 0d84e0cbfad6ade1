"""Sampling seeds: one per step (hashed), one per prompt (spaced by n), so that no two samples share a seed.

vLLM expands a request with ``n`` samples and seed ``s`` into ``n`` child requests seeded ``s, s+1, ..., s+n-1``.
Seeding prompt ``g`` with ``base + g`` (as we once did) gave sample ``(g, k)`` and sample ``(g+1, k-1)`` the same
seed, so two equal prompts next to each other drew the same completions; and a step seed ``seed + 101 * step``
repeated across steps past 101 prompts. Here a step's base is a 62-bit hash of (seed, step, round, mode), and
prompt ``g`` starts at ``base + g * n``: the seeds of a step are ``base .. base + samples - 1``, all distinct, and
different steps land at unrelated places of a 2^62 range (vLLM keeps seeds as int64).
"""

from __future__ import annotations

import contextlib
import hashlib

SEED_BITS = 62
#: ``rollout_seed_mode`` values: one vLLM seed per sample, or the engine's default generators seeded once per call
SEED_MODES = ("sample", "engine")

#: the error for ``rollout_seed_mode="sample"`` on the HF engine
HF_SAMPLE_SEEDS = ("rollout_seed_mode='sample' needs vLLM engines (one generator per request): the HF engine "
                   "(transformers generate) seeds each generation call once. Set rollout_seed_mode='engine' or leave "
                   "it unset (None: 'engine' on the HF engine), or use rollout_backend='vllm'.")


def _hash_seed(text: str) -> int:
    """A seed below 2^SEED_BITS from ``text`` (vLLM keeps seeds as int64); unrelated for different texts."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def step_seed(seed: int, step: int, round_: int = 0, mode: str = "train") -> int:
    """The base seed of one generation call: a hash of the run seed, the optimizer step, the generation round
    within the step (DAPO) and the mode. Reproducible (the same after resuming), unrelated across steps."""
    return _hash_seed(f"{seed}/{step}/{round_}/{mode}")


def prompt_seed(base: int, group: int, n: int) -> int:
    """Seed of the request of prompt ``group`` (its global index in the call) with ``n`` samples: its samples get
    ``prompt_seed .. prompt_seed + n - 1`` (vLLM's child seeds)."""
    if n < 1 or group < 0:
        raise ValueError(f"group={group} must be >= 0 and n={n} >= 1.")
    return base + group * n


def engine_seed(base: int, engine_index: int) -> int:
    """Seed of the default generators of engine ``engine_index`` for one call seeded ``base``
    (``rollout_seed_mode="engine"``): unrelated across engines and calls, below 2^62."""
    return _hash_seed(f"{base}/engine/{engine_index}")


def turn_seed(base: int, round_: int) -> int:
    """Base seed of the requests of turn ``round_`` (0: the first turn; ``r``: the turn after tool round ``r``) in
    a multi-turn call seeded ``base``: below 2^SEED_BITS, unrelated across rounds and bases. Pure, so the ranks of a
    TP engine give a request the same seed whatever other code in their processes drew from NumPy's or torch's
    global generators (which vLLM reads for a request without a seed) and whatever order the tools finish in."""
    if round_ < 0:
        raise ValueError(f"round_={round_} must be >= 0.")
    return _hash_seed(f"{base}/turn/{round_}")


@contextlib.contextmanager
def numpy_seeded(seed: int):
    """NumPy's global generator seeded with ``seed`` inside the block and restored after it (vLLM's Model Runner V2
    draws the seeds of unseeded requests from ``np.random``)."""
    import numpy as np

    state = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        np.random.set_state(state)
