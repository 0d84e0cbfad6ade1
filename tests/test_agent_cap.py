"""``agent_max_concurrent``: at most that many episodes' agents run at once on a rank (threads of a sync agent, tasks
of an async one), the others wait their turn and all run; the default is vLLM's default ``max_num_seqs`` (1024).
The agents here make no call, so the endpoint is a stand-in with the three members the runner reads (no HTTP server
or engine is needed to count concurrent agents)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trl_nrollout.plan.memory import DEFAULT_MAX_NUM_SEQS
from trl_nrollout.rollout.dispatch.agent_runs import EpisodeRunner
from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord


class _Endpoint:
    model_name = "policy"

    def __init__(self) -> None:
        self.closed: list[str] = []

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:9/e/{key}/v1"

    def close_episode(self, key: str) -> None:
        self.closed.append(key)


def _run(agent, cap: int | None, episodes: int = 10) -> tuple[EpisodeRunner, list[EpisodeRecord], _Endpoint]:
    records = [EpisodeRecord(key=f"k{i}", row={"i": i}) for i in range(episodes)]
    handed = iter([records])  # everything at once, as a rollout without a balanced queue hands them out

    def pull(running: int):
        batch = next(handed, [])
        return batch, True

    endpoint = _Endpoint()
    runner = EpisodeRunner(agent, timeout=30.0, max_running=cap)
    finished = threading.Event()
    runner.run(pull, endpoint, finished)
    assert finished.is_set()
    return runner, records, endpoint


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_at_most_the_cap_run_at_once_and_every_episode_runs(kind):
    """10 episodes under a cap of 3: the most agents seen running together is 3, and all 10 return their reward.
    Fails when the runner starts every episode it is handed at once (as before: up to 4,096 threads)."""
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def enter():
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])

    def leave():
        with lock:
            state["now"] -= 1

    if kind == "sync":
        def agent(client, row):
            enter()
            time.sleep(0.05)
            leave()
            return float(row["i"])
    else:
        async def agent(client, row):
            enter()
            await asyncio.sleep(0.05)
            leave()
            return float(row["i"])

    runner, records, endpoint = _run(agent, cap=3)
    assert state["peak"] == 3 == runner.peak_running
    assert [r.result for r in records] == [float(i) for i in range(10)]
    assert sorted(endpoint.closed) == sorted(r.key for r in records)


def test_the_default_cap_is_vllms_max_num_seqs_and_a_bad_one_names_the_option():
    assert EpisodeRunner(lambda client, row: 0.0, timeout=1.0).max_running == DEFAULT_MAX_NUM_SEQS
    assert EpisodeRunner(lambda client, row: 0.0, timeout=1.0, max_running=64).max_running == 64
    with pytest.raises(ValueError, match="agent_max_concurrent=0 must be a whole number >= 1"):
        EpisodeRunner(lambda client, row: 0.0, timeout=1.0, max_running=0)


def test_the_option_is_checked_when_the_config_is_built(tmp_path):
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    with pytest.raises(InputError, match="agent_max_concurrent=0 must be >= 1"):
        NRolloutConfig(output_dir=str(tmp_path), train_batch_size=2, rollout_n=2, use_cpu=True, report_to="none",
                       agent_max_concurrent=0)


def test_the_option_without_an_agent_is_refused_before_the_model_loads(tmp_path):
    """agent_max_concurrent caps endpoint agents' episodes only: a trainer without agent= refuses it (it would be
    ignored), naming the option and both fixes; the model name is never resolved. Mutation: the check left out ->
    the trainer goes on to load 'no/such-model' and fails there instead."""
    from trl_nrollout import NRolloutGRPOTrainer
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    args = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=2, rollout_n=2, use_cpu=True, report_to="none",
                          agent_max_concurrent=8)
    with pytest.raises(InputError, match=r"agent_max_concurrent=8 caps the episodes of agent=.*Pass "
                                         r"agent=your_function, or drop agent_max_concurrent"):
        NRolloutGRPOTrainer(model="no/such-model", reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                            args=args)
