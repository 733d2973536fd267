"""TENP (Trapezoidal Expert Neuron Pruning): per layer the highest-scored experts stay whole, their
number growing with depth (allocate/trapezoid.py does that arithmetic), and the others keep one
global share of their neurons, ranked by neuron importance, so the routed-parameter budget is met
exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from moeprune.allocate.trapezoid import DEFAULT_SLOPE, TrapezoidLayer, trapezoid_allocation
from moeprune.config import NEURON_STATS, PruneConfig, setting
from moeprune.criteria import LayerScores, importance_scores
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.models.packed import layer_cost
from moeprune.plan import LayerPlan, Plan
from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.neurons import (
    NarrowOptions,
    check_importance,
    check_neuron_prunable,
    check_neuron_stats,
)
from moeprune.surgery.novice import StatsInput
from moeprune.surgery.registry import METHODS, PARAMETERS, Method, PlanRequest, options_as
from moeprune.surgery.sizes import GRID_STEP, WeightBytes, grid_steps
from moeprune.surgery.target_size import planned_bytes
from moeprune.surgery.widths import width_step


@dataclass(frozen=True)
class TenpOptions(NarrowOptions):
    """TENP's own settings: how many whole experts, how they grow with depth, how neurons rank."""

    important_fraction: float | None = setting(
        None, "tenp: fraction of routed parameters kept as whole experts [default: half the kept budget]."
    )
    slope: float = setting(
        DEFAULT_SLOPE, "tenp: how fast the number of whole experts grows with depth (0 = flat, 1 = steepest)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.slope, bool)
            or not isinstance(self.slope, int | float)
            or not 0 <= self.slope <= 1
        ):
            raise MoePruneError(
                f"the trapezoid slope must be in [0, 1], got {self.slope!r}", options=("slope",)
            )
        fraction = self.important_fraction
        if fraction is not None and (
            isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1
        ):
            raise MoePruneError(
                f"the important fraction must be in [0, 1), got {fraction!r}", options=("important_fraction",)
            )


def _options(config: PruneConfig) -> TenpOptions:
    return options_as(config, TenpOptions)


def tenp_steps(moe: MoEModel, sparsity: float, options: TenpOptions) -> list[int]:
    """Each MoE layer's width step: `--width-multiple` when given (a budget it cannot meet is
    refused), else the serving alignment (surgery/widths.py) where the trapezoid leaves the
    narrowed experts at least one block, else TENP's own 1 neuron, as the neurons method falls
    back where its default step leaves too little."""
    steps = [width_step(m.intermediate_size, options.width_multiple) for m in moe.layers]
    if options.width_multiple is None and any(s > 1 for s in steps):
        try:
            _trapezoid(moe, sparsity, options, steps)
        except MoePruneError:  # less than one block of the default step left: TENP's own floor
            return [1] * len(steps)
    return steps


def _trapezoid(moe: MoEModel, sparsity: float, options: TenpOptions, steps: list[int]):
    layers = [TrapezoidLayer(m.num_experts, m.intermediate_size, layer_cost(m)) for m in moe.layers]
    return trapezoid_allocation(layers, 1 - sparsity, options.important_fraction, options.slope, steps)


def tenp_allocation(moe: MoEModel, sparsity: float, options: TenpOptions):
    """The trapezoid of `moe` at `sparsity`, the narrowed widths on each layer's width step
    (`tenp_steps`)."""
    return _trapezoid(moe, sparsity, options, tenp_steps(moe, sparsity, options))


def tenp_plan(
    moe: MoEModel,
    stats: StatsInput | None,
    scores: Sequence[LayerScores],
    sparsity: float,
    options: TenpOptions | None = None,
    *,
    criterion: str = "tenp",
    data_fingerprint: str = "",
) -> Plan:
    """TENP: per layer the highest-scored experts stay whole, the others are neuron-pruned.

    `sparsity` is the fraction of routed-expert parameters removed; `scores` rank experts within
    each layer (the tenp criterion; several calibration domains use its per-domain normalisation).
    `options` holds TENP's own settings.
    """
    options = options or TenpOptions()
    important_fraction, slope, importance = (
        options.important_fraction,
        options.slope,
        options.neuron_importance,
    )
    check_neuron_prunable(moe)
    check_neuron_stats(moe, stats, check_importance(importance))
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float):
        raise MoePruneError(f"sparsity must be a number, got {sparsity!r}")
    alloc = tenp_allocation(moe, sparsity, options)
    by_layer = {s.layer: s for s in scores}
    plans = []
    for m, count, widths in zip(moe.layers, alloc.important, alloc.widths):
        if m.index not in by_layer or len(by_layer[m.index].scores) != m.num_experts:
            raise MoePruneError(f"no {criterion} scores for the {m.num_experts} experts of layer {m.index}")
        rank = np.argsort(-np.asarray(by_layer[m.index].scores, dtype=np.float64), kind="stable").tolist()
        ids = m.expert_ids
        # super experts (moe.protected) rank first, so they are among the layer's whole experts
        super_ids = set(moe.protected.get(m.index, ()))
        rank = [p for p in rank if ids[p] in super_ids] + [p for p in rank if ids[p] not in super_ids]
        neurons = dict(sorted((ids[p], w) for p, w in zip(rank[count:], widths) if w < m.intermediate_size))
        plans.append(
            LayerPlan(
                layer=m.index, num_experts=m.num_experts, top_k=m.top_k, kept=sorted(ids), neurons=neurons
            )
        )
    plan = Plan.create(
        model_type=moe.model_type,
        layers=plans,
        criterion=criterion,
        allocation="trapezoid",
        method="tenp",
        sparsity=sparsity,
        data_fingerprint=data_fingerprint,
        extra={
            "neuron_importance": importance,
            "important_per_layer": alloc.important,
            "neuron_keep_ratio": alloc.neuron_ratio,
            "important_fraction_target": (1 - sparsity) / 2
            if important_fraction is None
            else important_fraction,
            "important_fraction": alloc.important_fraction,
            "slope": slope,
            "width_multiple": dict(
                zip([str(m.index) for m in moe.layers], tenp_steps(moe, sparsity, options))
            ),
            "routed_parameters_target": alloc.target_params,
            "routed_parameters_kept": alloc.kept_params,
            "routed_parameters_total": alloc.total_params,
        },
    )
    plan.validate({m.index: m.intermediate_size for m in moe.layers})
    return plan


TENP_STEP = GRID_STEP  # the grid TENP's continuous sparsity is solved on


def _tenp_solve(
    moe: MoEModel, config: PruneConfig, size: WeightBytes, target: int
) -> list[tuple[float, int]]:
    """TENP: the smallest grid sparsity that fits, by bisection (its size falls with the sparsity),
    and the grid point below it; [] when not even the highest one fits."""
    check_neuron_prunable(moe)

    def at(sparsity: float) -> int | None:
        try:
            return planned_bytes(moe, replace(config, sparsity=sparsity, target_size=None), size)
        except MoePruneError:  # the others would keep less than one neuron
            return None

    return grid_steps(at, size.total, target)


def _tenp_feasible(moe: MoEModel, config: PruneConfig) -> dict:
    """The trapezoid's counts and widths, from the structure and options alone: the scores only
    choose which experts stay whole, so the narrowed widths (`narrowed_neurons`, what a
    quantization group must divide) are known before loading."""
    alloc = tenp_allocation(moe, config.sparsity_value(), _options(config))
    return {
        "whole_experts_per_layer": dict(zip([m.index for m in moe.layers], alloc.important)),
        "neuron_keep_ratio": alloc.neuron_ratio,
        "narrowed_neurons": {
            m.index: sorted({w for w in widths if w < m.intermediate_size})
            for m, widths in zip(moe.layers, alloc.widths)
        },
    }


def _tenp_keeps(meta: MoEModel, config: PruneConfig) -> list[LayerKeep]:
    """The trapezoid's whole experts at full width, the others at their layer's narrowed widths."""
    alloc = tenp_allocation(meta, config.sparsity_value(), _options(config))
    return [
        LayerKeep((m.intermediate_size,) * c + tuple(ws))
        for m, c, ws in zip(meta.layers, alloc.important, alloc.widths)
    ]


@METHODS.register(
    Method(
        "tenp",
        "per layer the highest-scored experts stay whole, more with depth; the rest keep one global "
        "share of their neurons so the routed-parameter budget is met exactly",
        PARAMETERS,
        ("trapezoid",),
        needs=(NEURON_STATS,),
        neurons=True,
        options=TenpOptions,
        feasible=_tenp_feasible,
        target_steps=_tenp_solve,
        planned_keeps=_tenp_keeps,
        super_experts="keep their routing and rank first among each layer's whole experts (kept whole "
        "where the trapezoid keeps that many whole experts in their layer; narrowed otherwise)",
    )
)
def plan_tenp(request: PlanRequest) -> Plan:
    return tenp_plan(
        request.moe,
        request.domains,
        importance_scores(request.criterion, request.scores),
        request.sparsity,
        request.options,
        criterion=request.criterion.name,
        data_fingerprint=request.data_fingerprint,
    )
