"""Prompt datasets for recipes: the built-in task, a hub id, a local file (json/jsonl/csv/parquet) or folder."""

from __future__ import annotations

from pathlib import Path

from trl_nrollout.builtin import digits_dataset

_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(name: str, *, split: str = "train", prompt_column: str = "prompt", num_builtin: int = 512,
                 seed: int = 0, config: str | None = None, system_prompt: str | None = None):
    """A ``datasets.Dataset`` with a ``prompt`` column (text or chat messages) plus the other columns.

    ``config``: the dataset's configuration (subset), for a hub id or a dataset folder. ``system_prompt``: turn
    each text prompt into ``[system, user]`` chat messages (for instruction-tuned models)."""
    from datasets import load_dataset, load_from_disk

    if name == "builtin:digits":
        return digits_dataset(num_builtin, seed=seed)
    path = Path(name).expanduser()
    if path.is_file():
        fmt = _FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(f"dataset_name={name!r}: unknown file type {path.suffix!r}; use one of {sorted(_FORMATS)}.")
        ds = load_dataset(fmt, data_files=str(path), split="train")
    elif path.is_dir():
        ds = load_from_disk(str(path)) if (path / "dataset_info.json").exists() or (path / "state.json").exists() \
            else load_dataset(str(path), config, split=split)
        if hasattr(ds, "keys") and split in ds:
            ds = ds[split]
    else:
        ds = load_dataset(name, config, split=split)
    if prompt_column != "prompt":
        if prompt_column not in ds.column_names:
            raise ValueError(f"dataset_prompt_column={prompt_column!r} is not a column of {name!r}: {ds.column_names}.")
        ds = ds.rename_column(prompt_column, "prompt")
    if "prompt" not in ds.column_names:
        raise ValueError(
            f"dataset {name!r} has no 'prompt' column ({ds.column_names}); set dataset_prompt_column to the column "
            "holding the prompts."
        )
    if system_prompt:
        ds = ds.map(lambda row: {"prompt": as_chat(row["prompt"], system_prompt)})
    return ds


def as_chat(prompt, system_prompt: str) -> list[dict]:
    """``[system, user]`` messages for a text prompt; a prompt that is already a chat is returned as is."""
    if isinstance(prompt, list):
        return prompt
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": str(prompt)}]
