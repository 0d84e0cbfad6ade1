"""A recipe from the Hub is data, not code: what a shared recipe may ask for, and the flags that allow more.

A recipe written by someone else (an ``hf://`` reference) could otherwise run code on the launching machine in two
ways: ``trust_remote_code: true`` anywhere in it (``model_init_kwargs``, a reward model's or processing class's
kwargs...) executes Python files of a model repository, and a ``reward_funcs`` entry ``package.module:function``
imports any installed module. As in TRL and verl, that decision belongs to the person who runs the command, so a
Hub recipe may do neither unless the command line says so explicitly:

- ``--trust-remote-code`` lets the recipe's ``trust_remote_code`` settings apply;
- ``--allow-reward-module mypkg.rewards`` (repeatable, or comma-separated) lets reward functions of that module
  (and its submodules) be imported. Built-in rewards (``digits``, ``math_answer``, ...) are always allowed.

Local recipes are the user's own files and are not restricted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trl_nrollout.errors import InputError
from trl_nrollout.recipe.hub import HubError

TRUST_FLAG = "--trust-remote-code"
ALLOW_FLAG = "--allow-reward-module"


class UntrustedRecipeError(HubError):
    """A shared recipe asks for something only the person launching it may allow; the message names the key and
    the flag."""


@dataclass(frozen=True)
class RecipeRequests:
    """What a recipe asks for that matters for trust (pure data read from its YAML)."""

    model: str | None
    reward_funcs: tuple[str, ...]
    trust_remote_code_keys: tuple[str, ...]  # dotted paths of keys that set trust_remote_code to true
    reward_modules: tuple[str, ...]  # modules imported by its non-built-in reward functions (and its agent)
    agent: str | None = None  # its agent, 'package.module:function'

    def summary(self) -> str:
        """The lines ``trl-nrollout recipe pull`` shows before a user runs the recipe."""
        lines = [f"model: {self.model or '(default: builtin:tiny-qwen2)'}",
                 f"reward functions: {', '.join(self.reward_funcs) or '(default: digits)'}"]
        if self.agent:
            lines.append(f"agent: {self.agent}")
        if self.trust_remote_code_keys:
            lines.append(f"asks for trust_remote_code at {', '.join(self.trust_remote_code_keys)}: launching it "
                         f"needs {TRUST_FLAG}")
        else:
            lines.append("trust_remote_code: not requested")
        if self.reward_modules:
            flags = " ".join(f"{ALLOW_FLAG} {m}" for m in self.reward_modules)
            lines.append(f"imports reward code from {', '.join(self.reward_modules)}: launching it needs {flags}")
        else:
            lines.append("reward code: built-in rewards only")
        return "\n".join(lines)


def _truthy(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _trust_keys(value, path: str) -> list[str]:
    """Dotted paths under ``value`` of ``trust_remote_code`` keys set to true (JSON strings are looked into too:
    TRL parses dict options given as JSON text)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, sub in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "trust_remote_code" and _truthy(sub):
                found.append(where)
            else:
                found += _trust_keys(sub, where)
    elif isinstance(value, list | tuple):
        for i, sub in enumerate(value):
            found += _trust_keys(sub, f"{path}[{i}]")
    return found


def recipe_requests(data: Mapping) -> RecipeRequests:
    """Read a recipe's model, reward functions, ``trust_remote_code`` keys and reward modules."""
    from trl_nrollout.recipe.rewards import BUILTIN_REWARDS

    rewards = data.get("reward_funcs") or []
    rewards = [rewards] if isinstance(rewards, str) else [str(r) for r in rewards]
    modules = []
    for spec in rewards:
        if spec not in BUILTIN_REWARDS and ":" in spec:
            module = spec.partition(":")[0]
            if module not in modules:
                modules.append(module)
    agent = data.get("agent")
    if agent and ":" in str(agent) and str(agent).partition(":")[0] not in modules:
        modules.append(str(agent).partition(":")[0])  # an agent's module runs code as a reward function's does
    model = data.get("model_name_or_path")
    return RecipeRequests(model=str(model) if model is not None else None, reward_funcs=tuple(rewards),
                          trust_remote_code_keys=tuple(_trust_keys(dict(data), "")), reward_modules=tuple(modules),
                          agent=str(agent) if agent else None)


def module_allowed(module: str, allowed: Iterable[str]) -> bool:
    """``module`` is one of ``allowed`` or a submodule of one (``mypkg.rewards.math`` under ``mypkg.rewards``)."""
    return any(module == a or module.startswith(a + ".") for a in allowed)


def enforce_recipe_trust(data: Mapping, source: str, *, trust_remote_code: bool = False,
                         allow_reward_modules: Sequence[str] = ()) -> RecipeRequests:
    """Refuse a shared recipe (``source``, its reference) that asks for remote code or reward imports the user did
    not allow on the command line. Returns what it asks for."""
    req = recipe_requests(data)
    if req.trust_remote_code_keys and not trust_remote_code:
        keys = ", ".join(req.trust_remote_code_keys)
        raise UntrustedRecipeError(
            f"the shared recipe {source} sets {keys}: true, which would run Python code from a model repository. "
            f"A recipe from the Hub cannot turn this on by itself; if you trust that code, add {TRUST_FLAG} to "
            "your command (or copy the recipe locally with `trl-nrollout recipe pull --out DIR` and review it)."
        )
    refused = [m for m in req.reward_modules if not module_allowed(m, allow_reward_modules)]
    if refused:
        entries = [f"reward_funcs {s}" for s in req.reward_funcs if s.partition(":")[0] in refused]
        entries += [f"agent {req.agent}"] if req.agent and req.agent.partition(":")[0] in refused else []
        raise UntrustedRecipeError(
            f"the shared recipe {source} names {', '.join(entries)}, which would import "
            f"{', '.join(refused)}. A recipe from the Hub may use built-in rewards only unless you allow a module: "
            f"add {' '.join(f'{ALLOW_FLAG} {m}' for m in refused)} to your command if you trust it."
        )
    return req


def parse_recipe_command(argv: Sequence[str]) -> RecipeCommand:
    """The recipe script's own options, taken off its command line in one parse: ``--config RECIPE``,
    ``--trainer grpo|ppo``, ``--trust-remote-code`` and ``--allow-reward-module M`` (``=M``, repeatable,
    comma-separated); everything else is left, in order, for TRL's parser."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one clear error, not argparse's usage and exit
            if ALLOW_FLAG in message:
                raise UntrustedRecipeError(f"{ALLOW_FLAG} needs a module name, e.g. {ALLOW_FLAG} mypkg.rewards.")
            raise InputError(f"the command line: {message}")

    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--trainer", default=None)
    parser.add_argument(TRUST_FLAG, dest="trust_remote_code", action="store_true")
    parser.add_argument(ALLOW_FLAG, dest="allow", action="append", default=[])
    ns, rest = parser.parse_known_args(list(argv))
    allowed = tuple(m.strip() for value in ns.allow for m in value.split(",") if m.strip())
    return RecipeCommand(ns.config, ns.trainer, ns.trust_remote_code, allowed, rest)


@dataclass(frozen=True)
class RecipeCommand:
    """The recipe script's own options (:func:`parse_recipe_command`): ``config`` as given (None: the embedded
    default), ``trainer`` (None: the recipe's, else GRPO), the trust the command line grants, and ``rest``: the
    options for TRL's parser."""

    config: str | None
    trainer: str | None
    trust_remote_code: bool
    allow_reward_modules: tuple[str, ...]
    rest: list[str]
