"""What each MoE layer kept, in the units that are true for every method.

Counting kept experts says nothing about neuron pruning (every expert stays) or novices (an
expert becomes one vector), so the first panel is always the fraction of each layer's
routed-expert parameters kept; expert methods add a second panel with the experts kept. Where a
search ran, the uniform allocation is drawn beside the searched one. The numbers come from
report.json (`kept_per_layer`), so `moeprune report OUT` redraws the same picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display needed, same PNG everywhere

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: E402


def kept_series(rows: Sequence[dict], key: str = "after") -> dict[str, list[float]]:
    """Per layer: kept fraction of routed parameters and kept (weight-holding) experts."""
    return {
        "layers": [r["layer"] for r in rows],
        "params": [r[f"routed_params_{key}"] / r["routed_params_before"] for r in rows],
        "experts": [r[f"experts_{key}"] for r in rows if f"experts_{key}" in r],
    }


def plot_kept(path: str | Path, rows: Sequence[dict], *, expert_unit: bool, title: str,
              compare: Sequence[dict] | None = None, label: str = "this result") -> dict:  # fmt: skip
    """Draw kept parameters (and experts, for expert methods) per layer; returns the plotted data.

    `compare` (the uniform allocation's rows, where a search ran) is drawn as a second series.
    """
    series = {label: kept_series(rows)}
    if compare is not None:
        series = {"searched": series[label], "uniform": kept_series(compare)}
    panels = 2 if expert_unit else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 2.9 * panels + 0.8), sharex=True, squeeze=False)
    styles = {"marker": "o", "linewidth": 1.6}
    ax = axes[0][0]
    for i, (name, data) in enumerate(series.items()):
        ax.plot(data["layers"], data["params"], label=name, color=f"C{i}", **styles)
    ax.set_ylabel("routed-expert\nparameters kept")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1.08)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if expert_unit:
        ax = axes[1][0]
        before = [r["experts_before"] for r in rows]
        ax.plot(series[next(iter(series))]["layers"], before, color="0.6", linestyle="--", label="before")
        for i, (name, data) in enumerate(series.items()):
            ax.plot(data["layers"], data["experts"], label=name, color=f"C{i}", **styles)
        ax.set_ylabel("experts kept\n(with weights)")
        ax.set_ylim(0, max(before) * 1.08)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("decoder layer")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = [], []
    for row in axes:
        for h, lab in zip(*row[0].get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # below the axes, never over the data
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.07 if panels == 1 else 0.05, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return series
