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
budget; a recipe outside the best third goes on too when its gap to the rung's leader is within one
standard error of that gap over the search samples (`within_noise`: on 32 samples, plans 0.002
apart at 1/3 of their budget can finish in either order). Each run is a complete recipe (its
config says the budget it ran with, seeded, so it reruns to the same plan), and the winner is the
best plan any rung produced: a candidate stopped early still competes with what it reached. The
searches themselves run only through the search registry (search_for, SearchJob).

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
# ... and every recipe whose gap to the rung's leader is within this many standard errors of the
# gap, over the search samples (paired: both plans scored on the same samples). Two plans 0.002
# apart on 32 samples (one standard error 0.008) are a coin toss, and the one stopped there may be
# the better at full budget; one standard error, not two, since a gap at a small budget is also
# what the recipes make of their budget (on the DeepSeek-V3 demo at 50 %, two let both mixed +
# gradient recipes 0.005-0.006 behind run their full budgets, to the same plan as at 1/9).
NOISE = 1.0


@dataclass(frozen=True)
class Score:
    """A run's fitness on the search data and its value on each search sample (by sample id)."""

    value: float
    samples: dict = field(default_factory=dict)


def paired_gap(leader: Score, other: Score, higher: bool = True) -> tuple[float, float]:
    """How far `other` trails `leader`, as the mean over their shared search samples of the
    per-sample gap, and that mean's standard error (sd / sqrt(n)); (inf, 0) without two shared
    samples or a finite score."""
    shared = [k for k in leader.samples if k in other.samples]
    if len(shared) < 2 or not math.isfinite(other.value):
        return math.inf, 0.0
    sign = 1.0 if higher else -1.0
    gaps = [sign * (leader.samples[k] - other.samples[k]) for k in shared]
    mean = math.fsum(gaps) / len(gaps)
    spread = math.sqrt(math.fsum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    return mean, spread / math.sqrt(len(gaps))


def within_noise(leader: Score, other: Score, higher: bool = True) -> bool:
    """Whether `other` trails `leader` by no more than NOISE standard errors of their paired
    per-sample gap; False without two shared samples."""
    gap, error = paired_gap(leader, other, higher)
    return gap <= NOISE * error


def halving(
    count: int,
    searched: Sequence[bool],
    evaluate: Callable[[int, float], Score],
    higher: bool = True,
    log: Callable[[int, int, float, float], None] | None = None,
) -> list[list[tuple[float, float]]]:
    """Successive halving: `evaluate(i, fraction)` is recipe i's score at that fraction of its
    search budget. Recipes that search nothing run once at 1.0, first; the searched run at each
    of RUNGS in turn, the best 1/ETA (at least one) going on, with every recipe within the noise
    of the rung's leader (`within_noise`; `log(recipe, leader, gap, standard error)` hears of each).
    Returns each recipe's (fraction, fitness) runs, in order."""
    runs: list[list[tuple[float, float]]] = [[] for _ in range(count)]
    sign = 1.0 if higher else -1.0
    for i in range(count):
        if not searched[i]:
            runs[i].append((1.0, evaluate(i, 1.0).value))
    alive = [i for i in range(count) if searched[i]]
    for rung, fraction in enumerate(RUNGS):
        last = rung == len(RUNGS) - 1
        if len(alive) <= 1 and not last:
            continue  # one left: straight to the full budget
        scores = {i: evaluate(i, fraction) for i in alive}
        for i in alive:
            runs[i].append((fraction, scores[i].value))
        if not last:
            alive.sort(key=lambda i: -sign * scores[i].value)
            best = max(1, math.ceil(len(alive) / ETA))
            leader = scores[alive[0]]
            close = [i for i in alive[best:] if within_noise(leader, scores[i], higher)]
            for i in close:
                if log is not None:
                    log(i, alive[0], *paired_gap(leader, scores[i], higher))
            alive = alive[:best] + close
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
    repaired: dict = field(default_factory=dict)  # {before, after}: its best plan repaired (auto --repair)


@dataclass
class Found:
    """A run's plan and what it needs to be built again by `prune` without searching."""

    config: ResolvedConfig
    criterion: Criterion
    scores: list[LayerScores]
    searched: Searched
    plan: Plan
    fitness: float
    samples: dict = field(default_factory=dict)  # the fitness on each search sample, by sample id
    fits: Any = None  # the rank-R novices its plan keeps (None for constant novices or none)
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
    return Found(config, criterion, ordered, searched, plan, value, dict(accumulator.per_sample), fits)


def teacher_once(shared: Shared, fitness: str) -> SharedTeacher:
    """The contest's one teacher pass, made as a search makes its own (the fast path's captures
    and self-check included), for every search and plan of the contest to take."""
    moe = shared.moe
    orders = [list(range(m.num_experts)) for m in moe.layers]  # any: the pass reads none
    evaluator = CandidateEvaluator(moe, shared.search_set, orders, fitness=fitness, runtime=shared.runtime)
    prepared = evaluator.shared()
    evaluator.release()
    return prepared


def contest(shared: Shared, entries: list[Entry], log: Callable[[str], None] = print) -> list[Found]:
    """Every entry run by successive halving; returns each recipe's best run (its plan and how to
    rebuild it), the best first."""
    fitness = entries[0].config.search.fitness
    shared.prepared = teacher_once(shared, fitness)
    shared.teacher = shared.prepared.scored()
    higher = higher_is_better(fitness)
    sign = 1.0 if higher else -1.0
    best: dict[str, Found] = {}  # each recipe's best run
    found_at: dict[str, int] = {}  # its run's number: of equal plans, the one found first leads

    def evaluate(i: int, fraction: float) -> Score:
        entry = entries[i]
        start = time.perf_counter()
        try:
            found = run_once(shared, scaled(entry.config, fraction), entry.continuation)
        except MoePruneError as refusal:  # this recipe cannot run here; the others still compete
            entry.refused = str(refusal)
            log(f"auto: {entry.label}: {refusal}")
            return Score(-math.inf if higher else math.inf)
        seconds = time.perf_counter() - start
        found.label, found.budget = entry.label, fraction
        entry.runs.append({"budget": fraction, fitness: found.fitness, "seconds": round(seconds, 3)})
        log(
            f"auto: {entry.label} at {fraction:.3g} of its budget: {fitness} {found.fitness:.4f} ({seconds:.1f} s)"
        )
        if entry.label not in best or sign * found.fitness > sign * best[entry.label].fitness:
            best[entry.label], found_at[entry.label] = found, sum(len(e.runs) for e in entries)
        return Score(found.fitness, found.samples)

    searched = [ResolvedConfig.of(e.config).allocator.searches for e in entries]

    def close(i: int, leader: int, gap: float, error: float) -> None:
        entries[i].runs[-1]["within_noise"] = {
            "leader": entries[leader].label,
            "gap": round(gap, 6),
            "standard_error": round(error, 6),
        }
        log(
            f"auto: {entries[i].label} goes on within the noise of {entries[leader].label} "
            f"({gap:.4f} behind; {NOISE:g} standard error(s) of the gap: {NOISE * error:.4f})"
        )

    halving(len(entries), searched, evaluate, higher, close)
    if not best:
        raise MoePruneError(
            "no recipe of the auto method could run on this model: "
            + "; ".join(f"{e.label}: {e.refused}" for e in entries),
            options=("method",),
        )
    return sorted(best.values(), key=lambda found: (-sign * found.fitness, found_at[found.label]))
