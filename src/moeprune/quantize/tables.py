"""The bytes of a result whose MoE layers keep experts at chosen widths and schemes: pure arithmetic
on the byte tables of surgery/sizes.py (`WeightBytes` per scheme), shared by the per-layer precision
choice (quantize/choice.py, quantize/keeps.py) and the searches that price every candidate with it
(quantize/mixed_space.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moeprune.surgery.genes import LayerKeep  # what a method says each layer keeps (Method.planned_keeps)
from moeprune.surgery.sizes import WeightBytes


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes of a per-layer choice: `fixed` outside the routed experts (base scheme), and per
    layer and scheme the kept experts' bytes."""

    fixed: int
    layers: tuple[dict[str, int], ...]

    def total(self, choice: Sequence[str]) -> int:
        return self.fixed + sum(layer[s] for layer, s in zip(self.layers, choice))


def kept_bytes(
    per: dict[str, WeightBytes], keeps: Sequence[LayerKeep], novice_rank: int = 0
) -> PrecisionBytes:
    """The bytes per (layer, scheme) when each layer keeps `keeps[l]`, from one `WeightBytes` per
    scheme (the first the base outside the routed experts; novices unquantized, in the fixed part:
    llm-compressor quantizes Linear modules only; the stock form's zero-padded shared expert priced
    as surgery/neurons.py writes it)."""
    schemes = list(per)
    base = per[schemes[0]]
    fixed = base.total
    for lay, keep in zip(base.layers, keeps):
        fixed -= lay.experts * lay.expert() + keep.removed * lay.router_row
        fixed += keep.novices * lay.novice * (1 + 2 * novice_rank)
    one = {w for keep in keeps for w in keep.widths}
    if len(one) == 1 and not any(k.novices or k.removed for k in keeps):  # the stock form's padding
        k = one.pop()
        for lay in base.layers:
            if lay.shared_width and k < lay.width:
                fixed += lay.shared_per_neuron * (k * math.ceil(lay.shared_width / k) - lay.shared_width)
    layers = tuple(
        {s: sum(per[s].layers[i].expert(w) for w in keep.widths) for s in schemes}
        for i, keep in enumerate(keeps)
    )
    return PrecisionBytes(fixed, layers)


__all__ = ["LayerKeep", "PrecisionBytes", "kept_bytes"]
