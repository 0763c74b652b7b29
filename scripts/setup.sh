#!/usr/bin/env bash
# Installs fastft (editable) with its test extras. Keeps an installed torch; on a machine without one
# and without an NVIDIA driver it asks for the CPU build pinned below, never the multi-GB CUDA build.
set -euo pipefail
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e ".[test]"
