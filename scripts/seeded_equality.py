"""Seeded runs, value for value: record a tree's runs, then compare two records.

A refactor must not change what a seeded run trains. This script runs a fixed list of short seeded runs (the
axes' main paths: default, DDP, PPO, DAPO with partial rollouts, TRL tools request by request, an endpoint agent,
rollout ranks with a partial pool) against a source tree and saves each step's logged values; ``--compare`` then
says, run by run, whether two records are equal (timings excluded) and, where not, which values differ first.

    python scripts/seeded_equality.py record --tree . --out runs/seeded/after            # every run (~12 min here)
    python scripts/seeded_equality.py record --tree /tmp/base --out runs/seeded/before --runs default,ppo
    python scripts/seeded_equality.py compare runs/seeded/before runs/seeded/after

``--tree`` is a checkout of this repository (a git worktree of an older commit, say); its ``trl_nrollout`` is the one
imported (``PYTHONPATH``), with this interpreter's packages. Progress: one line per run, with its time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the long-tail model, 4 prompts x 4 samples a step, completions up to 64 tokens: samples stay in flight
PARTIAL = ["--model_name_or_path", "builtin:tiny-qwen2-longtail", "--rollout_partial", "true", "--max_staleness", "1",
           "--max_completion_length", "64", "--train_batch_size", "4", "--rollout_n", "4", "--learning_rate", "5e-3",
           "--reward_funcs", "digits"]
AGENT = ("async def agent(client, row):\n"
         "    r = await client.completions.create(model='policy', prompt=row['prompt'], max_tokens=6)\n"
         "    text = r.choices[0].text\n"
         "    return sum(c.isdigit() for c in text) / max(len(text), 1)\n")
#: name -> (processes, recipe arguments); "tools_requests" runs tests/assets/tools_grpo_script.py instead
RUNS: dict[str, tuple[int, list[str]]] = {
    "default": (1, ["--max_steps", "3"]),
    "ddp": (2, ["--max_steps", "3"]),
    "ppo": (1, ["--config", "ppo", "--max_steps", "3"]),
    "dapo_partial": (1, [*PARTIAL, "--filter_groups", "true", "--loss_type", "dapo", "--max_steps", "3"]),
    "tools_requests": (1, []),
    "agent": (1, ["--agent", "seeded_agent:agent", "--max_steps", "2", "--train_batch_size", "4", "--rollout_n", "2",
                  "--max_completion_length", "6"]),
    "ranks_partial": (3, [*PARTIAL, "--rollout_ranks", "1", "--rollout_lookahead", "1", "--max_steps", "3"]),
}
#: logged values that measure time or this machine, not training
#: (weight_sync/transfer_*: logged once the sender thread has finished, which the step may or may not see yet)
TIMING = ("time", "timing", "wall", "wait", "second", "throughput", "memory", "overlap", "speed", "tokens_per",
          "weight_sync/transfer")


def _timed(key: str) -> bool:
    """Whether a logged value measures time or this machine (left out of records and comparisons)."""
    return key.endswith("_s") or any(t in key for t in TIMING)


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _steps(history: list[dict]) -> list[dict]:
    """The training steps' logged numbers, timings left out."""
    steps = []
    for entry in history:
        if "loss" not in entry and "reward" not in entry:
            continue
        steps.append({k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and not _timed(k)})
    return steps


def record(tree: Path, out: Path, names: list[str]) -> None:
    """Run ``names`` against ``tree``; write ``out/<name>.json`` (the steps' values) and ``out/<name>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    for name in names:
        procs, extra = RUNS[name]
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as work:
            work = Path(work)
            if name == "tools_requests":
                options = {"rollout_multi_turn": "requests", "per_device_train_batch_size": 16, "num_generations": 4}
                cmd = [sys.executable, str(tree / "tests/assets/tools_grpo_script.py"), str(work), "vllm", "sync", "2",
                       json.dumps(options)]
                source = tree / "tests/assets/tools_grpo_script.py"
                script = work / "script.py"
                script.write_text(source.read_text()
                                  .replace("from trl import GRPOConfig, GRPOTrainer",
                                           "from trl_nrollout import NRolloutConfig as GRPOConfig\n"
                                           "from trl_nrollout import NRolloutGRPOTrainer")
                                  .replace("trainer = GRPOTrainer(", "trainer = NRolloutGRPOTrainer("))
                cmd[1] = str(script)
            else:
                (work / "seeded_agent.py").write_text(AGENT)
                env["PYTHONPATH"] = f"{tree}{os.pathsep}{work}"
                head = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs),
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "--main_process_port", _port()]
                head += ["--multi_gpu"] if procs > 1 else ["--cpu"]
                cmd = [*head, str(tree / "recipes/grpo.py"), "--output_dir", str(work / "out"), "--use_cpu", "true",
                       "--save_strategy", "no", "--report_to", "none", *extra]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
            (out / f"{name}.log").write_text(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-40000:])
            if proc.returncode != 0:
                print(f"{name}: FAILED (exit {proc.returncode}; see {out / (name + '.log')})", flush=True)
                continue
            if name == "tools_requests":
                history = json.loads((work / "result.json").read_text())["history"]
            else:
                history = json.loads((work / "out" / "log_history.json").read_text())
        steps = _steps(history)
        (out / f"{name}.json").write_text(json.dumps(steps, indent=1))
        print(f"{name}: {len(steps)} steps, {time.monotonic() - start:.0f} s", flush=True)


def compare(a: Path, b: Path) -> bool:
    """Print, run by run, whether ``a``'s and ``b``'s records agree value for value; True when all do."""
    same = True
    for path in sorted(a.glob("*.json")):
        other = b / path.name
        if not other.exists():
            print(f"{path.stem}: missing in {b}")
            same = False
            continue
        x, y = json.loads(path.read_text()), json.loads(other.read_text())
        diffs = []
        if len(x) != len(y):
            diffs.append(f"{len(x)} steps against {len(y)}")
        for i, (sx, sy) in enumerate(zip(x, y)):
            for key in sorted(k for k in set(sx) | set(sy) if not _timed(k)):
                u, v = sx.get(key), sy.get(key)
                if u != v and not (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v)):
                    diffs.append(f"step {i + 1} {key}: {u} against {v}")
        values = sum(1 for s in x for k in s if not _timed(k))
        print(f"{path.stem}: {'equal' if not diffs else 'DIFFERENT'} ({len(x)} steps, {values} values)"
              + "".join(f"\n    {d}" for d in diffs[:12]))
        same &= not diffs
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the seeded runs against a tree and save their steps")
    rec.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    cmp = sub.add_parser("compare", help="compare two records value for value")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        names = [n for n in args.runs.split(",") if n]
        unknown = [n for n in names if n not in RUNS]
        if unknown:
            parser.error(f"--runs: unknown run(s) {unknown}; choose among {list(RUNS)}")
        record(args.tree.resolve(), args.out, names)
        return 0
    return 0 if compare(args.a, args.b) else 1


if __name__ == "__main__":
    sys.exit(main())
