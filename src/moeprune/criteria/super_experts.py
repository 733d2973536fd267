"""Super experts: the few routed experts whose massive activations the model cannot lose.

A handful of experts emit outputs orders of magnitude larger than the rest; attention sinks are
built from them, and removing three of Qwen3-30B-A3B's 6,144 experts collapses the model
(Su et al., "Unveiling Super Experts in Mixture-of-Experts Large Language Models",
arXiv 2507.23279). Their rule, applied here:

- per routed expert, a = the largest |element| of its output E_i(h_t) (before the routing
  weight) over the calibration tokens routed to it (`LayerStats.output_absmax`);
- pool a over every expert of every MoE layer that received at least one token;
- expert i is super iff a_i > P99.5(pool) and a_i > max(pool) / 10.

P99.5 is numpy's default percentile (linear interpolation between the two closest ranks), so
with fewer than 200 pooled experts the largest one is always above it: a tiny model always has
at least one super expert unless its maxima tie. The guard (`protected_order` here, per-layer
caps in allocate/limits.py) keeps them through every allocation and expert method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from moeprune.criteria.registry import LayerScores
from moeprune.errors import MoePruneError
from moeprune.observe.kinds import Statistic
from moeprune.observe.stats import ExpertStats, as_domains

PERCENTILE = 99.5
FRACTION_OF_MAX = 0.1
# what the guard reads (observe/kinds.py): asked of every pass that finds super experts, which is
# every calibrated prune and score: with allow_super_experts the report still names them
GUARD_STATISTICS = frozenset({Statistic.MAXIMA})
NOT_CHECKED = (
    "super experts were not checked (no calibration data was read): give calibration data "
    "to find and keep them"
)


def expert_maxima(stats: ExpertStats | Sequence[ExpertStats]) -> dict[int, np.ndarray]:
    """Per decoder layer, [E] the largest |output element| over every domain (NaN where no token
    reached the expert: it is left out of the pool)."""
    domains = as_domains(stats)
    out = {}
    for first in domains[0].layers:
        count = torch.zeros(first.num_experts, dtype=torch.float64)
        peak = torch.zeros(first.num_experts, dtype=torch.float64)
        for d in domains:
            s = d.layer(first.layer)
            if s.output_absmax is None:
                raise MoePruneError(
                    "these calibration statistics predate the super-expert statistic "
                    "(output_absmax): observe the calibration data again",
                    options=("data",),
                )
            count += s.count.cpu()
            peak = torch.maximum(peak, s.output_absmax.cpu().to(torch.float64))
        values = peak.numpy().copy()
        values[count.numpy() == 0] = np.nan
        out[first.layer] = values
    return out


def find_super_experts(maxima: Mapping[int, np.ndarray]) -> dict[int, list[int]]:
    """The rule on per-layer maxima (NaN: not routed, left out): `{layer: [ids]}`, layers without
    a super expert left out, ids ascending."""
    pooled = np.concatenate([np.asarray(v, dtype=np.float64) for v in maxima.values()] or [np.zeros(0)])
    pooled = pooled[~np.isnan(pooled)]
    if pooled.size == 0:
        return {}
    threshold = max(float(np.percentile(pooled, PERCENTILE)), float(pooled.max()) * FRACTION_OF_MAX)
    found = {}
    for layer, values in maxima.items():
        values = np.asarray(values, dtype=np.float64)
        ids = [int(i) for i in np.flatnonzero(~np.isnan(values) & (values > threshold))]
        if ids:
            found[int(layer)] = ids
    return found


def super_experts(stats: ExpertStats | Sequence[ExpertStats]) -> dict[int, list[int]]:
    """The super experts of the observed model, `{decoder layer: [expert ids]}`."""
    return find_super_experts(expert_maxima(stats))


def protected_order(
    scores: Sequence[LayerScores], protected: Mapping[int, Sequence[int]]
) -> list[LayerScores]:
    """The same scores with each layer's protected experts moved to the end of its pruning order
    (relative order kept): every expert method removes a prefix of the order, and the per-layer
    caps (allocate/limits.py) never reach them. Scores themselves are unchanged."""
    if not protected:
        return list(scores)
    out = []
    for s in scores:
        keep = set(protected.get(s.layer, ()))
        if not keep:
            out.append(s)
            continue
        order = [e for e in s.order if e not in keep] + [e for e in s.order if e in keep]
        out.append(LayerScores(layer=s.layer, scores=s.scores, order=order))
    return out


def as_report(protected: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    """`{layer: [ids]}` with string keys, like report.json's other per-layer maps."""
    return {str(layer): [int(e) for e in ids] for layer, ids in sorted(protected.items())}


NEURONS_WHOLE = "super experts kept whole: the result is in moeprune format; --allow-super-experts gives a stock checkpoint"
KEPT = "were kept: no plan removes them"  # a method's own sentence when it has none (Method.super_experts)


def guard_note(found: Mapping[int, Sequence[int]] | None, allowed: bool, kept: str = KEPT) -> str:
    """The report's one sentence on the guard: what was found and what the plan did with it
    (`kept`: the method's own words for what its plans do with them, `Method.super_experts`)."""
    if found is None:
        return NOT_CHECKED
    if not found:
        return "no super expert was found in the calibration statistics"
    named = "; ".join(f"layer {layer}: {', '.join(map(str, ids))}" for layer, ids in sorted(found.items()))
    if allowed:
        return f"super experts ({named}) were not protected (allow_super_experts): the plan may remove them"
    return f"super experts ({named}) {kept}"


def found_in(stats: Sequence[ExpertStats]) -> dict[str, list[int]] | None:
    """report.json / scores.json's `super_experts`: `{layer: [ids]}`, None without statistics."""
    return as_report(super_experts(list(stats))) if stats else None


def guard_document(document: dict, allowed: bool) -> dict:
    """The `moeprune score` document with each layer's `order` as `moeprune prune` would use it:
    the super experts last (unless `allowed`), and `super_experts_guarded` saying which it is."""
    found = document.get("super_experts") or {}
    if found and not allowed:
        for layer in document["layers"]:
            keep = set(found.get(str(layer["layer"]), ()))
            layer["order"] = [e for e in layer["order"] if e not in keep] + [
                e for e in layer["order"] if e in keep
            ]
    return {**document, "super_experts_guarded": bool(found) and not allowed}
