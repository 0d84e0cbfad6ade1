"""Reward functions used by the end-to-end tests (importable as tests.assets.rewards_for_tests:NAME)."""

from trl_nrollout.builtin import digit_fraction


def constant_for_some_prompts(completions, prompts, **kwargs):
    """1.0 for every sample of prompts that mention 'digits' (a constant group: no signal), else the digit
    fraction: dynamic sampling must filter the constant groups."""
    return [1.0 if "digits" in p else digit_fraction(c) for p, c in zip(prompts, completions)]


def raises_on_long(completions, **kwargs):
    """Raises for the first completion longer than 3 characters (an error path)."""
    out = []
    for c in completions:
        if len(c) > 3:
            raise ZeroDivisionError("boom")
        out.append(0.0)
    return out


def none_for_all(completions, **kwargs):
    return [None for _ in completions]


async def async_digits(completions, **kwargs):
    """An async reward function (TRL accepts them): the digit fraction."""
    return [digit_fraction(c) for c in completions]


def nan_for_all(completions, **kwargs):
    """A buggy reward function: it computes NaN."""
    return [float("nan") for _ in completions]


def prompt_score(completions, prompts, **kwargs):
    """Depends on the prompt only (so two trainers sampling different completions score the same): the number of
    characters of the prompt modulo 7, or None for prompts whose length is even (the function does not apply)."""
    text = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
    return [None if len(t) % 2 == 0 else float(len(t) % 7) for t in text]


def prompt_bonus(completions, prompts, log_metric=None, log_extra=None, **kwargs):
    """A second prompt-only reward: 0.5 for prompts that mention 'number', None otherwise. It logs a metric (the
    fraction of prompts it applies to) and an extra column through TRL's callables."""
    text = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
    log_metric("bonus/applies", sum("number" in t for t in text) / len(text))
    log_extra("bonus_applies", ["number" in t for t in text])
    return [0.5 if "number" in t else None for t in text]


def says_good(completions, **kwargs):
    """A buggy reward function: it returns labels, not numbers."""
    return ["good" for _ in completions]


def slow_digits(completions, **kwargs):
    """A reward call that hangs (a stuck HTTP request): sleeps 600 s on rank 1 (or on every rank when run in one
    process), then returns the digit fraction."""
    import os
    import time

    if os.environ.get("RANK", "1") == "1" or os.environ.get("WORLD_SIZE", "1") == "1":
        time.sleep(600)
    return [digit_fraction(c) for c in completions]


def digits_recording_prompts(completions, prompts, **kwargs):
    """The digit fraction; each call appends the prompts it scored as one JSON line to the file named by
    ``NROLLOUT_TEST_PROMPT_LOG`` (which samples a step scored, and for which prompts ReMax took its baselines)."""
    import json
    import os

    with open(os.environ["NROLLOUT_TEST_PROMPT_LOG"], "a") as fh:
        fh.write(json.dumps([str(p) for p in prompts]) + "\n")
    return [digit_fraction(c) for c in completions]
