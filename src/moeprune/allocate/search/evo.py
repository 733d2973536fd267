"""EvoESAP: evolutionary search over per-layer removal counts (README, "EvoESAP").

An allocation r = (r_1, ..., r_L) removes r_l routed experts from MoE layer l. It is feasible
when sum_l r_l = B, 0 <= r_l <= cap_l (cap_l = n_l - k_l) and r_l is a multiple of m_l (m_l > 1
for group-limited routers, which must lose the same number of experts in every group).

The search is generic in the fitness: ``evaluate(allocation) -> float``, higher is better (the
caller negates KL/NLL). Every distinct allocation is evaluated once (fitness cache). All
randomness comes from one ``numpy.random.Generator(PCG64(seed))`` whose state is checkpointed
with the population and cache after every generation, so an interrupted run resumes to the
identical result.

Batch evaluation (data-parallel search under torchrun, see :mod:`moeprune.search`): with
``evaluate_many``, each generation's new allocations (not cached, deduplicated, in population
order) are handed over at once, ``evaluate_many(generation, allocations) -> fitnesses``; the
state is then saved at generation boundaries only. ``write_state=False`` (every rank but 0)
reads a saved state for ``resume`` but never writes one.

Generation 0 evaluates the initial population; each later generation evaluates the m elites of
the previous one (cached) plus P - m offspring. ``generations`` counts evaluated generations,
including generation 0. The next population is always bred right after a generation is
evaluated, so a finished run can be extended by resuming with more generations and reaches the
same result as a run started with that many.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moeprune.errors import InfeasibleBudgetError, MoePruneError

Allocation = tuple[int, ...]

STATE_VERSION = 1
_MAX_STEP_TRIES = 64  # redraws of one infeasible level-switch step before giving up on the offspring
_MAX_OFFSPRING_REDRAWS = 16  # redraws of an offspring that was already seen


@dataclass(frozen=True)
class EvoConfig:
    """Search hyper-parameters; defaults are the paper's (P=32, m=4, T=50, Delta=4, tau=3)."""

    population: int = 32
    elites: int = 4
    generations: int = 50
    delta_max: int = 4
    tau_max: int = 3
    seed: int = 42
    patience: int | None = None  # stop after this many generations without a better best (None: never)

    def validate(self) -> None:
        for name in ("population", "elites", "generations", "delta_max", "tau_max"):
            if getattr(self, name) < 1:
                raise MoePruneError(f"evo {name} must be >= 1, got {getattr(self, name)}", options=(name,))
        if self.patience is not None and self.patience < 1:
            raise MoePruneError(f"evo patience must be >= 1 generation, got {self.patience}", options=("patience",))
        if self.population < self.elites:
            raise MoePruneError(f"evo population ({self.population}) must be >= elites ({self.elites})")
        if self.seed < 0:
            raise MoePruneError(f"evo seed must be >= 0, got {self.seed}")


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
class EvoResult:
    """The best allocation ever evaluated, its fitness, and the search's full history."""

    best: Allocation
    best_fitness: float
    history: list[GenerationStats] = field(default_factory=list)
    evaluations: int = 0
    stopped: dict[str, Any] = field(default_factory=dict)  # why the search ended, after how many generations

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": list(self.best),
            "best_fitness": self.best_fitness,
            "evaluations": self.evaluations,
            "history": [asdict(h) for h in self.history],
            "stopped": self.stopped,
        }


# ---------------------------------------------------------------------------------------------
# Feasibility


class Feasibility:
    """The constraint set of one search: caps, multiples, budget, with exact reachability.

    ``reach[l]`` is a bitset (a Python int) of the budgets that layers l..L-1 can absorb; it
    decides feasibility exactly (a bounded knapsack), and guides a repair that always succeeds
    when the budget is feasible.
    """

    def __init__(self, budget: int, caps: Sequence[int], multiples: Sequence[int] | None = None) -> None:
        self.budget = int(budget)
        self.caps = tuple(int(c) for c in caps)
        self.multiples = tuple(int(m) for m in multiples) if multiples is not None else (1,) * len(self.caps)
        if not self.caps:
            raise MoePruneError("the search needs at least one MoE layer")
        if len(self.multiples) != len(self.caps):
            raise MoePruneError(f"{len(self.multiples)} multiples for {len(self.caps)} layers")
        if min(self.caps) < 0 or min(self.multiples) < 1:
            raise MoePruneError("caps must be >= 0 and multiples >= 1")
        # Largest removable count per layer that is a multiple of the layer's group constraint.
        self.top = tuple(c // m * m for c, m in zip(self.caps, self.multiples))
        self.reach = [1] * (len(self.caps) + 1)
        for layer in reversed(range(len(self.caps))):
            acc, nxt, m = 0, self.reach[layer + 1], self.multiples[layer]
            for j in range(self.top[layer] // m + 1):
                acc |= nxt << (j * m)
            self.reach[layer] = acc
        if self.budget < 0 or not (self.reach[0] >> self.budget) & 1:
            raise InfeasibleBudgetError(
                f"cannot remove exactly {self.budget} experts with per-layer caps summing to"
                f" {sum(self.caps)} (at least top-k experts stay per layer)"
                + (
                    ""
                    if set(self.multiples) == {1}
                    else f" and per-layer multiples {sorted(set(self.multiples))}"
                )
            )

    @property
    def num_layers(self) -> int:
        return len(self.caps)

    def is_feasible(self, allocation: Sequence[int]) -> bool:
        return (
            len(allocation) == self.num_layers
            and sum(allocation) == self.budget
            and all(0 <= r <= c and r % m == 0 for r, c, m in zip(allocation, self.caps, self.multiples))
        )

    def check(self, allocation: Sequence[int], what: str = "allocation") -> Allocation:
        if not self.is_feasible(allocation):
            raise MoePruneError(
                f"{what} {list(allocation)} is not feasible for budget {self.budget}, caps {list(self.caps)}"
            )
        return tuple(int(r) for r in allocation)

    def project(self, target: Sequence[float]) -> Allocation:
        """A feasible allocation close (in squared error) to a real-valued per-layer target.

        Water-fill the target onto {0 <= r <= top, sum r = B}, round to multiples, then move
        single multiples where they cost least until the budget is exact; a sequential
        reachability-guided fill is the fallback that always succeeds.
        """
        top = np.asarray(self.top, dtype=np.float64)
        mult = np.asarray(self.multiples, dtype=np.int64)
        t = _water_fill(np.asarray(target, dtype=np.float64), top, self.budget)
        r = np.minimum(np.round(t / mult).astype(np.int64) * mult, np.asarray(self.top))
        for _ in range(2 * self.num_layers + 16):
            gap = self.budget - int(r.sum())
            if gap == 0:
                return tuple(int(x) for x in r)
            step = np.sign(gap) * mult
            ok = (np.abs(step) <= abs(gap)) & (r + step >= 0) & (r + step <= np.asarray(self.top))
            if not ok.any():
                break
            cost = np.where(ok, (r + step - t) ** 2 - (r - t) ** 2, np.inf)
            layer = int(np.argmin(cost))
            r[layer] += step[layer]
        return self._sequential_fill(t)

    def _sequential_fill(self, target: np.ndarray) -> Allocation:
        out, left = [], self.budget
        for layer, m in enumerate(self.multiples):
            options = [
                v
                for v in range(0, min(self.top[layer], left) + 1, m)
                if (self.reach[layer + 1] >> (left - v)) & 1
            ]
            v = min(options, key=lambda x: (abs(x - target[layer]), x))
            out.append(v)
            left -= v
        return tuple(out)


def _water_fill(target: np.ndarray, top: np.ndarray, budget: int) -> np.ndarray:
    """Euclidean projection of ``target`` onto {0 <= x <= top, sum x = budget}.

    The projection is clip(target + lam, 0, top) for the lam where the clipped sum equals the
    budget; that sum is piecewise linear in lam with breakpoints -target and top - target, so
    lam is found exactly by interpolating between the two breakpoints that bracket the budget.
    """
    lams = np.concatenate([[-target.max() - 1.0], np.sort(np.concatenate([-target, top - target]))])
    sums = np.clip(target[None, :] + lams[:, None], 0.0, top).sum(axis=1)
    i = int(np.searchsorted(sums, budget))  # first breakpoint whose sum reaches the budget
    if i == 0:
        lam = lams[0]
    elif i == len(lams):
        lam = lams[-1]
    else:
        lam = lams[i - 1] + (budget - sums[i - 1]) * (lams[i] - lams[i - 1]) / (sums[i] - sums[i - 1])
    return np.clip(target + lam, 0.0, top)


# ---------------------------------------------------------------------------------------------
# Initial population and mutation


def _profiles(num_layers: int) -> list[np.ndarray]:
    """Depth profiles that concentrate pruning early, in the middle or late, hard and smooth."""
    x = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.zeros(1)
    ramp_down, ramp_up, triangle = 1.0 - x, x, 1.0 - np.abs(2.0 * x - 1.0)
    return [
        (x < 1 / 3).astype(float),  # early block
        ((x >= 1 / 3) & (x <= 2 / 3)).astype(float),  # middle block
        (x > 2 / 3).astype(float),  # late block
        ramp_down,  # linear ramps and triangle: smooth variants
        triangle,
        ramp_up,
        0.5 + 0.5 * ramp_down,  # mild variants: half uniform, half shaped
        0.5 + 0.5 * triangle,
        0.5 + 0.5 * ramp_up,
        np.abs(2.0 * x - 1.0),  # both ends, spare the middle
    ]


def initial_population(
    budget: int,
    caps: Sequence[int],
    multiples: Sequence[int] | None,
    uniform: Sequence[int],
    config: EvoConfig,
    rng: np.random.Generator,
) -> list[Allocation]:
    """Uniform first, then patterned, then random feasible allocations; distinct, at most P.

    A tiny search space may hold fewer than P distinct allocations; the population is then
    smaller (random draws are bounded), and the generations fill up with offspring.
    """
    feas = Feasibility(budget, caps, multiples)
    population: dict[Allocation, None] = {feas.check(uniform, "uniform allocation"): None}
    for profile in _profiles(feas.num_layers):
        if len(population) >= config.population:
            break
        if profile.sum() > 0:
            population.setdefault(feas.project(budget * profile / profile.sum()), None)
    tries = 0
    while len(population) < config.population and tries < 50 * config.population:
        tries += 1
        population.setdefault(feas.project(budget * rng.dirichlet(np.ones(feas.num_layers))), None)
    return list(population)[: config.population]


def mutate(
    parent: Sequence[int],
    caps: Sequence[int],
    multiples: Sequence[int] | None,
    config: EvoConfig,
    rng: np.random.Generator,
) -> Allocation:
    """tau = min(U{1..tau_max}, U{1..tau_max}) level-switch steps r_a += D, r_b -= D.

    D = U{1..Delta_max} times lcm(m_a, m_b), so both layers stay on their multiples. An
    infeasible step is redrawn (a, b and D) up to a bounded number of times; if a step never
    becomes feasible (e.g. a single layer), the parent comes back unchanged.
    """
    child = [int(r) for r in parent]
    num_layers = len(child)
    mult = [1] * num_layers if multiples is None else [int(m) for m in multiples]
    if num_layers < 2:
        return tuple(child)
    tau = int(min(rng.integers(1, config.tau_max + 1), rng.integers(1, config.tau_max + 1)))
    for _ in range(tau):
        for _ in range(_MAX_STEP_TRIES):
            a, b = int(rng.integers(num_layers)), int(rng.integers(num_layers - 1))
            b += b >= a  # a uniform pair of distinct layers
            amount = int(rng.integers(1, config.delta_max + 1)) * math.lcm(mult[a], mult[b])
            if child[a] + amount <= caps[a] and child[b] - amount >= 0:
                child[a] += amount
                child[b] -= amount
                break
        else:
            return tuple(int(r) for r in parent)
    return tuple(child)


# ---------------------------------------------------------------------------------------------
# The search


def _rank_key(item: tuple[Allocation, float]) -> tuple[float, Allocation]:
    """Best first; equal fitness falls back to the allocation tuple, so ties are deterministic."""
    return (-item[1], item[0])


def _atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class EvoSearch:
    """Runs (and checkpoints, and resumes) one EvoESAP search.

    Offspring that were evaluated before or already sit in the new population are redrawn up
    to 16 times, so each generation spends its evaluations on new allocations; after that a
    duplicate is accepted (it costs no evaluation). Elites are the top m *distinct*
    allocations. Mid-generation, the state (with the fitness cache) is also saved at most
    every ``save_interval_s`` seconds, so a crash loses little evaluation work.
    """

    def __init__(
        self,
        evaluate: Callable[[Allocation], float],
        budget: int,
        caps: Sequence[int],
        uniform: Sequence[int],
        config: EvoConfig | None = None,
        multiples: Sequence[int] | None = None,
        state_path: str | os.PathLike[str] | None = None,
        fingerprint: dict[str, Any] | None = None,
        progress: bool = True,
        save_interval_s: float = 30.0,
        evaluate_many: Callable[[int, list[Allocation]], Sequence[float]] | None = None,
        write_state: bool = True,
    ) -> None:
        self.config = config or EvoConfig()
        self.config.validate()
        self.feas = Feasibility(budget, caps, multiples)
        self.uniform = self.feas.check(uniform, "uniform allocation")
        self.evaluate = evaluate
        self.state_path = Path(state_path) if state_path is not None else None
        self.fingerprint = dict(fingerprint or {})
        self.progress = progress
        self.save_interval_s = save_interval_s
        self.evaluate_many = evaluate_many
        self.write_state = write_state
        self.cache: dict[Allocation, float] = {}
        self.history: list[GenerationStats] = []
        self._last_save = time.monotonic()
        self._new_in_generation = 0  # evaluations so far in the generation being evaluated
        self.stopped: dict[str, Any] = {}  # why run() ended (search.json)

    # -- identity of a run: what must match for a resume -----------------------------------
    def _identity(self) -> dict[str, Any]:
        config = asdict(self.config)
        config.pop("generations")  # a resume may extend (or shorten) the run, or stop it earlier
        config.pop("patience")
        identity = {
            "config": config,
            "budget": self.feas.budget,
            "caps": list(self.feas.caps),
            "multiples": list(self.feas.multiples),
            "uniform": list(self.uniform),
            "fingerprint": self.fingerprint,
        }
        return json.loads(json.dumps(identity))  # compare as saved: tuples become lists

    def _save(self, generation: int, population: list[Allocation], rng: np.random.Generator) -> None:
        if self.state_path is None or not self.write_state:
            return
        state = {
            "version": STATE_VERSION,
            **self._identity(),
            "generations": self.config.generations,
            "generation": generation,
            "population": [list(a) for a in population],
            "new_in_generation": self._new_in_generation,
            "cache": [[list(a), f] for a, f in self.cache.items()],
            "rng": rng.bit_generator.state,
            "history": [asdict(h) for h in self.history],
        }
        _atomic_write_json(self.state_path, state)
        self._last_save = time.monotonic()

    def _load(self) -> tuple[int, list[Allocation], np.random.Generator]:
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
        self.cache = {tuple(a): float(f) for a, f in state["cache"]}
        self.history = [GenerationStats(**h) for h in state["history"]]
        self._new_in_generation = int(state["new_in_generation"])
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state["rng"]
        return int(state["generation"]), [tuple(a) for a in state["population"]], rng

    # -- the loop ------------------------------------------------------------------------------
    def _fitness(self, allocation: Allocation) -> float:
        return _checked(allocation, self.evaluate(allocation))

    def _evaluate_population(
        self, generation: int, population: list[Allocation], rng: np.random.Generator
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
            best_allocation=list(best_allocation),
        )

    def _breed(self, population: list[Allocation], rng: np.random.Generator) -> list[Allocation]:
        ranked = sorted({a: self.cache[a] for a in population}.items(), key=_rank_key)
        elites = [a for a, _ in ranked[: self.config.elites]]
        nxt = list(elites)
        while len(nxt) < self.config.population:
            for _ in range(_MAX_OFFSPRING_REDRAWS):
                parent = elites[int(rng.integers(len(elites)))]
                child = mutate(parent, self.feas.caps, self.feas.multiples, self.config, rng)
                if child not in self.cache and child not in nxt:
                    break
            nxt.append(child)
        return nxt

    def run(self, resume: bool = False) -> EvoResult:
        """Search for ``config.generations`` generations; ``resume`` continues the saved state.

        Without ``resume`` a fresh search starts and overwrites any state at ``state_path``.
        """
        self._last_save = time.monotonic()
        if resume:
            start, population, rng = self._load()
        else:
            rng = np.random.Generator(np.random.PCG64(self.config.seed))
            self.cache, self.history, self._new_in_generation = {}, [], 0
            start = 0
            population = initial_population(
                self.feas.budget, self.feas.caps, self.feas.multiples, self.uniform, self.config, rng
            )
            self._save(0, population, rng)
        bar = tqdm(
            total=self.config.generations,
            initial=min(start, self.config.generations),
            desc="evo search",
            unit="gen",
            disable=not self.progress,
        )
        self.stopped = {"reason": "generations", "generations_run": len(self.history)}
        try:
            for generation in range(start, self.config.generations):
                if self.stalled():
                    break
                self.history.append(self._evaluate_population(generation, population, rng))
                population = self._breed(population, rng)
                self._new_in_generation = 0
                self._save(generation + 1, population, rng)
                bar.update(1)
                bar.set_postfix(best=f"{self.result().best_fitness:.6g}")
        finally:
            bar.close()
        stalled = self.stalled()
        self.stopped = {
            "reason": "patience" if stalled and len(self.history) < self.config.generations else "generations",
            "generations_run": len(self.history),
            **({"patience": self.config.patience} if self.config.patience else {}),
        }
        return self.result()

    def stalled(self) -> bool:
        """Whether the best fitness ever seen has not improved in the last `patience` generations."""
        patience = self.config.patience
        if not patience or len(self.history) <= patience:
            return False
        best_before = max(h.best for h in self.history[:-patience])
        return max(h.best for h in self.history[-patience:]) <= best_before

    def result(self) -> EvoResult:
        """The best allocation ever evaluated (ties: smallest tuple) and the history so far."""
        if not self.cache:
            raise MoePruneError("the search has not evaluated any allocation yet")
        best, fitness = min(self.cache.items(), key=_rank_key)
        return EvoResult(
            best=best, best_fitness=fitness, history=list(self.history), evaluations=len(self.cache),
            stopped=dict(self.stopped),
        )  # fmt: skip


def _checked(allocation: Allocation, value: float) -> float:
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
