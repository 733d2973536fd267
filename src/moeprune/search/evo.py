"""EvoESAP: the evolutionary search over a space (docs/allocation.md, "EvoESAP").

The one driver of every evo search: the candidates it moves between, and how, are its space's
(search/space.py `SearchSpace`: drop counts, mixed genes, either with schemes), so a new space
needs no new driver. The search is generic in the fitness: ``evaluate(candidate) -> float``,
higher is better (the caller negates KL/NLL). Every distinct allocation is evaluated once (fitness cache). All
randomness comes from one ``numpy.random.Generator(PCG64(seed))`` whose state is checkpointed
with the population and cache after every generation, so an interrupted run resumes to the
identical result.

Batch evaluation (data-parallel search under torchrun, see search/run.py): with
``evaluate_many``, each generation's new allocations (not cached, deduplicated, in population
order) are handed over at once, ``evaluate_many(generation, allocations) -> fitnesses``; the
state is then saved at generation boundaries only. ``EvoIO(write_state=False)`` (every rank but
0) reads a saved state for ``resume`` but never writes one.

Generation 0 evaluates the initial population; each later generation evaluates the m elites of
the previous one (cached) plus P - m offspring. ``generations`` counts evaluated generations,
including generation 0. The next population is always bred right after a generation is
evaluated, so a finished run can be extended by resuming with more generations and reaches the
same result as a run started with that many.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic

import numpy as np

from moeprune.allocate.fitness import FITNESSES
from moeprune.config import SearchConfig
from moeprune.errors import MoePruneError
from moeprune.runtime.atomic import write_json
from moeprune.runtime.progress import progress_bar
from moeprune.search.population import Allocation, Feasibility, initial_population, mutate
from moeprune.search.space import C, CountSpace, SearchSpace, listed

# the population's names stay importable from here, where they were first
__all__ = ["Allocation", "EvoIO", "EvoResult", "EvoSearch", "Feasibility", "GenerationStats"]
__all__ += ["generations_document", "initial_population", "mutate"]
STATE_VERSION = 1
_MAX_OFFSPRING_REDRAWS = 16  # redraws of an offspring that was already seen
_CARRY = "evo"  # the key of an evo search's state in a continuation (SearchRuntime.continuation)


@dataclass
class GenerationStats:
    """One generation of the history: the population's fitnesses in population order."""

    generation: int
    best: float
    mean: float
    fitnesses: list[float]
    new_evaluations: int
    best_allocation: list[int]


@dataclass
class EvoResult(Generic[C]):
    """The best candidate ever evaluated, its fitness, and the search's full history."""

    best: C
    best_fitness: float
    history: list[GenerationStats] = field(default_factory=list)
    evaluations: int = 0
    stopped: dict[str, Any] = field(default_factory=dict)  # why the search ended, after how many generations

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": _row(self.best),
            "best_fitness": self.best_fitness,
            "evaluations": self.evaluations,
            "history": [asdict(h) for h in self.history],
            "stopped": self.stopped,
        }


# ---------------------------------------------------------------------------------------------
# The search


def _rank_key(item: tuple[Any, float]) -> tuple[float, Any]:
    """Best first; equal fitness falls back to the allocation tuple, so ties are deterministic."""
    return (-item[1], item[0])


@dataclass(frozen=True)
class EvoIO:
    """What one search process reads and writes besides the fitness: its checkpoint and its
    progress bar. None of it changes the result; grouped so EvoSearch takes one object for them.

    The state at ``state_path`` (with ``fingerprint``, which a resume must match) is saved after
    every generation and, mid-generation, at most every ``save_interval_s`` seconds.
    ``write_state=False`` (every torchrun rank but 0) reads a saved state for a resume but never
    writes one.
    """

    state_path: str | os.PathLike[str] | None = None
    fingerprint: Mapping[str, Any] | None = None  # model, data, criterion, fitness, ...
    save_interval_s: float = 30.0
    write_state: bool = True
    progress: bool = True


class EvoSearch(Generic[C]):
    """Runs (and checkpoints, and resumes) one EvoESAP search.

    Offspring that were evaluated before or already sit in the new population are redrawn up
    to 16 times, so each generation spends its evaluations on new allocations; after that a
    duplicate is accepted (it costs no evaluation). Elites are the top m *distinct*
    allocations. Mid-generation, the state (with the fitness cache) is also saved at most
    every ``io.save_interval_s`` seconds, so a crash loses little evaluation work.
    """

    def __init__(
        self,
        evaluate: Callable[[C], float],
        space: SearchSpace[C],
        seeds: Mapping[str, C],
        config: SearchConfig | None = None,
        *,
        io: EvoIO | None = None,
        evaluate_many: Callable[[int, list[C]], Sequence[float]] | None = None,
    ) -> None:
        io = io or EvoIO()
        self.config = config or SearchConfig()
        self.config.validate()  # a config changed after it was made is checked again
        self.space, self.seeds = space, dict(seeds)
        self.evaluate = evaluate
        self.state_path = Path(io.state_path) if io.state_path is not None else None
        self.fingerprint = dict(io.fingerprint or {})
        self.progress = io.progress
        self.save_interval_s = io.save_interval_s
        self.evaluate_many = evaluate_many
        self.write_state = io.write_state
        self.cache: dict[C, float] = {}
        self.history: list[GenerationStats] = []
        self._last_save = time.monotonic()
        self._new_in_generation = 0  # evaluations so far in the generation being evaluated
        self.stopped: dict[str, Any] = {}  # why run() ended (search.json)

    @classmethod
    def counts(
        cls,
        evaluate: Callable[[Allocation], float],
        budget: int,
        caps: Sequence[int],
        uniform: Sequence[int],
        config: SearchConfig | None = None,
        multiples: Sequence[int] | None = None,
        *,
        io: EvoIO | None = None,
        evaluate_many: Callable[[int, list[Allocation]], Sequence[float]] | None = None,
    ) -> EvoSearch[Allocation]:
        """The search over drop counts (`CountSpace`) from the uniform allocation: bad settings
        (population < elites), an infeasible budget or uniform allocation fail here, in that order."""
        (config or SearchConfig()).validate()
        space = CountSpace(budget, caps, multiples)
        seeds = {"uniform": space.feas.check(uniform, "uniform allocation")}
        return EvoSearch(evaluate, space, seeds, config, io=io, evaluate_many=evaluate_many)

    # -- identity of a run: what must match for a resume -----------------------------------
    def _identity(self) -> dict[str, Any]:
        # the search core's settings; a resume may extend (or shorten) the run or stop it earlier
        # (generations, patience); the fitness is in the fingerprint, the sample count in the data's
        config = {
            name: getattr(self.config, name)
            for name in ("population", "elites", "delta_max", "tau_max", "seed")
        }
        identity = {"config": config, **self.space.describe(self.seeds), "fingerprint": self.fingerprint}
        return json.loads(json.dumps(identity))  # compare as saved: tuples become lists

    def _save(self, generation: int, population: list[C], rng: np.random.Generator) -> None:
        if self.state_path is None or not self.write_state:
            return
        state = {
            "version": STATE_VERSION,
            **self._identity(),
            "generations": self.config.generations,
            "generation": generation,
            "population": [_row(a) for a in population],
            "new_in_generation": self._new_in_generation,
            "cache": [[_row(a), f] for a, f in self.cache.items()],
            "rng": rng.bit_generator.state,
            "history": [asdict(h) for h in self.history],
        }
        write_json(self.state_path, state)
        self._last_save = time.monotonic()

    def _load(self) -> tuple[int, list[C], np.random.Generator]:
        if self.state_path is None:
            raise MoePruneError("resume needs a state_path")
        if not self.state_path.is_file():
            raise MoePruneError(f"cannot resume: no search state at {self.state_path}; run without resume")
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MoePruneError(
                f"cannot resume: {self.state_path} is not a readable search state ({exc})"
            ) from exc
        if state.get("version") != STATE_VERSION:
            raise MoePruneError(f"cannot resume: {self.state_path} has state version {state.get('version')}")
        for key, now in self._identity().items():
            saved = state.get(key)
            if saved != now:
                raise MoePruneError(
                    f"cannot resume: {_first_difference(key, saved, now)} differs from the saved search"
                    f" in {self.state_path}; use the same settings or start a new search"
                )
        self.cache = {_frozen(a): float(f) for a, f in state["cache"]}
        self.history = [GenerationStats(**h) for h in state["history"]]
        self._new_in_generation = int(state["new_in_generation"])
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state["rng"]
        return int(state["generation"]), [_frozen(a) for a in state["population"]], rng

    # -- the loop ------------------------------------------------------------------------------
    def _fitness(self, allocation: C) -> float:
        return _checked(allocation, self.evaluate(allocation))

    def _evaluate_population(
        self, generation: int, population: list[C], rng: np.random.Generator
    ) -> GenerationStats:
        if self.evaluate_many is not None:
            new = list(dict.fromkeys(a for a in population if a not in self.cache))
            values = list(self.evaluate_many(generation, new)) if new else []
            if len(values) != len(new):
                raise MoePruneError(
                    f"evaluate_many returned {len(values)} fitnesses for {len(new)} allocations"
                )
            for allocation, value in zip(new, values):
                self.cache[allocation] = _checked(allocation, value)
            self._new_in_generation += len(new)
        for allocation in population:
            if allocation in self.cache:
                continue
            self.cache[allocation] = self._fitness(allocation)
            self._new_in_generation += 1
            if time.monotonic() - self._last_save >= self.save_interval_s:
                self._save(generation, population, rng)
        fitnesses = [self.cache[a] for a in population]
        best_allocation, best = min(((a, self.cache[a]) for a in population), key=_rank_key)
        return GenerationStats(
            generation=generation,
            best=best,
            mean=float(np.mean(fitnesses)),
            fitnesses=fitnesses,
            new_evaluations=self._new_in_generation,
            best_allocation=_row(best_allocation),
        )

    def _breed(self, population: list[C], rng: np.random.Generator) -> list[C]:
        ranked = sorted({a: self.cache[a] for a in population}.items(), key=_rank_key)
        elites = [a for a, _ in ranked[: self.config.elites]]
        nxt = list(elites)
        while len(nxt) < self.config.population:
            for _ in range(_MAX_OFFSPRING_REDRAWS):
                parent = elites[int(rng.integers(len(elites)))]
                child = self.space.mutate(parent, self.config, rng)
                if child not in self.cache and child not in nxt:
                    break
            nxt.append(child)
        return nxt

    def run(self, resume: bool = False, carry: dict[str, Any] | None = None) -> EvoResult[C]:
        """Search for ``config.generations`` generations; ``resume`` continues the saved state.

        ``carry`` (`SearchRuntime.continuation`) is the same in memory: a run of this very search
        (the identity a resume checks) left its state there, and this run continues it, to the
        result a run started with this many generations reaches (module docstring); this run's
        state is left there in turn. Without either a fresh search starts and overwrites any state
        at ``state_path``.
        """
        self._last_save = time.monotonic()
        carried = carry.get(_CARRY) if carry is not None else None
        if resume:
            start, population, rng = self._load()
        elif (
            carried is not None
            and carried[0] == self._identity()
            and carried[1][0] <= self.config.generations
        ):
            start, population, rng, cache, history = carried[1]
            self.cache, self.history, self._new_in_generation = dict(cache), list(history), 0
        else:
            rng = np.random.Generator(np.random.PCG64(self.config.seed))
            self.cache, self.history, self._new_in_generation = {}, [], 0
            start = 0
            population = self.space.initial(list(self.seeds.values()), self.config, rng)
            self._save(0, population, rng)
        bar = progress_bar(
            total=self.config.generations,
            initial=min(start, self.config.generations),
            desc="evo search",
            unit="gen",
            enabled=self.progress,
            each_step=True,  # a generation takes long: without a terminal, one line each
        )
        fitness = self.fingerprint.get("fitness", "fitness")
        known = fitness in FITNESSES.names()
        sign = (
            1.0 if not known or FITNESSES.get(fitness).higher_is_better else -1.0
        )  # stored: higher is better
        self.stopped = {"reason": "generations", "generations_run": len(self.history)}
        try:
            for generation in range(start, self.config.generations):
                if self.stalled():
                    break
                self.history.append(self._evaluate_population(generation, population, rng))
                population = self._breed(population, rng)
                self._new_in_generation = 0
                self._save(generation + 1, population, rng)
                start = generation + 1  # where a continuation starts
                bar.set_postfix_str(f"best {fitness} so far {sign * self.result().best_fitness:.6g}")
                bar.update(1)
        finally:
            bar.close()
        stalled = self.stalled()
        self.stopped = {
            "reason": "patience"
            if stalled and len(self.history) < self.config.generations
            else "generations",
            "generations_run": len(self.history),
            **({"patience": self.config.patience} if self.config.patience else {}),
        }
        if carry is not None:  # the bred population and the generator as the next generation needs them
            state = (start, population, copy.deepcopy(rng), dict(self.cache), list(self.history))
            carry[_CARRY] = (self._identity(), state)
        return self.result()

    def stalled(self) -> bool:
        """Whether the best fitness ever seen has not improved in the last `patience` generations."""
        patience = self.config.patience
        if not patience or len(self.history) <= patience:
            return False
        best_before = max(h.best for h in self.history[:-patience])
        return max(h.best for h in self.history[-patience:]) <= best_before

    def result(self) -> EvoResult[C]:
        """The best allocation ever evaluated (ties: smallest tuple) and the history so far."""
        if not self.cache:
            raise MoePruneError("the search has not evaluated any allocation yet")
        best, fitness = min(self.cache.items(), key=_rank_key)
        return EvoResult(
            best=best,
            best_fitness=fitness,
            history=list(self.history),
            evaluations=len(self.cache),
            stopped=dict(self.stopped),
        )


def _row(candidate: Any) -> list[Any]:
    """A candidate (a tuple: of ints, or of per-layer tuples) as a list of its per-layer entries."""
    return list(candidate)


def _frozen(value: Any) -> Any:
    """A saved candidate as the cache keys it: lists back to (nested) tuples."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _checked(allocation: Any, value: float) -> float:
    value = float(value)
    if math.isnan(value):
        raise MoePruneError(f"the fitness of allocation {list(allocation)} is NaN")
    return value


def _first_difference(key: str, saved: Any, now: Any) -> str:
    """Name the innermost field that differs, e.g. ``fingerprint.criterion (saved 'reap', now 'seer')``."""
    if isinstance(saved, dict) and isinstance(now, dict):
        for sub in sorted(set(saved) | set(now)):
            if saved.get(sub) != now.get(sub):
                return _first_difference(f"{key}.{sub}", saved.get(sub), now.get(sub))
    return f"{key} (saved {saved!r}, now {now!r})"


def generations_document(
    history: Sequence[GenerationStats], sign: float, key: str, raced: Mapping[int, int] | None = None
) -> list[dict[str, Any]]:
    """search.json's `generations`: fitness in the user's direction (`sign`), each generation's
    best candidate under `key` as lists, and (drop counts) how many evaluations were `raced`."""
    return [
        {
            "generation": h.generation,
            "best": sign * h.best,
            "mean": sign * h.mean,
            "fitnesses": [sign * f for f in h.fitnesses],
            "new_evaluations": h.new_evaluations,
            **({"raced": raced.get(h.generation, 0)} if raced is not None else {}),
            key: listed(h.best_allocation),
        }
        for h in history
    ]
