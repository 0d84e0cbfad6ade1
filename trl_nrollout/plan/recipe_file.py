"""Reading a recipe file: the one function every reader of a recipe YAML goes through (``trl-nrollout plan``, the
recipe script, the Hub's push and pull)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_nrollout.errors import InputError


class RecipeFileError(InputError):
    """A recipe file that cannot be read, is not YAML, or is not a mapping of options."""


def read_recipe(path: str | Path, *, option: str = "--config") -> dict[str, Any]:
    """The options a recipe YAML sets (an empty file: none). Errors name ``option`` (how the user gave the file:
    ``--config``, ``recipe push:``) and the path: an unreadable file, invalid YAML, or YAML that is not a mapping
    of ``key: value`` lines."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise RecipeFileError(f"{option} {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise RecipeFileError(f"{option} {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeFileError(f"{option} {path} must hold a mapping of options (key: value lines), not a "
                              f"{type(data).__name__}.")
    return data
