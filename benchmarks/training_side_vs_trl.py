"""The training side of a whole GRPO step vs TRL's ``GRPOTrainer``, generation excluded (issue 45's second goal).

Both trainers are built from the same plain ``trl.GRPOConfig`` (``NRolloutGRPOTrainer`` converts it) on the same
model (``builtin:small-qwen2``, float32 on the CPU, SDPA, TRL's default gradient checkpointing), the same prompts and
the same batch: ``per_device_train_batch_size=16``, ``num_generations=8``, ``gradient_accumulation_steps=4`` (one
rollout of 8 prompts x 8 = 64 samples per optimizer step), ``num_iterations=2`` (each rollout trains two optimizer
steps, so both run the old-policy pass) and ``beta=0.04`` (both run the reference pass). Generation is excluded: a
custom ``rollout_func`` (TRL's argument; both trainers call it as ``rollout_func(prompts, trainer)`` with the rank's
prompts, each repeated ``num_generations`` times, and take its ``prompt_ids`` / ``completion_ids`` / ``logprobs``)
returns deterministic completions of long-tailed lengths: a clipped exponential, mean = cap / 4, cap
``--cap`` (512), at least one completion at the cap per rollout (:func:`tail_lengths`, the first goal's workload),
random non-special tokens after ``--prompt``-token prompts. Each rollout's prompts and lengths are fingerprinted and
the fingerprints compared across arms: every arm trains on the same samples, and none generates (our arms use
``rollout_backend='hf'``, the training model itself, as TRL does with ``use_vllm=False``: no engine, no weight sync).

Arms (each in a fresh process, ``--repeats`` times in alternating order; each arm's figures are those of its
fastest process, since on a shared machine another job only ever adds time; every process's figure is kept):

- ``trl``: TRL's ``GRPOTrainer`` (every micro batch padded to the rollout's longest sample, in the update and in the
  old-policy and reference passes).
- ``ours-padded``: ``NRolloutGRPOTrainer`` with ``padding_free=False`` and ``shared_prompt_forward=False``,
  count-based micro batches: TRL's layout, the control (its update as TRL's; its log-prob passes pad each micro batch
  to its own longest, not the rollout's, so they cost less).
- ``ours``: the default (padding-free where the model takes it, count-based micro batches).
- ``ours-budget``: the default with token-budgeted micro batches (``use_dynamic_bsz=True``: the default budget, or
  ``ppo_max_token_len_per_device=--budget``).

Measured: seconds per rollout (its ``num_iterations`` optimizer steps, wall time between the Trainer's step ends)
minus the ``rollout_func``'s own seconds, the first rollout a warm-up and dropped; split by one clock for every arm
into the old-policy pass, the reference pass (the log-prob forwards inside the rollout stage), the update (each
``training_step`` less its ``_prepare_inputs``, plus the optimizer step) and the rest (rewards, advantages, padding,
logging). The ratios to ``trl`` come from the same run; the goal is ``ours`` (or ``ours-budget``) <= 0.5x ``trl``.
Prints and saves ``training_side_vs_trl.json`` / ``.md`` / ``.png`` under ``--out``; ``--docs`` copies the plot
to docs/img.

    python benchmarks/training_side_vs_trl.py [--rollouts 3] [--cap 512] [--prompt 32] [--budget N] [--repeats 1]
        [--bf16] [--threads K] [--quick] [--out DIR] [--docs]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import check_load, pyplot, run_child, save_figure, write_table  # noqa: E402
from padding_free import lengths_of  # noqa: E402

ARMS = ("trl", "ours-padded", "ours", "ours-budget")
ARM_LABELS = {"trl": "TRL GRPOTrainer", "ours-padded": "ours, padding_free=False (control)",
              "ours": "ours, default (padding-free)", "ours-budget": "ours, padding-free + token budget"}
PHASES = ("old_log_prob", "ref", "update", "rest")
PHASE_LABELS = {"old_log_prob": "old-policy pass", "ref": "reference pass", "update": "update (fwd + bwd + optim)",
                "rest": "rest (rewards, advantages, batching)"}
PER_DEVICE, N, ACCUM, ITERATIONS, BETA = 16, 8, 4, 2, 0.04
GOAL = 0.5
TOKENS = (5, 1000)  # completion and prompt token ids: none of builtin:small-qwen2's special tokens (0, 1, 2)


# ---------------------------------------------------------------------------------------------- the workload
def prompt_tokens(prompt: str, length: int) -> list[int]:
    """A dataset prompt's ``length`` token ids, the same in every process (seeded by the prompt's text)."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
    return torch.randint(*TOKENS, (length,), generator=gen).tolist()


def tail_lengths(samples: int, cap: int, seed: int) -> list[int]:
    """Long-tailed completion lengths: ``padding_free.lengths_of`` (a clipped exponential, mean = cap / 4, the
    workload of the first goal) with its first sample at the cap (that function's rescaling to the exact mean can
    leave no sample at the cap)."""
    lengths = lengths_of("long-tailed", samples, cap, seed=seed)
    lengths[0] = cap
    return lengths


def completion_tokens(lengths: list[int], seed: int) -> list[list[int]]:
    """Random completion token ids of the given lengths (no EOS: every token is trained on)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(*TOKENS, (n,), generator=gen).tolist() for n in lengths]


def fingerprint(prompts: list[str], lengths: list[int]) -> int:
    """One number per rollout: which prompts, in which order, with which completion lengths."""
    return zlib.crc32(repr((prompts, lengths)).encode())


def make_rollout_func(cap: int, prompt_len: int):
    """TRL's ``rollout_func(prompts, trainer)``: for the k-th call, one long-tailed completion per entry of
    ``prompts`` (:func:`tail_lengths` with seed k); its seconds are added to ``trainer._bench_cur``."""
    calls = {"count": 0}

    def rollout_func(prompts: list, trainer) -> dict:
        start = time.perf_counter()
        k = calls["count"]
        calls["count"] += 1
        lengths = tail_lengths(len(prompts), cap, seed=k)
        completions = completion_tokens(lengths, seed=1000 + k)
        out = {"prompt_ids": [prompt_tokens(p, prompt_len) for p in prompts], "completion_ids": completions,
               "logprobs": [[-1.0] * n for n in lengths]}
        trainer.bench_rollouts.append({"fingerprint": fingerprint(list(prompts), lengths), "lengths": lengths})
        trainer._bench_cur["rollout_func"] += time.perf_counter() - start
        return out

    return rollout_func


def length_reward(completions: list, completion_ids: list | None = None, **kwargs) -> list[float]:
    """A reward with a spread inside each group (so advantages are not zero): shorter completions score higher."""
    return [-len(ids) / 512 for ids in completion_ids]


# ---------------------------------------------------------------------------------------------- child side
def _fresh() -> dict:
    return dict.fromkeys(("rollout", "rollout_func", "prepare", "training_step", "after_training_step",
                          "old_log_prob", "ref"), 0.0)


def clocked(base):
    """``base`` (TRL's GRPOTrainer or ours) with one clock per optimizer step (see the module docstring)."""
    from transformers import TrainerCallback

    class StepEnd(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kwargs):
            self.trainer._bench_prev = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            tr, now = self.trainer, time.perf_counter()
            cur = tr._bench_cur
            cur["after_training_step"] = now - tr._bench_ts_end  # grad clipping, optimizer, scheduler, zero_grad
            cur["step"] = now - tr._bench_prev
            tr.bench_steps.append(cur)
            tr._bench_cur, tr._bench_prev = _fresh(), now

    class Clocked(base):
        def __init__(self, *a, **kw):
            self.bench_steps: list[dict] = []
            self.bench_rollouts: list[dict] = []
            self._bench_cur = _fresh()
            self._bench_in_rollout = False
            self._bench_prev = self._bench_ts_end = time.perf_counter()
            super().__init__(*a, **kw)
            self.add_callback(StepEnd(self))
            passes = getattr(self, "logprob_passes", None)  # ours: the old-policy and reference passes' part
            if passes is not None:
                log_probs = passes.log_probs

                def timed(model, *a, **kw):
                    t = time.perf_counter()
                    out = log_probs(model, *a, **kw)
                    self._bench_add(self._pass_key(model), t)
                    return out

                passes.log_probs = timed

        def _bench_add(self, key: str, start: float) -> None:
            self._bench_cur[key] += time.perf_counter() - start

        def training_step(self, model, inputs, num_items_in_batch):
            t = time.perf_counter()
            out = super().training_step(model, inputs, num_items_in_batch)
            self._bench_add("training_step", t)
            self._bench_ts_end = time.perf_counter()
            return out

        def _prepare_inputs(self, generation_batch):
            t = time.perf_counter()
            out = super()._prepare_inputs(generation_batch)
            self._bench_add("prepare", t)
            return out

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            self._bench_in_rollout = True
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self._bench_in_rollout = False
                self._bench_add("rollout", t)

        def _pass_key(self, model) -> str:
            return "ref" if self.ref_model is not None and model is self.ref_model else "old_log_prob"

        # TRL's log-prob passes in the rollout stage (the same method is the update's forward: not timed there)
        def _get_per_token_logps_and_entropies(self, model, *a, **kw):
            if not self._bench_in_rollout:
                return super()._get_per_token_logps_and_entropies(model, *a, **kw)
            t = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(model, *a, **kw)
            self._bench_add(self._pass_key(model), t)
            return out

    return Clocked


def grpo_config(args, output_dir: str):
    """The one plain ``trl.GRPOConfig`` every arm starts from."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=args.bf16, seed=0, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, log_completions=False, learning_rate=1e-7,
        per_device_train_batch_size=PER_DEVICE, num_generations=N, gradient_accumulation_steps=ACCUM,
        num_iterations=ITERATIONS, beta=BETA, max_completion_length=args.cap,
        max_steps=ITERATIONS * args.rollouts)


def ours_config(grpo, **overrides):
    """``grpo`` converted as ``NRolloutGRPOTrainer`` converts a plain ``GRPOConfig``
    (:func:`trl_nrollout.trainer.grpo.to_nrollout_config`), with ``overrides`` (our options) set at construction
    so that they are resolved as a user's would be; checked field by field against that conversion."""
    from dataclasses import fields

    from trl import GRPOConfig

    from trl_nrollout.config import NRolloutConfig
    from trl_nrollout.trainer.grpo import to_nrollout_config

    values = {f.name: getattr(grpo, f.name) for f in fields(GRPOConfig) if f.init}
    values["generation_batch_size"] = None
    cfg = NRolloutConfig(**values, clip_ratio_c=None, kl_loss_type="k3", **overrides)
    plain, ours = to_nrollout_config(grpo).to_dict(), cfg.to_dict()
    touched = set(overrides) | {"use_dynamic_bsz", "log_prob_max_token_len_per_device"}  # resolved from a budget
    differ = sorted(k for k in plain if k not in touched and plain[k] != ours.get(k))
    if differ:
        raise RuntimeError(f"the benchmark's config conversion differs from to_nrollout_config in {differ}")
    return cfg


def build_trainer(arm: str, args):
    from datasets import Dataset
    from transformers import AutoTokenizer

    prompts = [f"prompt {i}" for i in range(8 * args.rollouts * 4)]
    dataset = Dataset.from_dict({"prompt": prompts})
    tok = AutoTokenizer.from_pretrained(args.model)
    grpo = grpo_config(args, tempfile.mkdtemp(prefix=f"training_side_{arm}_"))
    rollout_func = make_rollout_func(args.cap, args.prompt)
    kw = dict(model=args.model, reward_funcs=[length_reward], train_dataset=dataset, processing_class=tok,
              rollout_func=rollout_func)
    if arm == "trl":
        from trl import GRPOTrainer

        return clocked(GRPOTrainer)(args=grpo, **kw)
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    overrides: dict = {"rollout_backend": "hf"}
    if arm == "ours-padded":
        overrides.update(padding_free=False, shared_prompt_forward=False)
    elif arm == "ours-budget":
        overrides.update({"ppo_max_token_len_per_device": args.budget} if args.budget else {"use_dynamic_bsz": True})
    return clocked(NRolloutGRPOTrainer)(args=ours_config(grpo, **overrides), **kw)


def _per_rollout(steps: list[dict]) -> list[dict]:
    """Optimizer steps grouped by rollout (``ITERATIONS`` each): seconds of each phase per rollout."""
    out = []
    for i in range(0, len(steps) - ITERATIONS + 1, ITERATIONS):
        group = steps[i:i + ITERATIONS]
        s = {k: sum(g[k] for g in group) for k in group[0]}
        row = {"step_ex_gen": s["step"] - s["rollout_func"], "rollout_func": s["rollout_func"],
               "old_log_prob": s["old_log_prob"], "ref": s["ref"],
               "update": s["training_step"] - s["prepare"] + s["after_training_step"]}
        row["rest"] = row["step_ex_gen"] - row["old_log_prob"] - row["ref"] - row["update"]
        out.append(row)
    return out


def run_one(arm: str, args) -> dict:
    """One arm in this process: ``args.rollouts`` rollouts of ``ITERATIONS`` optimizer steps, the first dropped."""
    import torch

    logging.getLogger("trl_nrollout").setLevel(logging.INFO)
    load = os.getloadavg()[0]
    trainer = build_trainer(arm, args)
    trainer.train()
    rollouts = _per_rollout(trainer.bench_steps)
    measured = rollouts[1:] or rollouts
    logs = [h for h in trainer.state.log_history if "loss" in h]
    row = {
        "arm": arm, "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2),
        "torch_threads": torch.get_num_threads(), "rollouts_measured": len(measured),
        "per_rollout": [{k: round(v, 4) for k, v in r.items()} for r in rollouts],
        **{k: round(statistics.mean(r[k] for r in measured), 4) for k in ("step_ex_gen", "rollout_func", *PHASES)},
        "fingerprints": [r["fingerprint"] for r in trainer.bench_rollouts],
        "lengths": [r["lengths"] for r in trainer.bench_rollouts],
        "losses": [round(h["loss"], 6) for h in logs],
    }
    if arm != "trl":
        micro = [h["update/micro_batches"] for h in trainer.state.log_history if "update/micro_batches" in h]
        row.update(update_padding_free=trainer.policy_update.padfree_said,
                   budget_tokens=trainer.update_budget.tokens if trainer.update_budget is not None else None,
                   update_micro_batches=micro[-1] if micro else None)
    return row


# ---------------------------------------------------------------------------------------------- parent side
def workload(lengths: list[int], prompt_len: int) -> dict:
    """Real tokens of one rollout and the token slots of TRL's layout (every sample as wide as the longest)."""
    real = sum(lengths) + prompt_len * len(lengths)
    padded = len(lengths) * (prompt_len + max(lengths))
    return {"samples": len(lengths), "mean_completion": round(sum(lengths) / len(lengths), 1),
            "longest": max(lengths), "real_tokens": real, "trl_token_slots": padded,
            "real_over_padded": round(real / padded, 3)}


def _child(args, arm: str, rep: int) -> dict:
    extra = (["--budget", str(args.budget)] if args.budget else []) + (["--bf16"] if args.bf16 else [])
    return run_child(__file__, ["--model", args.model, "--rollouts", str(args.rollouts), "--cap", str(args.cap),
                                "--prompt", str(args.prompt), *extra], arm, rep, args.threads, args.timeout)


def merge(runs: list[dict]) -> dict:
    """One row per arm from its repeats: the fastest process's (contention only adds time), with every process's
    seconds per rollout and load beside it."""
    row = dict(min(runs, key=lambda r: r["step_ex_gen"]))
    row["step_ex_gen_repeats"] = [r["step_ex_gen"] for r in runs]
    row["load_repeats"] = [[r["load_at_start"], r["load_at_end"]] for r in runs]
    return row


def write_outputs(result: dict, out: Path) -> str:
    rows = {r["arm"]: r for r in result["rows"]}
    trl = rows["trl"]["step_ex_gen"]
    w = result["workload"]
    lines = [f"# Training side of a GRPO step vs TRL, generation excluded (builtin:small-qwen2 "
             f"{'bf16 autocast' if result['bf16'] else 'fp32'}, CPU, "
             f"{result['threads']} threads, load {result['load_at_start'][0]:.2f} at start)", "",
             f"{w['samples']} samples per rollout ({w['samples'] // N} prompts x {N}), {result['prompt']}-token "
             f"prompts, completions long-tailed (mean {w['mean_completion']}, longest {w['longest']}, cap "
             f"{result['cap']}): {w['real_tokens']:.0f} real tokens, {w['trl_token_slots']:.0f} token slots in TRL's layout "
             f"({w['real_over_padded']:.2f} real). num_iterations={ITERATIONS}, beta={BETA}, "
             f"per_device_train_batch_size={PER_DEVICE}, gradient_accumulation_steps={ACCUM}; seconds per rollout "
             f"(its {ITERATIONS} optimizer steps) less the rollout_func's, mean of {result['rollouts'] - 1} "
             f"measured rollouts, fastest of {result['repeats']} process(es) per arm.", "",
             "| arm | s per rollout | vs TRL | old-policy pass | reference pass | update | rest | each process (load "
             "at its start / end) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        r = rows.get(arm)
        if r is None:
            continue
        lines.append(f"| {ARM_LABELS[arm]} | {r['step_ex_gen']:.2f} | **{r['step_ex_gen'] / trl:.2f}x** | "
                     + " | ".join(f"{r[k]:.2f} ({r[k] / rows['trl'][k]:.2f}x)" if rows['trl'][k] else f"{r[k]:.2f}"
                                  for k in PHASES)
                     + " | " + ", ".join(f"{v:.1f}" + (f" ({ld[0]:.1f} / {ld[1]:.1f})" if ld else "") for v, ld in
                                         zip(r["step_ex_gen_repeats"], r.get("load_repeats") or [None] * 9)) + " |")
    lines += ["", f"Same samples in every arm: {'yes' if result['same_samples'] else 'NO'} (rollout fingerprints); "
                  f"first-step loss per arm: " + ", ".join(f"{a} {rows[a]['losses'][0]:.5f}" for a in ARMS
                                                           if a in rows and rows[a]['losses']) + "."]
    for arm in ARMS[1:]:
        r = rows.get(arm)
        if r is not None:
            lines.append(f"- {arm}: update padding-free {r.get('update_padding_free')}, token budget "
                         f"{r.get('budget_tokens')}, update micro batches per rollout {r.get('update_micro_batches')}")
    best = min((rows[a]["step_ex_gen"] / trl, a) for a in ("ours", "ours-budget") if a in rows)
    lines += ["", f"Goal (ours <= {GOAL}x TRL's GRPOTrainer, whole step, generation excluded): best "
                  f"{best[1]} **{best[0]:.2f}x**: {'met' if best[0] <= GOAL else 'NOT met'}."]
    table = write_table(result, lines, out, "training_side_vs_trl")
    _plot(result, rows, out)
    return table


def _plot(result: dict, rows: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    arms = [a for a in ARMS if a in rows]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    colors = {"old_log_prob": "tab:orange", "ref": "tab:green", "update": "tab:blue", "rest": "tab:gray"}
    bottom = [0.0] * len(arms)
    for k in PHASES:
        vals = [max(0.0, rows[a][k]) for a in arms]
        ax.bar(range(len(arms)), vals, bottom=bottom, color=colors[k], label=PHASE_LABELS[k])
        bottom = [b + v for b, v in zip(bottom, vals)]
    trl = rows["trl"]["step_ex_gen"]
    for i, a in enumerate(arms):
        ax.text(i, rows[a]["step_ex_gen"], f"{rows[a]['step_ex_gen'] / trl:.2f}x", ha="center", va="bottom")
    ax.axhline(GOAL * trl, color="red", ls="--", lw=1, label=f"goal: {GOAL}x TRL")
    ax.set_ylim(0, 1.12 * max(rows[a]["step_ex_gen"] for a in arms))
    ax.set_xticks(range(len(arms)), [ARM_LABELS[a].replace(", ", ",\n") for a in arms], fontsize=8)
    ax.set_ylabel("s per rollout (generation excluded)")
    w = result["workload"]
    ax.set_title(f"{w['samples']} samples, long-tailed completions (mean {w['mean_completion']:.0f}, cap "
                 f"{result['cap']}), num_iterations={ITERATIONS}, beta={BETA}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    save_figure(fig, out / "training_side_vs_trl.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:small-qwen2", help="built-in name, hub id or local folder")
    ap.add_argument("--rollouts", type=int, default=3, help="rollouts per arm (each num_iterations=2 optimizer "
                                                            "steps); the first is a warm-up and dropped")
    ap.add_argument("--cap", type=int, default=512, help="max_completion_length; completions' mean is cap / 4")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=None,
                    help="ours-budget's ppo_max_token_len_per_device (default: use_dynamic_bsz=True, the default "
                         "budget)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16=True (TRL's default: autocast over the float32 weights) instead of float32")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per arm, in alternating order")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every arm (default: all cores)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds an arm may run")
    ap.add_argument("--quick", action="store_true", help="cap 128, 2 rollouts: a check that it runs (about 4 minutes on 2 cores)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--docs", action="store_true", help="copy the plot to docs/img")
    ap.add_argument("--one", nargs=2, metavar=("ARM", "REPEAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.cap, args.rollouts = 128, 2
    if args.rollouts < 2:
        ap.error("--rollouts must be at least 2 (the first is a warm-up and is dropped)")
    if "trl" not in args.arms:
        ap.error("--arms must include trl: every ratio is to TRL's GRPOTrainer in the same run")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL: said once here
    if args.one:
        import json

        from trl_nrollout.builtin import resolve_model

        args.model = resolve_model(args.model)
        print(json.dumps(run_one(args.one[0], args)))
        return 0
    from trl_nrollout.builtin import resolve_model

    load, busy = check_load("the training-side timing")
    args.model = resolve_model(args.model)  # a built-in model is built once, before any child starts
    arms = [a for a in ARMS if a in args.arms]
    start = time.perf_counter()
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for rep in range(args.repeats):  # alternate the order: a slow spell hits every arm alike
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            res = _child(args, arm, rep)
            print(f"{arm} (repeat {rep + 1}): {res['step_ex_gen']:.2f} s per rollout "
                  f"(old {res['old_log_prob']:.2f}, ref {res['ref']:.2f}, update {res['update']:.2f}, "
                  f"rest {res['rest']:.2f})", file=sys.stderr, flush=True)
            runs[arm].append(res)
    rows = [merge(runs[a]) for a in arms]
    prints = {tuple(r["fingerprints"]) for rs in runs.values() for r in rs}
    lengths = rows[0]["lengths"][1:] or rows[0]["lengths"]
    loads = [workload(ls, args.prompt) for ls in lengths]
    result = {"load_at_start": load, "busy_at_start": busy, "load_at_end": os.getloadavg(), "cap": args.cap,
              "prompt": args.prompt, "rollouts": args.rollouts, "repeats": args.repeats,
              "threads": args.threads or os.cpu_count(), "budget": args.budget, "num_iterations": ITERATIONS,
              "beta": BETA, "per_device_train_batch_size": PER_DEVICE, "num_generations": N,
              "gradient_accumulation_steps": ACCUM, "bf16": args.bf16, "same_samples": len(prints) == 1,
              "workload": {k: (round(statistics.mean(w[k] for w in loads), 3) if k != "longest"
                               else max(w[k] for w in loads)) for k in loads[0]},
              "rows": rows, "wall_s": round(time.perf_counter() - start, 1)}
    result["workload"]["samples"] = int(result["workload"]["samples"])
    trl = next(r for r in rows if r["arm"] == "trl")["step_ex_gen"]
    result["ratio_vs_trl"] = {r["arm"]: round(r["step_ex_gen"] / trl, 3) for r in rows}
    result["goal_met"] = min(v for a, v in result["ratio_vs_trl"].items() if a in ("ours", "ours-budget")) <= GOAL
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_outputs(result, args.out))
    if args.docs:
        shutil.copy(args.out / "training_side_vs_trl.png", ROOT / "docs" / "img" / "training_side_vs_trl.png")
    if busy:
        print(f"WARNING: the machine was busy at the start (load {load[0]:.2f}).", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
