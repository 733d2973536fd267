#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (on a lent GPU machine; see CONTRIBUTING.md).
# Installs moeprune into the machine's own Python (its torch build stays), then runs the CUDA
# tests, the NCCL rank check and the benchmarks on the GPU. Logs go to $OUT (or ./gpu-check).
set -uo pipefail
out=${OUT:-gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 MOEPRUNE_CACHE=/tmp/moeprune-cache
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 || { tail "$out/install.txt"; exit 1; }
step() { local t=$SECONDS; echo "== $1"; shift; "$@"; echo "   ($((SECONDS - t)) s)"; }
step "pytest -m cuda" $py -m pytest -m cuda -p no:cacheprovider -q -rs tests/runtime/test_cuda.py 2>&1 | tee "$out/pytest_cuda.txt" | tail -15
work=$(mktemp -d)
$py - "$work" <<'PY'
import json, sys
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
tok = byte_tokenizer(); tiny_model("qwen3_moe", vocab_size=len(tok)).save_pretrained(f"{sys.argv[1]}/tiny"); tok.save_pretrained(f"{sys.argv[1]}/tiny")
open(f"{sys.argv[1]}/data.jsonl", "w").write("".join(json.dumps({"text": f"sample {i} " * 8}) + "\n" for i in range(16)))
PY
step "torchrun: 2 ranks on 1 GPU (expect one clear line, exit 2)" bash -c \
  "torchrun --nproc_per_node 2 --no-python moeprune score $work/tiny --criterion frequency --data $work/data.jsonl --output $work/s 2>&1 | grep -i 'error\|gpu' | head -3; echo exit \${PIPESTATUS[0]}"
step "torchrun: 1 rank on the GPU" bash -c \
  "torchrun --nproc_per_node 1 --no-python moeprune score $work/tiny --criterion frequency --data $work/data.jsonl --output $work/s1 --quiet 2>&1 | tail -2; echo exit \${PIPESTATUS[0]}"
step "observe overhead, cuda bf16" $py benchmarks/observe_overhead.py --device cuda --dtype bf16 2>&1 | tee "$out/observe_cuda.txt" | tail -4
step "observe overhead, cuda fp32" $py benchmarks/observe_overhead.py --device cuda --dtype fp32 2>&1 | tee -a "$out/observe_cuda.txt" | tail -2
step "search speed, cuda fp32" $py benchmarks/search_speed.py --device cuda --dtype fp32 2>&1 | tee "$out/search_cuda.txt" | tail -8
step "search speed, cuda bf16" $py benchmarks/search_speed.py --device cuda --dtype bf16 2>&1 | tee -a "$out/search_cuda.txt" | tail -5
