"""The docs cannot drift: the configuration reference is regenerated and compared, every ```python and ```bash
block of the docs and the README runs as written (offline), and local links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

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
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gen_config_docs.py"), "--check"], capture_output=True,
                          text=True, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "python")], ids=lambda p: p.name)
def test_python_blocks_run(doc, tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")  # docs refer to the repository's recipes
    code = "\n\n".join(blocks(doc, "python"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert proc.returncode == 0, f"{doc.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "bash")], ids=lambda p: p.name)
def test_bash_blocks_run(doc, tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    for body in blocks(doc, "bash"):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, capture_output=True, text=True,
                              env=_env(), timeout=600)
        assert proc.returncode == 0, f"{doc.name}:\n{body}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_local_links_exist(doc):
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
