"""Allocation arithmetic: hand-computed cases, constraints, and seeded property checks."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from moeprune.allocate import (
    budget_from_sparsity,
    check_allocation,
    global_allocation,
    group_balanced_removals,
    group_limited_cap,
    plan_removals,
    pruning_order,
    uniform_allocation,
)
from moeprune.errors import InfeasibleBudgetError, MoePruneError

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

# --- budget_from_sparsity -------------------------------------------------------------------


def test_budget_from_sparsity_rounds_half_up_and_bounds():
    assert budget_from_sparsity(0.25, [8, 8, 8], [2, 2, 2]) == 6
    assert budget_from_sparsity(0.0, [8, 8], [2, 2]) == 0
    assert budget_from_sparsity(0.75, [8, 8], [2, 2]) == 12  # the maximum: every layer keeps top_k
    assert budget_from_sparsity(1 / 32, [8, 8], [2, 2]) == 1  # 0.5 rounds up, not to even
    assert budget_from_sparsity(3 / 32, [8, 8], [2, 2]) == 2  # 1.5 -> 2


@pytest.mark.parametrize("sparsity", [-0.1, 0.76, float("nan"), 1.0])
def test_budget_from_sparsity_outside_range(sparsity):
    with pytest.raises(InfeasibleBudgetError, match=r"\[0, 0\.75\]"):
        budget_from_sparsity(sparsity, [8, 8], [2, 2])


def test_bad_layer_description():
    with pytest.raises(MoePruneError, match="top_k 9"):
        uniform_allocation(1, [8], [9])
    with pytest.raises(MoePruneError, match="2 entries"):
        uniform_allocation(1, [8, 8, 8], [2, 2])
    with pytest.raises(MoePruneError, match="integer"):
        uniform_allocation(1.0, [8], [2])  # type: ignore[arg-type]


# --- uniform ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "n", "k", "expected"),
    [
        (7, [8, 8, 8], [2, 2, 2], [3, 2, 2]),  # remainder 1: tie on 1/3 -> first layer
        (8, [8, 8, 8], [2, 2, 2], [3, 3, 2]),
        (9, [8, 8, 8], [2, 2, 2], [3, 3, 3]),
        (1, [8, 8, 8], [2, 2, 2], [1, 0, 0]),
        # shares 10*8/28=2.86, 10*16/28=5.71, 10*4/28=1.43: floors 2,5,1, leftovers to the
        # largest remainders .86 and .71
        (10, [8, 16, 4], [1, 1, 1], [3, 6, 1]),
        # shares 2.4, 9.6 but layer 0 may lose only 2: pinned, its overflow goes to layer 1
        (12, [4, 16], [2, 2], [2, 10]),
        (0, [8, 8], [2, 2], [0, 0]),
        (12, [8, 8], [2, 2], [6, 6]),
    ],
)
def test_uniform_hand_computed(budget, n, k, expected):
    assert uniform_allocation(budget, n, k) == expected


def test_uniform_cap_overflow_is_reshared_proportionally():
    # shares 14*4/24 = 2.33 (cap 1) -> pinned; 13 left over n=[8, 12]: 5.2, 7.8 -> 5, 8
    assert uniform_allocation(14, [4, 8, 12], [3, 1, 1]) == [1, 5, 8]


def test_uniform_infeasible_names_limits():
    with pytest.raises(InfeasibleBudgetError, match=r"budget 13 exceeds the 12 .*\[6, 6\]"):
        uniform_allocation(13, [8, 8], [2, 2])
    with pytest.raises(InfeasibleBudgetError, match=">= 0"):
        uniform_allocation(-1, [8, 8], [2, 2])


def test_uniform_multiple_of():
    assert uniform_allocation(16, [8, 8, 8, 8], [2, 2, 2, 2], [4, 4, 4, 4]) == [4, 4, 4, 4]
    assert uniform_allocation(8, [8, 8, 8], [2, 2, 2], [4, 4, 4]) == [4, 4, 0]
    # cap n-k = 6 rounds down to 4 under multiples of 4
    with pytest.raises(InfeasibleBudgetError, match=r"exceeds the 12 .*\[4, 4, 4\]"):
        uniform_allocation(16, [8, 8, 8], [2, 2, 2], [4, 4, 4])
    with pytest.raises(InfeasibleBudgetError, match="nearest feasible budgets: 6 or 8"):
        uniform_allocation(7, [8, 8, 8], [2, 2, 2], [2, 2, 2])


def test_uniform_mixed_multiples_falls_back_to_a_feasible_split():
    # proportional 3 + 3 is impossible with multiples (2, 3) and caps (6, 6); 6 + 0 is
    assert uniform_allocation(6, [8, 8], [2, 2], [2, 3]) == [6, 0]
    assert uniform_allocation(7, [8, 8, 8], [2, 2, 2], [2, 3, 1]) == [2, 3, 2]


# --- global ----------------------------------------------------------------------------------

SCORES = [
    np.array([0.9, 0.1, 0.5, 0.3]),
    np.array([0.2, 0.8, 0.05, 0.7]),
    np.array([0.6, 0.4, 0.35, 0.95]),
]


def test_global_takes_the_lowest():
    # sorted: .05(L1) .1(L0) .2(L1) .3(L0) .35(L2) .4(L2) .5(L0) ...
    assert global_allocation(SCORES, "lowest", 4, [4, 4, 4], [1, 1, 1], False) == [2, 2, 0]
    assert global_allocation(SCORES, "lowest", 6, [4, 4, 4], [1, 1, 1], False) == [2, 2, 2]


def test_global_highest_direction():
    # sorted descending: .95(L2) .9(L0) .8(L1) .7(L1) .6(L2)
    assert global_allocation(SCORES, "highest", 4, [4, 4, 4], [1, 1, 1], False) == [1, 2, 1]
    assert global_allocation(SCORES, "largest", 4, [4, 4, 4], [1, 1, 1], False) == [1, 2, 1]


def test_global_cap_repair_moves_excess_to_next_least_important():
    scores = [np.array([0.0, 0.1, 0.2, 0.3]), np.array([1.0, 2.0, 3.0, 4.0])]
    # layer 0 holds the 4 lowest but may lose only 2; the excess goes to layer 1's lowest
    assert global_allocation(scores, "lowest", 4, [4, 4], [2, 2], False) == [2, 2]


def test_global_normalisation_changes_the_result():
    # layer 1's scores are ~100x larger: raw ranking prunes only layer 0
    scores = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([50.0, 200.0, 300.0, 400.0])]
    assert global_allocation(scores, "lowest", 2, [4, 4], [1, 1], False) == [2, 0]
    # divided by the layer sums (10 and 950): .1 .2 | .053 .21 -> layer 1's first, then layer 0's
    assert global_allocation(scores, "lowest", 2, [4, 4], [1, 1], True) == [1, 1]


def test_global_ties_go_to_earlier_layer():
    scores = [np.ones(4), np.ones(4), np.ones(4)]
    assert global_allocation(scores, "lowest", 4, [4, 4, 4], [1, 1, 1], False) == [3, 1, 0]


def test_global_multiple_of_and_errors():
    scores = [np.arange(8.0), np.arange(8.0) + 0.5]
    assert global_allocation(scores, "lowest", 5, [8, 8], [2, 2], False) == [3, 2]
    # walk gives [3, 3]; floors [2, 2]; the leftover 2 goes to layer 0 (next block 2,3 < 2.5,3.5)
    assert global_allocation(scores, "lowest", 6, [8, 8], [2, 2], False, [2, 2]) == [4, 2]
    with pytest.raises(InfeasibleBudgetError, match="multiples"):
        global_allocation(scores, "lowest", 5, [8, 8], [2, 2], False, [2, 2])
    with pytest.raises(MoePruneError, match="expected 8 scores"):
        global_allocation([np.zeros(7), np.zeros(8)], "lowest", 1, [8, 8], [2, 2], False)
    with pytest.raises(MoePruneError, match="NaN"):
        global_allocation([np.full(8, np.nan), np.zeros(8)], "lowest", 1, [8, 8], [2, 2], False)
    with pytest.raises(MoePruneError, match="prune_first"):
        global_allocation(scores, "middle", 1, [8, 8], [2, 2], False)


# --- properties over random configurations ---------------------------------------------------


def _random_config(rng: random.Random) -> tuple[list[int], list[int], list[int], int]:
    layers = rng.randint(1, 7)
    n = [rng.choice([2, 4, 6, 8, 16]) for _ in range(layers)]
    k = [rng.randint(1, e) for e in n]
    mult = [rng.choice([1, 1, 2, 4]) for _ in range(layers)] if rng.random() < 0.4 else [1] * layers
    if rng.random() < 0.5 and len(set(mult)) > 1:
        mult = [mult[0]] * layers
    most = sum((e - kk) // m * m for e, kk, m in zip(n, k, mult))
    return n, k, mult, rng.randint(0, most)


def _feasible(budget: int, n: list[int], k: list[int], mult: list[int]) -> bool:
    options = [range(0, (e - kk) // m * m + 1, m) for e, kk, m in zip(n, k, mult)]
    return budget in {sum(c) for c in itertools.product(*options)}


def test_property_exact_sum_caps_and_multiples():
    rng = random.Random(1234)
    np_rng = np.random.default_rng(1234)
    for _ in range(300):
        n, k, mult, budget = _random_config(rng)
        scores = [np_rng.random(e) for e in n]
        if not _feasible(budget, n, k, mult):
            with pytest.raises(InfeasibleBudgetError):
                uniform_allocation(budget, n, k, mult)
            continue
        for r in (
            uniform_allocation(budget, n, k, mult),
            global_allocation(
                scores, rng.choice(["lowest", "highest"]), budget, n, k, rng.random() < 0.5, mult
            ),
        ):
            assert sum(r) == budget
            check_allocation(r, n, k, budget, multiple_of=mult)


def test_property_uniform_is_within_one_of_the_proportional_share():
    rng = random.Random(7)
    for _ in range(300):
        layers = rng.randint(1, 8)
        n = [rng.choice([8, 16, 32, 64]) for _ in range(layers)]
        k = [1] * layers
        budget = rng.randint(0, sum(e // 2 for e in n))  # at most half of every layer: no cap binds
        r = uniform_allocation(budget, n, k)
        assert sum(r) == budget
        assert all(abs(rl - budget * e / sum(n)) < 1 for rl, e in zip(r, n))
        assert r == uniform_allocation(budget, n, k)  # deterministic


def test_property_global_minimises_removed_importance():
    """Without multiples the capped greedy walk is optimal (a partition matroid): check by DP."""
    rng = random.Random(99)
    np_rng = np.random.default_rng(99)
    for _ in range(200):
        layers = rng.randint(1, 5)
        n = [rng.choice([3, 4, 6]) for _ in range(layers)]
        k = [rng.randint(1, e) for e in n]
        budget = rng.randint(0, sum(e - kk for e, kk in zip(n, k)))
        scores = [np_rng.random(e) for e in n]
        r = global_allocation(scores, "lowest", budget, n, k, False)
        prefix = [np.concatenate([[0.0], np.cumsum(np.sort(s))]) for s in scores]
        best = {0: 0.0}
        for p, e, kk in zip(prefix, n, k):
            layer_best: dict[int, float] = {}
            for (b, v), j in itertools.product(best.items(), range(e - kk + 1)):
                layer_best[b + j] = min(layer_best.get(b + j, np.inf), v + p[j])
            best = layer_best
        assert sum(p[rl] for p, rl in zip(prefix, r)) == pytest.approx(best[budget])


# --- check_allocation ------------------------------------------------------------------------


def test_check_allocation_names_the_layer():
    check_allocation([3, 2, 2], [8, 8, 8], [2, 2, 2], 7)
    with pytest.raises(InfeasibleBudgetError, match=r"MoE layer 1: removes 7 .* between 0 and 6"):
        check_allocation([0, 7, 0], [8, 8, 8], [2, 2, 2])
    with pytest.raises(InfeasibleBudgetError, match=r"layer 12: removes -1"):
        check_allocation([0, -1], [8, 8], [2, 2], layers=[10, 12])
    with pytest.raises(InfeasibleBudgetError, match="budget is 8"):
        check_allocation([3, 2, 2], [8, 8, 8], [2, 2, 2], 8)
    with pytest.raises(InfeasibleBudgetError, match="MoE layer 0: removes 3 experts, not a multiple of 2"):
        check_allocation([3, 2], [8, 8], [2, 2], multiple_of=[2, 2])
    with pytest.raises(InfeasibleBudgetError, match="between 0 and 4"):
        check_allocation([6, 0], [8, 8], [2, 2], max_removed=[4, 4])


# --- orders, removals, groups ----------------------------------------------------------------


def test_pruning_order_direction_and_ties():
    assert pruning_order(np.array([0.3, 0.1, 0.3, 0.2]), "lowest") == [1, 3, 0, 2]
    assert pruning_order(np.array([0.3, 0.1, 0.3, 0.2]), "highest") == [0, 2, 3, 1]


def test_plan_removals():
    orders = [[3, 1, 0, 2], [0, 1, 2, 3]]
    assert plan_removals(orders, [2, 0]) == [[3, 1], []]
    with pytest.raises(InfeasibleBudgetError, match="MoE layer 1"):
        plan_removals(orders, [0, 5])
    with pytest.raises(MoePruneError, match="exactly once"):
        plan_removals([[0, 0, 1, 2]], [1])


def test_group_balanced_removals():
    order = [7, 6, 0, 5, 1, 4, 2, 3]  # groups of 2 experts: {0,1} {2,3} {4,5} {6,7}
    assert group_balanced_removals(order, 4, 8, 4) == [7, 0, 5, 2]
    order = [0, 1, 2, 3, 4, 5, 6, 7]  # groups of 4: {0..3} {4..7}
    assert group_balanced_removals(order, 4, 8, 2) == [0, 1, 4, 5]
    assert plan_removals([order], [2], n_group=[2]) == [[0, 4]]
    with pytest.raises(InfeasibleBudgetError, match="not a multiple of 2"):
        group_balanced_removals(order, 3, 8, 2)
    with pytest.raises(InfeasibleBudgetError, match="at least 1 must stay"):
        group_balanced_removals(order, 8, 8, 2)
    with pytest.raises(MoePruneError, match="equal groups"):
        group_balanced_removals(order, 2, 8, 3)


def test_group_limited_cap():
    # DeepSeek-V3: 256 experts, 8 groups of 32, 4 groups chosen, top-8: each group keeps >= 2
    assert group_limited_cap(256, 8, 8, 4) == 240
    # top-8 from 1 chosen group: every group must keep 8
    assert group_limited_cap(64, 8, 4, 1) == 32
    assert group_limited_cap(16, 4, 4, 4, min_per_group=1) == 12
    caps = [group_limited_cap(64, 8, 4, 1)] * 2
    assert uniform_allocation(40, [64, 64], [8, 8], [4, 4], max_removed=caps) == [20, 20]
    with pytest.raises(InfeasibleBudgetError, match=r"\[32, 32\]"):
        uniform_allocation(68, [64, 64], [8, 8], [4, 4], max_removed=caps)


def test_allocations_dispatch_through_their_registry(monkeypatch):
    """An allocation that reads its counts off the scores is one registry entry: expert_allocation
    calls its `counts` (no list of names to extend), and `searches` says which ones need search data."""
    from moeprune.allocate.limits import expert_allocation
    from moeprune.allocate.registry import ALLOCATIONS, Allocator, searches
    from moeprune.criteria import compute_scores, get_criterion
    from moeprune.models import MoEModel
    from moeprune.models.factory import tiny_model

    assert [a.name for a in ALLOCATIONS if a.searches] == ["evo", "gradient"]
    assert searches("evo") and searches("gradient") and not searches("uniform") and not searches(None)
    moe = MoEModel(tiny_model("qwen3_moe"))
    criterion = get_criterion("random")
    scores = compute_scores("random", num_experts=[m.num_experts for m in moe.layers], layers=[m.index for m in moe.layers])
    seen = []

    def last_layer_first(criterion_, scores_, budget, limits):
        seen.append((criterion_.name, len(scores_), budget, tuple(limits.num_experts)))
        counts = [0] * len(limits.num_experts)
        counts[-1] = budget
        return counts

    monkeypatch.setitem(ALLOCATIONS._specs, "last", Allocator("last", "every expert from the last layer",
                                                              counts=last_layer_first))  # fmt: skip
    removed = expert_allocation(moe, criterion, scores, 0.25, "last")
    budget = sum(expert_allocation(moe, criterion, scores, 0.25, "uniform"))
    assert removed == [0] * (len(moe.layers) - 1) + [budget]
    assert seen == [("random", len(moe.layers), budget, tuple(m.num_experts for m in moe.layers))]
    with pytest.raises(MoePruneError, match="does not choose expert counts"):
        expert_allocation(moe, criterion, scores, 0.25, "evo")
