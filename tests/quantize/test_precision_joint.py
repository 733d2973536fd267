"""`prune --quantize auto:w4a16,w8a16 --target-size T` without `--sparsity`, through prune's own
steps (observation, the grid, the configured prune at the chosen point, the schemes chosen again),
with llm-compressor's oneshot stood in for (its part is tests/quantize/test_precision_prune.py):
no quantization environment needed, so it runs everywhere.

What must hold: the grid's points are the dry run's; the sparsity kept is the point of best combined
fitness; the prune ran at it (report and recipe); and with the uniform allocation the final choice
equals the grid's choice at that point (the same split, the same losses)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from helpers import oneshot_stand_in, run_cli, save_tiny_qwen, write_arithmetic
from moeprune.quantize import stage as stage_module

pytestmark = pytest.mark.integration

TARGET = "127300"  # the grid 5/24 .. 9/24: all-w4a16 fits from 5/24, all-w8a16 from 9/24


@pytest.fixture(scope="module")
def joint(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision-joint")
    save_tiny_qwen(root / "model")
    data = write_arithmetic(root / "calib.jsonl")
    args = ["prune", root / "model", "--output", root / "out", "--data", data, "--criterion", "frequency",
            "--target-size", TARGET, "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn",
            "--quant-group-size", "16", "--quant-python", sys.executable, "--quiet"]  # fmt: skip
    dry = run_cli(*args, "--dry-run").output
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
        run_cli(*args)
    report = json.loads((root / "out" / "report.json").read_text())
    recipe = json.loads((root / "out" / "recipe.json").read_text())
    return {"dry": dry, "report": report, "recipe": recipe, "out": root / "out"}


def test_the_sparsity_kept_is_the_grid_point_of_best_combined_fitness(joint):
    precision = joint["report"]["quantization"]["precision"]
    rows = precision["sparsity_grid"]
    dry = [float(s) for s in re.findall(r"grid      sparsity ([\d.]+):", joint["dry"])]
    assert [float(f"{r['sparsity']:.6g}") for r in rows] == dry and len(rows) == 4  # as printed
    best = max(rows, key=lambda r: r["fitness"])
    assert joint["report"]["sparsity"] == best["sparsity"] == joint["recipe"]["config"]["sparsity"]
    assert all(r["predicted_bytes"] <= int(TARGET) for r in rows)
    assert joint["recipe"]["quantize"]["target_size"] == int(TARGET)


def test_the_final_choice_is_the_grid_choice_at_that_point(joint):
    precision = joint["report"]["quantization"]["precision"]
    best = next(r for r in precision["sparsity_grid"] if r["sparsity"] == joint["report"]["sparsity"])
    assert joint["report"]["removed_per_layer"] == best["removed_per_layer"]
    assert precision["chosen"] == best["chosen"] and precision["predicted_bytes"] == best["predicted_bytes"]
    assert precision["summed_loss"] == pytest.approx(best["summed_loss"], rel=1e-6, abs=1e-9)


def test_the_run_log_names_the_choice_and_who_reads_it(joint):
    log = (joint["out"] / "moeprune.log").read_text()
    chosen = ", ".join(f"{k} {v}" for k, v in joint["report"]["quantization"]["precision"]["chosen"].items())
    assert f"per-layer precision (experts of layer: scheme) {chosen};" in log
    if len(set(joint["report"]["quantization"]["precision"]["chosen"].values())) > 1:
        assert "stock transformers reads one experts scheme for every layer" in log
