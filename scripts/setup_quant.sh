#!/usr/bin/env bash
# Sets up (or refreshes) the quantization environment .venv-quant the way a pip user gets it, and
# the environment that proves that way works:
#   1. .venv-pip: a fresh virtual environment with moeprune pip-installed from this folder, not
#      editable and without extras, as a user installs it (torch pinned first, so pip takes the CPU
#      wheel and never pulls a multi-GB CUDA build);
#   2. .venv-quant made by that install's own `moeprune setup quantize --path .venv-quant`: the
#      command a pip user runs, whose installs and pins live in src/moeprune/quantize/environment.py
#      (llm-compressor with transformers and compressed-tensors pinned; kept apart from .venv and
#      .venv-vllm because llmcompressor pins transformers 5.15-5.17 and compressed-tensors 0.19);
#   3. moeprune editable (no extras) into .venv-quant, constrained to what is now installed, so it
#      cannot move llm-compressor's pins: the tests load results with moeprune there too.
# tests/quantize/test_setup_quantize.py runs .venv-pip's `moeprune setup quantize` and `prune
# --quantize` from a folder of its own. Stamps make a second run instant; .venv-pip's moeprune is
# reinstalled when a source file changes, .venv-quant redone when this script, pyproject.toml or
# the pins change (or with FORCE=1).
set -euo pipefail

TORCH_VERSION=2.13.0

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
source scripts/install.sh
ensure_uv

# 1. .venv-pip
PIP_VENV=.venv-pip
PIP_STAMP=$PIP_VENV/.moeprune-pip-installed
PIP_WANT=$( (cat pyproject.toml; find src -type f \( -name '*.py' -o -name '*.json' -o -name 'py.typed' \) | sort | xargs cat) | sha256sum | cut -d' ' -f1)
if [ "${FORCE:-0}" = 1 ] || [ ! -f "$PIP_STAMP" ] || [ "$(cat "$PIP_STAMP")" != "$PIP_WANT" ]; then
  [ -x "$PIP_VENV/bin/python" ] || "$PY" -m venv "$PIP_VENV"
  pipu() { install_into "$PIP_VENV" "$@"; }
  "$PIP_VENV/bin/python" -c "import torch" 2>/dev/null || pipu "torch==$TORCH_VERSION"
  pipu "torch==$TORCH_VERSION" "$ROOT"          # moeprune's dependencies (and a first moeprune)
  pipu --no-deps --force-reinstall "$ROOT"       # this source's moeprune (same version number: forced)
  echo "$PIP_WANT" > "$PIP_STAMP"
fi

# 2. and 3. .venv-quant
VENV=.venv-quant
STAMP=$VENV/.moeprune-quant-editable
WANT=$(cat scripts/setup_quant.sh pyproject.toml src/moeprune/quantize/environment.py | sha256sum | cut -d' ' -f1)
if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
# The pinned stack first, with install_into (uv where at hand: minutes sooner on CI's two cores);
# the command below then runs its own installs, check and stamp as for any pip user: every pin
# already satisfied, pip installs nothing, and its check proves the environment holds its pins.
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
read -r -a pins < <("$PY" -c "import runpy; pins = runpy.run_path('src/moeprune/quantize/environment.py')['PINS']
print(' '.join(f'{name}=={version}' for name, version in pins.items()))")
install_into "$VENV" "${pins[@]}"
# MOEPRUNE_CACHE: the command records the environment it made; keep that record out of the user's cache
force=(); [ "${FORCE:-0}" = 1 ] && force=(--force)
MOEPRUNE_CACHE=$(mktemp -d) "$PIP_VENV/bin/moeprune" setup quantize --path "$VENV" "${force[@]}"
CONSTRAINTS=$VENV/quant-constraints.txt
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^moeprune' > "$CONSTRAINTS"
install_into "$VENV" -c "$CONSTRAINTS" -e "$ROOT"
echo "$WANT" > "$STAMP"
