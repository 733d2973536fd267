"""A method with its own search genes is one module. This file is that module: `quarters` declares
per-layer forms as its genes (`Method.genes = FORMS`) and its own options (a quarter of each
layer's experts made novices by default) and plan builder; nothing else names it. The uniform
allocation plans it, and the searches registered for (evo, forms) and (gradient, forms) run it
(search/registry.py `search_for`), through the one verb `moeprune.prune`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from test_observe import calibration
from test_search import _data

import moeprune
from moeprune.config import PruneConfig, SearchConfig, setting
from moeprune.models.factory import tiny_model
from moeprune.plan import Plan
from moeprune.search.registry import search_for
from moeprune.surgery import METHODS
from moeprune.surgery.mixed import MixedOptions, plan_mixed
from moeprune.surgery.planning import check_config
from moeprune.surgery.registry import FORMS, PlanRequest

pytestmark = pytest.mark.integration  # three small prunes of a tiny model, two of them searched

NAME = "quarters"


@dataclass(frozen=True)
class QuarterOptions(MixedOptions):
    """Its own default: a quarter of each layer's experts become novices."""

    mixed_novice: float = setting(
        0.25, "quarters: share of each layer's experts made novices.", minimum=0, maximum=1
    )


def quarters_plan(request: PlanRequest) -> Plan:
    """The forms the genes say (a search's, else the uniform shares), labelled as this method."""
    plan = plan_mixed(request)  # the forms' plan arithmetic is the mixed method's (surgery/mixed.py)
    plan.method = request.method
    plan.extra["quarters"] = {"searched": request.removed is not None}
    return plan


@pytest.fixture
def quarters(monkeypatch):
    """Registered for this test only (the registry is global; the generated docs list its entries).
    Its size hooks (feasible, planned bytes, target steps) are the forms' ones."""
    base = METHODS.get("mixed")
    spec = replace(
        base, name=NAME, help="a quarter novices (a test method)", options=QuarterOptions, fn=quarters_plan
    )
    assert spec.genes == FORMS
    monkeypatch.setitem(METHODS._specs, NAME, spec)


def _prune(allocation: str, search: SearchConfig | None = None):
    config = PruneConfig("reap", 0.4, allocation=allocation, method=NAME, search=search or SearchConfig())
    model = tiny_model("qwen3_moe")
    result = moeprune.prune(
        model,
        config,
        data=calibration((20, 17, 15, 12)),
        search_data=_data(),
        run=moeprune.RunOptions(progress=False),
    )
    return config, result


def test_uniform_plans_its_own_default(quarters):
    config, result = _prune("uniform")
    assert search_for(check_config(config)) is None
    plan = result.plan
    assert (
        plan.method == NAME and result.report.method == NAME and plan.extra["quarters"] == {"searched": False}
    )
    assert plan.extra["mixed_options"]["mixed_novice"] == 0.25  # its options class, resolved once
    assert all(len(lp.novice) == 2 for lp in plan.layers)  # a quarter of 8 experts per layer


@pytest.mark.parametrize(
    ("allocation", "search"),
    [
        ("evo", SearchConfig(population=4, elites=2, generations=2, seed=3)),
        ("gradient", SearchConfig(steps=3, seed=3)),
    ],
)
def test_searches_over_its_forms(quarters, allocation, search):
    config, result = _prune(allocation, search)
    entry = search_for(check_config(config))
    assert entry is not None and (entry.allocation, entry.genes) == (allocation, FORMS)
    plan, doc = result.plan, result.search
    assert plan.method == NAME and plan.extra["quarters"] == {"searched": True}
    assert doc is not None and result.report.search is not None
    # the plan is the searched genes: its per-layer forms are the ones search.json reports
    assert len(plan.extra["mixed_genes"]) == len(plan.layers)
    for lp, g in zip(plan.layers, plan.extra["mixed_genes"]):
        assert len(lp.novice) == g["novice"] and len(lp.dropped) == g["dropped"]
