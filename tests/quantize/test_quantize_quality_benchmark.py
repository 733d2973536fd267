"""benchmarks/quantize_quality.py's own code paths, without llm-compressor or a trained model: the
byte split read from safetensors headers, the equal-bytes rows (every solved row's --target-size is
its anchor's bytes on disk) and the table's row assembly (a refusal keeps its line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quantize_quality as qq  # noqa: E402


def test_weight_bytes_split_routed_experts_from_the_rest(tmp_path):
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    model.save_pretrained(tmp_path)
    routed, total = qq.weight_bytes(tmp_path)
    expected = sum(
        p.numel() * p.element_size() for m in MoEModel(model).layers for p in m.experts.parameters()
    )
    assert routed == expected > 0
    assert total == (tmp_path / "model.safetensors").stat().st_size
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        expected < everything < total
    )  # the rest (attention, embeddings) and the header counted in total only


METRICS = {d: {"esap": 0.5 + i / 10, "nll": 1.0 + i} for i, d in enumerate(qq.DOMAINS)}


class FakeRunner:
    """Records the rows `run` asks for; each made checkpoint's bytes shrink with the sparsity."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []

    def quant_flags(self, scheme):
        return ["--quantize", scheme]

    def quantize_only(self, scheme):
        row = qq.Row(f"{scheme} only", "x", "", 0.0, 80, 1000 if scheme == "w4a16" else 1800, METRICS)
        return row, (
            qq.Row("bf16, full model", "x", "", 0.0, 1, 4000, METRICS) if scheme == "w4a16" else None
        )

    def prune(self, name, flags, budget=""):
        self.calls.append((name, flags))
        if "--target-size" in flags and int(flags[flags.index("--target-size") + 1]) < 900:
            return qq.Row(name, " ".join(flags), budget, refused="no drop plan fits")
        sparsity = float(flags[1]) if flags[0] == "--sparsity" else 0.6
        return qq.Row(name, " ".join(flags), budget, sparsity, 10, int(1000 * (1 - sparsity / 2)), METRICS)


def test_each_solved_row_targets_its_anchors_bytes():
    runner = FakeRunner()
    rows = qq.run(runner, [0.25, 0.5], [0.75])  # type: ignore[arg-type]
    anchors = {
        r.name: r.total_bytes
        for r in rows
        if r.name in ("w4a16 only", "reap 25% + w4a16", "reap 50% + w4a16")
    }
    assert anchors == {"w4a16 only": 1000, "reap 25% + w4a16": 875, "reap 50% + w4a16": 750}
    targeted = [(n, f) for n, f in runner.calls if "--target-size" in f]
    assert len(targeted) == 6  # bf16 prune only and prune + w8a16 at each of the three anchors
    for name, flags in targeted:
        anchor = name.split(" at ", 1)[1]
        assert int(flags[flags.index("--target-size") + 1]) == anchors[anchor]
        assert ("--quantize" in flags) == name.startswith("prune + w8a16")
    text = qq.table(rows)
    assert text.count("\n") == len(rows) + 1  # head, rule, one line per row
    assert "no drop plan fits" in text  # the solver's refusal is in its row, not dropped


def test_row_cells_hold_bytes_scores_and_command():
    metrics = METRICS
    row = qq.Row("reap 25% + w4a16", "--sparsity 0.25", "", 0.25, 1234, 56789, metrics)
    cells = row.cells()
    assert len(cells) == len(qq.HEAD)
    assert cells[2:5] == ["25.0%", "1,234", "56,789"]
    assert cells[-2] == f"{sum(m['esap'] for m in metrics.values()) / len(metrics):.4f}"
    assert cells[-1] == "`--sparsity 0.25`"
