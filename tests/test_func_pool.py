"""A rollout_func run group by group (trl_nrollout/rollout/episodes/rollout_func.py): TRL's output contract checked per group,
the groups' samples joined into one batch, and a group whose records were closed unwinding its function. The runs
themselves (partial, request by request, balanced, on rollout ranks) are in tests/test_combinations.py and
tests/test_tool_requests.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
from trl_nrollout.rollout.episodes.endpoint import AgentEndpoint
from trl_nrollout.rollout.episodes.rollout_func import (
    FuncSample,
    GroupClosed,
    GroupEngine,
    TrainerView,
    check_output,
    func_samples,
    samples_batch,
)
from trl_nrollout.rollout.types import SamplingOptions


def _output(count: int, **extra) -> dict:
    return {"prompt_ids": [[1, 2]] * count, "completion_ids": [[3, 4, 5]] * count,
            "logprobs": [[-0.1, None, -0.3]] * count, **extra}


def test_the_contract_is_checked_with_the_field_and_the_fix():
    """Each break of TRL's contract names what is wrong. Mutation tried: the extra fields' length check removed ->
    the 'tag' case passes silently and the test fails."""
    with pytest.raises(ValueError, match=r"must return keys \['logprobs'\]"):
        check_output({"prompt_ids": [[1]], "completion_ids": [[2]]}, 1, 1, 8, False)
    with pytest.raises(ValueError, match="returned 2 prompt_ids and 2 completion_ids for 4 prompts"):
        check_output(_output(2), 4, 4, 8, False)
    with pytest.raises(ValueError, match="env_mask of sample 0 has 2 entries for 3 completion tokens"):
        check_output(_output(1, env_mask=[[1, 1]]), 1, 1, 8, False)
    with pytest.raises(ValueError, match="extra field 'tag' has 1 entries for 2 prompts"):
        check_output(_output(2, tag=["a"]), 2, 2, 8, False)
    with pytest.raises(ValueError, match="rollout correction"):
        check_output({**_output(1), "logprobs": None}, 1, 1, 8, True)
    samples = check_output(_output(2, tag=["a", "b"]), 2, 2, 3, False)
    assert [s.extra for s in samples] == [{"tag": "a"}, {"tag": "b"}]
    assert samples[0].logprobs == [-0.1, 0.0, -0.3] and samples[0].finish_reason == "length"  # 3 tokens = limit
    assert check_output(_output(1), 1, 1, 8, False)[0].finish_reason == "stop"


@given(st.lists(st.tuples(st.integers(1, 5), st.booleans(), st.booleans()), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(0, 40))
def test_groups_samples_join_in_order_with_masks_and_fields(specs, n, offset):
    """Samples of several groups (some with an env_mask, some with an extra field) as one batch: order kept, group
    indices from the job's offset, a sample without a mask trains every token, a missing field is None."""
    samples = [FuncSample([k], [7] * length, [-1.0] * length, "stop", [0] * length if masked else None,
                          {"f": k} if field else {}) for k, (length, masked, field) in enumerate(specs)]
    batch, masks, extra = samples_batch(samples, n, offset)
    assert batch.prompt_ids == [[k] for k in range(len(specs))]
    assert batch.group_index == [(offset + i) // n for i in range(len(specs))]
    if any(m for _, m, _ in specs):
        assert masks == [[0] * length if m else [1] * length for length, m, _ in specs]
    else:
        assert masks is None
    if any(f for *_, f in specs):
        assert extra == {"f": [k if f else None for k, (*_, f) in enumerate(specs)]}
    else:
        assert extra == {}


def test_a_closed_group_unwinds_its_function_and_failures_name_the_row():
    """A group whose records were closed (it started again, too stale) gets GroupClosed from its next engine call,
    before any request is queued: a BaseException, so the user's ``except Exception`` does not swallow it. A group
    whose function raised is an error naming its row and carrying the traceback. The trainer view forwards every
    attribute but the engine."""
    endpoint = AgentEndpoint(None, model_name="m", max_model_len=32, max_completion_length=8, max_calls=4)
    records = [EpisodeRecord(key=f"k{i}", row={"prompt": "p"}) for i in range(2)]
    endpoint.open(records)
    endpoint.close_episode("k1")
    engine = GroupEngine(endpoint, records, 32)
    with pytest.raises(GroupClosed):
        try:
            engine.generate_expanded([[1, 2]], 2, SamplingOptions(max_tokens=4))
        except Exception:  # noqa: BLE001 - what a user's function might write
            pytest.fail("GroupClosed was caught as an Exception")
    assert endpoint.requests.empty() and not records[0].calls  # nothing queued for the open record either
    view = TrainerView(type("T", (), {"args": "A", "rollout_engine": "theirs"})(), engine)
    assert view.args == "A" and view.rollout_engine is engine
    records[0].outcome, records[0].error = "error", "Traceback ...\nValueError: bad"
    with pytest.raises(RuntimeError, match=r"(?s)row {'prompt': 'p'}.*ValueError: bad"):
        func_samples(records)
