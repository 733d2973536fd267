#!/usr/bin/env bash
# Sets up (or refreshes) .venv-quant: llm-compressor and the compressed-tensors stack, in which
# `moeprune prune --quantize` runs llm-compressor's oneshot (src/moeprune/quantize/driver.py, a
# script started in this environment's Python) and the quantization tests read its results.
#
# Kept apart from .venv and .venv-vllm: llmcompressor 0.14.0.1 pins transformers to 5.15-5.17
# and compressed-tensors to 0.19, which neither moeprune's newest-transformers .venv nor vLLM's
# environment can share. Order matters:
#   1. torch FIRST, pinned, so pip takes the CPU wheel and never pulls a multi-GB CUDA build (torch
#      stays pinned in every later pip command, so nothing can move it);
#   2. llmcompressor with transformers and compressed-tensors pinned in the same command;
#   3. moeprune editable (no extras), constrained to what is now installed, so that it cannot
#      move any of llm-compressor's pins (the tests load results with moeprune here too).
# A stamp file makes a second run instant; it is redone when this script or pyproject.toml changes
# (or with FORCE=1).
set -euo pipefail

TORCH_VERSION=2.13.0
LLMCOMPRESSOR_VERSION=0.14.0.1
TRANSFORMERS_VERSION=5.17.0
COMPRESSED_TENSORS_VERSION=0.19.0

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv-quant
PY=${PYTHON:-python3}
STAMP=$VENV/.moeprune-quant-installed
# What the stamp certifies: this script, pyproject.toml and the pins above.
WANT=$(cat scripts/setup_quant.sh pyproject.toml | sha256sum | cut -d' ' -f1)

if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

pip_ "torch==$TORCH_VERSION"
pip_ "torch==$TORCH_VERSION" "llmcompressor==$LLMCOMPRESSOR_VERSION" \
  "transformers==$TRANSFORMERS_VERSION" "compressed-tensors==$COMPRESSED_TENSORS_VERSION"

CONSTRAINTS=$VENV/quant-constraints.txt
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^moeprune' > "$CONSTRAINTS"
pip_ -c "$CONSTRAINTS" -e "$ROOT"

# Fail here, not in the tests, if the pins did not hold.
"$VENV/bin/python" - <<PYEOF
import compressed_tensors, llmcompressor, torch, transformers
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert not torch.cuda.is_available() or "+cpu" in torch.__version__, torch.__version__
assert transformers.__version__ == "$TRANSFORMERS_VERSION", transformers.__version__
assert compressed_tensors.__version__.startswith("$COMPRESSED_TENSORS_VERSION"), compressed_tensors.__version__
print(f"llmcompressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}, "
      f"torch {torch.__version__}, transformers {transformers.__version__}: ready")
PYEOF
echo "$WANT" > "$STAMP"
