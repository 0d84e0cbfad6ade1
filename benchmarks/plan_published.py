"""``trl-nrollout plan --predict`` against published GPU runs whose workloads are stated.

NeMo-RL's GRPO performance summary (NVIDIA-NeMo/RL ``docs/about/performance-summary.md``, v0.5.0; DGX-H100, BF16,
Megatron training, colocated vLLM, on-policy, OpenMathInstruct-2): 64 prompts x 32 samples = 2,048 per step,
sequences up to 4,096 tokens, a global batch of 512 (4 optimizer steps per rollout), a KL penalty of 0.01 (NeMo-RL
computes the policy's and the reference's log-probs every step), and the mean generated length per run ("G-Average
Seq len"; the page does not define it: we read it as the generated tokens, as its tokens/s/GPU figures imply). Not
stated: the prompt lengths (we try 150 and 300 tokens; OpenMathInstruct-2's problems are short) and the engine's
``max_num_seqs`` (vLLM's default, 1,024). The training runs are Megatron with a distributed optimizer (``sharded``
here) and NeMo-RL's sequence packing (its GRPO configs enable it: ``policy.sequence_packing``; sequences concatenated
without padding, ``padding_free`` here); Megatron shards by tensor and pipeline parallelism and does not gather
parameters for each forward as ZeRO-3 does. Two trainers are priced: the runs' own (Megatron-like: no per-forward
gathers, no padding: the prediction of the published step) and ours on the same workload (ZeRO-3: gathers per
forward, each micro batch padded to its longest completion as TRL's: what our trainer would take, not the
published run). Model dimensions from each model's config.json. The trainers span the runs' nodes (8 GPUs each), so their
gradient reduce and gathers run at the DGX H100's InfiniBand speed (one 400 Gb/s port per GPU), not NVLink's.

Prints and writes ``plan_published.json`` / ``.md`` under ``--out``. Goal (issue 33): within a factor of 1.5.

    python benchmarks/plan_published.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SOURCE = "NVIDIA-NeMo/RL docs/about/performance-summary.md (v0.5.0), DGX-H100, BF16"
#: (label, model, GPUs, rollout TP, mean generated tokens, measured step seconds)
RUNS = [
    ("Llama-3.1-8B-Instruct, 16 x H100 (2 nodes), vLLM TP 1, Megatron PP 2", "meta-llama/Llama-3.1-8B-Instruct", 16,
     1, 1019, 92.8),
    ("Qwen3-32B, 32 x H100 (4 nodes), vLLM TP 4, Megatron TP 4 PP 4", "Qwen/Qwen3-32B", 32, 4, 3251, 376.0),
]
PROMPT_LENGTHS = (150, 300)
TRAINERS = {False: "the run's: Megatron-like (no per-forward gathers, sequences packed)",
            True: "ours: ZeRO-3 (gathers per forward, rows padded; not the run)"}
GOAL = 1.5


def compute_rows() -> list[dict]:
    """Each published run predicted at each assumed prompt length, with its own trainer and with ours (pure
    arithmetic: the planner's cost model on the ``h100`` profile)."""
    from trl_nrollout.plan.cost import predict_step
    from trl_nrollout.plan.devices import PROFILES
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.plan.models import model_dims
    from trl_nrollout.plan.workload import Workload

    rows = []
    for label, model, gpus, tp, mean, measured in RUNS:
        dims = model_dims(model)
        layout = RolloutLayout.build(num_processes=gpus, rollout_tp_size=tp, train_batch_size=64, rollout_n=32,
                                     ppo_mini_batch_size=16)
        for prompt, ours in [(p, s) for s in (False, True) for p in PROMPT_LENGTHS]:
            work = Workload(prompt_len=prompt, completion_mean=mean, completion_max=4096 - prompt, kl=True,
                            sharded=ours, skip_old_on_policy=False, nodes=gpus // 8, padding_free=not ours)
            pred = predict_step(dims, layout, work, PROFILES["h100"])
            rows.append({"run": label, "model": model, "gpus": gpus, "rollout_tp": tp, "prompt_tokens": prompt,
                         "trainer": TRAINERS[ours], "predicts_the_run": not ours,
                         "mean_generated": mean, "measured_s": measured, "predicted_s": pred.total_s,
                         "ratio": pred.total_s / measured, "phases": pred.phases,
                         "decode_bound": pred.details["decode_bound"]})
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    """The Markdown table of :func:`compute_rows` (docs/benchmarks.md quotes it; tests/test_benchmark_figures.py
    regenerates it to check the quote)."""
    lines = [f"Source: {SOURCE}", "", "| run | prompt tokens (assumed) | trainer modelled | measured step (s) | "
             "predicted (s) | predicted / measured | generation / old+ref / update (s), predicted |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["phases"]
        lines.append(f"| {r['run']} | {r['prompt_tokens']} | {r['trainer']} | {r['measured_s']:.1f} | "
                     f"{r['predicted_s']:.1f} | "
                     f"**{r['ratio']:.2f}** | {p['generation']:.1f} / {p['old_log_prob'] + p['ref_log_prob']:.1f} / "
                     f"{p['update']:.1f} |")
    runs = [r for r in rows if r["predicts_the_run"]]
    ok = sum(1 / GOAL <= r["ratio"] <= GOAL for r in runs)
    return lines + ["", f"the runs' own trainer within a factor of {GOAL}: {ok}/{len(runs)}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="the same (it takes well under a second)")
    args = ap.parse_args()
    rows = compute_rows()
    table = "\n".join(table_lines(rows))
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_published.md").write_text(table + "\n")
    (args.out / "plan_published.json").write_text(json.dumps({"source": SOURCE, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
