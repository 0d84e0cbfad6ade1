"""Every recipe in ``recipes/configs/`` loads its dataset through the project's own loader
(:func:`trl_nrollout.recipe.data.load_prompts`, as ``recipes/grpo.py`` calls it) and its reward functions score
rows of that dataset: a recipe that names a Hub dataset without the configuration or split the dataset needs, or
a prompt column or reward the dataset's columns do not serve, fails here rather than at launch on a GPU node."""

from __future__ import annotations

from dataclasses import fields

import pytest
import yaml

from tests.conftest import ROOT

RECIPES = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))


class HubDataset:
    """What a Hub dataset needs from a caller and holds: its configurations (None: it has none, so none may be
    named), its splits and a few rows of each configuration (its real columns, values of the real shape)."""

    def __init__(self, configs: tuple[str, ...] | None, splits: tuple[str, ...], rows: list[dict]) -> None:
        self.configs, self.splits, self.rows = configs, splits, rows


#: The Hub datasets the recipes name, as the Hub serves them (openai/gsm8k: configurations ``main`` and
#: ``socratic``, no default, splits train/test, ``question`` / ``answer`` columns, answers ending ``#### N``).
HUB_DATASETS = {
    "openai/gsm8k": HubDataset(
        configs=("main", "socratic"), splits=("train", "test"),
        rows=[{"question": "Tom has 2 apples and buys 3 more. How many apples does he have?",
               "answer": "Tom has 2 + 3 = <<2+3=5>>5 apples.\n#### 5"},
              {"question": "A box holds 12 eggs. How many eggs are in 4 boxes?",
               "answer": "4 * 12 = <<4*12=48>>48 eggs.\n#### 48"}]),
}


def hub_load_dataset(path: str, name: str | None = None, *, split: str | None = None, **kwargs):
    """The stand-in for the Hub's network (no test reaches huggingface.co): ``datasets.load_dataset(path, name,
    split=...)`` answered from :data:`HUB_DATASETS`, refusing what the Hub refuses, with the Hub's own words
    ("Config name is missing" for a dataset with several configurations and none named)."""
    from datasets import Dataset

    if path not in HUB_DATASETS:
        raise AssertionError(f"a recipe loads {path!r}, which this test does not describe: add it to HUB_DATASETS "
                             "with the configurations, splits and columns the Hub serves")
    hub = HUB_DATASETS[path]
    if hub.configs is not None and name is None:
        raise ValueError(f"Config name is missing.\nPlease pick one among the available configs: "
                         f"{list(hub.configs)}\nExample of usage:\n\t`load_dataset('{path}', '{hub.configs[0]}')`")
    if name is not None and name not in (hub.configs or ()):
        raise ValueError(f"BuilderConfig '{name}' not found. Available: {list(hub.configs or ())}")
    if split not in hub.splits:
        raise ValueError(f'Unknown split "{split}". Should be one of {list(hub.splits)}.')
    return Dataset.from_list(hub.rows)


def script_arguments(recipe: dict):
    """The recipe's ``ScriptArguments`` (the recipe script's own dataclass and defaults, for the keys it sets)."""
    from tests.conftest import load_recipe

    cls = load_recipe().ScriptArguments
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in recipe.items() if k in names})


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_its_dataset_and_scores_it(path, monkeypatch):
    import datasets

    from trl_nrollout.recipe.data import load_prompts
    from trl_nrollout.recipe.rewards import resolve_reward

    monkeypatch.setattr(datasets, "load_dataset", hub_load_dataset)
    recipe = yaml.safe_load(path.read_text())
    args = script_arguments(recipe)
    ds = load_prompts(args.dataset_name, split=args.dataset_split, prompt_column=args.dataset_prompt_column,
                      num_builtin=8, seed=0, config=args.dataset_config, system_prompt=args.dataset_system_prompt)
    assert len(ds) > 0 and "prompt" in ds.column_names
    if args.dataset_system_prompt:
        assert ds[0]["prompt"][0] == {"role": "system", "content": args.dataset_system_prompt}
    columns = {c: ds[c] for c in ds.column_names if c != "prompt"}  # what TRL passes a reward besides completions
    columns["completion_ids"] = [[1, 2, 3]] * len(ds)  # TRL passes every reward the completions' token ids too
    for spec in args.reward_funcs:
        reward = resolve_reward(spec)
        if "answer" in columns:  # a completion giving each row's reference answer scores 1.0
            right = [f"<answer>{a.rsplit('####', 1)[-1].strip()}</answer>" for a in columns["answer"]]
            assert reward(right, **columns) == [1.0] * len(ds), spec
        else:
            scores = reward(["123"] * len(ds), **columns)
            assert len(scores) == len(ds) and all(0.0 <= s <= 1.0 for s in scores), spec


def test_the_stand_in_refuses_what_the_hub_refuses():
    """The stand-in is strict where the Hub is: no configuration named, an unknown one or an unknown split."""
    with pytest.raises(ValueError, match="Config name is missing"):
        hub_load_dataset("openai/gsm8k", split="train")
    with pytest.raises(ValueError, match="not found"):
        hub_load_dataset("openai/gsm8k", "mian", split="train")
    with pytest.raises(ValueError, match="Unknown split"):
        hub_load_dataset("openai/gsm8k", "main", split="validation")
    assert hub_load_dataset("openai/gsm8k", "main", split="test").column_names == ["question", "answer"]
