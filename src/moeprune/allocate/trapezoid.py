"""TENP's trapezoid allocation: whole important experts growing with depth, the rest neuron-pruned.

With kept fraction rho of the routed-expert parameters and important fraction r_imp (default
rho / 2), layer l keeps c_l whole experts, c_l proportional to n_l * w_l with the depth weight
w_l = 1 + slope * (2 t_l - 1) (t_l from 0 at the first MoE layer to 1 at the last; slope in
[0, 1], so shallow layers get 1 - slope times the mean and deep layers 1 + slope times). The
other experts keep one global neuron ratio q = (rho - r) / (1 - r), r being the important
fraction actually realised after rounding c_l, so the parameter budget is met exactly.

Integer neuron counts: every other expert of layer l gets floor(q I_l) neurons, and the leftover
neurons (the budget rounded to whole neurons) go one each by largest fractional remainder,
earlier layer first on ties, then to the higher-scored expert of the layer. The kept parameters
then differ from rho * T by at most half a neuron row (asserted within one row).

Width multiples (`--width-multiple`, surgery/widths.py): with a step s_l per layer, every other
expert of layer l gets floor(q I_l / s_l) s_l neurons, and the leftover neurons go one block of
s_l each (the full width when less than a block is left to it) by largest fractional remainder
(in blocks), a block given only while at least half of it is still owed: the kept parameters then
differ from rho * T by at most half a block, max(s_l) / 2 neuron rows (asserted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from moeprune.allocate.basic import check_ratio
from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.errors import MoePruneError
from moeprune.models.adapter import ExpertCost

DEFAULT_SLOPE = 0.5
ALLOCATIONS.add(
    Allocator("trapezoid", "TENP: whole experts per layer growing with depth, the others neuron-pruned")
)


@dataclass(frozen=True)
class TrapezoidLayer:
    """One MoE layer as the allocation sees it."""

    experts: int
    width: int  # intermediate neurons of a whole expert
    cost: ExpertCost

    @property
    def expert_params(self) -> int:
        return self.cost.params(self.width)


@dataclass
class TrapezoidAllocation:
    important: list[int]  # whole experts per layer
    widths: list[list[int]]  # per layer, neuron counts of the other experts, largest first
    neuron_ratio: float  # q, the realised keep ratio of the other experts' neurons
    important_fraction: float  # realised share of all routed parameters kept in whole experts
    target_params: float
    kept_params: int
    total_params: int
    notes: list[str] = field(default_factory=list)


def depth_weights(count: int, slope: float) -> list[float]:
    """w_l = 1 + slope (2 t_l - 1), mean 1, non-decreasing with depth."""
    if isinstance(slope, bool) or not isinstance(slope, int | float) or not 0 <= slope <= 1:
        raise MoePruneError(f"trapezoid slope must be in [0, 1], got {slope!r}")
    if count == 1:
        return [1.0]
    return [1 + slope * (2 * pos / (count - 1) - 1) for pos in range(count)]


def _round_counts(targets: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Largest-remainder rounding to round(sum); deeper layer first on ties keeps counts monotone."""
    floors = [min(cap, math.floor(t)) for t, cap in zip(targets, caps)]
    extra = math.floor(sum(targets) + 0.5) - sum(floors)
    order = sorted(range(len(targets)), key=lambda p: (-(targets[p] - floors[p]), -p))
    for pos in order:
        if extra <= 0:
            break
        if floors[pos] < caps[pos]:
            floors[pos] += 1
            extra -= 1
    return floors


def trapezoid_allocation(
    layers: Sequence[TrapezoidLayer],
    keep_fraction: float,
    important_fraction: float | None = None,
    slope: float = DEFAULT_SLOPE,
    steps: Sequence[int] | None = None,
) -> TrapezoidAllocation:
    """Whole experts per layer and neuron counts of the others; see the module docstring."""
    if not layers:
        raise MoePruneError("no MoE layers given")
    rho = check_ratio(keep_fraction, "kept fraction of routed-expert parameters (1 - sparsity)")
    r_imp = rho / 2 if important_fraction is None else important_fraction
    if isinstance(r_imp, bool) or not isinstance(r_imp, int | float) or not 0 <= r_imp < 1:
        raise MoePruneError(f"important fraction must be in [0, 1), got {r_imp!r}")
    if r_imp >= rho and rho < 1:
        raise MoePruneError(
            f"important fraction {r_imp:.4g} must be below the kept fraction {rho:.4g} (1 - sparsity): "
            "the other experts need neurons too"
        )
    per_neuron = {layer.cost.per_neuron for layer in layers}
    if len(per_neuron) != 1:
        raise MoePruneError(f"MoE layers disagree on parameters per neuron ({sorted(per_neuron)})")
    row = per_neuron.pop()
    total = sum(layer.experts * layer.expert_params for layer in layers)
    target = rho * total
    weights = depth_weights(len(layers), slope)
    denom = sum(layer.experts * layer.expert_params * w for layer, w in zip(layers, weights))
    wanted = [
        min(layer.experts, r_imp * total * layer.experts * w / denom) for layer, w in zip(layers, weights)
    ]
    important = _round_counts(wanted, [layer.experts for layer in layers])
    important_params = sum(c * layer.expert_params for c, layer in zip(important, layers))
    others = [(pos, layer) for pos, layer in enumerate(layers) for _ in range(layer.experts - important[pos])]
    steps = list(steps) if steps is not None else [1] * len(layers)
    widths, ratio = _block_counts(layers, important, others, target - important_params, row, steps)
    kept = important_params + sum(layer.cost.params(w) for layer, ws in zip(layers, widths) for w in ws)
    if abs(kept - target) > row * max(1, max(steps) / 2):
        raise AssertionError(f"trapezoid budget missed: kept {kept} vs target {target:.1f} (row {row})")
    return TrapezoidAllocation(
        important=important,
        widths=widths,
        neuron_ratio=ratio,
        important_fraction=important_params / total,
        target_params=target,
        kept_params=kept,
        total_params=total,
    )


def _block_counts(
    layers: Sequence[TrapezoidLayer],
    important: Sequence[int],
    others: Sequence[tuple[int, TrapezoidLayer]],
    budget: float,
    row: int,
    steps: Sequence[int],
) -> tuple[list[list[int]], float]:
    """Widths of the non-important experts: one ratio q of the full width, each width rounded down
    to a multiple of its layer's step (1: single neurons), then the rounding handed out exactly, a
    step at a time, to the experts that lost most to it."""
    widths: list[list[int]] = [[] for _ in layers]
    if not others:
        return widths, 1.0
    full = sum(layer.width for _, layer in others)
    neurons = (budget - sum(layer.cost.per_expert for _, layer in others)) / row
    ratio = min(neurons / full, 1.0)
    step = [steps[pos] for pos, _ in others]
    base = [math.floor(ratio * layer.width / s) * s for (_, layer), s in zip(others, step)]
    if ratio <= 0 or min(base) < 1:
        small = min(step)
        unit = "one neuron" if small == 1 else f"one block of {small} neurons"
        raise MoePruneError(
            f"after the whole important experts, the others would keep a neuron ratio of {ratio:.4g}, less "
            f"than {unit} each; lower the important fraction, the sparsity"
            + (" or the width multiple" if small > 1 else ""),
            options=("important_fraction", "sparsity") + (("width_multiple",) if small > 1 else ()),
        )
    owed = min(neurons, full) - sum(base)
    rank = sorted(
        range(len(others)),
        key=lambda j: (-(ratio * others[j][1].width - base[j]) / step[j], others[j][0], j),
    )
    for j in rank:
        block = min(base[j] + step[j], others[j][1].width) - base[j]
        if block > 0 and owed >= block / 2:
            base[j] += block
            owed -= block
    for (pos, _), count in zip(others, base):
        widths[pos].append(count)
    return [sorted(ws, reverse=True) for ws in widths], ratio
