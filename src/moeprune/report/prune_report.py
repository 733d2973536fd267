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


def no_load_report(model_path: str | Path, output: str | Path, model_type: str, criterion: str, method: str,
                   sparsity: float) -> dict:  # fmt: skip
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
        before = [{"layer": r["layer"], "experts": r["experts_before"], "routed_params": r["routed_params_before"]}
                  for r in rows]  # fmt: skip
        uniform = uniform_rows(before, search_doc["uniform"]["allocation"], hidden_sizes,
                               novices=report["method"] == "novice")  # fmt: skip
    what = f"{report['criterion']}, {report['allocation']}, {report['method']}, sparsity {report['sparsity']}"
    return plot_kept(path, rows, expert_unit=expert_unit, title=f"kept per layer ({what})", compare=uniform)
