"""Scores of every MoE layer under one criterion, whatever it needs (statistics, weights, a seed).

Also the `moeprune score` JSON document (its keys are a contract) and the report's sentence on
experts no calibration token reached.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import cast

import numpy as np
import torch

from moeprune.criteria.baseline import random_scores
from moeprune.criteria.data import data_scores
from moeprune.criteria.registry import (
    Criterion,
    ExpertWeightSource,
    LayerScores,
    get_criterion,
    pruning_order_of,
)
from moeprune.criteria.super_experts import GUARD_STATISTICS
from moeprune.criteria.weights import weight_scores
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.distributed import observe_distributed
from moeprune.observe.kinds import NONE, Statistic, union
from moeprune.observe.stats import ExpertStats, as_domains


def _select(available: list[int], layers: Sequence[int] | None) -> list[int]:
    if layers is None:
        return available
    missing = [i for i in layers if i not in available]
    if missing:
        raise MoePruneError(f"no MoE layer at decoder layer(s) {missing}; MoE layers are {available}")
    return list(layers)


def _random_shapes(
    stats: ExpertStats | Sequence[ExpertStats] | None,
    weights: Sequence[ExpertWeightSource] | None,
    num_experts: Sequence[int] | None,
    layers: Sequence[int] | None,
) -> list[tuple[int, int]]:
    if num_experts is not None:
        ids = list(layers) if layers is not None else list(range(len(num_experts)))
        if len(ids) != len(num_experts):
            raise MoePruneError(f"got {len(num_experts)} expert counts for {len(ids)} layers")
        return list(zip(ids, (int(n) for n in num_experts)))
    if stats is not None:
        pairs = [(s.layer, s.num_experts) for s in as_domains(stats)[0].layers]
    elif weights is not None:
        pairs = [(w.layer, w.num_experts) for w in weights]
    else:
        raise MoePruneError("criterion 'random' needs the number of experts per MoE layer (num_experts)")
    by_layer = dict(pairs)
    return [(i, by_layer[i]) for i in _select(list(by_layer), layers)]


def _check_counts(num_experts: Sequence[int] | None, result: list[LayerScores]) -> None:
    if num_experts is None:
        return
    got = [len(r.scores) for r in result]
    if list(num_experts) != got:
        raise MoePruneError(f"expert counts {list(num_experts)} do not match the scored layers' {got}")


def compute_scores(
    name: str,
    *,
    stats: ExpertStats | Sequence[ExpertStats] | None = None,
    weights: Sequence[ExpertWeightSource] | None = None,
    seed: int = 0,
    num_experts: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
) -> list[LayerScores]:
    """Score every expert of every (selected) MoE layer with criterion `name`.

    `stats` may be a list of per-domain statistics: per-domain criteria (tenp) mix them with a
    per-layer norm normalisation, the others merge them into one calibration set. `layers`
    restricts scoring to those decoder layers (output in that order); for random without stats
    or weights, it names the decoder layers that `num_experts` describes (default 0..L-1).
    """
    crit = get_criterion(name)
    if crit.needs_data:
        if stats is None:
            raise MoePruneError(
                f"criterion {name!r} needs calibration data: give data files", options=("data",)
            )
        domains = as_domains(stats)
        ids = _select([s.layer for s in domains[0].layers], layers)
        raw = data_scores(crit, domains, ids)
    elif crit.needs_weights:
        if not weights:
            raise MoePruneError(f"criterion {name!r} needs the model's expert weights: pass the model")
        by_layer = {w.layer: w for w in weights}
        ids = _select(list(by_layer), layers)
        raw = weight_scores(crit, [by_layer[i] for i in ids])
    else:
        shapes = _random_shapes(stats, weights, num_experts, layers)
        ids = [layer for layer, _ in shapes]
        raw = random_scores(seed, shapes)
    result = []
    for layer in ids:
        scores = raw[layer]
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            raise MoePruneError(
                f"criterion {name!r} gave non-finite scores (NaN/Inf) in decoder layer {layer} "
                f"for experts {bad.tolist()}; the calibration statistics or weights are corrupt"
            )
        result.append(
            LayerScores(layer=layer, scores=scores, order=pruning_order_of(scores, crit.prune_first))
        )
    if crit.needs_data or crit.needs_weights:
        _check_counts(num_experts, result)
    return result


def importance_scores(criterion: Criterion, scores: Sequence[LayerScores]) -> list[LayerScores]:
    """Scores where higher means more important (TENP keeps the highest whole)."""
    if criterion.prune_first == "lowest":
        return list(scores)
    return [LayerScores(layer=s.layer, scores=-s.scores, order=s.order) for s in scores]


def unseen_experts(stats: ExpertStats | Sequence[ExpertStats]) -> dict[str, list[int]]:
    """Per decoder layer (as a string key, like report.json), the experts no calibration token
    reached in any domain; layers where every expert was reached are left out."""
    domains = as_domains(stats)
    unseen = {}
    for s in domains[0].layers:
        count = cast(torch.Tensor, sum(d.layer(s.layer).count for d in domains))  # at least one domain
        ids = torch.nonzero(count == 0).flatten().tolist()
        if ids:
            unseen[str(s.layer)] = ids
    return unseen


def unseen_note(stats: ExpertStats | Sequence[ExpertStats]) -> list[str]:
    """Report sentences naming, per layer, the experts no calibration token reached (all domains)."""
    total = {s.layer: s.num_experts for s in as_domains(stats)[0].layers}
    return [
        f"Decoder layer {layer}: {len(ids)} of {total[int(layer)]} experts ({', '.join(map(str, ids))}) "
        "received no calibration token; data-driven criteria score them 0, so they are pruned first."
        for layer, ids in unseen_experts(stats).items()
    ]


def scores_document(
    criterion: Criterion, scores: Sequence[LayerScores], stats: Sequence[ExpertStats]
) -> dict:
    """The `moeprune score` JSON (its keys are a contract)."""
    return {
        "criterion": criterion.name,
        "prune_first": criterion.prune_first,
        "tokens": int(sum(s.tokens for s in stats)),
        "layers": [
            {"layer": s.layer, "scores": [float(v) for v in s.scores], "order": [int(e) for e in s.order]}
            for s in scores
        ],
    }


def score_experts(
    moe: MoEModel,
    criterion_name: str,
    sets: Sequence[CalibrationData] = (),
    *,
    batch_size: int = 8,
    pad_token_id: int = 0,
    seed: int = 0,
    progress: bool = True,
    statistics: Collection[Statistic] = NONE,
) -> tuple[Criterion, list[LayerScores], list[ExpertStats]]:
    """Scores of every MoE layer under one criterion, observing the calibration `sets` first
    (one ExpertStats per set; under torchrun the pass is split over the ranks). The pass records
    what the criterion and the super-expert guard declare, plus `statistics` (what the run's
    method, allocation or `auto` read: `Requirements.statistics`; Statistic.NEURONS records each
    neuron's share, which neuron surgery needs)."""
    criterion = get_criterion(criterion_name)
    if criterion.needs_data and not sets:
        raise MoePruneError(
            f"criterion {criterion.name!r} needs calibration data: give data files", options=("data",)
        )
    stats = [
        observe_distributed(
            moe,
            d,
            batch_size=batch_size,
            pad_token_id=pad_token_id,
            progress=progress,
            domain=d.sources[0] if len(sets) > 1 else "",
            statistics=union(criterion.statistics, GUARD_STATISTICS, statistics),
        )
        for d in sets
    ]
    scores = compute_scores(
        criterion.name,
        stats=(stats if len(stats) > 1 else stats[0]) if stats and criterion.needs_data else None,
        weights=moe.layers if criterion.needs_weights else None,
        seed=seed,
        num_experts=[m.num_experts for m in moe.layers],
        layers=[m.index for m in moe.layers],
    )
    return criterion, scores, stats
