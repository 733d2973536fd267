"""`prune --method mixed --quantize auto:A,B --target-size T --allocation evo` without `--sparsity`:
each MoE layer's mixed forms (whole, narrowed to a width, novices, dropped) and its scheme searched
together under T (quantize/mixed_space.py).

Before loading (`mixed_joint_grid`): for each scheme, the smallest sparsity at which the uniform
mixed plan with that scheme in every layer fits T (the plan prepare checks the run at, the dry
run's table, and where the seeds come from); T is refused in one line when no scheme fits at any
sparsity the mixed shares reach.

After loading (`run_joint_mixed`), on the full-precision model:
1. one observation with the neuron statistics (the criterion's expert order, the neurons'
   importance, the novices' mean outputs) and the super-expert guard, as `prune` does;
2. the seeds: mixed's single-surgery recipes (search/mixed_space.py) at each grid point, each with
   that point's scheme in every layer, repaired into T; "quantize only" where it fits;
3. EvoESAP over joint candidates. A candidate runs virtually: its mixed plan (`mixed_plan` at the
   sparsity its genes keep, so the plan's widths are the genes' widths) through router slicing,
   neuron masks and novice outputs (`virtual_plan`), every layer's routed experts swapped for their
   round-to-nearest copies in its scheme (`LayerSwap`). The teacher is the unpruned full-precision
   model. A narrowed expert's down projection is quantized in groups along its full width there,
   along its kept neurons in the result: the search's scores approximate that layer's rounding, the
   bytes are exact.
The winner's genes go to `prune` (`RunOptions.removed`) at that sparsity, its schemes to
llm-compressor. With `--novice-rank R` every routed expert is fitted once as a rank-R novice first
(surgery/lowrank.py `fit_every_novice`): candidates score, and the result saves, those fits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from moeprune.allocate.fitness import check_fitness
from moeprune.allocate.limits import layer_limits
from moeprune.config import PruneConfig
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.kinds import Statistic
from moeprune.quantize.choice import LayerSwap, budget_per_scheme
from moeprune.quantize.evo import joint_document, joint_fingerprint
from moeprune.quantize.grid import criterion_orders
from moeprune.quantize.keeps import kept_precision_bytes, planned_keeps, scheme_bytes
from moeprune.quantize.mixed_space import JointGenes, MixedPrecisionSpace
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.per_layer import PrecisionTarget
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.evo import EvoResult, EvoSearch
from moeprune.search.mixed_space import MixedSpace
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import searches_schemes
from moeprune.search.run import run_seeded_search
from moeprune.surgery.lowrank import Fits, fit_every_novice
from moeprune.surgery.mixed import mixed_options, mixed_plan, stepped_costs
from moeprune.surgery.plans import virtual_plan
from moeprune.surgery.registry import PlanRequest, ResolvedConfig
from moeprune.surgery.sizes import WeightBytes, grid_steps


def check_joint_mixed(config: PruneConfig) -> None:
    """What the joint mixed search cannot run, refused in one line before loading."""
    if not searches_schemes(ResolvedConfig.of(config)):
        raise MoePruneError(
            "--method mixed with auto: and no --sparsity searches the forms and the schemes together: give "
            "--allocation evo, or --sparsity (its plan is then priced by what it keeps)",
            options=("allocation", "sparsity", "quantize"),
        )


def mixed_joint_grid(
    meta: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    size: WeightBytes,
    dtype_bytes: int,
    target: int,
) -> list[tuple[float, dict[str, int]]]:
    """Per scheme, the smallest sparsity (on surgery/sizes.py's grid) at which the uniform mixed plan
    with that scheme everywhere fits `target` (where the shares cannot narrow, e.g. experts one width
    step wide, mixed's uniform drop recipe: quantize/keeps.py `planned_keeps`), with the bytes of
    every layer at each scheme there; ascending, one point per distinct sparsity. Refused in one line
    when no scheme ever fits."""
    check_joint_mixed(config)
    schemes = tuple(options.candidates or ())

    refusals: list[str] = []

    def every_layer_at(sparsity: float) -> dict[str, int] | None:
        try:
            keeps = planned_keeps(meta, replace(config, sparsity=sparsity))
        except MoePruneError as error:  # the shares cannot reach this sparsity
            refusals.append(str(error))
            return None
        return budget_per_scheme(
            kept_precision_bytes(size, meta, schemes, options, dtype_bytes, keeps), schemes
        )

    points: dict[float, dict[str, int]] = {}
    closest: tuple[float, str, int] | None = None
    for scheme in schemes:

        def at(sparsity: float, scheme: str = scheme) -> int | None:
            per = every_layer_at(sparsity)
            return per[scheme] if per is not None else None

        steps = grid_steps(at, size.total, target)
        if steps and steps[-1][1] <= target:
            sparsity = steps[-1][0]
            points[sparsity] = cast(dict[str, int], every_layer_at(sparsity))
        elif steps and (closest is None or steps[-1][1] < closest[2]):
            closest = (steps[-1][0], scheme, steps[-1][1])
    if not points and closest is None:
        raise MoePruneError(
            f"no mixed plan exists at any sparsity here, so the forms cannot be searched with the schemes: "
            f"{refusals[-1] if refusals else 'no sparsity is plannable'}",
            options=("target_size", "quantize", "method"),
        )
    if not points:
        where = (
            f": with every layer in {closest[1]} at sparsity {closest[0]:g} it weighs {closest[2]:,} bytes"
            if closest
            else ""
        )
        raise MoePruneError(
            f"no mixed plan the shares reach fits the target {target:,} bytes{where}; raise the target, or "
            "change --mixed-whole / --mixed-novice",
            options=("target_size", "mixed_whole", "mixed_novice"),
        )
    return sorted(points.items())


def _seeds(
    space: MixedPrecisionSpace,
    moe: MoEModel,
    config: PruneConfig,
    grid: Sequence[tuple[float, dict[str, int]]],
    rng: np.random.Generator,
) -> dict[str, JointGenes]:
    """Mixed's recipes at each grid point with each scheme that fits there, repaired into T, and
    "quantize only" (every expert whole) per scheme where it fits (module docstring)."""
    options = mixed_options(config)
    limits = layer_limits(moe, config.expert_multiple)
    out: dict[str, JointGenes] = {}
    for s, scheme in enumerate(space.schemes):
        whole = tuple((c.experts, 0, 0, 0, c.width, s) for c in space.costs)
        if space.feasible(whole):
            out[f"quantize only {scheme}"] = whole
    for sparsity, per in grid:
        recipes = MixedSpace(list(space.costs), list(space.layers), sparsity).recipes(limits, options)
        for s, scheme in enumerate(space.schemes):
            if per[scheme] > space.target:
                continue
            for name, genes in recipes.items():
                if genes is None:
                    continue
                joint = tuple(
                    (g.whole, g.narrowed, g.novice, g.dropped, g.width if g.narrowed else c.width, s)
                    for g, c in zip(genes, space.costs)
                )
                fixed = space.repair(joint, rng)
                if fixed is not None and fixed not in out.values():
                    out[f"{name} {scheme} @{sparsity:.4g}"] = fixed
    if not out:
        raise MoePruneError(
            f"no mixed recipe fits the target {space.target:,} bytes within the layers' limits; raise the target",
            options=("target_size",),
        )
    return out


@contextmanager
def _candidate(
    moe: MoEModel,
    request: PlanRequest,
    space: MixedPrecisionSpace,
    swap: LayerSwap,
    candidate: JointGenes,
    fits: Fits | None,
) -> Iterator[None]:
    """The candidate applied virtually: its mixed plan (rank-R novices from `fits`), each layer's
    experts in its scheme."""
    plan = mixed_plan(replace(request, sparsity=space.sparsity(candidate)), space.genes(candidate))
    with ExitStack() as stack:
        stack.enter_context(virtual_plan(moe, plan, request.domains, fits))
        for position, scheme in enumerate(space.named(candidate)):
            stack.enter_context(swap.quantized(position, scheme))
        yield


@dataclass(frozen=True)
class JointMixed:
    """The joint mixed search's answer: what `prune` then runs."""

    genes: list[tuple[int, int, int, int, int]]  # the winner's, one tuple per MoE layer
    config: PruneConfig  # at the sparsity the genes keep, on the width steps searched
    quantize: QuantizeOptions  # with the chosen `layer_schemes`
    choice: dict[str, Any]  # report.json's `quantization.precision`
    search: dict[str, Any]  # search.json
    observed: tuple  # (criterion, scores, statistics) of the full model: prune reuses them
    novices: Fits | None = None  # with --novice-rank R, every routed expert's rank-R fit: prune saves them


def run_joint_mixed(
    full: MoEModel,
    config: PruneConfig,
    quantize: QuantizeOptions,
    target: PrecisionTarget,
    calibration: Sequence[CalibrationData],
    data: CalibrationData,
    runtime: SearchRuntime,
) -> JointMixed:
    """The joint search on the full model (module docstring)."""
    check_joint_mixed(config)
    fitness = check_fitness(config.search.fitness)
    pad = runtime.pad_token_id or 0
    orders, observed = criterion_orders(
        full, config, calibration, runtime.batch_size, pad, runtime.progress, frozenset({Statistic.NEURONS})
    )
    crit, scores, stats = observed
    options = mixed_options(config)
    fits = None
    if options.novice_rank:  # every expert fitted once: candidates score the novices they would save
        fits = fit_every_novice(
            full,
            options.novice_rank,
            list(calibration),
            batch_size=runtime.batch_size,
            pad_token_id=pad,
            progress=runtime.progress,
        )
    limits = layer_limits(full, config.expert_multiple)
    grid = list(target.grid)
    costs = stepped_costs(full, limits, grid[0][0], options)
    steps = {c.step for c in costs}
    if options.width_multiple is None and len(steps) == 1:  # the plan's steps, whatever its sparsity
        options = replace(options, width_multiple=steps.pop())
        config = replace(config, options=options)
    per = scheme_bytes(target.size, full, target.schemes, quantize, target.dtype_bytes)
    layers = tuple(m.index for m in full.layers)
    space = MixedPrecisionSpace(tuple(costs), layers, per, target.target_bytes, options.novice_rank)
    rng = np.random.default_rng(config.search.seed)
    seeds = _seeds(space, full, config, grid, rng)
    ordered = protected_order(scores, full.protected)
    request = PlanRequest(
        full,
        crit,
        ordered,
        grid[0][0],
        "evo",
        config.method,  # the method's own plan builder makes the candidates' plans (its own genes)
        stats=stats,
        expert_multiple=config.expert_multiple,
        options=options,
    )
    swap = LayerSwap(full, quantize.group)
    calibrated = [s.data_fingerprint for s in stats]
    fingerprint = joint_fingerprint(full, config, space.schemes, quantize.group, data, calibration=calibrated)
    result, search, evaluator = run_seeded_search(
        lambda evaluate, io: EvoSearch(evaluate, space, seeds, config.search, io=io),
        full,
        data,
        orders,
        fingerprint=fingerprint,
        runtime=runtime,
        plan_context=lambda _, c: _candidate(full, request, space, swap, c, fits),
    )
    best = cast(JointGenes, result.best)
    cache = cast(dict[Any, float], search.cache)
    document = _document(space, seeds, cache, result, config, evaluator)
    evaluator.release()
    choice = _choice(space, best, fitness, document)
    choice["seed_fitness"] = {name: row["fitness_value"] for name, row in document["seeds"].items()}
    genes = [(w, n, v, d, width) for w, n, v, d, width, _ in best]
    pruned = replace(config, sparsity=space.sparsity(best)) if space.sparsity(best) > 0 else config
    schemes = replace(quantize, layer_schemes=dict(zip(layers, space.named(best))))
    return JointMixed(genes, pruned, schemes, choice, document, observed, fits)


def _document(
    space: MixedPrecisionSpace,
    seeds: dict[str, JointGenes],
    cache: dict[Any, float],
    result: EvoResult,
    config: PruneConfig,
    evaluator: CandidateEvaluator,
) -> dict[str, Any]:
    """search.json of the joint mixed search."""
    best = cast(JointGenes, result.best)
    head = {
        "space": "mixed genes (whole, narrowed, novice, dropped, width) and scheme per MoE layer, under "
        "the target bytes",
        **space.summary(),
        "sparsity": space.sparsity(best),
    }
    layout = lambda c: {"genes": [list(g[:5]) for g in c]}  # noqa: E731
    return joint_document(space, seeds, cache, result, config, evaluator, layout, head)


def _choice(
    space: MixedPrecisionSpace, best: JointGenes, fitness: str, document: dict[str, Any]
) -> dict[str, Any]:
    """report.json's `quantization.precision` for the joint mixed search's winner."""
    keys = [str(i) for i in space.layers]
    return {
        "schemes": list(space.schemes),
        "base_scheme": space.schemes[0],
        "fitness": fitness,
        "search": "evo (mixed forms and schemes per layer together)",
        "target_bytes": space.target,
        "mixed_genes": dict(zip(keys, (list(g[:5]) for g in best))),
        "chosen": dict(zip(keys, space.named(best))),
        "predicted_bytes": space.bytes(best),
        "search_fitness": document["fitness_value"],
    }


__all__ = ["JointMixed", "check_joint_mixed", "mixed_joint_grid", "run_joint_mixed"]
