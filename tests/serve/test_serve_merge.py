"""Merge results served by vLLM's CPU build give moeprune's loader's greedy tokens: the stock
result (uniform: a stock checkpoint with changed weights) and per-layer counts (global, moeprune's
format through the plugin), checked by `moeprune serve-check` as tests/serve/test_serve_check.py
does for the other output kinds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_serve_check import SMALL_KV_CACHE, _check, base_model, prune_with

from moeprune.config import PruneConfig
from moeprune.evaluate.serve_check import LOGPROB_ATOL

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve_merge")
    out = base_model(root)
    for allocation in ("uniform", "global"):
        out[allocation] = root / allocation
        prune_with(out, out[allocation], PruneConfig("reap", 0.25, allocation=allocation, method="merge"))
    return out


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_vllm_serves_merge_results_like_moeprune(merged, allocation, shared_vllm_python):
    config = json.loads((merged[allocation] / "config.json").read_text())
    assert ("moeprune" in config) == (allocation == "global")  # stock where a drop is
    done = subprocess.run([sys.executable, "-m", "moeprune", "serve-check", str(merged[allocation]),
                           "--vllm-python", str(shared_vllm_python), "--vllm-option", SMALL_KV_CACHE,
                           "--prompts", str(merged["prompts"]), "--new-tokens", "12"],
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    check = _check(merged[allocation])
    assert check["verdict"] == "match" and check["max_logprob_difference"] <= LOGPROB_ATOL
