"""drop --reroute next|none: where a removed expert's picks go.

`next` (the default) re-routes over the survivors; `none` keeps the full model's routing and
gates and leaves the removed expert's pick empty (a zero novice)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_novice import logits
from transformers import AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close, run_cli
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.packed import router_count
from moeprune.models.routed import RoutedOptions, RoutedRows, override_routed
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.drop import DropOptions
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.registry import METHODS

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end


def drop_plan(moe: MoEModel, reroute: str | None, sparsity: float = 0.25) -> Plan:
    scores = compute_scores(
        "random",
        seed=1,
        layers=[m.index for m in moe.layers],
        num_experts=[m.num_experts for m in moe.layers],
    )
    options = None if reroute is None else {"reroute": reroute}
    return build_plan(
        moe, get_criterion("random"), scores, config=PruneConfig("random", sparsity, options=options)
    )


# softmax with renormalisation, softmax without, sigmoid + renormalisation + group-limited (DeepSeek-V3),
# softmax group-limited (DeepSeek-V2), sigmoid on the expert input (Llama-4)
KINDS = ["qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "llama4_text"]


@pytest.mark.parametrize("family", KINDS)
def test_none_virtual_equals_physical_and_loads_in_moeprune_and_stock_transformers(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    plan = drop_plan(moe, "none", sparsity=0.5)
    assert plan.extra["reroute"] == "none" and all(lp.novice and not lp.dropped for lp in plan.layers)
    full = logits(model)
    with virtual_plan(moe, plan):  # no statistics: the vectors are zero
        virtual = logits(model)
    assert (logits(model) - full).abs().max() == 0, "the virtual form was not undone"
    assert (virtual - full).abs().max() > 1e-4, "removing experts changed nothing"
    with virtual_plan(moe, drop_plan(moe, "next", sparsity=0.5)):
        rerouted = logits(model)
    assert (virtual - rerouted).abs().max() > 1e-4, "none and next are the same computation"

    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    routers = [m.router for m in pruned_moe.layers]
    apply_plan_physical(pruned_moe, plan)
    assert_logits_close(logits(pruned), virtual)
    assert all(m.router is r for m, r in zip(pruned_moe.layers, routers))  # every router row stays
    assert [router_count(m) for m in pruned_moe.layers] == [lp.num_experts for lp in plan.layers]
    # each removed expert keeps one zero d-vector: its weights are gone, d values stay
    after = routed_parameters(pruned_moe)
    assert after["routed_experts"] == plan_routed_parameters(moe, plan)["routed_experts"]
    for layer, lp in zip(pruned_moe.layers, plan.layers):
        assert torch.count_nonzero(layer.experts.moeprune_novice) == 0
        assert tuple(layer.experts.moeprune_novice.shape) == (len(lp.novice), layer.hidden_size)

    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    assert_logits_close(logits(moeprune.load_pretrained(tmp_path)), virtual)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    assert_logits_close(logits(stock.eval()), virtual)


def test_next_plans_are_what_they_were():
    """`next` is the default: its plan is the one drop made before the option existed (no key)."""
    moe = MoEModel(tiny_model("deepseek_v3"))
    default, named = drop_plan(moe, None), drop_plan(moe, "next")
    assert default.layers == named.layers and "reroute" not in named.extra
    assert all(lp.dropped and not lp.novice for lp in named.layers)


def _one_token_gates(family: str, renorm: bool, reroute: str) -> tuple[dict[int, float], dict[int, float]]:
    """Remove original expert 0 of the first MoE layer, whose router scores one token
    [2, 1, 0, -1, ...]; returns {original expert: applied gate} of that token, and
    {original expert: |its output|}, from moeprune's routed computation."""
    model = tiny_model(family, norm_topk_prob=renorm)
    moe = MoEModel(model)
    layer = moe.layers[0]
    n, d = layer.num_experts, layer.hidden_size
    with torch.no_grad():
        weight = layer.router.weight
        weight.zero_()
        weight[:, 0] = torch.tensor([2.0 - e for e in range(n)])
    removed = [[0] if m is layer else [] for m in moe.layers]
    plan = Plan.from_removals(
        ModelShape.of(moe), removals=removed, criterion="random", allocation="uniform", sparsity=0.125,
        novices=reroute == "none",
    )  # fmt: skip
    if reroute == "none":
        plan.extra["reroute"] = "none"
    apply_plan_physical(moe, plan)
    seen: list[RoutedRows] = []
    hidden = torch.zeros(1, 1, d)
    hidden[0, 0, 0] = 1.0
    with override_routed(moe, RoutedOptions(on_layer=lambda _, rows: seen.append(rows))), torch.no_grad():
        layer.block(hidden)
    rows = seen[0]
    ids = [layer.expert_ids[int(p)] for p in rows.experts]
    gates = dict(zip(ids, rows.weights.tolist()))
    norms = dict(zip(ids, rows.outputs.norm(dim=1).tolist()))
    return gates, norms


@pytest.mark.parametrize(("family", "renorm"), [("qwen3_moe", True), ("qwen3_moe", False), ("olmoe", False)])
def test_gates_of_one_token_by_hand(family, renorm):
    """Scores [2, 1, 0, -1, -2, ...], top-2, expert 0 removed.
    none: the picks stay {0, 1} with the full model's gates; expert 0 adds nothing.
    next: the picks are {1, 2}, gated by the softmax over the survivors."""
    e = math.e
    everything = sum(math.exp(2.0 - k) for k in range(8))  # the full softmax's denominator
    survivors = everything - e**2
    if renorm:  # renormalised over the top-k
        none = {0: e**2 / (e**2 + e), 1: e / (e**2 + e)}
        next_ = {1: e / (e + 1), 2: 1 / (e + 1)}
    else:  # the softmax's own values
        none = {0: e**2 / everything, 1: e / everything}
        next_ = {1: e / survivors, 2: 1 / survivors}
    gates, norms = _one_token_gates(family, renorm, "none")
    assert gates == pytest.approx(none, rel=1e-5)
    assert norms[0] == 0 and norms[1] > 0  # the empty pick adds nothing, the survivor runs
    gates, _ = _one_token_gates(family, renorm, "next")
    assert gates == pytest.approx(next_, rel=1e-5)


def test_none_keeps_routing_for_budget_size_and_pipelines():
    """`none` needs no group balance (routing is unchanged), counts a vector per removed expert
    in size planning, and is not a whole-expert drop (no-load, kept quantization refuse it)."""
    drop = METHODS.get("drop")
    assert not drop.configured(None).keeps_routing and drop.configured(None) is drop
    none = drop.configured({"reroute": "none"})
    assert none.keeps_routing and not none.whole_experts and drop.whole_experts
    assert drop.described({"reroute": "none"}) == "the drop method (--reroute none)"
    with pytest.raises(MoePruneError, match="reroute must be one of next, none"):
        DropOptions(reroute="skip")
    # DeepSeek-V3's 2 groups of 4: a next drop removes the same count from each group, none need not
    moe = MoEModel(tiny_model("deepseek_v3"))
    for layer in drop_plan(moe, "none", sparsity=0.375).layers:
        assert len(layer.novice) == 3  # an odd count: only possible without group balance
    for layer in drop_plan(moe, "next", sparsity=0.375).layers:  # the same budget, group-balanced
        assert len([e for e in layer.dropped if e < 4]) == len([e for e in layer.dropped if e >= 4])


def test_a_search_applies_none_candidates_as_the_plan_does():
    """evo scores `none` candidates in the form the result will have: zero novices, routing kept;
    `next` candidates keep the plain expert mask (no context of their own)."""
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    drop = METHODS.get("drop")
    assert drop.search_context(moe, None, {"reroute": "next"}) is None
    context = drop.search_context(moe, None, {"reroute": "none"})
    plan = drop_plan(moe, "none")
    removed = {lp.layer: [moe.layer(lp.layer).expert_ids.index(e) for e in lp.novice] for lp in plan.layers}
    with context(removed):
        searched = logits(model)
    with virtual_plan(moe, plan):
        planned = logits(model)
    assert (searched - planned).abs().max() == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--method", "novice", "--reroute", "none"), "--reroute"),
        (
            ("--reroute", "none", "--no-load"),
            "the drop method (--reroute none) with the uniform allocation needs",
        ),
        (("--reroute", "sideways"), "sideways"),
    ],
)
def test_refusals_in_one_line_before_loading(tiny_checkpoint, tmp_path, flags, message):
    out = tmp_path / "out"
    done = run_cli(
        "prune",
        tiny_checkpoint,
        "--output",
        out,
        "--criterion",
        "random",
        "--sparsity",
        "0.25",
        *flags,
        ok=False,
    )
    assert done.exit_code == 2, done.output
    assert message in done.output and len(done.output.strip().splitlines()) == 1, done.output
    assert not out.exists()


def test_the_command_line_prunes_with_none_and_says_so(tiny_checkpoint, tmp_path):
    """`moeprune prune --reroute none`: moeprune's format, plan and report name it, and the result
    computes the plan's virtual form on the reference."""
    out = tmp_path / "out"
    done = run_cli("prune", tiny_checkpoint, "--output", out, "--criterion", "random", "--sparsity", "0.25",
                   "--reroute", "none", "--quiet")  # fmt: skip
    assert "method drop --reroute none" in done.output
    report = json.loads((out / "report.json").read_text())
    assert report["reroute"] == "none" and report["format"] == "moeprune"
    plan = Plan.load(out / "plan.json")
    assert plan.extra["reroute"] == "none" and all(len(lp.novice) == 2 for lp in plan.layers)
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with virtual_plan(MoEModel(reference), plan):
        expected = logits(reference)
    assert_logits_close(logits(moeprune.load_pretrained(out)), expected)
