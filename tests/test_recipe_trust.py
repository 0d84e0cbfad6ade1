"""A recipe from the Hub is data, not code (:mod:`trl_nrollout.recipe.trust`): a shared recipe cannot enable
``trust_remote_code`` or import reward modules unless the launching command line allows it; local recipes are the
user's own and unrestricted. Hub recipes come from a pre-populated offline cache, as in test_hub.py."""

from __future__ import annotations

import pytest

from tests.conftest import load_recipe, populate_cache
from trl_nrollout.cli import main
from trl_nrollout.recipe.trust import (
    UntrustedRecipeError,
    enforce_recipe_trust,
    module_allowed,
    parse_recipe_command,
    recipe_requests,
)

REMOTE = b"""\
model_name_or_path: someone/custom-arch
model_init_kwargs:
  trust_remote_code: true
reward_funcs: [digits]
max_steps: 1
"""
REWARD_IMPORT = b"""\
reward_funcs: [digits, "tests.assets.rewards_for_tests:constant_for_some_prompts"]
max_steps: 1
"""


def _launcher():
    return load_recipe()


def test_hub_recipe_with_trust_remote_code_is_refused_naming_key_and_flag(offline_cache):
    populate_cache(offline_cache, "someone/recipe", {"config.yaml": REMOTE})
    grpo = _launcher()
    with pytest.raises(UntrustedRecipeError) as err:
        grpo._resolve_recipe(["--config", "hf://someone/recipe/config.yaml"])
    assert "model_init_kwargs.trust_remote_code" in str(err.value) and "--trust-remote-code" in str(err.value)


def test_with_the_flag_it_loads_and_the_setting_applies(offline_cache, monkeypatch):
    populate_cache(offline_cache, "someone/recipe", {"config.yaml": REMOTE})
    grpo = _launcher()
    argv, kind = grpo._resolve_recipe(["--config", "hf://someone/recipe/config.yaml", "--trust-remote-code",
                                 "--output_dir", "/tmp/x", "--use_cpu", "true", "--report_to", "none"])
    assert "--trust-remote-code" not in argv and argv[argv.index("--config") + 1].endswith("config.yaml")
    assert kind == "grpo"
    from trl import TrlParser

    from trl_nrollout.config import NRolloutConfig

    script, training = TrlParser((grpo.ScriptArguments, NRolloutConfig)).parse_args_and_config(argv)
    assert script.model_name_or_path == "someone/custom-arch"
    assert training.model_init_kwargs["trust_remote_code"] is True


def test_reward_module_outside_the_allow_list_is_refused(offline_cache):
    populate_cache(offline_cache, "someone/rewards", {"config.yaml": REWARD_IMPORT})
    grpo = _launcher()
    ref = "hf://someone/rewards/config.yaml"
    with pytest.raises(UntrustedRecipeError, match=r"--allow-reward-module tests\.assets\.rewards_for_tests"):
        grpo._resolve_recipe(["--config", ref])
    with pytest.raises(UntrustedRecipeError):  # another module allowed is not enough
        grpo._resolve_recipe(["--config", ref, "--allow-reward-module", "mypkg.rewards"])
    grpo._resolve_recipe(["--config", ref, "--allow-reward-module", "tests.assets"])  # a parent package allows
    grpo._resolve_recipe(["--config", ref, "--allow-reward-module=tests.assets.rewards_for_tests"])


def test_local_recipes_are_unchanged(tmp_path):
    local = tmp_path / "mine.yaml"
    local.write_bytes(REMOTE + b"reward_funcs: ['tests.assets.rewards_for_tests:constant_for_some_prompts']\n")
    argv, _ = _launcher()._resolve_recipe(["--config", str(local)])
    assert argv[argv.index("--config") + 1] == str(local)


def test_pull_shows_what_the_recipe_asks_for(offline_cache, capsys):
    populate_cache(offline_cache, "someone/recipe", {"config.yaml": REMOTE})
    assert main(["recipe", "pull", "hf://someone/recipe/config.yaml"]) == 0
    out = capsys.readouterr().out
    assert "model: someone/custom-arch" in out and "reward functions: digits" in out
    assert "asks for trust_remote_code at model_init_kwargs.trust_remote_code" in out and "--trust-remote-code" in out
    populate_cache(offline_cache, "someone/rewards", {"config.yaml": REWARD_IMPORT})
    assert main(["recipe", "pull", "hf://someone/rewards/config.yaml"]) == 0
    out = capsys.readouterr().out
    assert "trust_remote_code: not requested" in out
    assert "--allow-reward-module tests.assets.rewards_for_tests" in out


@pytest.mark.parametrize("data, keys", [
    ({"model_init_kwargs": {"trust_remote_code": True}}, ["model_init_kwargs.trust_remote_code"]),
    ({"model_init_kwargs": '{"trust_remote_code": true}'}, ["model_init_kwargs.trust_remote_code"]),  # JSON text
    ({"trust_remote_code": "true"}, ["trust_remote_code"]),
    ({"a": [{"b": {"trust_remote_code": 1}}]}, []),  # 1 is not a YAML boolean true; TRL would not read it either
    ({"a": [{"b": {"trust_remote_code": True}}]}, ["a[0].b.trust_remote_code"]),
    ({"model_init_kwargs": {"trust_remote_code": False}}, []),
])
def test_trust_remote_code_is_found_wherever_it_is(data, keys):
    assert list(recipe_requests(data).trust_remote_code_keys) == keys


def test_flags_and_allow_list_rules():
    cmd = parse_recipe_command(["--x", "1", "--trust-remote-code", "--allow-reward-module", "a.b,c", "--config=r.yaml",
                                "--allow-reward-module=d", "--trainer", "ppo", "--max_steps", "-1"])
    assert cmd.rest == ["--x", "1", "--max_steps", "-1"] and cmd.trust_remote_code
    assert cmd.allow_reward_modules == ("a.b", "c", "d") and cmd.config == "r.yaml" and cmd.trainer == "ppo"
    plain = parse_recipe_command(["--configuration", "x", "--trainers", "y"])  # no abbreviation: TRL's options
    assert plain.rest == ["--configuration", "x", "--trainers", "y"] and plain.config is None and not plain.trainer
    assert module_allowed("a.b.c", ["a.b"]) and not module_allowed("a.bc", ["a.b"])
    with pytest.raises(UntrustedRecipeError, match="needs a module name"):
        parse_recipe_command(["--allow-reward-module"])
    assert enforce_recipe_trust({"reward_funcs": "digits"}, "hf://x/y/c.yaml").reward_funcs == ("digits",)


def test_a_shared_recipes_agent_is_code_the_user_must_allow():
    """A recipe's ``agent: package.module:function`` imports code as a reward function's module does: a shared
    recipe that names one is refused unless the module is allowed, and the summary shows it."""
    data = {"agent": "my_agents.search:agent", "reward_funcs": ["digits"]}
    req = recipe_requests(data)
    assert req.agent == "my_agents.search:agent" and req.reward_modules == ("my_agents.search",)
    assert "agent: my_agents.search:agent" in req.summary()
    with pytest.raises(UntrustedRecipeError, match="names agent my_agents.search:agent.*--allow-reward-module "
                                                   "my_agents.search"):
        enforce_recipe_trust(data, "hf://x/y/c.yaml")
    assert enforce_recipe_trust(data, "hf://x/y/c.yaml", allow_reward_modules=["my_agents"]).agent == req.agent
