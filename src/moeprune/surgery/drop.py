"""The drop method: the first r_l experts of each layer's pruning order are removed, router row
and weights. The removal itself (virtual masks and physical slicing) is models/reshape.py."""

from __future__ import annotations

from moeprune.allocate.basic import plan_removals
from moeprune.allocate.registry import ALLOCATIONS
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.registry import EXPERTS, METHODS, Method, PlanRequest


@METHODS.register(
    Method(
        "drop",
        "expert weights and router row removed; top-k picks among the survivors",
        EXPERTS,
        ("uniform", "global", "evo"),
    )
)
def drop_plan(request: PlanRequest) -> Plan:
    """Drop the first r_l experts of each layer's pruning order (group-balanced where needed)."""
    moe, criterion, removed = request.moe, request.criterion, request.removals()
    layers = moe.layers
    positions = plan_removals([s.order for s in request.scores], removed, [m.n_group for m in layers])
    ids = [[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)]
    plan = Plan.from_removals(
        ModelShape.of(moe),
        removals=ids,
        criterion=criterion.name,
        allocation=request.allocation,
        method="drop",
        sparsity=request.sparsity,
        data_fingerprint=request.data_fingerprint,
    )
    plan.extra["budget"] = sum(removed)
    note = ALLOCATIONS.get(request.allocation).plan_note
    if note is not None:
        plan.extra.update(note(criterion))
    return plan
