"""`Method.planned_keeps`: what each MoE layer keeps under a config's uniform plan, predicted from
the structure and options alone (per-layer precision prices it before loading), is what the plan
built from scores keeps: every expert's width, the novices and the experts dropped."""

from __future__ import annotations

import pytest
from test_observe import calibration

from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery import METHODS
from moeprune.surgery.planning import build_plan, check_config

pytestmark = pytest.mark.unit  # a tiny model, one observation

KEEPING = [m.name for m in METHODS if m.planned_keeps is not None]


def test_the_methods_that_keep_other_forms_declare_their_keeps():
    assert {"neurons", "tenp", "novice", "mixed"} <= set(KEEPING)


@pytest.mark.parametrize("method", KEEPING)
@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_planned_keeps_are_the_uniform_plans(method, sparsity):
    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    criterion = get_criterion("reap")
    config = check_config(PruneConfig("reap", sparsity, method=method))
    assert not config.allocator.searches  # the method's default: a uniform plan
    plan = build_plan(moe, criterion, compute_scores("reap", stats=stats), config=config, stats=[stats])
    predicted = config.method_spec.planned_keeps(moe, config)
    for m, lp, keep in zip(moe.layers, plan.layers, predicted):
        novice = set(lp.novice)
        widths = sorted(lp.neurons.get(e, m.intermediate_size) for e in lp.kept if e not in novice)
        assert (widths, len(novice), len(lp.dropped)) == (sorted(keep.widths), keep.novices, keep.removed)
