"""On-policy distillation's learning goal (issue 64): a teacher trained by the demo and a fresh student; how many
steps the student needs to reach 90% of the teacher's reward by GRPO alone, by distillation alone (the teacher term
with the rewards weighted 0: GRPO's machinery, the teacher's pull as the only signal) and by both mixed.

Each arm is one real run of the recipe (``recipes/grpo.py``, one process, the vLLM engine, the embedded default's
task: ``builtin:digits`` with the ``digits`` and ``short_answer`` rewards, 8 prompts x 8 samples a step). The teacher
is the default recipe trained for ``--teacher-steps`` steps (seed 42); each student starts from ``builtin:tiny-qwen2``
(random weights; the same start in every arm of a seed) and runs ``--steps`` steps. The score of a step is the
rewards' weighted mean as the default weighs them (0.5 each), read from the per-function means TRL logs, so the
distillation-only arm (whose weights are 0) is scored on the same scale. "Steps to 90%": the first step whose mean
score over 3 steps reaches 0.9 x the teacher's (its last 5 steps' mean); ``None`` where a run never does.

Goal (issue 64): distillation alone reaches 90% of the teacher's reward in at most half the steps GRPO needs, on
each seed; and the mixed arm beats both or the table says why not.

    python benchmarks/distill_learning.py [--seeds 1,2,3] [--steps 40] [--teacher-steps 40] [--coef 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import CHILD_ENV, ROOT, finish, pyplot, save_figure, start_parent, write_table

GOAL = 0.5
WEIGHTS = {"digits_reward": 0.5, "short_answer_reward": 0.5}  # the default recipe's reward_weights
ARMS = ("grpo", "distill", "mixed")


def run(out: Path, extra: list[str], timeout: float, what: str, lock: str | None = None) -> list[dict]:
    """One run of the default recipe with ``extra`` options (under ``flock lock`` where given: a machine shared
    with other jobs runs one at a time); its log history."""
    cmd = [*(["flock", lock] if lock else []), sys.executable, str(ROOT / "recipes/grpo.py"), "--config", "default", "--output_dir", str(out),
           "--report_to", "none", *extra]
    print(what, file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env={**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((out / "log_history.json").read_text())


def scores(history: list[dict]) -> list[float]:
    """Each step's score: the per-function reward means weighed as the default weighs them."""
    out = []
    for h in history:
        means = {name: h.get(f"rewards/{name}/mean") for name in WEIGHTS}
        if all(v is not None for v in means.values()):
            out.append(sum(WEIGHTS[n] * v for n, v in means.items()))
    return out


def steps_to(series: list[float], target: float, window: int = 3) -> int | None:
    """The first step (1-based) whose mean over ``window`` steps ending there reaches ``target``."""
    for i in range(window - 1, len(series)):
        if statistics.fmean(series[i - window + 1:i + 1]) >= target:
            return i + 1
    return None


def arm_options(arm: str, teacher: str, coef: float) -> list[str]:
    if arm == "grpo":
        return []
    distill = ["--teacher_model_name_or_path", teacher, "--teacher_kl_coef", str(coef)]
    return distill + (["--reward_weights", "0.0", "0.0"] if arm == "distill" else [])


def table_lines(result: dict) -> list[str]:
    """The Markdown table of a result (its JSON as written): one row per seed, steps to 90% per arm."""
    lines = ["| seed | GRPO: steps to 90% | distillation alone | mixed | distillation / GRPO | final score GRPO / "
             "distill / mixed |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = r["steps_to_target"]
        ratio = (f"{s['distill'] / s['grpo']:.2f}x" if s["distill"] is not None and s["grpo"] else
                 "-" if s["distill"] is None else f"< {1 / len(r['scores']['grpo']):.2f}x (GRPO never)")
        finals = " / ".join(f"{statistics.fmean(r['scores'][a][-5:]):.2f}" for a in ARMS)
        lines.append(f"| {r['seed']} | {s['grpo']} | {s['distill']} | {s['mixed']} | {ratio} | {finals} |")
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    meta = result["meta"]
    lines = table_lines(result)
    lines += ["", f"Teacher: the default recipe after {meta['teacher_steps']} steps, score {meta['teacher_score']:.3f} "
              f"(target 90%: {meta['target']:.3f}). Students: `builtin:tiny-qwen2`, {meta['steps']} steps, teacher "
              f"coefficient {meta['coef']:g}. Goal: distillation / GRPO <= {GOAL}x on each seed. {meta['cpus']} CPUs; "
              f"load average (1 min) {result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at "
              "end."]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        colors = {"grpo": "tab:blue", "distill": "tab:orange", "mixed": "tab:green"}
        for r in result["rows"]:
            for arm in ARMS:
                ax.plot(range(1, len(r["scores"][arm]) + 1), r["scores"][arm], color=colors[arm], alpha=0.7,
                        label=arm if r is result["rows"][0] else None)
        ax.axhline(meta["target"], color="grey", linestyle="--", label="90% of the teacher")
        ax.set(xlabel="step", ylabel="score (0.5 digits + 0.5 short_answer)",
               title="fresh student: GRPO vs distillation from the demo's model")
        ax.legend()
        save_figure(fig, out_dir / "distill_learning.png")
    return write_table(result, lines, out_dir, "distill_learning")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2", help="the teacher's start and every student's")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--teacher-steps", type=int, default=40)
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--lock", help="a lock file each run takes with flock (a machine shared with other jobs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    _, load, busy = start_parent(args, "distill_learning")
    with tempfile.TemporaryDirectory() as tmp:
        teacher = Path(tmp) / "teacher"
        model = ["--model_name_or_path", args.model]
        t_scores = scores(run(teacher, [*model, "--max_steps", str(args.teacher_steps)], args.timeout,
                              f"teacher: the default recipe, {args.teacher_steps} steps", args.lock))
        teacher_score = statistics.fmean(t_scores[-5:])
        target = 0.9 * teacher_score
        rows = []
        for seed in (int(s) for s in args.seeds.split(",")):
            series = {arm: scores(run(Path(tmp) / f"{arm}{seed}", [*model, "--seed", str(seed), "--max_steps",
                                                                   str(args.steps), *arm_options(arm, str(teacher),
                                                                                                 args.coef)],
                                      args.timeout, f"seed {seed}: {arm}, {args.steps} steps", args.lock))
                      for arm in ARMS}
            rows.append({"seed": seed, "scores": series,
                         "steps_to_target": {arm: steps_to(s, target) for arm, s in series.items()}})
    result = {"meta": {"steps": args.steps, "teacher_steps": args.teacher_steps, "coef": args.coef,
                       "teacher_score": teacher_score, "teacher_scores": t_scores, "target": target,
                       "cpus": os.cpu_count()},
              "rows": rows, "load_avg_start": list(load), "load_avg_end": [round(x, 2) for x in os.getloadavg()],
              "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
