"""Low-rank novices that hold on tokens they were not fitted on: ridge strength and rank chosen
on held-out tokens, never worse there than the constant novice.

Why: the least-squares map B of a rank-R novice has d + 2dR parameters fitted on the few hundred
tokens routed to one expert; with no shrinkage it learns their noise, and on other text it can
score below MoNE's constant mu (issue 45: rank-8 novices fitted on 16 code samples lost 0.05 ESAP
on prose to constant ones). So each expert's fit is checked on tokens it did not see.

The family of fits (ridge regression, then reduced-rank regression), for ridge strength alpha:

    lambda = alpha trace(Sigma) / d,       B_alpha = C (Sigma + lambda I)^-1,
    B_{alpha,r} = U_r U_r^T B_alpha,       U_r = top-r left singular vectors of C (Sigma + lambda I)^-1/2

(Sigma = cov(h), C = cov(y, h) over the fit tokens). A larger alpha shrinks B toward 0, i.e. the
novice toward the constant mu; r = 0 is the constant itself. Every (alpha in RIDGES, r in 0..R)
is scored by its squared error on the held-out tokens and the smallest wins; r = 0 wins unless
some fit is strictly below it, so no novice is worse there than the constant one.

Held-out tokens: the search data's tokens routed to the expert when search data is given (the fit
then uses every calibration token), else every HOLD_OUT-th calibration sample (the fit uses the
others). Each source of held-out samples (data file: a domain) is checked on its own, and a fit
worse than the constant on any of them is not taken: a fit that helps code at prose's expense
stays out. Among the others the smallest error over all held-out tokens wins. The saved novice is mu + B (h - hbar) with mu, hbar the means over all routed calibration
tokens, so its constant part, and the fallback, is MoNE's exact mean; only B comes from the fit
tokens. Its mean squared error on a token set with means mu', hbar', population covariances
Sigma', C' and S' = mean ||y - mu'||^2 follows from the set's moments alone:

    E ||y - mu - B (h - hbar)||^2 = ||a - B delta||^2 + S' - 2 tr(B C'^T) + tr(B Sigma' B^T),
    a = mu' - mu, delta = hbar' - hbar,

and with B = sum_k u_k v_k^T (orthonormal u_k) it is the constant's error ||a||^2 + S' plus one
term per direction,

    g_k = (v_k . delta)^2 - 2 (u_k . a)(v_k . delta) - 2 u_k^T C' v_k + v_k^T Sigma' v_k,

so every rank of one ridge is scored at once (prefix sums of g). Cost per expert: one eigh of
Sigma and one d x d SVD per ridge strength.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from moeprune.data.loading import CalibrationData
from moeprune.models.lowrank import LowRankNovice
from moeprune.observe.moments import Moments
from moeprune.observe.stats import F64

RIDGES = (
    1e-6,
    1e-3,
    1e-2,
    1e-1,
    1.0,
    10.0,
)  # alpha: lambda = alpha trace(Sigma) / d; 1e-6 is the unshrunk fit
HOLD_OUT = 4  # without search data, every 4th calibration sample is held out of the fit
VALUES_PER_PARAMETER = 10  # fewer routed output values (tokens x d) per novice parameter: named as too few


def ridge_factors(
    moments: Moments, rank: int, ridges: tuple[float, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(U [d, r], V [d, r]) with B_{alpha,r} = U V^T for each ridge strength alpha (module
    docstring), fp64, r = min(rank, n - 1, d): the rank the expert's n tokens support."""
    d, n = moments.mean_h.numel(), moments.count
    usable = max(0, min(rank, int(n) - 1, d))
    if usable == 0:
        empty = moments.mean_y.new_zeros(d, 0, dtype=F64)
        return [(empty, empty.clone()) for _ in ridges]
    sigma = moments.c_hh.to(F64) / n
    cov = moments.c_yh.to(F64) / n
    evals, q = torch.linalg.eigh(sigma)
    scale = float(torch.trace(sigma)) / d
    out = []
    for alpha in ridges:
        shifted = (evals + alpha * scale).clamp_min(torch.finfo(F64).tiny)
        rotated = cov @ q
        whitened = rotated @ torch.diag(shifted.rsqrt()) @ q.T  # C (Sigma + lambda I)^-1/2
        left = torch.linalg.svd(whitened, full_matrices=False).U[:, :usable]
        full = rotated @ torch.diag(1 / shifted) @ q.T  # B_alpha = C (Sigma + lambda I)^-1
        out.append((left, full.T @ left))
    return out


def _terms(
    u: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, hbar: torch.Tensor, tokens: Moments
) -> tuple[float, torch.Tensor]:
    """(the constant novice mu's mean squared error on `tokens`, g_k per direction): module docstring."""
    n = tokens.count
    a, delta = tokens.mean_y.to(F64) - mu, tokens.mean_h.to(F64) - hbar
    base = float(a @ a) + tokens.yy / n
    vd, ua = v.T @ delta, u.T @ a
    cross = ((tokens.c_yh.to(F64) / n @ v) * u).sum(0)
    quad = ((tokens.c_hh.to(F64) / n @ v) * v).sum(0)
    return base, vd.square() - 2 * ua * vd - 2 * cross + quad


def _relative(base: float, gains: torch.Tensor, rank: int) -> float:
    """Mean squared error of the rank-`rank` prefix over the constant's (1: no better; 0: exact)."""
    change = float(gains[:rank].sum()) if rank else 0.0
    return (base + change) / base if base > 0 else 1.0


@dataclass(frozen=True)
class FitCheck:
    """One novice's fit checked on held-out tokens. Errors are relative to the constant novice's
    on the same tokens (1: as good as the constant; below 1: better)."""

    layer: int
    expert: int
    hidden: int
    rank: int  # asked (--novice-rank)
    chosen_rank: int  # kept (0: the constant novice)
    ridge: float | None  # alpha chosen (None: the constant)
    tokens: int  # routed calibration tokens
    held_tokens: int  # routed held-out tokens
    calibration: float  # relative error on the tokens it was fitted on
    held_out: float | None  # relative error on the held-out tokens (None: none reached the expert)
    unshrunk: float | None  # the same for the rank-R fit at the smallest ridge (what was saved before)

    @property
    def parameters(self) -> int:
        return self.hidden * (1 + 2 * self.rank)

    @property
    def too_few(self) -> bool:
        """Fewer than VALUES_PER_PARAMETER routed output values (tokens x d) per parameter."""
        return self.tokens * self.hidden < VALUES_PER_PARAMETER * self.parameters

    def warning(self) -> str:
        kept = f"rank {self.chosen_rank}, ridge {self.ridge:g}" if self.chosen_rank else "its constant"
        return (
            f"layer {self.layer} expert {self.expert}: {self.tokens} routed calibration tokens "
            f"({self.tokens * self.hidden:,} values) for the {self.parameters:,} parameters of a rank-{self.rank} "
            f"novice (d + 2dR), under {VALUES_PER_PARAMETER} values per parameter; the held-out check kept {kept}"
        )


def choose_novice(
    fit: Moments, held: Sequence[Moments], whole: Moments, rank: int, *, layer: int = 0, expert: int = 0
) -> tuple[LowRankNovice, FitCheck]:
    """The rank-`rank` novice (zero-padded) whose B, fitted on `fit`, has the smallest squared error
    on the held-out tokens among RIDGES x ranks 0..rank, with mu, hbar from `whole` (all routed
    calibration tokens). `held`: the held-out tokens' moments per source (data file or domain); a
    fit worse than the constant on any source is not taken, so the constant mean stays when nothing
    beats it on every source, or no held-out token reached the expert."""
    mu, hbar = whole.mean_y.to(F64), whole.mean_h.to(F64)
    factors = ridge_factors(fit, rank, RIDGES)
    sources = [m for m in held if m.count > 0]
    total = sum(m.count for m in sources)
    base = sum(m.count * _terms(factors[0][0], factors[0][1], mu, hbar, m)[0] for m in sources) / (total or 1)
    best: tuple[float, int, int] = (0.0, 0, 0)  # (held-out change, ridge index, rank): the constant
    unshrunk = None
    for i, (u, v) in enumerate(factors if sources else []):
        prefixes = torch.stack([torch.cumsum(_terms(u, v, mu, hbar, m)[1], 0) for m in sources])
        pooled = (prefixes * torch.tensor([m.count for m in sources], dtype=F64)[:, None]).sum(0) / total
        if i == 0:
            unshrunk = (base + float(pooled[-1] if pooled.numel() else 0.0)) / base if base > 0 else 1.0
        allowed = pooled.masked_fill(~(prefixes <= 0).all(0), float("inf"))  # no source worse than constant
        if allowed.numel() and float(allowed.min()) < best[0]:
            best = (float(allowed.min()), i, int(allowed.argmin()) + 1)
    change, index, r = best
    u, v = (factors[index][0][:, :r], factors[index][1][:, :r]) if r else (mu.new_zeros(mu.numel(), 0),) * 2
    check = FitCheck(
        layer=layer,
        expert=expert,
        hidden=mu.numel(),
        rank=rank,
        chosen_rank=r,
        ridge=RIDGES[index] if r else None,
        tokens=int(whole.count),
        held_tokens=int(total),
        calibration=_relative(*_terms(u, v, mu, hbar, fit), r) if fit.count > 0 else 1.0,
        held_out=((base + change) / base if base > 0 else 1.0) if sources else None,
        unshrunk=unshrunk,
    )
    return LowRankNovice(mu - u @ (v.T @ hbar), u, v.clone()).padded(rank), check


@dataclass
class FitChecks:
    """How fits are checked on held-out tokens, and the checks made ({(decoder layer, original
    expert id): FitCheck}). `data`: the held-out data (the search data); None: every HOLD_OUT-th
    calibration sample. `shrink` False: the unchecked least-squares fit on every calibration token
    at the smallest ridge (what moeprune saved before these checks; benchmarks compare the two)."""

    data: CalibrationData | None = None
    shrink: bool = True
    found: dict[tuple[int, int], FitCheck] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """Where the held-out tokens come from, in words (the report says it)."""
        return "the search data" if self.data is not None else f"every {HOLD_OUT}th calibration sample"

    @staticmethod
    def by_source(sets: Sequence[CalibrationData]) -> list[CalibrationData]:
        """One set per source (data file) of the held-out samples: each is checked on its own."""
        out = []
        for data in sets:
            for source in dict.fromkeys(s.source for s in data.samples):
                out.append(replace(data, samples=[s for s in data.samples if s.source == source]))
        return out

    @staticmethod
    def split(sets: Sequence[CalibrationData]) -> tuple[list[CalibrationData], list[CalibrationData]]:
        """(fit share, held-out share): every HOLD_OUT-th sample of each set is held out (a set of
        fewer samples holds none back)."""
        fit, held = [], []
        for data in sets:
            out = [s for i, s in enumerate(data.samples) if i % HOLD_OUT == HOLD_OUT - 1]
            kept = [s for i, s in enumerate(data.samples) if i % HOLD_OUT != HOLD_OUT - 1]
            fit.append(replace(data, samples=kept))
            if out:
                held.append(replace(data, samples=out))
        return fit, held
