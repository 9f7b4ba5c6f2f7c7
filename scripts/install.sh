#!/usr/bin/env bash
# Install colossal_lite (editable) with the given extras, e.g. `scripts/install.sh test`.
#
# torch: an existing torch (CUDA or CPU build) is kept. Without one:
#   - with a working NVIDIA GPU (`nvidia-smi -L` succeeds): the default index's torch;
#   - without: the CPU wheel from PyTorch's CPU index first (a standard default index would
#     pull the CUDA build and its ~3 GB of libraries), then, where only the default index
#     (or a local mirror) is reachable, torch==2.13.0 from there, then any torch>=2.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
pip_install() { "$PY" -m pip install -q "$@"; }
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install 'torch>=2.1'
  else
    echo "install.sh: no NVIDIA GPU found: installing the CPU build of torch" >&2
    pip_install --retries 1 --timeout 20 --index-url "$CPU_INDEX" 'torch==2.13.0' || \
      pip_install 'torch==2.13.0' || \
      pip_install 'torch>=2.1'
  fi
fi
if [ -n "$extras" ]; then target=".[$extras]"; else target="."; fi
pip_install -e "$target"
