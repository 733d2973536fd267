"""report.json as a `PruneReport`, on the reports real prunes write (one of each kind).

report.json is a file-format contract: reading a report into the typed object and writing it back
gives the same file, key order included; and every reader (the console summary, report.md, the
model card, density.png's data) says the same from the object as from the dictionary, which is
what the files in the output already hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.report.document import NO_LOAD, PRUNE, PruneReport
from moeprune.report.model_card import model_card
from moeprune.report.parts import KeptRow, ParameterCounts, SearchSummary
from moeprune.report.prune_report import draw_kept, report_markdown
from moeprune.report.summary import format_lines, prune_facts

pytestmark = pytest.mark.integration  # runs prunes end to end

COMMON = ("--criterion", "reap", "--sparsity", "0.25", "--samples", "8", "--quiet")
KINDS = {
    "drop": (),
    "novice": ("--method", "novice", "--criterion", "mone"),
    "tenp": ("--method", "tenp"),
    "evo": ("--allocation", "evo", "--search-data", "{data}", "--search-samples", "8",
            "--generations", "2", "--population", "4", "--elites", "2", "--criterion", "auto"),
    "no-load drop": ("--no-load",),
    "no-load neurons": ("--no-load", "--method", "neurons", "--sparsity", "0.5", "--allow-super-experts"),
}  # fmt: skip


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, data, tmp_path_factory) -> dict[str, Path]:
    """One output folder per kind of prune, through the command line."""
    root, out = tmp_path_factory.mktemp("document"), {}
    for kind, extra in KINDS.items():
        folder = root / kind.replace(" ", "_")
        args = ["prune", tiny_checkpoint, "--output", folder, "--data", data, *COMMON]
        args += [a.format(data=data) for a in extra]  # later options win over COMMON's
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        out[kind] = folder
    return out


def _read(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_report_json_round_trips_key_for_key(outputs, kind):
    document = _read(outputs[kind])
    report = PruneReport.from_json(document)
    assert json.dumps(report.to_json()) == json.dumps(document)  # same keys, order and values
    assert report.command == (NO_LOAD if kind.startswith("no-load") else PRUNE)


@pytest.mark.parametrize("kind", KINDS)
def test_readers_say_the_same_from_the_object_as_from_the_dictionary(outputs, kind):
    folder = outputs[kind]
    document = _read(folder)
    report = PruneReport.from_json(document)
    facts = prune_facts(document, folder)
    assert prune_facts(report, folder) == facts
    assert format_lines(prune_facts(report, folder)) == format_lines(facts)
    markdown = report_markdown(report, folder)
    assert markdown == report_markdown(document, folder)
    assert markdown == (folder / "report.md").read_text()  # what the prune wrote from its dictionary
    card = folder / "README.md"  # the model card: written by prunes that load the model
    name = document["output"]
    assert model_card(report, name) == model_card(document, name)
    if card.is_file():
        assert model_card(report, name) == card.read_text()


@pytest.mark.parametrize("kind", ["drop", "novice", "tenp", "evo"])
def test_density_data_is_the_same_from_the_object(outputs, kind, tmp_path):
    folder = outputs[kind]
    document = _read(folder)
    search = folder / "search.json"
    search_doc = json.loads(search.read_text()) if search.is_file() else None
    hidden = [16] * len(document["kept_per_layer"])
    expert_unit = document["sparsity_unit"] == "experts"
    from_dict = draw_kept(tmp_path / "a.png", document, search_doc, hidden, expert_unit=expert_unit)
    from_object = draw_kept(
        tmp_path / "b.png", PruneReport.from_json(document), search_doc, hidden, expert_unit=expert_unit
    )
    assert from_object == from_dict


def test_the_typed_fields_hold_the_report(outputs):
    """The parts readers use field by field are typed; the opaque documents stay dictionaries."""
    evo = PruneReport.from_json(_read(outputs["evo"]))
    assert isinstance(evo.search, SearchSummary) and evo.search.uniform.allocation
    assert evo.search.stopped.reason == "generations" and evo.search.stopped.generations_run == 2
    assert evo.criterion_auto.chosen == evo.criterion
    assert all(isinstance(row, KeptRow) for row in evo.kept_per_layer)
    assert isinstance(evo.parameters_after, ParameterCounts) and evo.parameters_after.total > 0
    assert evo.disk_bytes.after > 0 and isinstance(evo.scores, dict) and isinstance(evo.timing_s, dict)
    neurons = PruneReport.from_json(_read(outputs["no-load neurons"]))
    assert neurons.surgery.intermediate_size == 8 and neurons.kept_neurons["importance"]
    assert neurons.expert_multiple == 1  # kept per layer is written by both pipelines' evidence writer
    assert all(r.experts_after == r.experts_before and r.routed_params_after < r.routed_params_before
               for r in neurons.kept_per_layer)  # fmt: skip
    drop = PruneReport.from_json(_read(outputs["no-load drop"]))
    assert drop.format == "stock" and drop.allocation == "uniform" and drop.layers_before is None
