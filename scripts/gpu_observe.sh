#!/usr/bin/env bash
# The observation pass on a GPU, quickly (about a minute): its overhead over a plain forward in bf16
# at the default size and at a realistic layer size, then the CUDA tests. Nothing is installed:
# moeprune runs from src/ (PYTHONPATH), with the machine's own torch and transformers.
#   bash scripts/gpu_observe.sh            # logs also go to $OUT (or ./gpu-observe)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-observe}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 MOEPRUNE_CACHE=/tmp/moeprune-cache
py=${PYTHON:-python3}
status=0
step() { local t=$SECONDS; echo "== $1"; shift; "$@" || status=1; echo "   ($((SECONDS - t)) s)"; }
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$out/versions.txt"
step "observe overhead, cuda bf16, default size" bash -o pipefail -c \
  "$py benchmarks/observe_overhead.py --device cuda --dtype bf16 2>&1 | tee '$out/observe_default.txt' | tail -4"
step "observe overhead, cuda bf16, 2048 x 128 experts" bash -o pipefail -c \
  "$py benchmarks/observe_overhead.py --device cuda --dtype bf16 --hidden 2048 --intermediate 768 --experts 128 \
   --top-k 8 --layers 4 --vocab 32000 --samples 16 --batch-size 4 --seq-len 512 2>&1 | tee '$out/observe_large.txt' | tail -4"
step "pytest tests/runtime/test_cuda.py" bash -o pipefail -c \
  "$py -m pytest -p no:cacheprovider -q tests/runtime/test_cuda.py 2>&1 | tee '$out/pytest_cuda.txt' | tail -6"
exit $status
