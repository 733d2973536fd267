"""A mixed result (whole, narrowed, novice and dropped experts in one layer) served by vLLM's CPU
build through the plugin gives moeprune's loader's greedy tokens, checked by `moeprune serve-check`
as tests/serve/test_serve_merge.py does for merges."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_serve_check import SMALL_KV_CACHE, VLLM_PYTHON, _check, base_model, prune_with

from moeprune.config import PruneConfig
from moeprune.evaluate.serve_check import LOGPROB_ATOL

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)


def test_vllm_serves_a_mixed_result_like_moeprune(tmp_path):
    made = base_model(tmp_path)
    out = tmp_path / "mixed"
    options = {"mixed_whole": 0.25, "mixed_novice": 0.125, "mixed_width": 0.25}
    prune_with(made, out, PruneConfig("reap", 0.7, method="mixed", options=options))
    section = json.loads((out / "config.json").read_text())["moeprune"]
    for entry in section["layers"]:  # every layer: fewer router rows, several widths, novices
        widths = entry["widths"]
        assert entry["novice"] and None in widths and len({w for w in widths if w is not None}) > 1, entry
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run ./scripts/setup_vllm.sh", pytrace=False)
    done = subprocess.run([sys.executable, "-m", "moeprune", "serve-check", str(out),
                           "--vllm-python", str(VLLM_PYTHON), "--vllm-option", SMALL_KV_CACHE,
                           "--prompts", str(made["prompts"]), "--new-tokens", "12"],
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    check = _check(out)
    assert check["verdict"] == "match" and check["max_logprob_difference"] <= LOGPROB_ATOL
