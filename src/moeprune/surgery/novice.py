"""Novice surgery (MoNE): an expert becomes its mean output vector mu_i; routing is unchanged.

With `novice_rank` R > 0 the novice is the low-rank affine map mu + B (h - hbar) instead
(surgery/lowrank.py fits it after planning; the plan records R in `extra["novice_rank"]`).

The block then adds g_i(t) mu_i whenever the router selects expert i (Llama-4, which weights the
expert input, adds mu_i itself, mu_i being the mean of E_i(g h)). The expert's weights are
deleted and only a d-vector stays.

- Virtual form: ``override_routed(moe, RoutedOptions(novices=...))`` substitutes the constant
  without copying or changing the model (what a search evaluates).
- Physical form: :func:`make_novices` packs the layer (models/packed.py), deleting the weights.

mu_i comes from the observer's fp64 ``LayerStats.mean`` and is cast to the model's dtype. An
expert that no calibration token reached has mu_i = 0 (it then contributes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from moeprune.allocate.basic import plan_removals, uniform_allocation
from moeprune.allocate.limits import expert_allocation, layer_limits
from moeprune.config import CALIBRATION, PruneConfig
from moeprune.criteria import Criterion, LayerScores
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.packed import pack_layer
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.observe.kinds import Statistic
from moeprune.observe.stats import ExpertStats, LayerStats, merged_layer
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.lowrank import RANK_KEY, NoviceOptions
from moeprune.surgery.registry import EXPERTS, METHODS, Method, PlanRequest

StatsInput = ExpertStats | Sequence[ExpertStats]


def require_stats(stats: StatsInput | None, what: str) -> list[ExpertStats]:
    """The calibration statistics as a list of domains; a clear error when there are none."""
    domains = [stats] if isinstance(stats, ExpertStats) else list(stats or [])
    if not domains:
        raise MoePruneError(
            f"{what} needs calibration statistics: give calibration data files", options=("data",)
        )
    return domains


def layer_stats(domains: Sequence[ExpertStats], layer: MoELayer) -> LayerStats:
    """One layer's statistics merged over domains, checked against the model's expert count.

    Rows are the experts in the order the model held them when observed (original ids for an
    unpruned model).
    """
    try:
        stats = domains[0].layer(layer.index) if len(domains) == 1 else merged_layer(domains, layer.index)
    except KeyError:
        raise MoePruneError(f"the calibration statistics have no MoE layer {layer.index}") from None
    if stats.num_experts != layer.num_experts:
        raise MoePruneError(
            f"layer {layer.index}: statistics cover {stats.num_experts} experts but the model has "
            f"{layer.num_experts}; observe the model you prune (before surgery)"
        )
    return stats


def mean_outputs(layer: MoELayer, stats: LayerStats, positions: Sequence[int]) -> dict[int, torch.Tensor]:
    """mu_i of the experts at `positions`, in the model's dtype and device."""
    ref = cast(torch.Tensor, layer.experts.down_proj)
    return {p: stats.need("mean")[p].to(device=ref.device, dtype=ref.dtype) for p in positions}


def make_novices(moe: MoEModel, novices: Mapping[int, Mapping[int, torch.Tensor]]) -> None:
    """Physically replace experts by constants ({decoder layer: {position: mu}})."""
    for layer_index, vectors in novices.items():
        if vectors:
            pack_layer(moe.layer(layer_index), vectors, {})


def novice_plan(
    moe: MoEModel,
    stats: StatsInput | None,
    scores: Sequence[LayerScores],
    sparsity: float,
    *,
    criterion: Criterion,
    allocation: str = "uniform",
    removed: Sequence[int] | None = None,
    data_fingerprint: str = "",
) -> Plan:
    """Turn the `sparsity` fraction of experts into novices, least important first.

    Per-layer counts follow `allocation` (uniform or global), or are given as `removed` (e.g.
    by the evo search). Novices leave routing unchanged, so group-limited routers need no
    group balance.
    """
    require_stats(stats, "novice surgery (experts are replaced by their mean calibration output)")
    layers = moe.layers
    limits = layer_limits(moe, routing_changes=False)
    budget = limits.budget(sparsity)
    if removed is None:
        removed = expert_allocation(moe, criterion, scores, sparsity, allocation, limits)
    positions = plan_removals([s.order for s in scores], removed)
    plan = Plan.from_removals(
        ModelShape.of(moe),
        removals=[[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)],
        criterion=criterion.name,
        allocation=allocation,
        method="novice",
        sparsity=sparsity,
        novices=True,
        data_fingerprint=data_fingerprint,
    )
    plan.extra["budget"] = budget
    return plan


def _novice_keeps(meta: MoEModel, config: PruneConfig) -> list[LayerKeep]:
    """The uniform allocation's novices per layer, the other experts whole (routing kept)."""
    limits = layer_limits(meta, config.expert_multiple, routing_changes=False)
    removed = uniform_allocation(
        limits.budget(config.sparsity_value()), limits.num_experts, limits.top_k, **limits.as_kwargs()
    )
    return [LayerKeep((m.intermediate_size,) * (m.num_experts - r), r) for m, r in zip(meta.layers, removed)]


@METHODS.register(
    Method(
        "novice",
        "expert replaced by its mean output mu_i; routing unchanged, the block adds g_i(t) mu_i",
        EXPERTS,
        ("uniform", "global", "evo"),
        needs=(CALIBRATION,),
        keeps_routing=True,
        options=NoviceOptions,
        candidate_context=lambda moe, stats: novice_context(moe, stats),
        statistics=frozenset({Statistic.MOMENTS}),  # mu_i, the Welford mean
        planned_keeps=_novice_keeps,
    )
)
def plan_novices(request: PlanRequest) -> Plan:
    removed = request.removals()
    plan = novice_plan(
        request.moe,
        request.domains,
        request.scores,
        request.sparsity,
        criterion=request.criterion,
        allocation=request.allocation,
        removed=removed,
        data_fingerprint=request.data_fingerprint,
    )
    plan.extra["budget"] = sum(removed)
    rank = request.options.novice_rank if request.options is not None else 0
    if rank:  # fitted after planning, by a second calibration pass (surgery/lowrank.py)
        plan.extra[RANK_KEY] = rank
    return plan


def novice_context(moe: MoEModel, stats: StatsInput):
    """The virtual form for a search: `context(removed)` makes the removed positions novices
    (they add g_i(t) mu_i instead of running), for the duration of a `with`."""
    domains = require_stats(
        stats, "novice candidates (experts are replaced by their mean calibration output)"
    )

    def context(removed: dict[int, list[int]]):
        novices = {
            index: mean_outputs(moe.layer(index), layer_stats(domains, moe.layer(index)), positions)
            for index, positions in removed.items()
        }
        return override_routed(moe, RoutedOptions(novices=novices))

    return context
