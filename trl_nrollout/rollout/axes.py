"""The rollout's four axes, and every combination of them that is refused today, in one table.

A rollout step is one choice on each axis:

- **placement**, where the engines live: colocated with the trainers (``rollout_ranks=0``), or on rollout ranks;
- **dispatch**, how work reaches them: a registered :class:`DispatchRule` (``rollout_dispatch``; the built-ins in
  :mod:`trl_nrollout.rollout.dispatch.rules`: fixed shares, ``"shares"``, or one balanced queue, ``"balanced"``);
- **end**, when the step's rollout ends: every sample done, or partial (``rollout_partial=True``: the first groups
  to finish train, the rest stay in flight across weight syncs);
- **episode**, what one sample is: one completion, TRL tools turn by turn or request by request, an environment
  (``environment_factory``), a ``rollout_func``, a prompt with images, an agent written in any framework
  (``agent=``, through an OpenAI-compatible endpoint).

The engine (``rollout_backend``) is not an axis but the machine: the HF engine (transformers ``generate`` on the
training model) cannot abort or stream a request, so it cannot run what needs a request-level loop. :data:`REFUSALS`
(:func:`refusals`: :data:`AXIS_REFUSALS` and each registered :class:`DispatchRule`'s rows) lists each refused
pair once, with its kind: ``machine`` (what the machine cannot do), ``one axis`` (two choices of one axis, as two
dispatches would be: not a combination of axes), ``by definition`` (what the option means excludes
it) or ``not yet`` (a part to build); docs/architecture.md's table is generated from it
(``scripts/gen_config_docs.py``), and tests/test_axes.py checks that each row is refused where it says, with a
message naming both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from trl_nrollout.errors import InputError

#: the axes and their choices (the option that selects each)
AXES: dict[str, dict[str, str]] = {
    "placement": {"colocated": "rollout_ranks=0", "rollout ranks": "rollout_ranks>0"},
    "dispatch": {"shares": "rollout_dispatch='shares'", "balanced": "rollout_dispatch='balanced'"},
    "end": {"whole": "rollout_partial=False", "partial": "rollout_partial=True"},
    "episode": {"one completion": "(default)", "tools, turn by turn": "tools, rollout_multi_turn='turns'",
                "tools, request by request": "tools, rollout_multi_turn='requests'",
                "environment": "environment_factory", "custom": "rollout_func", "images": "image prompts",
                "agent": "agent= (an OpenAI-compatible endpoint)"},
}



@dataclass(frozen=True)
class Refusal:
    """One refused pair: ``first`` with ``second`` (each an option as a user writes it), the ``kind`` (machine / one
    axis / by definition / not yet), ``where`` the check lives (a function or method, for the tests and for whoever lifts
    it) and ``why`` in a few words."""

    first: str
    second: str
    kind: str
    where: str
    why: str


#: the refused pairs that no dispatch rule declares (a rule's own rows: :meth:`DispatchRule.refusals`)
AXIS_REFUSALS: tuple[Refusal, ...] = (
    Refusal("rollout_ranks", "rollout_backend='hf'", "machine", "checks.rollout_ranks_refusal",
            "the HF engine generates with the training model itself: it cannot live on another process"),
    Refusal("rollout_partial=True", "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
            "the HF engine cannot abort a request, so a sample cannot stop and continue later"),
    Refusal("rollout_multi_turn='requests'", "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
            "the HF engine has no request-level loop: samples cannot re-enter it one by one"),
    Refusal("agent", "rollout_backend='hf'", "machine", "agents.agent_refusal",
            "the HF engine has no request-level loop: an agent's calls cannot join it one by one"),
    Refusal("agent", "environment_factory or rollout_func", "one axis", "agents.agent_refusal",
            "two choices of the episode axis: each is the episode's own loop, as the agent is (an agent builds its "
            "environment itself from the row; tools= compose: the agent gets them)"),
    Refusal("image prompts", "environment_factory and rollout_ranks and rollout_partial=True", "not yet",
            "multiturn.check_images", "two choices of the episode axis: partial environment episodes on rollout "
            "ranks do not carry images yet (tools= do)"),
)


@dataclass(frozen=True)
class DispatchRule:
    """One choice of ``rollout_dispatch`` (the dispatch axis: which engine runs which group), everything the rest of
    the package asks of it, registered by name (:func:`register_dispatch`; the built-in rules, ``shares`` and
    ``balanced``, in :mod:`trl_nrollout.rollout.dispatch.rules`). Read it once where a part is built
    (``rule = dispatch_rule(args.rollout_dispatch)``), then ask ``rule.job_wide``, ``rule.generate(...)``...

    - ``name``, ``help`` (the option's help and docs/configuration.md: ``'name': help``);
    - ``job_wide``: the job's groups are pooled across the engines (any engine may run any rank's group, the results
      go home) rather than each engine running its own ranks' groups; the trainer's job-wide set-up (the partial
      pool of the job, environments' calls sent home, agents' job queue) follows it, and the engines build their
      job-wide collectives for it;
    - ``needs``: the engine capabilities it needs beyond the core (names of :mod:`~trl_nrollout.rollout.engines.
      protocol`'s constants), ``needs_why``: why an engine without them (the HF engine) cannot run it: the refusal
      table's row (:meth:`refusals`);
    - the drivers, one per operation (functions over any engine of the protocol, engine first):
      ``generate(engine, sample_prompts, n, sampling, *, sample_offset=None, images=None, mm=None) -> (RolloutBatch,
      PullStats | None)`` (single-turn, TRL's form; ``PullStats`` where groups were pulled from a queue, for the log);
      ``run_agents(engine, sample_prompts, n, sampling, turn_seed, agent, workers, *, sample_offset=None,
      images=None) -> (samples, groups, AgentStats, PullStats | None)`` (TRL tool episodes request by request);
      ``func_calls(engine)``: a context around a ``rollout_func``'s call yielding a list of each engine call's
      ``(PullStats, samples, n)``; for job-wide rules the job's partial pool, ``run_partial(engine, groups, target,
      sampling, version, homes) -> PartialRun`` and ``run_partial_agents(engine, groups, target, sampling, version,
      homes, agent, workers, quota=None) -> (PartialRun, AgentStats)`` (``homes[i]``: the engine of the rank that
      drew group ``i``).
    """

    name: str
    help: str
    job_wide: bool
    generate: Callable[..., Any]
    run_agents: Callable[..., Any]
    func_calls: Callable[[Any], Any]
    needs: tuple[str, ...] = ()
    needs_why: str = ""
    run_partial: Callable[..., Any] | None = None
    run_partial_agents: Callable[..., Any] | None = None

    @property
    def option(self) -> str:
        """The option as a user writes it (the refusal table's spelling)."""
        return f"rollout_dispatch={self.name!r}"

    def refusals(self) -> tuple[Refusal, ...]:
        """The rule's rows of the refusal table: the HF engine where it needs capabilities beyond the core."""
        if not self.needs:
            return ()
        return (Refusal(self.option, "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
                        self.needs_why),)


#: the registered dispatch rules, by name (``rollout_dispatch``'s accepted values, in registration order)
DISPATCH_RULES: dict[str, DispatchRule] = {}


def register_dispatch(rule: DispatchRule) -> DispatchRule:
    """Register ``rule`` under its name (a new name, a name of letters, digits and ``_``; a job-wide rule brings its
    partial pool's drivers). Returns it."""
    if not rule.name.replace("_", "").isalnum() or rule.name in DISPATCH_RULES:
        raise ValueError(f"dispatch rule {rule.name!r}: the name must be new (registered: {list(DISPATCH_RULES)}) "
                         "and of letters, digits and '_'.")
    missing = [f.name for f in fields(rule) if f.name in ("run_partial", "run_partial_agents")
               and rule.job_wide and getattr(rule, f.name) is None]
    if missing:
        raise ValueError(f"dispatch rule {rule.name!r} is job-wide but has no {missing}: a job-wide rule drives the "
                         "job's partial pool too (see rollout/dispatch/rules.py's balanced rule).")
    DISPATCH_RULES[rule.name] = rule
    return rule


def dispatch_rule(name: str, option: str = "rollout_dispatch") -> DispatchRule:
    """The rule registered as ``name``; an unknown name is refused naming ``option``, the value, the registered
    names and the fix."""
    rule = DISPATCH_RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        names = list(DISPATCH_RULES)
        raise InputError(f"{option}={name!r} must be one of {names}, the registered dispatch rules (their help: "
                         f"docs/configuration.md, {option}). Set {option} to one of them ('shares', the default: "
                         "each engine its own ranks' prompts), or register a rule first (rollout/axes.py "
                         "register_dispatch; docs/architecture.md, \"Adding a dispatch rule\").")
    return rule


def refusals() -> tuple[Refusal, ...]:
    """Every refused pair: :data:`AXIS_REFUSALS` and the registered dispatch rules' rows."""
    return (*AXIS_REFUSALS, *(row for rule in DISPATCH_RULES.values() for row in rule.refusals()))


def __getattr__(name: str):
    if name == "REFUSALS":  # the table, the registered dispatch rules' rows included (read when asked)
        return refusals()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def machine_refusal(option: str, off: str, *, auto: bool = False) -> str:
    """The error for ``option`` (as :data:`REFUSALS` writes it) on the HF engine: the machine's row's reason and the
    fix (vLLM engines, or ``off``). ``auto``: the HF engine is what ``rollout_backend='auto'`` chose (vLLM is not
    installed), not the user's setting. One message for the config's check and the trainer's."""
    row = next(r for r in refusals() if r.first == option and r.second == "rollout_backend='hf'" and r.kind == "machine")
    chosen = "rollout_backend='auto' chose the HF engine (vLLM is not installed)" if auto else "rollout_backend='hf'"
    return (f"{option} needs vLLM engines: {row.why}, and {chosen}. Set rollout_backend='vllm' (or 'auto' with vLLM "
            f"installed), or {off}.")


def refusal_table() -> list[str]:
    """:data:`REFUSALS` as a markdown table (docs/architecture.md), machine-imposed rows first."""
    order = {"machine": 0, "one axis": 1, "by definition": 2, "not yet": 3}
    rows = ["| option | with | kind | why | checked in |", "|---|---|---|---|---|"]
    for r in sorted(refusals(), key=lambda r: order[r.kind]):
        rows.append(f"| `{r.first}` | `{r.second}` | {r.kind} | {r.why} | `{r.where}` |")
    return rows
