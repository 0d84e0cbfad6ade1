"""Prompt datasets for recipes: the built-in task, a hub id, a local file (json/jsonl/csv/parquet) or folder."""

from __future__ import annotations

from pathlib import Path

from trl_nrollout.builtin import digits_dataset

_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(name: str, *, split: str = "train", prompt_column: str = "prompt", num_builtin: int = 512,
                 seed: int = 0):
    """A ``datasets.Dataset`` with a ``prompt`` column (text or chat messages) plus the other columns."""
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
            else load_dataset(str(path), split=split)
        if hasattr(ds, "keys") and split in ds:
            ds = ds[split]
    else:
        ds = load_dataset(name, split=split)
    if prompt_column != "prompt":
        if prompt_column not in ds.column_names:
            raise ValueError(f"dataset_prompt_column={prompt_column!r} is not a column of {name!r}: {ds.column_names}.")
        ds = ds.rename_column(prompt_column, "prompt")
    if "prompt" not in ds.column_names:
        raise ValueError(
            f"dataset {name!r} has no 'prompt' column ({ds.column_names}); set dataset_prompt_column to the column "
            "holding the prompts."
        )
    return ds
