"""TENP trapezoid: exact parameter budget, important experts growing with depth, per-family surgery."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_observe import calibration

import moeprune
from helpers import assert_logits_close
from moeprune.allocate.trapezoid import TrapezoidLayer, depth_weights, trapezoid_allocation
from moeprune.criteria import compute_scores
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.adapter import ExpertCost
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.tenp import TenpOptions, tenp_plan

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
SWIGLU = ExpertCost(per_neuron=3 * 64, per_expert=0)
CLAMPED_WITH_BIASES = ExpertCost(per_neuron=3 * 64 + 2, per_expert=64)  # gpt_oss-like


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("cost", [SWIGLU, CLAMPED_WITH_BIASES])
@pytest.mark.parametrize("rho", [0.3, 0.5, 0.77])
@pytest.mark.parametrize("r_imp", [None, 0.0, 0.2])
@pytest.mark.parametrize("slope", [0.0, 0.5, 1.0])
def test_budget_is_exact_and_important_counts_grow_with_depth(cost, rho, r_imp, slope):
    layers = [TrapezoidLayer(experts=16, width=48, cost=cost)] * 6
    alloc = trapezoid_allocation(layers, rho, r_imp, slope)
    assert abs(alloc.kept_params - rho * alloc.total_params) <= cost.per_neuron / 2
    assert alloc.important == sorted(alloc.important)  # monotone with depth
    if slope == 0:
        assert max(alloc.important) - min(alloc.important) <= 1
    q = alloc.neuron_ratio
    for n_imp, widths in zip(alloc.important, alloc.widths):
        assert len(widths) == 16 - n_imp
        assert widths == sorted(widths, reverse=True)
        assert set(widths) <= {math.floor(q * 48), math.floor(q * 48) + 1}
    if cost.per_expert == 0:  # q is exactly (rho - r) / (1 - r) with the realised important fraction r
        r = alloc.important_fraction
        assert q == pytest.approx((rho - r) / (1 - r), rel=1e-12)
    target = rho / 2 if r_imp is None else r_imp
    assert abs(alloc.important_fraction - target) <= len(layers) / (2 * 16 * len(layers)) + 1e-12


def test_slope_makes_deep_layers_keep_more_whole_experts():
    layers = [TrapezoidLayer(8, 32, SWIGLU)] * 4
    alloc = trapezoid_allocation(layers, 0.5, slope=1.0)
    assert alloc.important[0] < alloc.important[-1]
    assert depth_weights(4, 1.0) == pytest.approx([0, 2 / 3, 4 / 3, 2])
    assert depth_weights(1, 0.7) == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(keep_fraction=0.5, important_fraction=0.5), "must be below the kept fraction"),
        (dict(keep_fraction=0.5, important_fraction=-0.1), r"important fraction must be in \[0, 1\)"),
        (dict(keep_fraction=0.5, slope=1.5), r"slope must be in \[0, 1\]"),
        (dict(keep_fraction=0.0), r"\(0, 1\]"),
        (dict(keep_fraction=1.2), r"\(0, 1\]"),
        (dict(keep_fraction=0.05, important_fraction=0.045), "less than one neuron"),
    ],
)
def test_bad_trapezoid_inputs(kwargs, message):
    with pytest.raises(MoePruneError, match=message):
        trapezoid_allocation([TrapezoidLayer(8, 16, SWIGLU)] * 3, **kwargs)


@pytest.mark.parametrize("family", supported_families())
def test_tenp_virtual_equals_physical_and_reloads_exactly(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    scores = compute_scores("tenp", stats=stats)
    plan = tenp_plan(moe, stats, scores, 0.5)
    for lp, s, count in zip(plan.layers, scores, plan.extra["important_per_layer"]):
        whole = sorted(set(lp.kept) - set(lp.neurons))
        top = np.argsort(-s.scores, kind="stable")[:count].tolist()
        assert set(top) <= set(whole)
    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert (logits(model) - full).abs().max() == 0

    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats)
    physical = logits(pruned)
    assert (physical - virtual).abs().max() <= 1e-5 * max(1.0, float(full.abs().max()))
    after = routed_parameters(pruned_moe)["routed_experts"]
    assert (
        after == plan_routed_parameters(moe, plan)["routed_experts"] == plan.extra["routed_parameters_kept"]
    )
    per_neuron = 3 * 32 + (2 if family == "gpt_oss" else 0)
    assert abs(after - 0.5 * routed_parameters(moe)["routed_experts"]) <= per_neuron

    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    assert_logits_close(logits(moeprune.load_pretrained(tmp_path)), physical)


def test_multi_domain_calibration_uses_the_tenp_normalisation():
    model = tiny_model("qwen2_moe")
    moe = MoEModel(model)
    domains = [
        observe(moe, calibration(lengths), batch_size=2, neurons=True, progress=False, domain=name)
        for name, lengths in (("a", (20, 17)), ("b", (5, 4, 3)))
    ]
    mixed = compute_scores("tenp", stats=domains)
    plan = tenp_plan(moe, domains, mixed, 0.5, TenpOptions(important_fraction=0.3, slope=0.0))
    for lp, s in zip(plan.layers, mixed):
        layer = moe.layer(lp.layer)
        a, b = (d.layer(lp.layer).tenp_sum for d in domains)
        expected = (a / a.norm() + b / b.norm()).numpy()
        np.testing.assert_allclose(s.scores, expected, rtol=1e-12)
        whole = set(lp.kept) - set(lp.neurons)
        top = np.argsort(-expected, kind="stable")[: len(whole)].tolist()
        assert whole == set(top) and len(whole) < layer.num_experts
    with virtual_plan(moe, plan, domains):
        virtual = logits(model)
    apply_plan_physical(moe, plan, domains)
    assert (logits(model) - virtual).abs().max() <= 1e-5


def test_tenp_needs_neuron_statistics():
    moe = MoEModel(tiny_model("olmoe"))
    stats = observe(moe, calibration(), progress=False)
    with pytest.raises(MoePruneError, match="neurons=True"):
        tenp_plan(moe, stats, compute_scores("tenp", stats=stats), 0.5)
    with pytest.raises(
        MoePruneError, match="needs calibration statistics: give calibration data files"
    ) as caught:
        tenp_plan(moe, None, [], 0.5)
    assert caught.value.options == ("data",)
