"""The rollout's four axes, and every combination of them that is refused today, in one table.

A rollout step is one choice on each axis:

- **placement**, where the engines live: colocated with the trainers (``rollout_ranks=0``), or on rollout ranks;
- **dispatch**, how work reaches them: fixed shares (``rollout_dispatch="shares"``) or one balanced queue;
- **end**, when the step's rollout ends: every sample done, or partial (``rollout_partial=True``: the first groups
  to finish train, the rest stay in flight across weight syncs);
- **episode**, what one sample is: one completion, TRL tools turn by turn or request by request, an environment
  (``environment_factory``), a ``rollout_func``, a prompt with images, an agent written in any framework
  (``agent=``, through an OpenAI-compatible endpoint).

The engine (``rollout_backend``) is not an axis but the machine: the HF engine (transformers ``generate`` on the
training model) cannot abort or stream a request, so it cannot run what needs a request-level loop. :data:`REFUSALS`
lists each refused pair once, with its kind: ``machine`` (what the machine cannot do), ``one axis`` (two choices of
one axis, as two dispatches would be: not a combination of axes), ``by definition`` (what the option means excludes
it) or ``not yet`` (a part to build); docs/architecture.md's table is generated from it
(``scripts/gen_config_docs.py``), and tests/test_axes.py checks that each row is refused where it says, with a
message naming both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

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

#: ``rollout_dispatch`` values (the dispatch axis; the engines and the config checks read them here)
DISPATCH_MODES = ("shares", "balanced")


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


REFUSALS: tuple[Refusal, ...] = (
    Refusal("rollout_ranks", "rollout_backend='hf'", "machine", "checks.rollout_ranks_refusal",
            "the HF engine generates with the training model itself: it cannot live on another process"),
    Refusal("rollout_partial=True", "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
            "the HF engine cannot abort a request, so a sample cannot stop and continue later"),
    Refusal("rollout_dispatch='balanced'", "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
            "the HF engine has no request-level loop to add groups to while it generates"),
    Refusal("rollout_multi_turn='requests'", "rollout_backend='hf'", "machine", "ConfigChecks._check_choices",
            "the HF engine has no request-level loop: samples cannot re-enter it one by one"),
    Refusal("agent", "rollout_backend='hf'", "machine", "agents.agent_refusal",
            "the HF engine has no request-level loop: an agent's calls cannot join it one by one"),
    Refusal("agent", "environment_factory or rollout_func", "one axis", "agents.agent_refusal",
            "two choices of the episode axis: each is the episode's own loop, as the agent is (an agent builds its "
            "environment itself from the row; tools= compose: the agent gets them)"),
    Refusal("image prompts", "rollout_func and rollout_multi_turn='requests'", "not yet", "multiturn.check_images",
            "two choices of the episode axis: a rollout_func run group by group does not carry images yet (called on "
            "the whole batch it does, TRL's contract: its prompt_ids hold the processor's expansion, the forward "
            "takes the dataset's images)"),
    Refusal("image prompts", "tools and rollout_multi_turn='requests' and rollout_dispatch='balanced'", "not yet",
            "multiturn.check_images", "two choices of the episode axis: request-level tool episodes from a balanced "
            "queue do not carry images yet (nor a tool's returned images: refused when one returns an image); turn "
            "by turn, or from fixed shares, they do"),
    Refusal("image prompts", "environment_factory and rollout_partial=True", "not yet", "multiturn.check_images",
            "two choices of the episode axis: partial environment episodes do not carry their observations' images "
            "yet (partial tool episodes with tools= from fixed shares carry the prompts' and the tools' images)"),
    Refusal("image prompts", "tools and rollout_partial=True and rollout_dispatch='balanced'", "not yet",
            "multiturn.check_images", "two choices of the episode axis: partial tool episodes from a balanced queue "
            "do not carry images yet (from fixed shares they do)"),
    Refusal("image prompts", "rollout_func and rollout_partial=True", "not yet", "multiturn.check_images",
            "two choices of the episode axis: a partial rollout runs a rollout_func group by group, which does not "
            "carry images yet"),
    Refusal("image prompts", "tools and rollout_ranks", "not yet", "multiturn.check_images",
            "two choices of the episode axis: tool episodes on rollout ranks do not carry images yet"),
    Refusal("image prompts", "rollout_func and rollout_ranks", "not yet", "multiturn.check_images",
            "two choices of the episode axis: a rollout_func on rollout ranks does not carry images yet"),
)


def machine_refusal(option: str, off: str, *, auto: bool = False) -> str:
    """The error for ``option`` (as :data:`REFUSALS` writes it) on the HF engine: the machine's row's reason and the
    fix (vLLM engines, or ``off``). ``auto``: the HF engine is what ``rollout_backend='auto'`` chose (vLLM is not
    installed), not the user's setting. One message for the config's check and the trainer's."""
    row = next(r for r in REFUSALS if r.first == option and r.second == "rollout_backend='hf'" and r.kind == "machine")
    chosen = "rollout_backend='auto' chose the HF engine (vLLM is not installed)" if auto else "rollout_backend='hf'"
    return (f"{option} needs vLLM engines: {row.why}, and {chosen}. Set rollout_backend='vllm' (or 'auto' with vLLM "
            f"installed), or {off}.")


def refusal_table() -> list[str]:
    """:data:`REFUSALS` as a markdown table (docs/architecture.md), machine-imposed rows first."""
    order = {"machine": 0, "one axis": 1, "by definition": 2, "not yet": 3}
    rows = ["| option | with | kind | why | checked in |", "|---|---|---|---|---|"]
    for r in sorted(REFUSALS, key=lambda r: order[r.kind]):
        rows.append(f"| `{r.first}` | `{r.second}` | {r.kind} | {r.why} | `{r.where}` |")
    return rows
