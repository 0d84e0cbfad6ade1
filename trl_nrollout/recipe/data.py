"""Prompt datasets for recipes: the built-in task, a hub id, a local file (json/jsonl/csv/parquet) or folder.

Everything a recipe trains on is checked here, once, before a model is loaded: a local file that is empty or
malformed, a missing prompt column and an empty prompt are a :class:`~trl_nrollout.errors.DatasetError` naming the
file, the line or row, and what a dataset must look like (:data:`DATASET_SHAPE`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from trl_nrollout.builtin import digits_dataset
from trl_nrollout.errors import DatasetError, InputError
from trl_nrollout.trainer.prompts import check_prompts, prompt_rows

_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
#: What a recipe's dataset must look like (every dataset error ends with it).
DATASET_SHAPE = ("A recipe's dataset has one row per prompt and a 'prompt' column (or the column named by "
                 "dataset_prompt_column) holding a non-empty text or a list of chat messages "
                 "([{\"role\": \"user\", \"content\": \"...\"}]); a .jsonl file holds one JSON object per line, e.g. "
                 "{\"prompt\": \"Write a number.\"}.")


def load_prompts(name: str, *, split: str = "train", prompt_column: str = "prompt", num_builtin: int = 512,
                 seed: int = 0, config: str | None = None, system_prompt: str | None = None):
    """A ``datasets.Dataset`` with a ``prompt`` column (text or chat messages) plus the other columns, every prompt
    checked (:func:`check_prompts`).

    ``config``: the dataset's configuration (subset), for a hub id or a dataset folder. ``system_prompt``: turn
    each text prompt into ``[system, user]`` chat messages (for instruction-tuned models)."""
    from datasets import load_dataset, load_from_disk

    if name == "builtin:digits":
        return digits_dataset(num_builtin, seed=seed)
    path = Path(name).expanduser()
    if path.is_file():
        fmt = _FORMATS.get(path.suffix)
        if fmt is None:
            raise DatasetError(f"dataset_name={name!r}: unknown file type {path.suffix!r}; use one of "
                               f"{sorted(_FORMATS)}.")
        check_file(path)
        try:
            ds = load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:  # noqa: BLE001 - datasets hides the cause; name the file and the shape
            cause = err.__cause__ or err
            raise DatasetError(f"dataset_name={name!r}: datasets could not read this {fmt} file "
                               f"({type(cause).__name__}: {cause}). {DATASET_SHAPE}") from err
    elif path.is_dir():
        ds = load_from_disk(str(path)) if (path / "dataset_info.json").exists() or (path / "state.json").exists() \
            else load_dataset(str(path), config, split=split)
        if hasattr(ds, "keys") and split in ds:
            ds = ds[split]
    else:
        ds = load_dataset(name, config, split=split)
    if prompt_column != "prompt":
        if prompt_column not in ds.column_names:
            raise DatasetError(f"dataset_prompt_column={prompt_column!r} is not a column of {name!r}: "
                               f"{ds.column_names}; set dataset_prompt_column to one of them.")
        ds = ds.rename_column(prompt_column, "prompt")
    if "prompt" not in ds.column_names:
        raise DatasetError(
            f"dataset {name!r} has no 'prompt' column ({ds.column_names}); set dataset_prompt_column to the column "
            "holding the prompts."
        )
    check_prompts(ds["prompt"], source=f"dataset_name={name!r}")
    if system_prompt:
        ds = ds.map(lambda row: {"prompt": as_chat(row["prompt"], system_prompt)})
    return ds


def check_file(path: Path) -> None:
    """Refuse an empty file, and a ``.jsonl`` / ``.json`` file that is not valid JSON, naming the file and the line
    (``datasets`` reports both without them: a bare ``StopIteration`` or ``DatasetGenerationError``)."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.suffix in (".json", ".jsonl", ".csv") else None
    if path.stat().st_size == 0 or (text is not None and not text.strip()):
        raise DatasetError(f"dataset_name='{path}' is an empty file: there is nothing to train on. {DATASET_SHAPE}")
    if path.suffix == ".jsonl" or (path.suffix == ".json" and text.lstrip()[:1] != "["
                                   and "\n{" in text.strip()):  # a .json file may hold JSON lines too
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"dataset_name='{path}', line {number}: not valid JSON ({err.msg} at column "
                                   f"{err.colno}): {line[:120]!r}. {DATASET_SHAPE}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"dataset_name='{path}', line {number}: a JSON {type(row).__name__}, not an object "
                                   f"with a 'prompt' key. {DATASET_SHAPE}")
    elif path.suffix == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"dataset_name='{path}', line {err.lineno}: not valid JSON ({err.msg} at column "
                               f"{err.colno}). {DATASET_SHAPE}") from None


def as_chat(prompt, system_prompt: str) -> list[dict]:
    """``[system, user]`` messages for a text prompt; a prompt that is already a chat is returned as is."""
    if isinstance(prompt, list):
        return prompt
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": str(prompt)}]


def check_prompt_lengths(prompts: Iterable, model: str, limit: int, *, source: str = "the training dataset") -> None:
    """Refuse prompts longer than ``max_prompt_length=limit`` tokens of ``model``'s tokenizer (a chat prompt with
    its chat template and the generation prompt, as the engines see it), naming the rows and the longest."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InputError(f"max_prompt_length={limit!r} must be a whole number of tokens >= 1 (the longest prompt), "
                         "or unset.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = []
    for prompt in prompts:
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(str(prompt))["input_ids"]
        lengths.append(len(ids))
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return
    rows = prompt_rows(over)
    raise DatasetError(
        f"{source}: {len(over)} prompt{'s' if len(over) > 1 else ''} longer than max_prompt_length={limit} tokens "
        f"(rows {rows}, counting from 0; the longest {max(lengths)} tokens). Raise max_prompt_length to "
        f"{max(lengths)} (and plan with it), or filter the dataset to shorter prompts.")

