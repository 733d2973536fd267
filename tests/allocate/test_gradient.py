"""The gradient allocation: per-expert keep logits trained against the full model, projected onto
the exact budget with its per-layer floor (hand-checkable models whose best plan is known)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import run_cli
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.allocate.projection import project_budget
from moeprune.config import SearchConfig
from moeprune.data.loading import CalibrationData, Sample
from moeprune.errors import InfeasibleBudgetError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.search.gradient import run_gradient_search
from moeprune.search.options import SearchRuntime
from moeprune.surgery.drop import zero_context

pytestmark = pytest.mark.integration

VOCAB = 96
QUICK = SearchConfig(steps=40, learning_rate=0.2, temperature=1.0, temperature_end=0.2, seed=3)


def _data(n: int = 6) -> CalibrationData:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(n):
        length = int(torch.randint(10, 16, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        samples.append(Sample(ids, [False] * 4 + [True] * (length - 4), "mem", False))
    return CalibrationData(samples, "fp", 0, False, ["mem"])


def _model_with_useless(useless: dict[int, list[int]]) -> MoEModel:
    """Two MoE layers of 8 experts (top-2); the `useless` experts' down_proj is zero, so they add
    nothing: a plan that drops them (routing kept) leaves every logit as it was. (Seed 7: on the
    search data every expert is picked at least 7 times, so no other expert is free to drop.)"""
    moe = MoEModel(tiny_model("qwen3_moe", seed=7, vocab_size=VOCAB, num_hidden_layers=2, mlp_only_layers=[]))
    with torch.no_grad():
        for layer in moe.layers:
            for e in useless.get(layer.index, []):
                layer.experts.down_proj[e].zero_()
    return moe


def _adversarial_orders(moe: MoEModel, useless: dict[int, list[int]]) -> list[list[int]]:
    """Pruning orders that put the useless experts last: the starting logits favour keeping them."""
    out = []
    for layer in moe.layers:
        bad = useless.get(layer.index, [])
        out.append([e for e in range(layer.num_experts) if e not in bad] + bad)
    return out


def _search(moe, useless, budget, config=QUICK, **kwargs):
    return run_gradient_search(
        moe,
        _data(),
        _adversarial_orders(moe, useless),
        budget,
        config=config,
        runtime=SearchRuntime(progress=False, batch_size=3, candidate_context=zero_context(moe)),
        **kwargs,
    )


def test_finds_exactly_the_useless_experts_at_the_matching_budget():
    useless = {0: [0, 1], 1: [1, 4]}
    moe = _model_with_useless(useless)
    dropped, doc = _search(moe, useless, budget=4)
    assert dropped == [[0, 1], [1, 4]]
    assert doc["allocation"] == [2, 2] and sum(doc["allocation"]) == doc["budget"] == 4
    # dropped with their routing kept (--reroute none), they change nothing: ESAP is 1
    assert doc["fitness_value"] == pytest.approx(1.0, abs=1e-6)
    assert doc["fitness_value"] > doc["uniform"]["fitness_value"]  # the criterion's uniform plan
    assert len(doc["training"]) == QUICK.steps


def test_budget_exact_with_the_floor_where_the_useless_experts_sit_in_one_layer():
    # 7 useless experts in layer 0: dropping them all would leave 1 < top-k = 2 there
    useless = {0: [0, 1, 2, 3, 4, 5, 6]}
    moe = _model_with_useless(useless)
    dropped, doc = _search(moe, useless, budget=7)
    assert [len(d) for d in dropped] == [6, 1]  # the floor: layer 0 keeps top-k experts
    assert set(dropped[0]) <= set(useless[0])
    assert sum(doc["allocation"]) == 7


def test_super_experts_are_kept():
    useless = {0: [0, 1], 1: [1, 4]}
    moe = _model_with_useless(useless)
    moe.protected = {0: [1]}  # a super expert that would otherwise be dropped first
    dropped, doc = _search(moe, useless, budget=4)
    assert 1 not in dropped[0]
    assert sum(len(d) for d in dropped) == 4
    assert set(dropped[1]) >= {1, 4} and 0 in dropped[0]


def test_deterministic_under_a_seed():
    useless = {0: [0, 1], 1: [1, 4]}
    config = SearchConfig(steps=5, seed=11)
    first = _search(_model_with_useless(useless), useless, 4, config)
    second = _search(_model_with_useless(useless), useless, 4, config)
    assert first[0] == second[0]
    assert first[1]["keep_logits"] == second[1]["keep_logits"]
    assert first[1]["training"] == second[1]["training"]


def _limits(groups: int, caps: list[int], multiples: list[int], n: int = 8) -> LayerLimits:
    layers = len(caps)
    return LayerLimits(
        layers=list(range(layers)),
        num_experts=[n] * layers,
        top_k=[2] * layers,
        caps=caps,
        groups=[groups] * layers,
        multiples=multiples,
        fixed=[c == 0 for c in caps],
    )


def test_projection_by_hand():
    scores = [np.array([5, 0, 4, 1, 7, 8, 2, 9.0]), np.array([3, 3, 0.5, 6, 6, 6, 6, 6.0])]
    # no groups: the 3 lowest over both layers (0 in layer 0, 0.5 in layer 1, 1 in layer 0)
    assert project_budget(scores, _limits(1, [6, 6], [1, 1]), 3) == [[1, 3], [2]]
    # the floor (cap 1 in layer 0): 1 in layer 0 is past it, so 3 in layer 1 (expert 0: the lower id)
    assert project_budget(scores, _limits(1, [1, 6], [1, 1]), 3) == [[1], [0, 2]]
    # two groups [0..3] and [4..7], balanced: layer 0 loses its lowest of each group (0 and 2)
    assert project_budget(scores, _limits(2, [6, 6], [2, 2]), 2) == [[1, 6], []]
    # a protected expert is never chosen, a fixed layer (cap 0) loses nothing
    assert project_budget(scores, _limits(1, [6, 0], [1, 1]), 2, {0: [1]}) == [[3, 6], []]
    with pytest.raises(InfeasibleBudgetError, match="exactly 13"):
        project_budget(scores, _limits(1, [6, 6], [1, 1]), 13)


def test_projection_on_a_group_limited_model_keeps_groups_balanced():
    moe = MoEModel(tiny_model("deepseek_v3", vocab_size=VOCAB))
    limits = layer_limits(moe)
    rng = np.random.default_rng(0)
    scores = [rng.normal(size=n) for n in limits.num_experts]
    budget = sum(limits.multiples)  # one step in every layer: some other split is as possible
    dropped = project_budget(scores, limits, budget)
    assert sum(len(d) for d in dropped) == budget
    for d, n, g, cap in zip(dropped, limits.num_experts, limits.groups, limits.caps):
        size = n // g
        per_group = [sum(1 for e in d if e // size == k) for k in range(g)]
        assert len(set(per_group)) == 1 and len(d) <= cap


def test_cli_writes_a_gradient_result(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    run_cli(
        "prune", tiny_checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.25",
        "--allocation", "gradient", "--data", data, "--search-data", data, "--search-samples", "6", "--samples", "8",
        "--gradient-steps", "3", "--quiet",
    )  # fmt: skip
    search = json.loads((out / "search.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert search["allocation_method"] == "gradient" and len(search["training"]) == 3
    assert sum(search["allocation"]) == search["budget"] == 8  # 25 % of 4 layers x 8 experts
    planned = {str(layer["layer"]): sorted(layer["dropped"]) for layer in plan["layers"]}
    assert planned == {k: sorted(v) for k, v in search["dropped"].items()}
    report = json.loads((out / "report.json").read_text())
    assert report["allocation"] == "gradient" and report["search"]["steps"] == 3
    refused = run_cli(
        "prune", tiny_checkpoint, "--output", tmp_path / "x", "--criterion", "frequency", "--sparsity", "0.25",
        "--allocation", "gradient", "--data", data, "--search-data", data, "--population", "4", ok=False,
    )  # fmt: skip
    assert refused.exit_code == 2 and "--population has no effect without --allocation evo" in refused.output
