"""`--method auto`'s contest: every recipe of the portfolio (surgery/auto.py) scored on the search
data, the searched ones raced by successive halving, the best plan kept.

What the candidates share, so the contest costs little more than its searches:
- one observation: the calibration pass records the union of the statistics every candidate reads,
  and each criterion's scores are computed from it (no second pass per order);
- one teacher cache: the full model's answer distributions on the search data, computed once, and
  every candidate's plan scored against it with the searches' own teacher-forced fitness
  (allocate/fitness.py), through the method's virtual form (no model copy), as `--criterion auto`
  scores its criteria (search/auto.py);
- one set of fits: the rank-R novices of every expert fitted once per rank, for every search and
  plan that keeps novices of that rank.

  The teacher pass is made once (`SharedTeacher`, search/teacher.py: the prepared batches, the
  cache and the fast path's self-check) and every search takes it through its runtime
  (`SearchRuntime.teacher`), so no search makes a pass of its own.

Successive halving over the searches' own budgets (evo's generations, gradient's steps): plans
that need no search are final after one pass and go first; then every searched recipe runs at
1/9 of its budget, the best third (at least one) again at 1/3, the best third of those at the full
budget. Each run is a complete recipe (its config says the budget it ran with, seeded, so it
reruns to the same plan), and the winner is the best plan any rung produced: a candidate stopped
early still competes with what it reached. The searches themselves run only through the search
registry (search_for, SearchJob).

A recipe going on to a larger rung continues where its previous rung stopped when that reaches
the plan a fresh run at the larger budget reaches (`SearchRuntime.continuation`): evo keeps its
population, fitness cache, history and generator and runs only the generations it has not run
(search/evo.py: an extended run equals one started with that many generations; `--patience`
applies at every rung, so a run it stopped stays stopped, as the fresh run would). The gradient
allocation does not continue: its temperature falls from `--gradient-temperature` to its end over
all its steps, so its first 1/3 of 120 steps is not a 40-step run, and a rung ranked on a plan
still at high temperature would rank gradient recipes on what no recipe makes. It reruns at each
rung (1/9 + 1/3 more of its steps than alone: it is the cheaper family), so every rung's plan,
evo's and the gradient's, is what its recipe.json reruns to.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from moeprune.allocate.fitness import FitnessAccumulator, higher_is_better
from moeprune.criteria import Criterion, LayerScores, compute_scores, get_criterion, score_experts
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.kinds import union
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.search.auto import plan_fitness
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import Searched, SearchJob, search_for
from moeprune.search.teacher import SharedTeacher
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import fit_novices, plan_rank
from moeprune.surgery.planning import build_plan, check_config, guard_super_experts, requirements
from moeprune.surgery.registry import ResolvedConfig

RUNGS = (1 / 9, 1 / 3, 1.0)  # the searched recipes' budget fractions, rung by rung
ETA = 3  # each rung keeps the best 1/ETA of the recipes that ran in it (at least one)


def halving(
    count: int, searched: Sequence[bool], evaluate: Callable[[int, float], float], higher: bool = True
) -> list[list[tuple[float, float]]]:
    """Successive halving: `evaluate(i, fraction)` is recipe i's fitness at that fraction of its
    search budget. Recipes that search nothing run once at 1.0, first; the searched run at each
    of RUNGS in turn, the best 1/ETA (at least one) going on. Returns each recipe's (fraction,
    fitness) runs, in order."""
    runs: list[list[tuple[float, float]]] = [[] for _ in range(count)]
    sign = 1.0 if higher else -1.0
    for i in range(count):
        if not searched[i]:
            runs[i].append((1.0, evaluate(i, 1.0)))
    alive = [i for i in range(count) if searched[i]]
    for rung, fraction in enumerate(RUNGS):
        last = rung == len(RUNGS) - 1
        if len(alive) <= 1 and not last:
            continue  # one left: straight to the full budget
        for i in alive:
            runs[i].append((fraction, evaluate(i, fraction)))
        if not last:
            alive.sort(key=lambda i: -sign * runs[i][-1][1])
            alive = alive[: max(1, math.ceil(len(alive) / ETA))]
    return runs


def scaled(config: ResolvedConfig, fraction: float) -> ResolvedConfig:
    """`config` with its search's budget (evo's generations, gradient's steps) cut to `fraction`."""
    if fraction >= 1.0:
        return config
    search = config.search
    smaller = replace(
        search,
        generations=max(1, math.ceil(search.generations * fraction)),
        steps=max(1, math.ceil(search.steps * fraction)),
    )
    return check_config(replace(config.given(), search=smaller))


@dataclass
class Entry:
    """One recipe of the contest: its label and config (sparsity solved), and what its runs got."""

    label: str
    config: ResolvedConfig
    runs: list[dict] = field(default_factory=list)  # {budget, fitness, seconds} per run
    refused: str = ""  # why it could not run here (a budget only super experts meet, ...)
    continuation: dict = field(default_factory=dict)  # its search's state for the next rung


@dataclass
class Found:
    """A run's plan and what it needs to be built again by `prune` without searching."""

    config: ResolvedConfig
    criterion: Criterion
    scores: list[LayerScores]
    searched: Searched
    plan: Plan
    fitness: float
    label: str = ""  # the recipe's
    budget: float = 1.0  # the fraction of its search budget it ran at


@dataclass
class Shared:
    """What every candidate shares: the statistics and each criterion's scores, the teacher cache
    and its batches, the novices fitted per rank."""

    moe: MoEModel
    stats: list[ExpertStats]
    sets: list[CalibrationData]
    search_set: CalibrationData
    runtime: SearchRuntime
    teacher: Any = None  # (cache, batches) every plan is scored against (`SharedTeacher.scored`)
    prepared: SharedTeacher | None = None  # the same pass as every search takes it
    scores: dict[str, list[LayerScores]] = field(default_factory=dict)
    fits: dict[int, Any] = field(default_factory=dict)

    def scores_of(self, criterion: Criterion) -> list[LayerScores]:
        if criterion.name not in self.scores:
            domains = self.stats if len(self.stats) > 1 else self.stats[0]
            self.scores[criterion.name] = compute_scores(
                criterion.name,
                stats=domains if criterion.needs_data else None,
                weights=self.moe.layers if criterion.needs_weights else None,
                layers=[m.index for m in self.moe.layers],
            )
        return self.scores[criterion.name]


@dataclass
class _SharedFits(SearchJob):
    """A search job whose rank-R novices are fitted once per rank for the whole contest."""

    shared: Shared | None = None

    def every_novice(self) -> Any:
        rank = self.config.options.novice_rank
        assert self.shared is not None
        if rank not in self.shared.fits:
            self.shared.fits[rank] = super().every_novice()
        return self.shared.fits[rank]


def observe_once(
    moe: MoEModel,
    configs: Sequence[ResolvedConfig],
    sets: list[CalibrationData],
    runtime: SearchRuntime,
    seed: int,
) -> list[ExpertStats]:
    """One calibration pass recording what every candidate reads."""
    kinds = union(*(requirements(c).statistics for c in configs))
    _, _, stats = score_experts(
        moe,
        "reap",
        sets,
        batch_size=runtime.batch_size,
        pad_token_id=runtime.pad_token_id or 0,
        seed=seed,
        progress=runtime.progress,
        statistics=kinds,
    )
    return stats


def run_once(shared: Shared, config: ResolvedConfig, continuation: dict | None = None) -> Found:
    """One recipe run and scored: its search (if any) through the registry, taking the contest's
    teacher pass and continuing the recipe's previous run where it can (`continuation`), its
    plan, its fitness."""
    moe, stats = shared.moe, shared.stats
    guard_super_experts(moe, config, stats)  # refuses a budget only removing super experts meets
    criterion = get_criterion(config.criterion)
    scores = shared.scores_of(criterion)
    search = search_for(config)
    searched = Searched(None)
    checks = FitChecks(data=shared.search_set)
    if search is not None:
        if search.check is not None:
            search.check(moe, config)
        runtime = replace(
            shared.runtime,
            candidate_context=config.method_spec.search_context(moe, stats, config.options),
            teacher=shared.prepared,
            continuation=continuation,
        )
        job = _SharedFits(
            moe,
            criterion,
            scores,
            stats,
            shared.search_set,
            config,
            runtime,
            shared.sets,
            checks,
            shared=shared,
        )
        searched = search.run(job)
    ordered = scores if searched.scores is None else searched.scores  # a gradient search's orders
    plan = build_plan(moe, criterion, ordered, config=config, stats=stats, removed=searched.removed)
    fits = None
    if plan_rank(plan):
        if searched.novices is None:
            searched.novices = shared.fits.get(plan_rank(plan))
        fits = fit_novices(
            moe,
            plan,
            shared.sets,
            batch_size=shared.runtime.batch_size,
            pad_token_id=shared.runtime.pad_token_id or 0,
            progress=False,
            fitted=searched.novices,
            checks=checks,
        )
    teacher, _ = shared.teacher
    accumulator = FitnessAccumulator(teacher, config.search.fitness, config.seed)
    value = plan_fitness(moe, plan, shared.teacher, accumulator, stats, fits)
    return Found(config, criterion, ordered, searched, plan, value)


def teacher_once(shared: Shared, fitness: str) -> SharedTeacher:
    """The contest's one teacher pass, made as a search makes its own (the fast path's captures
    and self-check included), for every search and plan of the contest to take."""
    moe = shared.moe
    orders = [list(range(m.num_experts)) for m in moe.layers]  # any: the pass reads none
    evaluator = CandidateEvaluator(moe, shared.search_set, orders, fitness=fitness, runtime=shared.runtime)
    prepared = evaluator.shared()
    evaluator.release()
    return prepared


def contest(shared: Shared, entries: list[Entry], log: Callable[[str], None] = print) -> Found:
    """Every entry run by successive halving; returns the best run (its plan and how to rebuild it)."""
    fitness = entries[0].config.search.fitness
    shared.prepared = teacher_once(shared, fitness)
    shared.teacher = shared.prepared.scored()
    higher = higher_is_better(fitness)
    best: list[Found] = []

    def evaluate(i: int, fraction: float) -> float:
        entry = entries[i]
        start = time.perf_counter()
        try:
            found = run_once(shared, scaled(entry.config, fraction), entry.continuation)
        except MoePruneError as refusal:  # this recipe cannot run here; the others still compete
            entry.refused = str(refusal)
            log(f"auto: {entry.label}: {refusal}")
            return -math.inf if higher else math.inf
        seconds = time.perf_counter() - start
        found.label, found.budget = entry.label, fraction
        entry.runs.append({"budget": fraction, fitness: found.fitness, "seconds": round(seconds, 3)})
        log(
            f"auto: {entry.label} at {fraction:.3g} of its budget: {fitness} {found.fitness:.4f} ({seconds:.1f} s)"
        )
        sign = 1.0 if higher else -1.0
        if not best or sign * found.fitness > sign * best[0].fitness:
            best[:] = [found]
        return found.fitness

    searched = [ResolvedConfig.of(e.config).allocator.searches for e in entries]
    halving(len(entries), searched, evaluate, higher)
    if not best:
        raise MoePruneError(
            "no recipe of the auto method could run on this model: "
            + "; ".join(f"{e.label}: {e.refused}" for e in entries),
            options=("method",),
        )
    return best[0]
