"""Low-rank novices: the closed-form fit against hand-computed numbers and a direct fp64
least-squares / reduced-rank regression, streamed moments, few-token fallbacks, and the
virtual form equal to the physical one in every family."""

from __future__ import annotations

import copy

import pytest
import torch
from test_observe import calibration

from helpers import assert_logits_close
from moeprune.criteria import compute_scores, get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.packed import novice_rank, packed_structure
from moeprune.observe.moments import Moments, observe_moments
from moeprune.observe.observer import observe
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import RANK_KEY, NoviceOptions, fit_lowrank, fit_novices
from moeprune.surgery.novice import novice_plan
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = pytest.mark.integration  # fits novices on tiny models end to end

F64 = torch.float64


def test_hand_computed_fit():
    """h = +-e1, +-e2; y = A h + b with A = diag(2, 1), b = (1, 1): hbar = 0, mu = b,
    Sigma = diag(1/2, 1/2), C = A Sigma, so B = A. B Sigma B^T = diag(2, 1/2): rank 1 keeps e1,
    B_1 = [[2, 0], [0, 0]], and the novice maps h to (1 + 2 h_1, 1)."""
    h = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]], dtype=F64)
    y = h @ torch.diag(torch.tensor([2.0, 1.0], dtype=F64)) + 1
    full = fit_lowrank(Moments.of(h, y), 2, ridge=0.0)
    b = full.u @ full.v.T
    assert torch.allclose(b, torch.tensor([[2.0, 0], [0, 1]], dtype=F64), atol=1e-12)
    assert torch.allclose(full.constant, torch.tensor([1.0, 1.0], dtype=F64), atol=1e-12)
    one = fit_lowrank(Moments.of(h, y), 1, ridge=0.0)
    assert one.rank == 1
    assert torch.allclose(one.u @ one.v.T, torch.tensor([[2.0, 0], [0, 0]], dtype=F64), atol=1e-12)
    x = torch.tensor([[0.5, 3.0]], dtype=F64)
    assert torch.allclose(one(x), torch.tensor([[2.0, 1.0]], dtype=F64), atol=1e-12)
    zero = fit_lowrank(Moments.of(h, y), 0)
    assert zero.rank == 0 and torch.allclose(zero(x), torch.tensor([[1.0, 1.0]], dtype=F64))


def _direct_rrr(h: torch.Tensor, y: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced-rank regression the textbook way: lstsq on centred tokens, then project the fitted
    map onto the top-`rank` eigenvectors of the fitted outputs' covariance. Returns (B_R, c)."""
    hc, yc = h - h.mean(0), y - y.mean(0)
    b = torch.linalg.lstsq(hc, yc).solution.T  # y_c ~ h_c B^T
    fitted = hc @ b.T
    _, vecs = torch.linalg.eigh(fitted.T @ fitted)
    top = vecs[:, -rank:]
    b_r = top @ top.T @ b
    return b_r, y.mean(0) - b_r @ h.mean(0)


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_matches_direct_reduced_rank_regression(rank):
    g = torch.Generator().manual_seed(0)
    d, n = 6, 400
    h = torch.randn(n, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64) + 0.3
    y = torch.tanh(h @ torch.randn(d, d, generator=g, dtype=F64)) + 0.05 * torch.randn(
        n, d, generator=g, dtype=F64
    )
    b_r, c = _direct_rrr(h, y, rank)
    # streamed in uneven batches, merged with Chan's update
    moments = Moments.zeros(d)
    for part in torch.split(torch.arange(n), [1, 50, 149, 200]):
        moments.merge(Moments.of(h[part], y[part]))
    fit = fit_lowrank(moments, rank, ridge=0.0)
    assert torch.allclose(fit.u @ fit.v.T, b_r, atol=1e-9)
    assert torch.allclose(fit.constant, c, atol=1e-9)
    default = fit_lowrank(moments, rank)  # the documented ridge moves it by ~1e-6 relative
    assert torch.allclose(default.u @ default.v.T, b_r, atol=1e-4)
    # the fit is the least-squares optimum among rank-R maps: lower error than the constant
    err = (fit(h) - y).square().sum()
    assert err < (y - y.mean(0)).square().sum()
    assert err <= (h @ b_r.T + c - y).square().sum() + 1e-9


def test_few_tokens_fall_back_to_lower_rank():
    d = 4
    h = torch.tensor([[1.0, 2, 0, 0], [3.0, 0, 1, 0]], dtype=F64)
    y = torch.tensor([[1.0, 0, 0, 1], [0.0, 1, 1, 0]], dtype=F64)
    two = fit_lowrank(Moments.of(h, y), 3)  # 2 tokens: rank 1, padded with zero columns
    assert two.rank == 3 and two.u[:, 1:].abs().max() == 0 and two.v[:, 1:].abs().max() == 0
    assert torch.allclose(two(h), y, atol=1e-5)  # a line through both tokens fits them
    one = fit_lowrank(Moments.of(h[:1], y[:1]), 3)
    assert one.u.abs().max() == 0 and torch.equal(one.constant, y[0])
    unseen = fit_lowrank(Moments.zeros(d), 2)
    assert unseen(h).abs().max() == 0


def test_bad_ranks_are_refused():
    with pytest.raises(MoePruneError, match="non-negative"):
        NoviceOptions(novice_rank=-1)
    moe = MoEModel(tiny_model("qwen3_moe"))
    hidden = moe.layers[0].hidden_size
    NoviceOptions(novice_rank=hidden).check_model(moe)
    with pytest.raises(MoePruneError, match="larger than the hidden size"):
        NoviceOptions(novice_rank=hidden + 1).check_model(moe)


def _plan(moe, stats, rank):
    plan = novice_plan(moe, stats, compute_scores("mone", stats=stats), 0.25, criterion=get_criterion("mone"))
    plan.extra[RANK_KEY] = rank
    return plan


def _fitted(family, rank):
    """A tiny `family` model, its statistics, a rank-`rank` novice plan at 25 % and its fits:
    unchecked (`shrink=False`), since a random tiny model's 4-28 tokens per expert keep most
    novices constant on held-out tokens, and these tests check the low-rank form itself."""
    model = tiny_model(family)
    moe = MoEModel(model)
    data = calibration((20, 17, 15, 12))
    stats = observe(moe, data, batch_size=2, progress=False)
    plan = _plan(moe, stats, rank)
    unchecked = FitChecks(shrink=False)
    return (
        model,
        moe,
        stats,
        plan,
        fit_novices(moe, plan, [data], batch_size=2, progress=False, checks=unchecked),
    )


TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("family", supported_families())
def test_virtual_equals_physical(family):
    model, moe, stats, plan, fits = _fitted(family, 2)
    constant_plan = copy.deepcopy(plan)
    constant_plan.extra.pop(RANK_KEY)
    with virtual_plan(moe, constant_plan, stats):  # rank 0: the constant novices
        constant = _logits(model)
    with virtual_plan(moe, plan, stats, fits):
        virtual = _logits(model)
    assert (virtual - constant).abs().max() > 1e-5, "the low-rank part changed nothing"
    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats, fits)
    assert_logits_close(_logits(pruned), virtual)
    touched = [m for m in pruned_moe.layers if plan.layer(m.index).novice]
    assert touched and all(novice_rank(m) == 2 and packed_structure(m)["novice_rank"] == 2 for m in touched)
    d = moe.layers[0].hidden_size
    after = routed_parameters(pruned_moe)["routed_experts"]
    assert after == plan_routed_parameters(moe, plan)["routed_experts"]
    novices = sum(len(lp.novice) for lp in plan.layers)
    assert after - plan_routed_parameters(moe, constant_plan)["routed_experts"] == novices * 2 * d * 2


def test_low_rank_novice_fits_its_tokens_better():
    """On the calibration tokens themselves, the rank-R novice's squared error to the expert's
    output is below the constant's (least squares over those very tokens)."""
    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    data = calibration((20, 17, 15, 12))
    layer = moe.layers[0]
    moments = observe_moments(moe, [data], {layer.index: list(range(layer.num_experts))}, progress=False)
    for m in moments[layer.index].values():
        if m.count > 3:
            resid_total = torch.trace(m.c_hh)  # sanity: the expert saw varied inputs
            assert resid_total > 0
            fit = fit_lowrank(m, 2)
            # E||y - c - B h||^2 - E||y - mu||^2 from the moments: tr(B S B^T) - 2 tr(B C^T)
            b = fit.u @ fit.v.T
            gain = torch.trace(b @ m.c_hh @ b.T) - 2 * torch.trace(b @ m.c_yh.T)
            assert gain < 0


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4_text", "gpt_oss"])
def test_saved_low_rank_novices_reload_exactly_and_with_stock_transformers(family, tmp_path):
    """moeprune's loader and stock transformers (trust_remote_code, the saved modeling files)
    give the virtual form's logits; config.json records the rank. Within 1e-5, not bit for bit: the
    virtual form runs the experts in the stacked layout, the saved one in its packed layout, and
    the CPU's matmul kernels block the two shapes differently (on an AVX-512 Xeon, llama4_text and
    gpt_oss differ by 9.5e-7 and 1.2e-7 on logits of order 1; a wrong novice moves them by 1e-1)."""
    import json

    from transformers import AutoModelForCausalLM

    import moeprune

    model, moe, stats, plan, fits = _fitted(family, 3)
    with virtual_plan(moe, plan, stats, fits):
        virtual = _logits(model)
    apply_plan_physical(moe, plan, stats, fits)
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    layers = json.loads((tmp_path / "config.json").read_text())["moeprune"]["layers"]
    assert {entry.get("novice_rank") for entry in layers if entry["novice"]} == {3}
    assert (_logits(moeprune.load_pretrained(tmp_path)) - virtual).abs().max() <= 1e-5
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert (_logits(stock) - virtual).abs().max() <= 1e-5
