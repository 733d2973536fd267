"""`prune --quantize auto:A,B --target-size T` without `--sparsity`: the sparsity chosen together
with the per-layer schemes.

Why a grid and not a search: between the sparsity where every layer at the cheapest scheme just
fits T (fewest experts removed, fewest bits) and the one where every layer at the most expensive
scheme fits (more experts removed, more bits), the best trade is somewhere in between; a handful of
points (`--quant-sparsity-grid`, default 4) spans it, each costing layers x schemes + 1 evaluations.

For each point: the uniform split at that sparsity in the criterion's order (uniform for every
configured allocation, to keep it cheap: an evo search per point would cost a search each), the
per-layer losses on the full model with those experts masked (`measure_losses`), the exact choice
under T, and one more evaluation with every chosen layer fake-quantized at once: that combined
fitness ranks the points. The configured allocation then runs at the best point and the schemes are
chosen again on its own split (quantize/per_layer.py), so the result is what `--sparsity` at that
point would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from moeprune.allocate.basic import uniform_allocation
from moeprune.config import PruneConfig
from moeprune.criteria import score_experts
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.kinds import NONE, Statistics
from moeprune.quantize.choice import (
    LayerSwap,
    budget_per_scheme,
    choose_schemes,
    measure_losses,
    precision_bytes,
)
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.per_layer import JOINT_PLACEHOLDER
from moeprune.search.candidates import CandidateEvaluator
from moeprune.surgery.planning import guard_super_experts, requirements
from moeprune.surgery.registry import ResolvedConfig
from moeprune.surgery.sizes import WeightBytes


def criterion_orders(
    moe: MoEModel,
    config: PruneConfig,
    calibration: Sequence[CalibrationData],
    batch_size: int,
    pad: int,
    progress: bool,
    statistics: Statistics = NONE,
) -> tuple[list[list[int]], tuple]:
    """Each MoE layer's pruning order under the configured criterion (observed on the calibration
    data as prune does, with what the config needs and `statistics` besides), the guarded super
    experts last: what the grid's uniform splits remove and the joint searches mask; and the
    observation itself, (criterion, scores, statistics), which `prune` then reuses
    (`RunOptions.observed`) instead of a second pass over the same data. The teacher set-up of
    every joint search (grid.py, evo.py, mixed.py)."""
    observed = score_experts(
        moe,
        config.criterion,
        list(calibration),
        batch_size=batch_size,
        pad_token_id=pad,
        seed=config.seed,
        progress=progress,
        statistics=requirements(config).statistics | statistics,
    )
    _, scores, stats = observed
    guard_super_experts(moe, config, stats)
    return [list(s.order) for s in protected_order(scores, moe.protected)], observed


def uniform_split(moe: MoEModel, config: PruneConfig, sparsity: float) -> list[int]:
    """Experts removed per MoE layer by the uniform allocation at `sparsity` (0: none, the
    "quantize only" point)."""
    if sparsity == 0:
        return [0] * len(moe.layers)
    limits = ResolvedConfig.of(config).limits(moe)
    return uniform_allocation(limits.budget(sparsity), limits.num_experts, limits.top_k, **limits.as_kwargs())


def sparsity_grid(
    meta: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    size: WeightBytes,
    dtype_bytes: int,
    target: int,
) -> list[tuple[float, dict[str, int]]]:
    """The grid's sparsities, ascending, each with the bytes of every layer at each scheme (its
    uniform split): `options.sparsity_grid` points from the smallest sparsity where the cheapest
    scheme fits `target` to the smallest where the most expensive one does (or the largest
    sparsity, when none does); refused in one line when even the cheapest never fits. Sparsity 0
    (every expert kept, the whole model quantized) is the first point whenever it fits."""
    assert options.candidates is not None
    limits = ResolvedConfig.of(config).limits(meta)
    total = limits.prunable_experts
    steps = [0.0]  # quantize only, then every sparsity whose budget a uniform split meets, ascending
    for budget in range(1, total + 1):
        sparsity = budget / total
        try:
            if limits.budget(sparsity) != budget:
                continue
            uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
        except MoePruneError:  # past the feasible range, or a budget the per-layer limits cannot split
            continue
        steps.append(sparsity)
    if len(steps) == 1:
        raise MoePruneError("no sparsity removes any expert here: give --sparsity", options=("sparsity",))

    def per_scheme(i: int) -> dict[str, int]:
        removed = uniform_split(meta, config, steps[i])
        pb = precision_bytes(size, meta, options.candidates or (), options, dtype_bytes, removed)
        return budget_per_scheme(pb, options.candidates or ())

    def first_fit(fits) -> int | None:  # bytes fall as the sparsity rises: a binary search
        low, high = 0, len(steps)
        while low < high:
            mid = (low + high) // 2
            if fits(per_scheme(mid)):
                high = mid
            else:
                low = mid + 1
        return low if low < len(steps) else None

    cheap = first_fit(lambda per: min(per.values()) <= target)
    if cheap is None:
        last = per_scheme(len(steps) - 1)
        scheme = min(last, key=lambda s: last[s])
        raise MoePruneError(
            f"even with every layer in {scheme} at sparsity {steps[-1]:g} the result weighs {last[scheme]:,} "
            f"bytes, over the target {target:,}: raise the target",
            options=("target_size", "quantize"),
        )
    rich = first_fit(lambda per: max(per.values()) <= target)
    rich = len(steps) - 1 if rich is None else rich
    points = options.sparsity_grid
    if points == 1:
        picked = [cheap]
    else:
        picked = sorted({round(cheap + k * (rich - cheap) / (points - 1)) for k in range(points)})
    return [(steps[i], per_scheme(i)) for i in picked]


def planning_sparsity(grid: Sequence[tuple[float, Any]]) -> float:
    """The sparsity a joint job is planned and checked at before its point is chosen: the grid's
    first that removes experts (a config's sparsity is above 0), else the placeholder."""
    return next((s for s, _ in grid if s > 0), JOINT_PLACEHOLDER)


def combined_fitness(
    evaluator: CandidateEvaluator, moe: MoEModel, removed: Sequence[int], choice: Sequence[str], group: int
) -> float:
    """The evaluator's value with every layer's experts fake-quantized in its chosen scheme at
    once, the allocation `removed` masked."""
    swap = LayerSwap(moe, group)
    with ExitStack() as stack:
        for position, scheme in enumerate(choice):
            stack.enter_context(swap.quantized(position, scheme))
        evaluator.prefix_cache.clear()
        value = evaluator.evaluate(removed)
    evaluator.prefix_cache.clear()
    return value


def choose_sparsity(
    evaluator: CandidateEvaluator,
    moe: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    grid: Sequence[float],
    size: WeightBytes,
    dtype_bytes: int,
    target: int,
) -> tuple[float, list[dict[str, Any]]]:
    """The grid point of best combined fitness, and report.json's rows (one per point). `moe` is
    the full model, `evaluator` built on it with the criterion's pruning orders."""
    schemes = options.candidates or ()
    rows, fitness = [], []
    for sparsity in grid:
        removed = uniform_split(moe, config, sparsity)
        pb = precision_bytes(size, moe, schemes, options, dtype_bytes, removed)
        losses = measure_losses(evaluator, moe, removed, schemes, options.group)
        choice = choose_schemes(pb, losses, target)
        rows.append(
            {
                "sparsity": sparsity,
                "removed_per_layer": dict(zip((str(m.index) for m in moe.layers), removed)),
                "chosen": dict(zip((str(m.index) for m in moe.layers), choice)),
                "predicted_bytes": pb.total(choice),
                "summed_loss": sum(row[s] for row, s in zip(losses, choice)),
            }
        )
        fitness.append(combined_fitness(evaluator, moe, removed, choice, options.group))
        rows[-1]["fitness"] = fitness[-1]
    best = max(range(len(rows)), key=lambda i: (fitness[i], -grid[i]))
    return float(grid[best]), rows


__all__ = [
    "planning_sparsity",
    "choose_sparsity",
    "combined_fitness",
    "criterion_orders",
    "sparsity_grid",
    "uniform_split",
]
