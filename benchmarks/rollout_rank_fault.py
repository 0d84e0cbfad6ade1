"""A lost rollout rank (issue 65 item 1): the run with one rollout rank SIGKILLed during step 3, against the same run
without the kill, both real ``accelerate launch --max_restarts 1`` launches.

2 trainers + 2 rollout ranks (4 processes), the embedded default recipe, ``--max-steps`` steps (8) with a checkpoint
every step. The fault: once checkpoint-2 is complete (step 3 running), global rank 3 (a rollout rank) is killed with
SIGKILL from outside. torchrun's agent then ends every process and starts them again (``--max_restarts 1``); the
restarted run resumes from the last checkpoint on its own (``resume_from_checkpoint`` unset: a restarted launch
resumes as under ``auto``). Reports both runs' wall time and their ratio (goal: <= 1.6x), the steps trained, the
checkpoint resumed from, and whether every step logged the same reward, loss and gradient norm as the run without
the kill (the same prompts trained, each once). Writes ``rollout_rank_fault.json`` / ``.md`` under ``--out``.

    python benchmarks/rollout_rank_fault.py [--max-steps 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, check_load, finish, write_table

GOAL = 1.6
KEYS = ("reward", "loss", "grad_norm")


def one_run(out: Path, max_steps: int, kill: bool) -> dict:
    """One launch (killing rank 3 once checkpoint-2 is complete when ``kill``); its wall time and logged steps."""
    sys.path.insert(0, str(ROOT))
    from tests.fault import launch_killing

    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--max_restarts", "1", "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "recipes" / "grpo.py"),
           "--output_dir", str(out), "--use_cpu", "true", "--bf16", "false", "--max_steps", str(max_steps),
           "--rollout_ranks", "2", "--save_strategy", "steps", "--save_steps", "1"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    code, killed, wall = launch_killing(cmd, cwd=ROOT, env=env, log=out.with_suffix(".log"),
                                        checkpoint=out / "checkpoint-2" if kill else None, rank=3, timeout_s=1800)
    if code != 0:
        raise RuntimeError(f"the launch failed (exit {code}); its output: {out.with_suffix('.log')}")
    summary = json.loads((out / "run_summary.json").read_text())
    steps = [{k: h.get(k) for k in ("step", *KEYS)} for h in json.loads((out / "log_history.json").read_text())
             if "reward" in h]
    return {"kill": kill, "killed_pid": killed, "wall_s": wall, "steps": steps, "restarts": summary["restarts"],
            "resumed_from": Path(summary["resumed_from"]).name if summary["resumed_from"] else None,
            "steps_trained": summary["steps_trained"]}


def table_lines(result: dict) -> list[str]:
    """The table docs/benchmarks.md quotes, from a run's JSON."""
    plain, killed = result["plain"], result["killed"]
    lines = ["| run | restarts | resumed from | steps logged | same values as without the kill | wall s | / without |",
             "|---|---|---|---|---|---|---|"]
    for name, r in (("without the kill", plain), ("rollout rank 3 killed in step 3", killed)):
        lines.append(f"| {name} | {r['restarts']} | {r['resumed_from'] or '-'} | {len(r['steps'])} | "
                     f"{'yes' if result['same_steps'] or r is plain else 'NO'} | {r['wall_s']:.1f} | "
                     f"{r['wall_s'] / plain['wall_s']:.2f}x |")
    lines += ["", f"2 trainers + 2 rollout ranks on {result['meta']['cpus']} CPUs, the embedded default, "
              f"{result['meta']['max_steps']} steps, a checkpoint every step. Goal <= {GOAL}x. Load average (1 min) "
              f"{result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end."]
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    return write_table(result, table_lines(result), out_dir, "rollout_rank_fault")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    load, busy = check_load("rollout_rank_fault")
    with tempfile.TemporaryDirectory() as tmp:
        plain = one_run(Path(tmp) / "plain", args.max_steps, kill=False)
        print(f"without the kill: {plain['wall_s']:.1f} s", file=sys.stderr, flush=True)
        killed = one_run(Path(tmp) / "killed", args.max_steps, kill=True)
        print(f"killed: {killed['wall_s']:.1f} s, resumed from {killed['resumed_from']}", file=sys.stderr, flush=True)
    same = [s["step"] for s in killed["steps"]] == [s["step"] for s in plain["steps"]] and all(
        math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)
        for a, b in zip(plain["steps"], killed["steps"]) for k in KEYS if a[k] is not None)
    result = {"meta": {"max_steps": args.max_steps, "cpus": os.cpu_count()}, "plain": plain, "killed": killed,
              "same_steps": same, "load_avg_start": list(load),
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
