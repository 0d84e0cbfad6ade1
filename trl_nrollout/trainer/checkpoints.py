"""Which checkpoint a run resumes from, decided before anything loads, and the rollout stage's own state in it.

transformers' ``Trainer.train`` does not read ``TrainingArguments.resume_from_checkpoint`` (scripts pass it on), so
the recipe resolves it here: ``None`` / ``"false"`` (start afresh), ``"true"`` (the last complete checkpoint in
``output_dir``, as ``Trainer.train(resume_from_checkpoint=True)``) or a path. A checkpoint is complete when its
``trainer_state.json`` and the rollout state (:data:`ROLLOUT_STATE`, written last by the trainer) are there: a
run killed while saving leaves a folder without them, which ``"true"`` skips. It is readable when no file of it is
cut short (:func:`damage`: a disk that filled up, a copy that did not finish): ``"true"`` skips a damaged one with
a warning naming it and resumes from the newest complete and readable one; a path to a damaged one is an error
naming the file. ``NRolloutGRPOTrainer.train(resume_from_checkpoint=True)`` resolves through the same functions.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from pathlib import Path

import torch

from trl_nrollout.errors import InputError
from trl_nrollout.rollout.engines.protocol import JOBS, has

logger = logging.getLogger(__name__)

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


def _safetensors_damage(path: Path) -> str | None:
    """Why a ``.safetensors`` file cannot be loaded (its header says how long it is: 8 bytes of header length, the
    JSON header, then the tensors' bytes up to the largest ``data_offsets`` end), or None."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"it holds {size} bytes, fewer than the 8 of a safetensors header (it was cut short)"
        header_len = int.from_bytes(head, "little")
        if 8 + header_len > size:
            return (f"it holds {size} bytes but its header alone needs {8 + header_len} (it was cut short, or it is "
                    "not a safetensors file)")
        try:
            header = json.loads(fh.read(header_len))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "its header is not a safetensors header (the file is damaged)"
    if 8 + header_len + end > size:
        return f"it holds {size} bytes but its header describes {8 + header_len + end} (it was cut short)"
    return None


def _torch_file_damage(path: Path) -> str | None:
    """Why a ``torch.save`` file (a zip archive: optimizer, scheduler, RNG states, our rank state) cannot be loaded,
    or None; a file in torch's older, non-zip format is not checked."""
    size = path.stat().st_size
    if size == 0:
        return "it is empty (0 bytes)"
    with open(path, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":
            return None
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as err:
        return f"it holds {size} bytes and is not a complete torch.save archive ({err}; it was cut short)"


def _json_damage(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        return f"it is not valid JSON ({err}; it was cut short)"
    return None


def _index_damage(path: Path) -> str | None:
    """A sharded model's ``*.index.json``: valid, and every shard it maps weights to is there."""
    why = _json_damage(path)
    if why:
        return why
    shards = sorted(set(json.loads(path.read_text()).get("weight_map", {}).values()))
    missing = [s for s in shards if not (path.parent / s).is_file()]
    return f"it maps weights to {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} missing" \
        if missing else None


def damaged_file(folder: str | Path) -> tuple[Path, str] | None:
    """The first file of a checkpoint folder (in path order) that is cut short or unreadable, and why: weights
    (``*.safetensors`` and their index), ``torch.save`` files (``*.pt`` / ``*.pth`` / ``*.bin``: optimizer,
    scheduler, RNG and our rank state, DeepSpeed's shards), the trainer's and our state JSON; None when every one
    reads. Only headers, archive directories and the small state files are read, not the tensors."""
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        name = path.name
        if name.endswith(".safetensors"):
            why = _safetensors_damage(path)
        elif name.endswith(".index.json"):
            why = _index_damage(path)
        elif path.suffix in (".pt", ".pth", ".bin"):
            why = _torch_file_damage(path)
        elif name in (TRAINER_STATE, ROLLOUT_STATE):
            why = _json_damage(path)
        else:
            continue
        if why:
            return path, why
    return None


def damage(folder: str | Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from although it is complete (``"<file>: <why>"``, the file's full
    path), or None (see :func:`damaged_file`)."""
    found = damaged_file(folder)
    return None if found is None else f"{found[0]}: {found[1]}"


def last_complete_checkpoint(output_dir: str | Path,
                             skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest complete and readable checkpoint of ``output_dir`` (None when there is none); the complete but
    damaged ones passed over on the way are appended to ``skipped`` as ``(folder, why)``."""
    for folder in reversed(checkpoints(output_dir)):
        if not is_complete(folder):
            continue
        why = damage(folder)
        if why is None:
            return folder
        if skipped is not None:
            skipped.append((folder, why))
    return None


def elastic_restarts() -> int:
    """How many times the launcher restarted this run's processes (torchrun's ``TORCHELASTIC_RESTART_COUNT``: 0
    on the first start; ``accelerate launch --max_restarts N`` allows ``N``)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def resolve_resume(value: str | bool | None, output_dir: str | Path, restarts: int = 0) -> str | None:
    """The checkpoint folder ``resume_from_checkpoint=value`` names, or None to start afresh; an error naming the
    option, the value and a fix when it names nothing a run can resume from. Under ``true`` (or ``auto``) a damaged
    checkpoint newer than the one chosen is named in a warning. ``auto`` (verl's ``resume_mode: auto``): the last
    checkpoint when there is one, else afresh. ``restarts``: how many times the launcher restarted the run's
    processes (torchrun's ``TORCHELASTIC_RESTART_COUNT``, ``accelerate launch --max_restarts``): a restarted run
    with the option unset resumes as under ``auto`` (it would otherwise train from its start again)."""
    if value is None and restarts > 0:
        value = "auto"
        logger.warning("restart %d of this launch (accelerate launch --max_restarts): resuming from the last "
                       "checkpoint in output_dir=%s, if any (resume_from_checkpoint unset; pass false to start "
                       "afresh).", restarts, output_dir)
    if value is None or value is False:
        return None
    text = str(value).strip()
    auto = text.lower() == "auto"
    if value is True or text.lower() in _TRUE or auto:
        skipped: list[tuple[Path, str]] = []
        found = last_complete_checkpoint(output_dir, skipped)
        for folder, why in skipped:
            logger.warning("resume_from_checkpoint=%r: skipping %s, which is damaged (%s); resuming from %s, the "
                           "newest complete and readable checkpoint. Delete the damaged folder, or copy it again "
                           "if it was copied.", value, folder, why, found if found is not None else "none")
        if found is None and auto:
            return None
        if found is None:
            partial = checkpoints(output_dir)
            damaged = [f"{folder.name} ({why})" for folder, why in skipped]
            why = (f"its checkpoint folders are damaged: {'; '.join(damaged)}" if damaged else
                   f"its checkpoint folders ({', '.join(p.name for p in partial)}) are incomplete (the run stopped "
                   "while saving)" if partial else "it holds no checkpoint-N folder")
            raise InputError(f"resume_from_checkpoint={value!r} resumes from the last checkpoint in "
                             f"output_dir={str(output_dir)!r}, but {why}. Point resume_from_checkpoint at a "
                             "checkpoint folder, set output_dir to the run's folder, pass auto (the last "
                             "checkpoint if any, else afresh), or drop the option to start afresh.")
        return str(found)
    if text.lower() in _FALSE:
        return None
    return check_resume_folder(text, output_dir)


def check_resume_folder(path: str | os.PathLike, output_dir: str | Path) -> str:
    """``path`` as given, when it is a complete and readable checkpoint folder; otherwise an error naming the
    folder, what is wrong (the damaged file and why) and a fix."""
    text = str(path)
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
    damaged = damaged_file(folder)
    if damaged is not None:
        older = [p.name for p in checkpoints(folder.parent) if p != folder and is_complete(p)]
        raise InputError(f"resume_from_checkpoint={text!r} is a damaged checkpoint: {damaged[0]} cannot be read "
                         f"({damaged[1]}). Resume from another checkpoint"
                         + (f" ({', '.join(older)} beside it)" if older else "")
                         + ", or with resume_from_checkpoint=true, which takes the newest readable one.")
    return text


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


def rank_state_file(folder: str | os.PathLike, rank: int) -> str:
    """Where rank ``rank`` keeps its own state in a checkpoint folder."""
    return os.path.join(folder, f"nrollout_rank{rank}.pt")


def save_rank_state(folder: str | os.PathLike, rank: int, prompt_rng: torch.Generator, engine=None) -> None:
    """Rank ``rank``'s state beside the model's: the generator that draws DAPO's extra prompts; with rollout ranks
    (``engine`` a :class:`~trl_nrollout.rollout.ranks.client.RemoteEngines`), trainer rank 0's jobs written ahead and
    their samples (:func:`save_jobs_ahead`)."""
    os.makedirs(folder, exist_ok=True)
    torch.save({"prompt_rng": prompt_rng.get_state()}, rank_state_file(folder, rank))
    if has(engine, JOBS):
        save_jobs_ahead(folder, engine.jobs_ahead())


#: trainer rank 0's jobs written ahead with their samples (rollout ranks, ``rollout_lookahead >= 1``)
JOBS_AHEAD = "nrollout_jobs_ahead.pt"


def save_jobs_ahead(folder: str | os.PathLike, jobs: list | None) -> None:
    """The jobs written ahead and their samples (:meth:`~trl_nrollout.rollout.ranks.client.RemoteEngines.jobs_ahead`;
    None: nothing to keep) beside the model's state."""
    if jobs:
        os.makedirs(folder, exist_ok=True)
        torch.save({"jobs": jobs}, os.path.join(folder, JOBS_AHEAD))


def load_jobs_ahead(checkpoint: str | os.PathLike) -> list | None:
    """A checkpoint's jobs written ahead (:func:`save_jobs_ahead`), or None where it has none. Our own file: its
    samples are flat arrays and dataclasses, hence ``weights_only=False``."""
    path = os.path.join(checkpoint, JOBS_AHEAD)
    return torch.load(path, weights_only=False)["jobs"] if os.path.isfile(path) else None


def write_rollout_state(folder: str | os.PathLike, global_step: int, kl_coef: float) -> None:
    """The rollout stage's :data:`ROLLOUT_STATE` (the step and the KL controller's coefficient), written last: a
    folder that holds it is complete."""
    with open(os.path.join(folder, ROLLOUT_STATE), "w") as fh:
        json.dump({"global_step": global_step, "kl_coef": kl_coef}, fh)


def load_rollout_state(checkpoint: str | os.PathLike, rank: int, prompt_rng: torch.Generator,
                       engine=None) -> float | None:
    """Rank ``rank``'s prompt generator restored from ``checkpoint`` where it holds one, and with rollout ranks
    (``engine``) the jobs written ahead it holds (:func:`load_jobs_ahead`); the KL controller's saved coefficient
    (None: the checkpoint has no :data:`ROLLOUT_STATE`, e.g. TRL's)."""
    if has(engine, JOBS) and (jobs := load_jobs_ahead(checkpoint)):
        engine.restore_jobs_ahead(jobs)
    kl_coef = None
    state_file = os.path.join(checkpoint, ROLLOUT_STATE)
    if os.path.isfile(state_file):
        with open(state_file) as fh:
            kl_coef = float(json.load(fh)["kl_coef"])
    rank_file = rank_state_file(checkpoint, rank)
    if os.path.isfile(rank_file):
        prompt_rng.set_state(torch.load(rank_file, weights_only=True)["prompt_rng"])
    return kl_coef
