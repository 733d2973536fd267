"""EvoESAP on a real model: the search driver (checkpointed, resumable, split over torchrun ranks)
and search.json.

Data-parallel search (under ``torchrun``, world size W > 1): every rank holds the whole model and
the search set and does its own teacher pass. Each generation's new allocations (not cached,
deduplicated, in population order) are split round-robin over the ranks (rank r takes positions
r, r+W, ...), each rank evaluates its share, and the results (fitness, raced or not) are merged
with ``all_gather_object`` into every rank's fitness cache, in population order: every rank
holds the same cache, population and RNG state. A candidate's fitness does not depend on what
its rank evaluated before (prefix reuse is bitwise exact), and racing uses the elite threshold of
the cache at the start of the generation (one process raises it as the generation goes), so
elites, the per-generation best and the result are identical to one process for a fixed seed.
Raced candidates' partial fitnesses, and so a generation's mean, may differ. Rank 0 alone writes
the search state and the race log (every rank reads them to resume); the state is saved at
generation boundaries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moeprune.allocate.basic import uniform_allocation
from moeprune.allocate.fitness import check_fitness
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import Criterion, LayerScores
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.runtime.atomic import write_json
from moeprune.runtime.distributed import all_gather_objects, rank_and_world, split_map
from moeprune.search.candidates import TEXT_ONLY_NOTE, CandidateEvaluator
from moeprune.search.document import SearchDocument, evo_settings, evo_timings
from moeprune.search.evo import Allocation, EvoIO, EvoResult, EvoSearch, generations_document
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import SEARCHES, Search, Searched, SearchJob
from moeprune.surgery.registry import COUNTS

_LOG = logging.getLogger(__name__)
SEARCH_STATE = "search_state.json"


def _elite_threshold(cache: Mapping[Allocation, float], elites: int) -> float | None:
    """The m-th best fitness evaluated so far (elites are always the top m of everything seen)."""
    if len(cache) < elites:
        return None
    return sorted(cache.values(), reverse=True)[elites - 1]


def _raced_path(state_path: Path | None) -> Path | None:
    return None if state_path is None else state_path.with_name(state_path.name + ".raced.json")


class _RaceLog:
    """Which evaluations were raced, in which generation; persisted beside the search state.

    A fresh search removes an old log; an allocation raced again after a crash is logged once.
    With ``write=False`` (every torchrun rank but 0) the log is read for a resume, never written.
    """

    def __init__(self, path: Path | None, resume: bool, write: bool = True) -> None:
        self.path = path
        self.write = write
        self.entries: dict[Allocation, dict[str, Any]] = {}
        if path is not None and not resume:
            if write:
                path.unlink(missing_ok=True)
        elif path is not None and path.is_file():
            self.entries = {tuple(e["allocation"]): e for e in json.loads(path.read_text())["raced"]}

    def add(self, allocation: Allocation, generation: int, samples: int) -> None:
        entry = {"allocation": list(allocation), "generation": generation, "samples_scored": samples}
        self.entries[allocation] = entry
        if self.path is not None and self.write:
            write_json(self.path, {"raced": self.listed()})

    def listed(self) -> list[dict[str, Any]]:
        return list(self.entries.values())

    def per_generation(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for entry in self.entries.values():
            counts[entry["generation"]] = counts.get(entry["generation"], 0) + 1
        return counts


def run_evo_search(
    moe: MoEModel,
    search_data: CalibrationData,
    orders: Sequence[Sequence[int]],
    budget: int,
    *,
    config: SearchConfig,
    fingerprint: Mapping[str, Any],
    runtime: SearchRuntime | None = None,
    expert_multiple: int = 1,
) -> tuple[list[int], dict[str, Any]]:
    """EvoESAP over ``moe``: the best allocation (experts removed per MoE layer) and ``search.json``.

    What is searched: ``config`` (the settings and the fitness), ``budget``, ``expert_multiple``
    (every candidate keeps multiples of it). How it runs: ``runtime`` (batch size, speed-ups,
    progress, the method's virtual form, the checkpoint at ``state_path`` and ``resume``), which
    never changes the result. Bad input fails before the teacher pass: an unknown fitness,
    population < elites, or a budget no feasible allocation meets. ``fingerprint`` (model, data,
    criterion, ...) and the fitness name must match the saved state for ``resume``. Under torchrun
    (a joined process group, world > 1) every rank calls this with the same arguments: candidates
    are split over the ranks (module docstring), every rank returns the same allocation, and rank 0
    alone writes ``state_path`` and its race log.
    """
    runtime = runtime or SearchRuntime()
    fitness = check_fitness(config.fitness)
    limits = layer_limits(moe, expert_multiple)  # every candidate keeps multiples of expert_multiple
    uniform = uniform_allocation(
        budget, limits.num_experts, limits.top_k, multiple_of=limits.multiples, max_removed=limits.caps
    )  # raises InfeasibleBudgetError with the reason
    path = Path(runtime.state_path) if runtime.state_path is not None else None
    resume, race = runtime.resume, runtime.race
    if resume and (path is None or not path.is_file()):
        raise MoePruneError(f"cannot resume: no search state at {path}; run without resume")
    rank, world = rank_and_world()  # under torchrun: candidates split over ranks, rank 0 writes
    race_log = _RaceLog(_raced_path(path), resume, write=rank == 0)
    evaluator: CandidateEvaluator | None = None  # built below, after the cheap checks

    def built() -> CandidateEvaluator:  # the search only evaluates in search.run(), after it is built
        assert evaluator is not None, "a candidate evaluated before the evaluator was built"
        return evaluator

    parallel = _DataParallel(built, lambda: search, race_log, race) if world > 1 else None
    search = EvoSearch.counts(  # validates the config (population >= elites) before any model runs
        lambda allocation: _evaluate(built(), search, race_log, allocation, race),
        budget,
        limits.caps,
        uniform,
        config,
        limits.multiples,
        io=EvoIO(
            state_path=path,
            fingerprint={**fingerprint, "fitness": fitness, "search_data": search_data.fingerprint},
            progress=runtime.progress and rank == 0,
            write_state=rank == 0,
        ),
        evaluate_many=parallel,
    )
    if search_data.text_only:
        _LOG.warning(TEXT_ONLY_NOTE)
    start = time.perf_counter()
    evaluator = CandidateEvaluator(
        moe,
        search_data,
        orders,
        fitness=fitness,
        seed=config.seed,
        runtime=replace(runtime, progress=runtime.progress and rank == 0),
    )
    result = search.run(resume=resume, carry=runtime.continuation)
    seconds = time.perf_counter() - start
    document = _search_document(
        evaluator, search, result, race_log, limits, race, seconds, _totals(evaluator, world)
    )
    evaluator.release()  # the search and its closures form cycles: free the caches now, not at the next gc
    return list(result.best), document


def _totals(evaluator: CandidateEvaluator, world: int) -> tuple[dict[str, int], dict[str, Any] | None]:
    """The speedup counters (summed over ranks under torchrun) and, under torchrun, how the search
    was split. Every rank reaches this collective once, after the last generation."""
    counters = dict(evaluator.counters)
    if world <= 1:
        return counters, None
    per_rank = all_gather_objects(evaluator.counters)
    counters = {k: sum(c[k] for c in per_rank) for k in counters}
    distributed = {
        "world_size": world,
        "backend": torch.distributed.get_backend(),
        "evaluations_per_rank": [c["candidates"] for c in per_rank],
        "racing_threshold": "elite threshold at the start of each generation",
        "note": "candidates evaluated in parallel over ranks; elites and result equal one process,"
        " raced candidates' partial fitnesses (and generation means) may differ",
    }
    return counters, distributed


class _DataParallel:
    """``EvoSearch.evaluate_many`` under torchrun: one generation's new allocations, split over ranks.

    Rank r evaluates positions r, r+W, ... of ``allocations`` (``distributed.split_map``) against
    the elite threshold of the cache at the start of the generation, so its results do not depend
    on which candidates the other ranks got; every rank gets all (fitness, samples scored if
    raced) pairs in the given order.
    """

    def __init__(
        self,
        evaluator: Callable[[], CandidateEvaluator],
        search: Callable[[], EvoSearch[Allocation]],
        race_log: _RaceLog,
        race: bool,
    ) -> None:
        self.evaluator, self.search = evaluator, search
        self.race_log, self.race = race_log, race

    def __call__(self, generation: int, allocations: list[Allocation]) -> list[float]:
        search, evaluator = self.search(), self.evaluator()
        threshold = _elite_threshold(search.cache, search.config.elites) if self.race else None

        def one(allocation: Allocation) -> tuple[float, int | None]:
            return float(evaluator.evaluate(allocation, threshold)), evaluator.raced.get(allocation)

        results = split_map(one, allocations, "evaluating search candidates")
        for allocation, (_, samples) in zip(allocations, results):
            if samples is not None:
                self.race_log.add(allocation, generation, samples)
        return [value for value, _ in results]


def _evaluate(
    evaluator: CandidateEvaluator,
    search: EvoSearch[Allocation],
    race_log: _RaceLog,
    allocation: Allocation,
    race: bool,
) -> float:
    threshold = _elite_threshold(search.cache, search.config.elites) if race else None
    value = evaluator.evaluate(allocation, threshold)
    if allocation in evaluator.raced:
        race_log.add(allocation, len(search.history), evaluator.raced[allocation])
    return value


def _search_document(
    evaluator: CandidateEvaluator,
    search: EvoSearch[Allocation],
    result: EvoResult[Allocation],
    race_log: _RaceLog,
    limits: LayerLimits,
    race: bool,
    seconds: float,
    totals: tuple[Mapping[str, int], dict[str, Any] | None],
) -> dict[str, Any]:
    """``search.json``: per generation best / mean / population fitness (in the fitness's own
    units: KL and NLL are not negated), the final and uniform allocations, cache size, timings.
    ``totals``: the speedup counters (summed over ranks under torchrun) and the torchrun split
    (None in one process), as `_totals` gives them."""
    sign = evaluator.sign
    counters, distributed = dict(totals[0]), totals[1]
    uniform = search.seeds["uniform"]  # the uniform allocation, as the search's fitness cache holds it
    evaluations_here = counters["candidates"]
    return SearchDocument(
        fitness=evaluator.fitness,
        higher_is_better=sign > 0,
        config=evo_settings(search.config),
        found={
            "budget": sum(uniform),  # the uniform allocation removes exactly the budget
            "layers": limits.layers,
            "num_experts": limits.num_experts,
            "top_k": limits.top_k,
            "caps": limits.caps,
            "multiples": limits.multiples,
            "allocation": list(result.best),
        },
        fitness_value=sign * result.best_fitness,
        references={"uniform": {"allocation": list(uniform), "fitness_value": sign * search.cache[uniform]}},
        evaluations=result.evaluations,
        stopped=result.stopped,
        history={
            "generations": generations_document(
                result.history, sign, "best_allocation", race_log.per_generation()
            )
        },
        **evaluator.data_summary(),
        timings_s=evo_timings(evaluator.teacher_seconds, seconds, evaluations_here),
        speed={
            "speedups": {
                "resume_mode": evaluator.mode,
                "racing": race,
                "prefix_cache_budget_bytes": evaluator.prefix_cache.max_bytes,
                "prefix_cache_peak_bytes": evaluator.prefix_cache.peak_bytes,
                "prefix_cache_evictions": evaluator.prefix_cache.evictions,
                **counters,
            },
            "raced_evaluations": race_log.listed(),
            **({"distributed": distributed} if distributed is not None else {}),
        },
    ).to_json()


def search_state_path(output: Path) -> Path:
    """The search checkpoints beside the output folder (the output itself only appears at the end)."""
    return output.parent / f".{output.name}.{SEARCH_STATE}"


def model_fingerprint(moe: MoEModel) -> str:
    """Identifies the model a search ran on: its config and a checksum of its router weights."""
    digest = hashlib.sha256(json.dumps(moe.config.to_dict(), sort_keys=True, default=str).encode())
    for layer in moe.layers:
        weight = layer.router.weight
        assert isinstance(weight, torch.Tensor), "a router's weight is a tensor"
        digest.update(weight.detach().float().cpu().numpy().tobytes())
    return f"{moe.model_type}:{digest.hexdigest()[:16]}"


def search_allocation(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    stats: Sequence[ExpertStats],
    search_set: CalibrationData,
    *,
    config: PruneConfig,
    runtime: SearchRuntime | None = None,
) -> tuple[list[int], dict]:
    """EvoESAP: experts removed per MoE layer, searched on teacher-forced answer tokens.

    ``config`` says what is searched: its sparsity, method, expert_multiple and search settings
    (``criterion`` is the one that ranked ``scores``; ``config.criterion`` may be "auto").
    Candidates run in the method's virtual form (drop: router slicing; novice: constant
    substitution, ``runtime.candidate_context``), never by copying the model. With
    ``runtime.state_path``, the state is checkpointed every generation; ``runtime.resume``
    continues it and refuses other data or settings.
    """
    runtime = runtime or SearchRuntime()
    budget = layer_limits(moe).budget(config.sparsity_value())  # over the prunable layers only
    fingerprint = {
        "model": model_fingerprint(moe),
        "criterion": criterion.name,
        "method": config.method,
        "sparsity": config.sparsity,
        "calibration": [s.data_fingerprint for s in stats],
    }
    return run_evo_search(
        moe,
        search_set,
        [s.order for s in protected_order(scores, moe.protected)],  # super experts last: never reached
        budget,
        config=config.search,
        fingerprint=fingerprint,
        runtime=runtime,
        expert_multiple=config.expert_multiple,
    )


def run_seeded_search(
    make_search: Callable[[Callable[[Any], float], EvoIO], EvoSearch[Any]],
    moe: MoEModel,
    search_set: CalibrationData,
    orders: Sequence[Sequence[int]],
    *,
    fingerprint: dict[str, Any],
    runtime: SearchRuntime,
    plan_context: Callable[[CandidateEvaluator, Any], Any],
    prefix_key: Callable[[Any], tuple] | None = None,
) -> tuple[EvoResult[Any], EvoSearch[Any], CandidateEvaluator]:
    """EvoESAP over a space of its own (mixed genes, joint counts or genes with schemes): the
    search `make_search(evaluate, io)` builds (an EvoSearch over its space and seeds), each
    candidate applied by `plan_context(evaluator, candidate)` and scored by one
    `CandidateEvaluator` on `search_set`, its state checkpointed at `runtime.state_path` (rank 0
    writes it; every rank runs the same search). Returns the result, the search (its fitness
    cache) and the evaluator, not released: the caller reads its summary, then releases it."""
    rank, _ = rank_and_world()
    path = Path(runtime.state_path) if runtime.state_path is not None else None
    if runtime.resume and (path is None or not path.is_file()):
        raise MoePruneError(f"cannot resume: no search state at {path}; run without resume")
    evaluator: CandidateEvaluator | None = None

    def evaluate(candidate: Any) -> float:
        assert evaluator is not None, "a candidate evaluated before the evaluator was built"
        return evaluator.evaluate(candidate)

    def context(candidate: Any):
        assert evaluator is not None, "a candidate applied before the evaluator was built"
        return plan_context(evaluator, candidate)

    io = EvoIO(
        state_path=path,
        fingerprint=fingerprint,
        progress=runtime.progress and rank == 0,
        write_state=rank == 0,
    )
    search = make_search(evaluate, io)
    if search_set.text_only:
        _LOG.warning(TEXT_ONLY_NOTE)
    config = search.config
    evaluator = CandidateEvaluator(
        moe,
        search_set,
        orders,
        fitness=check_fitness(config.fitness),
        seed=config.seed,
        runtime=replace(runtime, candidate_context=None),
        plan_context=context,
        prefix_key=prefix_key,
    )
    return search.run(resume=runtime.resume, carry=runtime.continuation), search, evaluator


def _evo_counts(job: SearchJob) -> Searched:
    removed, doc = search_allocation(*job.args, **job.kwargs)
    return Searched(removed, doc)


SEARCHES.add(
    Search(
        "evo counts",
        "EvoESAP over the experts each MoE layer loses",
        "evo",
        COUNTS,
        _evo_counts,
        joint_schemes=True,
    )
)
