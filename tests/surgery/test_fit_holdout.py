"""Low-rank novices checked on held-out tokens (surgery/fit_holdout.py): the ridge solution and the
held-out choice on hand-computed numbers, the moment formula of the held-out error against the
tokens themselves, the too-few-tokens line, and rank-R novices fitted on one domain never below
constant ones on another."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from test_observe import calibration

from moeprune.checkpoint import load_model
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.data.loading import load_data
from moeprune.demo.run import DomainEval
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.moments import Moments
from moeprune.observe.observer import observe
from moeprune.report.parts import NoviceFits
from moeprune.report.summary import novice_fit_lines
from moeprune.surgery.fit_holdout import RIDGES, FitChecks, choose_novice, ridge_factors
from moeprune.surgery.lowrank import RANK_KEY, fit_novices, plan_checks
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import virtual_plan

pytestmark = pytest.mark.integration  # hand-computed fits, and fits on tiny and trained models

F64 = torch.float64
H = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]], dtype=F64)  # hbar = 0, Sigma = diag(1/2, 1/2)
Y = H @ torch.diag(torch.tensor([2.0, 1.0], dtype=F64)) + 1  # y = diag(2, 1) h + (1, 1)


def test_ridge_solution_by_hand():
    """alpha = 1: lambda = trace(Sigma) / d = 1/2, so B = C (Sigma + I/2)^-1 = diag(2, 1) Sigma
    = diag(1, 1/2); C (Sigma + lambda I)^-1/2 = diag(1, 1/2) has e1 first, so rank 1 is diag(1, 0)."""
    fit = Moments.of(H, Y)
    (u, v), (u0, v0) = ridge_factors(fit, 2, (1.0, 0.0))
    assert torch.allclose(u @ v.T, torch.tensor([[1.0, 0], [0, 0.5]], dtype=F64), atol=1e-12)
    assert torch.allclose(u0 @ v0.T, torch.tensor([[2.0, 0], [0, 1]], dtype=F64), atol=1e-12)  # least squares
    one = ridge_factors(fit, 1, (1.0,))[0]
    assert torch.allclose(one[0] @ one[1].T, torch.tensor([[1.0, 0], [0, 0]], dtype=F64), atol=1e-12)


def _held(y: torch.Tensor) -> Moments:
    return Moments.of(torch.tensor([[1.0, 0], [-1, 0]], dtype=F64), y)


def test_held_out_choice_by_hand():
    """Held-out tokens h = +-e1 (the search data: the fit takes every calibration token).
    - y = (1 + h1, 1): slope 1 where the fit saw 2. A novice diag(b, .) errs (1 - b)^2 against
      the constant's 1, so alpha = 1 (b = 1) at rank 1 wins with held-out error 0; on the fit tokens
      diag(1, 0) leaves E||(h1, h2)||^2 = 1 of the constant's 2.5: 0.4. The unshrunk b = 2 errs 1.
    - y = (1, 1 + h1): nothing the fit learnt holds (error 1 + b^2): the constant mean stays, and
      the unshrunk fit's error is 1 + 4 = 5 times the constant's."""
    fit = Moments.of(H, Y)
    novice, check = choose_novice(fit, [_held(torch.tensor([[2.0, 1], [0, 1]], dtype=F64))], fit, 2)
    assert (check.chosen_rank, check.ridge) == (1, 1.0)
    assert check.held_out == pytest.approx(0.0, abs=1e-12)
    assert check.calibration == pytest.approx(0.4, abs=1e-12)
    assert check.unshrunk == pytest.approx(1.0, abs=1e-5)
    assert novice.rank == 2 and torch.allclose(
        novice(torch.tensor([[1.0, 3]], dtype=F64)), torch.tensor([[2.0, 1]], dtype=F64)
    )
    novice, check = choose_novice(fit, [_held(torch.tensor([[1.0, 2], [1, 0]], dtype=F64))], fit, 2)
    assert (check.chosen_rank, check.ridge, check.held_out) == (0, None, 1.0)
    assert check.unshrunk == pytest.approx(5.0, abs=1e-5)
    assert torch.equal(novice.constant, fit.mean_y) and novice.u.abs().max() == 0
    _, unseen = choose_novice(fit, [], fit, 2)  # no held-out token reached it: the constant
    assert (unseen.chosen_rank, unseen.held_out, unseen.unshrunk) == (0, None, None)


def test_a_fit_worse_on_one_source_is_not_taken():
    """Two held-out sources: on A (4 tokens, y = (1 + 2 h1, 1)) the least-squares fit is exact, on B
    (2 tokens, y = (1, 1 + h1)) every fit that uses h1 errs 1 + b^2 against the constant's 1.
    Pooled, the fit wins (A's gain outweighs B's loss); per source it is worse on B, so the
    constant stays."""
    fit = Moments.of(H, Y)
    a = Moments.of(torch.cat((H[[0, 2]], H[[0, 2]])), torch.tensor([[3.0, 1], [-1, 1]] * 2, dtype=F64))
    b = _held(torch.tensor([[1.0, 2], [1, 0]], dtype=F64))
    pooled = Moments.zeros(2)
    pooled.merge(a)
    pooled.merge(b)
    assert choose_novice(fit, [pooled], fit, 2)[1].chosen_rank > 0
    novice, check = choose_novice(fit, [a, b], fit, 2)
    assert (check.chosen_rank, check.held_tokens, check.held_out) == (0, 6, 1.0)
    assert torch.equal(novice.constant, fit.mean_y)


def _direct_error(novice, h: torch.Tensor, y: torch.Tensor) -> float:
    return float((novice(h) - y).square().sum(1).mean())


def test_held_out_error_from_moments_is_the_tokens_and_the_best_of_the_grid():
    """Fit and held-out tokens from different maps, means from all tokens (a held-back share of the
    calibration data): the check's held-out error is the saved novice's error on the held-out tokens
    themselves over the constant mean's, no (ridge, rank) of the grid does better there, and none is
    below 1 (the constant)."""
    g = torch.Generator().manual_seed(0)
    d, rank = 6, 3
    w = torch.randn(d, d, generator=g, dtype=F64)
    h_fit, h_held = (
        torch.randn(40, d, generator=g, dtype=F64),
        torch.randn(30, d, generator=g, dtype=F64) + 0.2,
    )
    y_fit = h_fit @ w.T + torch.randn(40, d, generator=g, dtype=F64)
    y_held = h_held @ (0.5 * w).T + 0.3 + torch.randn(30, d, generator=g, dtype=F64)
    fit, held = Moments.of(h_fit, y_fit), Moments.of(h_held, y_held)
    whole = Moments.of(torch.cat((h_fit, h_held)), torch.cat((y_fit, y_held)))
    novice, check = choose_novice(fit, [held], whole, rank)
    constant = _direct_error(lambda x: whole.mean_y.expand(x.shape[0], -1), h_held, y_held)
    assert check.held_out == pytest.approx(_direct_error(novice, h_held, y_held) / constant, rel=1e-9)
    assert check.chosen_rank > 0 and check.held_out < 1
    mu, hbar = whole.mean_y, whole.mean_h
    for alpha, (u, v) in zip(RIDGES, ridge_factors(fit, rank, RIDGES)):
        for r in range(1, rank + 1):
            b = u[:, :r] @ v[:, :r].T
            error = _direct_error(lambda x, b=b: mu + (x - hbar) @ b.T, h_held, y_held) / constant
            assert check.held_out <= error + 1e-9, (alpha, r)
            if alpha == RIDGES[0] and r == rank:
                assert check.unshrunk == pytest.approx(error, rel=1e-9)
    assert check.calibration == pytest.approx(
        _direct_error(novice, h_fit, y_fit)
        / _direct_error(lambda x: mu.expand(x.shape[0], -1), h_fit, y_fit),
        rel=1e-9,
    )


def test_too_few_tokens_are_named_in_one_line(caplog):
    """Rank 1 on a tiny model (d = 32: 96 parameters per novice, 960 values needed): each plan
    novice with fewer than 30 routed calibration tokens is named with its count, the others not;
    the report part lists the same lines."""
    moe = MoEModel(tiny_model("qwen3_moe"))
    data = calibration((60, 50, 40, 30))
    stats = observe(moe, data, batch_size=2, progress=False)
    scores = compute_scores("mone", stats=stats)
    config = PruneConfig("mone", 0.5, method="novice", options={"novice_rank": 1})
    plan = build_plan(moe, get_criterion("mone"), scores, config=config, stats=[stats])
    checks = FitChecks()
    with caplog.at_level(logging.WARNING, logger="moeprune.surgery.lowrank"):
        fit_novices(moe, plan, [data], batch_size=2, progress=False, checks=checks)
    named = [r.getMessage() for r in caplog.records]
    d = moe.layers[0].hidden_size
    found = plan_checks(plan, checks.found)
    assert len(found) == sum(len(lp.novice) for lp in plan.layers) > 0
    for lp in plan.layers:
        counts = stats.layer(lp.layer).count
        for e in lp.novice:
            n = int(counts[e])
            line = f"layer {lp.layer} expert {e}: {n} routed calibration tokens ({n * d:,} values) for the {d * 3} parameters"
            assert any(line in m for m in named) == (n < 30), (line, named)
    assert 0 < len(named) < len(found)  # some novices are named, not all
    part = NoviceFits.of(found, checks.source)
    assert part.too_few == [c.warning() for c in found if c.too_few] and len(part.too_few) == len(named)
    assert NoviceFits.from_json(part.to_json()) == part
    lines = novice_fit_lines(part.to_json(), shown=2)  # the console summary: averages, then the names
    constant = sum(c.chosen_rank == 0 for c in found)
    assert (
        lines[0].startswith("  novice fits     rank 1: ")
        and f"{constant} of {len(found)} kept constant" in lines[0]
    )
    assert lines[1:3] == [f"  too few tokens  {line}" for line in part.too_few[:2]]


def test_rank_r_novices_fitted_on_code_never_below_constant_on_prose(trained_moe):
    """16 code samples calibrate rank-8 novices on the trained model (no search data: every 4th
    sample held out); on prose answers the novices after the held-out choice are never below the
    constant ones, in ESAP or NLL, at 25 % and 50 %; and every novice's held-out error is at most
    the constant's."""
    model_dir, corpus = trained_moe
    model, tokenizer = load_model(model_dir)
    moe, pad = MoEModel(model), tokenizer.pad_token_id or 0
    code = load_data([str(corpus / "code_train.jsonl")], tokenizer, num_samples=16, max_length=128, seed=0)
    prose = load_data([str(corpus / "prose_eval.jsonl")], tokenizer, num_samples=32, max_length=128, seed=0)
    stats = observe(moe, code, batch_size=8, pad_token_id=pad, progress=False)
    evaluation = DomainEval(moe, prose, 8, pad)
    scores = compute_scores("mone", stats=stats)
    for sparsity in (0.25, 0.5):
        config = PruneConfig("mone", sparsity, method="novice", options={"novice_rank": 8})
        plan = build_plan(moe, get_criterion("mone"), scores, config=config, stats=[stats])
        constant_plan = copy.deepcopy(plan)
        constant_plan.extra.pop(RANK_KEY)
        checks = FitChecks()
        fits = fit_novices(moe, plan, [code], batch_size=8, pad_token_id=pad, progress=False, checks=checks)
        assert all(c.held_out is not None and c.held_out <= 1 for c in plan_checks(plan, checks.found))
        constant = evaluation.score(functools.partial(virtual_plan, moe, constant_plan, stats))
        ranked = evaluation.score(functools.partial(virtual_plan, moe, plan, stats, fits))
        assert ranked["esap"] >= constant["esap"] and ranked["nll"] <= constant["nll"], (
            sparsity,
            ranked,
            constant,
        )
