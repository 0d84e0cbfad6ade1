"""The GPU example of a user's own TRL script (docs/gpu.md, examples/grpo_lora.py) runs on a CPU with only what a CPU
needs swapped (``--cpu-smoke``): the built-in tiny model for Qwen2.5-1.5B, ``use_cpu=True``, two short steps. Every
other line is the GPU's: LoRA through ``peft_config``, ``use_vllm=True`` colocated, bf16 (CPU autocast)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import grpo_lora

trainer = grpo_lora.main(cpu_smoke=True)
model = trainer.accelerator.unwrap_model(trainer.model)
lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
logs = [h for h in trainer.state.log_history if "rollout_corr/logprob_abs_diff_max" in h]
print("RESULT " + json.dumps({
    "steps": trainer.state.global_step,
    "backend": trainer.args.rollout_backend,
    "bf16": trainer.args.bf16,
    "lora_b_moved": any(float(p.abs().max()) > 0 for p in lora_b),
    "lora_b_count": len(lora_b),
    "only_lora_trains": all("lora_" in n for n in trainable),
    "diff_max": [h["rollout_corr/logprob_abs_diff_max"] for h in logs],
}))
trainer.close()
"""


def test_the_gpu_lora_example_trains_its_adapter_on_a_cpu(tmp_path):
    """The example trains the LoRA adapter only (its B matrices start at zero and move), on the vLLM engine, under
    bf16, for the two steps asked, and the engine's and the trainer's log-probs of the sampled tokens agree.
    Fails when the example's ``peft_config`` is dropped (every parameter trains, no lora_B) or its backend swapped."""
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "examples")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["steps"] == 2
    assert result["backend"] == "vllm" and result["bf16"] is True
    assert result["lora_b_count"] > 0 and result["lora_b_moved"], result
    assert result["only_lora_trains"], result
    assert result["diff_max"] and max(result["diff_max"]) < 0.05, result
