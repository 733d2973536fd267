#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
#
# Sets up .venv (the newest transformers) and .venv-vllm (vLLM's CPU build, with transformers at
# the lowest version moeprune supports), then runs the suite in both: the serving tests drive
# vLLM through .venv-vllm from the first run, so the second run leaves them out. Extra arguments
# go to both pytest runs (e.g. -x, -k).
set -euo pipefail
cd "$(dirname "$0")/.."
./setup.sh
./scripts/setup_vllm.sh
.venv/bin/ruff check src tests benchmarks scripts   # lint, then the formatter (src is formatted as ruff formats it)
.venv/bin/ruff format --check src
.venv/bin/mypy   # types of src/moeprune, as pyproject's [tool.mypy] says (modules not yet typed are listed there)
.venv/bin/python -m pytest "$@"
echo "== again on the lowest supported transformers ($(.venv-vllm/bin/python -c 'import transformers; print(transformers.__version__)'))"
# (the modules that drive .venv-vllm's vLLM in a subprocess ran in the first pass already)
.venv-vllm/bin/python -m pytest --ignore=tests/serve/test_serve_vllm.py --ignore=tests/serve/test_serve_check.py \
  --ignore=tests/serve/test_serve_speed_benchmark.py --ignore=tests/evaluate/test_lm_eval_vllm.py \
  --ignore=tests/serve/test_serve_mtp.py "$@"
