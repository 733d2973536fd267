"""build_plan and tenp_plan take their settings as one object."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_observe import calibration

from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery.planning import build_plan
from moeprune.surgery.tenp import TenpOptions, tenp_plan

pytestmark = pytest.mark.unit  # tiny models, no training


def _random_scores(moe: MoEModel):
    return compute_scores(
        "random", num_experts=[m.num_experts for m in moe.layers], layers=[m.index for m in moe.layers]
    )


def test_build_plan_takes_its_settings_as_one_prune_config():
    moe = MoEModel(tiny_model("olmoe"))
    criterion, scores = get_criterion("random"), _random_scores(moe)
    config = PruneConfig("random", 0.25, allocation="global", expert_multiple=2)
    plan = build_plan(moe, criterion, scores, config=config, data_fingerprint="abc")
    assert plan.allocation == "global" and plan.criterion == "random" and plan.data_fingerprint == "abc"
    assert all(len(lp.kept) % 2 == 0 for lp in plan.layers)
    uniform = build_plan(moe, criterion, scores, config=replace(config, allocation="uniform"))
    assert uniform.allocation == "uniform" and config.allocation == "global"
    with pytest.raises(MoePruneError, match="no sparsity"):  # a size target is solved before planning
        build_plan(moe, criterion, scores, config=PruneConfig("random", target_size="1MB"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'sparsity'"):
        build_plan(moe, criterion, scores, sparsity=0.25)


def test_tenp_plan_takes_tenp_options():
    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    scores = compute_scores("tenp", stats=stats)
    plan = tenp_plan(
        moe, stats, scores, 0.5, TenpOptions(important_fraction=0.3, slope=0.0, neuron_importance="l2")
    )
    assert plan.extra["neuron_importance"] == "l2" and plan.extra["slope"] == 0.0
    # the same plan through build_plan, the options given as JSON would give them
    config = PruneConfig(
        "tenp", 0.5, method="tenp", options={"neuron_importance": "l2", "important_fraction": 0.3, "slope": 0.0}
    )
    assert build_plan(moe, get_criterion("tenp"), scores, config=config, stats=[stats]) == plan
