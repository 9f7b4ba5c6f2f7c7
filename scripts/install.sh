#!/usr/bin/env bash
# Install colossal_lite (editable) with the given extras, e.g. `scripts/install.sh test`.
# An existing torch is kept. Without one, the CPU build is taken when no CUDA GPU is
# present, so a CPU-only machine never downloads the CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q 'torch>=2.1'
  else
    "$PY" -m pip install -q 'torch==2.13.0' || \
      "$PY" -m pip install -q 'torch>=2.1' --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if [ -n "$extras" ]; then target=".[$extras]"; else target="."; fi
"$PY" -m pip install -q -e "$target"
