"""The bytes a prune will write, from the model's structure alone, and the sparsity a size target asks for.

`--target-size` names what a user has (a disk, a GPU), not a sparsity. Every method's result is
the unpruned weights minus what its plan removes, and what each plan removes is known before
any weight is read: drop and novice take per-layer expert counts (`check_feasible`'s budget
and allocation), neurons one width per layer (`uniform_widths`), TENP whole experts and one
neuron share (`trapezoid_allocation`). So a `WeightBytes` (the unpruned model's bytes in the
format the result is saved in, and what one expert, one neuron, one router row weigh there; made
from the checkpoint's headers by moeprune.shards.weight_bytes) and the config give the planned bytes, and
the smallest sparsity whose planned bytes fit is found by walking the plans in order.

The planned size never grows with the sparsity, and it moves in steps, because plans are made of
whole experts and whole neurons:

- drop/novice: sparsity B / N for B experts removed of N (the budget `round(S * N)` then is B);
  the solved B is the smallest feasible budget that fits, and B - 1 (or the next feasible budget
  below) does not. The global and evo allocations choose per-layer counts from scores; where
  experts weigh differently per layer, their size is bounded by the worst case (the cheapest
  experts removed first), so the result fits whatever the scores say.
- neurons: the widths are multiples of each layer's width step (`--width-multiple`,
  surgery/widths.py; `uniform_keep`); the solved sparsity is the share of routed-expert parameters
  the chosen width removes, and one width step wider does not fit. Super experts kept whole
  (the guard) keep a layer at most what its ENP width keeps, so the plan still fits.
- tenp: the sparsity is continuous (the kept parameters meet it within one neuron); it is solved
  on a grid of 1e-4 and 1e-4 lower does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from moeprune.allocate.basic import uniform_allocation
from moeprune.allocate.limits import LayerLimits
from moeprune.config import PruneConfig, parse_target_size
from moeprune.errors import InfeasibleBudgetError, MoePruneError
from moeprune.models import MoEModel
from moeprune.surgery.registry import EXPERTS, ResolvedConfig
from moeprune.surgery.sizes import WeightBytes, keeps_bytes, removal_keeps

TARGET = ("target_size",)


def _check_layers(moe: MoEModel, size: WeightBytes) -> None:
    if len(size.layers) != len(moe.layers):
        raise MoePruneError(
            f"the size model has {len(size.layers)} MoE layers, the model {len(moe.layers)}"
        )  # pragma: no cover - both are read off the same checkpoint


def _saved(size: WeightBytes, novice: bool, rank: int) -> list[int]:
    """Bytes one removed expert takes per layer: its weights and router rows, or (a novice keeps
    its router row and a vector; rank R: d + 2dR values) its weights less the vector."""
    return [
        lay.expert() - lay.novice * (1 + 2 * rank) if novice else lay.expert() + lay.router_row
        for lay in size.layers
    ]


def _worst_removal(saved: list[int], budget: int, limits: LayerLimits) -> list[int]:
    """The allocation of `budget` experts within the caps that removes the fewest bytes (the cheapest
    experts first): a bound that holds whatever per-layer counts the scores or a search pick."""
    left, out = budget, [0] * len(saved)
    for pos in sorted(range(len(saved)), key=lambda p: saved[p]):
        out[pos] = min(left, limits.caps[pos])
        left -= out[pos]
    return out


def expert_plan_bytes(moe: MoEModel, config: PruneConfig, size: WeightBytes, budget: int) -> int:
    """Planned bytes of an expert method removing `budget` experts (InfeasibleBudgetError when
    no allocation can remove exactly that many under the per-layer limits): the uniform plan's
    keeps for a fixed allocation, else the worst case's, priced by `kept_bytes`."""
    config = ResolvedConfig.of(config)
    novice = config.surgery.keeps_routing  # drop --reroute none: as novices
    limits = config.limits(moe)
    removed = uniform_allocation(
        budget, limits.num_experts, limits.top_k, **limits.as_kwargs()
    )  # also refuses an unreachable budget
    rank = config.options.novice_rank
    if not config.allocator.fixed:
        removed = _worst_removal(_saved(size, novice, rank), budget, limits)
    return keeps_bytes(size, removal_keeps(size, removed, novice), rank)


def planned_bytes(moe: MoEModel, config: PruneConfig, size: WeightBytes) -> int:
    """Bytes of weights the plan of `config` (its sparsity set) leaves, in `size`'s format: exact
    for the uniform allocation and the neuron methods (what `Method.planned_keeps` says each
    layer keeps, priced by `kept_bytes`), an upper bound for global and evo."""
    config = ResolvedConfig.of(config)
    _check_layers(moe, size)
    assert config.sparsity is not None, "planned_bytes needs a sparsity"
    method = config.method_spec
    if method.sparsity_unit == EXPERTS:
        limits = config.limits(moe)
        budget = limits.budget(config.sparsity)
        return expert_plan_bytes(moe, config, size, budget)
    if not size.linear_neurons:
        raise MoePruneError(
            f"the {config.method} method narrows experts; this checkpoint's {size.format} weights "
            "are stored in blocks, so their narrowed size is not planned here",
            options=("method",),
        )
    assert method.planned_keeps is not None, f"method {method.name} registered without planned_keeps"
    return keeps_bytes(size, method.planned_keeps(moe, config), config.options.novice_rank)


@dataclass(frozen=True)
class TargetSolution:
    """The solved sparsity of a target size, and the sizes around it (report.json's `target`)."""

    target_bytes: int
    sparsity: float
    predicted_bytes: int  # the planned weights at `sparsity`
    unpruned_bytes: int  # the same model unpruned, in the output's format
    step_below: float  # the next lower sparsity step, whose plan does not fit (0: the unpruned model)
    step_below_bytes: int


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _expert_search(
    moe: MoEModel, config: ResolvedConfig, size: WeightBytes, target: int, stock: bool
) -> list[tuple[float, int]]:
    """(sparsity B / N, planned bytes) of the smallest feasible budget B that fits, preceded by the
    feasible budget below it (which does not); [the largest feasible budget] when none fits.

    With `stock` only budgets whose uniform plan keeps the same count in every layer (what a
    stock config expresses: the no-load rewrite writes nothing else). The planned bytes never
    grow with B, and no budget below `(total - target) / (the heaviest expert)` can fit, so the
    walk starts there instead of at 1 (a 58 x 256-expert model has 14,848 budgets; starting there, 48 x 128 solves in 10 ms instead of 15 s).
    """
    limits = config.limits(moe)
    experts, most = limits.prunable_experts, sum(limits.caps)  # a sparsity counts prunable layers only

    def planned(budget: int) -> int | None:
        try:
            value = expert_plan_bytes(moe, config, size, budget)
        except InfeasibleBudgetError:  # not a sum of per-layer multiples within the caps
            return None
        if stock:
            removed = uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
            if len({n - r for n, r in zip(limits.num_experts, removed)}) > 1:
                return None
        return value

    heaviest = max(_saved(size, config.surgery.keeps_routing, config.options.novice_rank))
    start = max(1, math.ceil((size.total - target) / heaviest)) if heaviest > 0 else most + 1
    for budget in range(start, most + 1):
        value = planned(budget)
        if value is not None and value <= target:
            below = next(((b, v) for b in range(budget - 1, 0, -1) if (v := planned(b)) is not None), None)
            return [*([(below[0] / experts, below[1])] if below else []), (budget / experts, value)]
    last = next(((b, v) for b in range(most, 0, -1) if (v := planned(b)) is not None), None)
    return [(last[0] / experts, last[1])] if last else []


def solve_target(
    moe: MoEModel, config: PruneConfig, size: WeightBytes, target: int, *, stock: bool = False
) -> TargetSolution:
    """The smallest sparsity step whose planned weights fit in `target` bytes; refused in one line
    (before any weight is read) when the unpruned model already fits or no plan is small enough.
    `stock`: only plans a stock config expresses (the same expert count in every layer)."""
    config = ResolvedConfig.of(config)
    _check_layers(moe, size)
    if target >= size.total:
        raise MoePruneError(
            f"the unpruned model already fits: {_human(size.total)} ({size.total:,} bytes) of "
            f"{size.format} weights <= the target {_human(target)} ({target:,} bytes); nothing needs "
            "pruning (lower the target size, or give a sparsity)",
            options=TARGET,
        )
    method = config.method_spec
    steps: list[tuple[float, int]]
    if method.sparsity_unit == EXPERTS:
        steps = _expert_search(moe, config, size, target, stock)
    elif not size.linear_neurons:
        raise MoePruneError(
            f"the {config.method} method narrows experts; a target size for {size.format} weights "
            "is planned for the drop method only",
            options=("method", *TARGET),
        )
    else:
        assert method.target_steps is not None, f"method {method.name} registered without target_steps"
        steps = method.target_steps(moe, config, size, target)
    fitting = next((i for i, (_, b) in enumerate(steps) if b <= target), None)
    if fitting is None:
        smallest = min((b for _, b in steps), default=size.total)
        what = _what_stays(config)
        raise MoePruneError(
            f"no {config.method} plan fits in {_human(target)} ({target:,} bytes): the smallest "
            f"reachable is {_human(smallest)} ({smallest:,} bytes) of {size.format} weights ({what})",
            options=TARGET,
        )
    sparsity, predicted = steps[fitting]
    below = steps[fitting - 1] if fitting else (0.0, size.total)  # below the first step: unpruned
    return TargetSolution(target, sparsity, predicted, size.total, below[0], below[1])


def _what_stays(config: ResolvedConfig) -> str:
    what: dict[str, Callable[[], str]] = {
        EXPERTS: lambda: (
            "every layer keeps at least its top-k experts"
            + (f" in multiples of {config.expert_multiple}" if config.expert_multiple > 1 else "")
        ),
    }
    unit = config.method_spec.sparsity_unit
    return what.get(unit, lambda: "every routed expert keeps at least one block of neurons")()


def check_target_config(config: PruneConfig) -> int | None:
    """The target's bytes, or None without one; both a sparsity and a target is refused, and a
    config with neither says what to give. Before anything runs."""
    if config.target_size is None:
        if config.sparsity is None:
            raise MoePruneError("give a sparsity or a target size", options=("sparsity", *TARGET))
        return None
    if config.sparsity is not None:
        raise MoePruneError(
            f"give a sparsity ({config.sparsity}) or a target size ({config.target_size}), not both: "
            "the target size solves the sparsity",
            options=("sparsity", *TARGET),
        )
    return parse_target_size(config.target_size)
