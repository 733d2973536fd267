"""The gradient allocation of mixed plans (`--method mixed --allocation gradient`): per-expert form
logits, the exact parameter budget with the per-layer floor at every step, a hand-checkable model
whose best plan is known, the saved plan = the trained one (masked = physical), refusals.

The tiny models have 2 MoE layers of 8 experts, top-2, 16 neurons, hidden 32: an expert holds
1536 parameters (96 per neuron), a constant novice 32, so T = 24576 routed parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from test_novice import logits
from test_observe import calibration
from test_search import _data

from helpers import assert_logits_close, run_cli
from moeprune.allocate.limits import layer_limits
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import LayerScores, compute_scores, get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.search.form_projection import DROPPED, NOVICE, WHOLE, plan_order, project_forms
from moeprune.search.gradient_mixed import check_gradient_family, gradient_mixed_allocation
from moeprune.search.options import SearchRuntime
from moeprune.surgery.mixed import LayerCosts
from moeprune.surgery.parameters import routed_parameters
from moeprune.surgery.planning import build_plan, check_config
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = pytest.mark.integration
ROW, TOTAL = 96, 24576
QUICK = SearchConfig(steps=12, learning_rate=0.2, temperature=1.0, temperature_end=0.2, seed=3)


def _costs(protected: int = 0, cap: int = 6, multiple: int = 1) -> LayerCosts:
    return LayerCosts(8, 16, ROW, 0, 32, 2, protected, cap, multiple)


def _scores(prefer: list[int], strength: float = 5.0) -> np.ndarray:
    z = np.zeros((8, 4))
    z[np.arange(8), prefer] = strength
    return z


def _kept(costs, plan) -> int:
    return sum(
        g.whole * c.expert() + g.novice * c.novice + sum(c.expert(w) for w in ws.values())
        for c, g, ws in zip(costs, plan.genes, plan.widths)
    )


def test_projection_by_hand():
    """Layer 0 wants every expert dropped, layer 1 every expert whole, at 50 % (8 experts' worth):
    layer 0 keeps its floor (top-2 experts with weights: narrowed, the cheapest such form), so
    layer 1 narrows the one whole expert that costs least score and the 3 narrowed experts share
    the 16 neurons left (6, 5, 5): exactly the budget."""
    costs = [_costs(), _costs()]
    z = [_scores([DROPPED] * 8), _scores([WHOLE] * 8)]
    plan = project_forms(costs, z, 0.5 * TOTAL, [0, 1], [1, 1])
    assert plan.counts()[0] == {"whole": 0, "narrowed": 2, "novice": 0, "dropped": 6}
    assert plan.counts()[1] == {"whole": 7, "narrowed": 1, "novice": 0, "dropped": 0}
    assert sorted(w for ws in plan.widths for w in ws.values()) == [5, 5, 6]
    assert _kept(costs, plan) == 0.5 * TOTAL
    # a super expert (only `whole` allowed) stays whole even where dropping is wanted
    z0 = _scores([DROPPED] * 8)
    z0[3, 1:] = -np.inf
    plan = project_forms([_costs(protected=1), _costs()], [z0, z[1]], 0.5 * TOTAL, [0, 1], [1, 1])
    assert plan.forms[0][3] == WHOLE and plan.genes[0].whole >= 1
    assert abs(_kept(costs, plan) - 0.5 * TOTAL) <= ROW / 2
    # its pruning order: dropped first, then narrowed (the most filled last), whole, the super expert last
    order = plan_order(plan, 0, z0, [3])
    assert order[-1] == 3 and set(order[:6]) == set(np.flatnonzero(plan.forms[0] == DROPPED))


def test_projection_balances_routing_groups():
    """Two routing groups of 4 (drops in multiples of 2, as many from each group): experts 0, 1, 2
    (all in group 0) want to be dropped, the rest to be novices. Three drops round to four (the
    nearest multiple; 1.5 per group rounds to 2), two per group: group 0 its two of largest drop
    margin (0, 1), group 1 expert 5 (its best margin) and 4 (a tie: the lower id)."""
    z = np.zeros((8, 4))
    z[[0, 1, 2], DROPPED] = [5.0, 4.0, 3.0]
    z[3:, NOVICE] = 1.0
    z[5, DROPPED] = 0.9  # group 1's best drop margin
    costs = [_costs(cap=4, multiple=2), _costs()]
    plan = project_forms(costs, [z, _scores([WHOLE] * 8)], 0.6 * TOTAL, [0, 1], [2, 1])
    dropped = set(np.flatnonzero(plan.forms[0] == DROPPED))
    assert dropped == {0, 1, 4, 5}
    assert abs(_kept(costs, plan) - 0.6 * TOTAL) <= ROW / 2
    assert plan.genes[0].whole + plan.genes[0].narrowed >= 2


def _observed(model):
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    return moe, stats


def _config(sparsity: float, search: SearchConfig = QUICK, **options) -> PruneConfig:
    return check_config(
        PruneConfig(
            "reap", sparsity, method="mixed", allocation="gradient", search=search, options=options or None
        )
    )


def _run(moe, stats, config, scores=None):
    scores = scores or compute_scores("reap", stats=stats)
    return gradient_mixed_allocation(
        moe,
        get_criterion("reap"),
        scores,
        [stats],
        _data(),
        config=config,
        runtime=SearchRuntime(progress=False),
    )


def test_finds_the_known_best_plan():
    """Experts 0, 1 of layer 0 and 1, 4 of layer 1 output nothing (zero down_proj). At 25 % the
    best plan makes them novices (their mean output is 0: exact) and keeps the rest, less the
    4 x 32 novice parameters (1.33 neurons) shaved off one expert: ESAP ~1. The criterion's order
    ranks the useless experts first, so no seed finds it (the uniform plan keeps them whole and
    narrows 5 useful experts per layer to 9 neurons); the logits start at the best seed (ENP)."""
    useless = {0: [0, 1], 1: [1, 4]}
    model = tiny_model("qwen3_moe", seed=7, vocab_size=96, num_hidden_layers=2, mlp_only_layers=[])
    with torch.no_grad():
        for layer in MoEModel(model).layers:
            layer.experts.down_proj[useless[layer.index]] = 0
    moe, stats = _observed(model)
    scores = [
        LayerScores(s.layer, s.scores, [e for e in range(8) if e not in useless[s.layer]] + useless[s.layer])
        for s in compute_scores("reap", stats=stats)
    ]
    config = _config(0.25, SearchConfig(steps=30, learning_rate=0.3, seed=1))
    _, _, doc = _run(moe, stats, config, scores)
    for layer, ids in useless.items():
        forms = doc["forms"][str(layer)]
        assert forms["novice"] == ids and not forms["dropped"]
        assert all(w >= 15 for w in forms["narrowed"].values())  # the others (nearly) whole
    assert doc["fitness_value"] > 0.999 and doc["returned"] == "trained"
    assert doc["uniform"]["genes"] == [[3, 5, 0, 0, 9]] * 2
    assert doc["start"] == "neurons"  # the best seed on the search data: the logits' start
    assert all(seed["fitness_value"] < 0.99 for seed in doc["seeds"].values())


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def trained(request):
    """A 50 % mixed gradient run with a super expert in the first MoE layer."""
    model = tiny_model(request.param)
    moe, stats = _observed(model)
    moe.protected = {moe.layers[0].index: [5]}
    config = _config(0.5)
    genes, scores, doc = _run(moe, stats, config)
    return model, moe, stats, config, genes, scores, doc


def test_budget_and_floor_at_every_step_and_in_the_plan(trained):
    _, moe, stats, config, genes, scores, doc = trained
    assert len(doc["training"]) == QUICK.steps
    for step in doc["training"]:  # every hard plan the loss saw meets the one budget
        assert abs(step["routed_parameters_kept"] - 0.5 * TOTAL) <= ROW / 2
        assert sum(step["forms"].values()) == 16
    plan = build_plan(moe, get_criterion("reap"), scores, config=config, stats=[stats], removed=genes)
    assert plan.extra["routed_parameters_kept"] == doc["routed_parameters_kept"]
    assert abs(doc["routed_parameters_kept"] - 0.5 * TOTAL) <= ROW / 2
    for m, lp, (whole, narrowed, *_) in zip(moe.layers, plan.layers, genes):
        forms = doc["forms"][str(m.index)]
        assert whole + narrowed >= m.top_k  # the floor: top-k experts keep weights
        assert sorted(lp.dropped) == forms["dropped"] and sorted(lp.novice) == forms["novice"]
        assert lp.neurons == {int(e): w for e, w in forms["narrowed"].items() if w < m.intermediate_size}
        if m.n_group > 1:  # routing groups lose as many experts each
            size = m.num_experts // m.n_group
            assert len({sum(e // size == g for e in lp.dropped) for g in range(m.n_group)}) == 1
    assert 5 in doc["forms"][str(moe.layers[0].index)]["whole"]  # the super expert
    for key in ("fitness_value", "seeds", "start", "training", "form_logits", "timings_s", "genes", "space"):
        assert key in doc
    assert doc["allocation_method"] == "gradient" and doc["steps"] == QUICK.steps
    # the trained plan, unless the seed it started from scores higher on the search data
    start = doc["seeds"][doc["start"]]["fitness_value"]
    assert doc["fitness_value"] == max(doc["trained"]["fitness_value"], start)
    assert doc["returned"] == ("trained" if doc["trained"]["fitness_value"] >= start else doc["start"])


def test_saved_plan_is_the_scored_one(trained):
    """The plan the genes and orders save gives the same logits virtually and physically, and its
    fitness evaluated afresh is search.json's."""
    model, moe, stats, config, genes, scores, doc = trained
    plan = build_plan(moe, get_criterion("reap"), scores, config=config, stats=[stats], removed=genes)
    assert plan.allocation == "gradient"
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    pruned = copy.deepcopy(model)
    apply_plan_physical(MoEModel(pruned), plan, stats)
    assert_logits_close(logits(pruned), virtual)
    assert routed_parameters(MoEModel(pruned))["routed_experts"] == plan.extra["routed_parameters_kept"]


def test_refusals():
    moe, stats = _observed(tiny_model("qwen3_moe"))
    with pytest.raises(MoePruneError, match="needs every expert's fit first"):
        _run(moe, stats, _config(0.5, novice_rank=2))
    with pytest.raises(MoePruneError, match="lower .*the sparsity"):  # no recipe to start from
        _run(moe, stats, _config(0.999))
    # widths on a multiple: the projection fills neuron by neuron, so the search refuses them
    with pytest.raises(MoePruneError, match="multiple of 4 .* --width-multiple 1 .* --allocation evo") as err:
        _run(moe, stats, _config(0.5, width_multiple=4))
    assert set(err.value.options) == {"allocation", "width_multiple"}
    # experts the hooks cannot compute form by form (LongCat's zero experts): refused, naming evo
    moe.layers[0].spec = dataclasses.replace(moe.layers[0].spec, extra_experts=2)
    with pytest.raises(MoePruneError, match="computes differently; use --allocation evo"):
        check_gradient_family(moe, layer_limits(moe))


def test_cli_writes_a_mixed_gradient_result(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    run_cli(
        "prune", tiny_checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.5",
        "--method", "mixed", "--allocation", "gradient", "--data", data, "--search-data", data,
        "--search-samples", "6", "--samples", "8", "--gradient-steps", "2", "--quiet",
    )  # fmt: skip
    search = json.loads((out / "search.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert search["allocation_method"] == "gradient" and len(search["training"]) == 2
    for layer in plan["layers"]:
        forms = search["forms"][str(layer["layer"])]
        assert sorted(layer["dropped"]) == forms["dropped"] and sorted(layer["novice"]) == forms["novice"]
    report = json.loads((out / "report.json").read_text())
    assert report["allocation"] == "gradient" and report["method"] == "mixed"
    assert report["search"]["steps"] == 2
    # a width multiple is refused before loading, in one line, nothing written
    bad = run_cli(
        "prune", tiny_checkpoint, "--output", tmp_path / "bad", "--criterion", "frequency", "--sparsity", "0.5",
        "--method", "mixed", "--allocation", "gradient", "--width-multiple", "4", "--data", data,
        "--search-data", data, ok=False,
    )  # fmt: skip
    assert bad.exit_code == 2 and "--width-multiple 1" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "bad").exists()


def test_low_rank_novices_score_what_is_saved():
    """--novice-rank 2: the allocation takes every expert's rank-2 fit (fitted once) and the returned
    plan's fitness, evaluated afresh with its novices taken from those fits, is search.json's (the
    forward with rank-2 novice forms is checked against the plan in the next test)."""
    from moeprune.criteria.super_experts import protected_order
    from moeprune.search.candidates import CandidateEvaluator
    from moeprune.surgery.lowrank import fit_every_novice, fit_novices

    moe, stats = _observed(tiny_model("qwen3_moe"))
    every = fit_every_novice(moe, 2, [calibration((20, 17, 15, 12))], batch_size=2, progress=False)
    config = _config(0.5, SearchConfig(steps=4, seed=3), novice_rank=2)
    scores = compute_scores("reap", stats=stats)
    genes, ordered, doc = gradient_mixed_allocation(
        moe, get_criterion("reap"), scores, [stats], _data(), config=config,
        runtime=SearchRuntime(progress=False), novices=every,
    )  # fmt: skip
    assert doc["novice_rank"] == 2
    plan = build_plan(moe, get_criterion("reap"), ordered, config=config, stats=[stats], removed=genes)
    fits = fit_novices(moe, plan, [calibration((20, 17, 15, 12))], fitted=every)
    fresh = CandidateEvaluator(
        moe, _data(), [s.order for s in protected_order(scores, moe.protected)], seed=3,
        runtime=SearchRuntime(progress=False, fast=False),
        plan_context=lambda _: virtual_plan(moe, plan, stats, fits),
    )  # fmt: skip
    assert fresh.evaluate((0,)) == pytest.approx(doc["fitness_value"], abs=1e-6)


@pytest.mark.parametrize("rank", [0, 2])
def test_training_forward_is_the_plan_where_routing_is_kept(rank):
    """The forward the loss sees (every form computed, the hard one-hot picking one) gives the
    logits of the saved plan's virtual form when nothing is dropped (drops keep routing in
    training): whole, narrowed (ENP order, filled widths) and novice experts (constant, or rank-2
    fits) alike."""
    from moeprune.allocate.limits import layer_limits
    from moeprune.criteria.super_experts import protected_order
    from moeprune.search import form_training as gm
    from moeprune.surgery.lowrank import fit_every_novice
    from moeprune.surgery.mixed import layer_costs, mixed_plan
    from moeprune.surgery.registry import PlanRequest

    model = tiny_model("qwen3_moe")
    moe, stats = _observed(model)
    fits = (
        fit_every_novice(moe, rank, [calibration((20, 17, 15, 12))], batch_size=2, progress=False)
        if rank
        else None
    )
    limits = layer_limits(moe)
    costs = layer_costs(moe, limits, rank)
    z = [_scores([WHOLE, WHOLE, 1, 1, 1, NOVICE, NOVICE, 1]), _scores([1, WHOLE, NOVICE, 1, 1, 1, WHOLE, 1])]
    plan = project_forms(costs, z, 0.6 * TOTAL, limits.layers, limits.groups)  # sparsity 0.4
    assert all(c["novice"] and c["narrowed"] and not c["dropped"] for c in plan.counts())
    scores = protected_order(compute_scores("reap", stats=stats), moe.protected)
    orders = [plan_order(plan, pos, z[pos], ()) for pos in range(2)]
    request = PlanRequest(
        moe, get_criterion("reap"), [LayerScores(s.layer, s.scores, o) for s, o in zip(scores, orders)],
        0.4, "gradient", "mixed", stats=[stats], options=_config(0.4, novice_rank=rank).options,
    )  # fmt: skip
    saved = mixed_plan(request, plan.genes)
    for lp, ws, f in zip(saved.layers, plan.widths, plan.forms):  # the same forms and widths
        assert lp.novice == [int(e) for e in np.flatnonzero(f == NOVICE)] and lp.neurons == ws
    with virtual_plan(moe, saved, stats, fits):
        expected = logits(model)
    forms = gm.Forms(moe, costs, limits, [stats], "projection", fits)
    state = {"weights": {}, "masks": {}, "novices": {m.index: n for m, n in zip(moe.layers, forms.novices)}}
    hard = torch.nn.functional.one_hot(torch.from_numpy(np.concatenate(plan.forms)), 4).float()
    gm._set_state(state, moe, forms, plan, hard)
    with gm._mixed_experts(moe, limits, state):
        got = logits(model)
    assert_logits_close(got, expected)
