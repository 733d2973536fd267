"""Expert criteria: one score per routed expert and a direction (formulas: README, "Criteria").

A criterion only ranks experts *within* a layer; how many experts each layer loses is the
allocation's job. The registry below is a table: each row says what a criterion needs (calibration
statistics, expert weights or nothing) and how its raw scores may be compared across layers, and
a one-line scorer per row turns one layer's inputs into a float64 score vector.

``comparable_across_layers`` (global allocation ranks raw scores only where it is True and
normalises per layer otherwise):

- random: False. The scores are positions in a per-layer permutation, meaningless across layers.
- magnitude: False. Mean |w| follows each layer's weight scale (init, depth, norm placement).
- aimer: True. Scale invariant and bounded in [1/sqrt(N), 1]; N is the same for every layer of
  one model, so the ratio means the same thing in every layer.
- frequency: True. Every MoE layer routes the same tokens k times each, so counts share a unit.
- seer: True. Router weights are probabilities (per token they sum to the same total in every
  layer of a model), so summed weights share a unit like counts do.
- ean, reap, mone, tenp: False. They scale with expert output norms, which grow with depth as
  the residual stream grows; a raw global ranking would empty the shallow layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from moeprune.errors import MoePruneError
from moeprune.observe.stats import ExpertStats, LayerStats

F64 = torch.float64
_CHUNK = 1 << 22  # elements cast to fp64 at a time when streaming expert weights


class ExpertWeightSource(Protocol):
    """One MoE layer's routed-expert weights, one expert at a time (adapter or safetensors)."""

    layer: int  # decoder layer index
    num_experts: int

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [I, d], up [I, d], down [d, I]; biases are not part of the criteria."""
        ...


@dataclass(frozen=True)
class Criterion:
    name: str
    prune_first: str  # "lowest" | "highest"
    needs_data: bool
    needs_weights: bool
    comparable_across_layers: bool
    description: str


@dataclass
class LayerScores:
    layer: int  # decoder layer index
    scores: np.ndarray  # float64 [E], indexed by original expert id
    order: list[int]  # expert ids, the first is pruned first (ties broken by expert id)


def _c(
    name: str, prune_first: str, data: bool, weights: bool, comparable: bool, description: str
) -> Criterion:
    return Criterion(name, prune_first, data, weights, comparable, description)


_TABLE: tuple[Criterion, ...] = (
    _c("random", "lowest", False, False, False, "seeded random permutation per layer (baseline)"),
    _c("magnitude", "lowest", False, True, False, "mean |w| over the expert's gate, up and down weights"),
    _c("aimer", "highest", False, True, True, "||w||_1 / (sqrt(N) ||w||_2) over gate, up and down (AIMER)"),
    _c("frequency", "lowest", True, False, True, "number of calibration tokens routed to the expert"),
    _c("seer", "lowest", True, False, True, "sum of the expert's router weights g_i(t) (SEER-MoE)"),
    _c("ean", "lowest", True, False, False, "sum of the expert's output norms ||E_i(h_t)|| (EAN)"),
    _c("reap", "lowest", True, False, False, "mean of g_i(t) ||E_i(h_t)|| over routed tokens (REAP)"),
    _c("mone", "lowest", True, False, False, "||std of outputs||_2 x mean router weight (MoNE)"),
    _c("tenp", "lowest", True, False, False, "sum of g ||E|| (1 - cos(h, E)) (TENP)"),
)
CRITERIA: dict[str, Criterion] = {c.name: c for c in _TABLE}


def _safe_div(num: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """num / count, 0 where no token reached the expert."""
    return torch.where(count > 0, num / count.clamp(min=1), torch.zeros_like(num))


def _mone(s: LayerStats) -> torch.Tensor:
    """phi_var x phi_freq; the unbiased variance is 0 below two tokens, so such experts score 0."""
    phi_var = s.variance.to(F64).clamp(min=0).sqrt().norm(dim=1)
    return phi_var * _safe_div(s.weight_sum.to(F64), s.count.to(F64))


# Data criteria: one layer's (possibly merged) statistics -> scores [E].
_DATA_SCORERS: dict[str, Callable[[LayerStats], torch.Tensor]] = {
    "frequency": lambda s: s.count,
    "seer": lambda s: s.weight_sum,
    "ean": lambda s: s.norm_sum,
    "reap": lambda s: _safe_div(s.weighted_norm_sum.to(F64), s.count.to(F64)),
    "mone": _mone,
    "tenp": lambda s: s.tenp_sum,
}

# Weight criteria: (sum |w|, sum w^2, N) of one expert -> score.
WEIGHT_SCORERS: dict[str, Callable[[float, float, int], float]] = {
    "magnitude": lambda l1, sq, n: l1 / n,
    "aimer": lambda l1, sq, n: l1 / (math.sqrt(n) * math.sqrt(sq)),
}


def list_criteria() -> list[str]:
    return list(CRITERIA)


def get_criterion(name: str) -> Criterion:
    try:
        return CRITERIA[name]
    except KeyError:
        raise MoePruneError(f"unknown criterion {name!r}; valid: {', '.join(CRITERIA)}") from None


def _as_domains(stats: ExpertStats | Sequence[ExpertStats]) -> list[ExpertStats]:
    domains = [stats] if isinstance(stats, ExpertStats) else list(stats)
    if not domains:
        raise MoePruneError("no calibration statistics were given (an empty list of domains)")
    ref = [(s.layer, s.num_experts) for s in domains[0].layers]
    for d in domains[1:]:
        got = [(s.layer, s.num_experts) for s in d.layers]
        if got != ref:
            raise MoePruneError(
                f"calibration domains disagree on MoE layers / expert counts: {ref} vs {got} "
                "(were they observed on different models?)"
            )
    return domains


def _copy_layer(s: LayerStats) -> LayerStats:
    fields = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.__dict__.items()}
    return LayerStats(**fields)


def merged_layer(domains: Sequence[ExpertStats], layer: int) -> LayerStats:
    """One layer's statistics summed over domains (Chan merge for moments); inputs stay untouched."""
    out = _copy_layer(domains[0].layer(layer))
    for d in domains[1:]:
        out.merge(d.layer(layer))
    return out


def _select(available: list[int], layers: Sequence[int] | None) -> list[int]:
    if layers is None:
        return available
    missing = [i for i in layers if i not in available]
    if missing:
        raise MoePruneError(f"no MoE layer at decoder layer(s) {missing}; MoE layers are {available}")
    return list(layers)


def _tenp_mix(domains: Sequence[ExpertStats], layer: int) -> torch.Tensor:
    """I_mix(i) = sum_tau I_tau(i) / ||I_tau||_2 over the layer; a domain with norm 0 adds 0."""
    total = torch.zeros(domains[0].layer(layer).num_experts, dtype=F64)
    for d in domains:
        imp = d.layer(layer).tenp_sum.to(F64)
        norm = float(imp.norm())
        if norm > 0:
            total += imp / norm
    return total


def _data_scores(name: str, domains: list[ExpertStats], layers: list[int]) -> dict[int, np.ndarray]:
    """Several domains are merged into one (sums add, moments merge exactly), except tenp's mix."""
    out = {}
    for layer in layers:
        if name == "tenp" and len(domains) > 1:
            t = _tenp_mix(domains, layer)
        else:
            s = domains[0].layer(layer) if len(domains) == 1 else merged_layer(domains, layer)
            t = _DATA_SCORERS[name](s)
        out[layer] = t.detach().to(device="cpu", dtype=F64).numpy().copy()
    return out


def _weight_sums(source: ExpertWeightSource, expert: int) -> tuple[float, float, int]:
    """(sum |w|, sum w^2, N) over gate, up, down in fp64, casting a chunk at a time."""
    l1 = sq = 0.0
    n = 0
    for t in source.expert_weights(expert):
        for chunk in t.detach().reshape(-1).split(_CHUNK):
            c = chunk.to(F64)
            l1 += float(c.abs().sum())
            sq += float(c.square().sum())
        n += t.numel()
    return l1, sq, n


def _weight_scores(name: str, sources: list[ExpertWeightSource]) -> dict[int, np.ndarray]:
    scorer = WEIGHT_SCORERS[name]
    out = {}
    for src in sources:
        scores = np.zeros(src.num_experts, dtype=np.float64)
        for e in range(src.num_experts):
            l1, sq, n = _weight_sums(src, e)
            if n == 0 or sq == 0.0:
                raise MoePruneError(
                    f"criterion {name!r}: expert {e} of decoder layer {src.layer} has no non-zero weights; "
                    "its score is undefined"
                )
            scores[e] = scorer(l1, sq, n)
        out[src.layer] = scores
    return out


def _random_scores(seed: int, shapes: list[tuple[int, int]]) -> dict[int, np.ndarray]:
    """Score = position in a permutation drawn from Generator((seed, layer)), so layers differ."""
    if seed < 0:
        raise MoePruneError(f"the random criterion needs a non-negative seed, got {seed}")
    out = {}
    for layer, n in shapes:
        perm = np.random.default_rng((seed, layer)).permutation(n)
        scores = np.empty(n, dtype=np.float64)
        scores[perm] = np.arange(n, dtype=np.float64)
        out[layer] = scores
    return out


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
        pairs = [(s.layer, s.num_experts) for s in _as_domains(stats)[0].layers]
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


def pruning_order_of(scores: np.ndarray, prune_first: str) -> list[int]:
    key = -scores if prune_first == "highest" else scores
    return [int(i) for i in np.argsort(key, kind="stable")]


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

    `stats` may be a list of per-domain statistics: tenp mixes them with the per-layer norm
    per-domain normalisation, the other data criteria merge them into one calibration set.
    `layers` restricts scoring to those decoder layers (output in that order); for random without
    stats or weights, it names the decoder layers that `num_experts` describes (default 0..L-1).
    """
    crit = get_criterion(name)
    if crit.needs_data:
        if stats is None:
            raise MoePruneError(f"criterion {name!r} needs calibration data: give data files", options=("data",))
        domains = _as_domains(stats)
        ids = _select([s.layer for s in domains[0].layers], layers)
        raw = _data_scores(name, domains, ids)
    elif crit.needs_weights:
        if not weights:
            raise MoePruneError(f"criterion {name!r} needs the model's expert weights: pass the model")
        by_layer = {w.layer: w for w in weights}
        ids = _select(list(by_layer), layers)
        raw = _weight_scores(name, [by_layer[i] for i in ids])
    else:
        shapes = _random_shapes(stats, weights, num_experts, layers)
        ids = [layer for layer, _ in shapes]
        raw = _random_scores(seed, shapes)

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


def unseen_note(stats: ExpertStats | Sequence[ExpertStats]) -> list[str]:
    """Report sentences naming, per layer, the experts no calibration token reached (all domains)."""
    domains = _as_domains(stats)
    notes = []
    for s in domains[0].layers:
        count = sum(d.layer(s.layer).count for d in domains)
        ids = torch.nonzero(count == 0).flatten().tolist()
        if ids:
            notes.append(
                f"Decoder layer {s.layer}: {len(ids)} of {s.num_experts} experts ({', '.join(map(str, ids))}) "
                "received no calibration token; data-driven criteria score them 0, so they are pruned first."
            )
    return notes
