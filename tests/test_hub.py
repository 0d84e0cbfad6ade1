"""Recipes on the Hub (:mod:`trl_nrollout.recipe.hub`), tested offline.

What needs the network is not exercised here: the HTTP download of an uncached file by ``hf_hub_download`` and
the upload requests of ``HfApi.create_repo`` / ``HfApi.create_commit``. Everything around them is: parsing
``hf://`` references, reading files back from a Hugging Face cache laid out the way ``huggingface_hub`` writes it
(``HF_HUB_OFFLINE=1``), the errors when a file is not cached, the card, the commit's ``CommitOperationAdd``
operations (built by ``huggingface_hub`` itself), the calls made on an ``HfApi`` (a recorder stands in for it),
and the ``trl-nrollout recipe push/pull`` commands.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import COMMIT, populate_cache
from trl_nrollout.cli import main
from trl_nrollout.recipe import hub
from trl_nrollout.recipe.hub import HubError, HubRef, RecipeNotFoundError, parse_hub_ref, resolve_config

ROOT = Path(__file__).resolve().parents[1]
COMMIT_2 = "fedcba9876543210fedcba9876543210fedcba98"
WORKED_EXAMPLE = """\
# The worked example of DESIGN.md: 6 processes, TP 2, 60 prompts, n 12.
model_name_or_path: Qwen/Qwen2.5-7B-Instruct
num_processes: 6
rollout_tp_size: 2
train_batch_size: 60
rollout_n: 12
log_prob_micro_batch_size: 48
accelerate_config: accelerate.yaml
"""
ACCELERATE = "distributed_type: MULTI_GPU\nnum_processes: 6\nmixed_precision: bf16\n"
VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "trl": "1.16.0"}


@pytest.fixture
def recipe_folder(tmp_path) -> Path:
    folder = tmp_path / "worked_example"
    folder.mkdir()
    (folder / "config.yaml").write_text(WORKED_EXAMPLE)
    (folder / "accelerate.yaml").write_text(ACCELERATE)
    return folder


class RecordingApi:
    """Stands in for ``huggingface_hub.HfApi``: records the calls, sends nothing."""

    def __init__(self, *args, **kwargs):
        self.calls: list[tuple] = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, list(operations), kwargs))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/{COMMIT}")


# ---------------------------------------------------------------------------------------------- (a) references
@pytest.mark.parametrize("ref, expected", [
    ("hf://user/repo/config.yaml", HubRef("user/repo", "config.yaml")),
    ("hf://user/repo/recipes/grpo/config.yaml", HubRef("user/repo", "recipes/grpo/config.yaml")),
    ("hf://user/repo@v1.0/config.yaml", HubRef("user/repo", "config.yaml", "v1.0")),
    (f"hf://user/repo@{COMMIT}/a/b.yaml", HubRef("user/repo", "a/b.yaml", COMMIT)),
    ("hf://user/repo@refs%2Fpr%2F3/config.yaml", HubRef("user/repo", "config.yaml", "refs/pr/3")),
    ("hf://datasets/user/repo/config.yaml", HubRef("user/repo", "config.yaml", None, "dataset")),
    ("hf://spaces/user/my.repo_x-1@main/c.yml", HubRef("user/my.repo_x-1", "c.yml", "main", "space")),
    ("hf://models/user/repo/config.yaml", HubRef("user/repo", "config.yaml")),
])
def test_parse_hub_ref(ref, expected):
    parsed = parse_hub_ref(ref)
    assert parsed == expected
    assert parse_hub_ref(str(parsed)) == parsed  # str() writes a reference that parses back


@pytest.mark.parametrize("path", ["recipes/configs/default.yaml", "/abs/config.yaml", "config.yaml",
                                  Path("hf://user/repo/x.yaml"), "https://huggingface.co/user/repo"])
def test_plain_paths_are_not_refs(path):
    assert parse_hub_ref(path) is None


@pytest.mark.parametrize("ref, says", [
    ("hf://user/config.yaml", "needs a namespace, a repo name and a file path"),
    ("hf://user/repo", "needs a namespace"),
    ("hf://user/repo/", "needs a namespace"),
    ("hf://user/repo@/config.yaml", "empty revision"),
    ("hf://us er/repo/config.yaml", "namespace 'us er' is not a valid Hub name"),
    ("hf://user/repo/../x.yaml", "'..'"),
])
def test_malformed_refs_say_what_is_missing(ref, says):
    with pytest.raises(HubError, match="hf://") as err:
        parse_hub_ref(ref)
    assert says in str(err.value)


def test_sibling_and_url():
    ref = HubRef("user/repo", "recipes/config.yaml", "v1")
    assert ref.sibling("accelerate.yaml") == HubRef("user/repo", "recipes/accelerate.yaml", "v1")
    assert ref.sibling("../accelerate/zero2.yaml").filename == "accelerate/zero2.yaml"
    with pytest.raises(HubError, match="outside the repo"):
        ref.sibling("../../x.yaml")
    assert ref.url == "https://huggingface.co/user/repo/blob/v1/recipes/config.yaml"
    assert str(HubRef("u/r", "c.yaml", "refs/pr/1", "dataset")) == "hf://datasets/u/r@refs%2Fpr%2F1/c.yaml"


# ---------------------------------------------------------------------------------------------- (b) resolving
def test_local_path_is_returned_as_is(recipe_folder):
    path = recipe_folder / "config.yaml"
    assert resolve_config(path) == path
    assert resolve_config(str(path)) == path


def test_missing_local_path_names_option_value_and_fix(recipe_folder):
    missing = recipe_folder / "confg.yaml"
    with pytest.raises(RecipeNotFoundError) as err:
        resolve_config(str(missing))
    msg = str(err.value)
    assert msg.startswith(f"--config {missing}: no such file")
    assert "hf://user/repo/config.yaml" in msg and f"did you mean {recipe_folder / 'config.yaml'}" in msg
    with pytest.raises(RecipeNotFoundError, match="is a folder"):
        resolve_config(recipe_folder)


def test_cached_file_is_used_offline(offline_cache):
    """A file in the HF cache resolves with HF_HUB_OFFLINE=1: by branch, by tag, by commit; the accelerate config
    the recipe names is fetched from the same commit."""
    from huggingface_hub import scan_cache_dir

    files = {"config.yaml": WORKED_EXAMPLE.encode(), "accelerate.yaml": ACCELERATE.encode()}
    populate_cache(offline_cache, "user/recipe", files)
    populate_cache(offline_cache, "user/recipe", {"config.yaml": b"rollout_n: 4\n"}, commit=COMMIT_2, revision="v2")
    assert {r.repo_id for r in scan_cache_dir(offline_cache).repos} == {"user/recipe"}  # a valid HF cache

    path = resolve_config("hf://user/recipe/config.yaml")
    assert path == offline_cache / "models--user--recipe" / "snapshots" / COMMIT / "config.yaml"
    assert path.read_text() == WORKED_EXAMPLE
    assert (path.parent / "accelerate.yaml").read_text() == ACCELERATE
    assert resolve_config(f"hf://user/recipe@{COMMIT}/config.yaml") == path
    assert resolve_config("hf://user/recipe@v2/config.yaml").read_text() == "rollout_n: 4\n"


def test_dataset_repo_ref_reads_its_own_cache_folder(offline_cache):
    populate_cache(offline_cache, "user/recipes", {"grpo/config.yaml": b"rollout_n: 8\n"}, repo_type="dataset")
    path = resolve_config("hf://datasets/user/recipes/grpo/config.yaml")
    assert "datasets--user--recipes" in path.parts and path.read_text() == "rollout_n: 8\n"


def test_uncached_file_offline_says_how_to_fetch_it(offline_cache):
    populate_cache(offline_cache, "user/recipe", {"config.yaml": WORKED_EXAMPLE.encode()})  # no accelerate.yaml
    with pytest.raises(RecipeNotFoundError) as err:
        resolve_config("hf://user/other/config.yaml")
    msg = str(err.value)
    assert msg.startswith("--config hf://user/other/config.yaml is not cached")
    assert str(offline_cache) in msg and "HF_HUB_OFFLINE=1" in msg
    assert "trl-nrollout recipe pull hf://user/other/config.yaml" in msg and "hf download user/other" in msg
    # The recipe is cached but the accelerate config it names is not: the error names both.
    with pytest.raises(RecipeNotFoundError, match="names accelerate_config: accelerate.yaml") as err:
        resolve_config("hf://user/recipe/config.yaml")
    assert resolve_config("hf://user/recipe/config.yaml", with_accelerate=False).is_file()


def test_local_files_only_without_offline_mode(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # local_files_only alone keeps it off the network
    cache = tmp_path / "cache"
    with pytest.raises(RecipeNotFoundError, match="not cached .* local_files_only is set"):
        resolve_config("hf://user/none/config.yaml", cache_dir=cache, local_files_only=True)


def test_environment_variables_in_a_fresh_process(tmp_path):
    """The real route: HF_HOME and HF_HUB_OFFLINE=1 set before ``huggingface_hub`` is imported, through
    ``trl-nrollout recipe pull``. A cached recipe is copied with its accelerate config; an uncached one fails."""
    home = tmp_path / "hf_home"
    populate_cache(home / "hub", "user/recipe", {"config.yaml": WORKED_EXAMPLE.encode(),
                                                 "accelerate.yaml": ACCELERATE.encode()})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "trl_nrollout.cli", "recipe", "pull"]
    proc = subprocess.run([*cmd, "hf://user/recipe/config.yaml", "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    paths = proc.stdout.split("\n\n")[0].split()  # then what the recipe asks for (tests/test_recipe_trust.py)
    assert paths == [str(out / "config.yaml"), str(out / "accelerate.yaml")]
    assert "model: Qwen/Qwen2.5-7B-Instruct" in proc.stdout
    assert (out / "config.yaml").read_text() == WORKED_EXAMPLE and (out / "accelerate.yaml").read_text() == ACCELERATE

    proc = subprocess.run([*cmd, "hf://user/uncached/config.yaml"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "hf://user/uncached/config.yaml is not cached" in proc.stderr
    assert str(home / "hub") in proc.stderr and "HF_HUB_OFFLINE=1 forbids downloading it" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_pull_prints_cached_path(offline_cache, capsys):
    populate_cache(offline_cache, "user/recipe", {"config.yaml": b"rollout_n: 4\n"})
    assert main(["recipe", "pull", "hf://user/recipe/config.yaml"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == str(offline_cache / "models--user--recipe/snapshots" / COMMIT /
                                                          "config.yaml")


def test_cli_plan_reads_a_hub_recipe_from_the_cache(offline_cache, capsys):
    """`trl-nrollout plan --config hf://...` plans a recipe shared on the Hub (here from a pre-populated cache)."""
    recipe = b"num_processes: 6\nrollout_tp_size: 2\ntrain_batch_size: 60\nrollout_n: 12\n"
    populate_cache(offline_cache, "user/worked", {"config.yaml": recipe})
    assert main(["plan", "--config", "hf://user/worked/config.yaml", "--no-memory", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_engines"] == 3 and plan["total_samples"] == 720
    assert main(["plan", "--config", "hf://user/missing/config.yaml", "--no-memory"]) == 2
    assert "hf://user/missing/config.yaml" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- (c) the card
def test_card_of_the_worked_example(recipe_folder):
    from huggingface_hub import ModelCard

    table, notes = hub.plan_table(recipe_folder / "config.yaml")
    assert notes == []
    card = hub.build_model_card(yaml.safe_load(WORKED_EXAMPLE), table, VERSIONS, repo_id="me/worked",
                                recipe_text=WORKED_EXAMPLE)
    data = ModelCard(card).data  # the front matter parses as huggingface_hub reads it
    assert data.tags == ["trl", "trl-nrollout", "grpo", "recipe"] and data.library_name == "trl-nrollout"
    for text in ("## What it trains", "The worked example of DESIGN.md", "`Qwen/Qwen2.5-7B-Instruct`",
                 "trl-nrollout train --config hf://me/worked/config.yaml",
                 "accelerate launch -m trl_nrollout.recipe.run --config hf://me/worked/config.yaml",
                 "trl-nrollout recipe pull hf://me/worked/config.yaml --out recipe/",
                 "accelerate launch --config_file recipe/accelerate.yaml -m trl_nrollout.recipe.run "
                 "--config recipe/config.yaml", "`recipes/grpo.py` in place of `-m trl_nrollout.recipe.run`",
                 "rollout engines              6 / rollout_tp_size=2 = 3", "3 x 240 = 720",
                 "| python | 3.11.7 |", "| trl | 1.16.0 |"):
        assert text in card, text


def test_card_without_plan_fields_says_so(tmp_path):
    (tmp_path / "config.yaml").write_text("model_name_or_path: builtin:tiny-qwen2\nnum_generations: 8\n")
    table, notes = hub.plan_table(tmp_path / "config.yaml")
    assert table is None and "train_batch_size is required" in notes[0]
    card = hub.build_model_card({"num_generations": 8}, table, VERSIONS, notes=notes)
    assert "No plan table" in card and "train_batch_size is required" in card
    assert "No plan table" in hub.build_model_card({}, None, VERSIONS)


def test_card_notes_an_assumed_process_count(tmp_path):
    (tmp_path / "config.yaml").write_text("train_batch_size: 8\nrollout_n: 4\n")
    table, notes = hub.plan_table(tmp_path / "config.yaml")
    assert "samples per step             1 x 32 = 32" in table and "assumes 1 process" in notes[0]


def test_collect_versions_lists_the_stack():
    versions = hub.collect_versions()
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"torch", "transformers", "trl", "accelerate", "trl_nrollout"} <= versions.keys()


# ---------------------------------------------------------------------------------------------- (c) pushing
def test_push_makes_one_repo_and_one_commit(recipe_folder):
    api = RecordingApi()
    plan = hub.push_recipe(recipe_folder, "me/worked", private=True, api=api, versions=VERSIONS, token="hf_x")
    assert [c[0] for c in api.calls] == ["create_repo", "create_commit"]
    _, repo_id, kwargs = api.calls[0]
    assert repo_id == "me/worked" and kwargs == {"exist_ok": True, "private": True, "repo_type": "model",
                                                 "token": "hf_x"}
    _, repo_id, operations, kwargs = api.calls[1]
    assert repo_id == "me/worked" and kwargs["commit_message"] == plan.commit_message
    uploaded = {op.path_in_repo: op.path_or_fileobj for op in operations}
    assert list(uploaded) == ["config.yaml", "accelerate.yaml", "README.md"]
    assert uploaded["config.yaml"] == WORKED_EXAMPLE.encode()
    assert uploaded["accelerate.yaml"] == ACCELERATE.encode()
    card = uploaded["README.md"].decode()
    assert card == plan.card and "3 x 240 = 720" in card and "6 / rollout_tp_size=2 = 3" in card
    assert plan.commit_url.endswith(COMMIT)


def test_commit_operations_are_real_requests(recipe_folder):
    """The operations are ``huggingface_hub.CommitOperationAdd`` objects, which compute the size and sha256 the
    upload's preupload request sends; only sending it needs the network."""
    from huggingface_hub import CommitOperationAdd

    plan = hub.push_recipe(recipe_folder, "me/worked", dry_run=True, versions=VERSIONS)
    ops = plan.operations()
    assert all(isinstance(op, CommitOperationAdd) for op in ops)
    for op, (path, content) in zip(ops, plan.files):
        assert op.path_in_repo == path and op.upload_info.size == len(content)
        assert op.upload_info.sha256 == hashlib.sha256(content).digest()


def test_dry_run_sends_nothing(recipe_folder, monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a dry run must not build an HfApi")

    monkeypatch.setattr(huggingface_hub, "HfApi", no_network)
    plan = hub.push_recipe(recipe_folder, "me/worked", dry_run=True, versions=VERSIONS)
    assert plan.repo_id == "me/worked" and plan.commit_url is None
    assert [(p, len(c)) for p, c in plan.files][:2] == [("config.yaml", len(WORKED_EXAMPLE)),
                                                        ("accelerate.yaml", len(ACCELERATE))]
    assert "3 x 240 = 720" in plan.card and "config.yaml" in plan.summary()


def test_cli_push_dry_run_prints_the_plan(recipe_folder, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any network use would fail
    assert main(["recipe", "push", str(recipe_folder), "me/worked", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run: nothing uploaded\nrepo: me/worked (public model repo)")
    for text in ("config.yaml", "accelerate.yaml", "README.md", "library_name: trl-nrollout",
                 "6 / rollout_tp_size=2 = 3", "3 x 240 = 720"):
        assert text in out


def test_cli_push_uses_hfapi(recipe_folder, monkeypatch, capsys):
    import huggingface_hub

    apis = []
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **kw: apis.append((RecordingApi(), kw)) or apis[-1][0])
    assert main(["recipe", "push", str(recipe_folder), "me/worked", "--private", "--token", "hf_x"]) == 0
    (api, kwargs), = apis
    assert kwargs == {"token": "hf_x"} and api.calls[0][2]["private"] is True
    assert f"pushed: https://huggingface.co/me/worked/commit/{COMMIT}" in capsys.readouterr().out


def test_push_errors(recipe_folder, tmp_path, capsys):
    with pytest.raises(HubError, match="needs a namespace"):
        hub.push_recipe(recipe_folder, "worked", dry_run=True)
    with pytest.raises(HubError, match="is invalid"):
        hub.push_recipe(recipe_folder, "me/bad name", dry_run=True)
    (recipe_folder / "accelerate.yaml").unlink()
    with pytest.raises(RecipeNotFoundError, match="names accelerate_config: accelerate.yaml"):
        hub.push_recipe(recipe_folder, "me/worked", dry_run=True)
    (recipe_folder / "config.yaml").write_text("accelerate_config: ../accelerate.yaml\n")
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE)
    with pytest.raises(HubError, match="copy it next to the recipe"):
        hub.push_recipe(recipe_folder, "me/worked", dry_run=True)

    class Unreachable(RecordingApi):
        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("no route to host")

    (recipe_folder / "config.yaml").write_text(WORKED_EXAMPLE.replace("accelerate_config: accelerate.yaml\n", ""))
    with pytest.raises(HubError, match="push to me/worked failed: ConnectionError: no route to host"):
        hub.push_recipe(recipe_folder, "me/worked", api=Unreachable())
    assert main(["recipe", "push", str(tmp_path / "nowhere"), "me/worked", "--dry-run"]) == 2
    assert "error: recipe push" in capsys.readouterr().err


def test_push_a_single_yaml_file(recipe_folder):
    (recipe_folder / "other.yaml").write_text("num_generations: 8\n")
    plan = hub.push_recipe(recipe_folder / "other.yaml", "me/other", dry_run=True, versions=VERSIONS)
    assert [p for p, _ in plan.files] == ["other.yaml", "README.md"]
    assert "hf://me/other/other.yaml" in plan.card and "No plan table" in plan.card
    plan = hub.push_recipe(recipe_folder / "config.yaml", "me/worked", dry_run=True, versions=VERSIONS)
    assert [p for p, _ in plan.files] == ["config.yaml", "accelerate.yaml", "README.md"]  # the named config too


def test_push_the_shipped_default_recipe():
    plan = hub.push_recipe(ROOT / "recipes" / "configs" / "default.yaml", "me/default", dry_run=True,
                           versions=VERSIONS)
    assert [p for p, _ in plan.files] == ["default.yaml", "README.md"]
    assert "## Rollout plan" in plan.card and "hf://me/default/default.yaml" in plan.card


# ---------------------------------------------------------------------------------------------- round trip
def test_round_trip_push_then_load_by_reference(recipe_folder, offline_cache):
    """Push to the recorder, lay the committed files out as a download would leave them in the cache, load the
    recipe back by its ``hf://`` reference (offline), and find the original YAML and accelerate config."""
    api = RecordingApi()
    hub.push_recipe(recipe_folder, "me/worked", api=api, versions=VERSIONS)
    operations = api.calls[1][2]
    populate_cache(offline_cache, "me/worked", {op.path_in_repo: op.path_or_fileobj for op in operations})

    path = resolve_config("hf://me/worked/config.yaml")
    assert yaml.safe_load(path.read_text()) == yaml.safe_load((recipe_folder / "config.yaml").read_text())
    assert path.read_bytes() == (recipe_folder / "config.yaml").read_bytes()
    assert (path.parent / "accelerate.yaml").read_text() == ACCELERATE
    assert "hf://me/worked/config.yaml" in (path.parent / "README.md").read_text()
    # ... and the loaded recipe plans the same as the original.
    assert hub.plan_table(path) == hub.plan_table(recipe_folder / "config.yaml")
