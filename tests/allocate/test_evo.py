"""EvoESAP search: feasibility of every candidate, determinism, quality, cache, checkpoint/resume."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from moeprune.config import SearchConfig
from moeprune.errors import InfeasibleBudgetError, MoePruneError
from moeprune.search.evo import EvoIO, EvoSearch, Feasibility, initial_population, mutate

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

SMALL = SearchConfig(population=8, elites=2, generations=6, seed=3)
QUIET = EvoIO(progress=False)  # no checkpoint, no progress bar


def _uniform(budget: int, caps: list[int], multiples: list[int] | None = None) -> tuple[int, ...]:
    """Test-local uniform allocation: the feasible allocation nearest to B/L everywhere."""
    return Feasibility(budget, caps, multiples).project([budget / len(caps)] * len(caps))


def _separable(weights: list[float]):
    """fitness = -sum_l w_l r_l^2: prune most where w_l is small; the optimum is known exactly."""
    return lambda alloc: -float(sum(w * r * r for w, r in zip(weights, alloc)))


def _optimum(weights: list[float], budget: int, caps: list[int]) -> float:
    """Greedy unit steps are exact for a separable convex cost with unit multiples."""
    r = [0] * len(caps)
    for _ in range(budget):
        layer = min(
            (i for i in range(len(caps)) if r[i] < caps[i]), key=lambda i: weights[i] * (2 * r[i] + 1)
        )
        r[layer] += 1
    return _separable(weights)(r)


class Recorder:
    """An evaluate() that records each call and checks feasibility."""

    def __init__(self, fitness, feas: Feasibility, fail_after: int | None = None) -> None:
        self.fitness, self.feas, self.fail_after = fitness, feas, fail_after
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, allocation: tuple[int, ...]) -> float:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated crash")
        assert self.feas.is_feasible(allocation), allocation
        self.calls.append(allocation)
        return self.fitness(allocation)


def _random_problem(rng: np.random.Generator):
    layers = int(rng.integers(1, 9))
    m = int(rng.choice([1, 1, 2, 4]))
    mixed = rng.random() < 0.3
    multiples = [int(rng.choice([1, 2])) if mixed else m for _ in range(layers)]
    caps = [int(rng.integers(0, 24)) for _ in range(layers)]
    top = sum(c // mm * mm for c, mm in zip(caps, multiples))
    budget = int(rng.integers(0, top + 1)) // m * m
    try:
        feas = Feasibility(budget, caps, multiples)
    except InfeasibleBudgetError:
        return None
    return budget, caps, multiples, feas


def test_every_generated_candidate_is_feasible_over_random_problems():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(60):
        problem = _random_problem(rng)
        if problem is None:
            continue
        budget, caps, multiples, feas = problem
        uniform = _uniform(budget, caps, multiples)
        config = SearchConfig(
            population=int(rng.integers(2, 10)),
            elites=1,
            generations=4,
            delta_max=int(rng.integers(1, 6)),
            tau_max=int(rng.integers(1, 4)),
            seed=int(rng.integers(100)),
        )
        init = initial_population(budget, caps, multiples, uniform, config, np.random.default_rng(1))
        assert init[0] == uniform and len(set(init)) == len(init) <= config.population
        assert all(feas.is_feasible(a) for a in init)
        for parent in init:
            for _ in range(20):
                assert feas.is_feasible(mutate(parent, caps, multiples, config, rng))
        weights = list(rng.random(len(caps)) + 0.1)
        recorder = Recorder(_separable(weights), feas)
        EvoSearch.counts(recorder, budget, caps, uniform, config, multiples=multiples, io=QUIET).run()
        assert recorder.calls and all(feas.is_feasible(a) for a in recorder.calls)
        checked += 1
    assert checked > 30


def test_projection_meets_budget_and_falls_back_when_greedy_cannot():
    # Mixed multiples: odd layers take multiples of 3, so greedy single moves can get stuck.
    feas = Feasibility(10, [6, 6, 1], [3, 3, 1])
    for target in ([10, 0, 0], [0, 0, 10], [3.3, 3.3, 3.3], [-5, 20, 1]):
        assert feas.is_feasible(feas.project(target))


def test_infeasible_budgets_and_bad_configs_are_refused():
    with pytest.raises(InfeasibleBudgetError):
        Feasibility(9, [4, 4])
    with pytest.raises(InfeasibleBudgetError, match="multiples"):
        Feasibility(3, [4, 4], [2, 2])
    with pytest.raises(MoePruneError, match="population"):
        EvoSearch.counts(lambda a: 0.0, 4, [4, 4], (2, 2), SearchConfig(population=2, elites=4))
    with pytest.raises(MoePruneError, match="not feasible"):
        EvoSearch.counts(lambda a: 0.0, 4, [4, 4], (3, 2), SMALL)


def test_mutation_keeps_the_parent_when_no_step_is_feasible():
    config = SearchConfig(delta_max=2)
    rng = np.random.default_rng(0)
    assert mutate((3,), [5], None, config, rng) == (3,)
    # Every layer is at 0 or at its cap with caps of 0: nothing can move.
    assert mutate((0, 0), [0, 0], None, config, rng) == (0, 0)


def test_same_seed_same_result_other_seed_differs():
    caps, budget = [8] * 6, 18
    fit = _separable([1, 2, 3, 4, 5, 6])
    runs = [
        EvoSearch.counts(fit, budget, caps, _uniform(budget, caps), replace(SMALL, seed=s), io=QUIET).run()
        for s in (3, 3, 4)
    ]
    assert runs[0] == runs[1]
    assert runs[0].history != runs[2].history


def test_best_is_at_least_uniform_and_much_better_on_a_separable_fitness():
    caps = [12] * 8
    budget = 40
    weights = [8.0, 4.0, 2.0, 1.0, 1.0, 2.0, 4.0, 8.0]
    fit = _separable(weights)
    uniform = _uniform(budget, caps)
    config = SearchConfig(population=16, elites=4, generations=25, seed=0)
    result = EvoSearch.counts(fit, budget, caps, uniform, config, io=QUIET).run()
    assert result.history[0].fitnesses[0] == fit(uniform)  # uniform is evaluated first
    assert result.best_fitness >= fit(uniform)
    best = _optimum(weights, budget, caps)
    # Uniform costs 5*5*30 = 750; the optimum is about 419: the search closes >= 90% of the gap.
    assert result.best_fitness - fit(uniform) >= 0.9 * (best - fit(uniform))
    assert result.best_fitness == fit(result.best) and sum(result.best) == budget
    assert len(result.history) == config.generations


def test_evaluate_is_called_once_per_distinct_allocation():
    caps, budget = [6] * 5, 12
    feas = Feasibility(budget, caps)
    recorder = Recorder(_separable([1, 3, 1, 3, 1]), feas)
    result = EvoSearch.counts(recorder, budget, caps, _uniform(budget, caps), SMALL, io=QUIET).run()
    counts = Counter(recorder.calls)
    assert max(counts.values()) == 1
    assert result.evaluations == len(counts) == sum(h.new_evaluations for h in result.history)


def test_resume_extends_a_finished_run_to_the_identical_result(tmp_path):
    caps, budget = [10] * 6, 24
    fit, uniform = _separable([5, 1, 2, 2, 1, 5]), _uniform(budget, caps)
    config = replace(SMALL, generations=8)
    full = EvoSearch.counts(fit, budget, caps, uniform, config, io=QUIET).run()
    state = tmp_path / "evo.json"
    kw = {"io": EvoIO(state_path=state, fingerprint={"model": "tiny"}, progress=False)}
    EvoSearch.counts(fit, budget, caps, uniform, replace(config, generations=3), **kw).run()
    saved = json.loads(state.read_text())
    assert saved["generation"] == 3 and len(saved["history"]) == 3
    assert {"population", "cache", "rng", "config", "budget", "caps", "fingerprint"} <= set(saved)
    assert not [p for p in tmp_path.iterdir() if p.name != "evo.json"]  # temp files replaced
    resumed = EvoSearch.counts(fit, budget, caps, uniform, config, **kw).run(resume=True)
    assert resumed == full


def test_resume_after_a_crash_mid_generation_is_identical_and_wastes_no_evaluation(tmp_path):
    caps, budget = [10] * 6, 24
    feas = Feasibility(budget, caps)
    fit, uniform = _separable([5, 1, 2, 2, 1, 5]), _uniform(budget, caps)
    full = EvoSearch.counts(fit, budget, caps, uniform, SMALL, io=QUIET).run()
    state = tmp_path / "evo.json"
    kw = {"io": EvoIO(state_path=state, progress=False, save_interval_s=0.0)}
    crashing = Recorder(fit, feas, fail_after=full.evaluations // 2)
    with pytest.raises(KeyboardInterrupt):
        EvoSearch.counts(crashing, budget, caps, uniform, SMALL, **kw).run()
    finishing = Recorder(fit, feas)
    resumed = EvoSearch.counts(finishing, budget, caps, uniform, SMALL, **kw).run(resume=True)
    assert resumed == full
    assert len(crashing.calls) + len(finishing.calls) == full.evaluations


def test_resume_refuses_other_settings_and_missing_state(tmp_path):
    caps, budget = [6] * 4, 10
    uniform = _uniform(budget, caps)
    state = tmp_path / "evo.json"
    fp = {"model": "tiny", "criterion": "reap", "fitness": "esap"}

    def search(config=SMALL, fingerprint=fp):
        io = EvoIO(state_path=state, fingerprint=fingerprint, progress=False)
        return EvoSearch.counts(lambda a: 0.0, budget, caps, uniform, config, io=io)

    with pytest.raises(MoePruneError, match="no search state"):
        search().run(resume=True)
    search().run()
    with pytest.raises(MoePruneError, match=r"fingerprint\.criterion \(saved 'reap', now 'seer'\)"):
        search(fingerprint=fp | {"criterion": "seer"}).run(resume=True)
    with pytest.raises(MoePruneError, match=r"config\.population"):
        search(config=replace(SMALL, population=9)).run(resume=True)
    with pytest.raises(MoePruneError, match=r"config\.seed"):
        search(config=replace(SMALL, seed=7)).run(resume=True)
    assert search().run(resume=True).evaluations > 0


def test_patience_stops_a_stalled_search_and_says_why():
    caps, budget = [6] * 4, 8
    flat = _separable(
        [0.0, 0.0, 0.0, 0.0]
    )  # every allocation ties: the best never improves after generation 0
    config = SearchConfig(population=6, elites=2, generations=30, seed=1, patience=3)
    result = EvoSearch.counts(flat, budget, caps, _uniform(budget, caps), config, io=QUIET).run()
    assert len(result.history) == 4  # generation 0, then 3 without improvement
    assert result.stopped == {"reason": "patience", "generations_run": 4, "patience": 3}
    full = EvoSearch.counts(
        flat, budget, caps, _uniform(budget, caps), replace(config, patience=None), io=QUIET
    ).run()
    assert len(full.history) == 30 and full.stopped == {"reason": "generations", "generations_run": 30}


def test_patience_only_shortens_the_same_trajectory():
    """Early stop is the full run cut short: same generations up to the stop, same best among them."""
    caps, budget = [10] * 6, 24
    fit, uniform = _separable([5, 1, 2, 2, 1, 5]), _uniform(budget, caps)
    config = SearchConfig(population=8, elites=2, generations=40, seed=5)
    full = EvoSearch.counts(fit, budget, caps, uniform, config, io=QUIET).run()
    early = EvoSearch.counts(fit, budget, caps, uniform, replace(config, patience=4), io=QUIET).run()
    ran = len(early.history)
    assert early.stopped["reason"] == "patience" and ran < 40
    assert early.history == full.history[:ran]
    assert early.best_fitness == max(h.best for h in full.history[:ran])
