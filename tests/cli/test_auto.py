"""`moeprune prune` without a recipe: `--method auto` through the command line on a tiny checkpoint
(the winner is the best recipe it ran, saved as that recipe; --stock gives a stock checkpoint;
the report's part and portfolio.png), its dry run (every recipe, no weight loaded), its refusals
before anything is loaded, and the default without search data (TENP's trapezoid, said)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_fp8_checkpoint
from moeprune.surgery import METHODS
from moeprune.surgery.registry import ResolvedConfig

pytestmark = pytest.mark.integration  # prunes a tiny checkpoint end to end


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def test_stock_auto_saves_the_best_stock_recipe_with_its_report_and_plot(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--search-data",
               data, "--search-samples", "6", "--stock", "--allow-super-experts")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    part = report["portfolio"]
    ran = [row for row in part["recipes"] if row.get("runs")]
    assert len(ran) == 4  # uniform drop and uniform neurons, in REAP's and TENP's orders
    best = max(ran, key=lambda row: max(r["esap"] for r in row["runs"]))
    assert part["chosen"] == best["label"] and part["budget"] == 1.0
    assert (report["criterion"], report["method"], report["allocation"]) == (
        best["criterion"],
        best["method"],
        best["allocation"],
    )
    assert report["format"] == "stock"  # reloads in stock transformers
    recipe = json.loads((out / "recipe.json").read_text())["config"]
    assert (recipe["criterion"], recipe["method"]) == (best["criterion"], best["method"])  # reruns the winner
    assert (out / "portfolio.png").is_file() and "auto " in done.output and best["label"] in done.output
    assert "## Auto: every recipe" in (out / "report.md").read_text()
    # one calibration pass for the whole contest and the winner's build (the prune takes it as given)
    stages = [
        line.split()[0] for line in (out / "moeprune.log").read_text().splitlines() if line.startswith("  ")
    ]
    assert stages.count("observe") == 1, stages


def test_with_repair_the_best_three_are_repaired_and_the_best_after_repair_wins(
    tiny_checkpoint, data, tmp_path
):
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--search-data",
               data, "--search-samples", "6", "--stock", "--allow-super-experts", "--repair", "--repair-steps",
               "6", "--repair-eval-every", "2")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    part = report["portfolio"]
    ran = [row for row in part["recipes"] if row.get("runs")]
    repaired = [row for row in part["recipes"] if row.get("repaired")]
    best_before = sorted(ran, key=lambda row: -max(r["esap"] for r in row["runs"]))
    assert [r["label"] for r in repaired] == sorted(
        (r["label"] for r in best_before[:3]), key=[r["label"] for r in part["recipes"]].index
    )
    for row in repaired:  # repair starts from the plan the contest scored, on the same samples
        assert row["repaired"]["before"] == pytest.approx(max(r["esap"] for r in row["runs"]), abs=1e-5)
        assert row["repaired"]["after"] >= row["repaired"]["before"]
    chosen = next(row for row in repaired if row["label"] == part["chosen"])
    assert chosen["repaired"]["after"] == max(row["repaired"]["after"] for row in repaired)
    # the job repairs the winner on the model itself: the same result as on the contest's copy
    assert report["repair"]["after"] == pytest.approx(chosen["repaired"]["after"], abs=1e-6)
    assert report["repair"]["before"] == pytest.approx(chosen["repaired"]["before"], abs=1e-6)
    assert "repaired:" in (out / "report.md").read_text()
    # the contest says what it does as it goes: each run, each finalist's repair
    assert f"auto: {chosen['label']} at 1 of its budget: esap" in done.output
    assert f"auto: {chosen['label']} repaired: held-out esap" in done.output


def test_without_room_for_a_copy_repair_takes_the_best_plan_before_repair_and_warns(
    tiny_checkpoint, data, tmp_path, monkeypatch
):
    import moeprune.job.auto as job_auto

    monkeypatch.setattr(job_auto, "room_for_a_copy", lambda model: False)
    out = tmp_path / "out"
    run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--search-data",
        data, "--search-samples", "6", "--stock", "--allow-super-experts", "--repair", "--repair-steps", "4",
        "--repair-eval-every", "2")  # fmt: skip
    part = json.loads((out / "report.json").read_text())["portfolio"]
    ran = [row for row in part["recipes"] if row.get("runs")]
    assert not any(row.get("repaired") for row in part["recipes"])
    assert part["chosen"] == max(ran, key=lambda row: max(r["esap"] for r in row["runs"]))["label"]
    assert "no room for a second copy of the model" in (out / "moeprune.log").read_text()


def test_the_python_api_on_a_loaded_model_takes_one_recipe():
    from moeprune.api import prune
    from moeprune.config import PruneConfig
    from moeprune.errors import MoePruneError

    with pytest.raises(MoePruneError, match="prune\\(\\) of a loaded model takes one recipe"):
        prune(tiny_model("qwen3_moe"), PruneConfig("auto", 0.5, method="auto"))


def test_a_dry_run_lists_every_recipe_with_an_estimate_and_loads_nothing(
    tiny_checkpoint, data, tmp_path, monkeypatch
):
    import moeprune.job.run as job_run

    monkeypatch.setattr(job_run, "load_placed", lambda *a, **k: pytest.fail("a dry run loaded the model"))
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--search-data",
               data, "--dry-run")  # fmt: skip
    recipes = [line for line in done.output.splitlines() if line.startswith("  recipe")]
    from moeprune.config import PruneConfig

    expected = METHODS.get("auto").portfolio(PruneConfig("auto", 0.5, method="auto"))
    assert len(recipes) == len(expected) and all(" s at its full budget" in line for line in recipes)
    assert {r.label for r in expected} == {line.split("  recipe  ")[1].split(" (")[0] for line in recipes}
    assert not out.exists()


def _small_auto(checkpoint, data, out) -> list:
    """auto in REAP's order alone, with small search budgets (seconds on the tiny checkpoint)."""
    return ["prune", checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--search-data", data,
            "--search-samples", "6", "--criterion", "reap", "--method", "auto", "--threads", "1", "--population", "6",
            "--elites", "2", "--generations", "3", "--gradient-steps", "9", "--allow-super-experts"]  # fmt: skip


def test_the_winner_s_recipe_json_reruns_to_the_same_plan(tiny_checkpoint, data, tmp_path):
    # the winner may be a run continued from a smaller rung: its recipe, run afresh, is the same plan
    out, again = tmp_path / "out", tmp_path / "again"
    run(*_small_auto(tiny_checkpoint, data, out))
    run("prune", tiny_checkpoint, "--output", again, "--config", out / "recipe.json", "--quiet")
    assert json.loads((again / "recipe.json").read_text())["config"]["method"] != "auto"
    assert json.loads((out / "plan.json").read_text()) == json.loads((again / "plan.json").read_text())


@pytest.mark.parametrize("repair", [(), ("--repair", "--repair-steps", "20")], ids=["plain", "repair"])
def test_the_dry_run_s_estimate_is_within_its_factor_of_the_contest_s_measured_time(
    tiny_checkpoint, data, tmp_path, repair
):
    from moeprune.job.auto import ESTIMATE_FACTOR

    out = tmp_path / "out"
    flags = [*_small_auto(tiny_checkpoint, data, out), *repair]
    estimate = float(run(*flags, "--dry-run").output.split("  estimated  ~")[1].split(" s ")[0])
    run(*flags)
    report = json.loads((out / "report.json").read_text())
    measured = report["portfolio"]["seconds"]  # with --repair: the finalists' repairs, and the winner's
    measured += sum(report["repair"]["seconds"].values()) if repair else 0.0
    assert 1 / ESTIMATE_FACTOR <= estimate / measured <= ESTIMATE_FACTOR, (estimate, measured)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--search-data", "DATA"), "the auto method needs calibration data"),
        (("--data", "DATA", "--search-data", "DATA", "--no-load"), "the no-load pipeline never loads it"),
        (("--data", "DATA", "--search-data", "DATA", "--novice-rank", "4"), "novice-rank"),
        (
            ("--data", "DATA", "--search-data", "DATA", "--allocation", "evo"),
            "the auto method chooses each recipe's allocation; leave out the allocation",
        ),
        (("--data", "DATA", "--method", "auto"), "the auto method needs search data"),
        (("--data", "DATA", "--method", "drop"), "--method drop needs a criterion"),
    ],
)
def test_refusals_are_one_line_before_loading(tiny_checkpoint, data, tmp_path, flags, message):
    out = tmp_path / "out"
    flags = [str(data) if f == "DATA" else f for f in flags]
    done = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", *flags, ok=False)
    assert done.exit_code == 2 and message in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not out.exists()


def test_a_quantized_input_is_refused_unless_saved_dequantized(data, tmp_path):
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=4, mlp_only_layers=[])
    fp8 = save_fp8_checkpoint(model, tmp_path / "fp8", block=(16, 16), tokenizer=tokenizer)
    done = run("prune", fp8, "--output", tmp_path / "out", "--sparsity", "0.5", "--data", data, "--search-data",
               data, ok=False)  # fmt: skip
    assert done.exit_code == 2 and "is quantized" in done.output and "--save-dtype" in done.output
    assert len(done.output.strip().splitlines()) == 1


def test_without_search_data_the_default_is_tenp_s_trapezoid_and_says_so(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data)
    report = json.loads((out / "report.json").read_text())
    assert (report["criterion"], report["method"], report["allocation"]) == ("tenp", "tenp", "trapezoid")
    assert "TENP trapezoid" in done.output and "needs no search data" in done.output


def test_stock_recipes_are_the_ones_a_stock_config_expresses():
    from moeprune.config import PruneConfig

    stock = METHODS.get("auto").portfolio(PruneConfig("auto", 0.5, method="auto", options={"stock": True}))
    every = METHODS.get("auto").portfolio(PruneConfig("auto", 0.5, method="auto"))
    assert stock and all(ResolvedConfig.of(r.config).stock for r in stock)
    assert any(not ResolvedConfig.of(r.config).stock for r in every)
    named = METHODS.get("auto").portfolio(PruneConfig("reap", 0.5, method="auto"))
    assert {r.config.criterion for r in named} == {"reap"}
