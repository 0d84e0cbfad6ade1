"""``trl-nrollout train --accelerate_config zero3 --num_processes 8 --config RECIPE ...``: the recipe under
``accelerate launch``, as TRL's ``trl grpo --accelerate_config zero3`` does, with the accelerate configs shipped in
the package (``trl_nrollout/recipes/accelerate/``, a clone's ``recipes/accelerate/``) found by name.

The launch's own flags (:data:`LAUNCH_FLAGS`) go to ``accelerate launch``; every other word goes to the recipe
(:mod:`trl_nrollout.recipe.run`), which runs as ``-m trl_nrollout.recipe.run`` in each process. Without any launch
flag, ``train`` runs the recipe in its own process. Pure functions; no torch at import.
"""

from __future__ import annotations

from pathlib import Path

from trl_nrollout.errors import InputError

#: the accelerate configs shipped with the package (``recipes/accelerate/*.yaml`` of the repository)
ACCELERATE_DIR = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"
#: ``train``'s words that are ``accelerate launch``'s, each with one value (``--accelerate_config`` becomes its
#: ``--config_file``): flag -> what ``trl-nrollout train --help`` says of it
LAUNCH_HELP = {
    "--accelerate_config": "An accelerate config: a file, or a shipped one's name (zero3, fsdp, ...; "
                           "trl_nrollout/recipes/accelerate/). Becomes accelerate launch's --config_file.",
    "--num_processes": "Processes in all (one per GPU).",
    "--num_machines": "Machines (nodes) of the launch.",
    "--machine_rank": "This machine's rank among them (0 on the main one).",
    "--main_process_ip": "The main machine's address (several machines).",
    "--main_process_port": "The main machine's port (several machines).",
    "--mixed_precision": "no, fp16 or bf16 (accelerate's).",
    "--gpu_ids": "The GPUs to use, comma-separated (accelerate's).",
}
LAUNCH_FLAGS = tuple(LAUNCH_HELP)
#: the module every launched process runs
RECIPE_MODULE = "trl_nrollout.recipe.run"


def shipped_accelerate_configs() -> list[str]:
    """Names of the accelerate configs shipped with the package (``zero3``, ``zero3_cpu``, ``fsdp``...)."""
    return sorted(p.stem for p in ACCELERATE_DIR.glob("*.yaml"))


def packaged_accelerate_config(value: str) -> str:
    """``value`` as an accelerate config file: a file that exists as is; a shipped config's name (``zero3`` or
    ``zero3.yaml``) or a clone's path to one (``recipes/accelerate/zero3.yaml``, run from elsewhere) as the
    installed file. Anything else: an :class:`InputError` naming the shipped configs."""
    if Path(value).expanduser().is_file():
        return value
    name = Path(value).name
    name = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    packaged = ACCELERATE_DIR / name
    if ("/" not in value or value.replace("\\", "/").rstrip("/").endswith(f"recipes/accelerate/{name}")) and \
            packaged.is_file():
        return str(packaged)
    raise InputError(f"--accelerate_config {value!r} is neither a file nor an accelerate config shipped with "
                     f"trl-nrollout; use a path or one of {shipped_accelerate_configs()} (in {ACCELERATE_DIR}).")


def split_launch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``train``'s words split into ``accelerate launch``'s (:data:`LAUNCH_FLAGS` and their values, as written:
    ``--flag value`` or ``--flag=value``) and the recipe's (the rest, in order)."""
    launch, rest = [], []
    i = 0
    while i < len(argv):
        word = argv[i]
        flag = word.split("=", 1)[0]
        if flag in LAUNCH_FLAGS:
            if "=" in word:
                launch += [flag, word.split("=", 1)[1]]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                launch += [flag, argv[i + 1]]
                i += 1
            else:
                raise InputError(f"{flag} needs a value (trl-nrollout train {flag} VALUE ...).")
        else:
            rest.append(word)
        i += 1
    return launch, rest


def accelerate_argv(argv: list[str]) -> list[str] | None:
    """The ``accelerate launch`` arguments that run ``train``'s words (``--config_file`` resolved from
    ``--accelerate_config``, the other launch flags as given, then ``-m trl_nrollout.recipe.run`` and the recipe's
    words); None when no launch flag is among them (the recipe runs in this process)."""
    launch, rest = split_launch_args(argv)
    if not launch:
        return None
    out = []
    for flag, value in zip(launch[::2], launch[1::2]):
        if flag == "--accelerate_config":
            out = ["--config_file", packaged_accelerate_config(value), *out]
        else:
            out += [flag, value]
    return [*out, "-m", RECIPE_MODULE, *rest]
