"""What the user sees after a command: the summary's facts, report.md, moeprune.log, progress lines.

The summary's facts are checked against independent sources (the saved tensors, the files on
disk, search.json, the criterion-auto table re-ranked here), never against its own wording.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from moeprune.cli.main import main
from moeprune.criteria import unseen_experts
from moeprune.job import run as job_run
from moeprune.observe.stats import ExpertStats, LayerStats
from moeprune.report.kept import kept_series
from moeprune.report.prune_report import draw_kept
from moeprune.report.summary import format_lines, prune_facts
from moeprune.runtime.progress import PlainBar, progress_bar, stage
from moeprune.runtime.runlog import LOG_NAME, RunLog

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def _saved(folder: Path) -> tuple[int, set[torch.dtype]]:
    """Parameters and dtypes of every tensor in the saved shards (read here, not from the report)."""
    count, dtypes = 0, set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = handle.get_tensor(name)
                count += tensor.numel()
                dtypes.add(tensor.dtype)
    return count, dtypes


@pytest.fixture(scope="module")
def evo_auto(tiny_checkpoint, data, tmp_path_factory) -> tuple[Path, str]:
    """One `prune --criterion auto --allocation evo` through the command line, and its output."""
    out = tmp_path_factory.mktemp("summary") / "out"
    result = run("prune", tiny_checkpoint, "--output", out, "--criterion", "auto", "--allocation", "evo",
                 "--sparsity", "0.5", "--data", data, "--search-data", data, "--search-samples", "8",
                 "--samples", "4", "--population", "4", "--elites", "2", "--generations", "2",
                 "--save-dtype", "bf16", "--quiet")  # fmt: skip
    return out, result.output


def test_prune_summary_facts_match_the_saved_model(tiny_checkpoint, evo_auto):
    out, printed = evo_auto
    report = json.loads((out / "report.json").read_text())
    search = json.loads((out / "search.json").read_text())
    facts = prune_facts(report, out)
    # criterion auto: the picked criterion is the one used, the runner-up the next best in its table
    table = report["criterion_auto"]["table"]
    ranked = sorted(table, key=lambda row: -row["esap"])  # esap: higher is better
    assert facts["auto"]["chosen"] == report["criterion"] == ranked[0]["criterion"]
    assert facts["auto"]["chosen_value"] == ranked[0]["esap"]
    assert facts["auto"]["runner_up"] == ranked[1]["criterion"]
    assert facts["auto"]["runner_up_value"] == ranked[1]["esap"]
    # the search: searched and uniform fitness as search.json holds them, and why it stopped
    assert facts["search"]["searched"] == search["fitness_value"]
    assert facts["search"]["uniform"] == search["uniform"]["fitness_value"]
    assert facts["search"]["stopped"] == "generations" and facts["search"]["generations"] == 2
    # parameters and bytes: before from the input's files, after from the output's files
    before, _ = _saved(tiny_checkpoint)
    after, dtypes = _saved(out)
    assert facts["parameters"]["before"] == before and facts["parameters"]["after"] == after
    assert facts["parameters"]["change_pct"] == pytest.approx(100 * (after - before) / before, abs=0.01)
    shard_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert facts["bytes"]["after"] == shard_bytes
    assert facts["bytes"]["before"] == sum(p.stat().st_size for p in tiny_checkpoint.glob("*.safetensors"))
    assert dtypes == {torch.bfloat16} and facts["save_dtype"] == "bfloat16"
    # where each file is: every listed file exists, and every evidence file is listed
    listed = [name for names in facts["files"].values() for name in names]
    assert all((out / name).is_file() for name in listed)
    for name in ("report.md", "report.json", "plan.json", "recipe.json", "search.json", LOG_NAME):
        assert name in facts["files"]["evidence"]
    assert {"density.png", "search_curve.png"} <= set(facts["files"]["plots"])
    # the console shows these lines, and report.md starts with the same lines
    lines = format_lines(facts)
    assert all(line in printed for line in lines)
    markdown = (out / "report.md").read_text()
    assert "\n".join(lines[:6]) in markdown
    assert "![kept per layer](density.png)" in markdown and "![search curve](search_curve.png)" in markdown


def _expert_params(folder: Path) -> dict[int, int]:
    """Routed-expert parameters per decoder layer, summed over the saved tensors' shapes."""
    out: dict[int, int] = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if ".mlp.experts." in name:
                    layer = int(name.split(".layers.")[1].split(".")[0])
                    out[layer] = out.get(layer, 0) + math.prod(handle.get_slice(name).get_shape())
    return out


def test_plot_data_is_the_kept_parameters_of_the_saved_model(tiny_checkpoint, evo_auto):
    """density.png's data (what `draw_kept` plots) per layer equals the routed-expert parameters
    of the saved tensors over those of the input, and the experts kept equal the plan's."""
    out, _ = evo_auto
    report = json.loads((out / "report.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    before, after = _expert_params(tiny_checkpoint), _expert_params(out)
    plotted = draw_kept(out / "again.png", report, json.loads((out / "search.json").read_text()),
                        [16] * len(plan["layers"]), expert_unit=True)  # fmt: skip
    searched = plotted["searched"]
    assert searched["layers"] == [lp["layer"] for lp in plan["layers"]]
    for layer, kept in zip(searched["layers"], searched["params"]):
        assert kept == pytest.approx(after[layer] / before[layer], rel=1e-12)
    assert searched["experts"] == [len(lp["kept"]) for lp in plan["layers"]]
    assert plotted["searched"] == kept_series(report["kept_per_layer"])


def test_run_log_records_command_versions_stages_and_warnings(tiny_checkpoint, data, tmp_path, monkeypatch):
    load = job_run.load_placed

    def loud(*args, **kwargs):
        warnings.warn("a warning raised while loading", UserWarning, stacklevel=1)
        return load(*args, **kwargs)

    monkeypatch.setattr(job_run, "load_placed", loud)
    out = tmp_path / "out"
    with pytest.warns(UserWarning):  # the log records warnings; it does not swallow them
        run("prune", tiny_checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.25",
            "--data", data, "--samples", "4", "--quiet")  # fmt: skip
    log = (out / LOG_NAME).read_text()
    assert f"prune {tiny_checkpoint} --output {out}" in log
    assert f"torch         {torch.__version__}" in log
    for name in ("loading", "observe", "saving to"):
        assert name in log
    assert "a warning raised while loading" in log
    assert RunLog._active is None  # released after the command


def test_no_load_prune_writes_log_report_and_summary(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    result = run("prune", tiny_checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.25",
                 "--data", data, "--no-load", "--quiet")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    facts = prune_facts(report, out)
    assert facts["bytes"]["after"] == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert facts["save_dtype"] == "float32"
    assert (out / LOG_NAME).is_file() and (out / "report.md").is_file()
    assert all(line in result.output for line in format_lines(facts))


def test_unseen_experts_and_their_summary_line():
    stats = ExpertStats(layers=[LayerStats.zeros(0, 4, 2, 3), LayerStats.zeros(3, 4, 2, 3)])
    stats.layers[0].count[:] = torch.tensor([5.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    stats.layers[1].count[:] = 1.0
    other = ExpertStats(layers=[LayerStats.zeros(0, 4, 2, 3), LayerStats.zeros(3, 4, 2, 3)])
    other.layers[0].count[3] = 1.0  # a second domain reaches expert 3 of layer 0
    assert unseen_experts(stats) == {"0": [1, 3]}
    assert unseen_experts([stats, other]) == {"0": [1]}
    report = {"criterion": "reap", "allocation": "uniform", "method": "drop", "sparsity": 0.5,
              "unseen": {"0": [1, 3], "5": [2]}, "output": "out"}  # fmt: skip
    facts = prune_facts(report)
    assert facts["unseen_experts"] == 3
    assert any("3 got no calibration token" in line and "1, 3" in line for line in format_lines(facts))


def test_progress_without_a_terminal_prints_plain_lines_and_times_stages(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with RunLog("moeprune test") as log:
        bar = progress_bar(total=3, desc="evo search", unit="gen", each_step=True)
        assert isinstance(bar.bar, PlainBar)
        for step in range(3):
            bar.set_postfix_str(f"best so far {step}")
            bar.update(1)
        bar.close()
        for _ in progress_bar(range(5), desc="observe", unit="batch"):
            pass
        with stage("saving"):
            pass
        with stage("quiet stage", enabled=False):
            pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "evo search: started (3 gen)"
    assert err[1:4] == [f"evo search: {i}/3 gen, best so far {i - 1}" for i in (1, 2, 3)]
    assert err[4].startswith("evo search: done, 3 gen in ")
    assert err[5] == "observe: started (5 batch)" and err[6].startswith("observe: done, 5 batch in ")
    assert err[7] == "saving ..." and err[8].startswith("saving: done in ")
    assert len(err) == 9  # no carriage-return bar redraws, nothing from the disabled stage
    assert [name for name, _, _ in log.stages] == ["evo search", "observe", "saving", "quiet stage"]
    assert log.stages[1][2] == 5


def test_eval_prints_its_summary_and_writes_its_log(tiny_checkpoint, evo_auto, data, tmp_path):
    out, _ = evo_auto
    report = tmp_path / "eval" / "r.json"
    result = run("eval", out, "--reference", tiny_checkpoint, "--data", data, "--metrics", "esap,size",
                 "--samples", "4", "--output", report, "--quiet")  # fmt: skip
    doc = json.loads(report.read_text())
    esap = doc["models"][0]["per_data"][str(data)]["esap"]
    assert f"esap {esap:.4g}" in result.output  # the summary's figure is the report's
    log = report.with_suffix(".log")
    assert log.is_file() and "eval" in log.read_text() and str(log) in result.output
    # an existing run log is not replaced silently: the whole report set needs --overwrite
    report.unlink()
    report.with_suffix(".md").unlink()
    again = run("eval", out, "--reference", tiny_checkpoint, "--data", data, "--metrics", "esap", "--output", report,
                "--quiet", ok=False)  # fmt: skip
    assert again.exit_code == 2 and "r.log" in again.output and "--overwrite" in again.output
