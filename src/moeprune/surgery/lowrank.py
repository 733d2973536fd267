"""Low-rank ("tilted") novices: `--method novice --novice-rank R`.

A removed expert j becomes y ~ mu + B (h - hbar) instead of MoNE's constant mu, with B of rank
at most R fitted in closed form over the expert's routed calibration tokens (formulas.md):

- least squares: B* = C Sigma^-1, Sigma = cov(h), C = cov(y, h) (population covariances over
  the routed tokens, fp64, from observe/moments.py's second pass);
- rank R (reduced-rank regression): the best rank-R B under the token-summed squared error is
  B_R = U_R U_R^T B*, U_R the top-R left singular vectors of C Sigma^-1/2 (equivalently the
  top-R eigenvectors of B* Sigma B*^T, the covariance of the fitted outputs);
- stored as factors U = U_R [d, R], V = B*^T U_R [d, R] and the constant c = mu - U V^T hbar, so
  the novice outputs c + U (V^T h): d + 2 d R parameters.

Ridge: Sigma + lambda I with lambda = alpha x trace(Sigma) / d. Saved novices take the alpha and
the rank r <= R that do best on held-out tokens, never worse there than the constant mu
(surgery/fit_holdout.py: ridge and reduced-rank regression together, the choice, the report's
checks); `fit_lowrank` is one fit at one alpha (RIDGE = 1e-6: a unique fit even where Sigma is
singular, directions with no input variance sent to zero, B shrunk by a relative 1e-6 elsewhere).
Few tokens: n tokens give at most n - 1 independent centred inputs, so an expert fits at rank
min(R, n - 1) and is zero-padded to R (the zero columns add nothing); with one token it is its
constant mu, and an expert no token reached has mu = 0 and B = 0, as a rank-0 novice.

`--method novice --allocation evo` scores candidates with constant novices; the final plan's
novices are fitted at rank R. `--method mixed --allocation evo` fits every routed expert at rank R
once before its search (`fit_every_novice`: the d x d statistics of every expert, in as few
calibration passes as the memory allows, down to one MoE layer per pass), gives
each candidate's novices those fits, and the final plan takes the same fits (`fit_novices(...,
fitted=)`), so what the search scored is what is saved.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from moeprune.config import MethodOptions, setting
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.models.lowrank import LowRankNovice
from moeprune.observe.moments import LayerMoments, Moments, observe_moments
from moeprune.observe.stats import F64
from moeprune.plan import Plan
from moeprune.surgery.fit_holdout import FitCheck, FitChecks, choose_novice, ridge_factors

_LOG = logging.getLogger(__name__)

RIDGE = 1e-6  # lambda / (trace(Sigma) / d): see the module docstring
RANK_KEY = "novice_rank"  # plan.extra: the rank the plan's novices are fitted at (absent: 0)
Fits = dict[int, dict[int, LowRankNovice]]  # decoder layer -> original expert id -> fitted novice


@dataclass(frozen=True)
class NoviceOptions(MethodOptions):
    """The novice method's own setting: the rank of each novice's input-dependent part."""

    novice_rank: int = setting(
        0,
        "novice/mixed: rank R of the low-rank novice mu + B(h - hbar) fitted by least squares on the "
        "routed calibration tokens (0: the constant mu of MoNE); costs d + 2dR parameters per novice and "
        "a second calibration pass holding 16 d^2 bytes per removed expert (mixed + evo: per routed "
        "expert, fitted before the search).",
        minimum=0,
        metavar="R",
    )

    def __post_init__(self) -> None:
        rank = self.novice_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise MoePruneError(
                f"novice_rank must be a non-negative integer (0: constant novices), got {rank!r}",
                options=("novice_rank",),
            )

    def check_model(self, moe: MoEModel) -> None:
        """Refuse a rank above the hidden size (B is d x d), from the structure alone (before loading)."""
        hidden = min((m.hidden_size for m in moe.layers), default=0)
        if self.novice_rank > hidden:
            raise MoePruneError(
                f"--novice-rank {self.novice_rank} is larger than the hidden size {hidden}; give a rank "
                f"between 0 and {hidden}",
                options=("novice_rank",),
            )


def fit_lowrank(moments: Moments, rank: int, ridge: float = RIDGE) -> LowRankNovice:
    """The rank-`rank` least-squares novice of one expert (fp64) at one ridge strength, zero-padded
    to `rank` when its tokens support a lower rank only (module docstring); no held-out check
    (`fit_holdout.choose_novice` is what `fit_novices` saves)."""
    u, v = ridge_factors(moments, rank, (ridge,))[0]
    mean_h, mean_y = moments.mean_h.to(F64), moments.mean_y.to(F64)
    return LowRankNovice(mean_y - u @ (v.T @ mean_h), u, v).padded(rank)


def plan_rank(plan: Plan) -> int:
    return int(plan.extra.get(RANK_KEY, 0) or 0)


def moments_bytes(moe: MoEModel, targets: Mapping[int, Sequence[int]]) -> int:
    """Bytes the fitting pass holds: two d x d fp64 matrices (16 d^2 bytes) per target expert."""
    return sum(16 * moe.layer(i).hidden_size ** 2 * len(set(p)) for i, p in targets.items())


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def moments_memory() -> int | None:
    """Bytes the all-expert fitting pass may hold per calibration pass: half of what the OS reports
    available now (MemAvailable: the model is already loaded), or a quarter of the RAM where it
    does not say; None where neither is known (one pass)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    memory = physical_memory()
    return None if memory is None else memory // 4


def layer_passes(moe: MoEModel, memory: int | None) -> list[list[int]]:
    """The MoE layers (decoder indices) grouped, in order, into the fewest consecutive passes whose
    all-expert moments each fit in `memory` bytes (a layer larger than it is a pass of its own;
    `check_every_novice_fits` refuses that before loading when it exceeds the RAM)."""
    passes: list[list[int]] = []
    held = 0
    for m in moe.layers:
        need = moments_bytes(moe, {m.index: range(m.num_experts)})
        if passes and (memory is None or held + need <= memory):
            passes[-1].append(m.index)
            held += need
        else:
            passes.append([m.index])
            held = need
    return passes


def check_every_novice_fits(moe: MoEModel, rank: int, memory: int | None = None) -> None:
    """Refuse, before loading, a mixed search with rank-R novices whose all-expert fitting cannot
    fit in this machine's memory even one MoE layer per pass (`fit_every_novice` holds 16 d^2 bytes
    per routed expert of the layers of one pass); `moe` may be the meta skeleton (its shape only)."""
    if not rank:
        return
    memory = physical_memory() if memory is None else memory
    sizes = {m.index: moments_bytes(moe, {m.index: range(m.num_experts)}) for m in moe.layers}
    layer = max(sizes, key=lambda i: sizes[i], default=None)
    if memory is not None and layer is not None and sizes[layer] > memory:
        raise MoePruneError(
            f"mixed + evo with --novice-rank {rank} fits every routed expert before the search, one "
            f"MoE layer per pass at least: {sizes[layer] / 2**30:,.1f} GiB of moments for layer "
            f"{layer} (16 d^2 bytes per expert), more than this machine's {memory / 2**30:,.1f} GiB; "
            "give --novice-rank 0, or --allocation uniform (the plan's novices only are fitted)",
            options=("novice_rank", "allocation"),
        )


def _fit(
    moe: MoEModel,
    targets: Mapping[int, Sequence[int]],
    rank: int,
    sets: Sequence[CalibrationData],
    *,
    checks: FitChecks,
    batch_size: int,
    pad_token_id: int,
    progress: bool,
) -> Fits:
    """The experts at `targets` ({decoder layer: positions}) fitted at `rank`, keyed by original id:
    ridge and rank chosen on held-out tokens as `checks` says, each expert's check put in
    `checks.found` (surgery/fit_holdout.py)."""
    targets = {i: list(p) for i, p in targets.items() if p}
    if not targets:
        return {}
    if not sets:
        raise MoePruneError(
            "low-rank novices need calibration data (a second pass fits them)", options=("data",)
        )

    def moments_of(data: Sequence[CalibrationData]) -> LayerMoments:
        return observe_moments(
            moe, data, targets, batch_size=batch_size, pad_token_id=pad_token_id, progress=progress
        )

    held: list[LayerMoments] | None = None  # per held-out source
    if not checks.shrink:
        fit = whole = moments_of(sets)
    elif checks.data is not None:  # the fit takes every calibration token
        fit = whole = moments_of(sets)
        held = [moments_of([part]) for part in checks.by_source([checks.data])]
    else:
        fit_sets, held_sets = checks.split(sets)
        fit = moments_of(fit_sets)
        held = [moments_of([part]) for part in checks.by_source(held_sets)]
        whole = {
            i: {p: _merged(m, [h.get(i, {}).get(p) for h in held]) for p, m in by.items()}
            for i, by in fit.items()
        }
        for i, p in {(i, p) for h in held for i, by in h.items() for p in by}:  # only held-out tokens reached
            whole.setdefault(i, {}).setdefault(
                p, _merged(Moments.zeros(moe.layer(i).hidden_size), [h.get(i, {}).get(p) for h in held])
            )
    out: Fits = {}
    for index, positions in targets.items():
        layer = moe.layer(index)
        ref = cast(torch.Tensor, layer.experts.down_proj)
        ids, zeros = layer.expert_ids, Moments.zeros(layer.hidden_size)
        fitted = {}
        for p in positions:
            m = fit.get(index, {}).get(p) or zeros
            if held is None:
                novice = fit_lowrank(m, rank)
            else:
                all_tokens = whole.get(index, {}).get(p) or zeros
                mine = [h[index][p] for h in held if p in h.get(index, {})]
                novice, check = choose_novice(m, mine, all_tokens, rank, layer=index, expert=ids[p])
                checks.found[(index, ids[p])] = check
            fitted[ids[p]] = novice.to(device=ref.device, dtype=ref.dtype)
        out[index] = fitted
    return out


def _merged(first: Moments, others: Sequence[Moments | None]) -> Moments:
    """A new Moments over all the token sets (Chan's update; no argument changes)."""
    out = Moments.zeros(first.mean_h.numel())
    for part in (first, *others):
        if part is not None:
            out.merge(part)
    return out


def fit_every_novice(
    moe: MoEModel,
    rank: int,
    sets: Sequence[CalibrationData],
    *,
    batch_size: int = 8,
    pad_token_id: int = 0,
    progress: bool = True,
    memory: int | None = None,
    checks: FitChecks | None = None,
) -> Fits:
    """Every routed expert of every MoE layer fitted as a rank-`rank` novice: what a mixed search
    gives its candidates' novices, so it scores the novices that will be saved. The moments take
    16 d^2 bytes per routed expert; the layers are fitted in as few calibration passes as keep each
    pass's moments within `memory` bytes (default: half the memory available, `moments_memory`),
    one pass where all fit. A pass's fits do not depend on which other layers it observes, so the
    passes give the very fits one pass would (tested). `checks`: as `fit_novices`'s (every
    expert's check goes into `checks.found`)."""
    targets = {m.index: list(range(m.num_experts)) for m in moe.layers}
    passes = layer_passes(moe, moments_memory() if memory is None else memory)
    _LOG.info(
        "fitting rank-%d novices for all %d routed experts before the search: %.3g GB of fp64 "
        "moments (16 d^2 bytes per expert) in %d calibration pass(es)",
        rank,
        sum(map(len, targets.values())),
        moments_bytes(moe, targets) / 1e9,
        len(passes),
    )
    out: Fits = {}
    for layers in passes:
        out.update(
            _fit(
                moe,
                {i: targets[i] for i in layers},
                rank,
                sets,
                checks=checks or FitChecks(),
                batch_size=batch_size,
                pad_token_id=pad_token_id,
                progress=progress,
            )
        )
    return out


def fit_novices(
    moe: MoEModel,
    plan: Plan,
    sets: Sequence[CalibrationData],
    *,
    batch_size: int = 8,
    pad_token_id: int = 0,
    progress: bool = True,
    fitted: Fits | None = None,
    checks: FitChecks | None = None,
) -> Fits:
    """The plan's novices fitted at its rank ({decoder layer: {original expert id: novice}}, in
    the model's dtype) from a second pass over the calibration sets; {} for a rank-0 plan.
    Each novice's ridge and rank are chosen on held-out tokens (surgery/fit_holdout.py): those
    of `checks.data` (the search data), else of every HOLD_OUT-th calibration sample; its check
    goes into `checks.found`, and a novice with too few routed tokens for its parameters is named
    in a warning. `checks.shrink` False: the unchecked least-squares fit (as before the checks).
    `fitted`: every expert already fitted at that rank (`fit_every_novice`, a mixed search's): the
    plan's novices are taken from it, the very ones the search scored, and no pass runs."""
    rank = plan_rank(plan)
    if rank == 0:
        return {}
    targets: dict[int, list[int]] = {}
    for lp in plan.layers:
        if lp.novice:
            where = {orig: pos for pos, orig in enumerate(moe.layer(lp.layer).expert_ids)}
            targets[lp.layer] = [where[e] for e in lp.novice]
    checks = checks or FitChecks()
    if fitted is None:
        fitted = _fit(
            moe,
            targets,
            rank,
            sets,
            checks=checks,
            batch_size=batch_size,
            pad_token_id=pad_token_id,
            progress=progress,
        )
    out: Fits = {}
    for lp in plan.layers:
        if not lp.novice:
            continue
        have = fitted.get(lp.layer, {})
        missing = [e for e in lp.novice if e not in have or have[e].rank != rank]
        if missing:
            raise MoePruneError(
                f"layer {lp.layer}: no rank-{rank} fit of novices {missing} among the fitted ones; "
                "fit every expert at the plan's rank (fit_every_novice) or let fit_novices fit them"
            )
        out[lp.layer] = {e: have[e] for e in lp.novice}
    for check in plan_checks(plan, checks.found):
        if check.too_few:
            _LOG.warning("too few tokens for a low-rank novice: %s", check.warning())
    return out


def plan_checks(plan: Plan, checks: Mapping[tuple[int, int], FitCheck]) -> list[FitCheck]:
    """The held-out checks of the plan's novices, in layer and expert order (those `checks` has)."""
    return [checks[(lp.layer, e)] for lp in plan.layers for e in sorted(lp.novice) if (lp.layer, e) in checks]
