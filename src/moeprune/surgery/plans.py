"""Apply any plan (drops, novices, neuron counts) virtually or physically, from one resolution.

A plan names original expert ids and neuron counts; what it means for this model (which
positions, which mu vectors, which neurons) is resolved once from the calibration statistics,
before any surgery. The virtual form slices the router for drops and swaps in moeprune's routed
computation for novices and neuron masks, without copying weights; the physical form deletes
weights. Both give the same logits (tested per family).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.lowrank import LowRankNovice
from moeprune.models.packed import pack_layer
from moeprune.models.reshape import drop_experts, mask_experts
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.plan import Plan
from moeprune.surgery.drop import zero_novices, zero_vectors
from moeprune.surgery.lowrank import Fits, plan_rank
from moeprune.surgery.merge import resolve_merge, swapped_weights, write_weights
from moeprune.surgery.merging import Tensors
from moeprune.surgery.neurons import (
    check_importance,
    check_neuron_prunable,
    kept_neurons,
    neuron_masks,
    shrink_uniform,
    stock_width_expressible,
    uniform_width,
)
from moeprune.surgery.novice import StatsInput, layer_stats, mean_outputs, require_stats

V = TypeVar("V")


@dataclass
class ResolvedPlan:
    """A plan made concrete for one model, keyed by decoder layer and original expert id."""

    dropped: dict[int, list[int]] = field(default_factory=dict)
    # id -> mu (model dtype), or the fitted low-rank novice of a rank-R plan
    novices: dict[int, dict[int, torch.Tensor | LowRankNovice]] = field(default_factory=dict)
    keep: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # id -> kept neuron ids
    merged: dict[int, dict[int, Tensors]] = field(default_factory=dict)  # centroid id -> merged tensors


def positions(layer: MoELayer, ids: Sequence[int]) -> list[int]:
    """Where original expert ids sit in the layer's current storage."""
    where = {orig: pos for pos, orig in enumerate(layer.expert_ids)}
    missing = [e for e in ids if e not in where]
    if missing:
        raise MoePruneError(f"layer {layer.index}: the plan names experts {missing} this model no longer has")
    return [where[e] for e in ids]


def _by_position(layer: MoELayer, by_id: Mapping[int, V]) -> dict[int, V]:
    return dict(zip(positions(layer, list(by_id)), by_id.values()))


def resolve_plan(
    moe: MoEModel, plan: Plan, stats: StatsInput | None = None, fits: Fits | None = None
) -> ResolvedPlan:
    """Positions, mu vectors and kept neurons the plan implies for `moe` (not yet modified).
    A plan of low-rank novices takes their fits (surgery/lowrank.py `fit_novices`)."""
    if plan.model_type != moe.model_type:
        raise MoePruneError(f"the plan is for {plan.model_type!r} but the model is {moe.model_type!r}")
    if plan_rank(plan) and fits is None:
        raise MoePruneError(
            f"the plan's novices have rank {plan_rank(plan)}: fit them first (surgery/lowrank.py fit_novices)"
        )
    zero = zero_novices(plan)  # a `--reroute none` drop: its novices are empty picks, no statistics
    needs_novices = not zero and any(lp.novice for lp in plan.layers)
    needs_neurons = any(lp.neurons for lp in plan.layers)
    domains = []
    if needs_novices or needs_neurons:
        what = "novice surgery (mean outputs)" if needs_novices else "neuron surgery (neuron importance)"
        domains = require_stats(stats, what)
    if needs_neurons:
        check_neuron_prunable(moe)
    kind = check_importance(plan.extra.get("neuron_importance", "projection"))
    out = ResolvedPlan(merged=resolve_merge(moe, plan, stats))
    for lp in plan.layers:
        layer = moe.layer(lp.layer)
        out.dropped[lp.layer] = list(lp.dropped)
        if not (lp.novice or lp.neurons):
            continue
        novice_pos = positions(layer, lp.novice)
        if zero:
            out.novices[lp.layer] = dict(zip(lp.novice, zero_vectors(layer, novice_pos).values()))
            if not lp.neurons:
                continue
        s = layer_stats(domains, layer)
        if not zero:
            novices: dict[int, torch.Tensor | LowRankNovice] = dict(
                zip(lp.novice, mean_outputs(layer, s, novice_pos).values())
            )
            if fits is not None:
                novices.update({e: fits[lp.layer][e] for e in lp.novice})
            out.novices[lp.layer] = novices
        counts = _by_position(layer, lp.neurons)
        kept = kept_neurons(layer, s, counts, kind)
        ids = layer.expert_ids
        out.keep[lp.layer] = {ids[p]: v for p, v in kept.items()}
    return out


@contextmanager
def virtual_plan(
    moe: MoEModel, plan: Plan, stats: StatsInput | None = None, fits: Fits | None = None
) -> Iterator[ResolvedPlan]:
    """Evaluate `plan` on the unchanged model: router slicing, novices, neuron masks, merged
    centroid rows swapped in (and back)."""
    resolved = resolve_plan(moe, plan, stats, fits)
    with ExitStack() as stack:
        merged = {i: _by_position(moe.layer(i), v) for i, v in resolved.merged.items() if v}
        stack.enter_context(swapped_weights(moe, merged))
        stack.enter_context(mask_experts(moe, _positions_of(moe, resolved.dropped)))
        novices = {i: _by_position(moe.layer(i), v) for i, v in resolved.novices.items() if v}
        masks = {
            i: neuron_masks(moe.layer(i), _by_position(moe.layer(i), v))
            for i, v in resolved.keep.items()
            if v
        }
        if novices or masks:
            stack.enter_context(override_routed(moe, RoutedOptions(novices=novices, neuron_masks=masks)))
        yield resolved


def apply_plan_physical(
    moe: MoEModel, plan: Plan, stats: StatsInput | None = None, fits: Fits | None = None
) -> dict[str, object]:
    """Physical surgery of any plan; returns what was done (for the report).

    Merged centroid rows are written first (from the unchanged members), then drops, then novices
    and neurons: a model where every expert keeps the same neuron
    count and nothing else is irregular stays rectangular (stock), anything else is packed.
    """
    resolved = resolve_plan(moe, plan, stats, fits)
    write_weights(moe, {i: _by_position(moe.layer(i), v) for i, v in resolved.merged.items() if v})
    drop_experts(moe, _positions_of(moe, resolved.dropped))
    keep = {i: _by_position(moe.layer(i), v) for i, v in resolved.keep.items() if v}
    novices = {i: _by_position(moe.layer(i), v) for i, v in resolved.novices.items() if v}
    width = uniform_width(moe, keep) if keep and not novices else None
    if width is not None and stock_width_expressible(moe, width):
        shrink_uniform(moe, keep)
        return {"form": "rectangular", "intermediate_size": width}
    touched = sorted(set(keep) | set(novices))
    for index in touched:
        pack_layer(moe.layer(index), novices.get(index, {}), keep.get(index, {}))
    return {"form": "packed" if touched else "rectangular", "packed_layers": touched}


def _positions_of(moe: MoEModel, by_layer: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    return {i: positions(moe.layer(i), ids) for i, ids in by_layer.items() if ids}
