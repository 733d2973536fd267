"""A new surgery method is one module: registered with its plan builder and nothing else, it runs
through the file-level job (checks, size planning, observation, surgery, save, evidence) and the
result reloads. This file is that module: if any generic code compared method names, or kept a
list of them, this method would be refused or mishandled somewhere on the way.
"""

from __future__ import annotations

import pytest
import torch

import moeprune
from moeprune.config import PruneConfig, RunOptions
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.registry import EXPERTS, METHODS, Method, PlanRequest

pytestmark = pytest.mark.integration  # prunes a tiny checkpoint end to end


def highest_ids_plan(request: PlanRequest) -> Plan:
    """A toy method: every layer drops its highest-numbered experts, whatever the scores say."""
    moe = request.moe
    removals = [list(range(m.num_experts - r, m.num_experts)) for m, r in zip(moe.layers, request.removals())]
    return Plan.from_removals(
        ModelShape.of(moe),
        removals=removals,
        criterion=request.criterion.name,
        allocation=request.allocation,
        method="highest-ids",
        sparsity=request.sparsity,
    )


SPEC = Method("highest-ids", "drops each layer's highest-numbered experts (a test method)", EXPERTS, ("uniform",))


@pytest.fixture
def registered(monkeypatch):
    """Registered for this test only: the registry is global, and the generated docs list its entries."""
    from dataclasses import replace

    monkeypatch.setitem(METHODS._specs, SPEC.name, replace(SPEC, fn=highest_ids_plan))


def test_a_method_registered_in_one_file_prunes_saves_and_reloads(registered, tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    config = PruneConfig(criterion="aimer", sparsity=0.25, method="highest-ids")
    report = prune_checkpoint(PruneRequest(tiny_checkpoint, out, config, run=RunOptions(progress=False)))
    assert report["method"] == "highest-ids" and report["format"] == "stock"
    plan = Plan.load(out / "plan.json")
    assert all(lp.dropped == [6, 7] for lp in plan.layers)  # 8 experts per layer, 25 % dropped
    original, pruned = moeprune.load_pretrained(tiny_checkpoint), moeprune.load_pretrained(out)
    for before, after in zip(original.model.layers, pruned.model.layers):
        kept = before.mlp.experts.gate_up_proj[:6]
        assert torch.equal(after.mlp.experts.gate_up_proj, kept)
        assert torch.equal(after.mlp.gate.weight, before.mlp.gate.weight[:6])
    assert (out / "recipe.json").is_file() and (out / "README.md").is_file()
