"""build_plan and tenp_plan take their settings as one object; their former keywords still work."""

from __future__ import annotations

import pytest
from test_observe import calibration

from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
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


def test_build_plan_takes_a_prune_config_and_still_the_former_keywords_with_a_warning():
    moe = MoEModel(tiny_model("olmoe"))
    criterion, scores = get_criterion("random"), _random_scores(moe)
    config = PruneConfig("random", 0.25, allocation="global", expert_multiple=2)
    plan = build_plan(moe, criterion, scores, config=config, data_fingerprint="abc")
    with pytest.warns(DeprecationWarning) as caught:
        legacy = build_plan(moe, criterion, scores, sparsity=0.25, allocation="global", expert_multiple=2,
                            data_fingerprint="abc")  # fmt: skip
    caught = [w for w in caught if str(w.message).startswith("build_plan(")]  # not those of its callees
    assert [str(w.message) for w in caught] == [
        "build_plan(sparsity=...) is deprecated: pass config=PruneConfig(sparsity=...)",
        "build_plan(allocation=...) is deprecated: pass config=PruneConfig(allocation=...)",
        "build_plan(expert_multiple=...) is deprecated: pass config=PruneConfig(expert_multiple=...)",
    ]
    assert all(w.filename == __file__ for w in caught)  # the warning points at the caller
    assert legacy == plan and plan.allocation == "global" and plan.criterion == "random"
    assert all(len(lp.kept) % 2 == 0 for lp in plan.layers)
    # a keyword given beside a config overrides that field (still with a warning)
    with pytest.warns(DeprecationWarning, match="build_plan\\(allocation=...\\)"):
        uniform = build_plan(moe, criterion, scores, config=config, allocation="uniform")
    assert uniform.allocation == "uniform" and config.allocation == "global"  # the config is not modified
    with pytest.raises(TypeError, match="build_plan\\(\\) missing its settings"):
        build_plan(moe, criterion, scores)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sparsty'"):
        build_plan(moe, criterion, scores, sparsty=0.25)


def test_tenp_plan_takes_tenp_options_and_still_the_former_keywords_with_a_warning():
    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    scores = compute_scores("tenp", stats=stats)
    plan = tenp_plan(
        moe, stats, scores, 0.5, TenpOptions(important_fraction=0.3, slope=0.0, neuron_importance="l2")
    )
    with pytest.warns(DeprecationWarning) as caught:
        legacy = tenp_plan(moe, stats, scores, 0.5, important_fraction=0.3, slope=0.0, importance="l2")
    assert [str(w.message) for w in caught] == [
        "tenp_plan(important_fraction=...) is deprecated: pass options=TenpOptions(important_fraction=...)",
        "tenp_plan(slope=...) is deprecated: pass options=TenpOptions(slope=...)",
        "tenp_plan(importance=...) is deprecated: pass options=TenpOptions(neuron_importance=...)",
    ]
    assert legacy == plan
    assert plan.extra["neuron_importance"] == "l2" and plan.extra["slope"] == 0.0
    # the same plan through build_plan and the PruneConfig's fields of the same names
    config = PruneConfig(
        "tenp", 0.5, method="tenp", neuron_importance="l2", important_fraction=0.3, slope=0.0
    )
    assert build_plan(moe, get_criterion("tenp"), scores, config=config, stats=[stats]) == plan
