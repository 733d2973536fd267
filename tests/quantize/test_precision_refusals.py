"""`prune --quantize auto:...` refused in one line, exit 2, before the weights are loaded: an
unknown or unmodelled scheme in the list, a single scheme after `auto:`, no calibration data, and
(until prune runs the per-layer search) a valid list, which names the library that chooses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run_cli
from moeprune.job import run as run_module
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.integration

CASES = {
    "unknown": ("auto:w4a16,int3", True, "unknown quantization scheme 'int3' in 'auto:w4a16,int3'"),
    "single": ("auto:w4a16", True, "leaves nothing to choose: name two or more schemes after 'auto:'"),
    "nvfp4": ("auto:w4a16,nvfp4a16", True, "nvfp4a16 has its own group size and scale format"),
    "no data": (
        "auto:w4a16,w8a16",
        False,
        "per-layer precision scores each layer's schemes on the calibration data",
    ),
    "valid": ("auto:w4a16,w8a16", True, "per-layer precision (auto:) is chosen by moeprune.job.precision"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("precision-refusals")
    tiny_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[]).save_pretrained(root / "model")
    (root / "calib.jsonl").write_text("".join(json.dumps({"text": f"{i} plus {i}"}) + "\n" for i in range(4)))
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_refused_in_one_line_before_loading(world, tmp_path, monkeypatch, case):
    def refuse(*_a, **_k):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(run_module, "load_placed", refuse)
    scheme, has_data, message = CASES[case]
    data = ["--data", world / "calib.jsonl"] if has_data else []
    result = run_cli(
        "prune", world / "model", "--output", tmp_path / "out", "--sparsity", "0.25", "--criterion", "frequency",
        *data, "--quantize", scheme, "--quant-method", "rtn", "--quant-python", sys.executable, ok=False,
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()
