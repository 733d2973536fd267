"""Statistics on request: the pass records what the run's entries declare, and nothing they read
is lost. Each criterion and method gets exactly its declared kinds (the others stay None), the
fields it gets equal a full observation's bit for bit, and its scores, plans and surgery from the
minimal observation equal those from the full one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tests.observe.test_observe import calibration

from moeprune.allocate.registry import ALLOCATIONS
from moeprune.config import PruneConfig
from moeprune.criteria import CRITERIA, compute_scores, get_criterion
from moeprune.criteria.super_experts import GUARD_STATISTICS
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.kinds import DEFAULT, NONE, Statistic, union
from moeprune.observe.observer import observe
from moeprune.observe.stats import ExpertStats
from moeprune.surgery.planning import build_plan, guard_super_experts, requirements
from moeprune.surgery.plans import apply_plan_physical
from moeprune.surgery.registry import METHODS

pytestmark = pytest.mark.unit

EVERY = DEFAULT | {Statistic.NEURONS}
DATA_CRITERIA = [c.name for c in CRITERIA if c.needs_data]
SPARSITY = {"drop": 0.25, "novice": 0.25, "merge": 0.25, "neurons": 0.5, "tenp": 0.5, "mixed": 0.5}


@pytest.fixture(scope="module")
def moe() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(tiny_model("qwen3_moe"))


@pytest.fixture(scope="module")
def data():
    return calibration((20, 17, 15, 12))


@pytest.fixture(scope="module")
def full(moe, data) -> ExpertStats:
    return observe(moe, data, batch_size=2, progress=False, statistics=EVERY)


def pass_of(moe, data, kinds) -> ExpertStats:
    return observe(moe, data, batch_size=2, progress=False, statistics=kinds)


def assert_recorded_exactly(stats: ExpertStats, full: ExpertStats, kinds) -> None:
    """The fields of `kinds` (and the always-recorded sums) equal the full pass's bit for bit;
    every other kind's fields are None."""
    for mine, ref in zip(stats.layers, full.layers, strict=True):
        for name in ("count", "weight_sum", "norm_sum", "weighted_norm_sum"):
            assert torch.equal(getattr(mine, name), getattr(ref, name)), name
        for kind in Statistic:
            for name in kind.fields:
                if kind in kinds:
                    assert torch.equal(getattr(mine, name), getattr(ref, name)), name
                else:
                    assert getattr(mine, name) is None, f"{name} recorded without {kind.name} asked"


@pytest.mark.parametrize("kind", list(Statistic))
def test_each_kind_alone_records_its_fields_only(moe, data, full, kind):
    assert_recorded_exactly(pass_of(moe, data, {kind}), full, {kind})


@pytest.mark.parametrize("name", DATA_CRITERIA)
def test_a_criterion_from_its_declared_statistics_equals_the_full_observation(moe, data, full, name):
    criterion = get_criterion(name)
    minimal = pass_of(moe, data, criterion.statistics)
    assert_recorded_exactly(minimal, full, criterion.statistics)
    for mine, ref in zip(compute_scores(name, stats=minimal), compute_scores(name, stats=full), strict=True):
        assert np.array_equal(mine.scores, ref.scores) and mine.order == ref.order


def test_the_expensive_kinds_are_declared_by_the_criteria_that_read_them():
    assert get_criterion("reap").statistics == NONE  # the per-token sums only
    assert Statistic.MOMENTS in get_criterion("mone").statistics & get_criterion("msan").statistics
    assert get_criterion("tenp").statistics == {Statistic.TENP}


def test_a_reader_of_an_undeclared_statistic_stops_in_one_line(moe, data):
    with pytest.raises(MoePruneError, match="hold no m2 .*declare it"):
        compute_scores("mone", stats=pass_of(moe, data, NONE))


def test_a_reap_drop_run_observes_the_guard_maxima_and_nothing_else():
    assert requirements(PruneConfig("reap", 0.5)).statistics == {Statistic.MAXIMA}
    # with super experts allowed the report still names them: the maxima are still recorded
    allowed = PruneConfig("reap", 0.5, allow_super_experts=True)
    assert requirements(allowed).statistics == GUARD_STATISTICS


def test_auto_observes_what_every_criterion_it_scores_reads():
    needed = requirements(PruneConfig("auto", 0.5)).statistics
    assert union(*(c.statistics for c in CRITERIA)) <= needed
    assert {Statistic.TENP, Statistic.MOMENTS} <= needed


def test_every_kind_is_read_by_some_entry():
    """No kind is recorded for nobody: each is declared by a criterion, method, allocation or the guard."""
    declared = union(
        *(c.statistics for c in CRITERIA),
        *(m.observes for m in METHODS),
        *(a.statistics for a in ALLOCATIONS),
        GUARD_STATISTICS,
    )
    assert declared == frozenset(Statistic)


@pytest.mark.parametrize("method", [m.name for m in METHODS if m.portfolio is None])  # auto builds none
def test_a_method_from_its_run_statistics_plans_and_cuts_as_from_the_full_observation(
    moe, data, full, method
):
    """The run's union (criterion, method, allocation, guard) suffices for the method's plan and
    surgery: same plan, same weights as from a full observation."""
    config = PruneConfig("reap", SPARSITY[method], method=method)
    kinds = requirements(config).statistics
    assert METHODS.get(method).observes <= kinds
    minimal = pass_of(moe, data, kinds)
    assert_recorded_exactly(minimal, full, kinds)
    results = []
    for stats in (minimal, full):
        pruned = MoEModel(copy.deepcopy(moe.model))
        guard_super_experts(pruned, config, [stats])
        scores = compute_scores("reap", stats=stats)
        plan = build_plan(pruned, get_criterion("reap"), scores, config=config, stats=[stats])
        apply_plan_physical(pruned, plan, stats)
        results.append((plan.to_json(), pruned.model.state_dict()))
    (plan_a, weights_a), (plan_b, weights_b) = results
    assert plan_a == plan_b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
