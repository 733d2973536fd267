"""The exact budget as a projection: which experts to drop, given a keep score for each one.

The gradient allocation (search/gradient.py) draws a hard mask at every training step and reads
its final plan off the learned logits; both go through :func:`project_budget`, so every mask it
ever evaluates removes exactly the budget and respects every per-layer limit (limits.py):

- at most ``caps[l]`` experts per layer (at least top-k stay, every routing group keeps enough,
  the super experts stay), a multiple of ``multiples[l]`` (balanced groups, `expert_multiple`);
- group-limited layers lose the same number from each group (group g holds experts
  ``[g*E/G, (g+1)*E/G)``, as `group_balanced_removals` splits them);
- protected experts are never chosen; fixed layers (cap 0) lose nothing.

Among those masks it returns the one whose dropped experts have the smallest total keep score.
Within a layer and a count that is the lowest scores of each group; across layers the value of
removing r experts is a sum of per-group prefix sums, so an exact dynamic programme over
(layer, experts removed so far) finds the best counts, O(layers x budget x steps per layer),
which is milliseconds even at DeepSeek-V3's 58 x 256 experts. Ties go to the lower count in the
earlier layer and to the lower expert id, so the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from moeprune.allocate.limits import LayerLimits
from moeprune.errors import InfeasibleBudgetError


def _layer_costs(
    keep: np.ndarray, num_experts: int, groups: int, multiple: int, cap: int, protected: Sequence[int]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """For j = 0..cap/multiple: the least total keep score of removing j*multiple experts, and
    each group's experts sorted by score (lowest first) from which the prefixes are taken."""
    size = num_experts // groups
    scores = np.asarray(keep, dtype=np.float64).copy()
    scores[list(protected)] = np.inf  # never chosen (the caps leave room for them)
    per_group = []
    for g in range(groups):
        ids = np.arange(g * size, (g + 1) * size)
        per_group.append(ids[np.lexsort((ids, scores[ids]))])  # by score, then by id
    steps = cap // multiple
    per = multiple // groups  # experts each group loses per step
    costs = np.zeros(steps + 1)
    for j in range(1, steps + 1):
        costs[j] = sum(float(scores[ids[: j * per]].sum()) for ids in per_group)
    return costs, per_group


def project_budget(
    keep_scores: Sequence[np.ndarray],
    limits: LayerLimits,
    budget: int,
    protected: Mapping[int, Sequence[int]] | None = None,
) -> list[list[int]]:
    """Per MoE layer (``limits`` order), the expert positions to drop: exactly ``budget`` in
    total, within every limit, with the least total keep score (module docstring).

    ``protected`` maps decoder layers to expert positions that must stay (the super experts).
    An unreachable budget is :class:`InfeasibleBudgetError`.
    """
    protected = protected or {}
    layers = len(limits.layers)
    if len(keep_scores) != layers:
        raise ValueError(f"{len(keep_scores)} score rows for {layers} MoE layers")
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0
    choices = []
    orders = []
    for i in range(layers):
        n, cap, m, g = limits.num_experts[i], limits.caps[i], limits.multiples[i], limits.groups[i]
        costs, per_group = _layer_costs(keep_scores[i], n, g, m, cap, protected.get(limits.layers[i], ()))
        orders.append(per_group)
        new = np.full(budget + 1, np.inf)
        choice = np.zeros(budget + 1, dtype=np.int64)
        for j, cost in enumerate(costs):
            r = j * m
            if r > budget:
                break
            if not np.isfinite(cost):
                break  # a protected expert would go: neither this count nor a larger one
            candidate = best[: budget + 1 - r] + cost
            better = candidate < new[r:]
            new[r:] = np.where(better, candidate, new[r:])
            choice[r:] = np.where(better, j, choice[r:])
        best = new
        choices.append(choice)
    if not np.isfinite(best[budget]):
        raise InfeasibleBudgetError(
            f"no allocation removes exactly {budget} experts within the per-layer limits "
            f"(caps {limits.caps}, multiples {limits.multiples})"
        )
    dropped: list[list[int]] = [[] for _ in range(layers)]
    left = budget
    for i in range(layers - 1, -1, -1):
        j = int(choices[i][left])
        per = j * limits.multiples[i] // limits.groups[i]
        dropped[i] = sorted(int(e) for ids in orders[i] for e in ids[:per])
        left -= j * limits.multiples[i]
    assert left == 0, "the backtrack spends the budget exactly"
    return dropped
