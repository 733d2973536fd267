"""What the parts of a model weigh in the format a result is saved in: the vocabulary of size
planning (`--target-size`) that every method's byte hooks speak (surgery/target_size.py).

Made from a checkpoint's headers by moeprune.shards.weight_bytes; read by each method's
`planned_bytes` and `target_steps` hooks (surgery/registry.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerBytes:
    """What the parts of one MoE layer weigh in the output's format."""

    experts: int
    width: int  # neurons of each routed expert
    per_neuron: int  # bytes one neuron adds to one routed expert (0: not linear, e.g. fp8 blocks)
    per_expert: int  # bytes of one routed expert besides its neurons (all of it when per_neuron is 0)
    router_row: int  # bytes of one expert's router rows and per-expert routing tensors
    novice: int = 0  # bytes of a novice's mean output vector
    shared_width: int = 0  # neurons of a shared expert whose width derives from the routed width
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
