"""The rollout's refusal table (:data:`trl_nrollout.rollout.axes.REFUSALS`) is the code's: every row is refused
where it says, with a message naming both of its sides, and docs/architecture.md's table is generated from it
(tests/test_docs.py). Mutation tried: a row whose check is lifted (``rollout_partial`` with
``environment_factory`` no longer refused in ``_partial_refusal``) -> its case fails here, so the table cannot claim a refusal
the code no longer makes (nor miss one it makes, for the checks listed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trl_nrollout.config import NRolloutConfig
from trl_nrollout.config.checks import rollout_ranks_refusal
from trl_nrollout.errors import InputError
from trl_nrollout.rollout.axes import REFUSALS, dispatch_rule, refusal_table
from trl_nrollout.trainer.agents import agent_refusal
from trl_nrollout.trainer.engines import EngineSetup
from trl_nrollout.trainer.multiturn import check_images, request_turns_refusal
from trl_nrollout.trainer.partial import partial_refusal
from trl_nrollout.trainer.rollout_ranks import RolloutRankPlacement


def _partial_refusal(trainer) -> str | None:
    """The trainer's partial-rollout check (:func:`~trl_nrollout.trainer.partial.partial_refusal`) on its engine."""
    return partial_refusal(trainer.rollout_backend)


def _raised(call) -> str | None:
    """The message of the error ``call()`` raises (None: it raised none)."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - any refusal's message
        return str(err)
    return None


def _config_error(tmp_path, **options) -> str:
    with pytest.raises(InputError) as err:
        NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **options)
    return str(err.value)


def _ranks(**options) -> str | None:
    base = dict(rollout_ranks=1, rollout_backend="vllm", rollout_partial=False, rollout_dispatch="shares",
                rollout_multi_turn="turns")
    return rollout_ranks_refusal(SimpleNamespace(**{**base, **options}))


def _trainer(**attrs) -> SimpleNamespace:
    base = dict(rollout_backend="vllm", tools=None, environment_factories=None, rollout_func=None,
                args=SimpleNamespace(rollout_ranks=1, rollout_multi_turn="turns", rollout_partial=False))
    return SimpleNamespace(**{**base, **attrs})


def _agent_refusal(t: SimpleNamespace) -> str | None:
    """The agent check on a stand-in trainer's options, engine, environments and rollout_func."""
    return agent_refusal(t.args, t.rollout_backend, t.environment_factories, t.rollout_func)


def _request_turns_refusal(t: SimpleNamespace) -> str | None:
    return request_turns_refusal(t.rollout_backend)


def _agent(**args) -> str | None:
    base = dict(rollout_backend="vllm", rollout_ranks=0, rollout_partial=False, rollout_dispatch="shares",
                rollout_seed_mode=None)
    hf = args.pop("hf", False)
    return _agent_refusal(_trainer(rollout_backend="hf" if hf else "vllm",
                                                 args=SimpleNamespace(**{**base, **args})))


#: how each row is made to happen: the message its check gives (the real check, called on the options)
CASES = {
    ("agent", "rollout_backend='hf'"): lambda tmp: _agent(hf=True, rollout_backend="hf"),
    ("image prompts", "environment_factory and rollout_ranks and rollout_partial=True"): lambda tmp: _raised(
        lambda: check_images(["prompt", "image"], environment_factory=print, args=SimpleNamespace(
            rollout_ranks=1, rollout_multi_turn="requests", rollout_partial=True))),
    ("agent", "environment_factory or rollout_func"): lambda tmp: _agent_refusal(
        _trainer(environment_factories={"x": print}, args=SimpleNamespace(rollout_backend="vllm"))),
    ("rollout_ranks", "rollout_backend='hf'"): lambda tmp: _ranks(rollout_backend="hf"),
    ("rollout_partial=True", "rollout_backend='hf'"): lambda tmp: _config_error(
        tmp, rollout_partial=True, rollout_backend="hf"),
    ("rollout_dispatch='balanced'", "rollout_backend='hf'"): lambda tmp: _config_error(
        tmp, rollout_dispatch="balanced", rollout_backend="hf"),
    ("rollout_multi_turn='requests'", "rollout_backend='hf'"): lambda tmp: _config_error(
        tmp, rollout_multi_turn="requests", rollout_backend="hf"),
}


def _names(side: str) -> list[str]:
    """The option names a side mentions (``rollout_ranks``, ``tools or environment_factory`` -> both...)."""
    words = side.replace(",", " ").replace(" or ", " ").replace(" and ", " ").split()
    return [w.split("=")[0] if "=" in w else w for w in words if "_" in w or w == "tools"] or [side]


def test_every_row_has_a_case_and_every_case_a_row():
    assert {(r.first, r.second) for r in REFUSALS} == set(CASES)
    assert len(refusal_table()) == len(REFUSALS) + 2


@pytest.mark.parametrize("row", REFUSALS, ids=lambda r: f"{r.first}+{r.second}")
def test_each_row_is_refused_where_it_says_naming_both_sides(row, tmp_path):
    message = CASES[(row.first, row.second)](tmp_path)
    assert message, f"{row.first} with {row.second} is not refused any more: lift the row from REFUSALS"
    for side in (row.first, row.second):
        for name in _names(side):
            assert name in message, (name, message)
    owner, _, attr = row.where.rpartition(".")
    namespace = {"checks": __import__("trl_nrollout.config.checks", fromlist=["x"]),
                 "ConfigChecks": __import__("trl_nrollout.config.checks", fromlist=["x"]).ConfigChecks,
                 "EngineSetup": EngineSetup, "RolloutRankPlacement": RolloutRankPlacement,
                 "agents": __import__("trl_nrollout.trainer.agents", fromlist=["x"]),
                 "partial": __import__("trl_nrollout.trainer.partial", fromlist=["x"]),
                 "multiturn": __import__("trl_nrollout.trainer.multiturn", fromlist=["x"])}
    assert callable(getattr(namespace[owner], attr)), row.where
    if row.kind == "machine":
        assert "rollout_backend='hf'" in (row.first, row.second)  # the only machine limit today: the HF engine
    else:  # no combination of axes is refused: what is left are two choices of the episode axis
        assert row.kind in ("one axis", "not yet") and "two choices of the episode axis" in row.why, row


def test_lifted_rows_are_no_longer_refused():
    """Rows lifted from the table run now: rollout ranks with request-level tool episodes (they run whole on the
    rollout ranks, tests/test_tools.py::test_tool_episodes_on_a_rollout_rank_one_step_off); partial rollouts of
    request-level tool episodes on a balanced queue (tests/test_dispatch.py); partial rollouts with environments
at TP=1 and TP=2."""
    assert _ranks(rollout_multi_turn="requests") is None
    # rollout ranks refuse nothing the trainer's arguments add (tools, environments, agent= and partial rollouts of
    # each run there: tests/test_combinations.py::test_a_rollout_rank_keeps_each_steps_episodes_and_groups_in_flight)
    assert not hasattr(RolloutRankPlacement, "_rollout_ranks_refusal")
    assert _ranks(rollout_partial=True) is None
    # partial rollouts of tool episodes on the job's balanced queue (tests/test_dispatch.py)
    assert _partial_refusal(_trainer(tools=[print], args=SimpleNamespace(
        rollout_ranks=0, rollout_multi_turn="requests", rollout_dispatch="balanced"))) is None
    # partial rollouts with environments, one engine per rank (tests/test_tool_requests.py) and an engine of two
    # ranks (tests/test_combinations.py::test_partial_environment_episodes_train_on_their_own_ranks_at_tp2)
    # environments on a balanced queue, their tools run at home (tests/test_combinations.py, rollout/episodes/home_tools.py)
    assert EngineSetup.dispatch_refusal(_trainer(environment_factories={"e": print}, args=SimpleNamespace(
        rollout_multi_turn="requests")), dispatch_rule("balanced")) is None
    for tp in (1, 2):
        assert _partial_refusal(_trainer(environment_factories={"e": print}, tools=[print], args=(
            SimpleNamespace(rollout_ranks=0, rollout_multi_turn="requests")), layout=SimpleNamespace(rollout_tp_size=tp)
        )) is None
    # issue 46's last rows (tests/test_combinations.py runs each): partial rollouts of tool episodes under the
    # default 'turns' (run request by request), a rollout_func partial or request by request (group by group), and
    # agent= with tools= (the agent gets them)
    for trainer in (_trainer(tools=[print]), _trainer(rollout_func=print)):
        assert _partial_refusal(trainer) is None
    assert _request_turns_refusal(_trainer(rollout_func=print)) is None
    assert _agent(rollout_backend="vllm") is None
    assert _agent_refusal(_trainer(tools=[print], args=SimpleNamespace(
        rollout_backend="vllm", rollout_seed_mode=None))) is None
    # issue 66: image prompts (and tools' images) with tool episodes from a balanced queue, request by request and
    # partial (tests/test_tool_images.py, tests/test_combinations.py::test_partial_tool_episodes_on_a_balanced_...)
    for more in ({"rollout_multi_turn": "requests"}, {"rollout_partial": True}):
        check_images(["prompt", "image"], tools=[print], args=SimpleNamespace(rollout_dispatch="balanced", **more))
    # partial environment episodes (tests/test_partial_images.py)
    check_images(["prompt", "image"], environment_factory=print, args=SimpleNamespace(rollout_partial=True))
    # and tool episodes on rollout ranks: whole episodes request by request, a job a turn turn by turn, partial
    # (tests/test_vlm.py::test_a_vlm_trains_on_a_rollout_rank_one_step_off)
    for more in ({"rollout_multi_turn": "requests"}, {"rollout_multi_turn": "turns"}, {"rollout_partial": True}):
        check_images(["prompt", "image"], tools=[print], args=SimpleNamespace(rollout_ranks=1, **more))
    # a rollout_func group by group, request by request or partial (tests/test_tool_images.py::test_a_rollout_funcs_image_...)
    # and on rollout ranks (tests/test_vlm.py::test_a_vlm_trains_on_a_rollout_rank_one_step_off)
    for more in ({"rollout_multi_turn": "requests"}, {"rollout_partial": True}, {"rollout_ranks": 1},
                 {"rollout_ranks": 1, "rollout_partial": True}):
        check_images(["prompt", "image"], rollout_func=print, args=SimpleNamespace(**more))


@pytest.mark.parametrize("option, off, check", [
    ("rollout_partial=True", "rollout_partial=False", _partial_refusal),
    ("rollout_dispatch='balanced'", "rollout_dispatch='shares'",
     lambda t: EngineSetup.dispatch_refusal(t, dispatch_rule("balanced"))),
    ("rollout_multi_turn='requests'", "rollout_multi_turn='turns'", _request_turns_refusal)])
def test_the_hf_engine_chosen_by_auto_is_refused_with_the_tables_reason(tmp_path, option, off, check):
    """rollout_backend='auto' without vLLM gives the HF engine: the trainer's check refuses each machine row with the
    reason the table states (the config's check, for rollout_backend='hf', says the same), what chose the engine, and
    the fix. Mutation tried: the trainer's partial check with its own message (no table reason) -> fails."""
    row = next(r for r in REFUSALS if r.first == option and r.kind == "machine")
    message = check(_trainer(rollout_backend="hf"))
    assert message is not None and row.why in message and "rollout_backend='auto' chose the HF engine" in message
    assert message.endswith(f"or {off}.")
    assert row.why in CASES[(row.first, row.second)](tmp_path)  # the config's check: the same reason
    assert check(_trainer()) is None  # vLLM engines: nothing to refuse
