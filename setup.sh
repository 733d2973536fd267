#!/usr/bin/env bash
# Sets up (or refreshes) .venv with a CPU PyTorch and moeprune in editable mode.
# Torch is installed FIRST and pinned so that installing moeprune never pulls the multi-GB
# CUDA build. On a GPU machine, install the torch you want into .venv before running this,
# or set MOEPRUNE_TORCH (e.g. MOEPRUNE_TORCH="torch==2.13.0" or "skip").
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
TORCH_SPEC=${MOEPRUNE_TORCH:-torch==2.13.0}
if [ "$TORCH_SPEC" != "skip" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
fi
stamp=.venv/.moeprune-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  touch "$stamp"
fi
