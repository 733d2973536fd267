"""The search space of `--quantize auto:A,B --target-size T --allocation evo` without `--sparsity`:
experts removed per MoE layer together with each layer's scheme, under one byte budget.

A candidate is one (removed, scheme index) pair per MoE layer, held as a tuple of pairs so the
fitness cache and the search state key it like drop counts (and so its prefix up to layer p
decides the hidden state entering layer p: removals and bits of the earlier layers alike, which
makes it the prefix cache's key as it is).

Bytes, exact per layer (quantize/choice.py `precision_bytes` is linear in the removals):
bytes(r, s) = fixed - sum_l r_l router_row_l + sum_l (n_l - r_l) expert_l[s_l], where `fixed` is
every byte outside the routed experts at the base scheme (the list's first) with nothing removed.
A candidate is feasible when bytes <= T and every r_l is within the layer's cap and multiple
(allocate/limits.py). Unlike evo's drop counts, the total removed is free: a scheme with more bits
costs experts, fewer bits buy them back.

Mutation: evo's level-switch steps (removals moved between layers, the layer multiples kept) or a
flip of one or two layers' schemes, then `repair`: while over T, one more removal (one multiple)
in a random layer with room; then, in a random order, removals given back while T still holds.
So every candidate is feasible and uses the budget tightly (an expert given back never hurts the
fitness much and the search would otherwise waste evaluations on candidates that leave bytes
unused).

Generation 0 holds the seeds first (the grid's points: uniform splits, each with its DP choice of
schemes, sparsity 0 among them when it fits), so the best the search returns is at least as fit
on the search data as every seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moeprune.config import SearchConfig
from moeprune.errors import MoePruneError
from moeprune.search.space import listed_seeds, seeded_population

Joint = tuple[tuple[int, int], ...]  # per MoE layer: (experts removed, index of its scheme)
_MAX_TRIES = 64  # redraws of a mutation that gives back its parent or an infeasible candidate


@dataclass(frozen=True)
class PrecisionSpace:
    """Byte model and per-layer limits of one joint search (all per MoE layer, `moe.layers` order)."""

    schemes: tuple[str, ...]
    fixed: int  # bytes outside the routed experts at the base scheme, nothing removed
    router_rows: tuple[int, ...]  # bytes one removed expert takes off the router (base scheme)
    experts: tuple[int, ...]  # routed experts of the unpruned layer
    expert_bytes: tuple[tuple[int, ...], ...]  # one expert's bytes at each scheme
    caps: tuple[int, ...]  # most experts the layer may lose
    multiples: tuple[int, ...]  # removals are a multiple of this
    target: int  # T, in bytes

    def __post_init__(self) -> None:
        sizes = {len(self.router_rows), len(self.experts), len(self.expert_bytes), len(self.caps)}
        if sizes != {len(self.multiples)} or not self.multiples:
            raise MoePruneError("the precision space needs one entry per MoE layer in every field")

    @property
    def num_layers(self) -> int:
        return len(self.caps)

    def top(self, layer: int) -> int:
        return self.caps[layer] // self.multiples[layer] * self.multiples[layer]

    def bytes(self, candidate: Joint) -> int:
        """The result's bytes on disk (the byte model's, exact)."""
        total = self.fixed
        for layer, (r, s) in enumerate(candidate):
            total += (self.experts[layer] - r) * self.expert_bytes[layer][s] - r * self.router_rows[layer]
        return total

    def layer_bytes(self, candidate: Joint) -> list[int]:
        """Each layer's kept routed experts' bytes at its scheme (what `PrecisionBytes.layers` holds)."""
        return [(self.experts[i] - r) * self.expert_bytes[i][s] for i, (r, s) in enumerate(candidate)]

    def within_limits(self, candidate: Joint) -> bool:
        return len(candidate) == self.num_layers and all(
            0 <= r <= self.top(i) and r % self.multiples[i] == 0 and 0 <= s < len(self.schemes)
            for i, (r, s) in enumerate(candidate)
        )

    def feasible(self, candidate: Joint) -> bool:
        return self.within_limits(candidate) and self.bytes(candidate) <= self.target

    def check(self, candidate: Joint, what: str) -> Joint:
        if not self.feasible(candidate):
            raise MoePruneError(
                f"{what} {[list(c) for c in candidate]} weighs {self.bytes(candidate):,} bytes or breaks "
                f"a layer's limit; the target is {self.target:,}"
            )
        return tuple((int(r), int(s)) for r, s in candidate)

    def named(self, candidate: Joint) -> list[str]:
        return [self.schemes[s] for _, s in candidate]

    # -- repair, mutation, the first generation ---------------------------------------------------
    def repair(self, candidate: Sequence[Sequence[int]], rng: np.random.Generator) -> Joint | None:
        """Within the limits and under T (module docstring), or None when no removal gets it there."""
        m = self.multiples
        r = [min(max(int(c[0]), 0), self.top(i)) // m[i] * m[i] for i, c in enumerate(candidate)]
        s = [int(c[1]) for c in candidate]

        def total() -> int:
            return self.bytes(tuple(zip(r, s)))

        while total() > self.target:
            room = [i for i in range(self.num_layers) if r[i] + self.multiples[i] <= self.top(i)]
            if not room:
                return None
            i = room[int(rng.integers(len(room)))]
            r[i] += self.multiples[i]
        changed = True
        while changed:  # give removals back, one multiple at a time, while T holds
            changed = False
            for i in rng.permutation(self.num_layers).tolist():
                if r[i] >= self.multiples[i]:
                    r[i] -= self.multiples[i]
                    if total() <= self.target:
                        changed = True
                    else:
                        r[i] += self.multiples[i]
        return tuple(zip(r, s))

    def mutate(self, parent: Joint, config: SearchConfig, rng: np.random.Generator) -> Joint:
        """Level-switch steps or scheme flips, repaired; the parent itself when every try fails."""
        for _ in range(_MAX_TRIES):
            child = [list(c) for c in parent]
            if len(self.schemes) > 1 and (self.num_layers < 2 or rng.random() < 0.5):
                flips = min(int(rng.integers(1, 3)), self.num_layers)
                for layer in rng.choice(self.num_layers, size=flips, replace=False).tolist():
                    others = [k for k in range(len(self.schemes)) if k != child[layer][1]]
                    child[layer][1] = others[int(rng.integers(len(others)))]
            elif self.num_layers >= 2:
                tau = int(min(rng.integers(1, config.tau_max + 1), rng.integers(1, config.tau_max + 1)))
                for _ in range(tau):
                    a, b = int(rng.integers(self.num_layers)), int(rng.integers(self.num_layers - 1))
                    b += b >= a
                    step = int(rng.integers(1, config.delta_max + 1)) * math.lcm(
                        self.multiples[a], self.multiples[b]
                    )
                    if child[a][0] + step <= self.top(a) and child[b][0] - step >= 0:
                        child[a][0] += step
                        child[b][0] -= step
            fixed = self.repair(child, rng)
            if fixed is not None and fixed != parent:
                return fixed
        return parent

    def initial(self, seeds: Sequence[Joint], config: SearchConfig, rng: np.random.Generator) -> list[Joint]:
        """The seeds (distinct, in order, every one of them even past P), then mutations of them in
        turn up to P in all."""
        return seeded_population(self, seeds, config, rng)

    def describe(self, seeds: Mapping[str, Joint]) -> dict[str, Any]:
        """The search state's account of the space: every field, and the seeds."""
        return {"precision_space": json.loads(json.dumps(asdict(self))), "seeds": listed_seeds(seeds)}


__all__ = ["Joint", "PrecisionSpace"]
