"""Evaluation plots (PNG, headless) and `moeprune report DIR`, which redraws everything from JSON
(a pruned output's model card included).

Why from JSON only: plots are cheap to redraw and easy to restyle, the measurements are not;
nothing here loads a model. Density and search curves reuse moeprune.plots (the search's own
plots); this module adds score profiles and acceptance per draft position, and finds the inputs
in a folder: eval reports, plan.json files, score files and search.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from moeprune.errors import MoePruneError
from moeprune.plan import Plan
from moeprune.report.document import NO_LOAD, PruneReport
from moeprune.report.eval_report import is_eval_report, markdown_path, to_markdown
from moeprune.report.model_card import model_card
from moeprune.report.plots import PathLike, plot_layer_density, plot_search_curve, plt, save_figure
from moeprune.runtime.atomic import write_text

PLAN_FILE = "plan.json"
_MAX_JSON_BYTES = 64 * 2**20  # larger JSON files (statistics dumps) are not plot inputs


def plot_plan_density(path: PathLike, plans: Mapping[str, Plan]) -> Path:
    """Kept-expert fraction per layer, one line per plan (plans of one model: same layers)."""
    first = next(iter(plans.values()), None)
    if first is None:
        raise MoePruneError("no plan to plot")
    layers = [lp.layer for lp in first.layers]
    same = {label: p for label, p in plans.items() if [lp.layer for lp in p.layers] == layers}
    removed = {label: p.removed_per_layer() for label, p in same.items()}
    removed = dict(sorted(removed.items()))
    return plot_layer_density(path, layers, [lp.num_experts for lp in first.layers], removed)


def _importance_profile(scores: list[float], prune_first: str) -> list[float]:
    """Scores sorted most important first, scaled to [0, 1] (1 = most important)."""
    ordered = sorted(scores, reverse=prune_first != "largest")
    low, high = min(ordered), max(ordered)
    if high == low:
        return [1.0] * len(ordered)
    scaled = [(v - low) / (high - low) for v in ordered]
    return scaled if prune_first != "largest" else [1 - v for v in scaled]


def plot_score_profiles(path: PathLike, score_docs: Mapping[str, dict]) -> Path:
    """Per layer, each criterion's within-layer sorted scores (AIMER's separation figure).

    A criterion whose profile falls steeply separates a few important experts from the rest;
    a flat one cannot tell them apart. `score_docs` maps a label to a `moeprune score` JSON.
    """
    layer_ids = sorted({lay["layer"] for doc in score_docs.values() for lay in doc["layers"]})
    if not layer_ids:
        raise MoePruneError("no scored layer to plot")
    cols = min(4, len(layer_ids))
    rows = -(-len(layer_ids) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, layer in zip(axes.flat, layer_ids):
        for label, doc in score_docs.items():
            entry = next((lay for lay in doc["layers"] if lay["layer"] == layer), None)
            if entry and entry["scores"]:
                profile = _importance_profile(entry["scores"], doc.get("prune_first", "smallest"))
                ax.plot(range(1, len(profile) + 1), profile, marker=".", label=label)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("rank (most important first)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(layer_ids) :]:
        ax.axis("off")
    axes.flat[0].set_ylabel("scaled score")
    axes.flat[0].legend(fontsize=7)
    return save_figure(fig, path)


def plot_acceptance(path: PathLike, doc: dict) -> Path:
    """Acceptance rate per draft position, one panel per mode, one line per model and data file."""
    modes = sorted(
        {mode for m in doc["models"] for d in m["per_data"].values() for mode in d.get("accept", {})}
    )
    if not modes:
        raise MoePruneError("the report has no speculative-decoding results (metric accept)")
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.4), squeeze=False)
    for ax, mode in zip(axes.flat, modes):
        for model in doc["models"]:
            for source, data in model["per_data"].items():
                rates = data.get("accept", {}).get(mode, {}).get("accept_rate_per_position")
                if rates:
                    xs = [i + 1 for i, r in enumerate(rates) if r is not None]
                    ax.plot(
                        xs,
                        [r for r in rates if r is not None],
                        marker="o",
                        label=f"{model['label']} · {Path(source).stem}",
                    )
        ax.set_title(f"{mode} drafting")
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    # one legend below the panels: acceptance near 1 fills the top of each panel, where a legend
    # inside would cover points
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = min(3, len(labels))
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * -(-len(labels) // columns) + 0.02, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ moeprune report DIR


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _json_files(folder: Path) -> list[Path]:
    """JSON files in the folder and one level below (pruned outputs keep plan.json and report.json)."""
    paths = sorted(folder.glob("*.json")) + sorted(folder.glob("*/*.json"))
    return [p for p in paths if p.stat().st_size <= _MAX_JSON_BYTES]


def _score_doc(doc: Any) -> dict | None:
    """A `moeprune score` document, or the one a prune report.json embeds."""
    if isinstance(doc, dict) and isinstance(doc.get("scores"), dict):
        doc = doc["scores"]
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if isinstance(layers, list) and layers and "criterion" in doc and all("scores" in lay for lay in layers):
        return doc
    return None


def _plans(folder: Path, docs: Mapping[Path, Any], reports: Mapping[Path, dict]) -> dict[str, Plan]:
    """plan.json files in the folder and its subfolders, and beside every evaluated model."""
    paths = [*folder.glob(PLAN_FILE), *folder.glob(f"*/{PLAN_FILE}")]
    paths += [
        Path(m["model"]) / PLAN_FILE for doc in reports.values() for m in doc["models"] if m.get("model")
    ]
    plans = {}
    for path in dict.fromkeys(p.resolve() for p in paths if p.is_file()):
        label = path.parent.name if path.parent != folder.resolve() else "plan"
        plans[label] = Plan.load(path)
    return plans


def _draw_reports(reports: Mapping[Path, dict]) -> list[Path]:
    """Each eval report's Markdown summary, and its acceptance plot beside it."""
    written = []
    for path, doc in reports.items():
        md = markdown_path(path)
        md.write_text(to_markdown(doc))
        written.append(md)
        if any(d.get("accept") for m in doc["models"] for d in m["per_data"].values()):
            written.append(plot_acceptance(path.with_name(f"{path.stem}_acceptance.png"), doc))
    return written


def _draw_scores(folder: Path, docs: Mapping[Path, Any]) -> list[Path]:
    scores: dict[str, dict] = {}
    for doc in docs.values():
        score = _score_doc(doc)
        if score is not None:  # one profile per criterion: the same model scored twice adds little
            scores.setdefault(score["criterion"], score)
    return [plot_score_profiles(folder / "score_profiles.png", scores)] if scores else []


def _draw_searches(docs: Mapping[Path, Any]) -> list[Path]:
    """A curve beside every search.json-like document (per-generation history plus its fitness)."""
    return [
        plot_search_curve(path.with_name(f"{path.stem}_curve.png"), doc["generations"], doc["fitness"])
        for path, doc in docs.items()
        if isinstance(doc, dict)
        and doc.get("generations")
        and isinstance(doc["generations"], list)
        and "fitness" in doc
    ]


def _draw_card(folder: Path, docs: Mapping[Path, Any]) -> list[Path]:
    """README.md (the model card) from a prune's report.json, as the prune drew it. Not for a
    prune without loading: it writes no card, and its README.md is the base model's, copied."""
    document = docs.get(folder / "report.json")
    if not isinstance(document, dict) or not all(k in document for k in _PRUNE_KEYS):
        return []
    report = PruneReport.from_json(document)
    if report.command == NO_LOAD:
        return []
    write_text(folder / "README.md", model_card(report, report.output or str(folder)))
    return [folder / "README.md"]


_PRUNE_KEYS = ("criterion", "allocation", "method", "sparsity")


def draw_directory(folder: str | Path) -> list[Path]:
    """(Re)draw every plot and Markdown summary the JSON files in `folder` allow; the files written."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MoePruneError(f"{folder} is not a folder; pass the folder holding the eval/prune/search JSON")
    docs = {p: _read_json(p) for p in _json_files(folder)}
    reports = {p: d for p, d in docs.items() if is_eval_report(d)}
    written = _draw_reports(reports)
    plans = _plans(folder, docs, reports)
    if plans:
        written.append(plot_plan_density(folder / "density.png", plans))
    written += _draw_scores(folder, docs) + _draw_searches(docs) + _draw_card(folder, docs)
    if not written:
        raise MoePruneError(
            f"nothing to draw in {folder}: expected an eval report (what moeprune eval writes), plan.json, "
            "scores JSON (moeprune score) or search.json"
        )
    return written
