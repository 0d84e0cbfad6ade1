"""Section ``rollout_rank`` of scripts/gpu_check.py: a one-step-off run with a rollout rank (``rollout_ranks=1``,
``rollout_lookahead=1``, the default): one trainer process and one rollout-rank process (a vLLM engine of its own)
on the same device, the recipe ``recipes/grpo.py`` as users run it.

``check_rollout_rank("cuda")`` starts the two processes itself (``RANK`` 0 and 1 of one world; ``LOCAL_RANK`` 0 for
both, so that both use the one GPU: an ``accelerate launch`` would put the rollout rank on ``cuda:1``), the engine
at a third of the device (``vllm_gpu_memory_utilization=0.3``), bf16, ``builtin:tiny-qwen2``, 4 steps. It reports
per step the lag (``rollout/staleness``: 0 at the first step, whose job nothing was written ahead of, then 1), the
trainer's wait for the samples, the loss, and the engine's log-probs against the trainer's
(``rollout_corr/logprob_abs_diff_mean``: bf16 rounding at the synchronous first step; the policy one update older
after). ``status`` ok when the lags are ``[0, 1, 1, 1]``, the losses and rewards are finite, the first step's
difference is under bf16 rounding (0.05; float32 on the CPU: 1e-3), and each update's version travelled.

``check_rollout_rank("cpu")`` (the dry run) does the same with ``--use_cpu true``, float32, 3 steps. Run alone:
``python scripts/gpu_sections/rollout_rank.py [--dry-run]`` prints the JSON.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the first (synchronous) step's mean engine-vs-trainer log-prob difference allowed: bf16 (CUDA), float32 (CPU)
TOLERANCE = {"cuda": 0.05, "cpu": 1e-3}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(out: str, cuda: bool, steps: int) -> list[str]:
    """The recipe's command line of the run (each of the two processes runs it)."""
    device = ["--bf16", "true", "--vllm_gpu_memory_utilization", "0.3"] if cuda else ["--use_cpu", "true",
                                                                                       "--bf16", "false"]
    return [sys.executable, str(ROOT / "recipes/grpo.py"), "--output_dir", out, "--rollout_ranks", "1",
            "--max_steps", str(steps), "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1",
            "--learning_rate", "5e-3", *device]


def launch(out: str, cuda: bool, steps: int, timeout: float) -> tuple[int, str]:
    """Run the two processes (trainer rank 0, the rollout rank); the worst exit status and both logs' tails."""
    port, procs, logs = _free_port(), [], []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for rank in range(2):
        log = open(os.path.join(out, f"rank{rank}.log"), "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(command(out, cuda, steps), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": "0" if cuda else str(rank)},
                                      start_new_session=True))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        codes.append(124)
    finally:
        for p in procs:  # our own children only, by their id
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for log in logs:
            log.close()
    tails = "\n".join(f"--- rank {r}\n" + Path(out, f"rank{r}.log").read_text()[-1500:] for r in range(2))
    return max(codes), tails


def judge(history: list[dict], kind: str, steps: int) -> dict:
    """``status`` (and ``why``) of the run's logged steps (``history``: the trainer's entries with a reward)."""
    why = []
    lags = [h.get("rollout/staleness") for h in history]
    if lags != [0] + [1] * (steps - 1):
        why.append(f"lags {lags}, not one step off")
    if not all(math.isfinite(h["loss"]) and math.isfinite(h["reward"]) for h in history):
        why.append("a loss or reward is not finite")
    first = history[0].get("rollout_corr/logprob_abs_diff_mean") if history else None
    if first is None or not first < TOLERANCE[kind]:
        why.append(f"the synchronous first step's engine vs trainer difference {first} (limit {TOLERANCE[kind]})")
    sent = [h.get("weight_sync/transfer_mb") for h in history]
    if sum(mb is not None and mb > 0 for mb in sent) < steps - 1:  # each update's version (the last may not go)
        why.append(f"transfers to the rollout rank {sent}: a version did not travel")
    return {"status": "failed" if why else "ok", **({"why": "; ".join(why)} if why else {})}


def check_rollout_rank(device: str, steps: int | None = None, timeout: float = 420) -> dict:
    """The checks of the module docstring on ``device``; ``status`` ok when all hold, else failed (with what)."""
    cuda = device.startswith("cuda")
    steps = steps or (4 if cuda else 3)
    out: dict = {"device": device, "steps": steps}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            code, tails = launch(tmp, cuda, steps, timeout)
            if code != 0:
                return {**out, "status": "failed", "error": f"the launch exited with {code}", "logs": tails}
            history = [h for h in json.loads(Path(tmp, "log_history.json").read_text()) if "reward" in h]
        keys = ("rollout/staleness", "rollout/wait_s", "loss", "reward", "rollout_corr/logprob_abs_diff_mean",
                "weight_sync/transfer_mb")
        out["per_step"] = [{k: h.get(k) for k in keys} for h in history]
        out.update(judge(history, "cuda" if cuda else "cpu", steps))
    except Exception as err:  # noqa: BLE001 - the section reports, the others go on
        out.update(status="failed", error=f"{type(err).__name__}: {err}"[:600], traceback=traceback.format_exc()[-2000:])
    return out


if __name__ == "__main__":
    import torch

    dry = "--dry-run" in sys.argv or not torch.cuda.is_available()
    print(json.dumps(check_rollout_rank("cpu" if dry else "cuda"), indent=2))
