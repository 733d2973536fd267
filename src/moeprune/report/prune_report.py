"""report.json of a prune: what was done, what it cost and kept, what was measured.

Everything the console summary, the model card, report.md and the plots say is read from this
dictionary, so they can be redrawn from the JSON at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moeprune import __version__
from moeprune.checkpoint.files import shard_names
from moeprune.data.loading import CalibrationData
from moeprune.observe.stats import ExpertStats
from moeprune.report.kept import plot_kept
from moeprune.report.summary import format_lines, prune_facts
from moeprune.surgery.parameters import uniform_rows


def weight_bytes(folder: str | Path) -> int:
    """Bytes of a checkpoint's safetensors weights on disk."""
    return sum((Path(folder) / name).stat().st_size for name in shard_names(Path(folder)))


def data_summary(sets: Sequence[CalibrationData], stats: Sequence[ExpertStats]) -> dict:
    if not sets:
        return {}
    return {
        "sources": [s for d in sets for s in d.sources],
        "samples": sum(len(d.samples) for d in sets),
        "tokens": int(sum(s.tokens for s in stats)),
        "truncated_samples": sum(d.truncated for d in sets),
        "text_only": all(d.text_only for d in sets),
        "fingerprint": sets[0].fingerprint if len(sets) == 1 else [d.fingerprint for d in sets],
        "notes": [n for d in sets for n in d.notes],
    }


def no_load_report(
    model_path: str | Path, output: str | Path, model_type: str, criterion: str, method: str, sparsity: float
) -> dict:
    """report.json fields every prune without loading shares (the result is always a stock checkpoint)."""
    return {
        "command": "prune --no-load",
        "moeprune_version": __version__,
        "model": str(model_path),
        "output": str(output),
        "model_type": model_type,
        "criterion": criterion,
        "allocation": "uniform",
        "method": method,
        "sparsity": sparsity,
        "format": "stock",
    }


def draw_kept(
    path: Path, report: dict, search_doc: dict | None, hidden_sizes: list[int], expert_unit: bool
) -> dict:
    """density.png: kept routed parameters (and experts) per layer; uniform beside a searched one.
    Returns the plotted series (tests compare them with the plan)."""
    rows = report["kept_per_layer"]
    uniform = None
    if search_doc is not None:
        before = [
            {"layer": r["layer"], "experts": r["experts_before"], "routed_params": r["routed_params_before"]}
            for r in rows
        ]
        uniform = uniform_rows(
            before, search_doc["uniform"]["allocation"], hidden_sizes, novices=report["method"] == "novice"
        )
    what = f"{report['criterion']}, {report['allocation']}, {report['method']}, sparsity {report['sparsity']}"
    named = {"searched": rows, "uniform": uniform} if uniform is not None else {"this result": rows}
    return plot_kept(path, named, expert_unit=expert_unit, title=f"kept per layer ({what})")


def report_markdown(report: dict, folder: str | Path) -> str:
    """report.md: the console summary, then the plots and the per-layer facts behind them."""
    folder = Path(folder)
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
    rows = report.get("kept_per_layer") or []
    if rows:
        out += [
            "| layer | experts before | experts after | routed parameters before | after | kept |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            kept = r["routed_params_after"] / r["routed_params_before"] if r["routed_params_before"] else 0.0
            out.append(
                f"| {r['layer']} | {r['experts_before']} | {r.get('experts_after', '-')} | "
                f"{r['routed_params_before']:,} | {r['routed_params_after']:,} | {kept:.1%} |"
            )
        out.append("")
    if (folder / "search_curve.png").is_file():
        out += [
            "## EvoESAP search",
            "",
            "Best and mean fitness per generation on the search data.",
            "",
            "![search curve](search_curve.png)",
            "",
        ]
    auto = report.get("criterion_auto")
    if auto:
        fitness = auto["fitness"]
        out += [
            "## Criterion auto",
            "",
            f"Uniform plan of each criterion, {fitness} on the search data:",
            "",
            f"| criterion | {fitness} |",
            "|---|---:|",
        ]
        out += [
            f"| {row['criterion']}{' (picked)' if row['criterion'] == auto['chosen'] else ''} | "
            f"{row[fitness]:.6g} |"
            for row in auto["table"]
        ]
        out.append("")
    notes = list(report.get("unseen_experts") or []) + list((report.get("search") or {}).get("notes") or [])
    notes += list((report.get("data") or {}).get("notes") or [])
    if notes:
        out += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    if report.get("command_line"):
        out += [
            "## Reproduce",
            "",
            "```bash",
            report["command_line"],
            "```",
            "",
            "or `moeprune prune MODEL --output OUT --config recipe.json` (recipe.json is in this folder).",
            "",
        ]
    return "\n".join(out)
