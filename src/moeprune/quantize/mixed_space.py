"""The search space of `--method mixed --quantize auto:A,B --target-size T --allocation evo` without
`--sparsity`: each MoE layer's mixed gene (experts whole, narrowed, novices, dropped, the narrowed
width) together with the scheme of its routed experts, under one byte budget.

A candidate is one (whole, narrowed, novice, dropped, width, scheme index) tuple per MoE layer.
Unlike `--method mixed` at a sparsity (search/mixed_space.py), no fill hands out neurons after the
fact: every narrowed expert of a layer keeps exactly `width` neurons, so the candidate alone is the
plan, its bytes and the prefix cache's key (a layer's tuple decides the hidden state leaving it).

Bytes, exact (quantize/keeps.py `kept_bytes`: the kept experts at their widths in the layer's
scheme, novices unquantized, dropped experts gone with their router rows, the rest at the base
scheme). A candidate is feasible when its genes keep the mixed rules (`check_genes`: super experts
whole, top_k experts keeping weights, drops within the cap and multiple, widths on the layer's
step) and its bytes are at most T.

Why a byte repair instead of mixed's fill: schemes make a neuron cost different bytes in different
layers, so no one unit absorbs the budget. `repair` shrinks (a width step down, whole to narrowed,
narrowed to novice or dropped, novice to dropped) in random layers while over T, then grows (a width
step up, dropped to novice, novice to narrowed, narrowed to whole) while T still holds, in a random
order: every candidate the search sees fits T and leaves less than its smallest growth unused.

Mutation: mixed's moves between forms (search/mixed_space.py) or a flip of one or two layers'
schemes, then the repair. Seeds: mixed's single-surgery recipes at the sparsities where one scheme
everywhere meets T (quantize/mixed.py), each with that scheme, and "quantize only" (every
expert whole) where it fits; generation 0 holds them first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeprune.config import SearchConfig
from moeprune.errors import MoePruneError
from moeprune.quantize.tables import LayerKeep, kept_bytes
from moeprune.search.mixed_space import MOVES, MixedSpace
from moeprune.search.space import listed_seeds, seeded_population
from moeprune.surgery.mixed import LayerCosts, LayerGene, check_genes
from moeprune.surgery.sizes import WeightBytes

Gene = tuple[int, int, int, int, int, int]  # whole, narrowed, novice, dropped, width, scheme index
JointGenes = tuple[Gene, ...]
_MAX_TRIES = 64  # redraws of a mutation that gives back its parent or an infeasible candidate
_SHRINK = ("width-", "whole>narrowed", "narrowed>novice", "narrowed>dropped", "novice>dropped")
_GROW = ("width+", "dropped>novice", "novice>narrowed", "narrowed>whole")


@dataclass(frozen=True)
class MixedPrecisionSpace:
    """Costs, byte tables and the target of one joint mixed search (per MoE layer, `layers` order)."""

    costs: tuple[LayerCosts, ...]  # parameters and limits of each layer (mixed's, with width steps)
    layers: tuple[int, ...]
    per: dict[str, WeightBytes]  # every scheme's bytes (quantize/keeps.py `scheme_bytes`), base first
    target: int  # T, in bytes
    novice_rank: int = 0

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self.per)

    def keeps(self, candidate: JointGenes) -> list[LayerKeep]:
        return [
            LayerKeep((c.width,) * g[0] + (g[4],) * g[1], g[2], g[3]) for c, g in zip(self.costs, candidate)
        ]

    def bytes(self, candidate: JointGenes) -> int:
        """The result's bytes on disk (the byte model's, exact)."""
        pb = kept_bytes(self.per, self.keeps(candidate), self.novice_rank)
        return pb.total(self.named(candidate))

    def named(self, candidate: JointGenes) -> list[str]:
        return [self.schemes[g[5]] for g in candidate]

    def genes(self, candidate: JointGenes) -> list[LayerGene]:
        return [LayerGene(*g[:5]) for g in candidate]

    def kept_parameters(self, candidate: JointGenes) -> int:
        return sum(c.kept(g) for c, g in zip(self.costs, self.genes(candidate)))

    def sparsity(self, candidate: JointGenes) -> float:
        """Routed parameters removed: the sparsity whose mixed fill keeps these widths exactly."""
        total = sum(c.experts * c.expert() for c in self.costs)
        return 1 - self.kept_parameters(candidate) / total

    def valid(self, candidate: JointGenes) -> bool:
        """The mixed rules hold (bytes aside)."""
        if len(candidate) != len(self.costs) or any(not 0 <= g[5] < len(self.per) for g in candidate):
            return False
        try:
            check_genes(self.costs, self.genes(candidate), self.layers)
        except MoePruneError:
            return False
        return all(g[1] == 0 or g[4] < c.width for c, g in zip(self.costs, candidate))

    def feasible(self, candidate: JointGenes) -> bool:
        return self.valid(candidate) and self.bytes(candidate) <= self.target

    def check(self, candidate: JointGenes, what: str) -> JointGenes:
        if not self.feasible(candidate):
            raise MoePruneError(
                f"{what} {[list(g) for g in candidate]} breaks a mixed rule or weighs more than the "
                f"target {self.target:,} bytes"
            )
        return candidate

    # -- repair --------------------------------------------------------------------------------
    def _moved(self, g: Gene, c: LayerCosts, move: str) -> Gene | None:
        """`g` after one shrinking or growing move, or None where the move does not apply."""
        w, n, v, d, width, s = g
        m = c.multiple
        below = c.width - 1 if c.step == 1 else (c.width - 1) // c.step * c.step  # a fresh narrowed width
        if move == "width-" and n and width - c.step >= max(c.step, 1):
            return (w, n, v, d, width - (width % c.step or c.step), s)
        if move == "width+" and n and width < below:
            return (w, n, v, d, min(width - width % c.step + c.step, below), s)
        if move == "whole>narrowed" and w > c.protected and below >= c.step:
            return (w - 1, n + 1, v, d, width if n else below, s)
        if move == "narrowed>whole" and n:
            return (w + 1, n - 1, v, d, width if n > 1 else c.width, s)
        if move == "narrowed>novice" and n and w + n - 1 >= c.top_k:
            return (w, n - 1, v + 1, d, width if n > 1 else c.width, s)
        if move == "novice>narrowed" and v and below >= c.step:
            return (w, n + 1, v - 1, d, width if n else c.step, s)
        if move == "narrowed>dropped" and n >= m and w + n - m >= c.top_k and d + m <= c.cap:
            return (w, n - m, v, d + m, width if n > m else c.width, s)
        if move == "novice>dropped" and v >= m and d + m <= c.cap:
            return (w, n, v - m, d + m, width, s)
        if move == "dropped>novice" and d >= m:
            return (w, n, v + m, d - m, width, s)
        return None

    def repair(self, candidate: JointGenes, rng: np.random.Generator) -> JointGenes | None:
        """Within the mixed rules and under T (module docstring), or None when no shrink gets there."""
        if not self.valid(candidate):
            return None
        cand = list(candidate)
        layers = range(len(cand))
        while self.bytes(tuple(cand)) > self.target:
            options = [
                (i, new)
                for i in layers
                for move in _SHRINK
                if (new := self._moved(cand[i], self.costs[i], move)) is not None
                and self.valid(tuple(cand[:i] + [new] + cand[i + 1 :]))
            ]
            if not options:
                return None
            i, cand[i] = options[int(rng.integers(len(options)))]
        grown = True
        while grown:  # growth given back, one move at a time, while T holds
            grown = False
            for i in rng.permutation(len(cand)).tolist():
                for move in rng.permutation(_GROW).tolist():
                    new = self._moved(cand[i], self.costs[i], move)
                    if new is not None and self.feasible(tuple(cand[:i] + [new] + cand[i + 1 :])):
                        cand[i], grown = new, True
                        break
        return tuple(cand)

    # -- mutation, the first generation --------------------------------------------------------
    def mutate(self, parent: JointGenes, config: SearchConfig, rng: np.random.Generator) -> JointGenes:
        """Mixed's moves between forms or scheme flips, repaired; the parent when every try fails."""
        for _ in range(_MAX_TRIES):
            child = list(parent)
            if len(self.per) > 1 and rng.random() < 0.5:
                flips = min(int(rng.integers(1, 3)), len(child))
                for i in rng.choice(len(child), size=flips, replace=False).tolist():
                    others = [k for k in range(len(self.per)) if k != child[i][5]]
                    w, n, v, d, width, _ = child[i]
                    child[i] = (w, n, v, d, width, others[int(rng.integers(len(others)))])
            else:
                i = int(rng.integers(len(child)))
                c = self.costs[i]
                step = MixedSpace.step(child[i][:5], c, str(rng.choice(MOVES)), config, rng)
                if step is None:
                    continue
                w, n, v, d, width = step
                if n and width >= c.width:  # narrowed to the full width: whole experts
                    w, n = w + n, 0
                child[i] = (w, n, v, d, width if n else c.width, child[i][5])
            fixed = self.repair(tuple(child), rng)
            if fixed is not None and fixed != parent:
                return fixed
        return parent

    def initial(
        self, seeds: Sequence[JointGenes], config: SearchConfig, rng: np.random.Generator
    ) -> list[JointGenes]:
        """The seeds (distinct, in order, every one of them even past P), then mutations of them."""
        return seeded_population(self, seeds, config, rng)

    def summary(self) -> dict[str, Any]:
        """search.json's account of the space."""
        return {
            "layers": list(self.layers),
            "schemes": list(self.schemes),
            "target_bytes": self.target,
            "novice_rank": self.novice_rank,
            "width_steps": [c.step for c in self.costs],
        }

    def describe(self, seeds: Mapping[str, JointGenes]) -> dict[str, Any]:
        """The search state's account of the space (search.json's) and the seeds."""
        return {"mixed_precision_space": self.summary(), "seeds": listed_seeds(seeds)}


__all__ = ["Gene", "JointGenes", "MixedPrecisionSpace"]
