"""Each user-facing error once: the raise sites no other test reached (issue 62), triggered the way a user does
(a config built with ``NRolloutConfig(...)`` / ``NRolloutPPOConfig(...)``, a dataset file, a Hub reference, a push
folder, a command line, a rollout rank's report through a real torch store), each message checked for the option
and the value it must name (and the fix where the message gives one).

Fast: no engine, no model but a tiny critic, no process. The Hub's answers come from a real HTTP server on
127.0.0.1 in this process (``huggingface_hub`` pointed at it): its status codes and ``X-Error-Code`` headers are what
the Hub sends, parsed by ``huggingface_hub`` itself. The rollout-rank reports cross a real ``TCPStore``; what stands
in for a process is said where it does (a failing engine start, a frozen process's last heartbeat).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.conftest import COMMIT, populate_cache
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.errors import DatasetError, InputError
from trl_nrollout.trainer.ppo import NRolloutPPOConfig

BASE = dict(use_cpu=True, report_to="none")


def _config(cls, tmp_path, **options):
    return cls(output_dir=str(tmp_path / "out"), **BASE, **options)


def _says(message: str, *parts: str) -> None:
    missing = [p for p in parts if p not in message]
    assert not missing, f"the message lacks {missing}: {message}"


# ---------------------------------------------------------------------------------------------- config options
# (options, WORLD_SIZE, what the message must name). Each entry is one raise site of config/derive.py,
# config/checks.py or config/options.py; the comment names the rule.
CONFIG_ERRORS = {
    # config/derive.py: TRL's names and their verl twins
    "scale_rewards": (dict(scale_rewards="rank"), 1, ["scale_rewards='rank'", "'group', 'batch', 'none'"]),
    "multi_objective_aggregation": (dict(multi_objective_aggregation="mean"), 1,
                                    ["multi_objective_aggregation='mean'", "'sum_then_normalize'"]),
    "gdpo_with_kl_in_reward": (dict(multi_objective_aggregation="normalize_then_sum", use_kl_in_reward=True), 1,
                               ["normalize_then_sum", "set use_kl_in_reward=False"]),
    "use_vllm_with_hf": (dict(use_vllm=True, rollout_backend="hf"), 1, ["use_vllm=True", "rollout_backend='hf'"]),
    "vllm_importance_sampling_mode": (
        dict(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_clip"), 1,
        ["vllm_importance_sampling_mode='token_clip'", "'token_truncate'"]),
    "trl_batch_against_verl": (dict(train_batch_size=4, rollout_n=2, per_device_train_batch_size=3), 1,
                               ["per_device_train_batch_size=3", "train_batch_size=4",
                                "remove per_device_train_batch_size"]),
    "generation_batch_against_verl": (dict(train_batch_size=4, rollout_n=2, generation_batch_size=6), 1,
                                      ["generation_batch_size=6", "train_batch_size=4 x rollout_n=2 = 8",
                                       "remove it"]),
    "rollout_n_against_num_generations": (dict(rollout_n=4, num_generations=2), 1,
                                          ["rollout_n=4", "num_generations=2", "set only one"]),
    "sp_micro_batch": (dict(sequence_parallel_size=2, train_batch_size=2, rollout_n=2,
                            ppo_micro_batch_size_per_device=1), 2,
                       ["sequence_parallel_size=2", "micro batch of 1", "ppo_micro_batch_size_per_device a multiple "
                        "of 2"]),
    # config/checks.py: one option out of range, or two that cannot run together
    "steps_span_rollouts": (dict(rollout_partial=True, per_device_train_batch_size=2, gradient_accumulation_steps=3,
                                 steps_per_generation=4, num_generations=2), 1,
                            ["rollout_partial=True", "span two rollouts", "gradient_accumulation_steps",
                             "rollout_partial=False"]),
    "pad_to_multiple_of_zero": (dict(pad_to_multiple_of=0), 1, ["pad_to_multiple_of=0", "positive whole number"]),
    "pad_to_multiple_of_text": (dict(pad_to_multiple_of="8"), 1, ["pad_to_multiple_of='8'"]),
    "temperature": (dict(temperature=-0.5), 1, ["temperature=-0.5", ">= 0"]),
    "generation_kwargs_reserved": (dict(generation_kwargs={"max_tokens": 10}), 1,
                                   ["generation_kwargs", "'max_tokens'", "use max_completion_length"]),
    "filter_groups_max_rounds": (dict(filter_groups_max_rounds=-1), 1, ["filter_groups_max_rounds=-1", ">= 0"]),
    "rollout_max_num_seqs": (dict(rollout_max_num_seqs=0), 1, ["rollout_max_num_seqs=0", ">= 1"]),
    "rollout_is_threshold": (dict(rollout_is="token", rollout_is_threshold=0.0), 1,
                             ["rollout_is_threshold=0.0", "> 0"]),
    "rollout_is_threshold_lower": (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0),
                                   1, ["rollout_is_threshold_lower=3.0", "rollout_is_threshold=2.0"]),
    "truncate_without_bounds": (dict(rollout_is="token", rollout_is_threshold=None), 1,
                                ["rollout_is_mode='truncate'", "set rollout_is_threshold=2.0"]),
    # config/options.py
    "vllm_mode": (dict(vllm_mode="remote"), 1, ["vllm_mode='remote'", "'colocate' or 'server'"]),
    "sp_without_padding_free": (dict(sequence_parallel_size=2, padding_free=False), 1,
                                ["sequence_parallel_size=2", "padding_free=False"]),
    # rollout/bridge.py split_world: the layout cannot split
    "rollout_ranks_leave_no_trainer": (dict(rollout_ranks=2), 2, ["rollout_ranks=2", "no process to train",
                                                                  "at most 1"]),
    # options no other test set: weight_sync_bucket_mb, rollout_enforce_eager, ref_log_prob_max_token_len_per_device
    "weight_sync_bucket_mb_nan": (dict(weight_sync_bucket_mb=float("nan")), 1,
                                  ["weight_sync_bucket_mb=nan", "finite", "256 (the default)"]),
    "weight_sync_bucket_mb_with_hf": (dict(weight_sync_bucket_mb=512, rollout_backend="hf"), 1,
                                      ["rollout_backend='hf'", "weight_sync_bucket_mb=512", "rollout_backend='vllm'"]),
    "rollout_enforce_eager_with_hf": (dict(rollout_enforce_eager=True, rollout_backend="hf"), 1,
                                      ["rollout_enforce_eager=True"]),
    "ref_log_prob_max_token_len": (dict(ref_log_prob_max_token_len_per_device=0), 1,
                                   ["ref_log_prob_max_token_len_per_device=0", "positive integer"]),
    # checks added after this file's first reading found them missing
    "weight_sync_bucket_mb_zero": (dict(weight_sync_bucket_mb=0), 1, ["weight_sync_bucket_mb=0", ">= 1", "256"]),
    "weight_sync_bucket_mb_fraction": (dict(weight_sync_bucket_mb=1.5), 1, ["weight_sync_bucket_mb=1.5", "whole"]),
    "trl_importance_sampling_cap": (
        dict(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=0.0), 1,
        ["rollout_is_threshold=0.0", "vllm_importance_sampling_cap", "> 0"]),
}


@pytest.mark.parametrize("options, world, parts", list(CONFIG_ERRORS.values()), ids=list(CONFIG_ERRORS))
def test_a_config_error_names_the_option_and_the_value(options, world, parts, tmp_path, monkeypatch):
    """Mutation tried: ``filter_groups_max_rounds < 0`` -> ``< -100`` in config/checks.py: its entry fails."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(InputError) as err:
        _config(NRolloutConfig, tmp_path, **options)
    _says(str(err.value), *parts)


PPO_ERRORS = {
    "critic_micro_batch": (dict(critic_ppo_micro_batch_size_per_device=0), ["critic_ppo_micro_batch_size_per_device=0"]),
    "critic_token_budget": (dict(critic_ppo_max_token_len_per_device=0), ["critic_ppo_max_token_len_per_device=0"]),
    "one_sample_rollout": (dict(per_device_train_batch_size=1), ["1 sample", "at least 2", "train_batch_size"]),
    "critic_weight_decay": (dict(critic_weight_decay=-0.1), ["critic_weight_decay=-0.1", ">= 0"]),
    "critic_max_grad_norm": (dict(critic_max_grad_norm=float("inf")), ["critic_max_grad_norm=inf", "finite"]),
}


@pytest.mark.parametrize("options, parts", list(PPO_ERRORS.values()), ids=list(PPO_ERRORS))
def test_a_ppo_config_error_names_the_option_and_the_value(options, parts, tmp_path):
    with pytest.raises(InputError) as err:
        _config(NRolloutPPOConfig, tmp_path, **{"per_device_train_batch_size": 2, **options})
    _says(str(err.value), *parts)


@pytest.mark.parametrize("value", [1, 64, 1024])
def test_weight_sync_bucket_mb_is_kept_for_the_vllm_engines(value, tmp_path):
    """A bucket bound the vLLM engines take is kept as given (the engine group reads ``value << 20`` bytes)."""
    cfg = _config(NRolloutConfig, tmp_path, weight_sync_bucket_mb=value, rollout_backend="vllm")
    assert cfg.weight_sync_bucket_mb == value
    assert cfg.vllm_engine_settings() == [f"weight_sync_bucket_mb={value}"]  # what the HF engine would refuse


def test_critic_model_name_or_path_is_where_the_critic_starts(tiny_model_path, tmp_path):
    """The critic of ``critic_model_name_or_path`` holds that model's decoder weights and a fresh one-label head."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.passes.critic import build_critic

    cfg = _config(NRolloutPPOConfig, tmp_path, critic_model_name_or_path=tiny_model_path, per_device_train_batch_size=2)
    critic = build_critic(cfg.critic_model_name_or_path, seed=cfg.seed)
    source = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert critic.config.num_labels == 1
    torch.testing.assert_close(critic.get_input_embeddings().weight, source.get_input_embeddings().weight)


def test_an_unknown_builtin_critic_names_the_value_and_the_choices():
    from trl_nrollout.passes.critic import build_critic

    with pytest.raises(ValueError) as err:
        build_critic("builtin:no-such-critic")
    _says(str(err.value), "'builtin:no-such-critic'", "builtin:tiny-qwen2")


# ---------------------------------------------------------------------------------------------- dataset files
DATASET_ERRORS = {
    "unknown_suffix": ("prompts.txt", b"Write a number.\n", {}, ["prompts.txt", "'.txt'", "'.jsonl'"]),
    "unreadable_parquet": ("prompts.parquet", b"not a parquet file", {}, ["prompts.parquet", "parquet file",
                                                                          "'prompt' column"]),
    "missing_prompt_column": ("prompts.jsonl", b'{"question": "Write a number."}\n', {"prompt_column": "text"},
                              ["dataset_prompt_column='text'", "['question']"]),
    "invalid_json_document": ("prompts.json", b'{"prompt": "a",\n "n": }\n', {}, ["prompts.json", "line 2",
                                                                                  "not valid JSON"]),
}


@pytest.mark.parametrize("name, data, kwargs, parts", list(DATASET_ERRORS.values()), ids=list(DATASET_ERRORS))
def test_a_dataset_error_names_the_file_and_the_rule(name, data, kwargs, parts, tmp_path):
    from trl_nrollout.recipe.data import load_prompts

    (tmp_path / name).write_bytes(data)
    with pytest.raises(DatasetError) as err:
        load_prompts(str(tmp_path / name), **kwargs)
    _says(str(err.value), *parts)


# ---------------------------------------------------------------------------------------------- Hub pulls
#: repo name -> (status, X-Error-Code) the local "Hub" answers for any of its files
HUB_ANSWERS = {"gated": (403, "GatedRepo"), "missing": (404, "RepoNotFound"), "norev": (404, "RevisionNotFound"),
               "nofile": (404, "EntryNotFound"), "nothub": (200, None)}


class _HubAnswers(BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's name
        parts = self.path.split("/")
        status, code = HUB_ANSWERS.get(parts[2] if len(parts) > 2 else "", (404, None))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubAnswers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def online_hub(hub_server, tmp_path, monkeypatch) -> Path:
    """``huggingface_hub`` online, its endpoint the local server, an empty cache (returned)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", hub_server)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub_server + "/{repo_id}/resolve/{revision}/{filename}")
    return cache


HUB_PULL_ERRORS = {
    "gated": ["hf://user/gated@v1/config.yaml", "is gated", "hf auth login"],
    "missing": ["hf://user/missing@v1/config.yaml", "no model repo user/missing", "check the name"],
    "norev": ["hf://user/norev@v1/config.yaml", "no revision 'v1'", "drop '@v1'"],
    "nofile": ["hf://user/nofile@v1/config.yaml", "no file 'config.yaml' at v1", "/tree/v1"],
    "nothub": ["hf://user/nothub@v1/config.yaml", "could not be downloaded", "not cached", "HF_ENDPOINT"],
}


@pytest.mark.parametrize("repo, parts", list(HUB_PULL_ERRORS.items()), ids=list(HUB_PULL_ERRORS))
def test_a_hub_pull_error_names_the_reference_and_the_fix(repo, parts, online_hub):
    """Mutation tried: ``except GatedRepoError`` turned into a clause that re-raises it: the gated entry fails."""
    from trl_nrollout.recipe.hub import HubError, resolve_config

    with pytest.raises(HubError) as err:
        resolve_config(f"hf://user/{repo}@v1/config.yaml")
    _says(str(err.value), "--config", *parts)


def test_pulling_a_recipe_whose_accelerate_config_lies_outside_its_folder(offline_cache, tmp_path):
    from trl_nrollout.recipe.hub import HubError, pull_recipe

    populate_cache(offline_cache, "user/recipes", {"grpo/config.yaml": b"accelerate_config: ../accelerate.yaml\n",
                                                   "accelerate.yaml": b"num_processes: 2\n"})
    with pytest.raises(HubError) as err:
        pull_recipe("hf://user/recipes/grpo/config.yaml", out=tmp_path / "out")
    _says(str(err.value), "../accelerate.yaml", "outside the recipe's folder", "copy")
    assert COMMIT in str(err.value)  # the cached file to copy by hand


# ---------------------------------------------------------------------------------------------- Hub pushes
PUSH_ERRORS = {
    "no_yaml": ({"notes.txt": "hello\n"}, ["holds no .yaml/.yml recipe"]),
    "two_candidates": ({"a.yaml": "rollout_n: 4\n", "b.yaml": "rollout_n: 8\n"},
                       ["cannot tell which YAML", "a.yaml, b.yaml", "name it config.yaml"]),
    "invalid_yaml": ({"config.yaml": "rollout_n: [4\n"}, ["recipe push:", "config.yaml", "not valid YAML"]),
}


@pytest.mark.parametrize("files, parts", list(PUSH_ERRORS.values()), ids=list(PUSH_ERRORS))
def test_a_push_error_names_the_folder_and_the_fix(files, parts, tmp_path):
    from trl_nrollout.recipe.hub import HubError, push_recipe

    folder = tmp_path / "recipe"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(HubError) as err:
        push_recipe(folder, "me/recipe", dry_run=True, versions={})
    _says(str(err.value), *parts)


# ---------------------------------------------------------------------------------------------- the recipe script
def test_a_recipe_option_without_its_value_is_a_one_line_error():
    from trl_nrollout.recipe.trust import parse_recipe_command

    with pytest.raises(InputError) as err:
        parse_recipe_command(["--trainer"])
    _says(str(err.value), "the command line", "--trainer", "expected one argument")


def test_an_agent_that_is_not_an_import_path_says_how_to_write_it():
    from trl_nrollout.recipe.rewards import resolve_import

    with pytest.raises(InputError) as err:
        resolve_import("mypkg.agents.solve", "agent")
    _says(str(err.value), "agent 'mypkg.agents.solve'", "'package.module:function'")


def test_an_answer_reward_on_a_dataset_without_answers_names_the_column():
    from trl_nrollout.recipe.rewards import exact_answer_reward, math_answer_reward

    for reward in (exact_answer_reward, math_answer_reward):
        with pytest.raises(KeyError, match="'answer' column"):
            reward(["42"], prompts=["What is 6 x 7?"])


# ---------------------------------------------------------------------------------------------- rollout ranks
@pytest.fixture
def store_pair():
    """A real libuv TCPStore (trainer rank 0 hosts it) and a client of it (a rollout rank's)."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=20))
    client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                        timeout=timedelta(seconds=20))
    yield torch.distributed.PrefixStore("b/", server), torch.distributed.PrefixStore("b/", client)


def _bridge(store, rank: int, timeout_s: float = 30.0):
    from trl_nrollout.rollout.bridge import Bridge, Roles

    return Bridge(Roles(world=2, rollout_ranks=1, local_world=2), rank, store, None, timeout_s)


def _error_within(seconds: float, call) -> BaseException:
    """What ``call()`` raised, run on a thread: a wait that never ends fails the test after ``seconds`` instead of
    hanging it."""
    met: list[BaseException] = []

    def run():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            met.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: the error was never raised"
    assert met, "it returned without an error"
    return met[0]


def _close(*bridges) -> None:
    for b in bridges:  # no watchdog left that could stop this process once the store is gone
        b.unwatch()
        b.finish()


def test_a_rollout_rank_whose_engine_fails_to_start_is_reported_to_the_trainers(store_pair):
    """The rollout rank's loop (``serve``) meets an error building its engine (a stand-in build that raises, as a
    GPU out of memory would): the trainers' ``RemoteEngines`` raise it, naming the rank, its process and the error.
    Mutation tried: ``value.get("kind") == "error"`` -> ``"failure"`` in Bridge.take: the trainers get the error
    dict as the engine's answer and fail with a KeyError instead; the test fails."""
    from trl_nrollout.rollout.bridge import RolloutRankError
    from trl_nrollout.rollout.ranks.client import RemoteEngines
    from trl_nrollout.rollout.ranks.serve import serve
    from trl_nrollout.rollout.ranks.state import RankState

    trainer, rollout = _bridge(store_pair[0], 0), _bridge(store_pair[1], 1)
    met: list[BaseException] = []

    def build_engine(settings):
        raise RuntimeError(f"CUDA out of memory building an engine of max_model_len={settings['max_model_len']}")

    def rollout_rank():
        try:
            serve(rollout, build_engine, RankState())
        except BaseException as err:  # noqa: BLE001 - what the rollout rank's process would die of
            met.append(err)

    thread = threading.Thread(target=rollout_rank, daemon=True)
    thread.start()
    try:
        err = _error_within(20, lambda: RemoteEngines(trainer, {"lookahead": 1, "max_model_len": 64},
                                                      max_model_len=64, bucket_bytes=1 << 20))
        thread.join(timeout=10)
    finally:
        _close(rollout, trainer)
    assert isinstance(err, RolloutRankError), err
    _says(str(err), "global rank 1 (rollout rank 0, process ", "failed: RuntimeError: CUDA out of memory",
          "max_model_len=64")
    assert len(met) == 1 and isinstance(met[0], RuntimeError)  # the rollout rank stops too


def test_a_rollout_rank_that_finished_while_awaited_is_named(store_pair, monkeypatch):
    from trl_nrollout.rollout import bridge as ranks

    monkeypatch.setattr(ranks, "LIVENESS_S", 0.0)  # check the sender at every poll (1 s in a launch)
    trainer, rollout = _bridge(store_pair[0], 0), _bridge(store_pair[1], 1)
    rollout.finish()
    try:
        err = _error_within(20, lambda: trainer.take("out/3/0", 1, "job 3's samples"))
    finally:
        _close(rollout, trainer)
    assert isinstance(err, ranks.RolloutRankError), err
    _says(str(err), "global rank 1 (rollout rank 0", "finished while this rank waited for job 3's samples")


def test_a_silent_rollout_rank_is_named_with_the_timeout_option(store_pair, monkeypatch):
    """The store holds what a process frozen 100 s ago left: its pid and its last heartbeat."""
    from trl_nrollout.rollout import bridge as ranks

    monkeypatch.setattr(ranks, "LIVENESS_S", 0.0)
    store_pair[1].set("pid/1", "node7:4242")
    store_pair[1].set("beat/1", f"{time.time() - 100}|generating job 3")
    trainer = _bridge(store_pair[0], 0, timeout_s=30.0)
    try:
        err = _error_within(20, lambda: trainer.take("out/3/0", 1, "job 3's samples"))
    finally:
        _close(trainer)
    assert isinstance(err, ranks.RolloutRankError), err
    _says(str(err), "global rank 1 (rollout rank 0, process node7:4242)", "rollout_rank_timeout_s=30",
          "last generating job 3", "job 3's samples")


def test_a_second_split_with_other_rollout_ranks_is_refused(tmp_path, monkeypatch):
    from trl_nrollout.rollout import bridge as ranks

    bridge = _bridge(torch.distributed.HashStore(), 0)
    monkeypatch.setattr(ranks, "_BRIDGE", bridge)
    try:
        with pytest.raises(ValueError) as err:
            _config(NRolloutConfig, tmp_path, rollout_ranks=2)
    finally:
        _close(bridge)
    _says(str(err.value), "rollout_ranks=2", "already split with rollout_ranks=1")


def test_rollout_ranks_after_torch_distributed_started_say_to_build_the_config_first(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(InputError) as err:
            _config(NRolloutConfig, tmp_path, rollout_ranks=1)
    finally:
        torch.distributed.destroy_process_group()
    _says(str(err.value), "rollout_ranks=1", "already started", "build NRolloutConfig first")


def test_a_cpu_trainer_is_refused_beside_cuda_engines(tmp_path, monkeypatch):
    """``use_cpu=True`` where vLLM runs on CUDA (the CPU default recipe on a GPU machine) is refused, naming both and
    the fix; the HF engine, a trainer on the GPU, or vLLM on the CPU are accepted. CUDA cannot run here: torch's
    ``cuda.is_available`` and vLLM's platform are stood in (a mock of the GPU machine, said here)."""
    from trl_nrollout.config.checks import cpu_trainer_cuda_engine_refusal
    from trl_nrollout.rollout.engines import platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platform, "vllm_available", lambda: True)
    monkeypatch.setattr(platform, "is_cpu_platform", lambda: False)
    why = cpu_trainer_cuda_engine_refusal(True, "auto")
    _says(why, "use_cpu=True", "on CUDA", "rollout_backend='auto'", "--use_cpu false", "rollout_backend='hf'")
    assert cpu_trainer_cuda_engine_refusal(True, "hf") is None
    assert cpu_trainer_cuda_engine_refusal(False, "vllm") is None
    monkeypatch.setattr(platform, "is_cpu_platform", lambda: True)
    assert cpu_trainer_cuda_engine_refusal(True, "vllm") is None


def test_the_config_runs_the_cpu_trainer_check(tmp_path, monkeypatch):
    from trl_nrollout.config import checks as config_checks

    monkeypatch.setattr(config_checks, "cpu_trainer_cuda_engine_refusal", lambda use_cpu, backend: f"refused {backend}")
    with pytest.raises(InputError, match="refused vllm"):
        _config(NRolloutConfig, tmp_path, rollout_backend="vllm")
