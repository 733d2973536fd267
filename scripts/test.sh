#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
#
# Sets up .venv (the newest transformers), .venv-vllm (vLLM's CPU build, with transformers at
# the lowest version moeprune supports), .venv-quant (llm-compressor, for --quantize) and
# .venv-vllm33 (vLLM 0.33's wheel without dependencies: its sources, read by the tests), then runs
# the suite in the first two: the serving and quantizing tests drive .venv-vllm and .venv-quant
# from the first run, so the second run leaves them out. Extra arguments go to both pytest runs
# (e.g. -x, -k).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python keeps the bytecode it compiles (into the environments and __pycache__, all ignored by git).
# This machine sets PYTHONDONTWRITEBYTECODE=1, and uv installs without compiling (pip compiles at
# install): every process of the suite (two workers a pass, vLLM engines, llm-compressor drivers,
# CLI runs, torchrun ranks) compiled torch's, transformers' and vLLM's modules from source again:
# `import vllm` 43 s against 19 s, `import transformers, moeprune.cli.main` 22 s against 10 s.
unset PYTHONDONTWRITEBYTECODE
# uv first (seconds): every set-up script below installs with it (scripts/install.sh).
source scripts/install.sh
ensure_uv
# The environments install side by side (mostly waiting on downloads and unpacking), and lint
# and types run while .venv-vllm and .venv-quant are still installing: on 2 cores that saves minutes of CI.
setup_log=$(mktemp "${TMPDIR:-/tmp}/moeprune-setup-vllm.XXXXXX")
./scripts/setup_vllm.sh > "$setup_log" 2>&1 &
setup_vllm=$!
quant_log=$(mktemp "${TMPDIR:-/tmp}/moeprune-setup-quant.XXXXXX")  # .venv-quant (llm-compressor), beside it
./scripts/setup_quant.sh > "$quant_log" 2>&1 &
setup_quant=$!
vllm33_log=$(mktemp "${TMPDIR:-/tmp}/moeprune-setup-vllm33.XXXXXX")  # .venv-vllm33 (0.33's sources, no deps)
./scripts/setup_vllm33.sh > "$vllm33_log" 2>&1 &
setup_vllm33=$!
./setup.sh
ct20_log=$(mktemp "${TMPDIR:-/tmp}/moeprune-setup-ct20.XXXXXX")  # .venv-ct20: compressed-tensors 0.20 alone
./scripts/setup_ct20.sh > "$ct20_log" 2>&1 &   # (it reads torch from .venv, so after it), beside lint and types
setup_ct20=$!
.venv/bin/ruff check src tests benchmarks scripts   # lint, then the formatter (src is formatted as ruff formats it)
.venv/bin/ruff format --check src
.venv/bin/mypy   # types of src/moeprune, as pyproject's [tool.mypy] says (modules not yet typed are listed there)
status=0
wait "$setup_vllm" || status=$?
cat "$setup_log" && rm -f "$setup_log"
[ "$status" = 0 ] || { echo "scripts/setup_vllm.sh failed (exit $status)" >&2; exit "$status"; }
wait "$setup_quant" || status=$?
cat "$quant_log" && rm -f "$quant_log"
[ "$status" = 0 ] || { echo "scripts/setup_quant.sh failed (exit $status)" >&2; exit "$status"; }
wait "$setup_vllm33" || status=$?
cat "$vllm33_log" && rm -f "$vllm33_log"
[ "$status" = 0 ] || { echo "scripts/setup_vllm33.sh failed (exit $status)" >&2; exit "$status"; }
wait "$setup_ct20" || status=$?
cat "$ct20_log" && rm -f "$ct20_log"
[ "$status" = 0 ] || { echo "scripts/setup_ct20.sh failed (exit $status)" >&2; exit "$status"; }
# Every core runs tests (pytest-xdist), a test module on one worker so that its module-scoped
# fixtures (a trained, pruned or served set of models) are built once: about half the suite's time
# on CI's two cores. Modules start in xdist's order (most tests first). Starting the serving,
# quantizing and torchrun modules first was tried once (first pass 1,919 s against 1,679 s, in a run
# that also lacked bytecode and had vLLM's engines on one core). A per-module timeline of both
# passes at e1e6be2 showed no tail left to shorten: the two workers ended 46 s and 3 s apart, with
# 1-2 % of the CPU idle, so only less work makes CI faster. Not --dist loadgroup:
# pytest-xdist 3.8 cannot regroup under pytest 9.2, whose node ids it no longer rewrites.
# MOEPRUNE_TEST_WORKERS=0 runs in this process, as plain pytest does. Each pass ends with its 25
# slowest tests (setup, call or teardown), for whoever keeps CI's time.
workers=(-n "${MOEPRUNE_TEST_WORKERS:-auto}" --dist loadfile --durations=25)
record=$(mktemp -d "${TMPDIR:-/tmp}/moeprune-transformers.XXXXXX")
trap 'rm -rf "$record"' EXIT
MOEPRUNE_TRANSFORMERS_RECORD="$record" .venv/bin/python -m pytest "${workers[@]}" "$@"
# The second pass, on the lowest supported transformers, runs again the tests whose behaviour
# depends on the transformers version. Two filters, both needed:
#  - the stages whose code reads transformers' model classes: families and their discovery, loading
#    and saving, shards, quantized formats, surgery, observation, repair, serving without vLLM, the
#    speculative-decoding caches, the end-to-end commands. Formulas, allocations, searches, reports
#    and the demo read no model class: a second run of them tests nothing new (it cost CI 8 minutes);
#  - within them, the tests that ran transformers' model code, as the first pass recorded them
#    (tests/transformers_use.py): a test during which (or during whose fixtures, or whose module's
#    import) a transformers model or config is built, moeprune's family code answers from caches
#    computed from them, or this Python starts another of itself. Codecs on plain tensors, plans
#    and refusals before loading compute the same on any transformers and run once.
# The vllm and quant_env tiers run once: their engines already run in .venv-vllm and .venv-quant,
# at those environments' own transformers.
stages="tests/models/ tests/checkpoint/ tests/shards/ tests/quant/ tests/surgery/ tests/observe/ tests/repair/
  tests/serve/ tests/e2e/ tests/evaluate/test_speculative.py tests/test_pipelines.py"
# Within those stages, a module whose assertions read no model class even though its runs load one:
# kill -9 during saves and searches (atomic replacement, a resumed search's state files).
neutral="tests/e2e/test_interrupted.py"
mapfile -t modules < <(cat "$record"/*.txt | cut -d: -f1 | sort -u | grep -F "$(printf '%s\n' $stages)" \
  | grep -v -x -F "$(printf '%s\n' $neutral)")
echo "== again on the lowest supported transformers ($(.venv-vllm/bin/python -c 'import transformers; print(transformers.__version__)')):" \
  "the tests of ${#modules[@]} modules that ran its model code"
if [ "${#modules[@]}" -gt 0 ]; then
  MOEPRUNE_TRANSFORMERS_SELECT="$record" .venv-vllm/bin/python -m pytest "${workers[@]}" "${modules[@]}" "$@"
fi
