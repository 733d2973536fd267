"""report.json of a prune: what was done, what it cost and kept, what was measured.

Everything the console summary, the model card, report.md and the plots say is read from this
report (a `PruneReport`, moeprune.report.document; its dictionary is accepted too), so they can be
redrawn from the JSON at any time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moeprune.checkpoint.files import shard_names
from moeprune.report.document import PruneReport, as_report
from moeprune.report.kept import plot_kept
from moeprune.report.summary import format_lines, prune_facts
from moeprune.search.document import SearchDocument
from moeprune.surgery.parameters import uniform_rows
from moeprune.surgery.registry import METHODS


def weight_bytes(folder: str | Path) -> int:
    """Bytes of a checkpoint's safetensors weights on disk."""
    return sum((Path(folder) / name).stat().st_size for name in shard_names(Path(folder)))


def draw_kept(
    path: Path,
    report: PruneReport | Mapping,
    search_doc: dict | None,
    hidden_sizes: list[int],
    expert_unit: bool,
) -> dict:
    """density.png: kept routed parameters (and experts) per layer; uniform beside a searched one.
    Returns the plotted series (tests compare them with the plan)."""
    report = as_report(report)
    rows = [row.to_json() for row in report.kept_per_layer or []]
    uniform = None
    # drop counts only: a mixed search's seeds, and the uniform genes of mixed + gradient, are in search.json
    searched = SearchDocument.from_json(search_doc).uniform_allocation if search_doc is not None else None
    if searched is not None:
        before = [
            {"layer": r["layer"], "experts": r["experts_before"], "routed_params": r["routed_params_before"]}
            for r in rows
        ]
        uniform = uniform_rows(
            before,
            searched,
            hidden_sizes,
            novices=METHODS.get(report.method).keeps_routing or report.reroute == "none",
        )
    what = f"{report.criterion}, {report.allocation}, {report.method}, sparsity {report.sparsity:.4g}"
    named = {"searched": rows, "uniform": uniform} if uniform is not None else {"this result": rows}
    return plot_kept(path, named, expert_unit=expert_unit, title=f"kept per layer ({what})")


def report_markdown(report: PruneReport | Mapping, folder: str | Path) -> str:
    """report.md: the console summary, then the plots and the per-layer facts behind them."""
    report, folder = as_report(report), Path(folder)
    facts = prune_facts(report, folder)
    evidence = facts["files"]["evidence"]
    if "report.md" not in evidence:  # this file, being written
        evidence.insert(0, "report.md")
    out = ["# moeprune prune", "", "```text", *format_lines(facts), "```", ""]
    if (folder / "density.png").is_file():
        out += [
            "## What each layer kept",
            "",
            "Routed-expert parameters kept per decoder layer (and experts kept, for expert methods); "
            "where a search ran, the uniform allocation is drawn beside the searched one.",
            "",
            "![kept per layer](density.png)",
            "",
        ]
    out += _kept_table(report)
    if (folder / "search_curve.png").is_file():
        out += [
            "## EvoESAP search",
            "",
            "Best and mean fitness per generation on the search data.",
            "",
            "![search curve](search_curve.png)",
            "",
        ]
    auto = report.criterion_auto
    if auto:
        fitness = auto.fitness
        out += [
            "## Criterion auto",
            "",
            f"Uniform plan of each criterion, {fitness} on the search data:",
            "",
            f"| criterion | {fitness} |",
            "|---|---:|",
        ]
        out += [
            f"| {row['criterion']}{' (picked)' if row['criterion'] == auto.chosen else ''} | "
            f"{row[fitness]:.6g} |"
            for row in auto.table
        ]
        out.append("")
    out += _portfolio_table(report)
    out += _novice_fits_table(report)
    notes = list(report.release_layers or []) + list(report.unseen_experts or [])
    notes += list((report.search and report.search.notes) or [])
    notes += list(report.data.notes or [])
    if notes:
        out += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    if report.command_line:
        out += [
            "## Reproduce",
            "",
            "```bash",
            report.command_line,
            "```",
            "",
            "or `moeprune prune MODEL --output OUT --config recipe.json` (recipe.json is in this folder).",
            "",
        ]
    return "\n".join(out)


def _kept_table(report: PruneReport) -> list[str]:
    """report.md's per-layer table of experts and routed parameters kept."""
    rows = report.kept_per_layer or []
    if not rows:
        return []
    out = [
        "| layer | experts before | experts after | routed parameters before | after | kept |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kept = r.routed_params_after / r.routed_params_before if r.routed_params_before else 0.0
        after = "-" if r.experts_after is None else r.experts_after
        out.append(
            f"| {r.layer} | {r.experts_before} | {after} | "
            f"{r.routed_params_before:,} | {r.routed_params_after:,} | {kept:.1%} |"
        )
    return [*out, ""]


def _novice_fits_table(report: PruneReport) -> list[str]:
    """report.md's per-layer table of low-rank novices' errors, calibration beside held-out."""
    fits = report.novice_fits
    if not fits or not fits.layers:
        return []

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    out = [
        "## Novice fits",
        "",
        f"Rank-{fits.rank} novices: squared error relative to the constant novice's (1: no better), on "
        f"the calibration tokens they were fitted on and on held-out tokens ({fits.held_out}); the "
        "unshrunk column is the held-out error of the least-squares rank-R fit without the held-out "
        "choice of ridge and rank. Calibration far below held-out is overfitting.",
        "",
        "| layer | novices | kept constant | calibration | held out | unshrunk held out |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in fits.layers:
        out.append(
            f"| {r['layer']} | {r['novices']} | {r['constant']} | {cell(r['calibration'])} | "
            f"{cell(r['held_out'])} | {cell(r['unshrunk_held_out'])} |"
        )
    return [*out, "", *[f"- too few tokens: {line}" for line in fits.too_few or []], ""]


def _went_on(run: dict) -> str:
    """A run outside its rung's best third that went on: how far behind the leader, and the noise."""
    close = run.get("within_noise")
    if not close:
        return ""
    return f" (went on: {close['gap']:.4f} behind {close['leader']}, standard error {close['standard_error']:.4f})"


def _portfolio_table(report: PruneReport) -> list[str]:
    """`--method auto`'s recipes: each one's runs (budget fraction: fitness, seconds), the winner marked."""
    part = report.portfolio
    if not part:
        return []
    fitness = part.fitness
    out = [
        "## Auto: every recipe",
        "",
        f"{fitness} on the search data of each recipe's plan at each budget it ran ({part.halving}):",
        "",
        "![portfolio](portfolio.png)",
        "",
        f"| recipe | runs (budget: {fitness}, seconds) |",
        "|---|---|",
    ]
    for row in part.recipes:
        runs = "; ".join(
            f"{r['budget']:.3g}: {r[fitness]:.6g}, {r['seconds']:.1f} s{_went_on(r)}"
            for r in row.get("runs") or []
        )
        label = row["label"] + (" (chosen)" if row["label"] == part.chosen else "")
        if row.get("repaired"):
            runs += f"; repaired: {row['repaired']['before']:.6g} -> {row['repaired']['after']:.6g}"
        out.append(f"| {label} | {runs or 'not run: ' + row.get('refused', 'stopped')} |")
    return [*out, ""]
