"""The search space of `--method mixed --allocation evo`: per-layer genes, the seeds, mutation.

A candidate is one `LayerGene` per MoE layer, held as a tuple of (whole, narrowed, novice,
dropped, width) tuples so the fitness cache and the search state key it like drop counts.

Why the budget is exact for every candidate: a gene's whole experts, novices and drops come in
whole units; `fill_widths` hands what they miss to the narrowed experts of every layer, one
neuron each (a block of the layer's width step each under `--width-multiple`: the budget then met
within half a block, surgery/mixed.py). A candidate is feasible when `check_genes` accepts it
(super experts whole, top_k experts keeping weights, drops within the layer's cap and multiple:
routing groups balanced as drop does; the width gene on the layer's step) and the fill keeps every
narrowed expert in [step, I] neurons. Mutation redraws an infeasible step and moves widths by whole
steps, so every candidate the search sees meets the one budget on the width multiple. The steps
are the uniform plan's (`stepped_costs`), so the seeds, the search and the saved plan agree.

Why the seeds: the first generation holds today's single-surgery recipes as genes (uniform drop,
uniform novices (at the run's `--novice-rank`, so at its cost d + 2dR), TENP's trapezoid, uniform neurons: ENP), so the best the search returns is at
least as fit as each of them on the search data. A recipe whose counts alone miss the parameter
budget (drop and novices come in whole experts) narrows as few experts as the fill needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple
from typing import Any, cast

import numpy as np

from moeprune.allocate.basic import uniform_allocation
from moeprune.allocate.limits import LayerLimits
from moeprune.allocate.trapezoid import TrapezoidLayer, trapezoid_allocation
from moeprune.config import SearchConfig
from moeprune.errors import InfeasibleBudgetError, MoePruneError
from moeprune.models.adapter import ExpertCost
from moeprune.search.space import listed_seeds
from moeprune.surgery.mixed import (
    LayerCosts,
    LayerGene,
    MixedOptions,
    check_genes,
    fill_widths,
    uniform_genes,
)

Genes = tuple[tuple[int, int, int, int, int], ...]  # per MoE layer: astuple(LayerGene)
_MAX_STEP_TRIES = 64  # redraws of one infeasible step before the offspring is its parent
MOVES = (
    "whole>narrowed",
    "narrowed>whole",
    "width",
    "novice>dropped",
    "dropped>novice",
    "narrowed>novice",
    "novice>narrowed",
    "narrowed>dropped",
    "dropped>narrowed",
)


def as_genes(candidate: Genes) -> list[LayerGene]:
    return [LayerGene(*g) for g in candidate]


def as_candidate(genes: Sequence[LayerGene]) -> Genes:
    return tuple(cast(tuple[int, int, int, int, int], astuple(g)) for g in genes)


class MixedSpace:
    """The feasible genes of one model and budget (parameters kept: `target`)."""

    def __init__(self, costs: Sequence[LayerCosts], layers: Sequence[int], sparsity: float) -> None:
        self.costs, self.layers, self.sparsity = list(costs), list(layers), float(sparsity)
        self.target = (1 - sparsity) * sum(c.experts * c.expert() for c in costs)

    def widths(self, candidate: Genes) -> list[list[int]]:
        """The narrowed experts' neurons that meet the budget; MoePruneError when infeasible."""
        genes = as_genes(candidate)
        check_genes(self.costs, genes, self.layers)
        return fill_widths(self.costs, genes, self.target)

    def feasible(self, candidate: Genes) -> bool:
        try:
            self.widths(candidate)
        except MoePruneError:
            return False
        return True

    def canonical(self, candidate: Genes) -> Genes:
        """The same plan with each layer's width gene at its filled minimum (full width when
        nothing is narrowed): genes that mean one plan look alike."""
        out = []
        for c, g, ws in zip(self.costs, candidate, self.widths(candidate)):
            out.append((g[0], g[1], g[2], g[3], min(ws) if ws else c.width))
        fixed = tuple(out)
        return fixed if self.feasible(fixed) else candidate

    def prefix_key(self, candidate: Genes) -> tuple:
        """Per MoE layer, what decides it exactly (counts and filled widths): the prefix cache's key."""
        return tuple((*g[:4], tuple(ws)) for g, ws in zip(candidate, self.widths(candidate)))

    # -- the seeds ------------------------------------------------------------------------------
    def repair(self, candidate: Genes, rng: np.random.Generator | None = None) -> Genes | None:
        """`candidate` made feasible by narrowing as few experts as the fill needs (a whole one when
        it keeps too much, a novice or dropped one when too little), round-robin over layers (no
        randomness: `rng` is unused)."""
        cand = candidate
        for step in range(sum(c.experts for c in self.costs) + 1):
            if self.feasible(cand):
                return self.canonical(cand)
            kept = sum(c.kept(g) for c, g in zip(self.costs, as_genes(cand)))
            over = kept > self.target
            changed = False
            for offset in range(len(self.costs)):
                pos = (step + offset) % len(self.costs)
                c, (w, n, v, d, width) = self.costs[pos], cand[pos]
                width = width if n else (c.width if over else min(c.step, c.width))
                if over and w > max(c.protected, 0) and w + n >= c.top_k:
                    new = (w - 1, n + 1, v, d, width)
                elif not over and v:
                    new = (w, n + 1, v - 1, d, width)
                elif not over and d and c.multiple == 1:
                    new = (w, n + 1, v, d - 1, width)
                else:
                    continue
                cand = cand[:pos] + (new,) + cand[pos + 1 :]
                changed = True
                break
            if not changed:
                return None
        return None

    def seeds(self, limits: LayerLimits, uniform: MixedOptions) -> dict[str, Genes]:
        """Today's single-surgery recipes as genes (module docstring), by name; a recipe the budget
        or the layers' limits rule out is left out (search.json lists the seeds it kept)."""
        out: dict[str, Genes] = {}
        for name, genes in self.recipes(limits, uniform).items():
            cand = self.repair(as_candidate(genes)) if genes is not None else None
            if cand is not None and cand not in out.values():
                out[name] = cand
        if not out:
            raise MoePruneError(
                f"no mixed recipe meets sparsity {self.sparsity} within the layers' limits; lower the sparsity",
                options=("sparsity",),
            )
        return out

    def recipes(self, limits: LayerLimits, uniform: MixedOptions) -> dict[str, list[LayerGene] | None]:
        """The recipes' genes as each recipe makes them at the sparsity, before the budget's repair
        (None: the recipe cannot reach it)."""
        costs, s = self.costs, self.sparsity
        recipes: dict[str, list[LayerGene] | None] = {}
        try:
            removed = uniform_allocation(
                limits.budget(s), limits.num_experts, limits.top_k, **limits.as_kwargs()
            )
            recipes["drop"] = [LayerGene(c.experts - r, 0, 0, r, c.width) for c, r in zip(costs, removed)]
        except InfeasibleBudgetError:
            recipes["drop"] = None
        novices: list[LayerGene] | None = []
        for c in costs:  # a novice (of rank R: d + 2dR parameters) saves P - n of P
            if c.novice >= c.expert() or novices is None:
                novices = None  # a novice as large as an expert saves nothing: no such recipe
                continue
            r = min(round(s * c.experts * c.expert() / (c.expert() - c.novice)), c.experts - c.top_k)
            novices.append(LayerGene(c.experts - r, 0, r, 0, c.width))
        recipes["novice"] = novices
        try:  # TENP's trapezoid on the same width steps
            trapezoid = trapezoid_allocation(
                [TrapezoidLayer(c.experts, c.width, _cost(c)) for c in costs],
                1 - s,
                steps=[c.step for c in costs],
            )
            recipes["tenp"] = [
                LayerGene(w := max(whole, c.protected), c.experts - w, 0, 0, min(ws) if ws else c.width)
                for c, whole, ws in zip(costs, trapezoid.important, trapezoid.widths)
            ]
        except MoePruneError:  # less than one block left to its narrowed experts
            recipes["tenp"] = None
        for name, options in (("neurons", MixedOptions(mixed_whole=0.0)), ("uniform", uniform)):
            try:
                recipes[name] = uniform_genes(costs, s, options)
            except MoePruneError:
                recipes[name] = None
        return recipes

    def describe(self, seeds: Mapping[str, Genes]) -> dict[str, Any]:
        """The search state's account of the space: the budget, the layers and the seeds."""
        return {"target": self.target, "layers": self.layers, "seeds": listed_seeds(seeds)}

    # -- mutation -------------------------------------------------------------------------------
    def initial(self, seeds: Sequence[Genes], config: SearchConfig, rng: np.random.Generator) -> list[Genes]:
        """The seeds first, then mutants of them (several steps each), distinct, at most P."""
        population: dict[Genes, None] = dict.fromkeys(seeds)
        tries = 0
        while len(population) < config.population and tries < 50 * config.population:
            parent = seeds[tries % len(seeds)]
            tries += 1
            child = parent
            for _ in range(1 + tries % 4):
                child = self.mutate(child, config, rng)
            population.setdefault(child, None)
        return list(population)[: max(config.population, len(seeds))]

    def mutate(self, parent: Genes, config: SearchConfig, rng: np.random.Generator) -> Genes:
        """tau = min(U{1..tau_max}, U{1..tau_max}) steps, each a move between forms in one layer
        (whole<->narrowed, novice<->dropped, narrowed<->novice, narrowed<->dropped, width up or
        down by U{1..delta_max} sixteenths); the fill moves the budget between layers. An
        infeasible step is redrawn; a step that never fits leaves the parent."""
        child = parent
        tau = int(min(rng.integers(1, config.tau_max + 1), rng.integers(1, config.tau_max + 1)))
        for _ in range(tau):
            for _ in range(_MAX_STEP_TRIES):
                pos = int(rng.integers(len(child)))
                step = self.step(child[pos], self.costs[pos], str(rng.choice(MOVES)), config, rng)
                if step is None:
                    continue
                trial = child[:pos] + (step,) + child[pos + 1 :]
                if self.feasible(trial):
                    child = trial
                    break
            else:
                return parent
        return self.canonical(child)

    @staticmethod
    def step(
        g: tuple[int, ...], c: LayerCosts, move: str, config: SearchConfig, rng: np.random.Generator
    ) -> tuple[int, int, int, int, int] | None:
        w, n, v, d, width = g
        m = c.multiple
        start = width if n else c.width
        if move == "whole>narrowed" and w:
            return (w - 1, n + 1, v, d, start)
        if move == "narrowed>whole" and n:
            return (w + 1, n - 1, v, d, width)
        if move == "width" and n:  # whole steps of the layer's width multiple
            unit = max(c.step, c.width // 16 - c.width // 16 % c.step)
            delta = int(rng.integers(1, config.delta_max + 1)) * unit
            new = min(c.width, max(min(c.step, c.width), width + (delta if rng.integers(2) else -delta)))
            new = new if new == c.width else new - new % c.step
            return (w, n, v, d, new) if new != width else None
        if move == "novice>dropped" and v >= m:
            return (w, n, v - m, d + m, width)
        if move == "dropped>novice" and d >= m:
            return (w, n, v + m, d - m, width)
        if move == "narrowed>novice" and n:
            return (w, n - 1, v + 1, d, width)
        if move == "novice>narrowed" and v:
            return (w, n + 1, v - 1, d, start)
        if move == "narrowed>dropped" and n >= m:
            return (w, n - m, v, d + m, width)
        if move == "dropped>narrowed" and d >= m:
            return (w, n + m, v, d - m, start)
        return None


def _cost(c: LayerCosts) -> ExpertCost:
    return ExpertCost(per_neuron=c.per_neuron, per_expert=c.per_expert)
