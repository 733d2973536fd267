"""`PruneReport` on hand-written report.json documents: the stages a report passes through before
it is written, older reports with fewer keys, newer ones with unknown keys, and the few keys whose
value may be null. (test_document.py does the same on the reports real prunes write.)"""

from __future__ import annotations

import json

import pytest

from moeprune import __version__
from moeprune.errors import MoePruneError
from moeprune.report.document import NO_LOAD, PruneReport, as_report
from moeprune.report.model_card import model_card
from moeprune.report.parts import DataSummary, DiskBytes, SearchStop, SearchSummary
from moeprune.report.prune_report import report_markdown
from moeprune.report.summary import format_lines, prune_facts

pytestmark = pytest.mark.unit  # JSON documents only

HEAD = {
    "command": "prune",
    "moeprune_version": "0.1.0",
    "model": "in",
    "output": "out",
    "model_type": "qwen3_moe",
}
LAYERS = [
    {"layer": 0, "experts": 8, "novices": 0, "top_k": 2, "intermediate_size": 16, "min_intermediate_size": 16}
]
PARAMS = {"total": 100, "routed_experts": 64, "active_routed_experts": 16, "active_per_token": 52}
DATA = {
    "sources": ["d.jsonl"],
    "samples": 4,
    "tokens": 40,
    "truncated_samples": 0,
    "text_only": True,
    "fingerprint": "ab",
    "notes": ["a note"],
}
FACTS = {
    "criterion": "reap", "prune_first": "lowest", "allocation": "evo", "method": "drop", "sparsity": 0.25,
    "sparsity_unit": "experts", "expert_multiple": 2, "budget_experts_removed": 2,
    "removed_per_layer": {"0": 2}, "surgery": {"form": "rectangular", "packed_layers": []},
    "layers_before": LAYERS, "layers_after": [{**LAYERS[0], "experts": 6}],
    "parameters_before": PARAMS, "parameters_after": {**PARAMS, "total": 84, "routed_experts": 48},
    "kept_per_layer": [{"layer": 0, "experts_before": 8, "experts_after": 6, "routed_params_before": 64,
                        "routed_params_after": 48}],
    "data": DATA, "unseen_experts": ["layer 0: expert 3 got no calibration token"], "unseen": {"0": [3]},
    "scores": {"criterion": "reap", "layers": [{"layer": 0, "scores": [0.5] * 8}]},
    "serving": {"vllm_refused": "not this family"},
    "criterion_auto": {"fitness": "esap", "chosen": "reap", "table": [{"criterion": "reap", "esap": 0.9},
                                                                      {"criterion": "ean", "esap": 0.8}]},
    "search": {"fitness": "esap", "budget": 2, "allocation": [2], "fitness_value": 0.9,
               "uniform": {"allocation": [2], "fitness_value": 0.85}, "evaluations": 5,
               "stopped": {"reason": "patience", "generations_run": 3, "patience": 1},
               "teacher_cache": {"bytes": 10}, "notes": ["no prompt/answer split"]},
}  # fmt: skip
TAIL = {"save_dtype": "bfloat16", "command_line": "moeprune prune in --output out", "format": "moeprune",
        "disk_bytes": {"before": 4000, "after": 3000}, "timing_s": {"total": 1.0}}  # fmt: skip
NO_LOAD_NEURONS = {
    **{**HEAD, "command": NO_LOAD}, "criterion": "reap", "allocation": "uniform", "method": "neurons",
    "sparsity": 0.5, "format": "stock", "prune_first": "lowest", "sparsity_unit": "routed-expert parameters",
    "surgery": {"form": "rectangular", "intermediate_size": 8}, "kept_neurons": {"importance": "projection"},
    "layers_before": LAYERS, "parameters_before": PARAMS, "data": DATA, "unseen_experts": [], "unseen": {},
    "scores": {}, "layers_after": [{**LAYERS[0], "intermediate_size": 8, "min_intermediate_size": 8}],
    "parameters_after": {**PARAMS, "total": 68}, "timing_s": {"total": 1.0},
    "disk_bytes": {"before": 4000, "after": 3000}, "save_dtype": "float32",
}  # fmt: skip
NO_LOAD_DROP = {
    **{**HEAD, "command": NO_LOAD}, "criterion": "frequency", "allocation": "uniform", "method": "drop",
    "sparsity": 0.25, "format": "stock", "budget_experts_removed": 2, "removed_per_layer": {"0": 2},
    "data": DATA, "unseen": {}, "scores": {}, "timing_s": {"total": 1.0},
    "disk_bytes": {"before": 4000, "after": 3000}, "save_dtype": "float32",
}  # fmt: skip
TARGET = {"target_bytes": 3500, "sparsity": 0.25, "format": "bfloat16", "predicted_bytes": 3100,
          "written_bytes": 3000, "unpruned_bytes": 4100, "step_below": 0.125, "step_below_bytes": 3600}  # fmt: skip


def _without(document: dict, *keys: str) -> dict:
    return {k: v for k, v in document.items() if k not in keys}


def _round_trips(document: dict) -> bool:
    return json.dumps(PruneReport.from_json(document).to_json()) == json.dumps(document)


STAGES = {
    "api.prune's facts (no file-level keys)": FACTS,
    "a written in-memory prune": {**HEAD, **FACTS, **TAIL},
    "through the API: no command line": {**HEAD, **FACTS, **TAIL, "command_line": None},
    "on a rank that does not write": {**HEAD, **FACTS, "save_dtype": "float32", "command_line": None},
    "no expert budget": {**HEAD, **FACTS, "budget_experts_removed": None, **TAIL},
    "no calibration data": {**HEAD, **FACTS, "data": {}, **TAIL},
    "no-load drop": NO_LOAD_DROP,
    "no-load drop, before the rewrite": _without(NO_LOAD_DROP, "timing_s", "disk_bytes", "save_dtype"),
    "no-load, dtype of the shards unknown": {**NO_LOAD_DROP, "save_dtype": None},
    "no-load neurons": NO_LOAD_NEURONS,
    "no-load neurons, before the rewrite": _without(
        NO_LOAD_NEURONS, "layers_after", "parameters_after", "timing_s", "disk_bytes", "save_dtype"
    ),
    "a newer report's unknown keys": {**HEAD, **FACTS, **TAIL, "future": {"x": [1]}},
    "a size target, in memory": {**HEAD, **FACTS, **TAIL, "target": TARGET},
    "a size target, no-load drop": {**NO_LOAD_DROP, "target": TARGET},
    "a size target, no-load drop, before the rewrite": {
        **_without(NO_LOAD_DROP, "timing_s", "disk_bytes", "save_dtype"),
        "target": _without(TARGET, "written_bytes"),
    },
}


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_of_a_report_round_trips(stage):
    assert _round_trips(STAGES[stage])


@pytest.mark.parametrize("stage", [s for s in STAGES if "before the rewrite" not in s])  # never rendered
def test_readers_say_the_same_from_the_object(stage, tmp_path):
    document = STAGES[stage]
    report = PruneReport.from_json(document)
    assert prune_facts(report, tmp_path) == prune_facts(document, tmp_path)
    assert format_lines(prune_facts(report)) == format_lines(prune_facts(document))
    assert report_markdown(report, tmp_path) == report_markdown(document, tmp_path)
    assert model_card(report, "out") == model_card(document, "out")


def test_an_old_report_reads_with_defaults():
    """Reports from before a key existed still render; writing one back fills in the defaults."""
    old = {"criterion": "reap", "allocation": "uniform", "method": "drop", "sparsity": 0.5,
           "unseen": {"0": [1, 3], "5": [2]}, "output": "out"}  # fmt: skip
    report = PruneReport.from_json(old)
    assert report.expert_multiple == 1 and report.sparsity_unit is None and report.data == DataSummary()
    assert report.kept_per_layer is None and report.search is None and report.command is None
    facts = prune_facts(report)
    assert (
        facts["command"] == "prune" and facts["sparsity_unit"] == "experts" and facts["unseen_experts"] == 3
    )
    assert model_card(report) == model_card(old)
    written = report.to_json()
    assert {k: written[k] for k in old} == old and written["data"] == {} and written["expert_multiple"] == 1


def test_a_document_that_is_no_prune_report_is_refused():
    with pytest.raises(MoePruneError, match="criterion, sparsity"):
        PruneReport.from_json({"allocation": "uniform", "method": "drop"})


def test_parts_are_typed_and_empty_parts_are_false():
    report = as_report({**HEAD, **FACTS, **TAIL})
    assert as_report(report) is report
    assert isinstance(report.search, SearchSummary) and report.search.uniform.fitness_value == 0.85
    assert report.search.stopped == SearchStop(reason="patience", generations_run=3, patience=1)
    assert report.disk_bytes == DiskBytes(4000, 3000) and report.layers_after[0].experts == 6
    assert report.serving.vllm_refused and report.serving.vllm_parameters is None
    assert not DiskBytes() and DiskBytes(before=1) and not SearchSummary.from_json({})


def test_a_target_is_the_last_key_and_every_reader_gives_it():
    document = {**HEAD, **FACTS, **TAIL, "target": TARGET}
    assert list(PruneReport.from_json(document).to_json())[-1] == "target"
    assert "target" not in PruneReport.from_json({**HEAD, **FACTS, **TAIL}).to_json()  # old keys only
    line = "  target size     3.50 kB: 3.00 kB of bfloat16 weights written, sparsity 0.25 solved; 0.125 would need 3.60 kB"
    assert line in format_lines(prune_facts(document))
    assert "- Size target: 0.0 MiB (3,500 bytes) of weights; 0.0 MiB (3,000 bytes) of bfloat16 weights written; " \
        "sparsity 0.25 solved for it" in model_card(document, "out")  # fmt: skip


def test_the_search_summary_picks_its_keys_from_search_json():
    search_doc = {**FACTS["search"], "generations": [{"best": 1.0}], "config": {"population": 4}}
    assert SearchSummary.from_json(search_doc).to_json() == FACTS["search"]


def test_no_load_reports_start_as_before():
    """`PruneReport.no_load` writes the first keys every no-load report.json has always had."""
    head = {
        "command": "prune --no-load",
        "moeprune_version": __version__,
        "model": "in",
        "output": "out",
        "model_type": "qwen3_moe",
        "criterion": "reap",
        "allocation": "uniform",
        "method": "drop",
        "sparsity": 0.25,
        "format": "stock",
    }
    typed = PruneReport.no_load("in", "out", "qwen3_moe", "reap", "drop", 0.25, "uniform").to_json()
    assert list(typed.items())[: len(head)] == list(head.items())
    assert DataSummary.of([], []).to_json() == {}
