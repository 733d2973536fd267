"""`moeprune demo` end to end on the trained fixture (quick mode): rows, files and basic sanity."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.demo import run as demo_run

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end


@pytest.fixture()
def quick_on_fixture(monkeypatch, trained_moe):
    """Quick mode, every criterion, on the session's trained fixture (already cached)."""
    monkeypatch.setattr(demo_run, "QUICK_CRITERIA", demo_run.DEMO_CRITERIA)
    monkeypatch.setattr(demo_run, "get_demo_model", lambda *a, **k: trained_moe[0])


def test_demo_quick_writes_table_results_and_plots(quick_on_fixture, tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(
        main, ["demo", "--quick", "--output", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    full = rows[0]
    assert full["criterion"] == "full model" and full["esap"] == pytest.approx(1.0, abs=1e-6)
    methods = {(r["allocation"], r["method"]) for r in rows[1:]}
    assert {("uniform", "drop"), ("global", "drop"), ("uniform", "novice"), ("uniform", "neurons"),
            ("trapezoid", "tenp"), ("evo", "drop"), ("evo", "mixed"), ("uniform", "novice, rank 16"),
            ("uniform", "drop, reroute none")} <= methods  # fmt: skip
    for sparsity in (0.25, 0.5):  # a rank-16 novice holds d + 2 d 16 values where a constant holds d
        peers = {r["method"]: r for r in rows if r["sparsity"] == sparsity and r["criterion"] == "mone"}
        extra = peers["novice, rank 16"]["parameters"]["total"] - peers["novice"]["parameters"]["total"]
        novices = sum(len(ids) for ids in peers["novice"]["removed"].values())
        assert extra == novices * 2 * 16 * 64  # hidden size 64 (the fixture)
    assert {r["criterion"] for r in rows[1:]} >= set(demo_run.DEMO_CRITERIA)
    for row in rows[1:]:
        assert 0 < row["esap"] < 1
        assert row["parameters"]["total"] < full["parameters"]["total"]
    for sparsity in (0.25, 0.5):  # searched >= uniform on the search data, by construction
        search = next(s for s in results["searches"] if s["sparsity"] == sparsity)
        assert search["fitness_value"] >= search["uniform"]["fitness_value"]
        mixed = next(s for s in results["searches"] if s["sparsity"] == sparsity and "seeds" in s)
        assert set(mixed["seeds"]) >= {"tenp", "neurons"}, mixed["seeds"].keys()  # drop, novice: where the budget allows
        assert all(mixed["fitness_value"] >= seed["fitness_value"] for seed in mixed["seeds"].values())
    assert "tenp mixed evo at 50%" in result.output
    # the super experts (a model this small always has one) stay in every row, as prune keeps them
    assert results["super_experts"] and "super experts kept in every row" in result.output
    for row in rows[1:]:
        for layer, ids in results["super_experts"].items():
            assert not set(ids) & set(row["removed"][layer]), (row["criterion"], row["method"])
    assert (out / "results.md").read_text().startswith("| criterion |")
    assert (out / "density_50.png").is_file() and list(out.glob("search_*.png"))
    assert "ESAP" in result.output
    # without a terminal, a line per configuration as it finishes, with its ESAP
    last = rows[-1]
    assert (
        f"demo: {len(rows) - 1}/{len(rows) - 1} config, {last['criterion']} {last['allocation']} "
        f"{last['method']} at {last['sparsity']:g}: ESAP {last['esap']:.3f}"
    ) in result.output
    assert (out / "moeprune.log").is_file() and "demo --quick" in (out / "moeprune.log").read_text()
    # the summary's output line lists what is in the folder
    assert all(p.name in result.output for p in out.iterdir())

    # density plots tell the truth for every method: narrowed experts keep a fraction of their
    # parameters (not "1.0 of the experts"), novices keep one vector per replaced expert
    plotted = demo_run._plots(tmp_path, rows)
    for sparsity, series in plotted.items():
        labels = list(series)
        assert labels[0].startswith("uniform drop")  # the reference first
        for label, data in series.items():
            row = next(r for r in rows if r["sparsity"] == sparsity
                       and label.startswith(f"{r['allocation']} {r['method']} ({r['criterion']})"))  # fmt: skip
            kept = [r["routed_params_after"] / r["routed_params_before"] for r in row["kept_rows"]]
            assert data["params"] == pytest.approx(kept)
            total_before = sum(r["routed_params_before"] for r in row["kept_rows"])
            total_after = sum(r["routed_params_after"] for r in row["kept_rows"])
            if row["method"] == "mixed":  # one parameter budget over every form, met to half a neuron row
                assert total_after / total_before == pytest.approx(1 - sparsity, abs=0.005)
            if row["method"] in ("neurons", "tenp"):  # a parameter budget, met over the whole model
                assert total_after / total_before == pytest.approx(1 - sparsity, abs=0.03)
                assert data["experts"] == [r["experts_before"] for r in row["kept_rows"]]
            elif row["method"] == "drop":
                assert data["params"] == pytest.approx(
                    [r["experts_after"] / r["experts_before"] for r in row["kept_rows"]]
                )


def test_demo_gradient_row_removes_what_the_search_chose(trained_moe):
    """The full demo's gradient rows: `_search` dispatches to the gradient allocation, whose counts
    meet the demo's budget and whose re-ordered scores make the plan drop exactly its choice (drop;
    mixed: genes and orders whose plan has the forms search.json reports)."""
    from moeprune.checkpoint import load_model
    from moeprune.config import PruneConfig, SearchConfig
    from moeprune.criteria import compute_scores
    from moeprune.data.loading import load_data
    from moeprune.demo.corpus import DOMAINS
    from moeprune.models import MoEModel
    from moeprune.surgery.planning import build_plan

    model_dir, corpus = trained_moe
    model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    settings = demo_run.DemoSettings.for_mode(quick=True)
    files = [str(corpus / f"{d}_search.jsonl") for d in DOMAINS]
    search = load_data(files, tokenizer, num_samples=8, max_length=64, seed=0)
    layers = [m.index for m in moe.layers]
    scores = compute_scores("magnitude", weights=moe.layers, num_experts=[m.num_experts for m in moe.layers], layers=layers)
    config = PruneConfig("magnitude", 0.5, allocation="gradient", search=SearchConfig(steps=4, seed=3))
    removed, ordered, document = demo_run._search(moe, scores, search, config, settings, tokenizer.pad_token_id or 0)
    assert document["allocation_method"] == "gradient" and document["steps"] == 4
    assert sum(removed) == document["budget"] == sum(m.num_experts for m in moe.layers) // 2
    plan = build_plan(moe, demo_run.get_criterion("magnitude"), ordered, config=config, removed=removed)
    assert {str(lp.layer): sorted(lp.dropped) for lp in plan.layers} == {
        k: sorted(v) for k, v in document["dropped"].items()
    }
    # the full demo's mixed + gradient row: genes and orders that save exactly the forms it reports
    from moeprune.observe.observer import observe

    stats = observe(moe, search, batch_size=4, neurons=True, progress=False)
    config = PruneConfig("magnitude", 0.5, allocation="gradient", method="mixed", search=SearchConfig(steps=2, seed=3))
    genes, ordered, document = demo_run._search(moe, scores, search, config, settings, tokenizer.pad_token_id or 0, stats)
    plan = build_plan(moe, demo_run.get_criterion("magnitude"), ordered, config=config, stats=[stats], removed=genes)
    for lp in plan.layers:
        forms = document["forms"][str(lp.layer)]
        assert sorted(lp.dropped) == forms["dropped"] and sorted(lp.novice) == forms["novice"]
