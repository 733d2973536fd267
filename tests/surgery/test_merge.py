"""The merge method (REAM-style): hand-computed distances, a known neuron permutation recovered,
the saliency-weighted average, virtual == physical per layout kind, stock and moeprune-format
results that reload, the search's virtual form, super experts kept singletons, and refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_observe import calibration

import moeprune
from helpers import assert_logits_close, run_cli, stock_from_pretrained
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.observe.stats import PROBE_TOKENS, LayerStats
from moeprune.surgery.merge import merge_context, swapped_weights
from moeprune.surgery.merging import (
    LayerMerger,
    align_neurons,
    assign_groups,
    expert_distance,
    expert_tensors,
    group_weights,
    permuted,
    reap_saliency,
    weighted_average,
)
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves and reloads models

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def merge_plan(moe: MoEModel, stats, sparsity: float = 0.5, allocation: str = "uniform"):
    config = PruneConfig("reap", sparsity, method="merge", allocation=allocation)
    return build_plan(
        moe, get_criterion("reap"), compute_scores("reap", stats=stats), config=config, stats=[stats]
    )


# ----------------------------------------------------------------------------- hand-computed numbers
def test_distance_is_the_hand_computed_one():
    # gated outputs: e0 = (1, 0), e1 = (0, 1) (cos 0), e2 = (-2, 0) (cos -1 with e0)
    gated = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-2.0, 0.0]])
    # router columns over 2 tokens: e0 (0.6, 0.8), e1 (0.6, 0.8) (cos 1), e2 (1, 0) (cos 0.6 with both)
    columns = torch.tensor([[0.6, 0.6, 1.0], [0.8, 0.8, 0.0]])
    d = expert_distance(gated, columns)
    # d = 1 - ((cos_out + 1) / 2 + cos_route) / 2
    expected = torch.tensor(
        [
            [0.0, 1 - (0.5 + 1) / 2, 1 - (0.0 + 0.6) / 2],
            [1 - (0.5 + 1) / 2, 0.0, 1 - (0.5 + 0.6) / 2],
            [1 - (0.0 + 0.6) / 2, 1 - (0.5 + 0.6) / 2, 0.0],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(d, expected, atol=1e-12)
    # the removed e2 joins e1 (0.45) rather than e0 (0.7); a singleton takes no member
    assert assign_groups(d, kept=[0, 1], removed=[2]) == ({1: [2]}, [])
    assert assign_groups(d, kept=[0, 1], removed=[2], singletons=[1]) == ({0: [2]}, [])
    assert assign_groups(d, kept=[1], removed=[0, 2], singletons=[1]) == ({}, [0, 2])


def test_saliency_is_reap_with_one_gate_factor_and_weights_the_average():
    stats = LayerStats.zeros(0, 3, 2, 4)
    stats.count[:] = torch.tensor([4.0, 2.0, 0.0])
    stats.weighted_norm_sum[:] = torch.tensor([2.0, 3.0, 0.0])  # sum g ||E(h)||: one g per token
    saliency = reap_saliency(stats)
    assert saliency.tolist() == [0.5, 1.5, 0.0]
    assert group_weights(saliency, [0, 1]).tolist() == [0.25, 0.75]
    assert group_weights(saliency, [2]).tolist() == [1.0]  # never routed: equal weights
    a = {"w": torch.full((2, 3), 4.0), "b": torch.tensor([1.0, -1.0])}
    b = {"w": torch.full((2, 3), 8.0), "b": torch.tensor([3.0, 3.0])}
    out = weighted_average([a, b], group_weights(saliency, [0, 1]))
    assert torch.equal(out["w"], torch.full((2, 3), 7.0)) and out["b"].tolist() == [2.5, 2.0]


def test_hungarian_alignment_recovers_a_known_permutation():
    cost = torch.tensor([[5.0, 0.0, 9.0], [9.0, 5.0, 0.0], [0.0, 9.0, 5.0]])
    assert align_neurons(cost).tolist() == [1, 2, 0]  # slot k takes member neuron perm[k]

    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17)), batch_size=2, progress=False)
    layer = moe.layers[0]
    width = layer.intermediate_size
    shuffle = torch.randperm(width, generator=torch.Generator().manual_seed(0))
    centroid = expert_tensors(layer, 0)
    member = permuted(layer, centroid, shuffle)  # expert 1 := expert 0 with its neurons shuffled
    with swapped_weights(moe, {layer.index: {1: {n: t.clone() for n, t in member.items()}}}):
        merger = LayerMerger(layer, stats.layer(layer.index))
        perm = merger.permutation(0, 1)
        assert torch.equal(shuffle[perm], torch.arange(width))  # member neuron perm[k] is neuron k
        merged = merger.merged(0, [1])
    for name, tensor in centroid.items():  # aligned copies average to the expert itself
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


# ----------------------------------------------------------------------------- observation
def test_observer_records_gated_sums_and_a_probe():
    moe = MoEModel(tiny_model("qwen3_moe"))
    data = calibration((90, 80))
    stats = observe(moe, data, batch_size=1, progress=False)
    first = observe(moe, calibration((90,)), batch_size=1, progress=False)
    s = stats.layer(moe.layers[0].index)
    assert s.probe is not None and s.probe.shape == (PROBE_TOKENS, s.hidden_size)
    # the first PROBE_TOKENS distinct tokens in order: the first sample's 90, then the second's
    assert torch.equal(s.probe[:90], first.layer(s.layer).probe)
    assert s.gated_sum is not None and s.gated_sum.shape == s.mean.shape
    # |sum g y| <= sum g ||y||, with equality only for parallel outputs
    assert bool((s.gated_sum.norm(dim=1) <= s.weighted_norm_sum * (1 + 1e-9)).all())
    assert bool((s.gated_sum.abs().sum(1)[s.count > 0] > 0).all())


# ----------------------------------------------------------------------------- virtual == physical
@pytest.mark.parametrize(
    "family",
    ["olmoe", "gpt_oss", "llama4_text", "nemotron_h", "deepseek_v3"],
    ids=["fused", "interleaved-biases", "input-weighted", "ungated", "group-routing"],
)
def test_virtual_equals_physical_and_the_stock_result_reloads(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, progress=False)
    plan = merge_plan(moe, stats)
    groups = plan.extra["merge_groups"]
    for lp in plan.layers:  # every dropped expert merged into a kept one, once
        members = sorted(e for ms in groups[str(lp.layer)].values() for e in ms)
        assert members == sorted(lp.dropped) and set(map(int, groups[str(lp.layer)])) <= set(lp.kept)
    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert torch.equal(logits(model), full), "the virtual form was not undone"
    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats)
    assert_logits_close(logits(pruned), virtual)
    dropped = copy.deepcopy(model)  # the same plan's drop differs: the merged weights are used
    drop_plan = copy.deepcopy(plan)
    drop_plan.extra.pop("merge_groups")
    apply_plan_physical(MoEModel(dropped), drop_plan, stats)
    assert float((logits(dropped) - virtual).abs().max()) > 1e-4

    assert moeprune.save_pretrained(pruned, tmp_path) == "stock"
    assert_logits_close(logits(stock_from_pretrained(tmp_path)), virtual)


def test_global_result_is_moeprune_format_with_per_layer_counts(tmp_path):
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, progress=False)
    plan = merge_plan(moe, stats, sparsity=0.25, allocation="global")
    assert len({lp.num_experts - len(lp.dropped) for lp in plan.layers}) > 1
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    apply_plan_physical(moe, plan, stats)
    assert_logits_close(logits(model), virtual)
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    assert_logits_close(logits(moeprune.load_pretrained(tmp_path)), virtual)


def test_search_candidates_compute_with_the_merged_weights_and_restore_them():
    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, progress=False)
    plan = merge_plan(moe, stats)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    context = merge_context(moe, stats)
    removed = {lp.layer: list(lp.dropped) for lp in plan.layers}  # ids == positions: unpruned
    with virtual_plan(moe, plan, stats):
        expected = logits(model)
    for _ in range(2):  # the second time from the cache
        with context(removed):
            assert torch.equal(logits(model), expected)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_super_experts_stay_singletons():
    moe = MoEModel(tiny_model("qwen3_moe"))
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, progress=False)
    free = merge_plan(moe, stats)
    layer = moe.layers[0]
    busy = [int(c) for c in free.extra["merge_groups"][str(layer.index)]]
    moe.protected = {layer.index: busy[:1]}  # a centroid that took members is now a super expert
    guarded = merge_plan(moe, stats)
    lp = guarded.layer(layer.index)
    assert busy[0] in lp.kept and busy[0] not in lp.dropped
    assert str(busy[0]) not in guarded.extra["merge_groups"][str(layer.index)]


# ----------------------------------------------------------------------------- command line
def test_merge_with_trapezoid_is_refused_in_one_line_before_loading(tmp_path):
    done = run_cli("prune", tmp_path / "no-such-model", "--output", tmp_path / "out", "--method", "merge",
                   "--allocation", "trapezoid", "--criterion", "reap", "--sparsity", "0.5", ok=False)  # fmt: skip
    assert done.exit_code == 2
    assert done.output.strip().splitlines() == [
        "moeprune: error: the merge method goes with the uniform or global or evo allocation, not trapezoid "
        "(--method, --allocation)"
    ]


def test_the_command_line_writes_a_stock_checkpoint_transformers_loads(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    run_cli("prune", tiny_checkpoint, "--output", out, "--method", "merge", "--criterion", "reap",
            "--sparsity", "0.25", "--data", data, "--quiet")  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert "moeprune" not in config and config["num_local_experts"] == 6
    plan = json.loads((out / "plan.json").read_text())
    assert plan["method"] == "merge" and plan["extra"]["merge_groups"]
    stock, ours = stock_from_pretrained(out), moeprune.load_pretrained(out)
    assert_logits_close(logits(stock), logits(ours))


def test_the_no_load_pipeline_refuses_to_merge():
    from moeprune.errors import MoePruneError
    from moeprune.job.pipelines import PIPELINES

    with pytest.raises(
        MoePruneError, match="the merge method with the uniform allocation needs the in-memory"
    ):
        PIPELINES.get("no-load").check(PruneConfig("reap", 0.5, method="merge"))
