"""The search space of EvoESAP: feasible allocations, the initial population, and mutation.

An allocation r = (r_1, ..., r_L) removes r_l routed experts from MoE layer l. It is feasible
when sum_l r_l = B, 0 <= r_l <= cap_l (cap_l = n_l - k_l) and r_l is a multiple of m_l (m_l > 1
for group-limited routers, which must lose the same number of experts in every group, or for
expert counts kept in multiples). Every function here keeps candidates feasible by construction
and takes its randomness from the caller's generator, so a search is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moeprune.config import SearchConfig
from moeprune.errors import InfeasibleBudgetError, MoePruneError

Allocation = tuple[int, ...]  # experts removed per MoE layer
_MAX_STEP_TRIES = 64  # redraws of one infeasible level-switch step before giving up on the offspring


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

    def project(self, target: Sequence[float] | np.ndarray) -> Allocation:
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
    config: SearchConfig,
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
    config: SearchConfig,
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
