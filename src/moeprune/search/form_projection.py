"""The exact budget for per-expert forms: a hard mixed plan from one score per (expert, form).

The mixed gradient allocation (search/gradient_mixed.py) gives every routed expert a score for
each form f in (whole, narrowed, novice, dropped); :func:`project_forms` turns the scores into
a hard plan that `mixed_plan` saves as it is: every count within `check_genes`' per-layer limits
and the kept routed parameters within half a neuron row of the budget (`fill_widths`, the same
exactness every mixed plan has). Deterministic (no randomness, ties to the lower form then the
lower expert id), a few milliseconds at DeepSeek-V3's size (numpy over N x 4 numbers).

Why this design: the scores do not depend on the narrowed width (the fill sets it), so a set of
forms is feasible when the narrowed experts can take up what the others leave: kept with every
narrowed expert at one neuron <= budget <= kept with them at every neuron. The projection is the
highest-scoring feasible set, found as follows.

1. **Lagrangian.** The argmax form of every expert, when it is feasible. When it keeps too much
   even at one neuron per narrowed expert, each expert takes argmax_f z_f - lambda x price_f
   (price: the form's parameters over a whole expert's, narrowed at one neuron), the least
   lambda that fits (the kept parameters only fall as lambda rises: each expert's chosen price is
   non-increasing in it, so bisection finds it); when it keeps too little even at full width, the
   same with + mu x price (narrowed at every neuron). That is the optimum of the relaxed problem
   up to the one expert at the switching point; a knapsack DP would be exact but costs budget x
   experts. Pricing narrowed experts at one fixed width instead (tried first) locks the width:
   a plan of few wide narrowed experts prices narrowing dear and so never finds the plan of many
   thin ones, even where that one is lossless (tests/allocate/test_gradient_mixed.py).
2. **Repair to the per-layer limits** (what `check_genes` holds): a layer's drops are rounded to
   its multiple (routing groups, `--expert-multiple`) and cap, and taken per routing group (each
   group loses as many: the experts of largest drop margin z_dropped - best other price-adjusted
   score); an expert put back takes its best other form. A layer with fewer than top_k experts
   holding weights narrows its novices with the largest z_narrowed - z_novice. Super experts and
   fixed layers are not free: whole.
3. **The width fill.** What the counts miss goes to the narrowed experts (`fill_widths`, one
   neuron each). When the fill cannot fit in [1, I] neurons, one move at a time in the direction
   needed, the one that loses the least score: to keep less, a whole expert narrowed or a
   narrowed one made a novice (or dropped); to keep more, a novice narrowed or a dropped expert
   put back (drops move one at a time only where a layer's multiple is 1).

The narrowed experts of a layer are listed by z_narrowed (highest first): `fill_widths` gives
the first ones the extra neuron, so :func:`plan_order` lists them in the order `mixed_plan`
reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moeprune.errors import MoePruneError
from moeprune.plan import Plan
from moeprune.surgery.mixed import LayerCosts, LayerGene, check_genes, fill_widths

WHOLE, NARROWED, NOVICE, DROPPED = range(4)
FORMS = ("whole", "narrowed", "novice", "dropped")
_BISECTION_STEPS = 60


@dataclass(frozen=True)
class FormPlan:
    """A hard assignment: per MoE layer each expert's form, the genes and the filled widths."""

    forms: list[np.ndarray]  # per layer [n] ints in FORMS order
    genes: list[LayerGene]
    widths: list[dict[int, int]]  # per layer: narrowed expert -> neurons it keeps
    width: int  # the narrowed experts' mean width (the one a not narrowed expert is scored at)

    def counts(self) -> list[dict[str, int]]:
        return [{name: int((f == k).sum()) for k, name in enumerate(FORMS)} for f in self.forms]


def _prices(costs: Sequence[LayerCosts], narrowed: str) -> np.ndarray:
    """[layers, 4] each form's parameters over a whole expert's, a narrowed expert at its least
    (one neuron: `narrowed` "min") or its most (every neuron: "max")."""
    return np.array(
        [
            [1.0, c.expert(1 if narrowed == "min" else c.width) / c.expert(), c.novice / c.expert(), 0.0]
            for c in costs
        ]
    )


def _kept(costs: Sequence[LayerCosts], forms: Sequence[np.ndarray], narrowed: str) -> float:
    out = 0.0
    for c, f in zip(costs, forms):
        n = np.bincount(f, minlength=4)
        out += (
            n[WHOLE] * c.expert()
            + n[NARROWED] * c.expert(1 if narrowed == "min" else c.width)
            + n[NOVICE] * c.novice
        )
    return out


def _lagrangian(costs: Sequence[LayerCosts], z: Sequence[np.ndarray], target: float) -> list[np.ndarray]:
    """The scores' argmax where the narrowed widths can meet `target`; else the argmax of
    z - lambda x price (keeping too much: prices at one neuron per narrowed expert) or
    z + mu x price (too little: at every neuron), the least lambda or mu that reaches the target
    (bisection). Returns the price-adjusted scores, whose argmax is the plan."""
    finite = np.concatenate([zl[np.isfinite(zl)] for zl in z])
    span = float(finite.max() - finite.min()) if finite.size else 0.0
    if _kept(costs, [np.argmax(zl, 1) for zl in z], "min") > target:
        prices, sign, side = _prices(costs, "min"), -1.0, "min"
    elif _kept(costs, [np.argmax(zl, 1) for zl in z], "max") < target:
        prices, sign, side = _prices(costs, "max"), 1.0, "max"
    else:
        return list(z)
    smallest = float(prices[:, 1:3][prices[:, 1:3] > 0].min(initial=1.0))
    lo, hi = 0.0, 2 * span / smallest + 1  # at hi every expert takes its cheapest (dearest) form

    def reached(lam: float) -> bool:
        kept = _kept(costs, [np.argmax(zl + sign * lam * p, 1) for zl, p in zip(z, prices)], side)
        return kept <= target if side == "min" else kept >= target

    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if reached(mid):
            hi = mid
        else:
            lo = mid
    return [zl + sign * hi * p for zl, p in zip(z, prices)]


def _repair_layer(
    c: LayerCosts, zl: np.ndarray, forms: np.ndarray, adjusted: np.ndarray, groups: int
) -> None:
    """In place: drops to a multiple within the cap, balanced over routing groups; top_k kept."""
    free = np.isfinite(zl[:, WHOLE]) & np.isfinite(zl[:, DROPPED])  # super experts: only whole finite
    other = np.where(np.arange(4) == DROPPED, -np.inf, adjusted)  # best non-drop, price-adjusted
    best_other = np.argmax(other, axis=1)
    margin = adjusted[:, DROPPED] - other.max(axis=1)
    d = int((forms == DROPPED).sum())
    d = min(int(round(d / c.multiple)) * c.multiple, c.cap - c.cap % c.multiple)
    size = c.experts // groups
    dropped = np.zeros(c.experts, dtype=bool)
    for g in range(groups):
        ids = np.arange(g * size, (g + 1) * size)
        ids = ids[free[ids]]
        ids = ids[np.lexsort((ids, -margin[ids]))]  # largest margin first, then the lower id
        dropped[ids[: d // groups]] = True
    forms[:] = np.where(dropped, DROPPED, np.where(forms == DROPPED, best_other, forms))
    holding = int(((forms == WHOLE) | (forms == NARROWED)).sum())
    if holding < c.top_k:
        novices = np.flatnonzero(forms == NOVICE)
        gain = zl[novices, NARROWED] - zl[novices, NOVICE]
        pick = novices[np.lexsort((novices, -gain))][: c.top_k - holding]
        forms[pick] = NARROWED


def _genes(costs: Sequence[LayerCosts], forms: Sequence[np.ndarray]) -> list[LayerGene]:
    out = []
    for c, f in zip(costs, forms):
        n = np.bincount(f, minlength=4)
        out.append(LayerGene(int(n[0]), int(n[1]), int(n[2]), int(n[3]), c.width))
    return out


def _fill_move(
    costs: Sequence[LayerCosts], z: Sequence[np.ndarray], forms: list[np.ndarray], keep_less: bool
) -> bool:
    """One move toward a fillable plan (module docstring, 3): the one losing the least score.
    A move that changes a layer's drops only where its drops come one at a time (multiple 1)."""
    best: tuple[float, int, int, int] | None = None  # (loss, layer, expert, new form)
    moves: tuple[tuple[int, int], ...]
    if keep_less:
        moves = ((WHOLE, NARROWED), (NARROWED, NOVICE), (NOVICE, DROPPED), (NARROWED, DROPPED))
    else:
        moves = ((NOVICE, NARROWED), (DROPPED, NOVICE), (DROPPED, NARROWED))
    for pos, (c, zl, f) in enumerate(zip(costs, z, forms)):
        holding = int(((f == WHOLE) | (f == NARROWED)).sum())
        drops = int((f == DROPPED).sum())
        for old, new in moves:
            if old == NARROWED and new != WHOLE and holding <= c.top_k:
                continue
            if DROPPED in (old, new) and (c.multiple != 1 or (new == DROPPED and drops >= c.cap)):
                continue
            for e in np.flatnonzero(f == old):
                loss = float(zl[e, old] - zl[e, new])
                if np.isfinite(loss) and (best is None or loss < best[0]):
                    best = (loss, pos, int(e), new)
    if best is None:
        return False
    forms[best[1]][best[2]] = best[3]
    return True


def _fill(
    costs: Sequence[LayerCosts], z: Sequence[np.ndarray], forms: list[np.ndarray], target: float
) -> tuple[list[LayerGene], list[list[int]]]:
    row = costs[0].per_neuron
    for _ in range(sum(c.experts for c in costs) + 1):
        genes = _genes(costs, forms)
        narrowed = sum(g.narrowed for g in genes)
        fixed = sum(
            g.whole * c.expert() + g.novice * c.novice + g.narrowed * c.per_expert
            for c, g in zip(costs, genes)
        )
        low = fixed + narrowed * row  # every narrowed expert at one neuron
        high = fixed + sum(g.narrowed * c.width * row for c, g in zip(costs, genes))
        keep_less = target - low < high - target  # the nearer end of the fillable range
        if low - row / 2 <= target <= high + row / 2:
            try:
                return genes, fill_widths(costs, genes, target)
            except MoePruneError:  # rounding at an end of the range: one more move
                pass
        if not _fill_move(costs, z, forms, keep_less=keep_less):
            break
    raise MoePruneError(
        "no per-expert mixed plan meets the parameter budget within the layers' limits; lower the sparsity",
        options=("sparsity",),
    )


def project_forms(
    costs: Sequence[LayerCosts],
    z: Sequence[np.ndarray],
    target: float,
    layers: Sequence[int],
    groups: Sequence[int],
) -> FormPlan:
    """The hard plan of scores `z` (per MoE layer [n, 4], -inf where a form is not allowed: super
    experts and fixed layers have only `whole` finite) keeping `target` routed parameters (module
    docstring)."""
    z = [np.asarray(zl, dtype=np.float64) for zl in z]
    adjusted = _lagrangian(costs, z, target)
    forms = [np.argmax(a, axis=1) for a in adjusted]
    for c, zl, f, a, g in zip(costs, z, forms, adjusted, groups):
        _repair_layer(c, zl, f, a, g)
    genes, filled = _fill(costs, z, forms, target)
    # every width gene at the least filled width: the same shift for every slot, so `fill_widths`
    # hands out the same neurons (a per-layer minimum would move them between layers)
    least = min((w for ws in filled for w in ws), default=0)
    genes = [replace(g, width=least) if g.narrowed else g for g in genes]
    check_genes(costs, genes, layers)
    widths = []
    for zl, f, ws in zip(z, forms, filled):
        narrowed = np.flatnonzero(f == NARROWED)
        ranked = narrowed[np.lexsort((narrowed, -zl[narrowed, NARROWED]))]
        widths.append({int(e): int(w) for e, w in zip(ranked, ws)})
    every = [w for ws in filled for w in ws]
    return FormPlan(forms, genes, widths, int(round(float(np.mean(every)))) if every else costs[0].width)


def plan_order(plan: FormPlan, pos: int, z: np.ndarray, protected: Sequence[int]) -> list[int]:
    """Layer `pos`'s pruning order under which `mixed_plan` with `plan.genes` makes exactly this
    plan: dropped first (each group's earliest go), then novices, the narrowed experts (the one
    filled first last: `mixed_plan` reads the order backwards), whole ones, super experts last."""
    f = plan.forms[pos]
    supers = set(int(e) for e in protected)
    by_form = {k: [int(e) for e in np.flatnonzero(f == k) if int(e) not in supers] for k in range(4)}
    narrowed = list(reversed(list(plan.widths[pos])))  # widths lists them most-filled first
    whole = sorted(by_form[WHOLE], key=lambda e: (z[e, WHOLE], -e))  # the most wanted last
    return by_form[DROPPED] + by_form[NOVICE] + narrowed + whole + sorted(supers)


def forms_of_plan(plan: Plan) -> dict[str, dict[str, Any]]:
    """Per decoder layer, the experts of each form in a mixed plan (narrowed: id -> neurons kept)."""
    out = {}
    for lp in plan.layers:
        other = set(lp.novice) | set(lp.neurons)
        out[str(lp.layer)] = {
            "whole": sorted(int(e) for e in lp.kept if e not in other),
            "narrowed": {str(e): int(w) for e, w in lp.neurons.items()},
            "novice": sorted(int(e) for e in lp.novice),
            "dropped": sorted(int(e) for e in lp.dropped),
        }
    return out
