"""TRL's agentic interfaces on our engines: ``tools``, ``environment_factory``, ``rollout_func``.

The turn loop (:func:`run_tool_turns`) is tested with scripted turns (its inputs are plain callables), then whole
trainers run TRL scripts with tools on the vLLM and the HF engine: the built-in tool task, where the reward is 1 when
the model called the tool and got its result (a random model does so in about 2% of its samples).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ACCELERATE_LAUNCH, ROOT, run_cmd, run_script_in_process
from trl_nrollout.rollout.episodes.tools import call_tools, run_tool_turns, split_tools
from trl_nrollout.rollout.types import RolloutBatch

CALL, EOS, SUFFIX = 50, 2, [90, 91, 92]  # token ids of the scripted turns: a call, end of turn, a tool result


def _parse(i, ids, prefix):
    return {"role": "assistant", "content": "", **({"tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": {"x": len(ids)}}}]} if ids and ids[-1] == CALL else {})}


def _turns(first_completions, replies, *, budget=20, iterations=None, model_len=1000, other_rank_turns=0):
    """Run the loop on scripted first turns; ``replies[k]`` are the k-th continuation turns, in order. Another rank
    still has samples to continue for ``other_rank_turns`` turns."""
    calls = []
    others = [other_rank_turns]

    def any_rank(flag: bool) -> bool:
        others[0] -= 1
        return flag or others[0] >= 0

    def generate(contexts, budgets, turn, samples):
        calls.append((turn, [list(c) for c in contexts], list(budgets)))
        out = [list(replies[turn - 1][k]) for k in range(len(contexts))]
        return RolloutBatch([list(c) for c in contexts], out, [[-0.5] * len(o) for o in out],
                            ["stop"] * len(out), list(range(len(out))))

    first = RolloutBatch([[1, 2, 3]] * len(first_completions), [list(c) for c in first_completions],
                         [[-0.1] * len(c) for c in first_completions], ["stop"] * len(first_completions),
                         [k // 2 for k in range(len(first_completions))])
    turns = run_tool_turns(
        first, parse=_parse, run_tools=lambda i, tc: ([{"role": "tool", "name": "f", "content": "r"}], 0),
        suffix_ids=lambda msgs: list(SUFFIX), generate=generate,
        any_rank=any_rank, max_iterations=iterations,
        max_completion_length=budget, max_model_len=model_len)
    return turns, calls


def test_samples_that_call_tools_continue_and_tool_tokens_are_masked():
    turns, calls = _turns([[10, CALL], [11, EOS], [12, 13, CALL], [14, EOS]],
                          replies=[[[20, EOS], [21, 22, CALL]], [[30, EOS]]])
    assert [t for t, _, _ in calls] == [1, 2]  # two more turns: samples 0 and 2, then sample 2 again
    assert calls[0][1] == [[1, 2, 3, 10, CALL] + SUFFIX, [1, 2, 3, 12, 13, CALL] + SUFFIX]
    assert turns.completion_ids[0] == [10, CALL] + SUFFIX + [20, EOS]
    assert turns.tool_mask[0] == [1, 1, 0, 0, 0, 1, 1]
    assert turns.logprobs[0] == [-0.1, -0.1, 0.0, 0.0, 0.0, -0.5, -0.5]
    assert turns.completion_ids[2] == [12, 13, CALL] + SUFFIX + [21, 22, CALL] + SUFFIX + [30, EOS]
    assert sum(turns.tool_mask[2]) == len(turns.completion_ids[2]) - 2 * len(SUFFIX)
    assert turns.completion_ids[1] == [11, EOS] and turns.tool_mask[1] == [1, 1]  # no call: one turn
    assert turns.turns == [2, 1, 3, 1] and turns.tool_calls == [1, 0, 2, 0]
    assert [m["role"] for m in turns.completions[2]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert len(turns.completion_ids) == 4  # the group keeps its samples


def test_budget_iterations_and_collective_turns():
    # the tool result does not fit (2 + 3 >= 5): dropped, the sample ends as it was
    turns, calls = _turns([[10, CALL]], replies=[], budget=5)
    assert calls == [] and turns.completion_ids[0] == [10, CALL] and turns.turns == [1]
    # a reply longer than the budget left is cut there and the sample is "length"
    turns, calls = _turns([[10, CALL]], replies=[[[20, 21, 22, 23, 24, 25]]], budget=8)
    assert calls[0][2] == [3] and turns.completion_ids[0] == [10, CALL] + SUFFIX + [20, 21, 22]
    assert turns.finish_reasons == ["length"]
    # max_tool_calling_iterations=1: the second call is not run
    turns, calls = _turns([[10, CALL]], replies=[[[20, CALL]]], iterations=1)
    assert len(calls) == 1 and turns.tool_calls == [1] and turns.turns == [2]
    # another rank still has samples to continue for 2 turns: this rank takes part with nothing (collective engines)
    _, calls = _turns([[10, EOS]], replies=[[]] * 3, other_rank_turns=2)
    assert [c for _, c, _ in calls] == [[], []]
    # ranks that never agree to stop (a bug elsewhere) end in an error, not a hang
    with pytest.raises(RuntimeError, match="ranks disagree"):
        _turns([[10, EOS]], replies=[[]] * 30, other_rank_turns=10**9, budget=20)


def test_call_tools_sync_async_errors():
    def add(a: int, b: int) -> int:
        return a + b

    async def echo(text: str) -> str:
        await asyncio.sleep(0)
        return text.upper()

    def broken() -> str:
        raise RuntimeError("down")

    sync, asyn = split_tools([add, echo, broken])
    assert set(sync) == {"add", "broken"} and set(asyn) == {"echo"}

    def fn(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args}}

    messages, failures = call_tools([fn("add", a=2, b=3), fn("echo", text="hi"), fn("broken"), fn("nope"),
                                     {"type": "retrieval", "name": "r"}], sync, asyn)
    assert [m["content"] for m in messages[:2]] == ["5", "HI"]  # results in call order, async ones awaited
    assert "down" in messages[2]["content"] and "nope not found" in messages[3]["content"]
    assert "Unsupported tool call type" in messages[4]["content"] and failures == 3
    assert all(m["role"] == "tool" for m in messages)


ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"}


def _run_tool_script(tmp_path, backend: str, tool: str, steps: int, extra: dict | None = None, procs: int = 1,
                     config: str | None = None, timeout: float = 900) -> list[dict]:
    script = tmp_path / "script.py"
    source = (ROOT / "tests/assets/tools_grpo_script.py").read_text()
    # the class swapped; for the HF engine the config too, to say rollout_backend='hf' (a plain GRPOConfig with
    # use_vllm=False leaves it at 'auto', which picks vLLM where it is installed, as here)
    from trl import GRPOConfig

    ours = backend == "hf" or bool(set(extra or {}) - set(GRPOConfig.__dataclass_fields__))  # NRolloutConfig's
    config_import = "from trl_nrollout import NRolloutConfig as GRPOConfig" if ours else "from trl import GRPOConfig"
    script.write_text(source.replace("from trl import GRPOConfig, GRPOTrainer",
                                     f"{config_import}\nfrom trl_nrollout import NRolloutGRPOTrainer")
                      .replace("trainer = GRPOTrainer(", "trainer = NRolloutGRPOTrainer("))
    if backend == "hf":
        extra = {"rollout_backend": "hf", **(extra or {})}
    if config is not None:  # one of the recipes' accelerate configs, or a path
        head = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes/accelerate" / config)]
    elif procs == 1:  # as `python script.py ...`, in this process (see run_script_in_process)
        run_script_in_process(script, str(tmp_path), backend, tool, str(steps), json.dumps(extra or {}), env=ENV)
        return json.loads((tmp_path / "result.json").read_text())
    else:
        head = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", str(procs)]
    run_cmd([*head, str(script), str(tmp_path), backend, tool, str(steps), json.dumps(extra or {})],
            timeout=timeout, env={**ENV, "PYTHONPATH": str(ROOT)})
    return json.loads((tmp_path / "result.json").read_text())


def _check_masks(result: dict) -> None:
    """Every sample of the final rollout: tool-response tokens (mask 0) are exactly the rendered results."""
    assert result["rows"] == result["expected_rows"]  # groups of n kept
    assert result["samples"], "no sample called the tool"
    rendered = "<tool_response>\n7\n</tool_response>"  # the tool's result as the chat template renders it
    for text_masked, text_trained in result["samples"]:
        assert rendered in text_masked and rendered not in text_trained and "</tool_call>" in text_trained


@pytest.mark.slow
@pytest.mark.vllm
def test_a_trl_tools_script_learns_to_call_the_tool_on_vllm_in_partial_rollouts_without_a_turn_barrier(tmp_path):
    """rollout_multi_turn='requests' (sync tool on the thread pool) with rollout_partial=True: the model learns to
    call the tool as with turn-by-turn rollouts (whose samples the request-level ones equal, test_tool_requests.py),
    masks intact, while each step trains the groups that finished first and continues the others' episodes after
    the weight sync (staleness within max_staleness)."""
    result = _run_tool_script(tmp_path, "vllm", "sync", steps=8, extra={
        "rollout_multi_turn": "requests", "rollout_partial": True, "max_staleness": 1})
    steps = [h for h in result["history"] if "reward" in h]
    rewards = [h["reward"] for h in steps]
    assert rewards[0] < 0.3 and max(rewards[-2:]) > 0.8, rewards
    turns = [h["num_turns/mean"] for h in steps]
    assert turns[-1] > 1.5 and all("tools/call_frequency" in h for h in steps)
    assert all(0.0 <= h["tools/overlap"] <= 1.0 for h in steps)
    assert sum(h["partial/aborted_samples"] for h in steps) > 0  # steps stopped before their slowest episodes
    assert all(h["partial/staleness_max"] <= 1 for h in steps) and any(h["partial/staleness_max"] > 0 for h in steps)
    _check_masks(result)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_tool_turns_stay_collective_on_one_engine_over_two_ranks(tmp_path):
    """Two processes, one vLLM engine at TP=2: every turn is one engine call on both ranks, also when only one rank
    has samples that called the tool (it would hang otherwise); the samples keep their masks and groups."""
    result = _run_tool_script(tmp_path, "vllm", "sync", steps=3, procs=2,
                              extra={"vllm_tensor_parallel_size": 2, "per_device_train_batch_size": 32,
                                     "use_cpu": True})
    turns = [h["num_turns/mean"] for h in result["history"] if "num_turns/mean" in h]
    assert len(turns) == 3 and max(turns) > 1.0
    _check_masks(result)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_request_level_tool_turns_in_partial_rollouts_agree_on_one_engine_over_two_ranks(tmp_path):
    """rollout_multi_turn='requests' with partial rollouts and an async tool, two processes, one vLLM engine at TP=2:
    the pool's episodes re-enter the one engine as their tools finish, each group's tools running on the rank that
    brought its prompt, and both ranks add the same requests in the same steps and hold the same episodes (their
    exchanged tool results; otherwise the TP engine's collectives would hang or fail, and the ranks would train
    different samples). The request loop without partial rollouts agrees at TP=2 too: tests/dist/tp_agreement.py."""
    result = _run_tool_script(tmp_path, "vllm", "async", steps=3, procs=2,
                              extra={"vllm_tensor_parallel_size": 2, "per_device_train_batch_size": 32,
                                     "use_cpu": True, "rollout_multi_turn": "requests", "rollout_partial": True,
                                     "max_staleness": 1})
    steps = [h for h in result["history"] if "num_turns/mean" in h]
    assert len(steps) == 3 and max(h["num_turns/mean"] for h in steps) > 1.0
    assert sum(h["partial/aborted_samples"] for h in steps) > 0
    _check_masks(result)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_request_level_tool_episodes_from_a_balanced_queue_over_two_engines(tmp_path):
    """rollout_multi_turn='requests' with rollout_dispatch='balanced', two processes, one engine each: the job's
    groups are pulled from one queue and their episodes run on the engine that pulled them; each rank trains its
    own prompts' episodes (groups of n kept, masks intact), and the dispatch is logged. That the episodes equal the
    fixed shares' sample for sample: tests/test_dispatch.py. With rollout_partial=True:
    tests/test_combinations.py::test_partial_tool_episodes_on_a_balanced_queue_over_two_engines."""
    result = _run_tool_script(tmp_path, "vllm", "sync", steps=2, procs=2,
                              extra={"per_device_train_batch_size": 16, "use_cpu": True,
                                     "rollout_multi_turn": "requests", "rollout_dispatch": "balanced"})
    steps = [h for h in result["history"] if "num_turns/mean" in h]
    assert len(steps) == 2 and max(h["num_turns/mean"] for h in steps) > 1.0
    assert all(0.0 <= h["rollout/moved_groups"] <= 1.0 and h["rollout/engine_idle_s"] >= 0 for h in steps)
    _check_masks(result)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("multi_turn", ["requests", "turns"])
def test_tool_episodes_on_a_rollout_rank_one_step_off(tmp_path, multi_turn):
    """rollout_ranks=1 with tools, one trainer and one rollout rank, samples one step stale (rollout_lookahead=1).

    ``requests``: each step's whole episodes (every turn, the tools too) are one job of the rollout rank, written a
    step ahead, request by request on its engine with the script's own tools; the trainer gets their tokens, tool
    masks and messages. ``turns``: the first turns are generated a step ahead on the rollout rank, each tool turn is
    one job while the tools run on the trainer (3 steps: the cheap check of that path).

    Either way the model learns to call the tool as colocated (turns > 1), tool-result tokens are masked out of the
    loss (mask 0 on exactly the rendered results), and every step's samples were generated by a policy at most
    max_staleness=1 versions old (one of them exactly 1: generated ahead). Mutations tried (requests): the rollout
    rank's tool masks all 1 (episode_extras) -> the masks check fails; the jobs written ahead without their agent
    entry (single-turn jobs: the step's episodes are regenerated when it comes) -> no sample is one step stale;
    the rollout rank reporting the version it held at the start of the run (0) -> the staleness check fails."""
    steps = 10 if multi_turn == "requests" else 3
    result = _run_tool_script(tmp_path, "vllm", "sync", steps=steps, procs=2,
                              extra={"per_device_train_batch_size": 32, "use_cpu": True, "rollout_ranks": 1,
                                     "rollout_lookahead": 1, "rollout_multi_turn": multi_turn})
    steps_logged = [h for h in result["history"] if "num_turns/mean" in h]
    assert len(steps_logged) == steps and max(h["num_turns/mean"] for h in steps_logged) > 1.0
    assert all(h["rollout/staleness"] <= 1 for h in steps_logged)  # versions within rollout_lookahead
    assert any(h["rollout/staleness"] == 1 for h in steps_logged)  # generated one step ahead
    assert result["engine"] == "RemoteEngines"
    if multi_turn == "requests":  # learns; the rollout rank's own loop: its tool stats came back with the episodes
        rewards = [h["reward"] for h in steps_logged]
        assert rewards[0] < 0.1 and max(rewards[-2:]) > 0.4, rewards
        assert all(0.0 <= h["tools/overlap"] <= 1.0 for h in steps_logged)
        assert sum(h["tools/call_seconds"] for h in steps_logged) > 0
    _check_masks(result)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tool_turns_on_the_hf_engine_under_zero3_with_synced_forwards(tmp_path):
    """A TRL tools script on two ZeRO-3 processes, every parameter partitioned, the HF engine generating without
    gathering the parameters (every forward gathers them collectively): tool turns train, with TRL's masks. (The
    ranks' uneven turns themselves: test_a_rank_with_fewer_tool_turn_samples_keeps_the_hf_engines_forwards_in_step.)"""
    accelerate_config = _zero3_partition_all(tmp_path)
    result = _run_tool_script(tmp_path, "hf", "sync", steps=2, config=str(accelerate_config), timeout=300,
                              extra={"use_cpu": False, "ddp_backend": "gloo", "ds3_gather_for_generation": False,
                                     "per_device_train_batch_size": 32, "bf16": False})
    assert result["partitioned_params"] == result["params"] > 0  # every parameter is split over the two ranks
    assert result["engine"] == "HFEngine"
    turns = [h["num_turns/mean"] for h in result["history"] if "num_turns/mean" in h]
    assert len(turns) == 2 and max(turns) > 1.0
    _check_masks(result)


def _zero3_partition_all(tmp_path) -> Path:
    """An accelerate config for two ZeRO-3 CPU processes that partitions every parameter
    (``stage3_param_persistence_threshold: 0``), as a real model's are: a tiny model's would otherwise all stay whole
    on every rank, below DeepSpeed's default threshold, and its forwards would gather nothing (no rank could wait)."""
    ds_config = tmp_path / "ds_zero3_partition_all.json"
    ds_config.write_text(json.dumps({
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True}))
    accelerate_config = tmp_path / "zero3_partition_all.yaml"
    accelerate_config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {ds_config}\n  zero3_init_flag: true\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\n")
    return accelerate_config


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_with_fewer_tool_turn_samples_keeps_the_hf_engines_forwards_in_step(tmp_path):
    """ZeRO-3 over two ranks, every parameter partitioned, the HF engine at a tool turn where rank 0 continues 5
    samples (3 generate calls of 2) and rank 1 none, with both ds3_gather_for_generation values (TRL's generation
    context gathering the parameters or not) and with sampling and beam search (log-probs from a forward pass after
    generate). Each forward gathers parameters collectively, and transformers' generate steps the ranks together
    under ZeRO-3 even inside the gathered context; rank 0 would wait for rank 1 (here rank 1 would run on into the
    next case's collectives and the launch hang until the timeout; in training rank 1 would wait in another
    collective). Rank 1 makes filler generate calls and a filler log-prob pass until the busiest rank is done, and
    both finish with their own samples; gathering changes none of them. Shown failing: with the gathered context
    trusted to keep forwards local (rank 1 returning early: the old ``synced = ... and not self.local_forwards``)
    the gathered case hangs; without the filler log-prob pass the partitioned beam case hangs."""
    run_cmd([*ACCELERATE_LAUNCH, "--config_file", str(_zero3_partition_all(tmp_path)),
             str(ROOT / "tests/assets/hf_engine_uneven_turns.py"), str(tmp_path)],
            timeout=300, env={**ENV, "PYTHONPATH": str(ROOT)})  # a hang fails the test at the timeout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["partitioned"] == r["params"] > 0 for r in ranks)
    cases = ranks[0]["cases"]
    assert sorted(cases) == ["gathered/beams", "gathered/sample", "partitioned/beams", "partitioned/sample"]
    for name, case in cases.items():
        assert len(case["completions"]) == 5 and all(1 <= len(c) <= 3 for c in case["completions"]), name
        assert [len(lp) for lp in case["logprobs"]] == [len(c) for c in case["completions"]], name
        assert all(v < 0 for lp in case["logprobs"] for v in lp), name
        assert ranks[1]["cases"][name] == {"completions": [], "logprobs": []}
    for decoding in ("sample", "beams"):  # the same seeds: gathering the parameters changes no sample
        gathered, partitioned = cases[f"gathered/{decoding}"], cases[f"partitioned/{decoding}"]
        assert gathered["completions"] == partitioned["completions"]
        assert sum(gathered["logprobs"], []) == pytest.approx(sum(partitioned["logprobs"], []), abs=1e-4)


@pytest.mark.slow
def test_a_trl_tools_script_with_an_async_tool_on_the_hf_engine(tmp_path):
    """An async tool (awaited by the rollout) on the HF engine: samples call it, its results are masked out of the
    loss, and the steps train. (That a tools script learns is shown on vLLM, the default engine, above; the turn loop
    is the same for both engines.)"""
    result = _run_tool_script(tmp_path, "hf", "async", steps=2)
    assert result["engine"] == "HFEngine"
    steps = [h for h in result["history"] if "reward" in h]
    assert len(steps) == 2 and all(h["tools/call_frequency"] > 0 for h in steps)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result["history"] if "loss" in h)
    _check_masks(result)


@pytest.mark.slow
def test_mask_truncated_completions_with_tools(tmp_path):
    """With tools, completions cut at the budget are masked out; the tensors keep their sizes (a crash before).
    In the final rollout, some rows are cut and train no token, and every other row's last trained token ends the
    model's turn (a cut row that still trained would end elsewhere). Mutation tried: mask_truncated_completions
    not applied to tool episodes -> rows ending mid-turn train."""
    result = _run_tool_script(tmp_path, "hf", "sync", steps=2, extra={"mask_truncated_completions": True,
                                                                        "max_completion_length": 24})
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result["history"] if "loss" in h)
    assert any(h["completions/clipped_ratio"] > 0 for h in result["history"] if "reward" in h)
    ends = result["ends"]
    assert len(ends) == result["expected_rows"] and None in ends, ends  # the cut rows are masked whole
    assert {e for e in ends if e is not None} <= {"<|im_end|>", "<|endoftext|>"}, ends


class LuckyEnv:
    """A TRL environment: reset per episode with the dataset row, one tool, and its own reward."""

    resets: list[str] = []

    def reset(self, **row) -> str:
        LuckyEnv.resets.append(row["prompt"][-1]["content"])
        self.calls = 0
        return " Ask the tool."

    def lucky_number(self) -> str:
        """Returns today's lucky number.

        Returns:
            The lucky number, as digits.
        """
        self.calls += 1
        return "7"

    def get_reward(self) -> float:
        return float(self.calls > 0)


def _hf_trainer(tmp_path, monkeypatch, **kwargs):
    from trl import GRPOConfig

    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutGRPOTrainer

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=kwargs.pop("max_completion_length", 40), max_steps=2, learning_rate=1e-2,
                      logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0)
    return NRolloutGRPOTrainer(args=args, **kwargs)


@pytest.mark.slow
def test_environment_factory_resets_one_environment_per_sample(tmp_path, monkeypatch):
    from trl_nrollout.builtin import resolve_model, tool_dataset

    def tool_results_match_environment(completions, environments, **kwargs):
        """Reward kwargs carry each sample's environment: it ran every tool call the sample's messages show (and
        maybe one more, whose result did not fit the completion budget and was dropped, as in TRL)."""
        for messages, env in zip(completions, environments, strict=True):
            assert env.calls - 1 <= sum(m.get("role") == "tool" for m in messages) <= env.calls
        return [0.0] * len(completions)

    LuckyEnv.resets.clear()
    dataset = tool_dataset(32)
    trainer = _hf_trainer(tmp_path, monkeypatch, model=resolve_model("builtin:tiny-qwen2-tools"),
                          reward_funcs=[tool_results_match_environment], train_dataset=dataset,
                          environment_factory=LuckyEnv)
    trainer.train()
    assert len(LuckyEnv.resets) >= 2 * 16 and set(LuckyEnv.resets) <= {r[-1]["content"] for r in dataset["prompt"]}
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert all("rewards/LuckyEnv/mean" in h for h in logged)  # get_reward is a reward function, as in TRL
    batch = trainer._generate_and_score_completions([dict(dataset[0])] * 4)
    prompt = trainer.processing_class.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()])
    assert prompt.count("Ask the tool.") == 1  # the observation reset() returned, appended to the prompt
    assert len(trainer.environments) == 4 and len({id(e) for e in trainer.environments}) == 4


@pytest.mark.slow
def test_rollout_func_generates_and_its_fields_reach_the_rewards(tmp_path, monkeypatch):
    from trl_nrollout.builtin import digit_fraction, digits_dataset
    from trl_nrollout.rollout.types import SamplingOptions

    def my_rollout(prompts, trainer):
        """A user's rollout on the trainer's engine: its own sampling, the last token of each sample masked."""
        prompt_ids = [trainer.processing_class(text=p)["input_ids"] for p in prompts]
        batch = trainer.rollout_engine.generate_expanded(prompt_ids, trainer.num_generations,
                                                         SamplingOptions(max_tokens=6, temperature=1.0, seed=1))
        return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
                "env_mask": [[1] * (len(c) - 1) + [0] for c in batch.completion_ids],
                "source": ["my_rollout"] * len(prompts)}

    seen = []

    def reward(completions, source, **kwargs):
        seen.extend(source)
        return [digit_fraction(c) for c in completions]

    trainer = _hf_trainer(tmp_path, monkeypatch, model="builtin:tiny-qwen2", reward_funcs=[reward],
                          train_dataset=digits_dataset(32), rollout_func=my_rollout)
    trainer.train()
    assert seen and set(seen) == {"my_rollout"}
    batch = trainer._generate_and_score_completions([dict(digits_dataset(4)[0])] * 4)
    lengths = batch["completion_mask"].sum(-1)
    assert (batch["completion_ids"].shape[1] <= 6) and bool((lengths > 0).all())
    for row, n in enumerate(lengths.tolist()):  # env_mask: the last token of each sample is not trained on
        assert batch["tool_mask"][row, n - 1] == 0 and batch["tool_mask"][row, : n - 1].all()
    with pytest.raises(ValueError, match="rollout_func must return keys"):
        trainer.rollout_func = lambda prompts, t: {"prompt_ids": []}
        trainer._generate_and_score_completions([dict(digits_dataset(4)[0])] * 4)


@pytest.mark.slow
def test_tool_results_get_no_advantage_reward_or_kl(tmp_path, monkeypatch):
    """Tokens the policy did not sample (a rollout_func's env_mask: here each sample's last token) are outside the
    estimators' response mask: the outcome reward is credited on the last sampled token, REINFORCE++ whitens over
    sampled tokens only, and the KL in the reward sums over sampled tokens only (as verl's multi-turn mask)."""
    import trl_nrollout.trainer.grpo as trainer_module
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.algos.losses import kl_penalty
    from trl_nrollout.builtin import digit_fraction, digits_dataset
    from trl_nrollout.rollout.types import SamplingOptions

    def my_rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class(text=p)["input_ids"] for p in prompts]
        batch = trainer.rollout_engine.generate_expanded(prompt_ids, trainer.num_generations,
                                                         SamplingOptions(max_tokens=6, temperature=1.0, seed=2,
                                                                         ignore_eos=True))
        return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
                "env_mask": [[1] * (len(c) - 1) + [0] for c in batch.completion_ids]}

    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4,
                          max_completion_length=6, max_steps=1, learning_rate=1e-2, report_to="none", use_cpu=True,
                          save_strategy="no", seed=0, adv_estimator="reinforce_plus_plus", use_kl_in_reward=True,
                          kl_coef=0.5, beta=0.0)
    trainer = NRolloutGRPOTrainer(model="builtin:tiny-qwen2", args=args, train_dataset=digits_dataset(32),
                                  reward_funcs=[lambda completions, **kw: [digit_fraction(c) for c in completions]],
                                  rollout_func=my_rollout)
    with torch.no_grad():  # the reference drifts from the policy, so the KL is not zero
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.model.train()
    batch = trainer._generate_and_score_completions([dict(digits_dataset(4)[0])] * 4)
    sampled = (batch["completion_mask"] * batch["tool_mask"]).float()
    tool = batch["completion_mask"].float() - sampled
    assert bool((tool.sum(-1) == 1).all()) and bool((sampled.sum(-1) == 5).all())
    adv = batch["advantages"]
    assert bool((adv[tool.bool()] == 0).all())  # the last (masked) token gets no advantage
    assert float((adv * sampled).sum() / sampled.sum()) == pytest.approx(0.0, abs=1e-5)  # whitened over sampled
    assert bool((adv * sampled != 0).any())
    # the KL penalty in the reward: the mean over samples of (the sequence's KL / its sampled tokens)
    ids = [row[m.bool()].tolist() for row, m in zip(batch["completion_ids"], batch["completion_mask"])]
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    micro = trainer.layout.old_log_prob
    old = trainer.logprob_passes.log_probs(trainer.model, prompts, ids, micro)
    ref = trainer.logprob_passes.log_probs(trainer.ref_model, prompts, ids, micro)
    per_token = kl_penalty(old, ref, args.kl_penalty) * sampled[:, :old.shape[1]]
    expected = float((per_token.sum(-1) / sampled.sum(-1)).mean())
    logged = trainer._metrics["train"]["actor/reward_kl_penalty"][-1]
    assert logged == pytest.approx(expected, rel=1e-4) and expected > 0
    with_tool = float(((kl_penalty(old, ref, args.kl_penalty) * batch["completion_mask"]).sum(-1)
                       / batch["completion_mask"].sum(-1)).mean())
    assert abs(logged - with_tool) > 1e-4 * abs(with_tool)  # the tool tokens' KL would have shown


def _paired(sample: dict) -> bool:
    """A trained sample's tool results came from its own environment: each is the environment's number, one per
    call it served (the last call's result may be dropped when it does not fit the budget, as in TRL)."""
    results, returned = sample["results"], sample["returned"]
    return results in (returned, returned[:-1]) and all(r == str(sample["ident"]) for r in results)


@pytest.mark.slow
@pytest.mark.vllm
def test_partial_environment_episodes_keep_their_environment_across_steps_and_restart_after_a_checkpoint(tmp_path):
    """environment_factory with rollout_partial=True (tests/assets/env_partial.py: an environment whose tool returns
    its own number). Across steps, every trained sample's tool results came from its own environment, which the
    reward functions get as ``environments=`` in sample order; no environment serves two trained samples of a step;
    some samples trained at a step after the one that reset their environment (their episode was in flight across
    a weight sync) and called the tool. The checkpoint at step 2 keeps the pool's groups without their episodes (no
    sample started), said in a log line; the resumed run starts those groups again with new environments (each
    trained sample's environment reset after the resume, staleness 0 at step 3, the results paired), said in a log
    line. Mutations tried: new groups drawing environments that episodes in flight hold (``busy`` ignored) -> the
    pairing fails; the checkpoint keeping the episodes (``_pool_to_save`` returning the pool) -> the saved-pool
    check fails; with that, the resumed pool's episodes also continued with new environments (``_restore_env_groups``
    not restarting the samples) -> the pairing fails; the reward's environments in another order than the trained
    samples' (``mine[::-1]``) -> the pairing fails."""
    run_script_in_process(ROOT / "tests/assets/env_partial.py", str(tmp_path), env=ENV)
    result = json.loads((tmp_path / "result.json").read_text())
    full, resumed = result["full"], result["resumed"]
    assert [c["step"] for c in full] == [0, 1, 2] and [c["step"] for c in resumed] == [2]
    carried = 0
    for at, call in enumerate(full + resumed):
        samples = call["samples"]
        assert len(samples) == 8 and all(_paired(s) for s in samples), samples
        assert len({s["ident"] for s in samples}) == len(samples)  # one environment per trained sample
        if 0 < at < len(full):  # reset before the previous step's rewards: in flight across a step
            carried += sum(1 for s in samples if s["serial"] <= full[at - 1]["resets"] and s["results"])
    assert carried, "no sample with tool calls was carried across a step with its environment"
    assert any(s["results"] for c in full for s in c["samples"]), "no sample called the tool"
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / "nrollout_partial_rank0.json").read_text())
    assert saved and all(s["episode"] is None and not s["turn_ids"] for g in saved for s in g["samples"])
    assert any("without their" in line and "episodes in flight" in line for line in result["lines"])
    assert any("resumed pool's" in line and "new environments" in line for line in result["lines"])
    assert all(s["serial"] > result["resets_at_resume"] for s in resumed[0]["samples"])
    step3 = [h for h in result["resumed_history"] if "partial/staleness_max" in h and h["step"] == 3]
    assert len(step3) == 1 and step3[0]["partial/staleness_max"] == 0
