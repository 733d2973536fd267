"""Allocation: how many routed experts each MoE layer loses, and which ones."""

from __future__ import annotations

from moeprune.allocate.basic import (
    budget_from_sparsity,
    check_allocation,
    global_allocation,
    group_balanced_removals,
    group_limited_cap,
    plan_removals,
    pruning_order,
    uniform_allocation,
)

__all__ = [
    "budget_from_sparsity",
    "check_allocation",
    "global_allocation",
    "group_balanced_removals",
    "group_limited_cap",
    "plan_removals",
    "pruning_order",
    "uniform_allocation",
]
