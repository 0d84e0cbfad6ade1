"""The docs cannot drift: the configuration reference is regenerated and compared, every ```python and ```bash
block of the docs and the README runs as written (offline), and local links point at files that exist."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ACCELERATE_LAUNCH, ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


def test_configuration_reference_is_current():
    """docs/configuration.md and the options table of docs/migrating.md are what scripts/gen_config_docs.py renders
    from the config classes today (its `--check`, run here as a module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts/gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.OUT.read_text() == gen.render(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    assert gen.MIGRATING.read_text() == gen.render_migrating(gen.MIGRATING.read_text()), (
        "docs/migrating.md's options table is stale: run python scripts/gen_config_docs.py")
    assert gen.ARCHITECTURE.read_text() == gen.render_architecture(gen.ARCHITECTURE.read_text()), (
        "docs/architecture.md's refusal table is stale: run python scripts/gen_config_docs.py")


PYTHON_DOCS = [d for d in DOCS if blocks(d, "python")]


@pytest.fixture(scope="module")
def python_block_results(tmp_path_factory) -> tuple[dict, str]:
    """Every doc's ```python blocks, run as one script per doc, all docs in one process (the imports of torch, TRL
    and vLLM paid once; tests/assets/run_python_blocks.py), each in its own folder: ``({doc name: result}, the
    run's output)``."""
    base = tmp_path_factory.mktemp("python_blocks")
    spec = []
    for doc in PYTHON_DOCS:
        folder = base / doc.name
        folder.mkdir()
        (folder / "recipes").symlink_to(ROOT / "recipes")  # docs refer to the repository's recipes
        spec.append({"name": doc.name, "code": "\n\n".join(blocks(doc, "python")), "cwd": str(folder)})
    (base / "spec.json").write_text(json.dumps(spec))
    # one process, forked by the warm launcher (tests/zygote.py: its imports done, its heap frozen)
    proc = subprocess.run([*ACCELERATE_LAUNCH, "--plain", str(ROOT / "tests/assets/run_python_blocks.py"),
                           str(base / "spec.json"), str(base / "results.json")], cwd=base, capture_output=True,
                          text=True, env=_env(), timeout=1200)
    results = json.loads((base / "results.json").read_text()) if (base / "results.json").exists() else {}
    return results, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("doc", PYTHON_DOCS, ids=lambda p: p.name)
def test_python_blocks_run(doc, python_block_results):
    results, output = python_block_results
    assert doc.name in results, f"{doc.name} did not run (the runner stopped before it):\n{output}"
    assert results[doc.name]["ok"], f"{doc.name}:\n{results[doc.name]['error']}\n{output}"


def warm_commands(folder: Path) -> dict:
    """An environment whose ``trl-nrollout`` and ``accelerate launch`` run through the suite's warm launcher
    (tests/zygote.py: a process forked with torch, transformers, TRL and vLLM imported, 8-12 s of imports saved per
    command here): ``trl-nrollout ARGS`` as ``python -m trl_nrollout.cli ARGS`` (the console script's entry point,
    pyproject.toml), ``accelerate launch ARGS`` as the suite's launches run (accelerate's own parser and
    environment); ``accelerate``'s other commands are the real one. The console script and the real ``accelerate
    launch`` themselves: tests/test_train_command.py, tests/test_help.py, tests/test_rollout_ranks.py."""
    from tests.conftest import ACCELERATE_LAUNCH

    bin_dir = folder / "bin"
    bin_dir.mkdir()
    warm = " ".join(shlex.quote(w) for w in ACCELERATE_LAUNCH)
    real = shlex.quote(str(Path(sys.executable).parent / "accelerate"))
    shims = {"trl-nrollout": f'exec {warm} --plain -m trl_nrollout.cli "$@"\n',
             "accelerate": f'if [ "${{1:-}}" = launch ]; then shift; exec {warm} "$@"; fi\nexec {real} "$@"\n'}
    for name, body in shims.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = _env()
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "bash")], ids=lambda p: p.name)
def test_bash_blocks_run(doc, tmp_path):
    """Every doc's ```bash blocks, each as one ``bash -euo pipefail`` script, in a folder with the repository's
    recipes, its ``trl-nrollout`` and ``accelerate launch`` through the warm launcher (:func:`warm_commands`)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = warm_commands(tmp_path)
    for body in blocks(doc, "bash"):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, f"{doc.name}:\n{body}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_local_links_exist(doc):
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_the_readmes_benchmark_figures_are_docs_benchmarks():
    """The README's measured figures are docs/benchmarks.md's (issue 50: one place): the goals table's rollout
    throughput (tiny and medium model) and step time at 512-token prompts, and the padding-free rows' speed-up on
    the long tail, each quoted as the benchmark page states it."""
    readme, bench = (ROOT / "README.md").read_text(), (ROOT / "docs" / "benchmarks.md").read_text()
    rollout = re.search(r"\| rollout at 512-token prompts, n = 12: .*? \| tiny \*\*([\d.]+x)\*\*; medium "
                        r"\*\*([\d.]+x)\*\* \|", bench)
    step = re.search(r"\| step time at 512-token prompts, n = 8: .*? \| \*\*([\d.]+x)\*\*", bench)
    rows = re.search(r"padding-free\s+rows run the micro batch ([\d.]+x) faster than the padded layout", bench)
    assert rollout and step and rows, "docs/benchmarks.md no longer states the figures the README quotes"
    flat = " ".join(readme.split())
    assert f"({rollout[1]}-{rollout[2]} TRL's generation throughput at 512-token prompts and n = 12" in flat
    assert f"at 512-token prompts and n = 8 a whole step took {step[1]} TRL's" in flat
    assert f"at a 512-token cap ran {rows[1]} faster than padded" in flat


def test_every_benchmark_script_is_run_by_make_bench_or_named_apart_and_the_docs_say_which():
    """Each script of benchmarks/ is in run_all.py's BENCHMARKS (``make bench``) or its APART (run alone, with why),
    and a figure the docs say comes from a script "in `run_all.py`" names one of BENCHMARKS."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks/run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"run_all.py", "common.py"}
    assert not set(run_all.BENCHMARKS) & set(run_all.APART)
    assert scripts == set(run_all.BENCHMARKS) | set(run_all.APART), scripts ^ (set(run_all.BENCHMARKS) | set(run_all.APART))
    claims = re.findall(r"benchmarks/(\w+\.py)[^`]*`\s*\(in `run_all\.py`\)", (ROOT / "docs/benchmarks.md").read_text())
    assert claims and all(c in run_all.BENCHMARKS for c in claims), claims
