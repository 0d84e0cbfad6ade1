"""The engine protocol holds: the drivers use nothing of an engine but what ``rollout/engines/protocol.py`` names, read
no private attribute of one, and every engine has every member of the core and of the capabilities it declares.

How an engine object is recognised (in every package module outside the engines' own, :data:`ENGINE_MODULES`):

- any attribute ``.rollout_engine`` (``self.rollout_engine``, ``trainer.rollout_engine``);
- the rollout rank's ``state.engine`` (an attribute ``engine`` of a name or attribute ending in ``state``; also
  ``state["engine"]``, ``state.get("engine")``, ``state.pop("engine")``);
- a name ``engine`` inside a function that takes it as a parameter or binds it from one of the above, from a call of
  ``build_engine`` / ``_build_engine`` (or ``engine_factory``), or from an engine class; a function that binds it
  from anything else (``trainer/ppo.py``'s DeepSpeed engine) holds no engine under that name, and a nested function
  sees its enclosing function's.

A use is an attribute read or write on such an object, or a ``getattr`` / ``hasattr`` / ``setattr`` of it with a
literal name. Mutations these tests catch (each tried once): ``self.rollout_engine.llm`` in ``trainer/grpo.py``
(not a protocol member: (a) fails); ``engine._tp_group`` in ``rollout/ranks/reader.py`` (private: (b) fails);
``gather_tp`` deleted from ``HFEngine`` or ``ABORT`` added to its capabilities (``run_partial`` missing: (c) fails);
``isinstance(self.rollout_engine, HFEngine)`` back in ``trainer/grpo.py`` (the isinstance test fails).

The drivers live above the engines (``rollout/dispatch/``): an engine class that grows a driver method again
(``run_partial`` back on ``VLLMEngineGroup``) fails :func:`test_engines_carry_no_drivers`, and a driver that an
engine without the capability reaches is refused with the capability's name (:func:`test_drivers_refuse_an_engine_
without_the_capability`).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import trl_nrollout
from trl_nrollout.rollout.engines import protocol as ep

PACKAGE = Path(trl_nrollout.__file__).parent
#: the engines' own modules: they may use anything of their engine
ENGINE_MODULES = {"rollout/engines/vllm_group.py", "rollout/engines/vllm_settings.py",
                  "rollout/engines/vllm_weights.py", "rollout/engines/vllm_process.py", "rollout/engines/hf_engine.py", "rollout/ranks/client.py",
                  "rollout/engines/protocol.py"}
ENGINE_CLASSES = ("VLLMEngineGroup", "HFEngine", "RemoteEngines")
#: uses allowed although they are not protocol members (each says why and until when)
ALLOWED: dict[tuple[str, str], str] = {}
ENGINE_CALLS = {"build_engine", "_build_engine", "engine_factory", *ENGINE_CLASSES}


def _engine_expr(node: ast.AST) -> bool:
    """Whether ``node`` is an engine by the first two rules (or a call that builds one)."""
    if isinstance(node, ast.Attribute):
        if node.attr == "rollout_engine":
            return True
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        return node.attr == "engine" and name.endswith("state")
    if isinstance(node, ast.Subscript):  # (the rollout rank's state as a dict: state["engine"])
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        return name.endswith("state") and isinstance(node.slice, ast.Constant) and node.slice.value == "engine"
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("get", "pop") and isinstance(f, ast.Attribute) and node.args:  # state.get("engine")
            key = node.args[0]
            return (isinstance(key, ast.Constant) and key.value == "engine"
                    and ast.unparse(f.value).split(".")[-1].endswith("state"))
        return name in ENGINE_CALLS
    return False


def _bindings(fn: ast.AST) -> list[ast.AST | None]:
    """The values a function binds to the name ``engine`` in its own body (not in nested functions); None where
    the value is not known (a tuple unpacked from one expression)."""
    out: list[ast.AST | None] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    if isinstance(target, ast.Name) and target.id == "engine":
                        out.append(child.value)
                    elif isinstance(target, ast.Tuple):
                        for k, elt in enumerate(target.elts):
                            if isinstance(elt, ast.Name) and elt.id == "engine":
                                value = child.value
                                out.append(value.elts[k] if isinstance(value, ast.Tuple) else None)
            elif isinstance(child, ast.NamedExpr) and child.target.id == "engine":
                out.append(child.value)
            visit(child)

    visit(fn)
    return out


def engine_uses(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of every use of an engine object in a module's ``source`` (the rule above)."""
    tree = ast.parse(source)
    uses: list[tuple[int, str]] = []

    def is_engine(node: ast.AST, named: bool) -> bool:
        return _engine_expr(node) or (named and isinstance(node, ast.Name) and node.id == "engine")

    def walk(node: ast.AST, named: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = named
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = child.args
                params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
                values = [v for v in _bindings(child) if not (isinstance(v, ast.Constant) and v.value is None)]
                if "engine" in params or (values and all(v is not None and _engine_expr(v) for v in values)):
                    inner = True
                elif values:  # bound from something else: not one of ours here
                    inner = False
            elif isinstance(child, ast.ClassDef):
                inner = False
            if isinstance(child, ast.Attribute) and is_engine(child.value, inner):
                uses.append((child.lineno, child.attr))
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id in ("getattr", "hasattr", "setattr") and len(child.args) >= 2
                    and is_engine(child.args[0], inner) and isinstance(child.args[1], ast.Constant)):
                uses.append((child.lineno, str(child.args[1].value)))
            walk(child, inner)

    walk(tree, False)
    return uses


def _package_uses() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ENGINE_MODULES:
            continue
        for line, attr in engine_uses(path.read_text()):
            found.setdefault((rel, attr), []).append(line)
    return found


def test_drivers_use_only_protocol_members():
    """(a) Every member of an engine that a module outside the engines uses is named by the protocol (the core or
    a capability), or allowed in :data:`ALLOWED`."""
    members = ep.engine_members()
    unknown = {f"{rel}:{lines[0]} .{attr}" for (rel, attr), lines in _package_uses().items()
               if attr not in members and (rel, attr) not in ALLOWED and not attr.startswith("_")}
    assert not unknown, (f"engine members used outside the engines that rollout/engines/protocol.py does not name: "
                         f"{sorted(unknown)}; add them to the protocol (core or a capability) or use one it names")


def test_no_private_reads_of_an_engine():
    """(b) No module outside the engines reads a private (``_x``) attribute of an engine (but :data:`ALLOWED`)."""
    private = {f"{rel}:{lines[0]} .{attr}" for (rel, attr), lines in _package_uses().items()
               if attr.startswith("_") and not attr.startswith("__") and (rel, attr) not in ALLOWED}
    assert not private, f"private engine attributes read outside the engines: {sorted(private)}"


def test_the_scan_sees_the_engine_uses():
    """The rule finds uses through each form it names (a scan that found nothing would pass the two tests above),
    and leaves a differently bound ``engine`` alone."""
    source = '''
def a(self):
    self.rollout_engine.sleep()
    engine = self.rollout_engine
    engine.gather_tp(1)
    getattr(engine, "_hidden", None)
def b(state):
    state.engine.load_buckets([])
    def inner():
        return state.engine.dtype
def c(engine):
    return engine.rank
def d(self):
    engine = self._critic_engine()
    engine.backward(1)
'''
    assert sorted(a for _, a in engine_uses(source)) == ["_hidden", "dtype", "gather_tp", "load_buckets", "rank",
                                                         "sleep"]
    uses = _package_uses()
    assert ("rollout/dispatch/rules.py", "generate_expanded") in uses and ("rollout/ranks/serve.py", "load_buckets") in uses


def _instance_attributes(cls: type) -> set[str]:
    """Names a class (and its package bases) assigns on ``self`` in its methods, and annotates at class level."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("trl_nrollout"):
            continue
        tree = ast.parse(inspect.getsource(base))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
        names.update(getattr(base, "__annotations__", {}))
    return names


def _engine_classes() -> list[type]:
    from trl_nrollout.rollout.engines.hf_engine import HFEngine
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.ranks.client import RemoteEngines

    return [VLLMEngineGroup, HFEngine, RemoteEngines]


@pytest.mark.parametrize("cls", _engine_classes(), ids=lambda c: c.__name__)
def test_each_engine_implements_what_it_declares(cls):
    """(c) Every engine has each member of the core and of each capability it declares in ``capabilities`` (a
    capability it does not declare, it does not have to have: callers check ``capabilities``, not the class)."""
    declared = cls.capabilities
    assert isinstance(declared, frozenset) and declared <= set(ep.CAPABILITIES), (cls.__name__, declared)
    have = set(dir(cls)) | _instance_attributes(cls)
    wanted = {"core": ep.protocol_members(ep.RolloutEngine)}
    wanted.update({c: ep.protocol_members(ep.CAPABILITIES[c]) for c in declared})
    missing = {name: sorted(members - have) for name, members in wanted.items() if members - have}
    assert not missing, f"{cls.__name__} lacks protocol members: {missing}"


def test_callers_check_capabilities_not_classes():
    """No module outside the engines asks ``isinstance(x, <engine class>)``: it checks a capability."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ENGINE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2 and any(isinstance(n, ast.Name) and n.id in ENGINE_CLASSES
                                                    for n in ast.walk(node.args[1]))):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"isinstance checks of engine classes (check engine.capabilities instead): {found}"


#: engine members with a driver's name that are not drivers (each says why)
NOT_DRIVERS: dict[tuple[str, str], str] = {
    ("RemoteEngines", "run_job_episodes"): "the rollout ranks' proxy writes one job; the drivers run on the ranks",
}


def _driver_name(name: str) -> bool:
    """A driver's name: an episode runner (``run_*``) or a dispatch twin (``*_balanced``, ``balanced_*``)."""
    return name.startswith("run_") or name.endswith("_balanced") or name.startswith("balanced_")


@pytest.mark.parametrize("cls", _engine_classes(), ids=lambda c: c.__name__)
def test_engines_carry_no_drivers(cls):
    """An engine class (and its package bases) defines no driver: what runs episodes, dispatch or a partial pool
    over an engine lives in ``rollout/dispatch/`` and takes the engine as an argument (issue 61 item 2), so a new
    engine gets every driver by implementing the protocol. The protocol names no driver either.
    Mutation tried: ``run_partial`` (or ``generate_balanced``) put back as a method of ``VLLMEngineGroup`` -> fails."""
    members = {name for base in cls.__mro__ if base.__module__.startswith("trl_nrollout") for name in vars(base)}
    drivers = sorted(n for n in members if _driver_name(n) and (cls.__name__, n) not in NOT_DRIVERS)
    assert not drivers, (f"{cls.__name__} carries driver methods {drivers}: move them to rollout/dispatch/ as "
                         f"functions of the engine over the protocol")
    named = {n for n in ep.engine_members() if _driver_name(n)}
    assert named <= {n for _, n in NOT_DRIVERS}, f"the engine protocol names drivers: {sorted(named)}"


class _Bare:
    """An engine with the core only (the HF engine's capabilities but for its prefill counts)."""

    capabilities = frozenset()
    balances_job = False
    rank, tp_ranks, engine_index = 0, [0], 0


def test_drivers_refuse_an_engine_without_the_capability():
    """Each driver checks the capabilities it needs before it uses them: an engine without a request loop or an
    abort (the HF engine) is refused with the missing capability's name, not an AttributeError deep inside.
    Mutation tried: the ``require`` call removed from ``run_partial`` -> an AttributeError (``ready``), test fails."""
    from trl_nrollout.rollout.dispatch import balanced, shares
    from trl_nrollout.rollout.types import SamplingOptions

    opts, engine = SamplingOptions(max_tokens=2), _Bare()
    calls = [lambda: shares.run_partial(engine, [], 1, opts, 0),
             lambda: shares.run_partial_agents(engine, [], 1, opts, 0, None, 1, owns=lambda g: True),
             lambda: shares.run_agents(engine, [[1]], 1, opts, lambda r: None, None, 1),
             lambda: balanced.run_partial_balanced(engine, [], 1, opts, 0, []),
             lambda: balanced.balanced_calls(engine).__enter__()]
    for call in calls:
        with pytest.raises(TypeError, match=r"needs an engine with \['(requests|abort)"):
            call()
