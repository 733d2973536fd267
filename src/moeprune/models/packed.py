"""Routed experts stored one by one: novices (a constant vector) and per-expert neuron counts.

A stock config describes rectangular expert tensors ``[E, ...I...]``. Novices (no weights, one
d-vector each) and experts of different widths are not rectangular, so a layer holding them is
converted to this *packed* form: each weight-holding expert's tensors, in the family's native
per-expert layout and cut to its kept neurons, flattened and concatenated into one 1-D tensor
per native name (``packed_gate_up_proj``, ...). Memory really shrinks, and each expert's view is
a contiguous tensor of the native shape, so the adapter's own per-expert code computes it.

The router is untouched. The block computes through moeprune's routed computation (routed.py)
by swapping the class of the experts module (Llama-4: also the block's) for a subclass whose
forward does that. Unlike an instance-level forward, a class swap survives ``copy.deepcopy`` and
keeps every parameter name, so the packed model saves and reloads like any module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace

import torch
from torch import nn

from moeprune.errors import MoePruneError
from moeprune.models.adapter import EXPERT_IDS_ATTR, ExpertCost, MoELayer, own_gate, top_k_of
from moeprune.models.lowrank import LowRankNovice
from moeprune.models.routed import RoutedOptions, input_weighted_block_forward, routed_compute
from moeprune.models.spec import FUSED, INTERLEAVED, TRANSPOSED, UNGATED, FamilySpec

# Per-expert native tensors of each layout: name -> (axis of the neurons in one expert's tensor,
# values per neuron), or None for a tensor without a neuron axis (gpt_oss's down bias).
NEURON_AXES: dict[str, dict[str, tuple[int, int] | None]] = {
    FUSED: {"gate_up_proj": (0, 2), "down_proj": (1, 1)},
    TRANSPOSED: {"gate_up_proj": (1, 2), "down_proj": (0, 1)},
    UNGATED: {"up_proj": (0, 1), "down_proj": (1, 1)},
    INTERLEAVED: {
        "gate_up_proj": (1, 2),
        "gate_up_proj_bias": (0, 2),
        "down_proj": (0, 1),
        "down_proj_bias": None,
    },
}
PACKED_PREFIX = "packed_"
NOVICE_PARAM = "moeprune_novice"  # [n_novice, d], the novices' mean outputs mu_i (low rank: c_i)
# low-rank novices (models/lowrank.py): [n_novice, d, R] factors, the novice adds c + U (V^T h)
NOVICE_U, NOVICE_V = "moeprune_novice_u", "moeprune_novice_v"


def neuron_index(layout: str, name: str, keep: torch.Tensor, width: int) -> torch.Tensor:
    """Indices along `name`'s neuron axis that hold neurons `keep` (gate and up values together)."""
    axis = NEURON_AXES[layout][name]
    if axis is None or axis[1] == 1:
        return keep
    if layout == INTERLEAVED:  # gate and up columns alternate
        return torch.stack((2 * keep, 2 * keep + 1), dim=1).flatten()
    return torch.cat((keep, keep + width))  # gate block, then up block


def slice_neurons(
    layout: str, name: str, tensor: torch.Tensor, keep: torch.Tensor, width: int
) -> torch.Tensor:
    """One expert's native tensor cut to neurons `keep` (unchanged if it has no neuron axis)."""
    axis = NEURON_AXES[layout][name]
    if axis is None:
        return tensor
    return tensor.index_select(axis[0], neuron_index(layout, name, keep.to(tensor.device), width))


def expert_tensor_names(layer: MoELayer) -> list[str]:
    return [n for n in NEURON_AXES[layer.spec.layout] if hasattr(layer.experts, n)]


def _unit_shapes(layer: MoELayer) -> dict[str, tuple[list[int], int | None]]:
    """name -> (one expert's shape at width 1, neuron axis) of a native (unpacked) layer."""
    width = layer.intermediate_size
    out = {}
    for name in expert_tensor_names(layer):
        shape = list(getattr(layer.experts, name).shape[1:])
        axis = NEURON_AXES[layer.spec.layout][name]
        if axis is not None:
            shape[axis[0]] = axis[1]
            if getattr(layer.experts, name).shape[1 + axis[0]] != axis[1] * width:
                raise MoePruneError(
                    f"layer {layer.index}: {name} does not have {axis[1]} x {width} neuron rows"
                )
        out[name] = (shape, None if axis is None else axis[0])
    return out


def _shape_at(unit: tuple[list[int], int | None], width: int) -> list[int]:
    shape, axis = unit
    return [d * width if i == axis else d for i, d in enumerate(shape)]


def cost_of_shapes(units: Mapping[str, tuple[list[int], int | None]]) -> ExpertCost:
    per_neuron = sum(math.prod(s) for s, axis in units.values() if axis is not None)
    per_expert = sum(math.prod(s) for s, axis in units.values() if axis is None)
    return ExpertCost(per_neuron, per_expert)


# ----------------------------------------------------------------------------- the packed module
class PackedExperts:
    """Mixin placed before a family's experts class; see the module docstring."""

    moeprune_packed = True

    def routed_view(self, block: nn.Module | None = None) -> PackedView:
        """What moeprune's routed computation needs of this layer (models/routed.py asks)."""
        return packed_view(self, block)

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, **_: object):
        view = packed_view(self)
        return routed_compute(view, hidden_states, top_k_index, top_k_weights, view.options())


class PackedInputWeightedBlock:
    """Mixin for Llama-4's block: it runs every expert on every token, the packed one only the routed."""

    def forward(self, hidden_states):
        view = packed_view(self.experts, block=self)
        return input_weighted_block_forward(view, view.options())(hidden_states)


@cache
def _subclass(mixin: type, cls: type) -> type:
    return type(f"Packed{cls.__name__}", (mixin, cls), {"__module__": __name__})


def is_packed(layer: MoELayer) -> bool:
    return bool(getattr(layer.experts, "moeprune_packed", False))


@dataclass
class PackedView:
    """What routed_compute needs of a layer, for a packed experts module."""

    experts: nn.Module
    spec: FamilySpec
    index: int
    block: nn.Module | None = None

    @property
    def num_experts(self) -> int:  # router outputs, novices included
        return len(self.experts.moeprune_slots)

    @property
    def top_k(self) -> int:
        return top_k_of(self.index, getattr(self.block, self.spec.router_attr), self.block, self.experts)

    def options(self) -> RoutedOptions:
        experts = self.experts
        u, v = getattr(experts, NOVICE_U, None), getattr(experts, NOVICE_V, None)
        novices: dict[int, torch.Tensor | LowRankNovice] = {}
        for p, s in enumerate(experts.moeprune_slots):
            if s < 0:
                c = experts.moeprune_novice[-1 - s]
                novices[p] = c if u is None or v is None else LowRankNovice(c, u[-1 - s], v[-1 - s])
        return RoutedOptions(novices={self.index: novices})

    def expert_forward(
        self, expert: int, x: torch.Tensor, return_intermediate: bool = False, neuron_mask=None
    ):
        """The adapter's own per-expert computation on a one-expert view of the packed tensors."""
        tensors = expert_tensors(self.experts, self.experts.moeprune_slots[expert])
        one = SimpleNamespace(
            **{name: t.unsqueeze(0) for name, t in tensors.items()},
            act_fn=getattr(self.experts, "act_fn", None),
            _apply_gate=getattr(self.experts, "_apply_gate", None),
            moeprune_own_gate=own_gate(self.experts),
        )
        layer = MoELayer(self.index, SimpleNamespace(experts=one), self.spec)  # type: ignore[arg-type]
        return layer.expert_forward(0, x, return_intermediate=return_intermediate, neuron_mask=neuron_mask)


def packed_view(experts: nn.Module, block: nn.Module | None = None) -> PackedView:
    return PackedView(experts, experts.moeprune_spec, experts.moeprune_layer, block)


def _offsets(units: Mapping[str, tuple[list[int], int | None]], widths: list[int]) -> dict[str, list[int]]:
    """Start of each weight-holder's slice in every packed tensor (one extra end entry)."""
    out = {}
    for name, unit in units.items():
        ends = [0]
        for w in widths:
            ends.append(ends[-1] + math.prod(_shape_at(unit, w)))
        out[name] = ends
    return out


def expert_tensors(experts: nn.Module, slot: int) -> dict[str, torch.Tensor]:
    """Weight-holding expert `slot`'s tensors, as contiguous views of the native per-expert shape."""
    width = experts.moeprune_widths[slot]
    out = {}
    for name, unit in experts.moeprune_units.items():
        start = experts.moeprune_offsets[name][slot]
        shape = _shape_at(unit, width)
        flat = getattr(experts, PACKED_PREFIX + name)
        out[name] = flat[start : start + math.prod(shape)].view(shape)
    return out


# ----------------------------------------------------------------------------- packing
def pack_layer(
    layer: MoELayer,
    novices: Mapping[int, torch.Tensor | LowRankNovice],
    keep: Mapping[int, torch.Tensor],
) -> None:
    """Convert one native MoE layer in place: positions in `novices` become constant vectors or
    low-rank novices (their weights are deleted), experts in `keep` keep only those neuron
    indices (ascending). Low-rank novices of one layer share one rank (lower ones are padded)."""
    if is_packed(layer):
        raise MoePruneError(f"layer {layer.index} is already packed (novices or per-expert widths applied)")
    experts, n, width, hidden = layer.experts, layer.num_experts, layer.intermediate_size, layer.hidden_size
    bad = sorted(p for p in [*novices, *keep] if not 0 <= p < n)
    if bad:
        raise MoePruneError(f"layer {layer.index}: expert positions {bad} out of range (it has {n} experts)")
    units = _unit_shapes(layer)
    setattr(layer.block, EXPERT_IDS_ATTR, layer.expert_ids)  # the default reads the native tensors
    holders = [p for p in range(n) if p not in novices]
    widths = [int(len(keep[p])) if p in keep else width for p in holders]
    slots, novice_rows = [], []
    for p in range(n):
        if p in novices:
            slots.append(-1 - len(novice_rows))
            novice_rows.append(novices[p])
        else:
            slots.append(holders.index(p))
    for name in units:
        param = getattr(experts, name)
        parts = [
            slice_neurons(layer.spec.layout, name, param.detach()[p], keep[p], width).reshape(-1)
            if p in keep
            else param.detach()[p].reshape(-1)
            for p in holders
        ]
        packed = torch.cat(parts) if parts else param.detach().new_zeros(0)
        delattr(experts, name)
        experts.register_parameter(
            PACKED_PREFIX + name, nn.Parameter(packed.clone(), requires_grad=param.requires_grad)
        )
    if novice_rows:
        ref = getattr(experts, PACKED_PREFIX + next(iter(units)))
        _store_novices(experts, novice_rows, ref)
    experts.moeprune_units = units
    experts.moeprune_widths = widths
    experts.moeprune_hidden = hidden
    experts.moeprune_offsets = _offsets(units, widths)
    experts.moeprune_slots = slots
    experts.moeprune_model_type = layer.spec.model_type
    experts.moeprune_spec = layer.spec
    experts.moeprune_layer = layer.index
    experts.__class__ = _subclass(PackedExperts, type(experts))
    if layer.spec.weight_on_input:
        layer.block.__class__ = _subclass(PackedInputWeightedBlock, type(layer.block))


def _store_novices(experts: nn.Module, rows: list, ref: torch.Tensor) -> None:
    """The novices' constants [n, d] and, for low-rank ones, their factors [n, d, R]."""
    lowrank = [r for r in rows if isinstance(r, LowRankNovice)]
    if lowrank and len(lowrank) != len(rows):
        raise MoePruneError("a layer's novices are all constant or all low-rank")
    rank = max((r.rank for r in lowrank), default=0)
    lowrank = [r.padded(rank) for r in lowrank]

    def stacked(values: list[torch.Tensor]) -> nn.Parameter:
        data = torch.stack([v.detach().to(device=ref.device, dtype=ref.dtype) for v in values])
        return nn.Parameter(data, requires_grad=False)

    experts.register_parameter(NOVICE_PARAM, stacked([r.constant if lowrank else r for r in rows]))
    if lowrank:
        experts.register_parameter(NOVICE_U, stacked([r.u for r in lowrank]))
        experts.register_parameter(NOVICE_V, stacked([r.v for r in lowrank]))


def novice_rank(layer: MoELayer) -> int:
    """The rank of a packed layer's novices (0: constant novices, or none)."""
    u = getattr(layer.experts, NOVICE_U, None) if is_packed(layer) else None
    return int(u.shape[2]) if u is not None else 0


def packed_structure(layer: MoELayer) -> dict:
    """JSON-ready description (router positions): novices and every weight-holder's width
    (and the novices' rank when they are low-rank)."""
    experts = layer.experts
    slots = experts.moeprune_slots
    out = {
        "novice": [p for p, s in enumerate(slots) if s < 0],
        "widths": {str(p): experts.moeprune_widths[s] for p, s in enumerate(slots) if s >= 0},
    }
    if novice_rank(layer):
        out["novice_rank"] = novice_rank(layer)
    return out


def pack_like(layer: MoELayer, structure: Mapping) -> None:
    """Rebuild a packed layer's shapes from `packed_structure` (values are loaded afterwards)."""
    hidden, rank = layer.hidden_size, int(structure.get("novice_rank", 0) or 0)

    def empty() -> torch.Tensor | LowRankNovice:
        if not rank:
            return torch.zeros(hidden)
        return LowRankNovice(torch.zeros(hidden), torch.zeros(hidden, rank), torch.zeros(hidden, rank))

    novices = {int(p): empty() for p in structure["novice"]}
    keep = {int(p): torch.arange(int(w)) for p, w in structure["widths"].items()}
    pack_layer(layer, novices, keep)


def layer_widths(layer: MoELayer) -> list[int | None]:
    """Per router position: the expert's neuron count, or None for a novice."""
    if not is_packed(layer):
        return [layer.intermediate_size] * layer.num_experts
    experts = layer.experts
    return [experts.moeprune_widths[s] if s >= 0 else None for s in experts.moeprune_slots]


def layer_hidden(layer: MoELayer) -> int:
    return int(layer.experts.moeprune_hidden) if is_packed(layer) else layer.hidden_size


def layer_cost(layer: MoELayer) -> ExpertCost:
    units = layer.experts.moeprune_units if is_packed(layer) else _unit_shapes(layer)
    return cost_of_shapes(units)


def router_count(layer: MoELayer) -> int:
    """Experts the router chooses among (novices included)."""
    return len(layer.experts.moeprune_slots) if is_packed(layer) else layer.num_experts
