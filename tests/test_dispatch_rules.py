"""Dispatch rules (``rollout_dispatch``: a :class:`~trl_nrollout.rollout.axes.DispatchRule` registered by name, the
built-ins in rollout/dispatch/rules.py): the contributor's proof of issue 61 item 7 for the dispatch axis.
docs/architecture.md's "Adding a dispatch rule" walks through a new rule; this test runs that section's own code
(read from the doc, so the doc and the test cannot drift) on one vLLM engine in this process. The fast tests check
the registry's contract: the option's values and refusals are the registry's, and no module compares the option's
string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
BASE = dict(output_dir="/tmp/x", report_to="none", use_cpu=True)


def section(title: str) -> str:
    """The text of one ``## `` section of docs/architecture.md."""
    return DOC.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def doc_rule():
    """The doc's rule registered (its code run as the doc writes it); the registry as it was afterwards."""
    from trl_nrollout.rollout.axes import DISPATCH_RULES

    code = "\n\n".join(BLOCK.findall(section("Adding a dispatch rule")))
    assert "register_dispatch" in code
    before = dict(DISPATCH_RULES)
    namespace: dict = {}
    try:
        exec(compile(code, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        DISPATCH_RULES.clear()
        DISPATCH_RULES.update(before)


@pytest.mark.vllm
def test_the_docs_dispatch_rule_hands_out_the_longest_groups_first(doc_rule, tiny_model_path):
    """The doc's ``longest_first`` rule, registered: the engine is built for it by name (job-wide), and one
    single-turn rollout through the rule's driver hands the job's groups to the engine longest prompt first (its
    claims, several: the engine runs fewer samples at once than the job has), while every sample is the one fixed
    shares draw (a group is seeded by its place in the job, not by when it runs). Mutations tried: the doc's
    driver without ``order=`` (one engine: the share at once, groups in job order: fails); ``generate_balanced``
    ignoring ``order`` (the queue's own order: fails)."""
    from tests.conftest import restored_distributed_env
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.axes import dispatch_rule
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.types import SamplingOptions

    n = 2
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [12, 13, 14, 15, 16], [20 + k for k in range(12)],
               [30, 31, 32, 33, 34, 35, 36], [40, 41, 42, 43]]
    longest = doc_rule["longest_first"](prompts)
    assert longest == [3, 1, 4, 2, 5, 0]
    sample_prompts = [list(p) for p in prompts for _ in range(n)]
    sampling = SamplingOptions(max_tokens=8, temperature=1.0, seed=11, stop_token_ids=tuple(range(10, 40)))
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=len(sample_prompts),
                                 rollout_n=n)
    with restored_distributed_env():
        engine = VLLMEngineGroup(tiny_model_path, layout, rank=0, max_model_len=128, seed=1234, max_num_seqs=2,
                                 dispatch="longest_first")
        try:
            rule = dispatch_rule("longest_first")
            assert rule.job_wide and rule is doc_rule["LONGEST_FIRST"]
            batch, pulled = rule.generate(engine, sample_prompts, n, sampling, sample_offset=0)
            shares, none = dispatch_rule("shares").generate(engine, sample_prompts, n, sampling, sample_offset=0)
        finally:
            engine.close()
    assert pulled.groups == longest  # the order the engine got them
    assert pulled.claims > 2  # pulled as it had room, not handed out at once
    assert none is None
    assert batch.group_index == shares.group_index == [g for g in range(len(prompts)) for _ in range(n)]
    assert batch.prompt_ids == shares.prompt_ids
    assert batch.completion_ids == shares.completion_ids  # the samples fixed shares draw
    assert len({len(c) for c in batch.completion_ids}) > 1  # (the stops apply: the order is worth something)


def test_the_docs_rule_is_an_option_value_with_its_refusal(doc_rule):
    """Registered, the doc's rule is a value ``rollout_dispatch`` accepts, refused on the HF engine with its own
    name (its row in the refusal table comes from the rule's ``needs``); the section names at most three package
    files. Mutation tried: the config checking a fixed tuple of names (the new name refused: fails)."""
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.errors import InputError
    from trl_nrollout.rollout.axes import REFUSALS

    assert NRolloutConfig(**BASE, rollout_dispatch="longest_first").rollout_dispatch == "longest_first"
    with pytest.raises(InputError, match="rollout_dispatch='longest_first' needs vLLM engines.*rollout_backend='hf'"):
        NRolloutConfig(**BASE, rollout_dispatch="longest_first", rollout_backend="hf")
    assert any(r.first == "rollout_dispatch='longest_first'" and r.second == "rollout_backend='hf'" for r in REFUSALS)
    steps = re.findall(r"^\d\. .*?`((?:trainer|config|rollout)/[\w/]+\.py)`", section("Adding a dispatch rule"),
                       re.MULTILINE)
    assert 1 <= len(set(steps)) <= 3, steps


def test_unknown_and_duplicate_rules_are_refused():
    """An unknown name is refused naming the option, the value and the registered names; a name registered twice,
    or a job-wide rule without the job's partial pool drivers, is refused at registration."""
    from dataclasses import replace

    from trl_nrollout.errors import InputError
    from trl_nrollout.rollout.axes import DISPATCH_RULES, dispatch_rule, register_dispatch

    with pytest.raises(InputError, match=r"rollout_dispatch='least' must be one of \['shares', 'balanced'\].*Set "):
        dispatch_rule("least")
    with pytest.raises(ValueError, match="must be new"):
        register_dispatch(dispatch_rule("shares"))
    with pytest.raises(ValueError, match="job-wide but has no"):
        register_dispatch(replace(dispatch_rule("shares"), name="pooled", job_wide=True))
    assert list(DISPATCH_RULES)[:2] == ["shares", "balanced"] and "pooled" not in DISPATCH_RULES


def _string_comparisons(names: set[str]) -> list[str]:
    """``file:line`` of every comparison in the package with one of ``names`` as a literal side (``==``, ``!=``,
    ``in`` a literal tuple...)."""
    found = []
    for path in sorted((ROOT / "trl_nrollout").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            literals = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))]
            if any(isinstance(c, ast.Constant) and c.value in names for c in literals):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_compares_the_dispatch_rules_name():
    """Every choice between dispatch rules asks the rule (``dispatch_rule(args.rollout_dispatch)``), so adding one
    edits no site: no comparison in the package has a rule's name as a literal. (The engine capability named
    ``"balanced"`` is compared through ``has``, never as a literal.) Mutation tried: ``args.rollout_dispatch ==
    "balanced"`` put back in trainer/pool_rounds.py (found: fails)."""
    from trl_nrollout.rollout.axes import DISPATCH_RULES

    assert _string_comparisons(set(DISPATCH_RULES)) == []
