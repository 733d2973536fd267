"""The search space protocol: what the evo driver (search/evo.py `EvoSearch`) asks of a space.

A space is the set of feasible candidates of one search and the moves between them; the driver
owns everything else (the generation loop, the fitness cache, the checkpoint, `--resume`,
`--patience`). A candidate is a hashable value (a tuple, of ints or of tuples), so the fitness
cache and the saved state key it as they key drop counts. Every space keeps its candidates
feasible by construction: `initial` and `mutate` return only feasible candidates, `repair` makes
one feasible or says it cannot. Randomness comes from the caller's generator only, so a search
is reproducible and a resumed one identical.

The spaces: drop counts (`CountSpace` here, over search/population.py), mixed genes
(search/mixed_space.py), counts with a scheme per layer (quantize/evo_space.py), mixed genes
with a scheme per layer (quantize/mixed_space.py). A new space is one class with these five
methods; `EvoSearch(evaluate, space, seeds, config)` runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from moeprune.config import SearchConfig
from moeprune.search.population import Allocation, Feasibility, initial_population, mutate

C = TypeVar("C")


class SearchSpace(Protocol[C]):
    """The feasible candidates of one search and the moves between them (module docstring)."""

    def initial(self, seeds: Sequence[C], config: SearchConfig, rng: np.random.Generator) -> list[C]:
        """Generation 0: the seeds first (in order), then candidates made from them; distinct."""
        ...

    def feasible(self, candidate: C) -> bool:
        """Whether `candidate` is in the space (every limit and the budget kept)."""
        ...

    def repair(self, candidate: C, rng: np.random.Generator) -> C | None:
        """A feasible candidate close to `candidate`, or None when the space has none near it."""
        ...

    def mutate(self, parent: C, config: SearchConfig, rng: np.random.Generator) -> C:
        """A feasible offspring of `parent` (the parent itself when no move fits)."""
        ...

    def describe(self, seeds: Mapping[str, C]) -> dict[str, Any]:
        """What defines a search over this space from `seeds`: the search state records it, and a
        resume must match it (JSON-able; tuples may come back as lists)."""
        ...


def listed(candidate: Any) -> Any:
    """A candidate as JSON holds it: (nested) tuples as lists."""
    return [listed(v) for v in candidate] if isinstance(candidate, (tuple, list)) else candidate


def listed_seeds(seeds: Mapping[str, Any]) -> dict[str, Any]:
    """The named seeds as JSON holds them (the `seeds` of a seeded space's `describe`)."""
    return {name: listed(seed) for name, seed in seeds.items()}


class _Checked(Protocol[C]):
    def check(self, candidate: C, what: str) -> C: ...

    def mutate(self, parent: C, config: SearchConfig, rng: np.random.Generator) -> C: ...


def seeded_population(
    space: _Checked[C], seeds: Sequence[C], config: SearchConfig, rng: np.random.Generator
) -> list[C]:
    """The seeds (checked, distinct, in order, every one of them even past P), then mutations of
    them in turn up to P in all: generation 0 of the spaces whose repair keeps every mutant on
    the budget (quantize/evo_space.py, quantize/mixed_space.py)."""
    population = list(dict.fromkeys(space.check(seed, "seed") for seed in seeds))
    tries = 0
    while len(population) < config.population and tries < 20 * config.population:
        child = space.mutate(population[tries % len(population)], config, rng)
        tries += 1
        if child not in population:
            population.append(child)
    return population[: max(config.population, len(dict.fromkeys(seeds)))]


class CountSpace:
    """Drop counts: experts removed per MoE layer, exactly `budget` in all, each layer within its
    cap and on its multiple (search/population.py). Its one seed is the uniform allocation."""

    def __init__(self, budget: int, caps: Sequence[int], multiples: Sequence[int] | None = None) -> None:
        self.feas = Feasibility(budget, caps, multiples)

    def initial(
        self, seeds: Sequence[Allocation], config: SearchConfig, rng: np.random.Generator
    ) -> list[Allocation]:
        """Uniform first, then patterned, then random feasible allocations (population.py)."""
        (uniform,) = seeds
        feas = self.feas
        return initial_population(feas.budget, feas.caps, feas.multiples, uniform, config, rng)

    def feasible(self, candidate: Allocation) -> bool:
        return self.feas.is_feasible(candidate)

    def repair(self, candidate: Allocation, rng: np.random.Generator) -> Allocation:
        """The feasible allocation nearest `candidate` (squared error; always one: the budget is)."""
        return self.feas.project(np.asarray(candidate, dtype=np.float64))

    def mutate(self, parent: Allocation, config: SearchConfig, rng: np.random.Generator) -> Allocation:
        return mutate(parent, self.feas.caps, self.feas.multiples, config, rng)

    def describe(self, seeds: Mapping[str, Allocation]) -> dict[str, Any]:
        (uniform,) = seeds.values()
        return {
            "budget": self.feas.budget,
            "caps": list(self.feas.caps),
            "multiples": list(self.feas.multiples),
            "uniform": list(uniform),
        }
