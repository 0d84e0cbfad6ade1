"""Shared fixtures: the built-in tiny model (built once per machine, cached) and helpers to run launchers."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Keep CPU runs light and quiet; vLLM-specific settings are applied by the library itself.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# DeepSpeed's CPU ops: where scripts/setup_env.sh compiled them (inside the environment, not ~/.cache). A `lock` left
# there by a killed compile (a compile takes ~2 minutes) would make every ZeRO-Offload run wait forever: removed.
_EXTENSIONS = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
for _lock in _EXTENSIONS.rglob("lock"):
    with contextlib.suppress(OSError):
        if _lock.stat().st_mtime < time.time() - 1800:
            _lock.unlink()


_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def restored_distributed_env():
    """An in-process vLLM engine sets RANK / WORLD_SIZE / MASTER_PORT in os.environ (its external launcher reads
    them); later subprocesses must not inherit them (they would take the port or the rank)."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    with restored_distributed_env():
        yield


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Local folder of ``builtin:tiny-qwen2`` (built on first use)."""
    from trl_nrollout.builtin import resolve_model

    return resolve_model("builtin:tiny-qwen2")


@pytest.fixture(scope="session")
def recipe():
    """The recipe as a module (``recipe.main(argv)``, its parsers and checks): :mod:`trl_nrollout.recipe.run`, which
    ``recipes/grpo.py`` and ``trl-nrollout train`` run."""
    return load_recipe()


def load_recipe():
    """:mod:`trl_nrollout.recipe.run`, the module behind ``recipes/grpo.py`` (a wrapper of it) and ``trl-nrollout
    train``: patching its functions patches every launch's."""
    import importlib

    return importlib.import_module("trl_nrollout.recipe.run")


#: The commit hash of the Hub repositories laid out by :func:`populate_cache`.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT,
                   revision: str | None = "main", repo_type: str = "model") -> Path:
    """Lay files out as ``huggingface_hub`` stores a download: ``<type>s--<ns>--<name>/blobs/<etag>``, a
    ``snapshots/<commit>/<path>`` link to the blob, and ``refs/<revision>`` holding the commit hash."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for path, data in files.items():
        blob = storage / "blobs" / hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if revision is not None:
        (storage / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return storage


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, made the default of ``huggingface_hub`` in this process, in offline mode.

    ``huggingface_hub`` reads ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` once, at import; its module constants are
    patched here (the subprocess test below sets the real environment variables instead)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def run_cmd(args: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, fail the test with its output when it exits non-zero."""
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


# ---------------------------------------------------------------------------------------------- recipe runs
def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick), for a launch's rendezvous: a fixed one (torchrun's
    default 29500) makes two runs on one machine (two test sessions, a test and a benchmark) fail on each other."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(procs: int) -> list[str]:
    """The head of a command that runs a script as ``torchrun --nproc_per_node procs`` would, on a free port: the
    warm launcher (:data:`ACCELERATE_LAUNCH`, tests/zygote.py) in its ``--torchrun`` mode, whose ranks are forked
    with torch, transformers, TRL and PEFT imported (a real torchrun's processes imported them each: 9-20 s more
    per launch on the 2-core machine, 2026-12-07); the same variables as torchrun's (the rank variables,
    ``OMP_NUM_THREADS=1``), none of accelerate's."""
    return [*ACCELERATE_LAUNCH, "--torchrun", str(procs)]


ACCELERATE = str(Path(sys.executable).parent / "accelerate")
# `accelerate-launch ARGS` is accelerate's own entry point for `accelerate launch ARGS` (the same parser and launch
# function) without the `accelerate` command's other subcommands, whose imports cost about 3.5 s per launch here
# the tests' launches go through a warm launcher (tests/zygote.py: one server per test session imports torch,
# transformers, TRL and PEFT once and forks each launch's ranks; accelerate's own parser and environment); the
# README's commands and the command-line tests run the real `accelerate launch`
ZYGOTE_SOCKET = f"/tmp/trl_nrollout_launch_{os.getpid()}.sock"
ACCELERATE_LAUNCH = [sys.executable, str(ROOT / "tests" / "zygote.py"), "run", ZYGOTE_SOCKET]
os.environ.setdefault("ZYGOTE_OWNER", str(os.getpid()))  # the launch server lives as long as this session
RECIPE = str(ROOT / "recipes" / "grpo.py")
ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def launch(out: Path, *extra: str, procs: int = 1, config: str | None = None, timeout: float = 600,
           config_processes: int | None = None) -> dict:
    """Run the recipe; return its summary and log history. One process without an accelerate config runs in this
    process (``recipe.main``, the function `accelerate launch recipes/grpo.py` calls; a launch costs about 9 s of
    imports and start-up); `make demo` is run as the README gives it by ``one_process_run``, and more processes or a
    DeepSpeed config by a real `accelerate launch`."""
    if procs == 1 and not config:
        with restored_distributed_env():  # a module-scoped fixture's run must not leave them to the tests
            load_recipe().main(["--output_dir", str(out), "--use_cpu", "true", *extra])
        return _read_run(out)
    if config:
        head = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes/accelerate" / config)]
        if config_processes:  # the config file's count, overridden
            head += ["--num_processes", str(config_processes)]
    elif procs == 1:
        head = [*ACCELERATE_LAUNCH, "--cpu", "--num_processes", "1"]
    else:
        head = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", str(procs)]
    cpu = ["--use_cpu", "false", "--ddp_backend", "gloo"] if config and "zero" in config else ["--use_cpu", "true"]
    run_cmd([*head, RECIPE, "--output_dir", str(out), *cpu, *extra], timeout=timeout, env=ENV)
    return _read_run(out)


def launch_two_nodes(out: Path, per_node: int, *extra: str, timeout: float = 600) -> None:
    """The recipe as a 2-"node" launch on this machine (accelerate, --num_machines 2, ``per_node`` processes each,
    a free local port); fails the test with both nodes' output when a node fails."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(node), "--num_processes",
         str(2 * per_node), "--main_process_ip", "127.0.0.1", "--main_process_port", port, RECIPE, "--output_dir",
         str(out), "--use_cpu", "true", *extra],
        cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outputs)


def run_script_in_process(script: Path, *argv: str, env: dict | None = None) -> dict:
    """Run a one-process script as ``python script argv...`` would, in this process (the imports of torch, TRL and
    vLLM are paid once per session instead of once per script): ``__name__ == "__main__"``, its ``sys.argv`` and
    ``env`` set while it runs. What the end of its process would release is released: the trainers it leaves open
    are closed (engines, process groups), accelerate's state is reset, the environment restored. Returns the
    script's globals."""
    import runpy

    from tests.assets.run_python_blocks import release

    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [str(script), *argv]
    os.environ.update({k: v for k, v in (env or {}).items() if v is not None})
    namespace: dict = {}
    try:
        namespace = runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved_argv
        release(namespace)
        os.environ.clear()
        os.environ.update(saved_env)
    return namespace


def _read_run(out: Path) -> dict:
    summary = json.loads((out / "run_summary.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    return {"summary": summary, "steps": [h for h in history if "reward" in h]}



def rewards(run: dict) -> list[float]:
    return [h["reward"] for h in run["steps"]]


# what a resume must bring back beside the model: the optimizer and a scheduler that moves (linear), the adaptive KL
# controller (KL in the reward), and the generator that draws DAPO's extra prompts (groups of prompts that mention
# 'digits' score a constant 1.0 and are filtered out, so every step draws more)
RESUME = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--learning_rate", "5e-3",
          "--lr_scheduler_type", "linear", "--use_kl_in_reward", "true", "--kl_ctrl_type", "adaptive",
          "--kl_target", "0.0001", "--kl_horizon", "50", "--filter_groups", "true", "--reward_funcs",
          "tests.assets.rewards_for_tests:constant_for_some_prompts"]
RESUMED_KEYS = ("reward", "loss", "learning_rate", "actor/reward_kl_penalty_coeff", "dynamic_sampling/rounds")


def assert_resumed(full: dict, resumed: dict, checkpoint: Path, keys=RESUMED_KEYS) -> None:
    """``resumed`` trained only the steps after ``checkpoint`` (``checkpoint-K``), from it, and logged what the
    uninterrupted run ``full`` logged for them."""
    at, total = int(checkpoint.name.rsplit("-", 1)[1]), len(full["steps"])
    assert resumed["summary"]["resumed_from"] == str(checkpoint)
    assert resumed["summary"]["steps_trained"] == total - at and resumed["summary"]["steps"] == total
    tail = [h for h in full["steps"] if h["step"] > at]
    again = [h for h in resumed["steps"] if h["step"] > at]
    assert [h["step"] for h in again] == list(range(at + 1, total + 1))
    for a, b in zip(tail, again):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a["step"])


@pytest.fixture(scope="session")
def zero3_long_prompt_runs(tmp_path_factory):
    """Two processes under DeepSpeed ZeRO-3 with the HF engine, 2 steps on prompts of 80 tokens (long enough for the
    shared-prompt forward to pay: a group packs into fewer tokens than its n plain rows) with a KL loss, one launch
    per variant, run
    on first request and shared: ``get("gathered")`` (ds3_gather_for_generation, TRL's default), ``"not_gathered"``,
    and ``"plain"`` (gathered, shared_prompt_forward off). Read by the HF engine's prefill test (test_trainer) and
    the shared-prompt forward's comparison with the plain layout (test_packing)."""
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import digits_prompts, long_prompts, resolve_model

    base = tmp_path_factory.mktemp("zero3_long_prompts")
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    data = base / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in long_prompts(digits_prompts(32), tok, 80)))
    # the old-policy and reference passes run (a KL loss; no on-policy skip): their micro batches hold whole groups,
    # which is where the shared-prompt forward packs (the update's shuffled micro batches mix prompts)
    common = ("--max_steps", "2", "--rollout_backend", "hf", "--dataset_name", str(data), "--save_strategy", "no",
              "--beta", "0.04", "--skip_old_log_prob_when_on_policy", "false")
    variants = {"gathered": ("--ds3_gather_for_generation", "true"),
                "not_gathered": ("--ds3_gather_for_generation", "false"),
                "plain": ("--ds3_gather_for_generation", "true", "--shared_prompt_forward", "false")}
    runs: dict[str, dict] = {}

    def get(variant: str) -> dict:
        if variant not in runs:
            runs[variant] = launch(base / variant, *common, *variants[variant], config="zero3_cpu.yaml", timeout=900)
        return runs[variant]

    return get


def save_tiny_model(folder: Path, moe: bool = False, dtype=None, **config) -> str:
    """A tiny random Qwen2 (or Qwen2-MoE: 4 experts, 2 per token) with the built-in tokenizer, saved to ``folder``
    (in ``dtype``, e.g. ``torch.bfloat16`` for a bf16 checkpoint, as most released models are); ``config`` overrides
    the model config (e.g. head sizes a vLLM backend lacks). Returns the folder."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from trl_nrollout.builtin import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
    if moe:
        base.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**base, **config}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**base, **config}))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# ---------------------------------------------------------------------------------------------- test tiers
# Two tiers, marked by what a test does, not by hand: `full` for every test that starts a process, an engine or a
# training run (found in its source, its fixtures' and the helpers they call, recursively), `fast` for the rest
# (pure functions, config, layout, plan, errors). `make test-fast` runs `-m fast`, the developer's loop; `make test`
# runs both. A test marked fast that starts one of those anyway fails with the reason (see _tier_guard), so the
# marking cannot drift. A test marked slow or multiprocess by hand is full whatever its source says.
HEAVY = {
    "starts a process": re.compile(r"\b(run_cmd|launch|Popen|subprocess\.(run|call|check_call|check_output))\("),
    "trains": re.compile(r"\.train\("),
    "runs a script": re.compile(r"\brun_script_in_process\("),
    "starts an engine": re.compile(r"\b(VLLMEngineGroup|HFEngine|LLM)\("),
    "runs a rollout": re.compile(r"\b(_generate_and_score_completions|generate_expanded|generate_engine)\("),
    "builds a trainer (model and engine)": re.compile(r"\b\w*Trainer\((?!\w*Error)"),
    "calibrates (an engine, training runs)": re.compile(r"\bcalibrate\("),
}


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def heavy_reason(func, fixture_defs: dict, seen: set | None = None) -> str | None:
    """Why ``func`` (a test, a fixture or a helper of the tests) belongs to the full tier, or None: its source, the
    fixtures it requests and the test helpers it calls, searched recursively."""
    seen = set() if seen is None else seen
    if func in seen:
        return None
    seen.add(func)
    text = _source(func)
    for why, pattern in HEAVY.items():
        if pattern.search(text):
            return f"{getattr(func, '__name__', func)} {why}"
    module = sys.modules.get(getattr(func, "__module__", ""), None)
    names = set(re.findall(r"\b([A-Za-z_]\w*)\(", text))
    for name in sorted(names):
        target = getattr(module, name, None)
        if inspect.isfunction(target) and target.__module__.startswith("tests."):
            why = heavy_reason(target, fixture_defs, seen)
            if why:
                return why
    for name in inspect.signature(func).parameters if callable(func) else ():
        for fixture in fixture_defs.get(name, ()):
            why = heavy_reason(fixture.func, fixture_defs, seen)
            if why:
                return why
    return None


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, TRL, vLLM: millions of objects), so that Python's full
    collections, and the ones vLLM runs while an engine starts in this process, skip it. Measured ..."""
    if os.environ.get("NO_GC_FREEZE"):
        return
    from tests.harness import hold_frozen_heap, preimport

    # what the runs import, first (the fast tier's guard imports our trainer and engines anyway)
    preimport(ours=True, stack=any(item.get_closest_marker("full") for item in session.items))
    hold_frozen_heap()  # and vLLM's engines neither unfreeze it nor freeze their own objects (tests/harness.py)


def pytest_collection_modifyitems(config, items):
    skip_vllm = None if _vllm_installed() else pytest.mark.skip(
        reason="vLLM is not installed (pip install 'trl-nrollout[cpu]' on CPU, '[vllm]' on CUDA)")
    for item in items:
        if skip_vllm is not None and item.get_closest_marker("vllm"):
            item.add_marker(skip_vllm)
        if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.full)
            continue
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        why = heavy_reason(getattr(item, "function", None), defs) if hasattr(item, "function") else None
        item.add_marker(pytest.mark.full(reason=why) if why else pytest.mark.fast)


class TierError(AssertionError):
    """A test of the fast tier started a process, an engine or a training run."""


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """In a test of the fast tier, starting a process, an engine or a training run is an error naming the test: the
    tier's promise (no engine start, no training, no subprocess) is checked, not assumed."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return

    def refuse(what):
        def _refused(*args, **kwargs):
            raise TierError(f"{request.node.nodeid} is in the fast tier but {what}; the tier markers are derived from "
                            "the source (tests/conftest.py HEAVY): name the call there, or mark the test slow.")
        return _refused

    import subprocess as _subprocess

    import transformers.trainer  # noqa: F401 - loaded once, so that a test importing it later meets the guard too

    import trl_nrollout.rollout.engines.hf_engine  # noqa: F401
    import trl_nrollout.rollout.engines.vllm_group  # noqa: F401
    import trl_nrollout.trainer.grpo  # noqa: F401 - TRL's trainer imports vLLM, which probes the platform in a process

    monkeypatch.setattr(_subprocess.Popen, "__init__", refuse("starts a process"))
    for module, attr, what in (("trl_nrollout.rollout.engines.vllm_group", "VLLMEngineGroup", "starts a vLLM engine"),
                               ("trl_nrollout.rollout.engines.hf_engine", "HFEngine", "starts an HF engine"),
                               ("transformers.trainer", "Trainer", "trains")):
        if module in sys.modules:
            cls = getattr(sys.modules[module], attr)
            monkeypatch.setattr(cls, "train" if attr == "Trainer" else "__init__", refuse(what))
    yield


def pytest_sessionfinish(session, exitstatus):
    """Stop this session's launch server (tests/zygote.py), if a test started one; unfreeze the heap (frozen objects
    are never finalized, and some extension modules print a leak report at exit for theirs)."""
    from tests.harness import release_frozen_heap

    release_frozen_heap()
    if os.path.exists(ZYGOTE_SOCKET):
        subprocess.run([sys.executable, str(ROOT / "tests" / "zygote.py"), "stop", ZYGOTE_SOCKET], timeout=60,
                       check=False)
