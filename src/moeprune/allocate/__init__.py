"""Allocation: how many routed experts each MoE layer loses, and which ones.

- registry.py   the Allocator spec and ALLOCATIONS (uniform, global, trapezoid, evo)
- basic.py      budgets, uniform and global allocation (pure arithmetic, exact)
- limits.py     what every allocation must respect per layer (top-k, routing groups, multiples)
- trapezoid.py  TENP's whole experts per layer, growing with depth
- fitness.py    what makes one allocation better: ESAP / SAP / KL / NLL against the teacher
- searched.py   the `evo` allocation's declaration (the search itself: moeprune.search)
- projection.py  The exact budget as a projection: which experts to drop, given a keep score for
  each one
"""

from __future__ import annotations

# Importing registers the allocators; this order is the table's.
# isort: off
from moeprune.allocate import basic  # noqa: F401
from moeprune.allocate import trapezoid  # noqa: F401
from moeprune.allocate import searched  # noqa: F401

# isort: on
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
from moeprune.allocate.registry import ALLOCATIONS

__all__ = [
    "ALLOCATIONS",
    "budget_from_sparsity",
    "check_allocation",
    "global_allocation",
    "group_balanced_removals",
    "group_limited_cap",
    "plan_removals",
    "pruning_order",
    "uniform_allocation",
]
