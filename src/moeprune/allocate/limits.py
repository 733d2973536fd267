"""What every allocation must respect in each MoE layer of one model, computed in one place.

- cap: the most experts the layer may lose (n - top_k, or fewer for group-limited routers,
  which must keep enough experts in every group: `group_limited_cap`);
- groups: group-limited routers lose the same number of experts from each of their groups;
- multiple: removals per layer are a multiple of this, so that the kept count is a multiple of
  `expert_multiple` (vLLM's expert parallelism needs counts divisible by the EP size, and
  kernels prefer multiples of 8) and group-limited layers stay balanced;
- fixed: layers that cannot lose an expert (`MoELayer.kept_whole`: hash routing) have cap 0 and
  do not count toward the budget, so a sparsity is a fraction of the prunable layers' experts and
  every allocation (uniform, global, evo, a target size) spreads it over those layers only.
- protected: the layer's super experts (`moe.protected`) are never removed, so the cap leaves
  room for them (every group of a group-limited layer keeps its own); the pruning orders put them
  last (criteria/super_experts.py), so a count within the cap never reaches them. Every
  allocation and the search read these caps, which is what makes the guard hold everywhere.

Works on a model on the meta device, so an impossible request is refused before any weight
is loaded. `expert_allocation` applies the uniform and global allocations under these limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moeprune.allocate.basic import (
    budget_from_sparsity,
    group_limited_cap,
)
from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.criteria import Criterion, LayerScores
from moeprune.errors import InfeasibleBudgetError, MoePruneError
from moeprune.models.adapter import MoEModel


@dataclass(frozen=True)
class LayerLimits:
    """Per MoE layer, in `moe.layers` order."""

    layers: list[int]  # decoder layer indices
    num_experts: list[int]
    top_k: list[int]
    caps: list[int]  # most experts the layer may lose
    groups: list[int]  # routing groups (removals are spread evenly over them); 1 if none
    multiples: list[int]  # removals per layer must be a multiple of this
    fixed: list[bool]  # kept whole (cap 0), outside the budget

    def as_kwargs(self) -> dict[str, list[int]]:
        """The per-layer constraints in the form the allocators take."""
        return {"multiple_of": self.multiples, "max_removed": self.caps}

    @property
    def prunable_experts(self) -> int:
        """Experts of the layers that may lose some: what a sparsity is a fraction of."""
        return sum(n for n, f in zip(self.num_experts, self.fixed) if not f)

    def budget(self, sparsity: float) -> int:
        """Experts to remove for `sparsity`, over the prunable layers only (a fixed layer's experts
        are neither removed nor counted, so 50% halves every prunable layer)."""
        prunable = [i for i, f in enumerate(self.fixed) if not f]
        return budget_from_sparsity(
            sparsity, [self.num_experts[i] for i in prunable], [self.top_k[i] for i in prunable]
        )


def layer_limits(moe: MoEModel, expert_multiple: int = 1, routing_changes: bool = True) -> LayerLimits:
    """The limits of `moe`'s MoE layers; every kept count a multiple of `expert_multiple`.

    `routing_changes` False (novices: still routed, so routing groups stay as they are) drops the
    group constraints and keeps only "at least top_k weight-holding experts".
    """
    if isinstance(expert_multiple, bool) or not isinstance(expert_multiple, int) or expert_multiple < 1:
        raise MoePruneError(
            f"expert_multiple must be a positive integer, got {expert_multiple!r}",
            options=("expert_multiple",),
        )
    uneven = [(m.index, m.num_experts) for m in moe.layers if m.num_experts % expert_multiple]
    if uneven:
        layer, count = uneven[0]
        raise InfeasibleBudgetError(
            f"decoder layer {layer} has {count} experts, not a multiple of {expert_multiple}: no kept count can be "
            f"a multiple of {expert_multiple} there; choose a divisor of every layer's expert count",
            options=("expert_multiple",),
        )
    groups = [m.n_group if routing_changes else 1 for m in moe.layers]
    fixed = [m.fixed for m in moe.layers]
    caps = [
        0
        if f
        else min(
            group_limited_cap(m.num_experts, m.top_k, g, m.topk_group) if g > 1 else m.num_experts - m.top_k,
            protected_cap(m.num_experts, g, moe.protected.get(m.index, ())),
        )
        for m, g, f in zip(moe.layers, groups, fixed)
    ]
    return LayerLimits(
        layers=[m.index for m in moe.layers],
        num_experts=[m.num_experts for m in moe.layers],
        top_k=[m.top_k for m in moe.layers],
        caps=caps,
        groups=groups,
        multiples=[math.lcm(g, expert_multiple) for g in groups],
        fixed=fixed,
    )


def protected_cap(num_experts: int, groups: int, protected: Sequence[int]) -> int:
    """Most experts a layer may lose keeping every protected expert: with g balanced groups each
    group loses r / g, so the group holding the most protected experts sets the limit."""
    if not protected:
        return num_experts
    size = num_experts // groups
    per_group = [0] * groups
    for e in protected:
        per_group[min(int(e) // size, groups - 1)] += 1
    return groups * (size - max(per_group))


def expert_allocation(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    sparsity: float,
    allocation: str | Allocator,
    limits: LayerLimits | None = None,
) -> list[int]:
    """How many experts each MoE layer loses under the global budget (uniform or global); the
    allocation's entry, or its name."""
    limits = limits or layer_limits(moe)
    budget = limits.budget(sparsity)
    spec = allocation if isinstance(allocation, Allocator) else ALLOCATIONS.get(allocation)
    counts = spec.counts
    if counts is not None:
        return counts(criterion, scores, budget, limits)
    raise MoePruneError(
        f"allocation {spec.name!r} does not choose expert counts (use uniform, global or evo)",
        options=("allocation",),
    )
