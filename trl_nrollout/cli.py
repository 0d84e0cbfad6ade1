"""The ``trl-nrollout`` command.

Subcommands live in :data:`COMMANDS` (name -> :class:`Command`: help, a function adding its arguments, a function
running it and returning the exit status). To add one, write those two functions and add an entry; ``main`` and
``_build_parser`` need no change.

``trl-nrollout plan`` prints every count of a rollout step (engines, shares, micro batches) and, given a model,
its KV-cache and weight memory, from a recipe YAML and/or flags, before any GPU is touched::

    trl-nrollout plan --num-processes 6 --rollout-tp-size 2 --train-batch-size 60 --rollout-n 12 \\
        --log-prob-micro-batch-size 48 [--model-name-or-path builtin:tiny-qwen2] [--json]

Exit status: 0 on success, 2 on an invalid layout or bad arguments (the reason on stderr).
Heavy modules (torch, transformers) are imported only when a model's memory is estimated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from .layout import LayoutError, RolloutLayout

EXIT_OK = 0
EXIT_INVALID = 2


class Command(NamedTuple):
    """One subcommand: its one-line help, a function adding its arguments, and the function running it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CliError(Exception):
    """A user error reported as ``trl-nrollout: error: <message>`` with exit status 2."""


# ---------------------------------------------------------------------------------------------- plan
#: (option, type, help) of every ``plan`` option; each is a flag (``--rollout-tp-size`` or ``--rollout_tp_size``)
#: and a recipe YAML key (``rollout_tp_size``). Flags override the YAML.
PLAN_OPTIONS: list[tuple[str, type, str]] = [
    ("num_processes", int, "World size (accelerate's num_processes). Or give n_gpus_per_node and nnodes."),
    ("n_gpus_per_node", int, "GPUs per node (verl trainer.n_gpus_per_node); world = n_gpus_per_node x nnodes."),
    ("nnodes", int, "Number of nodes (verl trainer.nnodes). Default 1."),
    ("rollout_tp_size", int, "Ranks per vLLM engine (verl rollout.tensor_model_parallel_size). Default 1."),
    ("train_batch_size", int, "Prompts per rollout step (verl data.train_batch_size). Required."),
    ("rollout_n", int, "Samples per prompt (verl rollout.n, TRL num_generations). Required."),
    ("ppo_mini_batch_size", int, "Prompts per optimizer step (verl semantics). Default: train_batch_size."),
    ("ppo_micro_batch_size_per_device", int, "Samples per device per training forward. Default: the whole "
                                             "mini batch of a rank."),
    ("ppo_epochs", int, "Passes over each rollout. Default 1."),
    ("log_prob_micro_batch_size", int, "Old-policy log-prob micro batch, global: divided by the data-parallel "
                                       "size (verl's older normalization)."),
    ("log_prob_micro_batch_size_per_device", int, "Old-policy log-prob micro batch per device."),
    ("ref_log_prob_micro_batch_size", int, "Reference log-prob micro batch, global. Default: as the old pass."),
    ("ref_log_prob_micro_batch_size_per_device", int, "Reference log-prob micro batch per device."),
    ("log_prob_max_token_len_per_device", int, "Token budget per log-prob forward (dynamic micro batches)."),
    ("ref_log_prob_max_token_len_per_device", int, "Token budget per reference forward."),
    ("sequence_parallel_size", int, "Ulysses sequence-parallel size. Default 1."),
    ("adv_estimator", str, "Advantage estimator (grpo, rloo, reinforce_plus_plus, ...). Default grpo."),
    ("model_name_or_path", str, "A builtin: name, local folder or hub id: adds the memory estimate."),
    ("max_prompt_length", int, "Longest prompt in tokens (memory estimate). Default 512."),
    ("max_completion_length", int, "Longest completion in tokens (memory estimate). Default 512."),
    ("dtype", str, "Engine dtype: bfloat16, float16, float32, fp8 or auto (the config's). Default auto."),
    ("max_num_seqs", int, "Sequences an engine runs at once (rollout_max_num_seqs). Default 1024."),
    ("gpu_memory_gib", float, "GPU memory in GiB: checks that weights and KV cache fit."),
    ("gpu_memory_utilization", float, "Fraction of GPU memory vLLM may use (TRL vllm_gpu_memory_utilization). "
                                      "Default 0.9."),
]
LAYOUT_KEYS = (
    "num_processes", "n_gpus_per_node", "nnodes", "rollout_tp_size", "train_batch_size", "rollout_n",
    "ppo_mini_batch_size", "ppo_micro_batch_size_per_device", "ppo_epochs", "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_device", "ref_log_prob_micro_batch_size",
    "ref_log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_device",
    "ref_log_prob_max_token_len_per_device", "sequence_parallel_size", "adv_estimator",
)
#: TRL names read from a recipe when the verl-named key is absent.
YAML_ALIASES = {
    "num_generations": "rollout_n",
    "vllm_tensor_parallel_size": "rollout_tp_size",
    "vllm_gpu_memory_utilization": "gpu_memory_utilization",
}


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=str, metavar="YAML",
                   help="A recipe YAML (a path or an hf://user/repo/file.yaml reference); keys named like the options below (unknown keys are ignored).")
    for name, typ, help_text in PLAN_OPTIONS:
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        if name == "model_name_or_path":
            flags.append("--model")  # the short spelling the README and docs use
        metavar = {int: "N", float: "X"}.get(typ, "NAME")
        p.add_argument(*flags, dest=name, type=typ, default=None, help=help_text, metavar=metavar)
    p.add_argument("--n-values", type=str, default=None, metavar="LIST",
                   help="n values of the KV-cache-vs-n table, comma separated. Default 1,4,8,12,16.")
    p.add_argument("--no-memory", action="store_true", help="Skip the memory estimate even when a model is given.")
    p.add_argument("--json", action="store_true", help="Print the figures as JSON (layout + a 'memory' dict).")


def _read_recipe(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise CliError(f"--config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise CliError(f"--config {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(f"--config {path} must hold a mapping of options, not a {type(data).__name__}.")
    known = {name for name, _, _ in PLAN_OPTIONS}
    values = {k: v for k, v in data.items() if k in known}
    for alias, name in YAML_ALIASES.items():
        if alias in data and name not in values:
            values[name] = data[alias]
    return values


def _local_recipe(config: str | Path) -> Path:
    """A local recipe path as is; an ``hf://`` reference resolved through the Hub cache (offline mode respected)."""
    if str(config).startswith("hf://"):
        from trl_nrollout.hub import resolve_config

        try:
            return resolve_config(str(config))
        except Exception as err:  # noqa: BLE001 - shown as a CLI error
            raise CliError(str(err)) from None
    return Path(config)


def plan_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options of a ``plan`` call: the recipe's, overridden by the flags given."""
    values = _read_recipe(_local_recipe(args.config)) if args.config is not None else {}
    for name, _, _ in PLAN_OPTIONS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values


def _n_values(text: str | None) -> tuple[int, ...]:
    from .memory import DEFAULT_N_VALUES

    if text is None:
        return DEFAULT_N_VALUES
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CliError(f"--n-values={text!r} must be comma-separated positive integers, e.g. 1,4,8,12,16.") from None
    if not values or min(values) < 1:
        raise CliError(f"--n-values={text!r} must be comma-separated positive integers, e.g. 1,4,8,12,16.")
    return values


def build_layout(values: dict[str, Any]) -> RolloutLayout:
    """The :class:`RolloutLayout` of ``plan`` options (raises :class:`CliError` for a missing required one)."""
    missing = [k for k in ("train_batch_size", "rollout_n") if values.get(k) is None]
    if missing:
        raise CliError(" and ".join(
            f"{k} is required: pass --{k.replace('_', '-')} or set {k} in the --config YAML" for k in missing
        ) + ".")
    return RolloutLayout.build(**{k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None})


def build_memory(values: dict[str, Any], layout: RolloutLayout, n_values: tuple[int, ...]):
    """The :class:`~trl_nrollout.memory.MemoryEstimate` of ``plan`` options (loads the model's config)."""
    from . import memory

    dtype = values.get("dtype")
    if dtype not in (None, "auto"):
        try:
            memory.dtype_bytes(dtype)
        except ValueError as err:
            raise CliError(str(err)) from None
    notes = []
    lengths = {}
    for key, default in [("max_prompt_length", memory.DEFAULT_MAX_PROMPT_LENGTH),
                         ("max_completion_length", memory.DEFAULT_MAX_COMPLETION_LENGTH)]:
        value = values.get(key)
        if value is None:
            notes.append(f"{key} not set: {default} assumed.")
            value = default
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CliError(f"{key}={value!r} must be a non-negative integer.")
        lengths[key] = value
    max_num_seqs = values.get("max_num_seqs")
    max_num_seqs = memory.DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise CliError(f"max_num_seqs={max_num_seqs!r} must be a positive integer (the default is 1024).")
    util = values.get("gpu_memory_utilization")
    gib = values.get("gpu_memory_gib")
    if util is not None and not 0 < util <= 1:
        raise CliError(f"gpu_memory_utilization={util!r} must be in (0, 1], e.g. 0.9.")
    if gib is not None and util is None:
        util = 0.9

    shape = memory.load_model_shape(values["model_name_or_path"], dtype=dtype)
    memory.check_model_fits_layout(shape, layout)
    if shape.num_parameters is None:
        notes.append("parameter count unavailable (transformers could not build this architecture): no weights "
                     "figure.")
    return memory.estimate_memory(
        shape, layout, max_prompt_length=lengths["max_prompt_length"],
        max_completion_length=lengths["max_completion_length"], max_num_seqs=max_num_seqs, n_values=n_values,
        gpu_memory_gib=gib, gpu_memory_utilization=util, notes=notes,
    )


def check_token_budgets(values: dict[str, Any]) -> None:
    """A log-prob token budget must hold one whole sequence (checked when both lengths are given)."""
    prompt, completion = values.get("max_prompt_length"), values.get("max_completion_length")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return
    seq_len = prompt + completion
    for key in ("log_prob_max_token_len_per_device", "ref_log_prob_max_token_len_per_device"):
        budget = values.get(key)
        if isinstance(budget, int) and budget < seq_len:
            raise LayoutError(
                f"{key}={budget} is smaller than one sequence (max_prompt_length + max_completion_length = "
                f"{seq_len} tokens), so a long sample fits in no forward; use {key} {seq_len} or more "
                f"({2 * seq_len} is usual).",
                option=key, value=budget, rule="token_budget_fits_sequence", fixes=[{key: seq_len}],
            )


def _run_plan(args: argparse.Namespace) -> int:
    values = plan_values(args)
    n_values = _n_values(args.n_values)
    layout = build_layout(values)
    check_token_budgets(values)
    mem, mem_error = None, None
    if values.get("model_name_or_path") and not args.no_memory:
        try:
            mem = build_memory(values, layout, n_values)
        except (LayoutError, CliError):
            raise  # a user error: exit 2
        except Exception as err:  # offline hub id, missing folder...: the layout still stands
            mem_error = f"memory estimate unavailable for {values['model_name_or_path']!r}: {err}"
            print(f"trl-nrollout: warning: {mem_error}", file=sys.stderr)
    if args.json:
        out = layout.to_dict()
        out["memory"] = mem.to_dict() if mem is not None else ({"error": mem_error} if mem_error else None)
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print("rollout layout")
    print(layout.table())
    if mem is not None:
        print()
        print(mem.table())
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- recipe
def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    push = sub.add_parser("push", help="Upload a recipe folder (its YAML files and a generated card) to the Hub.",
                          description="Upload a recipe folder (its YAML files and a generated README.md card with "
                                      "the plan table) to a Hub model repo, in one commit.")
    push.add_argument("folder", type=Path, help="The recipe folder (config.yaml, accelerate config) or a recipe YAML.")
    push.add_argument("repo_id", help="The Hub model repo, namespace/name (created if missing).")
    push.add_argument("--private", action="store_true", help="Create the repo private.")
    push.add_argument("--dry-run", action="store_true", help="Print the files and the card; upload nothing.")
    push.add_argument("--token", default=None, help="A Hub token with write access. Default: your login / HF_TOKEN.")
    push.add_argument("--message", default=None, help="Commit message.")
    pull = sub.add_parser("pull", help="Fetch a recipe (and its accelerate config) by its hf:// reference.",
                          description="Fetch a recipe by its hf:// reference into the Hugging Face cache (offline: "
                                      "use the cached copy) and print its path; with --out, copy it there.")
    pull.add_argument("ref", help="hf://namespace/repo[@revision]/config.yaml")
    pull.add_argument("--out", type=Path, default=None, metavar="DIR", help="Copy the recipe files into DIR.")
    pull.add_argument("--token", default=None, help="A Hub token (private or gated repos).")


def _run_recipe(args: argparse.Namespace) -> int:
    from . import hub

    try:
        if args.recipe_command == "push":
            plan = hub.push_recipe(args.folder, args.repo_id, token=args.token, private=args.private,
                                   dry_run=args.dry_run, commit_message=args.message)
            if args.dry_run:
                print("dry run: nothing uploaded")
                print(plan.summary())
                print()
                print(plan.card)
            else:
                print(plan.summary())
                print(f"pushed: {plan.commit_url or 'https://huggingface.co/' + plan.repo_id}")
            return EXIT_OK
        paths = hub.pull_recipe(args.ref, args.out, token=args.token)
        for path in paths:
            print(path)
        from .recipe_trust import recipe_requests

        data = yaml.safe_load(paths[0].read_text()) or {}
        if isinstance(data, dict):  # what the recipe asks for, before anyone runs it
            print()
            print(recipe_requests(data).summary())
        return EXIT_OK
    except hub.HubError as err:
        raise CliError(str(err)) from None


# ---------------------------------------------------------------------------------------------- dispatch
COMMANDS: dict[str, Command] = {
    "plan": Command(
        help="Print the rollout layout (engines, shares, micro batches) and memory estimate of a recipe.",
        add_arguments=_add_plan_arguments,
        run=_run_plan,
    ),
    "recipe": Command(
        help="Share recipes on the Hugging Face Hub: push a recipe folder, pull one by its hf:// reference.",
        add_arguments=_add_recipe_arguments,
        run=_run_recipe,
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-nrollout",
        description="verl's rollout stage for TRL without Ray: plan and check rollout layouts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trl-nrollout`` console script; returns the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2, already printed by argparse)
        return exit_.code if isinstance(exit_.code, int) else EXIT_INVALID
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_INVALID
    try:
        return COMMANDS[args.command].run(args)
    except (LayoutError, CliError) as err:
        print(f"trl-nrollout {args.command}: error: {err}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # `trl-nrollout plan | head`: the reader left; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
