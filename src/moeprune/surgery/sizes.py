"""What the parts of a model weigh in the format a result is saved in, and the one function that
prices what each MoE layer keeps (`kept_bytes`): size planning (`--target-size`,
surgery/target_size.py), the quantized prediction and the per-layer precision tables
(quantize/keeps.py, quantize/choice.py) all price a method's `planned_keeps` (or a removal's
keeps) with it, so one formula, its shared-expert padding included, says what a plan weighs.

Made from a checkpoint's headers by moeprune.shards.weight_bytes."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.widths import STOCK_MULTIPLE


@dataclass(frozen=True)
class LayerBytes:
    """What the parts of one MoE layer weigh in the output's format."""

    experts: int
    width: int  # neurons of each routed expert
    per_neuron: int  # bytes one neuron adds to one routed expert (0: not linear, e.g. fp8 blocks)
    per_expert: int  # bytes of one routed expert besides its neurons (all of it when per_neuron is 0)
    router_row: int  # bytes of one expert's router rows and per-expert routing tensors
    novice: int = 0  # bytes of a novice's mean output vector
    # neurons of a shared expert whose width derives from the routed width, in a family whose
    # stock form can pad it (surgery/neurons.py `stock_width_expressible`; 0 elsewhere)
    shared_width: int = 0
    shared_per_neuron: int = 0  # bytes per neuron of that shared expert (it is zero-padded: neurons.py)

    def expert(self, width: int | None = None) -> int:
        return self.per_neuron * (self.width if width is None else width) + self.per_expert


@dataclass(frozen=True)
class SavedTensors:
    """The input's tensors as the result saves them (name, safetensors dtype, shape) and the part of
    `WeightBytes.total` that bounds their headers: a byte model that renames tensors (quantization,
    quantize/pricing.py) counts the result's headers afresh from these instead of that bound."""

    header: int  # the bytes of `total` that are the headers' bound
    files: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class WeightBytes:
    """The unpruned model's weights in the output's format, and what each MoE layer's parts weigh."""

    format: str  # "bfloat16", "float8_e4m3fn (fp8, 128x128 blocks)", ...
    total: int  # bytes of every tensor the result is saved with, before pruning
    layers: tuple[LayerBytes, ...]
    linear_neurons: bool = True  # False: an expert's bytes are not linear in its width (fp8 blocks)
    saved: SavedTensors | None = None  # the tensors behind `total` (None: a hand-made size)


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes of a per-layer choice: `fixed` outside the routed experts (base scheme), and per
    layer and scheme the kept experts' bytes."""

    fixed: int
    layers: tuple[dict[str, int], ...]

    def total(self, choice: Sequence[str]) -> int:
        return self.fixed + sum(layer[s] for layer, s in zip(self.layers, choice))


def _padding(layers: Sequence[LayerBytes], keeps: Sequence[LayerKeep]) -> int:
    """Bytes of the zero neurons a derived shared expert gains when the result is saved in the stock
    form (surgery/plans.py `apply_plan_physical`): every expert that keeps weights at one width
    K below the one full width, no novice, K on grouped_mm's stride (surgery/neurons.py
    `stock_width_expressible`); the shared expert is padded to K * ceil(W / K) neurons."""
    widths = {w for keep in keeps for w in keep.widths}
    full = {lay.width for lay in layers}
    if len(widths) != 1 or len(full) != 1 or any(keep.novices for keep in keeps):
        return 0
    k, width = widths.pop(), full.pop()
    if k >= width or k % STOCK_MULTIPLE and not width % STOCK_MULTIPLE:
        return 0
    return sum(
        lay.shared_per_neuron * (k * math.ceil(lay.shared_width / k) - lay.shared_width)
        for lay in layers
        if lay.shared_width
    )


def kept_bytes(
    per: dict[str, WeightBytes], keeps: Sequence[LayerKeep], novice_rank: int = 0
) -> PrecisionBytes:
    """The bytes per (layer, scheme) when each MoE layer keeps `keeps[l]`, from one `WeightBytes`
    per scheme (the first the base outside the routed experts): every expert that keeps weights
    at its width w weighs `per_neuron * w + per_expert` in the layer's scheme; a novice its
    vector (rank R: d + 2dR values) in the fixed part, unquantized (llm-compressor quantizes Linear
    modules only); a removed expert takes its router rows with it; a stock form's padded shared
    expert is in the fixed part (`_padding`)."""
    schemes = list(per)
    base = per[schemes[0]]
    fixed = base.total + _padding(base.layers, keeps)
    for lay, keep in zip(base.layers, keeps):
        fixed -= lay.experts * lay.expert() + keep.removed * lay.router_row
        fixed += keep.novices * lay.novice * (1 + 2 * novice_rank)
    counts = [Counter(keep.widths) for keep in keeps]
    layers = tuple(
        {s: sum(n * per[s].layers[i].expert(w) for w, n in count.items()) for s in schemes}
        for i, count in enumerate(counts)
    )
    return PrecisionBytes(fixed, layers)


def keeps_bytes(size: WeightBytes, keeps: Sequence[LayerKeep], novice_rank: int = 0) -> int:
    """Bytes of `size` (one format everywhere) when each MoE layer keeps `keeps[l]` (`kept_bytes`)."""
    return kept_bytes({size.format: size}, keeps, novice_rank).total([size.format] * len(keeps))


def removal_keeps(size: WeightBytes, removed: Sequence[int], novices: bool = False) -> list[LayerKeep]:
    """What each MoE layer keeps when `removed[l]` whole experts go: dropped with their router rows,
    or (`novices`) replaced by novices that keep theirs; the rest whole."""
    return [
        LayerKeep((lay.width,) * (lay.experts - r), r if novices else 0, 0 if novices else r)
        for lay, r in zip(size.layers, removed)
    ]


GRID_STEP = 1e-4  # the grid a continuous sparsity (TENP, mixed) is solved on


def grid_steps(at: Callable[[float], int | None], total: int, target: int) -> list[tuple[float, int]]:
    """(sparsity, planned bytes) of the smallest grid sparsity whose plan fits `target`, and the grid
    point below it, by bisection (the planned size falls with the sparsity); [] when not even the
    highest plannable one fits. `at(sparsity)`: the planned bytes, None where no plan exists."""
    grid = round(1 / GRID_STEP)

    def bytes_at(i: int) -> int | None:
        return at(i / grid)

    top = grid - 1
    if bytes_at(top) is None:  # plans stop being possible above some sparsity: find the last one
        feasible, infeasible = 0, top
        while infeasible - feasible > 1:
            mid = (feasible + infeasible) // 2
            feasible, infeasible = (mid, infeasible) if bytes_at(mid) is not None else (feasible, mid)
        top = feasible
    high = bytes_at(top) if top else None
    if high is None or high > target:
        return [(top / grid, high)] if high is not None else []
    low_i, high_i = 0, top  # bytes_at(low_i) does not fit (0: the unpruned model), bytes_at(high_i) does
    while high_i - low_i > 1:
        mid = (low_i + high_i) // 2
        value = bytes_at(mid)
        if value is not None and value <= target:
            high_i = mid
        else:
            low_i = mid
    below = [(low_i / grid, bytes_at(low_i) or total)] if low_i else []
    return [*below, (high_i / grid, bytes_at(high_i) or 0)]
