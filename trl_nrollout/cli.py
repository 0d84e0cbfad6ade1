"""The ``trl-nrollout`` command: ``plan``, ``recipe`` (Hub recipes) and ``train`` (a recipe run in this process:
``trl-nrollout train --config gsm8k_qwen --max_steps 20``, the code of ``accelerate launch -m trl_nrollout.recipe.run``;
``trl-nrollout train --accelerate_config zero3 --num_processes 8 --config ...`` launches it under accelerate with a
shipped accelerate config, as TRL's ``trl grpo --accelerate_config zero3`` does).

Subcommands live in :data:`COMMANDS` (name -> :class:`Command`: help, a function adding its arguments, a function
running it and returning the exit status). To add one, write those two functions and add an entry; ``main`` and
``_build_parser`` need no change.

``trl-nrollout plan`` prints every count of a rollout step (engines, shares, micro batches) and, given a model,
its KV-cache and weight memory, from a recipe YAML and/or flags, before any GPU is touched::

    trl-nrollout plan --num-processes 6 --rollout-tp-size 2 --train-batch-size 60 --rollout-n 12 \\
        --log-prob-micro-batch-size 48 [--model-name-or-path builtin:tiny-qwen2] [--json]

Exit status: 0 on success, 2 on an invalid layout or bad arguments (the reason on stderr), 3 when ``--predict``
finds that the layout does not fit the device's memory (the figures on stdout, which limit binds first and the fix
on stderr).
Heavy modules (torch, transformers) are imported only when a model's memory is estimated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import yaml

from trl_nrollout.plan.figures import (
    PLAN_OPTIONS,
    PlanError,
    build_layout,
    build_memory,
    check_token_budgets,
    critic_rows,
    n_values,
    parse_bool,
    plan_values,
    split_rollout_ranks,
)
from trl_nrollout.plan.layout import LayoutError

EXIT_OK = 0
EXIT_INVALID = 2
#: ``plan --predict``: the layout is valid but does not fit the device's memory (the figures are printed, the reason
#: and the fix on stderr)
EXIT_DOES_NOT_FIT = 3


class Command(NamedTuple):
    """One subcommand: its one-line help, a function adding its arguments, and the function running it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    #: the command parses its own arguments: every word after its name is handed over as ``args.argv`` (its
    #: ``--help`` included)
    passthrough: bool = False


#: A user error reported as ``trl-nrollout: error: <message>`` with exit status 2.
CliError = PlanError


def _bool_arg(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}; use true or false") from None


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=str, metavar="YAML",
                   help="A recipe YAML (a path or an hf://user/repo/file.yaml reference); keys named like the options below (unknown keys are ignored).")
    for name, typ, help_text in PLAN_OPTIONS:
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        if name == "model_name_or_path":
            flags.append("--model")  # the short spelling the README and docs use
        if typ is bool:  # --flag alone is true; --flag false says it
            p.add_argument(*flags, dest=name, type=_bool_arg, nargs="?", const=True, default=None, help=help_text,
                           metavar="BOOL")
            continue
        metavar = {int: "N", float: "X"}.get(typ, "NAME")
        p.add_argument(*flags, dest=name, type=typ, default=None, help=help_text, metavar=metavar)
    p.add_argument("--n-values", type=str, default=None, metavar="LIST",
                   help="n values of the KV-cache-vs-n table, comma separated. Default 1,4,8,12,16.")
    p.add_argument("--no-memory", action="store_true", help="Skip the memory estimate even when a model is given.")
    p.add_argument("--json", action="store_true", help="Print the figures as JSON (layout + a 'memory' dict).")
    p.add_argument("--predict", action="store_true",
                   help="Predict the step's seconds per phase and samples/s on --device, and how they grow with n "
                        "(needs --model and --device).")
    p.add_argument("--suggest", action="store_true",
                   help="Search the layouts of --num-processes devices (TP size, max_num_seqs, n in --n-values when "
                        "given, else the recipe's rollout_n) and rank them by predicted samples/s, with the reason "
                        "each refused one fails (needs --model, --device, --train-batch-size).")
    p.add_argument("--suggest-rollout-ranks", action="store_true",
                   help="With --suggest: also rank launches split into trainers and rollout ranks (engines on "
                        "processes of their own, generating --rollout-lookahead steps ahead, default 1), every split the "
                        "launch allows.")
    p.add_argument("--calibrate", action="store_true",
                   help="Measure this machine (a matmul, a memory copy, engine decode steps and training forwards of "
                        "--model) and save it as the device profile --device (default: 'local').")


def local_recipe(config: str | None) -> str | None:
    """A local recipe path as is; a shipped recipe's name (``verl_article``, as ``train --config`` takes it) as its
    installed file; an ``hf://`` reference resolved through the Hub cache (offline mode respected)."""
    if config is None or not str(config).startswith("hf://"):
        from trl_nrollout.recipe.launch import ACCELERATE_DIR

        name = str(config) if str(config).endswith((".yaml", ".yml")) else f"{config}.yaml"
        shipped = ACCELERATE_DIR.parent / "configs" / name
        if config is not None and "/" not in str(config) and not Path(config).is_file() and shipped.is_file():
            return str(shipped)
        return config
    from trl_nrollout.recipe.hub import resolve_config

    try:
        return str(resolve_config(str(config)))
    except Exception as err:  # noqa: BLE001 - shown as a CLI error
        raise PlanError(str(err)) from None


def _run_plan(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name) for name, _, _ in PLAN_OPTIONS if getattr(args, name) is not None}
    values = plan_values(local_recipe(args.config), flags)
    values["_flags"] = flags  # carried, under the trainer's names, into the launch command --suggest prints
    if args.config:
        values["_config"] = args.config  # named in the launch command --suggest prints
    if args.calibrate:
        return _run_calibrate(values)
    if args.suggest_rollout_ranks and not args.suggest:
        raise PlanError("--suggest-rollout-ranks adds the split launches to --suggest's search: pass --suggest too.")
    if args.suggest:
        from trl_nrollout.plan.predict import suggest

        allowed = n_values(args.n_values) if args.n_values else (values.get("rollout_n"),)
        if allowed == (None,):
            raise PlanError("--suggest needs rollout_n (or --n-values with the n values to search).")
        found = suggest(values, tuple(int(n) for n in allowed), rollout_ranks=args.suggest_rollout_ranks)
        print(json.dumps(found["json"], indent=2) if args.json else "\n".join(found["lines"]))
        return EXIT_OK
    ns = n_values(args.n_values)
    split = split_rollout_ranks(values)
    if split is not None:  # the trainers' layout: their processes, no engine among them
        values = split[0]
    layout = build_layout(values)
    from trl_nrollout.plan.update_budget import (
        check_update_budget,
        update_budget,
        update_rows,
        with_log_prob_budget,
    )

    budget = update_budget(values, layout, colocated=split is None)
    check_update_budget(values, budget)
    if budget is not None:  # the log-prob passes take the update's budget unless sized (the trainer's rule)
        budgeted = with_log_prob_budget(values, budget)
        if budgeted is not values:
            values = budgeted
            layout = build_layout(values)
    check_token_budgets(values)
    update = update_rows(values, layout, budget)
    mem, mem_error = None, None
    if values.get("model_name_or_path") and not args.no_memory:
        try:
            mem = build_memory(values, layout, ns)
        except (LayoutError, CliError):
            raise  # a user error: exit 2
        except Exception as err:  # offline hub id, missing folder...: the layout still stands
            mem_error = f"memory estimate unavailable for {values['model_name_or_path']!r}: {err}"
            print(f"trl-nrollout: warning: {mem_error}", file=sys.stderr)
    critic = critic_rows(values, layout)
    predicted = None
    if args.predict and split is not None:
        from trl_nrollout.plan.predict import predict_rollout_ranks

        predicted = predict_rollout_ranks(values, layout, split[2], budget=budget)
    elif args.predict:
        from trl_nrollout.plan.predict import predict

        predicted = predict(values, layout, ns, budget=budget)
    if args.json:
        out = layout.to_dict()
        if critic:
            out["critic"] = dict(critic)
        out["update"] = {"use_dynamic_bsz": budget is not None,
                         "ppo_max_token_len_per_device": None if budget is None else budget.tokens,
                         "source": None if budget is None else budget.source,
                         "rule": dict((k.strip(), v) for k, v in update)}
        out["memory"] = mem.to_dict() if mem is not None else ({"error": mem_error} if mem_error else None)
        if predicted is not None:
            out["prediction"] = predicted["json"]
        if split is not None:
            out["rollout_ranks"] = split[2]
        print(json.dumps(out, indent=2))
        return _fit_status(predicted)
    if split is not None:
        print("rollout ranks")
        width = max(len(k) for k, _ in split[1])
        print("\n".join(f"{k.ljust(width)}  {v}" for k, v in split[1]))
        print()
        print("trainers (batches and micro batches; no engine among them)")
        engine_rows = ("rollout engines", "engine ranks", "prompts per engine", "samples per engine")
        rows = [(k, v) for k, v in layout.rows() if k not in engine_rows]
        width = max(len(k) for k, _ in rows)
        print("\n".join([f"{k.ljust(width)}  {v}" for k, v in rows] + [f"note: {n}" for n in layout.notes]))
    else:
        print("rollout layout")
        print(layout.table())
    width = max((len(k) for k, _ in layout.rows()), default=0)
    for key, text in [*update, *critic]:
        print(f"{key.ljust(width)}  {text}")
    if mem is not None:
        print()
        print(mem.table())
    if predicted is not None:
        print()
        print("\n".join(predicted["lines"]))
    return _fit_status(predicted)


def _fit_status(predicted: dict | None) -> int:
    """``--predict``'s exit status: :data:`EXIT_DOES_NOT_FIT` (with the reason and the fix on stderr) when the
    layout does not fit the device's memory."""
    if predicted is None or predicted.get("fits", True):
        return EXIT_OK
    sys.stdout.flush()
    print(f"trl-nrollout plan: error: {predicted['message']}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def _run_calibrate(values: dict) -> int:
    from trl_nrollout.calibrate import calibrate
    from trl_nrollout.plan.devices import save_profile

    model = values.get("model_name_or_path") or "builtin:tiny-qwen2"
    profile = calibrate(model, name=values.get("device") or "local", progress=lambda m: print(m, file=sys.stderr),
                        lora_r=values.get("lora_r") or 16)
    path = save_profile(profile)
    print(json.dumps(profile.to_dict(), indent=2))
    print(f"saved: {path} (use it with --device {profile.name})", file=sys.stderr)
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
    from trl_nrollout.recipe import hub

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
        from trl_nrollout.recipe.trust import recipe_requests

        data = yaml.safe_load(paths[0].read_text()) or {}
        if isinstance(data, dict):  # what the recipe asks for, before anyone runs it
            print()
            print(recipe_requests(data).summary())
        return EXIT_OK
    except hub.HubError as err:
        raise CliError(str(err)) from None


# ---------------------------------------------------------------------------------------------- train
def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    """None: ``train`` hands every word to the recipe's parser (TRL's, over the recipe's dataclasses)."""


def _run_train(args: argparse.Namespace) -> int:
    """The recipe (:func:`trl_nrollout.recipe.run.cli`, what ``accelerate launch -m trl_nrollout.recipe.run``
    runs) in this process: a mistake in the options, the recipe or the data is one ``error:`` line and exit status
    2. With launch flags (``--accelerate_config zero3 --num_processes 8``, :mod:`trl_nrollout.recipe.launch`) the
    recipe runs under ``accelerate launch`` instead, a shipped accelerate config found by name (TRL's CLI's way)."""
    from trl_nrollout.errors import InputError
    from trl_nrollout.recipe.launch import LAUNCH_HELP, accelerate_argv
    from trl_nrollout.recipe.run import recipe_help, wants_help

    if wants_help(args.argv):  # the recipe's options and the launch's, whatever else the line holds
        print(recipe_help(list(args.argv), "trl-nrollout train", launch=LAUNCH_HELP))
        return EXIT_OK
    try:
        launch = accelerate_argv(list(args.argv))
    except InputError as err:
        print(f"trl-nrollout train: error: {err}", file=sys.stderr)
        return EXIT_INVALID
    if launch is not None:
        return _accelerate_launch(launch)
    from trl_nrollout.recipe.run import cli as run_recipe

    return run_recipe(list(args.argv), prog="trl-nrollout train")


def _accelerate_launch(launch: list[str]) -> int:
    """``accelerate launch`` with the arguments ``launch`` (its own parser and launcher, in this process, as TRL's
    CLI calls them); the exit status of the launched processes."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    print("trl-nrollout train: accelerate launch " + " ".join(launch), file=sys.stderr)
    try:
        launch_command(launch_command_parser().parse_args(launch))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except subprocess.CalledProcessError as err:
        return err.returncode
    return EXIT_OK


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
    "train": Command(
        help="Train from a recipe (a YAML file, a shipped recipe's name such as gsm8k_qwen, or hf://...) in this "
             "process; options after it override the recipe's (--max_steps 20). Under accelerate: --accelerate_config "
             "zero3 (a shipped config's name or a file) --num_processes 8 [--num_machines, --machine_rank, "
             "--main_process_ip, --main_process_port], or accelerate launch -m trl_nrollout.recipe.run --config ...",
        add_arguments=_add_train_arguments,
        run=_run_train,
        passthrough=True,
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-nrollout",
        description="verl's rollout stage for TRL without Ray: plan and check rollout layouts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, add_help=not command.passthrough)
        command.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trl-nrollout`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS and COMMANDS[argv[0]].passthrough:  # its words are its own parser's
        return COMMANDS[argv[0]].run(argparse.Namespace(command=argv[0], argv=argv[1:]))
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
