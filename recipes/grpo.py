"""GRPO (or PPO) training from a YAML recipe: ``accelerate launch recipes/grpo.py [--config RECIPE] [--key value ...]``.

A wrapper, kept for launches from a clone: the recipe is :mod:`trl_nrollout.recipe.run`, installed with the package
and run the same way by ``trl-nrollout train --config RECIPE`` (one process) and ``accelerate launch -m
trl_nrollout.recipe.run --config RECIPE`` (any launch); its docstring lists the options. ``RECIPE`` is a YAML file,
a recipe shipped with the package by name (``default``, ``gsm8k_qwen``...) or an ``hf://`` reference.
"""

import sys

from trl_nrollout.recipe.run import cli

if __name__ == "__main__":
    sys.exit(cli())
