"""Section ``sharded_budgets`` of scripts/gpu_check.py: the update's default token budget under DeepSpeed ZeRO-3 and
FSDP2, and its peak memory against the plan (issue 62, items 4-5).

For each of ``zero3`` (``recipes/accelerate/zero3.yaml``: ``zero3_init_flag``, parameters partitioned as they are
built) and ``fsdp2`` (``recipes/accelerate/fsdp.yaml``), ``check_sharded_budgets("cuda")`` runs one process under
``accelerate launch`` (this file's ``--child``): a Qwen2 model of about 0.3 B parameters with random weights (built
and saved here), ``use_dynamic_bsz`` with the default budget, gradient checkpointing, bf16, the HF engine (the budget
then has the whole device), 2 steps of 64 samples of up to 32 + 256 tokens. The child reports

- ``params_counted``: the parameters the budget's trainer state counts (:func:`~trl_nrollout.passes.budget.
  update_state_bytes`, which reads ZeRO-3's ``ds_numel``) against ``params`` (the model's), and ``numel_at_init``
  (what ``p.numel()`` sums after the trainer is built: 0 under ``zero3_init_flag``, the count item 4's budget used);
- ``budget_tokens``: the default budget the trainer took;
- ``peak_gib``: the CUDA allocator's peak over both steps (generation, log-prob passes, update), against
  ``plan_gib``: the plan's bytes for what ran, the trainer state per device plus the largest micro batch's tokens
  (the budget, or a step's samples where they are fewer) times the plan's activation bytes per token
  (:func:`~trl_nrollout.plan.activations.activation_bytes_per_token`).

``status`` ok when every mode counted the whole model, trained both steps, and its peak stays within the plan's
bytes (``peak_over_plan`` <= 1). ``check_sharded_budgets("cpu")`` (the dry run) runs ``zero3`` alone (accelerate
cannot run FSDP on a CPU; ``fsdp2`` is skipped), ``zero3_cpu.yaml``, a tiny model, 1 step, without the CUDA peak. Run
alone: ``python scripts/gpu_sections/sharded_budgets.py [--dry-run]`` prints the JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIZES = {
    "cuda": dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=32768), batch=64, n=8, completion=256, steps=2),
    "cpu": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048), batch=8, n=4, completion=8, steps=1),
}
CONFIGS = {"cuda": {"zero3": "zero3.yaml", "fsdp2": "fsdp.yaml"}, "cpu": {"zero3": "zero3_cpu.yaml"}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save_model(folder: str, size: dict, dtype) -> int:
    """A random Qwen2 model of ``size`` and a tokenizer with its vocabulary saved in ``folder``; its parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_nrollout.builtin import resolve_model

    torch.manual_seed(0)
    tiny = resolve_model("builtin:tiny-qwen2")  # its tokenizer (the digits prompts) with a vocabulary that fits
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = Qwen2Config(max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **{**size["model"], "vocab_size": max(size["model"]["vocab_size"], len(tok))})
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def child(model_dir: str, out: str, kind: str) -> None:
    """Under ``accelerate launch`` (one process): build and train, write ``out/result.json``."""
    import torch

    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward
    from trl_nrollout.passes.budget import update_state_bytes
    from trl_nrollout.plan.activations import activation_bytes_per_token

    cuda, size = kind == "cuda", SIZES[kind]
    args = NRolloutConfig(
        output_dir=out, train_batch_size=size["batch"], rollout_n=size["n"], max_completion_length=size["completion"],
        max_steps=size["steps"], learning_rate=1e-5, rollout_backend="hf", use_dynamic_bsz=True,
        gradient_checkpointing=True, bf16=cuda, use_cpu=False, report_to="none", save_strategy="no", logging_steps=1,
        seed=0, **({} if cuda else {"ddp_backend": "gloo"}))
    trainer = NRolloutGRPOTrainer(model_dir, reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(4 * size["batch"]))
    inner = trainer.accelerator.unwrap_model(trainer.model)
    params = list(inner.parameters())
    counted, state = update_state_bytes(params, trainer.accelerator.num_processes, sharded=True)
    result = {"params_counted": counted, "numel_at_init": sum(p.numel() for p in params),
              "budget_tokens": trainer.update_budget.tokens, "state_bytes": state}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps = [h for h in trainer.state.log_history if "reward" in h]
    result["steps"] = len(steps)
    ran = min(result["budget_tokens"], size["batch"] * (32 + size["completion"]))  # the largest micro batch's tokens
    act = activation_bytes_per_token(inner.config.to_dict(), dtype_bytes=2 if cuda else 4, gradient_checkpointing=True)
    result.update(micro_tokens_bound=ran, activation_bytes_per_token=act, plan_gib=(state + ran * act) / 2**30)
    if cuda:
        torch.cuda.synchronize()
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_over_plan"] = result["peak_gib"] / result["plan_gib"]
    trainer.close()
    Path(out, "result.json").write_text(json.dumps(result))


def _run_mode(mode: str, config: str, model_dir: str, kind: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate" / config), "--num_processes", "1", "--main_process_port",
               str(_free_port()), __file__, "--child", model_dir, out, kind]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            return {"status": "failed", "error": f"the launch exited with {proc.returncode}",
                    "logs": (proc.stdout[-1000:] + proc.stderr[-2500:])}
        return json.loads(Path(out, "result.json").read_text())


def judge(got: dict, params: int, steps: int, cuda: bool) -> dict:
    """``status`` (and ``why``) of one mode's result."""
    why = []
    if got["params_counted"] != params:
        why.append(f"the budget counted {got['params_counted']} parameters of {params}")
    if got["steps"] != steps:
        why.append(f"{got['steps']} steps of {steps}")
    if cuda and not got["peak_over_plan"] <= 1.0:
        why.append(f"peak {got['peak_gib']:.2f} GiB over the plan's {got['plan_gib']:.2f} GiB")
    return {"status": "failed" if why else "ok", **({"why": "; ".join(why)} if why else {})}


def check_sharded_budgets(device: str, timeout: float = 420) -> dict:
    """The checks of the module docstring on ``device``; ``status`` ok when all hold, else failed (with what)."""
    import torch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    out: dict = {"device": device}
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            params = _save_model(model_dir, SIZES[kind], torch.bfloat16 if kind == "cuda" else torch.float32)
            out["params"] = params
            modes = {}
            for mode in ("zero3", "fsdp2"):
                config = CONFIGS[kind].get(mode)
                if config is None:
                    modes[mode] = {"status": "skipped", "why": "accelerate cannot run FSDP on a CPU"}
                    continue
                got = _run_mode(mode, config, model_dir, kind, timeout)
                modes[mode] = got if "status" in got else {**got, **judge(got, params, SIZES[kind]["steps"],
                                                                          kind == "cuda")}
        out["modes"] = modes
        out["status"] = "ok" if all(m["status"] in ("ok", "skipped") for m in modes.values()) else "failed"
    except Exception as err:  # noqa: BLE001 - the section reports, the others go on
        out.update(status="failed", error=f"{type(err).__name__}: {err}"[:600], traceback=traceback.format_exc()[-2000:])
    return out


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        child(*sys.argv[i + 1:i + 4])
        sys.exit(0)
    import torch

    dry = "--dry-run" in sys.argv or not torch.cuda.is_available()
    print(json.dumps(check_sharded_budgets("cpu" if dry else "cuda"), indent=2))
