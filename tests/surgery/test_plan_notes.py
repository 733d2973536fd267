"""The allocation's note (the global allocation's normalisation) is recorded once, where every
plan is built: each method's plan with each allocation that has a note carries it (a novice plan
with the global allocation once lacked it, drop and merge added it by hand)."""

from __future__ import annotations

import json

import pytest
from test_observe import calibration

from moeprune.allocate.registry import ALLOCATIONS
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery import METHODS
from moeprune.surgery.planning import build_plan

pytestmark = pytest.mark.unit  # tiny models, one observation

PAIRS = [
    (m.name, a)
    for m in METHODS
    for a in m.allocations
    if a in ALLOCATIONS and ALLOCATIONS.get(a).plan_note is not None
]


@pytest.fixture(scope="module")
def observed():
    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    return moe, stats


def test_some_allocation_has_a_note():
    assert PAIRS, "no allocation records a note: nothing to check"
    assert ("novice", "global") in PAIRS  # the pair that drifted


@pytest.mark.parametrize(("method", "allocation"), PAIRS)
def test_every_allocation_note_is_in_every_method_plan(observed, method, allocation):
    moe, stats = observed
    for criterion in (get_criterion("reap"), get_criterion("frequency")):
        scores = compute_scores(criterion.name, stats=stats)
        config = PruneConfig(criterion.name, 0.25, allocation=allocation, method=method)
        plan = build_plan(moe, criterion, scores, config=config, stats=[stats])
        note = ALLOCATIONS.get(allocation).plan_note(criterion)
        assert note and {k: plan.extra.get(k) for k in note} == note
        assert {k: json.loads(plan.to_json())["extra"][k] for k in note} == note  # in plan.json
