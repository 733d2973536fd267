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
from test_serve_check import FAMILY, SMALL_KV_CACHE, VLLM_PYTHON, _check
from test_serve_vllm import _reference

from moeprune.config import DataOptions, PruneConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.evaluate.serve_check import LOGPROB_ATOL
from moeprune.job import PruneRequest, prune_checkpoint

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve_merge")
    tokenizer = byte_tokenizer()
    data = root / "calib.jsonl"
    rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b  # {'xyz' * i}\n"} for i in range(16)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"text": t}) for t in ("The cat", "x = [i * i for i in", "1 + 2 ="))
    )
    base = root / "base"
    _reference(FAMILY, base, len(tokenizer))
    tokenizer.save_pretrained(base)
    out = {"prompts": prompts}
    for allocation in ("uniform", "global"):
        out[allocation] = root / allocation
        config = PruneConfig("reap", 0.25, allocation=allocation, method="merge")
        prune_checkpoint(PruneRequest(base, out[allocation], config,
                         data=DataOptions(sources=[str(data)], samples=16, max_length=64),
                         run=RunOptions(progress=False)))  # fmt: skip
    return out


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_vllm_serves_merge_results_like_moeprune(merged, allocation):
    config = json.loads((merged[allocation] / "config.json").read_text())
    assert ("moeprune" in config) == (allocation == "global")  # stock where a drop is
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run ./scripts/setup_vllm.sh", pytrace=False)
    done = subprocess.run([sys.executable, "-m", "moeprune", "serve-check", str(merged[allocation]),
                           "--vllm-python", str(VLLM_PYTHON), "--vllm-option", SMALL_KV_CACHE,
                           "--prompts", str(merged["prompts"]), "--new-tokens", "12"],
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    check = _check(merged[allocation])
    assert check["verdict"] == "match" and check["max_logprob_difference"] <= LOGPROB_ATOL
