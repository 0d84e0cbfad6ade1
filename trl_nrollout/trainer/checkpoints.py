"""Which checkpoint a run resumes from, decided before anything loads, and the rollout stage's own state in it.

transformers' ``Trainer.train`` does not read ``TrainingArguments.resume_from_checkpoint`` (scripts pass it on), so
the recipe resolves it here: ``None`` / ``"false"`` (start afresh), ``"true"`` (the last complete checkpoint in
``output_dir``, as ``Trainer.train(resume_from_checkpoint=True)``) or a path. A checkpoint is complete when its
``trainer_state.json`` and the rollout state (:data:`ROLLOUT_STATE`, written last by the trainer) are there: a
run killed while saving leaves a folder without them, which ``"true"`` skips.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trl_nrollout.errors import InputError

#: What ``NRolloutGRPOTrainer`` writes last into each checkpoint: the KL controller's coefficient (rank 0), and
#: per rank the generator that draws DAPO's extra prompts.
ROLLOUT_STATE = "nrollout_state.json"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_TRUE, _FALSE = ("true", "yes", "1", "last"), ("false", "no", "0", "none", "")


def is_complete(folder: Path) -> bool:
    """A checkpoint a run can resume from: transformers' state is there, and ours where the folder has any."""
    if not (folder / TRAINER_STATE).is_file():
        return False
    ours = list(folder.glob("nrollout_*"))
    return not ours or (folder / ROLLOUT_STATE).is_file()


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, oldest step first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def last_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``output_dir`` (None when there is none)."""
    return next((p for p in reversed(checkpoints(output_dir)) if is_complete(p)), None)


def resolve_resume(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder ``resume_from_checkpoint=value`` names, or None to start afresh; an error naming the
    option, the value and a fix when it names nothing a run can resume from."""
    if value is None or value is False:
        return None
    text = str(value).strip()
    if value is True or text.lower() in _TRUE:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            partial = checkpoints(output_dir)
            why = (f"its checkpoint folders ({', '.join(p.name for p in partial)}) are incomplete (the run stopped "
                   "while saving)" if partial else "it holds no checkpoint-N folder")
            raise InputError(f"resume_from_checkpoint={value!r} resumes from the last checkpoint in "
                             f"output_dir={str(output_dir)!r}, but {why}. Point resume_from_checkpoint at a "
                             "checkpoint folder, set output_dir to the run's folder, or drop the option to start "
                             "afresh.")
        return str(found)
    if text.lower() in _FALSE:
        return None
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise InputError(f"resume_from_checkpoint={text!r} is not a folder; give a checkpoint folder such as "
                         f"{str(output_dir)!r}/checkpoint-100, or true for the last checkpoint in output_dir.")
    if not is_complete(folder):
        inside = checkpoints(folder)
        hint = (f" It holds checkpoints ({', '.join(p.name for p in inside)}): give one of them, or set "
                f"output_dir={text!r} with resume_from_checkpoint=true." if inside else
                " The run that wrote it stopped while saving, or it is not a checkpoint; resume from an earlier one.")
        raise InputError(f"resume_from_checkpoint={text!r} is not a complete checkpoint (no {TRAINER_STATE}"
                         f"{' or ' + ROLLOUT_STATE if (folder / TRAINER_STATE).is_file() else ''}).{hint}")
    return str(folder)


def check_output_dir(output_dir: str | Path) -> None:
    """Create ``output_dir`` and write a file in it now, so that an unwritable folder is an error before a model
    loads (transformers finds out at its first save)."""
    folder = Path(output_dir).expanduser()
    probe = folder / f".trl_nrollout_write_check.{os.getpid()}"  # one per process: the ranks check at once
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise InputError(f"output_dir={str(output_dir)!r} cannot be written ({type(err).__name__}: "
                         f"{err.strerror or err}); choose a folder you can write to, e.g. --output_dir runs/mine."
                         ) from None
