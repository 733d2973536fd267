"""`--method mixed` under a width multiple (`--width-multiple N`): every narrowed width a multiple
of N (the full width allowed), the budget met within half a block (N / 2 neuron rows, TENP's
sense), the evo space's seeds and mutants on the same steps, super experts whole, masked =
physical logits.

The tiny qwen3_moe has 2 MoE layers of 8 experts, top-2, 16 neurons, hidden size 32: one expert
holds 1536 parameters (96 per neuron), so T = 24576 routed parameters.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_mixed import plan_of, setup
from test_novice import logits

from helpers import assert_logits_close
from moeprune.allocate.limits import layer_limits
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.criteria.super_experts import protected_order
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.search.mixed_space import MixedSpace, as_genes
from moeprune.surgery.mixed import (
    LayerCosts,
    LayerGene,
    MixedOptions,
    fill_widths,
    mixed_plan,
    mixed_steps,
    stepped_costs,
)
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import check_config, check_feasible
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.registry import PlanRequest

pytestmark = pytest.mark.integration
ROW, NOVICE, TOTAL = 96, 32, 24576


def test_fill_hands_out_whole_blocks_within_half_a_block():
    """1 whole + 3 narrowed at 8 neurons + 4 dropped per layer keep 7680 on a step of 4. 10
    neurons short: blocks of 4 to the first narrowed expert of each layer (2 left), then one more
    (half a block still owed): 12 rows over by 2 = half a block. 7 over: the least important
    narrowed experts give back a block each (1 left short)."""
    costs = [LayerCosts(8, 16, ROW, 0, NOVICE, 2, 0, 6, 1, 4)] * 2
    genes = [LayerGene(1, 3, 0, 4, 8)] * 2
    assert fill_widths(costs, genes, 7680 + 10 * ROW) == [[12, 12, 8], [12, 8, 8]]
    assert fill_widths(costs, genes, 7680 - 7 * ROW) == [[8, 8, 4], [8, 8, 4]]
    # every narrowed expert at full width and 3 blocks still owed: refused, not silently missed
    with pytest.raises(MoePruneError, match="cannot absorb"):
        fill_widths(costs, [LayerGene(1, 3, 0, 4, 16)] * 2, 2 * (4 * 1536) + 12 * ROW)


def test_default_step_aligns_wide_experts_and_falls_back_below_one_block():
    """256-wide experts: the default step is 32 (the serving alignment); at 90 % the uniform genes'
    narrowed experts would keep 25 neurons, less than one block: step 1, as TENP falls back. An
    explicit multiple is never relaxed: refused there."""
    wide = [LayerCosts(8, 256, ROW, 0, NOVICE, 2, 0, 6, 1)] * 2
    assert mixed_steps(wide, 0.5, MixedOptions()) == [32, 32]
    assert mixed_steps(wide, 0.9, MixedOptions()) == [1, 1]
    assert mixed_steps(wide, 0.9, MixedOptions(width_multiple=32)) == [32, 32]
    meta = MoEModel(tiny_model("qwen3_moe"))
    assert mixed_steps(stepped_costs(meta, layer_limits(meta), 0.5, MixedOptions()), 0.5, MixedOptions()) == [1, 1]
    config = check_config(PruneConfig("reap", 0.25, method="mixed", options={"width_multiple": 16}))
    with pytest.raises(MoePruneError, match="less than one block of 16") as caught:
        check_feasible(meta, config)  # the full width is the only multiple of 16: nothing to narrow
    assert "\n" not in str(caught.value) and "width multiple" in str(caught.value)


@pytest.mark.parametrize(
    ("family", "sparsity", "options"),
    [
        ("qwen3_moe", 0.5, {}),
        ("qwen3_moe", 0.7, {"mixed_whole": 0.25, "mixed_novice": 0.125, "mixed_width": 0.25}),
        ("deepseek_v3", 0.7, {"mixed_whole": 0.25, "mixed_novice": 0.125, "mixed_width": 0.25}),
    ],
)
def test_uniform_widths_on_the_multiple_budget_within_half_a_block_masked_equals_physical(family, sparsity, options):
    """Every narrowed width a multiple of 4; the kept parameters = the plan's record = the
    physical model's, within 2 rows of (1 - S) T; a super expert stays whole; the virtual plan
    and the surgery compute the same logits (deepseek_v3: drops in pairs of routing groups)."""
    model, moe, stats = setup(family)
    scores = compute_scores("reap", stats=stats)
    moe.protected = {s.layer: [s.order[0]] for s in scores}  # the least important: a super expert
    plan = plan_of(moe, stats, sparsity, **options, width_multiple=4)
    assert plan.extra["width_multiple"] == {str(m.index): 4 for m in moe.layers}
    widths = [w for lp in plan.layers for w in lp.neurons.values()]
    assert widths and all(w % 4 == 0 for w in widths), widths
    for lp in plan.layers:
        (e,) = moe.protected[lp.layer]
        assert e in lp.kept and e not in lp.novice and e not in lp.neurons
    kept = plan_routed_parameters(moe, plan)["routed_experts"]
    assert kept == plan.extra["routed_parameters_kept"]
    assert abs(kept - (1 - sparsity) * TOTAL) <= 2 * ROW
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    pruned = copy.deepcopy(model)
    apply_plan_physical(MoEModel(pruned), plan, stats)
    assert routed_parameters(MoEModel(pruned))["routed_experts"] == kept
    assert_logits_close(logits(pruned), virtual)


@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_evo_seeds_and_mutants_on_the_multiple_within_half_a_block(sparsity):
    """The search space on steps of 4 (`stepped_costs`, as search_mixed builds it): seeds and 200
    mutants are feasible, their plans (mixed_plan re-derives the same steps) keep widths on the
    multiple and the budget within 2 rows."""
    _, moe, stats = setup("qwen3_moe")
    options = MixedOptions(width_multiple=4)
    limits = layer_limits(moe)
    space = MixedSpace(stepped_costs(moe, limits, sparsity, options), limits.layers, sparsity)
    seeds = space.seeds(limits, options)
    assert {"drop", "tenp", "neurons"} <= set(seeds)
    config = SearchConfig(population=8, elites=2, generations=3, seed=3)
    rng = np.random.Generator(np.random.PCG64(0))
    candidates = list(space.initial(list(seeds.values()), config, rng))
    parent = candidates[0]
    for _ in range(200):
        parent = space.mutate(parent, config, rng)
        candidates.append(parent)
    assert len(set(candidates)) > 20
    request = PlanRequest(
        moe, get_criterion("reap"), protected_order(compute_scores("reap", stats=stats), moe.protected),
        sparsity, "evo", "mixed", stats=[stats], options=options,
    )  # fmt: skip
    narrowed = set()
    for cand in set(candidates):
        assert all(g[4] % 4 == 0 or g[4] == 16 for g in cand), cand
        plan = mixed_plan(request, as_genes(cand))
        widths = {w for lp in plan.layers for w in lp.neurons.values()}
        assert all(w % 4 == 0 for w in widths), (cand, widths)
        narrowed |= widths
        assert abs(plan_routed_parameters(moe, plan)["routed_experts"] - (1 - sparsity) * TOTAL) <= 2 * ROW, cand
    assert len(narrowed) > 1  # the search does move widths, a block at a time
