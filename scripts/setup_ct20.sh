#!/usr/bin/env bash
# Sets up .venv-ct20: compressed-tensors 0.20.0 in an environment of its own, where the tests
# validate the `moe_sparsity_config` moeprune writes with compressed-tensors' own classes
# (ExpertSparsityConfig, and QuantizationConfig for quantized results; tests/checkpoint/
# test_sparsity_metadata.py). 0.20.0 is the release whose schema moeprune's writer follows; it is
# never installed into .venv-vllm (vLLM pins 0.17) nor .venv-quant (llm-compressor pins 0.19), nor .venv.
#
# Only compressed-tensors itself is installed (--no-deps): its imports (torch, transformers,
# pydantic, loguru, psutil) are read from .venv's site-packages through a .pth file, which Python
# puts after this environment's own, so this 0.20.0 is the compressed-tensors imported here.
# A second run is instant (a stamp); FORCE=1 redoes it.
set -euo pipefail
CT_VERSION=0.20.0
cd "$(dirname "$0")/.."
VENV=.venv-ct20
STAMP=$VENV/.moeprune-ct20
MAIN_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MAIN_SITE=$(realpath "$MAIN_SITE")
WANT=$( (cat scripts/setup_ct20.sh; echo "$MAIN_SITE") | sha256sum | cut -d' ' -f1)
if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
rm -rf "$VENV"
"$(realpath .venv/bin/python)" -m venv "$VENV"
source scripts/install.sh
install_into "$VENV" --no-deps "compressed-tensors==$CT_VERSION"
OWN_SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$MAIN_SITE" > "$OWN_SITE/moeprune-main-venv.pth"
"$VENV/bin/python" -c "
import compressed_tensors, importlib.metadata as m
from compressed_tensors.config import ExpertSparsityConfig
assert m.version('compressed-tensors') == '$CT_VERSION', m.version('compressed-tensors')
print('.venv-ct20: compressed-tensors', m.version('compressed-tensors'), 'from', compressed_tensors.__file__)
"
echo "$WANT" > "$STAMP"
