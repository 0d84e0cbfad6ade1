"""The prompts' own check, before a model loads: an empty prompt refused, naming its rows. The trainer runs it on
its ``train_dataset``; the recipe's datasets (:mod:`trl_nrollout.recipe.data`) run it when they load."""

from __future__ import annotations

from collections.abc import Iterable

from trl_nrollout.errors import DatasetError

#: How many offending rows an error lists.
_SHOWN = 5


def is_empty_prompt(prompt) -> bool:
    """A prompt with nothing in it: ``None``, an empty text or an empty list of messages. (A blank text or a chat
    with empty messages still gives the engine tokens, and TRL trains on them; they are left alone.)"""
    return prompt is None or (isinstance(prompt, str | list) and len(prompt) == 0)


def prompt_rows(indices: list[int]) -> str:
    """The first rows of ``indices`` for a message (``3, 7, 9 and 12 more``)."""
    shown = ", ".join(str(i) for i in indices[:_SHOWN])
    return shown + (f" and {len(indices) - _SHOWN} more" if len(indices) > _SHOWN else "")


def check_prompts(prompts: Iterable, *, source: str = "the training dataset") -> None:
    """Refuse a dataset with an empty prompt (vLLM refuses it only at the step that draws it: "The decoder prompt
    cannot be empty"; TRL's trainer fails there too), naming the rows. Cheap: no tokenizer."""
    empty = [i for i, p in enumerate(prompts) if is_empty_prompt(p)]
    if not empty:
        return
    rows = prompt_rows(empty)
    raise DatasetError(
        f"{source}: {len(empty)} empty prompt{'s' if len(empty) > 1 else ''} (row{'s' if len(empty) > 1 else ''} "
        f"{rows}, counting from 0); every prompt needs some text. Remove {'them' if len(empty) > 1 else 'it'} from the data, or "
        "filter the dataset first: dataset.filter(lambda row: bool(row['prompt']))."
    )
