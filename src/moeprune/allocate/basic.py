"""Budgets and the two simple allocations: how many routed experts each MoE layer loses.

Everything here is pure arithmetic on per-layer lists, so it is exact and fast to test. Layers
are addressed by their position in the lists (the MoE layers in model order); error messages
name that position. An allocation is ``r`` with ``sum(r) == B`` and
``0 <= r_l <= n_l - k_l`` (every layer keeps at least top-k experts); optionally ``r_l`` must
be a multiple of ``multiple_of[l]`` (group-limited routers) and at most ``max_removed[l]``
(a tighter per-layer limit, e.g. from :func:`group_limited_cap`).

Determinism: every tie is broken by layer position (earlier first), and within a layer by
expert id (lower first), so the same inputs always give the same allocation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from numbers import Integral, Real

import numpy as np

from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.errors import InfeasibleBudgetError, MoePruneError


def _uniform_counts(criterion, scores, budget: int, limits) -> list[int]:
    return uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())


def _global_counts(criterion, scores, budget: int, limits) -> list[int]:
    normalize = not criterion.comparable_across_layers  # scores not comparable: per-layer shares
    return global_allocation(
        [s.scores for s in scores],
        criterion.prune_first,
        budget,
        limits.num_experts,
        limits.top_k,
        normalize,
        **limits.as_kwargs(),
    )


ALLOCATIONS.add(
    Allocator(
        "uniform",
        "the same share of experts removed in every layer (remainders by largest remainder)",
        counts=_uniform_counts,
        fixed=True,
    )
)
ALLOCATIONS.add(
    Allocator(
        "global",
        "rank all experts of all layers by the criterion (normalised per layer unless "
        "comparable across layers) and remove the least important",
        counts=_global_counts,
        plan_note=lambda criterion: {
            "global_normalisation": "none (raw scores)"
            if criterion.comparable_across_layers
            else "per-layer sum of |score|"
        },
    )
)

# Which end of a criterion's scale is pruned first; "smallest"/"largest" are accepted aliases.
_DIRECTIONS = {"lowest": 1.0, "smallest": 1.0, "highest": -1.0, "largest": -1.0}


def check_ratio(ratio: float, what: str) -> float:
    """A fraction in (0, 1], or an error naming what it is."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise MoePruneError(f"{what} must be in (0, 1], got {ratio!r}")
    return float(ratio)


def _as_int(value: object, what: str) -> int:
    """Accept Python or numpy integers (not bools, not floats): silent truncation hides bugs."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise MoePruneError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _per_layer(values: Sequence[object] | None, count: int, what: str, default: int | None) -> list[int]:
    if values is None:
        return [default] * count  # type: ignore[list-item]
    if len(values) != count:
        raise MoePruneError(f"{what} has {len(values)} entries but there are {count} MoE layers")
    return [_as_int(v, f"{what}[{i}]") for i, v in enumerate(values)]


def _limits(
    num_experts: Sequence[int],
    top_k: Sequence[int],
    multiple_of: Sequence[int] | None = None,
    max_removed: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Validate the layer description; return (per-layer removal limit, per-layer multiple).

    The limit is ``min(n_l - k_l, max_removed[l])``, not yet rounded to the multiple.
    """
    count = len(num_experts)
    if count == 0:
        raise MoePruneError("no MoE layers given")
    n = _per_layer(num_experts, count, "num_experts", None)
    k = _per_layer(top_k, count, "top_k", None)
    mult = _per_layer(multiple_of, count, "multiple_of", 1)
    limit = [nl - kl for nl, kl in zip(n, k)]
    extra = _per_layer(max_removed, count, "max_removed", None) if max_removed is not None else limit
    for pos, (nl, kl, ml, xl) in enumerate(zip(n, k, mult, extra)):
        if not 1 <= kl <= nl:
            raise MoePruneError(f"MoE layer {pos}: top_k {kl} must be between 1 and its {nl} experts")
        if ml < 1:
            raise MoePruneError(f"MoE layer {pos}: multiple_of must be >= 1, got {ml}")
        if xl < 0:
            raise MoePruneError(f"MoE layer {pos}: max_removed must be >= 0, got {xl}")
    return [min(a, b) for a, b in zip(limit, extra)], mult


def _rounded_caps(limits: Sequence[int], multiples: Sequence[int]) -> list[int]:
    return [c // m * m for c, m in zip(limits, multiples)]


def _reachable_sums(top: int, start: Sequence[int], caps: Sequence[int], multiples: Sequence[int]) -> int:
    """Bitset of the increments 0..top reachable by adding whole multiples within the caps."""
    mask = (1 << (top + 1)) - 1
    reach = 1
    for r, c, m in zip(start, caps, multiples):
        acc = reach
        for j in range(1, (c - r) // m + 1):
            acc |= (reach << (j * m)) & mask
        reach = acc
    return reach


def _reachable(target: int, start: Sequence[int], caps: Sequence[int], multiples: Sequence[int]) -> bool:
    if target < 0:
        return False
    room = sum(c - r for c, r in zip(caps, start))
    if len(set(multiples)) == 1:  # the usual case: plain arithmetic, no subset sums
        return target % multiples[0] == 0 and target <= room
    return target <= room and bool(_reachable_sums(target, start, caps, multiples) >> target & 1)


def _check_budget(budget: int, caps: Sequence[int], multiples: Sequence[int]) -> int:
    """Fail early, saying which budgets would work, instead of deep inside an allocator."""
    budget = _as_int(budget, "budget")
    most = sum(caps)
    if budget < 0:
        raise InfeasibleBudgetError(f"budget must be >= 0 experts, got {budget}")
    grouped = any(m > 1 for m in multiples)
    how = "each layer keeps at least top_k experts" + (
        " and removes a multiple of multiple_of" if grouped else ""
    )
    if budget > most:
        raise InfeasibleBudgetError(
            f"budget {budget} exceeds the {most} experts that can be removed ({how}); "
            f"per-layer limits: {list(caps)}"
        )
    if not _reachable(budget, [0] * len(caps), caps, multiples):
        sums = _reachable_sums(most, [0] * len(caps), caps, multiples)
        below = max(b for b in range(budget + 1) if sums >> b & 1)
        above = min((b for b in range(budget, most + 1) if sums >> b & 1), default=None)
        nearest = f"{below}" if above is None else f"{below} or {above}"
        raise InfeasibleBudgetError(
            f"budget {budget} cannot be split into per-layer multiples of {list(multiples)} within the "
            f"per-layer limits {list(caps)}; nearest feasible budgets: {nearest}"
        )
    return budget


def _fill(
    start: Sequence[int],
    budget: int,
    caps: Sequence[int],
    multiples: Sequence[int],
    priority: Callable[[int, int], tuple],
) -> list[int] | None:
    """Add whole multiples to the layer with the best (smallest) priority until the budget is met.

    A step is taken only if the rest of the budget stays reachable, so this never paints itself
    into a corner; None when the budget is not reachable from ``start`` at all.
    """
    removed = list(start)
    deficit = budget - sum(removed)
    if not _reachable(deficit, removed, caps, multiples):
        return None
    mixed = len(set(multiples)) > 1
    while deficit > 0:
        open_layers = [
            pos for pos, (r, c, m) in enumerate(zip(removed, caps, multiples)) if r + m <= c and m <= deficit
        ]
        for pos in sorted(open_layers, key=lambda p: priority(p, removed[p])):
            removed[pos] += multiples[pos]
            if not mixed or _reachable(deficit - multiples[pos], removed, caps, multiples):
                deficit -= multiples[pos]
                break
            removed[pos] -= multiples[pos]
        else:  # pragma: no cover - excluded by the reachability invariant
            return None
    return removed


def _round_and_fill(
    targets: Sequence[float | Fraction | int],
    budget: int,
    caps: Sequence[int],
    multiples: Sequence[int],
    priority: Callable[[int, int], tuple],
) -> list[int]:
    """Round each target down to its multiple, then give the rest out by priority.

    If the rounded start cannot reach the budget (only possible with mixed multiples), start
    over from zero, which always works once :func:`_check_budget` passed.
    """
    start = [min(math.floor(t / m) * m, c) for t, m, c in zip(targets, multiples, caps)]
    result = _fill(start, budget, caps, multiples, priority)
    if result is None:
        result = _fill([0] * len(caps), budget, caps, multiples, priority)
    if result is None:  # pragma: no cover - _check_budget guarantees reachability from zero
        raise InfeasibleBudgetError(f"budget {budget} cannot be allocated within limits {list(caps)}")
    return result


def budget_from_sparsity(sparsity: float, num_experts: Sequence[int], top_k: Sequence[int]) -> int:
    """Experts to remove for expert sparsity S: ``B = round(S * sum n_l)``, halves rounded up.

    S must lie in ``[0, sum(n_l - k_l) / sum(n_l)]``: beyond that some layer would keep fewer
    than top-k experts.
    """
    limits, _ = _limits(num_experts, top_k)
    total = sum(_as_int(n, "num_experts") for n in num_experts)
    most = sum(limits)
    highest = most / total
    if not isinstance(sparsity, Real) or not math.isfinite(sparsity) or not 0 <= sparsity <= highest + 1e-12:
        raise InfeasibleBudgetError(
            f"sparsity {sparsity!r} is outside the feasible range [0, {highest:.6g}] "
            f"(= sum(n_l - top_k_l) / sum(n_l) = {most}/{total}: every layer keeps at least top_k experts)"
        )
    return min(math.floor(float(sparsity) * total + 0.5), most)


def check_allocation(
    removed: Sequence[int],
    num_experts: Sequence[int],
    top_k: Sequence[int],
    budget: int | None = None,
    *,
    multiple_of: Sequence[int] | None = None,
    max_removed: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
) -> None:
    """Raise InfeasibleBudgetError naming the first layer that breaks a constraint.

    ``layers`` (decoder layer indices) only makes the messages name real layers.
    """
    limits, mult = _limits(num_experts, top_k, multiple_of, max_removed)
    r = _per_layer(removed, len(limits), "removed", None)
    names = [f"MoE layer {p}" for p in range(len(r))] if layers is None else [f"layer {i}" for i in layers]
    for pos, (rl, cap, ml) in enumerate(zip(r, limits, mult)):
        if not 0 <= rl <= cap:
            raise InfeasibleBudgetError(
                f"{names[pos]}: removes {rl} experts but must remove between 0 and {cap} "
                f"({num_experts[pos]} experts, top_k {top_k[pos]} must stay)"
            )
        if rl % ml:
            raise InfeasibleBudgetError(f"{names[pos]}: removes {rl} experts, not a multiple of {ml}")
    if budget is not None and sum(r) != budget:
        raise InfeasibleBudgetError(f"allocation removes {sum(r)} experts in total, budget is {budget}")


def _water_fill(budget: int, weights: Sequence[int], caps: Sequence[int]) -> list[Fraction]:
    """Exact proportional shares ``budget * w_l / sum(w)``, with capped layers fixed at their cap.

    Layers whose share exceeds their cap are pinned there and the rest of the budget is shared
    again among the others, until no share exceeds its cap (the continuous optimum).
    """
    free = set(range(len(weights)))
    while True:
        rest = budget - sum(caps[p] for p in range(len(caps)) if p not in free)
        weight = sum(weights[p] for p in free)
        over = {p for p in free if Fraction(rest * weights[p], weight) > caps[p]}
        if not over:
            return [
                Fraction(rest * weights[p], weight) if p in free else Fraction(caps[p])
                for p in range(len(caps))
            ]
        free -= over


def uniform_allocation(
    budget: int,
    num_experts: Sequence[int],
    top_k: Sequence[int],
    multiple_of: Sequence[int] | None = None,
    *,
    max_removed: Sequence[int] | None = None,
) -> list[int]:
    """The same expert sparsity in every layer (the same ``r_l`` when all ``n_l`` are equal).

    Shares are ``B * n_l / sum(n)`` in exact fractions (Hamilton / largest-remainder method):
    each layer gets the floor of its share and the leftover experts go one each to the layers
    with the largest fractional remainder, earlier layers first on ties. A layer whose share
    exceeds its cap is pinned at the cap and its overflow re-shared among the others. With
    ``multiple_of`` the floors are taken to the multiple and leftover multiples are handed out
    the same way.
    """
    limits, mult = _limits(num_experts, top_k, multiple_of, max_removed)
    caps = _rounded_caps(limits, mult)
    budget = _check_budget(budget, caps, mult)
    targets = _water_fill(budget, [int(n) for n in num_experts], caps)
    return _round_and_fill(targets, budget, caps, mult, lambda p, r: (r - targets[p], p))


def _prune_keys(
    scores: Sequence[np.ndarray | Sequence[float]],
    prune_first: str,
    num_experts: Sequence[int],
    normalize: bool,
) -> list[np.ndarray]:
    """Per-layer float64 keys where smaller means pruned earlier."""
    if prune_first not in _DIRECTIONS:
        raise MoePruneError(f"prune_first must be 'lowest' or 'highest', got {prune_first!r}")
    if len(scores) != len(num_experts):
        raise MoePruneError(f"scores has {len(scores)} layers but num_experts has {len(num_experts)}")
    keys = []
    for pos, (s, n) in enumerate(zip(scores, num_experts)):
        arr = np.asarray(s, dtype=np.float64)
        if arr.shape != (n,):
            raise MoePruneError(f"MoE layer {pos}: expected {n} scores, got shape {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise MoePruneError(f"MoE layer {pos}: scores contain NaN or infinity")
        if normalize:
            total = np.abs(arr).sum()
            arr = arr / total if total > 0 else arr
        keys.append(arr * _DIRECTIONS[prune_first])
    return keys


def pruning_order(scores: np.ndarray | Sequence[float], prune_first: str) -> list[int]:
    """Expert ids of one layer, first pruned first; ties go to the lower expert id."""
    (keys,) = _prune_keys([scores], prune_first, [len(scores)], normalize=False)
    return np.argsort(keys, kind="stable").tolist()


def global_allocation(
    scores: Sequence[np.ndarray],
    prune_first: str,
    budget: int,
    num_experts: Sequence[int],
    top_k: Sequence[int],
    normalize: bool,
    multiple_of: Sequence[int] | None = None,
    *,
    max_removed: Sequence[int] | None = None,
) -> list[int]:
    """Remove the B globally least important experts, subject to the per-layer limits.

    ``normalize=True`` divides each layer's scores by that layer's sum of absolute scores
    (a layer whose scores are all zero stays zero) so that criteria whose scale differs between
    layers (counts, output norms) become comparable; the within-layer order is unchanged.
    All experts are ranked together (ties: earlier layer, then lower expert id); walking that
    ranking, an expert is taken unless its layer already reached its limit, in which case the
    layer's excess goes to the next-least-important experts of layers with room. With
    ``multiple_of`` each layer's count is rounded down to its multiple and the leftover is
    handed out in whole multiples to the layer whose next block of experts is least important
    (mean key of that block; ties: earlier layer).
    """
    limits, mult = _limits(num_experts, top_k, multiple_of, max_removed)
    caps = _rounded_caps(limits, mult)
    budget = _check_budget(budget, caps, mult)
    sorted_keys = [
        np.sort(k, kind="stable") for k in _prune_keys(scores, prune_first, num_experts, normalize)
    ]
    flat = np.concatenate(sorted_keys)
    layer_of = np.concatenate([np.full(len(k), p) for p, k in enumerate(sorted_keys)])
    rank = np.concatenate([np.arange(len(k)) for k in sorted_keys])
    counts = [0] * len(caps)
    taken = 0
    for idx in np.lexsort((rank, layer_of, flat)):
        if taken == budget:
            break
        pos = int(layer_of[idx])
        if counts[pos] < caps[pos]:
            counts[pos] += 1
            taken += 1

    def next_block(pos: int, r: int) -> tuple[float, int]:
        return float(sorted_keys[pos][r : r + mult[pos]].mean()), pos

    return _round_and_fill(counts, budget, caps, mult, next_block)


def group_limited_cap(
    num_experts: int, top_k: int, n_group: int, topk_group: int, min_per_group: int = 2
) -> int:
    """Most experts a group-limited router layer (DeepSeek-V3 style) can lose, group-balanced.

    Each of the ``n_group`` groups keeps ``q`` experts with ``q * topk_group >= top_k`` (the
    chosen groups must offer top_k experts) and ``q >= min_per_group`` (DeepSeek-V3 and
    GLM-4-MoE score a group by its best two experts). Pass the result as ``max_removed``.
    """
    if n_group < 1 or num_experts % n_group:
        raise MoePruneError(f"{num_experts} experts cannot be split into {n_group} equal groups")
    if not 1 <= topk_group <= n_group:
        raise MoePruneError(f"topk_group {topk_group} must be between 1 and n_group {n_group}")
    keep = max(min_per_group, -(-top_k // topk_group))
    return max(0, num_experts - n_group * keep)


def group_balanced_removals(order: Sequence[int], r: int, num_experts: int, n_group: int) -> list[int]:
    """The r experts to remove from a group-limited layer: r / n_group from every group.

    Group g holds experts ``[g*E/G, (g+1)*E/G)``; from each group the experts earliest in
    ``order`` go. Returned in pruning order. Group-limited routers need equal group sizes,
    hence the balance.
    """
    order = _check_order(order, num_experts)
    r, n_group = _as_int(r, "r"), _as_int(n_group, "n_group")
    if n_group < 1 or num_experts % n_group:
        raise MoePruneError(f"{num_experts} experts cannot be split into {n_group} equal groups")
    if r % n_group:
        raise InfeasibleBudgetError(
            f"removing {r} experts from {n_group} groups: {r} is not a multiple of {n_group}"
        )
    size, per = num_experts // n_group, r // n_group
    if not 0 <= per < size:
        raise InfeasibleBudgetError(
            f"removing {r} experts would leave {size - per} of {size} experts per group; at least 1 must stay"
        )
    taken = [0] * n_group
    chosen = []
    for e in order:
        if taken[e // size] < per:
            taken[e // size] += 1
            chosen.append(e)
    return chosen


def _check_order(order: Sequence[int], num_experts: int) -> list[int]:
    ids = [_as_int(e, "expert id") for e in order]
    if sorted(ids) != list(range(num_experts)):
        raise MoePruneError(f"a pruning order must list each of the {num_experts} expert ids exactly once")
    return ids


def plan_removals(
    orders: Sequence[Sequence[int]],
    removed: Sequence[int],
    n_group: Sequence[int] | None = None,
) -> list[list[int]]:
    """Per layer, the expert ids to remove: the first ``r_l`` of that layer's pruning order.

    Layers with ``n_group[l] > 1`` use :func:`group_balanced_removals` instead.
    """
    r = _per_layer(removed, len(orders), "removed", None)
    groups = _per_layer(n_group, len(orders), "n_group", 1)
    result = []
    for pos, (order, rl, g) in enumerate(zip(orders, r, groups)):
        ids = _check_order(order, len(order))
        if not 0 <= rl <= len(ids):
            raise InfeasibleBudgetError(f"MoE layer {pos}: cannot remove {rl} of its {len(ids)} experts")
        result.append(group_balanced_removals(ids, rl, len(ids), g) if g > 1 else ids[:rl])
    return result
