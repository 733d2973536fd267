"""EvoESAP over mixed genes (`--method mixed --allocation evo`): the exact budget for every
candidate, the single-surgery seeds in generation 0, a winner at least as fit as each seed,
resume = an uninterrupted run, the virtual candidate = physical surgery, bad input refused.

The tiny models have 2 MoE layers of 8 experts, top-2, 16 neurons, hidden 32: an expert holds
1536 parameters (96 per neuron), so T = 24576 routed parameters.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_novice import logits
from test_observe import calibration
from test_search import _data

from helpers import assert_logits_close
from moeprune.allocate.limits import layer_limits
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.criteria.super_experts import protected_order
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.mixed_search import search_mixed
from moeprune.search.mixed_space import MixedSpace, as_genes
from moeprune.search.options import SearchRuntime
from moeprune.surgery.mixed import MixedOptions, layer_costs, mixed_plan
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import build_plan, check_config
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.registry import PlanRequest

pytestmark = pytest.mark.integration
ROW, TOTAL = 96, 24576
SMALL = SearchConfig(population=8, elites=2, generations=3, seed=3)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def setup(request):
    model = tiny_model(request.param)
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    return model, moe, stats


def _config(sparsity: float, **search) -> PruneConfig:
    return PruneConfig("reap", sparsity, method="mixed", allocation="evo", search=replace(SMALL, **search))


def _search(moe, stats, sparsity, tmp_path=None, resume=False, **search):
    runtime = SearchRuntime(
        progress=False, state_path=None if tmp_path is None else tmp_path / "state.json", resume=resume
    )
    return search_mixed(
        moe, get_criterion("reap"), compute_scores("reap", stats=stats), [stats], _data(),
        config=check_config(_config(sparsity, **search)), runtime=runtime,
    )  # fmt: skip


@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_every_candidate_meets_the_budget_and_seeds_lead(setup, sparsity):
    """Seeds and 200 mutants: the kept routed parameters are within half a neuron row of (1 - s) T."""
    _, moe, stats = setup
    limits = layer_limits(moe)
    space = MixedSpace(layer_costs(moe, limits), limits.layers, sparsity)
    seeds = space.seeds(limits, MixedOptions())
    assert {"drop", "novice", "tenp", "neurons"} <= set(seeds)
    rng = np.random.Generator(np.random.PCG64(0))
    population = space.initial(list(seeds.values()), SMALL, rng)
    assert population[: len(seeds)] == list(seeds.values())  # generation 0 starts with the seeds
    request = PlanRequest(
        moe, get_criterion("reap"), protected_order(compute_scores("reap", stats=stats), moe.protected),
        sparsity, "evo", "mixed", stats=[stats],
    )  # fmt: skip
    candidates, parent = list(population), population[0]
    for _ in range(200):
        parent = space.mutate(parent, SMALL, rng)
        candidates.append(parent)
    assert len(set(candidates)) > 20  # the moves do move
    for cand in set(candidates):
        plan = mixed_plan(request, as_genes(cand))
        kept = plan_routed_parameters(moe, plan)["routed_experts"]
        assert abs(kept - (1 - sparsity) * TOTAL) <= ROW / 2, cand


def test_winner_at_least_each_seed_and_resume_is_exact(setup, tmp_path):
    _, moe, stats = setup
    genes, doc = _search(moe, stats, 0.5)
    for name, seed in doc["seeds"].items():
        assert doc["fitness_value"] >= seed["fitness_value"], name
    assert doc["generations"][0]["fitnesses"][: len(doc["seeds"])] == [
        s["fitness_value"] for s in doc["seeds"].values()
    ]
    # interrupted after 2 generations, resumed to 3: the same winner and history
    _search(moe, stats, 0.5, tmp_path, generations=2)
    resumed, doc2 = _search(moe, stats, 0.5, tmp_path, resume=True)
    assert resumed == genes and doc2["fitness_value"] == doc["fitness_value"]
    assert [g["fitnesses"] for g in doc2["generations"]] == [g["fitnesses"] for g in doc["generations"]]


def test_virtual_candidate_equals_physical_surgery(setup):
    """The evaluator's virtual form of a mutated candidate and the physically pruned model give
    the same logits; the evaluator's fast path (prefix cache keyed by filled widths) = plain."""
    model, moe, stats = setup
    limits = layer_limits(moe)
    space = MixedSpace(layer_costs(moe, limits), limits.layers, 0.5)
    rng = np.random.Generator(np.random.PCG64(1))
    cand = space.mutate(space.seeds(limits, MixedOptions())["tenp"], SMALL, rng)
    config = PruneConfig("reap", 0.5, method="mixed", allocation="evo")
    scores = compute_scores("reap", stats=stats)
    plan = build_plan(moe, get_criterion("reap"), scores, config=config, stats=[stats], removed=list(cand))
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    pruned = copy.deepcopy(model)
    apply_plan_physical(MoEModel(pruned), plan, stats)
    assert_logits_close(logits(pruned), virtual)
    assert routed_parameters(MoEModel(pruned))["routed_experts"] == plan.extra["routed_parameters_kept"]
    request = PlanRequest(
        moe, get_criterion("reap"), protected_order(scores, moe.protected), 0.5, "evo", "mixed", stats=[stats]
    )
    values = []
    for fast in (True, False):
        ev = CandidateEvaluator(
            moe, _data(), [s.order for s in request.scores],
            runtime=SearchRuntime(progress=False, fast=fast),
            plan_context=lambda c: virtual_plan(moe, mixed_plan(request, as_genes(c)), stats),
            prefix_key=space.prefix_key,
        )  # fmt: skip
        values.append([ev.evaluate(c) for c in (cand, space.seeds(limits, MixedOptions())["drop"], cand)])
    assert values[0] == pytest.approx(values[1], abs=1e-5)
    assert torch.isfinite(torch.tensor(values[0])).all()


def test_mixed_with_a_fixed_allocation_is_refused_in_one_line():
    with pytest.raises(MoePruneError, match="mixed method goes with the uniform or evo or gradient allocation"):
        check_config(PruneConfig("reap", 0.5, method="mixed", allocation="trapezoid"))


def test_low_rank_search_scores_what_is_saved():
    """--novice-rank 4 (a novice: 32 x 9 = 288 parameters): every expert is fitted once before the
    search; the winner's search fitness equals its final plan's, evaluated afresh with the plan's
    novices (taken from those fits, and equal to a refit of the plan's novices alone). The novice
    seed pays the rank-4 cost: at 50 % round(6144 / (1536 - 288)) = 5 novices per layer, 12096 of
    12288 kept, so the repair narrows one of them: 9 novices (rank 0: 4 per layer, over the
    budget, a whole expert narrowed: 8)."""
    from moeprune.surgery.lowrank import fit_every_novice, fit_novices

    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    data = calibration((20, 17, 15, 12))
    stats = observe(moe, data, batch_size=2, neurons=True, progress=False)
    limits = layer_limits(moe)
    novices = {
        rank: sum(g[2] for g in MixedSpace(layer_costs(moe, limits, rank), limits.layers, 0.5).seeds(
            limits, MixedOptions(novice_rank=rank))["novice"])
        for rank in (0, 4)
    }  # fmt: skip
    assert novices == {0: 8, 4: 9}
    every = fit_every_novice(moe, 4, [data], batch_size=2, progress=False)
    assert {i: len(f) for i, f in every.items()} == {m.index: 8 for m in moe.layers}
    config = check_config(replace(_config(0.5), options={"novice_rank": 4}))
    scores = compute_scores("reap", stats=stats)
    for unchecked in (config, replace(_config(0.5), options={"novice_rank": 4})):  # a script's dict too
        with pytest.raises(MoePruneError, match="fit every expert first"):
            search_mixed(moe, get_criterion("reap"), scores, [stats], _data(), config=unchecked)
    runtime = SearchRuntime(progress=False)
    genes, doc = search_mixed(
        moe, get_criterion("reap"), scores, [stats], _data(), config=config, runtime=runtime, novices=every
    )
    assert doc["novice_rank"] == 4 and doc["novice_moments_bytes"] == 16 * 32**2 * 16
    # the winner and the novice seed (a winner on random weights may have no novice): each one's
    # search fitness is its saved plan's, evaluated afresh
    for cand, value in (
        (genes, doc["fitness_value"]),
        *[(g["genes"], g["fitness_value"]) for g in [doc["seeds"]["novice"]]],
    ):
        plan = build_plan(moe, get_criterion("reap"), scores, config=config, stats=[stats], removed=cand)
        assert plan.extra["novice_rank"] == 4
        fits = fit_novices(moe, plan, [data], fitted=every)
        refit = fit_novices(moe, plan, [data], batch_size=2, progress=False)
        for index, by_id in fits.items():
            for e, f in by_id.items():
                assert f is every[index][e]
                other = refit[index][e]
                for a, b in zip((f.constant, f.u, f.v), (other.constant, other.u, other.v)):
                    torch.testing.assert_close(a, b)
        fresh = CandidateEvaluator(
            moe, _data(), [s.order for s in protected_order(scores, moe.protected)], seed=SMALL.seed,
            runtime=SearchRuntime(progress=False, fast=False),
            plan_context=lambda _, plan=plan, fits=fits: virtual_plan(moe, plan, stats, fits),
        )  # fmt: skip
        assert fresh.sign * fresh.evaluate(tuple(map(tuple, cand))) == pytest.approx(value, abs=1e-6)
        pruned = copy.deepcopy(model)
        apply_plan_physical(MoEModel(pruned), plan, stats, fits)
        assert routed_parameters(MoEModel(pruned))["routed_experts"] == plan.extra["routed_parameters_kept"]
        assert abs(plan.extra["routed_parameters_kept"] - 0.5 * TOTAL) <= ROW / 2
    assert sum(len(lp.novice) for lp in plan.layers) == 9  # the novice seed's plan
