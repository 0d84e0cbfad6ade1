"""What PPO's critic costs: time per step and training memory, beside the policy's, measured in the same run.

For each model (``builtin:tiny-qwen2``, ``builtin:small-qwen2``, or ``--models``) a fresh process trains
``NRolloutPPOTrainer`` for ``--steps`` steps (32 prompts x n = 1, 16 new tokens, vLLM engine when installed, else HF)
and reports, the first step dropped:

- time per step of each phase from the trainer's ``timing_s/*`` metrics: generation, old log-probs, the critic's
  value pass (``values``), the actor update and the critic update; the critic's share of the step;
- training-state memory, counted from the objects after training: parameters, gradients and AdamW state of the
  policy and of the critic (bytes), and the process's peak RSS.

Writes ``ppo_critic_cost.json``, ``.md`` and ``.png`` under ``--out`` (default benchmarks/results).
Run: ``.venv/bin/python benchmarks/ppo_critic_cost.py [--quick] [--steps 6] [--models builtin:tiny-qwen2 ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import CHILD_ENV, check_load  # noqa: E402

PHASES = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/values", "timing_s/update_actor",
          "timing_s/update_critic")


def _state_bytes(params, optimizer) -> dict:
    params = list(params)
    p = sum(t.numel() * t.element_size() for t in params)
    g = sum(t.grad.numel() * t.grad.element_size() for t in params if t.grad is not None)
    o = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel"))
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def one(model: str, steps: int, out: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from trl_nrollout import NRolloutPPOConfig, NRolloutPPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward

    args = NRolloutPPOConfig(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", bf16=False,
                             train_batch_size=32, ppo_mini_batch_size=32, max_completion_length=16, max_steps=steps,
                             learning_rate=1e-6, critic_learning_rate=1e-6, logging_steps=1, seed=0,
                             disable_tqdm=True)
    trainer = NRolloutPPOTrainer(model, reward_funcs=digits_reward, args=args, train_dataset=digits_dataset(256))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "timing_s/step" in h][1:]  # the first step warms up
    phases = {k: sum(h.get(k, 0.0) for h in logs) / max(len(logs), 1) for k in (*PHASES, "timing_s/step")}
    result = {
        "model": model, "backend": trainer.rollout_backend, "steps_measured": len(logs), "seconds": phases,
        "critic_share_of_step": (phases["timing_s/values"] + phases["timing_s/update_critic"])
        / max(phases["timing_s/step"], 1e-9),
        "policy_bytes": _state_bytes(trainer.model.parameters(), trainer.optimizer),
        "critic_bytes": _state_bytes(trainer.critic.parameters(), trainer.critic_optimizer),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    trainer.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["builtin:tiny-qwen2", "builtin:small-qwen2"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="tiny model only, 3 steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), out / "ppo_run")))
        return
    models, steps = (["builtin:tiny-qwen2"], 3) if a.quick else (a.models, a.steps)
    load, busy = check_load("ppo_critic_cost")
    from tqdm import tqdm

    rows = []
    for model in tqdm(models, desc="ppo_critic_cost"):
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run([sys.executable, __file__, "--out", str(out), "--one", model, str(steps)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{model} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = {"load_at_start": load, "machine_busy": busy, "rows": rows}
    (out / "ppo_critic_cost.json").write_text(json.dumps(result, indent=2))
    lines = ["| model | backend | step s | gen | old log-prob | critic values | actor update | critic update | "
             "critic share of step | policy state MB | critic state MB | critic / policy memory |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["seconds"]
        pol, cri = r["policy_bytes"]["total"] / 2**20, r["critic_bytes"]["total"] / 2**20
        lines.append(f"| {r['model']} | {r['backend']} | {s['timing_s/step']:.3f} | {s['timing_s/gen']:.3f} | "
                     f"{s['timing_s/old_log_prob']:.3f} | {s['timing_s/values']:.3f} | {s['timing_s/update_actor']:.3f}"
                     f" | {s['timing_s/update_critic']:.3f} | {r['critic_share_of_step']:.0%} | {pol:.1f} | {cri:.1f} "
                     f"| {cri / pol:.2f} |")
    lines.append(f"\nload average at start: {load[0]:.2f}" + (" (machine busy: noisy)" if busy else " (idle)"))
    (out / "ppo_critic_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["model"].replace("builtin:", "") for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r["seconds"][phase] for r in rows]
        ax.barh(names, vals, left=bottom, label=phase.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("seconds per PPO step (32 prompts x n=1, 16 tokens)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("PPO step by phase: the critic's share (values + critic update)")
    fig.tight_layout()
    fig.savefig(out / "ppo_critic_cost.png", dpi=110)


if __name__ == "__main__":
    main()
