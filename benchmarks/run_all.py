"""Run the benchmark scripts one after another (``make bench``; ``make bench ARGS=--quick`` for the short versions).

Each script in :data:`BENCHMARKS` runs in its own process, in order, with ``--out`` and (when given) ``--quick``
passed on; a script that does not exist yet is skipped. To add a benchmark, append its file name to the list: it
must accept ``--quick`` and ``--out DIR``.

    python benchmarks/run_all.py [--quick] [--out DIR] [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The benchmark scripts, in the order they run (file names under benchmarks/). Missing ones are skipped.
BENCHMARKS: list[str] = [
    "logprob_memory.py",
    "engine_overhead.py",
    "rollout_throughput.py",
    "step_benchmark.py",
    "overlap_probe.py",
    "ppo_critic_cost.py",
    "partial_rollout.py",
    "tool_latency.py",
    "dispatch_balance.py",
    "plan_accuracy.py",
    "plan_published.py",
    "training_side_vs_trl.py",
    "func_groups.py",
    "distill_step.py",
]

#: The benchmark scripts ``make bench`` does not run, each run alone (``python benchmarks/NAME``, its own options) and
#: why: several real launches, long runs, or a machine-sized check. ``--list`` prints them too.
APART: dict[str, str] = {
    "agent_barrier.py": "agents through the endpoint vs a turn barrier: its own --repeats, no --quick",
    "agent_carry.py": "agents' calls cut by a step's end, continued vs restarted: its own --repeats, no --quick",
    "agent_learning.py": "a learning curve of an agent with tools (minutes of training), no --quick",
    "lora_curves.py": "reward curves of the two LoRA sync modes (several full trainings)",
    "lora_sync.py": "LoRA sync timing on the medium model (long engine builds)",
    "lora_sync_ranks.py": "LoRA sync to a rollout rank: one real 2-process launch per mode, no --quick",
    "padding_free.py": "the padding-free forward at long-tailed lengths: its own sizes, no --quick",
    "rollout_ranks.py": "real ZeRO-3 launches of the recipe (one-step-off vs synchronous vs colocated), about 20 minutes",
    "rollout_rank_fault.py": "a rollout rank SIGKILLed in step 3 of a real 4-process launch with --max_restarts 1, "
                             "against the same launch without the kill, no --quick",
    "rollout_ranks_user_size.py": "a user-sized job (1.08 M tokens) through the rollout ranks' transport, no --quick",
    "sp_memory.py": "Ulysses memory per rank, 2-process launches, no --quick",
    "store_load.py": "the launcher store under many waiting ranks: a machine-sized check, no --quick",
    "weight_delta.py": "weight versions as deltas to a rollout rank: four real 2-process launches on the medium model",
    "distill_learning.py": "on-policy distillation's learning goal: ten 40-step training runs (a teacher, three seeds x "
                           "three arms), about 15 minutes",
    "vlm_tool_learning.py": "a VLM learns from a tool's picture (issue 66's learning goal): real 2-process launches, "
                            "with --control a second one, a few minutes each, no --quick",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every script")
    ap.add_argument("--out", default=str(HERE / "results"), help="results folder passed to every script")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these scripts (with or without .py)")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)

    names = BENCHMARKS
    if args.only:
        wanted = {n if n.endswith(".py") else n + ".py" for n in args.only}
        unknown = wanted - set(BENCHMARKS)
        if unknown:
            ap.error(f"--only {sorted(unknown)}: not in BENCHMARKS {BENCHMARKS}")
        names = [n for n in BENCHMARKS if n in wanted]

    results: list[tuple[str, str, float]] = []
    for name in names:
        script = HERE / name
        if not script.exists():
            print(f"[run_all] skip {name}: not written yet", flush=True)
            results.append((name, "skipped", 0.0))
            continue
        cmd = [sys.executable, str(script), "--out", args.out] + (["--quick"] if args.quick else [])
        print(f"[run_all] {' '.join(cmd)}", flush=True)
        if args.list:
            continue
        start = time.perf_counter()
        code = subprocess.run(cmd, cwd=HERE.parent).returncode
        results.append((name, "ok" if code == 0 else f"failed (exit {code})", time.perf_counter() - start))

    if args.list:
        for name, why in APART.items():
            print(f"[run_all] not in make bench: python benchmarks/{name}  ({why})", flush=True)
    else:
        print("\n[run_all] summary")
        for name, status, seconds in results:
            print(f"  {name:<32} {status:<18} {seconds:7.1f} s")
    return 1 if any(status.startswith("failed") for _, status, _ in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
