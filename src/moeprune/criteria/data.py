"""Criteria computed from calibration statistics (formulas: docs/criteria.md).

g is the routing weight the model applied (read from the router, never recomputed), E(h) the
expert's output, sums run over the tokens routed to the expert; an expert no token reached
scores 0 and is pruned first (the report names it). For the criteria that average over the routed
tokens (reap, man, msan) that mean is undefined, and 0 stands for it: below any seen expert's
score, as every score here is >= 0.

The unified form of arXiv 2606.15716, S(b, alpha, beta) = (1/n)^b sum g^alpha ||E||^beta over the
routed tokens, covers frequency, seer, ean, reap, man and msan (UNIFIED_FORM).

Comparable across layers (global allocation ranks raw scores only then):
- frequency: every MoE layer routes the same tokens k times each, so counts share a unit.
- seer: router weights are probabilities (per token they sum to the same total in every layer),
  so summed weights share a unit like counts do.
- ean, reap, mone, tenp, man, msan: not comparable. They scale with expert output norms, which grow with
  depth as the residual stream grows; a raw global ranking would empty the shallow layers.
"""

from __future__ import annotations

import numpy as np
import torch

from moeprune.config import CALIBRATION
from moeprune.criteria.registry import CRITERIA, Criterion
from moeprune.observe.kinds import Statistic
from moeprune.observe.stats import ExpertStats, LayerStats, merged_layer

F64 = torch.float64
_DATA = (CALIBRATION,)


def _safe_div(num: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """num / count, 0 where no token reached the expert."""
    return torch.where(count > 0, num / count.clamp(min=1), torch.zeros_like(num))


@CRITERIA.register(
    Criterion("frequency", "lowest", True, "number of calibration tokens routed to the expert", needs=_DATA)
)
def frequency(s: LayerStats) -> torch.Tensor:
    return s.count


@CRITERIA.register(
    Criterion("seer", "lowest", True, "sum of the expert's router weights g_i(t) (SEER-MoE)", needs=_DATA)
)
def seer(s: LayerStats) -> torch.Tensor:
    return s.weight_sum


@CRITERIA.register(
    Criterion("ean", "lowest", False, "sum of the expert's output norms ||E_i(h_t)|| (EAN)", needs=_DATA)
)
def ean(s: LayerStats) -> torch.Tensor:
    return s.norm_sum


@CRITERIA.register(
    Criterion("reap", "lowest", False, "mean of g_i(t) ||E_i(h_t)|| over routed tokens (REAP)", needs=_DATA)
)
def reap(s: LayerStats) -> torch.Tensor:
    return _safe_div(s.weighted_norm_sum.to(F64), s.count.to(F64))


@CRITERIA.register(
    Criterion(
        "mone",
        "lowest",
        False,
        "||std of outputs||_2 x mean router weight (MoNE)",
        needs=_DATA,
        statistics=frozenset({Statistic.MOMENTS}),
    )
)
def mone(s: LayerStats) -> torch.Tensor:
    """phi_var x phi_freq; the unbiased variance is 0 below two tokens, so such experts score 0."""
    phi_var = s.variance.to(F64).clamp(min=0).sqrt().norm(dim=1)
    return phi_var * _safe_div(s.weight_sum.to(F64), s.count.to(F64))


@CRITERIA.register(
    Criterion(
        "tenp",
        "lowest",
        False,
        "sum of g ||E|| (1 - cos(h, E)) (TENP)",
        needs=_DATA,
        per_domain=True,
        statistics=frozenset({Statistic.TENP}),
    )
)
def tenp(s: LayerStats) -> torch.Tensor:
    return s.need("tenp_sum")


@CRITERIA.register(
    Criterion(
        "man",
        "lowest",
        False,
        "mean of the expert's output norms ||E_i(h_t)|| over routed tokens (MAN)",
        needs=_DATA,
    )
)
def man(s: LayerStats) -> torch.Tensor:
    """S(1, 0, 1): ean divided by the count; reap without the router weight."""
    return _safe_div(s.norm_sum.to(F64), s.count.to(F64))


@CRITERIA.register(
    Criterion(
        "msan",
        "lowest",
        False,
        "mean of the squared output norms ||E_i(h_t)||^2 over routed tokens (MSAN)",
        needs=_DATA,
        statistics=frozenset({Statistic.MOMENTS}),
    )
)
def msan(s: LayerStats) -> torch.Tensor:
    """S(1, 0, 2): sum ||E||^2 comes from the Welford moments (LayerStats.sq_norm_sum)."""
    return _safe_div(s.sq_norm_sum.to(F64), s.count.to(F64))


# (b, alpha, beta) of S(b, alpha, beta) = (1/n_i)^b sum_{t in T_i} g_i(t)^alpha ||E_i(h_t)||^beta
UNIFIED_FORM: dict[str, tuple[int, int, int]] = {
    "frequency": (0, 0, 0),
    "seer": (0, 1, 0),
    "ean": (0, 0, 1),
    "reap": (1, 1, 1),
    "man": (1, 0, 1),
    "msan": (1, 0, 2),
}


def _mix_domains(criterion: Criterion, domains: list[ExpertStats], layer: int) -> torch.Tensor:
    """I_mix(i) = sum_tau I_tau(i) / ||I_tau||_2 over the layer; a domain with norm 0 adds 0."""
    fn = criterion.fn
    assert fn is not None, f"data criterion {criterion.name!r} registered without a function"
    total = torch.zeros(domains[0].layer(layer).num_experts, dtype=F64)
    for d in domains:
        imp = fn(d.layer(layer)).to(F64)
        norm = float(imp.norm())
        if norm > 0:
            total += imp / norm
    return total


def data_scores(criterion: Criterion, domains: list[ExpertStats], layers: list[int]) -> dict[int, np.ndarray]:
    """Several domains are merged into one (sums add, moments merge exactly), except for criteria
    that normalise per domain (TENP's mix)."""
    fn = criterion.fn
    assert fn is not None, f"data criterion {criterion.name!r} registered without a function"
    out = {}
    for layer in layers:
        if criterion.per_domain and len(domains) > 1:
            t = _mix_domains(criterion, domains, layer)
        else:
            s = domains[0].layer(layer) if len(domains) == 1 else merged_layer(domains, layer)
            t = fn(s)
        out[layer] = t.detach().to(device="cpu", dtype=F64).numpy().copy()
    return out
