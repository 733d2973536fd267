"""The evidence beside every result, written the same way by both pipelines.

A result folder holds the weights and config the pipeline wrote, the input's other files
(tokenizer, chat template, generation config, ...) and this evidence: plan.json, recipe.json,
report.json, report.md, the model card (README.md), moeprune.log, density.png, and search.json
with search_curve.png where a search ran. One writer, so a `--no-load` result and an in-memory
one can never drift apart in what they carry (tests/job/test_evidence.py compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moeprune.checkpoint.save import carry_input_files
from moeprune.checkpoint.sparsity_metadata import record_sparsity, sparsity_config
from moeprune.config import RECIPE_FILE, Recipe
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.report.document import PruneReport
from moeprune.report.model_card import model_card
from moeprune.report.parts import DiskBytes, KeptRow
from moeprune.report.plots import plot_portfolio, plot_search_curve
from moeprune.report.prune_report import draw_kept, report_markdown, weight_bytes
from moeprune.runtime.atomic import write_json
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.search.document import SearchDocument
from moeprune.surgery.parameters import kept_per_layer, kept_rows
from moeprune.surgery.registry import EXPERTS


@dataclass
class Evidence:
    """What a finished prune knows about itself, whichever pipeline ran it."""

    model_path: Path
    output: Path
    report: PruneReport
    plan: Plan
    recipe: Recipe
    before: MoEModel  # the input's structure (a meta-device model will do)
    log: RunLog
    timer: Timer
    search: dict | None = None  # search.json, where a search ran
    tokenizer_path: Path | None = None  # a tokenizer given apart from the input


def write_evidence(folder: Path, evidence: Evidence, after: MoEModel) -> None:
    """Write every evidence file into `folder` (the result being published, its weights and config
    already there), after carrying over the input's other files; `after` is the result's
    structure. The report is completed here: bytes on disk, kept per layer, timings."""
    report = evidence.report
    for source in (evidence.model_path, evidence.tokenizer_path):
        if source is not None and Path(source).is_dir():
            carry_input_files(source, folder)
    config: Any = after.model.config  # transformers' config (a plain attribute, not a submodule)
    metadata = sparsity_config(
        evidence.plan,
        int(config.get_text_config().num_hidden_layers),
        {m.index: m.num_experts for m in after.layers},
    )
    if metadata is not None:  # the standard's per-layer counts, for tools that read it
        record_sparsity(folder, metadata)
    written = weight_bytes(folder)
    report.disk_bytes = DiskBytes(weight_bytes(evidence.model_path), written)
    if report.target is not None:
        report.target = replace(report.target, written_bytes=written)
    if report.kept_per_layer is None:
        report.kept_per_layer = KeptRow.rows(
            kept_rows(kept_per_layer(evidence.before), kept_per_layer(after))
        )
    evidence.plan.save(folder / "plan.json")
    write_json(folder / RECIPE_FILE, evidence.recipe.to_json())
    if evidence.search is not None:
        write_json(folder / "search.json", evidence.search)
        search = SearchDocument.from_json(evidence.search)
        if search.generations is not None:  # evo's (gradient: steps)
            plot_search_curve(folder / "search_curve.png", search.generations, search.fitness)
    if report.portfolio:  # --method auto: every recipe's fitness and time
        plot_portfolio(folder / "portfolio.png", report.portfolio)
    draw_kept(
        folder / "density.png",
        report,
        evidence.search,
        [m.hidden_size for m in evidence.before.layers],
        expert_unit=report.sparsity_unit in (None, EXPERTS),  # reports before the unit: experts
    )
    evidence.timer.lap("save")
    report.timing_s = evidence.timer.total()
    write_json(folder / "report.json", report.to_json())
    (folder / "README.md").write_text(model_card(report, str(evidence.output)))
    evidence.log.write(folder)  # before report.md, so that its file list names the log
    (folder / "report.md").write_text(report_markdown(report, folder))
