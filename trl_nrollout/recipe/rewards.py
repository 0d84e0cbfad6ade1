"""Built-in reward functions (TRL's signature: ``f(completions, **columns) -> list[float | None]``) and the
resolver recipes use: a built-in name or any ``module:function`` import path."""

from __future__ import annotations

import difflib
import importlib
import os
import re
from collections.abc import Callable
from fractions import Fraction

from trl_nrollout.builtin import digits_reward, short_answer_reward
from trl_nrollout.errors import InputError

RewardFunc = Callable[..., list]


def completion_text(completion) -> str:
    """The text of a completion, plain or conversational (the last message's content)."""
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is ``<think>...</think><answer>...</answer>`` (R1's format), else 0.0."""
    return [1.0 if _FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def length_reward(completions: list, target_length: int = 64, **kwargs) -> list[float]:
    """``1 - |characters - target| / target``, floored at 0: completions near ``target_length`` characters."""
    out = []
    for c in completions:
        n = len(completion_text(c))
        out.append(max(0.0, 1.0 - abs(n - target_length) / target_length))
    return out


def extract_answer(text: str) -> str:
    """The answer of a completion: the last ``<answer>`` tag, else the last ``\\boxed{}``, else the last line."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _answers(kwargs: dict, n: int) -> list:
    if "answer" not in kwargs:
        raise KeyError("this reward needs an 'answer' column in the dataset (one reference answer per prompt).")
    return kwargs["answer"]


def exact_answer_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the dataset's ``answer`` column (whitespace/case-insensitive)."""
    answers = _answers(kwargs, len(completions))
    return [1.0 if extract_answer(completion_text(c)).strip().lower() == str(a).strip().lower() else 0.0
            for c, a in zip(completions, answers)]


def parse_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact fraction (``1,234``, ``-3.5``, ``7/2``); None if there is none."""
    found = _NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    token = found[-1].replace(",", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion's answer is numerically equal to the dataset's ``answer`` (exact fractions)."""
    answers = _answers(kwargs, len(completions))
    out = []
    for c, a in zip(completions, answers):
        got, want = parse_number(extract_answer(completion_text(c))), parse_number(str(a))
        out.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return out


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "digits": digits_reward,
    "short_answer": short_answer_reward,
    "format": format_reward,
    "length": length_reward,
    "exact_answer": exact_answer_reward,
    "math_answer": math_answer_reward,
}


def resolve_reward(spec: str) -> RewardFunc:
    """A reward function from a built-in name or a ``package.module:function`` path. A reference that does not
    resolve (no such module, the module failing to import, no such function) is an :class:`InputError` naming the
    entry, what went wrong and a fix: the recipe prints it as its one-line ``error:`` (exit status 2)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise InputError(
            f"reward_funcs entry {spec!r} is neither a built-in reward {sorted(BUILTIN_REWARDS)} nor an import "
            "path 'package.module:function'; use one of those."
        )
    return resolve_import(spec, "reward_funcs entry")


def resolve_import(spec: str, option: str):
    """The function a ``package.module:function`` path names (``option``: the recipe key, for the error: a
    ``reward_funcs`` entry, ``agent``); an :class:`InputError` naming it, what went wrong and a fix otherwise."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise InputError(f"{option} {spec!r} is not an import path 'package.module:function'; write it so.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if err.name is not None and module_name.startswith(err.name) and module_name[len(err.name):][:1] in ("", "."):
            raise InputError(  # the module itself (or a package of its path) is not found
                f"{option} {spec!r}: no module named {err.name!r} on Python's path. Check the spelling; "
                f"a module file of yours must be in a folder on PYTHONPATH (python puts the script's folder on the "
                f"path, not the current one): e.g. PYTHONPATH={os.getcwd()} for a module in the current folder."
            ) from None
        raise InputError(f"{option} {spec!r}: module {module_name!r} was found but importing it failed: "
                         f"{err}. Install what it imports, or fix the import.") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed at import time: its error, where it happened
        raise InputError(f"{option} {spec!r}: importing module {module_name!r} raised "
                         f"{type(err).__name__}: {err}{_where(err)}. Fix the module (python -c 'import "
                         f"{module_name}' shows the whole traceback).") from None
    func = getattr(module, attr, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        close = difflib.get_close_matches(attr, found, n=1)
        what = (f"module {module_name!r} has no function {attr!r}" if func is None else
                f"{module_name}.{attr} is a {type(func).__name__}, not a function")
        raise InputError(f"{option} {spec!r}: {what}"
                         + (f"; did you mean {module_name}:{close[0]}?" if close else
                            f"; its functions: {found[:10]}." if found else "; it defines no function."))
    return func


def _where(err: BaseException) -> str:
    """`` (file, line N)`` of the innermost frame an exception was raised in, or ``""`` (a SyntaxError's message
    names them itself)."""
    if isinstance(err, SyntaxError):  # its message names the file and the line
        return ""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" ({tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})" if tb is not None else ""
