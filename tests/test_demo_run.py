"""`moeprune demo` end to end on the trained fixture (quick mode): rows, files and basic sanity."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.demo import run as demo_run


@pytest.fixture()
def quick_on_fixture(monkeypatch, trained_moe):
    """Quick mode, every criterion, on the session's trained fixture (already cached)."""
    monkeypatch.setattr(demo_run, "QUICK_CRITERIA", demo_run.DEMO_CRITERIA)
    monkeypatch.setattr(demo_run, "get_demo_model", lambda *a, **k: trained_moe[0])


def test_demo_quick_writes_table_results_and_plots(quick_on_fixture, tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(
        main, ["demo", "--quick", "--output", str(out), "--quiet"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    full = rows[0]
    assert full["criterion"] == "full model" and full["esap"] == pytest.approx(1.0, abs=1e-6)
    methods = {(r["allocation"], r["method"]) for r in rows[1:]}
    assert {("uniform", "drop"), ("global", "drop"), ("uniform", "novice"), ("uniform", "neurons"),
            ("trapezoid", "tenp"), ("evo", "drop")} <= methods  # fmt: skip
    assert {r["criterion"] for r in rows[1:]} >= set(demo_run.DEMO_CRITERIA)
    for row in rows[1:]:
        assert 0 < row["esap"] < 1
        assert row["parameters"]["total"] < full["parameters"]["total"]
    for sparsity in (0.25, 0.5):  # searched >= uniform on the search data, by construction
        search = next(s for s in results["searches"] if s["sparsity"] == sparsity)
        assert search["fitness_value"] >= search["uniform"]["fitness_value"]
    assert (out / "results.md").read_text().startswith("| criterion |")
    assert (out / "density_50.png").is_file() and list(out.glob("search_*.png"))
    assert "ESAP" in result.output
