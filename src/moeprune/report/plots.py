"""PNG plots for reports (matplotlib, Agg backend: no display needed).

Each function is independent: it opens its own figure, writes one PNG and closes the figure,
so callers never leak figures and plots can be added without touching the others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless, deterministic PNG output

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PathLike = str | os.PathLike[str]


def save_figure(fig: Any, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _per_layer(value: int | Sequence[int], count: int) -> list[int]:
    if isinstance(value, int):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{len(value)} expert counts for {count} layers")
    return [int(v) for v in value]


def plot_layer_density(
    path: PathLike,
    layer_indices: Sequence[int],
    experts_total: int | Sequence[int],
    allocations: Mapping[str, Sequence[int]],
) -> Path:
    """Kept fraction of routed experts per MoE layer, one line per plan (e.g. uniform vs searched).

    ``allocations`` maps a label to the number of experts *removed* per layer, in the order of
    ``layer_indices``; ``experts_total`` is the per-layer expert count before pruning.
    """
    totals = _per_layer(experts_total, len(layer_indices))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    markers = "osD^v<>p*"
    for i, (label, removed) in enumerate(allocations.items()):
        if len(removed) != len(layer_indices):
            raise ValueError(f"allocation {label!r} has {len(removed)} layers, expected {len(layer_indices)}")
        kept = [(n - r) / n for n, r in zip(totals, removed)]
        ax.plot(list(layer_indices), kept, marker=markers[i % len(markers)], label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("kept fraction of routed experts")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("per-layer expert density")
    return save_figure(fig, path)


def _as_dict(entry: Any) -> dict[str, Any]:
    # a dataclass instance, not a dataclass class (is_dataclass accepts both; asdict only the first)
    return asdict(entry) if is_dataclass(entry) and not isinstance(entry, type) else dict(entry)


def plot_search_curve(path: PathLike, history: Sequence[Any], fitness: str = "fitness") -> Path:
    """Best and mean fitness per generation, with every population member as a faint dot.

    ``history`` entries are dicts or dataclasses with ``generation``, ``best``, ``mean`` and
    optionally ``fitnesses`` (as in ``search.json``).
    """
    rows = [_as_dict(h) for h in history]
    if not rows:
        raise ValueError("empty search history: nothing to plot")
    gens = [r["generation"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.0))
    for r in rows:
        values = r.get("fitnesses") or []
        ax.scatter([r["generation"]] * len(values), values, s=6, color="0.7", zorder=1)
    ax.plot(gens, [r["mean"] for r in rows], marker=".", label="population mean", zorder=2)
    ax.plot(gens, [r["best"] for r in rows], marker="o", label="generation best", zorder=3)
    ax.scatter([], [], s=6, color="0.7", label="population members")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generation")
    ax.set_ylabel(f"{fitness} on the search data")
    ax.grid(alpha=0.3)
    ax.set_title("EvoESAP search: fitness per generation")
    # below the axes: population dots fill the whole plot area, a legend inside would cover some
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    return save_figure(fig, path)


def plot_portfolio(path: PathLike, portfolio: Any) -> Path:
    """`--method auto`'s contest: each recipe's runs as fitness on the search data against the
    seconds it took (one marker per successive-halving rung, joined per recipe, its size the share
    of the recipe's search budget), the winner marked. Seconds span orders of magnitude (a plan
    without a search takes a fraction of a second, a full search minutes), so the axis is
    logarithmic once they do; sizes, not text, tell the rungs apart, since the first rungs of
    several recipes land on one spot. With --repair, each finalist's plan after repair is a star above
    its last run."""
    fitness, rows = portfolio.fitness, [r for r in portfolio.recipes if r.get("runs")]
    if not rows:
        raise ValueError("no recipe ran: nothing to plot")
    fig, ax = plt.subplots(figsize=(8, 4.6))
    spans = []
    for row in rows:
        runs = row["runs"]
        seconds = list(accumulate(r["seconds"] for r in runs))  # spent on the recipe so far
        values = [r[fitness] for r in runs]
        spans += seconds
        won = row["label"] == portfolio.chosen
        (line,) = ax.plot(
            seconds,
            values,
            marker="o",
            ms=4,
            lw=2.5 if won else 1,
            label=row["label"] + (" (chosen)" if won else ""),
        )
        sizes = [20 + 60 * min(1.0, float(r["budget"])) for r in runs]
        edge = "black" if won else "none"
        ax.scatter(seconds, values, s=sizes, color=line.get_color(), zorder=3, edgecolors=edge)
        if row.get("repaired"):  # auto --repair's finalists: before -> after repair, dotted, a star
            fixed = row["repaired"]
            ax.plot([seconds[-1]] * 2, [fixed["before"], fixed["after"]], ":", color=line.get_color(), lw=1)
            ax.scatter([seconds[-1]], [fixed["after"]], marker="*", s=110, color=line.get_color(), zorder=4)
    if any(r.get("repaired") for r in rows):
        ax.scatter([], [], marker="*", s=110, color="grey", label="after repair (finalists)")
    positive = [s for s in spans if s > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("seconds spent on the recipe so far (shared observation and teacher not included)")
    ax.set_ylabel(f"{fitness} on the search data")
    ax.set_title(
        "auto: every recipe's plan at each rung (marker size: share of its search budget)", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return save_figure(fig, path)
