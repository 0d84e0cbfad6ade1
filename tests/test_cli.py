"""``trl-nrollout plan``: in-process through ``main``, and once through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trl_nrollout.cli import COMMANDS, _build_parser, main

EXAMPLE_FLAGS = ["--num-processes", "6", "--rollout-tp-size", "2", "--train-batch-size", "60", "--rollout-n", "12",
                 "--log-prob-micro-batch-size", "48"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def console_script() -> str:
    found = shutil.which("trl-nrollout", path=str(Path(sys.executable).parent)) or shutil.which("trl-nrollout")
    if found is None:
        pytest.skip("the trl-nrollout console script is not installed")
    return found


# ---------------------------------------------------------------------------------------------- worked example
def test_worked_example_table(capsys):
    code, out, err = run(capsys, *EXAMPLE_FLAGS)
    assert code == 0 and err == ""
    for text in ("rollout engines              6 / rollout_tp_size=2 = 3", "(0,1), (2,3), (4,5)",
                 "prompts per engine           60 / 3 = 20", "20 x n=12 = 240", "3 x 240 = 720",
                 "8 sequences per device per forward (log_prob_micro_batch_size=48 // 6 ranks)"):
        assert text in out
    assert "memory per engine" not in out  # no model given: no memory table


def test_worked_example_json(capsys):
    code, out, _ = run(capsys, *EXAMPLE_FLAGS, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["num_engines"] == 3 and d["engine_ranks"] == [[0, 1], [2, 3], [4, 5]]
    assert d["prompts_per_engine"] == 20 and d["samples_per_engine"] == 240 and d["total_samples"] == 720
    assert d["log_prob_micro_batch_size_per_device"] == 8 and d["memory"] is None


def test_underscore_flags_and_per_device_micro_batch(capsys):
    code, out, _ = run(capsys, "--num_processes", "6", "--rollout_tp_size", "2", "--train_batch_size", "60",
                       "--rollout_n", "12", "--log-prob-micro-batch-size-per-device", "8", "--json")
    assert code == 0 and json.loads(out)["log_prob_micro_batch_size_per_device"] == 8


# ---------------------------------------------------------------------------------------------- recipe YAML
def test_yaml_recipe_flags_override_and_unknown_keys_ignored(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "n_gpus_per_node: 6\nrollout_tp_size: 2\ntrain_batch_size: 60\nrollout_n: 12\n"
        "log_prob_micro_batch_size_per_device: 4\n"
        "learning_rate: 1.0e-6\noutput_dir: runs/x\nbeta: 0.0\n"  # trainer options: ignored
    )
    code, out, _ = run(capsys, "--config", str(recipe), "--json")
    d = json.loads(out)
    assert code == 0 and d["num_engines"] == 3 and d["log_prob_micro_batch_size_per_device"] == 4
    code, out, _ = run(capsys, "--config", str(recipe), "--rollout-tp-size", "3", "--rollout-n", "8", "--json")
    d = json.loads(out)
    assert code == 0 and d["num_engines"] == 2 and d["rollout_n"] == 8 and d["total_samples"] == 480


def test_yaml_trl_aliases(tmp_path, capsys):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("num_processes: 2\ntrain_batch_size: 8\nnum_generations: 4\nvllm_tensor_parallel_size: 2\n")
    code, out, _ = run(capsys, "--config", str(recipe), "--json")
    d = json.loads(out)
    assert code == 0 and d["rollout_n"] == 4 and d["num_engines"] == 1


def test_the_default_recipe_plans_what_it_trains(capsys):
    """`plan` on the shipped default recipe gives the layout the demo trains with (1 process, 8 prompts x 8)."""
    default = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "default.yaml"
    code, out, _ = run(capsys, "--config", str(default), "--no-memory", "--json")
    plan = json.loads(out)
    assert code == 0
    assert plan["num_engines"] == 1 and plan["total_samples"] == 64 and plan["samples_per_rank"] == 64


@pytest.mark.parametrize("content,message", [("- a\n- b\n", "must hold a mapping"), ("a: [\n", "not valid YAML")])
def test_bad_yaml(tmp_path, capsys, content, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    code, _, err = run(capsys, "--config", str(recipe))
    assert code == 2 and message in err


def test_missing_yaml(tmp_path, capsys):
    code, _, err = run(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml" in err


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-processes", "6", "--rollout-tp-size", "2", "--train-batch-size", "50", "--rollout-n", "12"],
         "train_batch_size=50 is not divisible by the 3 rollout engines (6 processes / rollout_tp_size=2); "
         "use 48 or 51."),
        ([*EXAMPLE_FLAGS, "--log-prob-micro-batch-size-per-device", "8"],
         "log_prob_micro_batch_size=48 and log_prob_micro_batch_size_per_device=8 are both set"),
        (["--num-processes", "6", "--rollout-tp-size", "4", "--train-batch-size", "60", "--rollout-n", "12"],
         "rollout_tp_size=4 does not divide the 6 processes"),
        (["--train-batch-size", "4"], "rollout_n is required"),
        (["--rollout-n", "1", "--train-batch-size", "4"], "rollout_n=1 but adv_estimator='grpo'"),
        ([*EXAMPLE_FLAGS, "--max-prompt-length", "512", "--max-completion-length", "512",
          "--log-prob-max-token-len-per-device", "1000"],
         "log_prob_max_token_len_per_device=1000 is smaller than one sequence"),
        ([*EXAMPLE_FLAGS, "--n-values", "1,x"], "--n-values='1,x'"),
    ],
)
def test_invalid_exits_2_with_the_message_on_stderr(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and err.startswith("trl-nrollout plan: error: ")


def test_usage(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    assert "--rollout-tp-size" in capsys.readouterr().out
    assert main(["plan", "--rollout-n", "many"]) == 2  # argparse: invalid int
    assert main(["frobnicate"]) == 2
    capsys.readouterr()


def test_parser_is_built_from_the_command_table():
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


# ---------------------------------------------------------------------------------------------- memory
def test_plan_with_the_builtin_model(capsys, tiny_model_path):
    code, out, _ = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", "builtin:tiny-qwen2",
                       "--max-prompt-length", "100", "--max-completion-length", "60", "--json")
    assert code == 0
    m = json.loads(out)["memory"]
    assert m["kv_bytes_per_token"] == 1024 and m["kv_bytes_per_token_per_gpu"] == 512  # float32, 1 KV head per GPU
    assert m["blocks_per_sequence"] == 10 and m["concurrent_sequences"] == 240
    assert m["kv_bytes_per_gpu"] == 240 * 10 * 16 * 512
    assert m["prefix_sharing_saves_bytes_per_gpu"] == (240 - 20) * 6 * 16 * 512
    assert m["num_parameters"] == 345_216 and m["weights_bytes_per_gpu"] == 345_216 * 4 // 2
    assert [r["n"] for r in m["kv_vs_n"]] == [1, 4, 8, 12, 16]

    code, out, _ = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", tiny_model_path, "--dtype", "bfloat16",
                       "--gpu-memory-gib", "1", "--n-values", "2,12,32")
    assert code == 0
    assert "2 x 2 layers x 2 KV heads x head_dim 32 x 2 B = 512 B" in out
    assert "KV cache vs n" in out and "fits" in out and "note: max_prompt_length not set: 512 assumed." in out


def test_plan_with_a_model_config_file(tmp_path, capsys):
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", str(tmp_path), "--json")
    m = json.loads(out)["memory"]
    assert code == 0 and m["kv_bytes_per_token"] == 57344 and m["kv_heads_per_gpu"] == 2
    code, _, err = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", str(tmp_path), "--dtype", "int3")
    assert code == 2 and "dtype='int3' is not a known dtype" in err


def test_model_heads_must_split_over_tp(capsys, tiny_model_path):
    # builtin:tiny-qwen2 has 4 attention heads: tp 3 cannot split them.
    code, _, err = run(capsys, "--num-processes", "6", "--rollout-tp-size", "3", "--train-batch-size", "60",
                       "--rollout-n", "12", "--model-name-or-path", "builtin:tiny-qwen2")
    assert code == 2 and "rollout_tp_size=3 cannot split the model's 4 attention heads" in err
    assert "use rollout_tp_size 1 or 2" in err


def test_unreachable_model_keeps_the_layout(capsys):
    code, out, err = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", "no-such-org/no-such-model-xyz", "--json")
    d = json.loads(out)
    assert code == 0 and d["num_engines"] == 3 and "error" in d["memory"]
    assert "warning: memory estimate unavailable" in err
    code, out, _ = run(capsys, *EXAMPLE_FLAGS, "--model-name-or-path", "no-such-org/x", "--no-memory", "--json")
    assert code == 0 and json.loads(out)["memory"] is None


# ---------------------------------------------------------------------------------------------- real processes
def test_console_script_worked_example_and_invalid_layout():
    exe = console_script()
    ok = subprocess.run([exe, "plan", *EXAMPLE_FLAGS, "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert (d["num_engines"], d["prompts_per_engine"], d["samples_per_engine"], d["total_samples"]) == (3, 20, 240, 720)
    assert d["engine_ranks"] == [[0, 1], [2, 3], [4, 5]] and d["log_prob_micro_batch_size_per_device"] == 8
    bad = subprocess.run([exe, "plan", "--num-processes", "6", "--rollout-tp-size", "2", "--train-batch-size", "50",
                          "--rollout-n", "12"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "train_batch_size=50 is not divisible by the 3 rollout engines" in bad.stderr and "use 48 or 51" in bad.stderr


def test_plan_without_a_model_imports_no_torch():
    code = (
        "import sys\n"
        "from trl_nrollout.cli import main\n"
        f"assert main({['plan', *EXAMPLE_FLAGS]!r}) == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'trl', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_model_short_flag_gives_the_memory_estimate(capsys):
    """`--model` (the README's spelling) is `--model-name-or-path`: the plan then carries the memory estimate."""
    code, out, _ = run(capsys, "--num-processes", "1", "--train-batch-size", "8", "--rollout-n", "8", "--model",
                       "builtin:tiny-qwen2", "--json")
    assert code == 0
    assert json.loads(out)["memory"]["kv_vs_n"]
