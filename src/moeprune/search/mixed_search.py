"""EvoESAP over mixed genes (`--method mixed --allocation evo`): the search and its driver.

The loop, the fitness cache, the checkpoint, `--resume` and `--patience` are EvoSearch's
(search/evo.py); only the space differs (search/mixed_space.py: seeds, mutation, the exact budget).
A candidate runs virtually, like a drop candidate: its plan (`mixed_plan`) is applied with router
slicing, neuron masks and novice outputs (`virtual_plan`), never by copying weights; the prefix
cache is keyed by each layer's counts and filled widths, which decide that layer exactly.

With `--novice-rank R` a candidate's novices are the rank-R fits of its novice experts, taken
from `novices`: every routed expert fitted once before the search (surgery/lowrank.py
`fit_every_novice`), so a candidate is scored with the novices its plan would save, and the
final plan takes the same fits (`fit_novices(..., fitted=novices)`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from moeprune.allocate.fitness import check_fitness
from moeprune.allocate.limits import layer_limits
from moeprune.config import PruneConfig
from moeprune.criteria import Criterion, LayerScores
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.runtime.distributed import rank_and_world
from moeprune.search.document import SearchDocument, evo_settings, evo_timings
from moeprune.search.evo import EvoSearch, generations_document
from moeprune.search.mixed_space import Genes, MixedSpace, as_genes
from moeprune.search.options import SearchRuntime
from moeprune.search.run import model_fingerprint, run_seeded_search
from moeprune.search.space import listed
from moeprune.surgery.lowrank import Fits, moments_bytes
from moeprune.surgery.mixed import mixed_options, mixed_plan, stepped_costs
from moeprune.surgery.plans import virtual_plan
from moeprune.surgery.registry import PlanRequest


def check_mixed_seeds(moe: MoEModel, config: PruneConfig) -> None:
    """Refuse, before loading, a sparsity that no mixed recipe meets within the layers' limits (the
    search's seeds: a meta-device model does). The uniform shares alone may miss it (experts one
    width step wide cannot be narrowed): the search then starts from the recipes that do."""
    options = mixed_options(config)
    sparsity = config.sparsity_value()
    limits = layer_limits(moe, config.expert_multiple)
    MixedSpace(stepped_costs(moe, limits, sparsity, options), limits.layers, sparsity).seeds(limits, options)


def search_mixed(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    stats: Sequence[ExpertStats],
    search_set: CalibrationData,
    *,
    config: PruneConfig,
    runtime: SearchRuntime | None = None,
    novices: Fits | None = None,
) -> tuple[list[tuple[int, int, int, int, int]], dict[str, Any]]:
    """The best mixed genes on the search data (one tuple per MoE layer) and search.json.
    `novices`: with a novice rank R > 0, every routed expert's rank-R fit (`fit_every_novice`)."""
    runtime = runtime or SearchRuntime()
    rank, _ = rank_and_world()
    search_config = config.search
    fitness = check_fitness(search_config.fitness)
    options = mixed_options(config)  # a dict of fields (an unchecked config) too: its rank counts
    sparsity = config.sparsity_value()
    rank = options.novice_rank
    fits = _rank_fits(rank, novices)
    limits = layer_limits(moe, config.expert_multiple)
    space = MixedSpace(stepped_costs(moe, limits, sparsity, options), limits.layers, sparsity)
    seeds = space.seeds(limits, options)
    ordered = protected_order(scores, moe.protected)  # super experts last: dropped never, whole first
    request = PlanRequest(
        moe,
        criterion,
        ordered,
        sparsity,
        "evo",
        "mixed",
        stats=stats,
        expert_multiple=config.expert_multiple,
        options=options,
    )
    domains = request.domains

    def plan_context(_, candidate: Genes):
        return virtual_plan(moe, mixed_plan(request, as_genes(candidate)), domains, fits)

    fingerprint = {
        "model": model_fingerprint(moe),
        "criterion": criterion.name,
        "method": "mixed",
        "sparsity": config.sparsity,
        **({"novice_rank": rank} if rank else {}),  # rank 0: the same state as before ranks existed
        "calibration": [s.data_fingerprint for s in stats],
        "fitness": fitness,
        "search_data": search_set.fingerprint,
    }
    start = time.perf_counter()
    result, search, evaluator = run_seeded_search(
        lambda evaluate, io: EvoSearch(evaluate, space, seeds, search_config, io=io),
        moe,
        search_set,
        [s.order for s in ordered],
        fingerprint=fingerprint,
        runtime=runtime,
        plan_context=plan_context,
        prefix_key=space.prefix_key,
    )
    seconds = time.perf_counter() - start
    sign = evaluator.sign
    best = cast(Genes, result.best)  # EvoSearch keys candidates as tuples: here, of genes
    cache = cast(dict[Any, float], search.cache)
    document = SearchDocument(
        fitness=fitness,
        higher_is_better=sign > 0,
        space="mixed genes (whole, narrowed, novice, dropped, width) per MoE layer",
        config=evo_settings(search_config),
        found={
            "layers": limits.layers,
            "routed_parameters_target": space.target,
            **_novice_note(moe, rank),
            "genes": listed(best),
            "narrowed_neurons": space.widths(best),
        },
        fitness_value=sign * result.best_fitness,
        references={
            "seeds": {
                name: {"genes": listed(g), "fitness_value": sign * cache[g]} for name, g in seeds.items()
            }
        },
        evaluations=result.evaluations,
        stopped=result.stopped,
        history={"generations": generations_document(result.history, sign, "best_genes")},
        **evaluator.data_summary(),
        timings_s=evo_timings(evaluator.teacher_seconds, seconds, evaluator.counters["candidates"]),
        speed={"speedups": {"resume_mode": evaluator.mode, **evaluator.counters}},
    ).to_json()
    evaluator.release()
    return list(best), document


def _rank_fits(rank: int, novices: Fits | None) -> Fits | None:
    """The fits a rank-`rank` search scores its novices with (none at rank 0: constant novices)."""
    if rank and novices is None:
        raise MoePruneError(
            f"a mixed search with --novice-rank {rank} scores rank-{rank} novices: fit every expert first "
            "(surgery/lowrank.py fit_every_novice) and pass them as novices"
        )
    return novices if rank else None


def _novice_note(moe: MoEModel, rank: int) -> dict[str, Any]:
    """search.json's novice rank and the moments its fits read (nothing at rank 0)."""
    if not rank:
        return {}
    experts = {m.index: range(m.num_experts) for m in moe.layers}
    return {"novice_rank": rank, "novice_moments_bytes": moments_bytes(moe, experts)}
