"""The package's imports keep the architecture docs/architecture.md states: no import cycle between modules, every
import pointing down the layer table of that doc (read from it, so the doc and the code cannot drift), and no
module over 600 lines. Imports are read with ``ast`` from every module of ``trl_nrollout``: at module level, inside
functions (a lazy import is still a dependency: a cycle hidden in a function is still a cycle) and under
``if TYPE_CHECKING:``. Nothing is imported or run.

Mutations tried: ``from trl_nrollout.trainer.stages import Round`` inside a function of ``passes/critic.py`` (an
upward import: the layering test fails naming the line); ``from trl_nrollout.config.options import
NRolloutConfig`` inside a function of ``config/trl_options.py`` (a cycle options -> trl_options -> options: the
cycle test fails naming both edges); a line of the layer table removed from the doc (the table test fails);
``from trl_nrollout.rollout.dispatch.shares import run_agents`` inside a function of ``rollout/engines/build.py``
(an engine importing a driver: the layering test fails naming ``rollout.engines`` -> ``rollout.dispatch``).

The ``rollout`` subpackage is divided: rows ``rollout.engines``, ``rollout.episodes``, ... of the table are parts
of their own (``part``), so an import from one of its folders into a folder above it fails as an import from one
top-level part into another does."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_nrollout"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 600
#: the layer table of docs/architecture.md: a fenced block with the info string ``layers``
TABLE = re.compile(r"^```layers\n(.*?)^```", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Import:
    """One import of a module of the package by another: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@functools.cache
def _lazy_exports(path: Path) -> dict[str, str]:
    """A package's ``_EXPORTS`` (name -> its submodule), the names its ``__getattr__`` imports on first use."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(node.value)
    return {}


def imports(mods: dict[str, Path] | None = None) -> list[Import]:
    """Every import of a package module by another (module level, in functions, under TYPE_CHECKING). ``from P
    import x`` is an import of ``P.x`` where that is a module, or of the module a package's ``_EXPORTS`` loads
    ``x`` from, else of ``P``."""
    mods = modules() if mods is None else mods

    def owner(name: str) -> str | None:  # the package module that defines a dotted name
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                lazy = _lazy_exports(mods[base]) if base in mods else {}
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods
                           else f"{base}.{lazy[alias.name]}" if alias.name in lazy else base for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == PACKAGE.name and (module := owner(target)) and module != name:
                    found.append(Import(name, module, node.lineno))
    return found


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_table(text: str | None = None) -> list[list[str]]:
    """The doc's layers, bottom first: each line names the parts of one layer (a subpackage or a top-level module
    of ``trl_nrollout``; ``__init__`` the package's own), comma-separated; ``#`` starts a comment."""
    blocks = TABLE.findall(DOC.read_text() if text is None else text)
    assert len(blocks) == 1, "docs/architecture.md must hold exactly one ```layers block"
    rows = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines()]
    return [[part.strip() for part in row.split(",")] for row in rows if row]


def divided(table: list[list[str]]) -> set[str]:
    """The subpackages the table divides into parts of their own: ``rollout`` where a row names ``rollout.engines``."""
    return {name.split(".")[0] for row in table for name in row if "." in name}


def part(module: str, table: list[list[str]] | None = None) -> str:
    """The part of the layer table a module belongs to: ``trl_nrollout.rollout.types`` -> ``rollout``. In a
    subpackage the table divides (rows ``rollout.engines``, ``rollout.__init__``, ...), a module of its subpackage
    ``S`` belongs to ``rollout.S`` (``trl_nrollout.rollout.engines.build`` -> ``rollout.engines``), its own modules
    to ``rollout`` and its ``__init__`` to ``rollout.__init__``."""
    names = module.split(".")
    if len(names) == 1:
        return "__init__"
    if names[1] in divided(layer_table() if table is None else table):
        if len(names) == 2:
            return f"{names[1]}.__init__"
        if (PACKAGE / names[1] / names[2]).is_dir():
            return f"{names[1]}.{names[2]}"
    return names[1]


def upward(edges: list[Import], table: list[list[str]]) -> list[Import]:
    """The imports from one part into a part of the same layer or of a layer above it."""
    level = {name: i for i, row in enumerate(table) for name in row}
    where = functools.partial(part, table=table)
    unplaced = {where(m) for e in edges for m in (e.source, e.target)} - set(level)
    assert not unplaced, f"parts not in docs/architecture.md's ```layers table: {sorted(unplaced)}"
    return [e for e in edges if where(e.source) != where(e.target) and level[where(e.target)] >= level[where(e.source)]]


def test_no_import_cycle():
    found = cycles(imports())
    edges = [f"{e.source}:{e.line} -> {e.target}" for c in found for e in imports()
             if e.source in c and e.target in c]
    assert not found, "import cycles (module:line -> module):\n" + "\n".join(edges)


def test_the_layer_table_names_every_part_once():
    table = layer_table()
    listed = [name for row in table for name in row]
    assert len(listed) == len(set(listed)), f"a part listed twice in docs/architecture.md's layers: {listed}"
    present = {part(m, table) for m in modules()}
    assert present - set(listed) == set(), "place these parts in docs/architecture.md's ```layers table"
    assert set(listed) - present == set(), "docs/architecture.md's ```layers table names parts that do not exist"


def test_imports_point_down_the_layers():
    table = layer_table()
    bad = upward(imports(), table)
    assert not bad, ("imports into a part of the same layer or one above (docs/architecture.md's ```layers table, "
                     "bottom first):\n" + "\n".join(f"{e.source}:{e.line} -> {e.target}" for e in bad))


def test_no_module_over_the_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("source, target, kind", [
    ("trl_nrollout.passes.critic", "trl_nrollout.trainer.stages", "upward"),
    ("trl_nrollout.rollout.engines.vllm_group", "trl_nrollout.rollout.dispatch.shares", "upward"),
    ("trl_nrollout.rollout.episodes.tools", "trl_nrollout.rollout.partial.pool", "upward"),
    ("trl_nrollout.rollout.dispatch.balanced", "trl_nrollout.rollout", "upward"),
    ("trl_nrollout.config.trl_options", "trl_nrollout.config.options", "cycle"),
])
def test_the_checks_see_a_lazy_upward_import_and_a_lazy_cycle(source, target, kind, tmp_path):
    """The mutations of the module docstring, on a copy of the two modules' imports: an import inside a function is
    seen, as an upward import and as a cycle."""
    mods = modules()
    extra = mods[source].read_text() + f"\n\ndef _mutation():\n    import {target}  # noqa: F401\n"
    copy = tmp_path / mods[source].name
    copy.write_text(extra)
    edges = imports({**mods, source: copy})
    assert Import(source, target, len(extra.splitlines())) in edges
    if kind == "upward":
        assert any(e.source == source and e.target == target for e in upward(edges, layer_table()))
    else:
        assert any(source in c and target in c for c in cycles(edges))


#: the trainer's numbers of docs/architecture.md (issue 61 item 3): a fenced block with the info string ``numbers``
NUMBERS = re.compile(r"^```numbers\n(.*?)^```", re.DOTALL | re.MULTILINE)


def trainer_self_calls(folder: Path | None = None) -> list[tuple[str, str, int]]:
    """Calls ``self.m(...)`` in a module of ``trainer/`` where ``m`` is defined only in classes of *other* modules of
    ``trainer/``: ``(calling module, method, line)``. A part that calls back into the trainer through ``self`` (a mixin
    reaching into another mixin) shows here; a part's own methods and TRL's do not."""
    folder = folder or PACKAGE / "trainer"
    trees = {path.stem: ast.parse(path.read_text()) for path in sorted(folder.glob("*.py"))}
    defined: dict[str, set[str]] = {}
    for stem, tree in trees.items():
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined.setdefault(item.name, set()).add(stem)
    found = []
    for stem, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and (where := defined.get(node.func.attr)) and stem not in where):
                found.append((stem, node.func.attr, node.lineno))
    return found


def package_classes(cls: type) -> list[str]:
    """The classes of this package in ``cls``'s MRO (the trainer's own class and its mixins or parts' bases)."""
    return [c.__qualname__ for c in cls.__mro__ if c.__module__.startswith("trl_nrollout.")]


def stated_numbers(text: str | None = None) -> dict[str, int]:
    """docs/architecture.md's ```numbers block: ``name: value`` per line."""
    found = NUMBERS.search(DOC.read_text() if text is None else text)
    assert found, "docs/architecture.md has no ```numbers block"
    pairs = (line.split(":", 1) for line in found.group(1).splitlines() if line.strip())
    return {name.strip(): int(value) for name, value in pairs}


def test_the_docs_state_the_trainers_numbers():
    """docs/architecture.md states how many classes of this package the trainers' MROs hold and how many calls of
    ``trainer/`` reach a method of another module through ``self`` (issue 61's measure of a trainer made of parts);
    the doc and the code cannot drift. Mutation tried: a mixin added back to NRolloutGRPOTrainer's bases (both MRO
    numbers change) fails; a ``self._metric(...)`` call added in trainer/logprob_stage.py (count + 1) fails."""
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer
    from trl_nrollout.trainer.ppo import NRolloutPPOTrainer

    measured = {"classes of this package in NRolloutGRPOTrainer's MRO": len(package_classes(NRolloutGRPOTrainer)),
                "classes of this package in NRolloutPPOTrainer's MRO": len(package_classes(NRolloutPPOTrainer)),
                "calls in trainer/ through self to a method of another module": len(trainer_self_calls())}
    assert stated_numbers() == measured, (
        f"docs/architecture.md's ```numbers block says {stated_numbers()}, the code has {measured}: update the block")


def test_self_calls_across_modules_are_seen(tmp_path):
    """The counter sees a call into another module's class through ``self`` and ignores a call to a method of the
    same module."""
    (tmp_path / "a.py").write_text("class A:\n    def f(self):\n        return self.g() + self.h()\n"
                                   "    def h(self):\n        return 1\n")
    (tmp_path / "b.py").write_text("class B:\n    def g(self):\n        return 2\n")
    assert trainer_self_calls(tmp_path) == [("a", "g", 3)]
