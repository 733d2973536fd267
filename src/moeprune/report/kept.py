"""What each MoE layer kept, in the units that are true for every method.

Counting kept experts says nothing about neuron pruning (every expert stays) or novices (an
expert becomes one vector), so the first panel is always the fraction of each layer's
routed-expert parameters kept; expert methods add a second panel with the experts kept. Several
results can share one figure (a search beside the uniform allocation; the demo's methods). The numbers come from
report.json (`kept_per_layer`), so `moeprune report OUT` redraws the same picture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def _style(i: int, count: int) -> dict:
    """Results often coincide in some layers (uniform drop and uniform neurons keep the same share):
    each series gets its own marker and dash, and earlier ones are drawn larger, so that a series
    under another still shows around it."""
    size = 10 - 5 * i / max(1, count - 1)
    return {
        "color": f"C{i}",
        "marker": "osD^vPX*"[i % 8],
        "markersize": size,
        "linewidth": 2.4 - i * 0.25,
        "linestyle": ("-", "--", "-.", ":")[i % 4],
        "zorder": 2 + i,
    }


def plot_kept(
    path: str | Path, named_rows: Mapping[str, Sequence[dict]], *, expert_unit: bool, title: str
) -> dict:
    """Draw kept parameters (and experts, for expert methods) per layer, one series per entry of
    `named_rows` (label -> `kept_per_layer` rows); returns the plotted data, by label."""
    series = {label: kept_series(rows) for label, rows in named_rows.items()}
    first = next(iter(named_rows.values()))
    panels = 2 if expert_unit else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 2.9 * panels + 0.8), sharex=True, squeeze=False)
    ax = axes[0][0]
    for i, (name, data) in enumerate(series.items()):
        ax.plot(data["layers"], data["params"], label=name, **_style(i, len(series)))
    ax.set_ylabel("routed-expert\nparameters kept")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1.08)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if expert_unit:
        ax = axes[1][0]
        before = [r["experts_before"] for r in first]
        ax.plot(series[next(iter(series))]["layers"], before, color="0.6", linestyle="--", label="before")
        for i, (name, data) in enumerate(series.items()):
            ax.plot(data["layers"], data["experts"], label=name, **_style(i, len(series)))
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
    # below the axes, never over the data; three entries per legend row, two or one when the labels
    # are long enough that more would run past the figure's edges
    longest = max(map(len, labels))
    columns = min(3 if longest <= 26 else 2 if longest <= 44 else 1, len(labels))
    legend_rows = -(-len(labels) // columns)
    fig.legend(handles, labels, loc="lower center", ncol=columns, frameon=False)
    # Margins in inches, fixed (the labels, fonts and legend columns are), and the figure saved as
    # laid out: a layout engine and a tight bounding box each drew it once more (0.28 s against
    # 0.16 s a figure, and every prune draws one).
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=1.0 / width,  # the two-line y label and "100%"
        right=1 - 0.25 / width,
        top=1 - 0.4 / height,  # the title
        bottom=(0.65 + 0.27 * legend_rows) / height,  # tick labels, the x label, then the legend
        hspace=0.08,
    )
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return series
