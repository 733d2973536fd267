"""The search space protocol (search/space.py): a space defined here, in a few lines, runs through
the one evo driver (search/evo.py `EvoSearch`) with its loop, fitness cache, checkpoint and resume;
and the drop counts are one more space (`CountSpace`) whose state says what it said before."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from moeprune.config import SearchConfig
from moeprune.errors import MoePruneError
from moeprune.search.evo import EvoIO, EvoSearch
from moeprune.search.space import CountSpace, SearchSpace, listed_seeds

pytestmark = pytest.mark.unit

QUIET = EvoIO(progress=False)
WEIGHTS = (5.0, -1.0, 3.0, 0.5, 4.0, -2.0, 1.0, 2.5)


class Choose:
    """Pick exactly `k` of `n` items (a 0/1 tuple); a move swaps one chosen item for another."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k

    def feasible(self, c: tuple[int, ...]) -> bool:
        return len(c) == self.n and sum(c) == self.k and set(c) <= {0, 1}

    def repair(self, c: tuple[int, ...], rng: np.random.Generator) -> tuple[int, ...] | None:
        ones = [i for i in np.argsort(c, kind="stable")[::-1][: self.k]]
        return tuple(int(i in ones) for i in range(self.n)) if len(c) == self.n else None

    def mutate(self, parent: tuple[int, ...], config: SearchConfig, rng: np.random.Generator) -> tuple:
        on, off = [i for i, b in enumerate(parent) if b], [i for i, b in enumerate(parent) if not b]
        child = list(parent)
        child[on[int(rng.integers(len(on)))]], child[off[int(rng.integers(len(off)))]] = 0, 1
        return tuple(child)

    def initial(self, seeds, config: SearchConfig, rng: np.random.Generator) -> list[tuple[int, ...]]:
        population = dict.fromkeys(seeds)
        for tries in range(20 * config.population):
            if len(population) >= config.population:
                break
            population.setdefault(self.mutate(seeds[tries % len(seeds)], config, rng), None)
        return list(population)

    def describe(self, seeds) -> dict:
        return {"n": self.n, "k": self.k, "seeds": listed_seeds(seeds)}


def _score(c: tuple[int, ...]) -> float:
    return float(sum(w * b for w, b in zip(WEIGHTS, c)))


def test_a_space_of_its_own_runs_through_the_one_driver(tmp_path):
    space: SearchSpace[tuple[int, ...]] = Choose(len(WEIGHTS), 3)
    seeds = {"first three": (1, 1, 1, 0, 0, 0, 0, 0)}
    seen: list[tuple[int, ...]] = []

    def fitness(c: tuple[int, ...]) -> float:
        seen.append(c)
        return _score(c)

    config = SearchConfig(population=6, elites=2, generations=12, seed=1)
    result = EvoSearch(fitness, space, seeds, config, io=QUIET).run()
    best = max(itertools.combinations(range(len(WEIGHTS)), 3), key=lambda s: sum(WEIGHTS[i] for i in s))
    assert result.best == tuple(int(i in best) for i in range(len(WEIGHTS)))  # items 0, 2, 4: 12.0
    assert result.best_fitness == 12.0 and result.history[0].fitnesses[0] == _score(seeds["first three"])
    assert seen and all(space.feasible(c) for c in seen) and len(seen) == len(set(seen)) == result.evaluations
    near = space.repair((0, 9, 1, 8, 0, 0, 7, 0), np.random.default_rng(0))
    assert near == (0, 1, 0, 1, 0, 0, 1, 0)  # the three largest chosen

    state = tmp_path / "state.json"
    io = EvoIO(state_path=state, progress=False)
    EvoSearch(_score, space, seeds, replace(config, generations=4), io=io).run()
    saved = json.loads(state.read_text())
    assert (saved["n"], saved["k"], saved["seeds"]) == (8, 3, {"first three": [1, 1, 1, 0, 0, 0, 0, 0]})
    assert EvoSearch(_score, space, seeds, config, io=io).run(resume=True) == result  # resumed: identical
    with pytest.raises(MoePruneError, match=r"cannot resume: k \(saved 3, now 4\)"):
        EvoSearch(_score, Choose(len(WEIGHTS), 4), seeds, config, io=io).run(resume=True)


def test_drop_counts_are_one_more_space_whose_state_is_unchanged():
    space = CountSpace(6, [4, 4, 4], [1, 2, 1])
    described = {"budget": 6, "caps": [4, 4, 4], "multiples": [1, 2, 1], "uniform": [2, 2, 2]}
    assert space.describe({"uniform": (2, 2, 2)}) == described  # as EvoSearch's state held it
    rng = np.random.default_rng(0)
    config = SearchConfig(population=8, elites=2)
    population = space.initial([(2, 2, 2)], config, rng)
    assert population[0] == (2, 2, 2) and all(space.feasible(a) for a in population)
    assert all(space.feasible(space.mutate(a, config, rng)) for a in population)
    assert space.repair((3.6, 0.2, 2.2), rng) == (4, 0, 2)  # the nearest multiples, on the budget
    assert not space.feasible((2, 1, 3))  # the middle layer loses multiples of 2
