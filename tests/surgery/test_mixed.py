"""The mixed method: whole, narrowed, novice and dropped experts in one layer under one exact budget.

The tiny models (qwen3_moe; deepseek_v3 with 2 routing groups) have 2 MoE layers of 8 experts,
top-2, 16 neurons, hidden size 32: one expert holds 3 x 32 x 16 = 1536 parameters (96 per
neuron), a novice 32, so the routed experts hold T = 2 x 8 x 1536 = 24576.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_novice import logits
from test_observe import calibration
from transformers import AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery.lowrank import check_every_novice_fits
from moeprune.surgery.mixed import LayerCosts, LayerGene, MixedOptions, fill_widths
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import build_plan, check_config, check_feasible
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves models end to end

FAMILIES = ["qwen3_moe", "deepseek_v3"]
ROW, EXPERT, NOVICE, TOTAL = 96, 1536, 32, 24576


def setup(family: str):
    model = tiny_model(family)
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)
    return model, moe, stats


def plan_of(moe, stats, sparsity: float, method: str = "mixed", **options):
    config = PruneConfig("reap", sparsity, method=method, options=options or None)
    return build_plan(
        moe, get_criterion("reap"), compute_scores("reap", stats=stats), config=config, stats=[stats]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_four_forms_in_one_layer_virtual_equals_physical_and_reload(family, tmp_path):
    """At 70 % each layer keeps 0.3 x 8 x 1536 = 3686.4: 2 whole (3072) and 1 novice (32) leave
    582.4, 1.5 experts of 4 neurons (384): 2 narrowed, 3 dropped (deepseek_v3 drops in pairs of
    groups: 3 narrowed, 2 dropped); the fill hands the remainder out one neuron each. Every layer
    holds all four forms."""
    model, moe, stats = setup(family)
    plan = plan_of(moe, stats, 0.7, mixed_whole=0.25, mixed_novice=0.125, mixed_width=0.25)
    for lp in plan.layers:
        narrowed = [e for e in lp.kept if e not in lp.novice and e in lp.neurons]
        whole = [e for e in lp.kept if e not in lp.novice and e not in lp.neurons]
        assert len(whole) == 2 and len(lp.novice) == 1 and narrowed and lp.dropped, lp
        assert len(whole) + len(narrowed) + len(lp.novice) + len(lp.dropped) == 8
    # the budget: within half a neuron row of 0.3 x T
    kept = plan_routed_parameters(moe, plan)["routed_experts"]
    assert abs(kept - 0.3 * TOTAL) <= ROW / 2 and kept == plan.extra["routed_parameters_kept"]

    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert (logits(model) - full).abs().max() == 0, "the virtual form was not undone"
    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats)
    assert_logits_close(logits(pruned), virtual)
    assert routed_parameters(pruned_moe)["routed_experts"] == kept

    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    reloaded = moeprune.load_pretrained(tmp_path)
    assert routed_parameters(MoEModel(reloaded))["routed_experts"] == kept
    assert_logits_close(logits(reloaded), virtual)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    assert_logits_close(logits(stock.eval()), virtual)


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_drop_novices_and_enp_are_points_of_the_space(family):
    """Same experts, same forms: drop at 50 % (group-balanced on deepseek_v3), novices at 50 %
    (parameter sparsity 0.5 x (1 - 32 / 1536)) and ENP at 50 % (8 of 16 neurons)."""
    _, moe, stats = setup(family)
    drop = plan_of(moe, stats, 0.5, method="drop")
    assert plan_of(moe, stats, 0.5, mixed_whole=0, mixed_width=1).layers == drop.layers
    novice = plan_of(moe, stats, 0.5, method="novice")
    mixed = plan_of(moe, stats, 0.5 * (1 - NOVICE / EXPERT), mixed_whole=0, mixed_novice=0.5, mixed_width=1)
    assert mixed.layers == novice.layers
    enp = plan_of(moe, stats, 0.5, method="neurons")
    assert plan_of(moe, stats, 0.5, mixed_whole=0).layers == enp.layers


def test_super_experts_stay_whole():
    """The least important expert of each layer, made a super expert, is whole whatever the shares."""
    _, moe, stats = setup("qwen3_moe")
    scores = compute_scores("reap", stats=stats)
    moe.protected = {s.layer: [s.order[0]] for s in scores}
    plan = plan_of(moe, stats, 0.6, mixed_whole=0, mixed_novice=0.25, mixed_width=0.5)
    for lp in plan.layers:
        (e,) = moe.protected[lp.layer]
        assert e in lp.kept and e not in lp.novice and e not in lp.neurons
        assert abs(plan_routed_parameters(moe, plan)["routed_experts"] - 0.4 * TOTAL) <= ROW / 2


def test_fill_hands_the_missing_neurons_out_most_important_first():
    """Two layers of the tiny model's costs, 1 whole + 3 narrowed at 8 neurons + 4 dropped each:
    2 x (1536 + 3 x 768) = 7680 kept. A target of 7680 + 4 x 96 + 40 is 4.42 neurons away:
    4 neurons, to each layer's first narrowed expert, then their second; a shortfall of 7 neurons
    takes 2 from each of the 6 and gives back 5 from the most important, so the least important
    narrowed expert of the last layer pays most."""
    costs = [LayerCosts(8, 16, ROW, 0, NOVICE, 2, 0, 6, 1)] * 2
    genes = [LayerGene(1, 3, 0, 4, 8)] * 2
    assert fill_widths(costs, genes, 7680 + 4 * ROW + 40) == [[9, 9, 8], [9, 9, 8]]
    assert fill_widths(costs, genes, 7680 - 7 * ROW) == [[7, 7, 7], [7, 7, 6]]
    with pytest.raises(MoePruneError, match="no expert is narrowed"):
        fill_widths(costs, [LayerGene(4, 0, 0, 4, 16)] * 2, 4 * EXPERT + ROW)


def test_unreachable_shares_are_refused_in_one_line_from_the_structure():
    meta = MoEModel(tiny_model("qwen3_moe"))
    with pytest.raises(MoePruneError, match="add up to more than every expert"):
        MixedOptions(mixed_whole=0.75, mixed_novice=0.5)

    def feasible(sparsity, **options):
        return check_feasible(
            meta, check_config(PruneConfig("reap", sparsity, method="mixed", options=options))
        )

    with pytest.raises(MoePruneError, match=r"6 whole experts and 0 novices keep more than 0\.5") as caught:
        feasible(0.5, mixed_whole=0.75)
    assert "\n" not in str(caught.value)
    with pytest.raises(MoePruneError, match="no expert is narrowed"):
        feasible(0.3, mixed_whole=0, mixed_width=1)  # 5.6 of 8 experts: not a count
    with pytest.raises(MoePruneError, match="would keep 0 of 16 neurons"):
        feasible(0.72, mixed_whole=0.25)  # 0.28 x 12288 - 2 x 1536 = 368.6 for 6 experts
    known = feasible(0.5, mixed_whole=0.25, mixed_width=0.5)
    assert known["mixed_genes"][0] == {"whole": 2, "narrowed": 4, "novice": 0, "dropped": 2, "width": 8}


def test_tenp_is_the_genes_of_its_trapezoid():
    """TENP at 50 % as genes (same criterion, so the same order): its whole counts per layer, the rest narrowed at floor(q I) neurons,
    nothing novice or dropped. Same whole experts, every width within one neuron of TENP's, and
    both plans within half a neuron row of the budget."""
    from moeprune.allocate.trapezoid import TrapezoidLayer, trapezoid_allocation
    from moeprune.models.packed import layer_cost
    from moeprune.surgery.mixed import mixed_plan
    from moeprune.surgery.registry import PlanRequest

    _, moe, stats = setup("qwen3_moe")
    tenp = plan_of(moe, stats, 0.5, method="tenp")
    layers = [TrapezoidLayer(m.num_experts, m.intermediate_size, layer_cost(m)) for m in moe.layers]
    alloc = trapezoid_allocation(layers, 0.5)
    genes = [LayerGene(c, 8 - c, 0, 0, min(ws)) for c, ws in zip(alloc.important, alloc.widths)]
    scores = compute_scores("reap", stats=stats)
    request = PlanRequest(moe, get_criterion("reap"), scores, 0.5, "uniform", "mixed", stats=[stats])
    mixed = mixed_plan(request, genes)
    for t, m in zip(tenp.layers, mixed.layers):
        assert set(t.neurons) == set(m.neurons) and t.kept == m.kept, (t, m)
        assert all(abs(t.neurons[e] - m.neurons[e]) <= 1 for e in t.neurons)
    for plan in (tenp, mixed):
        assert abs(plan_routed_parameters(moe, plan)["routed_experts"] - 0.5 * TOTAL) <= ROW / 2


RANK = 2  # a rank-2 novice of the tiny models holds 32 x (1 + 2 x 2) = 160 parameters
S_RANK = 1 - 7424 / TOTAL  # per layer 3712 kept


def test_low_rank_novices_beside_narrowed_and_dropped_experts(tmp_path):
    """--novice-rank 2 at sparsity 1 - 7424 / 24576: per layer 2 whole (3072) and 1 rank-2 novice
    (160) leave 480, 1.25 experts of 4 neurons (384): 1 narrowed, 4 dropped; the fill gives each
    layer's narrowed expert the missing neuron (2 x 96), so each layer keeps 3072 + 160 + 480 = 3712
    and the plan exactly (1 - S) x T = 7424 (rank-0 novices of 32 would leave 608: 2 narrowed).
    Masked = physical = reloaded logits, all four forms in each layer."""
    from moeprune.cli.prune import method_settings_by_name
    from moeprune.surgery.lowrank import NoviceOptions, fit_novices

    # one --novice-rank flag for both methods: the same field, validated by NoviceOptions
    assert method_settings_by_name()["novice_rank"] in __import__("dataclasses").fields(NoviceOptions)
    with pytest.raises(MoePruneError, match="non-negative"):
        MixedOptions(novice_rank=-1)
    model, moe, stats = setup("qwen3_moe")
    shares = {"mixed_whole": 0.25, "mixed_novice": 0.125, "mixed_width": 0.25}
    with pytest.raises(MoePruneError, match="larger than the hidden size"):
        check_feasible(
            moe, check_config(PruneConfig("reap", 0.5, method="mixed", options={"novice_rank": 33}))
        )
    ranked = PruneConfig("reap", S_RANK, method="mixed", options={"novice_rank": RANK, **shares})
    known = check_feasible(moe, check_config(ranked))
    assert known["mixed_genes"][0] == {"whole": 2, "narrowed": 1, "novice": 1, "dropped": 4, "width": 4}
    assert known["narrowed_neurons"] == {0: [5], 2: [5]}  # MoE layers 0 and 2
    plan = plan_of(moe, stats, S_RANK, novice_rank=RANK, **shares)
    assert plan.extra["novice_rank"] == RANK
    for lp in plan.layers:
        assert (
            len(lp.kept) == 4
            and len(lp.novice) == 1
            and len(lp.dropped) == 4
            and list(lp.neurons.values()) == [5]
        )
    kept = plan_routed_parameters(moe, plan)["routed_experts"]
    assert kept == plan.extra["routed_parameters_kept"] == 7424 == round((1 - S_RANK) * TOTAL)

    fits = fit_novices(moe, plan, [calibration((20, 17, 15, 12))], batch_size=2, progress=False)
    assert {e: f.rank for lp in plan.layers for e, f in fits[lp.layer].items()} == {
        e: RANK for lp in plan.layers for e in lp.novice
    }
    with pytest.raises(MoePruneError, match="fit them first"), virtual_plan(moe, plan, stats):
        pass
    with virtual_plan(moe, plan, stats, fits):
        virtual = logits(model)
    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats, fits)
    assert_logits_close(logits(pruned), virtual)
    assert routed_parameters(pruned_moe)["routed_experts"] == 7424
    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    reloaded = moeprune.load_pretrained(tmp_path)
    assert routed_parameters(MoEModel(reloaded))["routed_experts"] == 7424
    assert_logits_close(logits(reloaded), virtual)


def test_an_all_expert_fit_is_refused_only_when_one_layer_exceeds_memory():
    """16 d^2 bytes per routed expert, hand-counted, fitted one MoE layer per pass at least: refused
    one byte short of the largest layer's moments, accepted at them (not at the whole model's)."""
    moe = MoEModel(tiny_model("qwen3_moe"))
    per_layer = [16 * m.hidden_size**2 * m.num_experts for m in moe.layers]
    assert len(per_layer) > 1 and per_layer[0] == 16 * 32**2 * 8
    check_every_novice_fits(moe, 2, memory=max(per_layer))
    check_every_novice_fits(moe, 0, memory=1)  # rank 0 fits nothing
    with pytest.raises(
        MoePruneError, match=r"--novice-rank 2 .* one MoE layer per pass .* more than this machine's"
    ) as err:
        check_every_novice_fits(moe, 2, memory=max(per_layer) - 1)
    assert set(err.value.options) == {"novice_rank", "allocation"}


def test_every_novice_fitted_in_passes_that_fit_memory_equals_one_pass(monkeypatch):
    """Memory for one layer's moments: one calibration pass per MoE layer (each observing the fit
    share, then the held-out share of the samples), giving the very fits (bit for bit) of the
    single pass; memory for both layers: one pass."""
    from moeprune.surgery import lowrank

    moe = MoEModel(tiny_model("qwen3_moe"))
    data = calibration((20, 17, 15, 12))
    one_layer = 16 * 32**2 * 8
    layers = [m.index for m in moe.layers]
    assert len(layers) == 2 and lowrank.layer_passes(moe, None) == [layers]
    assert lowrank.layer_passes(moe, 2 * one_layer) == [layers]
    assert lowrank.layer_passes(moe, 2 * one_layer - 1) == [[i] for i in layers]
    whole = lowrank.fit_every_novice(moe, 3, [data], batch_size=2, progress=False, memory=None)
    calls = []
    observe = lowrank.observe_moments
    monkeypatch.setattr(
        lowrank, "observe_moments", lambda m, s, t, **k: calls.append(sorted(t)) or observe(m, s, t, **k)
    )
    split = lowrank.fit_every_novice(moe, 3, [data], batch_size=2, progress=False, memory=one_layer)
    assert calls == [[i] for i in layers for _share in ("fit", "held out")]
    assert whole.keys() == split.keys() and all(whole[i].keys() == split[i].keys() for i in whole)
    for i in whole:
        for e, fit in whole[i].items():
            for a, b in zip(
                (fit.constant, fit.u, fit.v), (split[i][e].constant, split[i][e].u, split[i][e].v)
            ):
                assert torch.equal(a, b)
