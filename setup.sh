#!/usr/bin/env bash
# Sets up (or refreshes) .venv with a CPU PyTorch and moeprune in editable mode.
# Torch is installed FIRST and pinned so that installing moeprune never pulls the multi-GB
# CUDA build. On a GPU machine, install the torch you want into .venv before running this,
# or set MOEPRUNE_TORCH (e.g. MOEPRUNE_TORCH="torch==2.13.0" or "skip").
set -euo pipefail
cd "$(dirname "$0")"
source scripts/install.sh  # install_into: uv's pip where uv is at hand, else pip
ensure_uv                  # .venv, with uv in it
TORCH_SPEC=${MOEPRUNE_TORCH:-torch==2.13.0}
if [ "$TORCH_SPEC" != "skip" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  install_into .venv "$TORCH_SPEC"
fi
stamp=.venv/.moeprune-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  install_into .venv -e ".[dev]"
  touch "$stamp"
fi
