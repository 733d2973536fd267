"""Novice surgery: virtual == physical, exact save/load, constant experts, novice beats drop."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_observe import calibration

import moeprune
from helpers import assert_logits_close
from moeprune.checkpoint import load_model
from moeprune.criteria import compute_scores, get_criterion
from moeprune.data.loading import load_data
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.packed import router_count
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.observe.observer import observe
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.novice import novice_plan
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def mone_plan(moe: MoEModel, stats, sparsity: float = 0.25, allocation: str = "uniform") -> Plan:
    crit = get_criterion("mone")
    return novice_plan(
        moe, stats, compute_scores("mone", stats=stats), sparsity, criterion=crit, allocation=allocation
    )


@pytest.mark.parametrize("family", supported_families())
def test_virtual_equals_physical_and_reloads_exactly(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    stats = observe(moe, calibration((20, 17, 15, 12)), batch_size=2, progress=False)
    plan = mone_plan(moe, stats, allocation="global" if family == "olmoe" else "uniform")
    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert (logits(model) - full).abs().max() == 0, "the virtual form was not undone"
    assert (virtual - full).abs().max() > 1e-4, "novices changed nothing"

    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    routers = [m.router for m in pruned_moe.layers]
    apply_plan_physical(pruned_moe, plan, stats)
    assert_logits_close(logits(pruned), virtual)
    assert all(m.router is r for m, r in zip(pruned_moe.layers, routers))  # routing untouched
    assert [router_count(m) for m in pruned_moe.layers] == [lp.num_experts for lp in plan.layers]
    after = routed_parameters(pruned_moe)
    assert after["routed_experts"] == plan_routed_parameters(moe, plan)["routed_experts"]
    assert after["routed_experts"] < routed_parameters(moe)["routed_experts"]
    assert after["total"] - after["routed_experts"] == sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for m in moe.layers for p in m.experts.parameters()
    )

    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    reloaded = moeprune.load_pretrained(tmp_path)
    assert_logits_close(logits(reloaded), virtual)
    again = copy.deepcopy(reloaded)  # a class swap, not a closure: copies stay independent
    assert_logits_close(logits(again), virtual)


@pytest.mark.parametrize("family", supported_families())
def test_constant_expert_is_replaced_with_zero_error(family):
    """Zero down weights make one routed expert per layer constant: zero, or gpt_oss's non-zero
    down bias (expert 3, or the busiest one where the router never picks 3 on this data)."""
    model = tiny_model(family)
    moe = MoEModel(model)
    data = calibration((20, 17, 15, 12))
    first = observe(moe, data, batch_size=2, progress=False)
    chosen = [3 if s.count[3] > 0 else int(s.count.argmax()) for s in first.layers]
    with torch.no_grad():
        for layer, e in zip(moe.layers, chosen):
            layer.experts.down_proj[e].zero_()
    stats = observe(moe, data, batch_size=2, progress=False)
    assert all(s.count[e] > 0 for s, e in zip(stats.layers, chosen))
    shape = ModelShape(family, [m.index for m in moe.layers], [8] * len(moe), [m.top_k for m in moe.layers])
    plan = Plan.from_removals(
        shape, removals=[[e] for e in chosen], criterion="manual", allocation="uniform", method="novice",
        sparsity=0.125, novices=True,
    )  # fmt: skip
    with override_routed(moe, RoutedOptions(on_layer=lambda *_: None)):  # same computation, real expert
        full = logits(model)
    with virtual_plan(moe, plan, stats):
        assert (logits(model) - full).abs().max() == 0
    apply_plan_physical(moe, plan, stats)
    assert (logits(model) - full).abs().max() == 0
    if family == "gpt_oss":
        assert moe.layers[0].experts.moeprune_novice.abs().max() > 0.01


def test_novices_need_calibration_data():
    moe = MoEModel(tiny_model("olmoe"))
    scores = compute_scores("random", num_experts=[8] * len(moe), layers=[m.index for m in moe.layers])
    with pytest.raises(
        MoePruneError, match="needs calibration statistics: give calibration data files"
    ) as caught:
        novice_plan(moe, None, scores, 0.25, criterion=get_criterion("random"))
    assert caught.value.options == ("data",)
    plan = Plan.from_removals(
        ModelShape("olmoe", [0, 1, 2], [8] * 3, [2] * 3), removals=[[1]] * 3,
        criterion="random", allocation="uniform", method="novice", sparsity=0.125, novices=True,
    )  # fmt: skip
    with pytest.raises(MoePruneError, match="calibration"):
        apply_plan_physical(moe, plan, [])
    with pytest.raises(MoePruneError, match="unknown|allocation"):
        novice_plan(moe, observe(moe, calibration(), progress=False), scores, 0.25,
                    criterion=get_criterion("random"), allocation="evo")  # fmt: skip


def test_packed_layer_json_records_novices(tmp_path):
    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    stats = observe(moe, calibration(), batch_size=2, progress=False)
    plan = mone_plan(moe, stats)
    apply_plan_physical(moe, plan, stats)
    moeprune.save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())["moeprune"]
    assert meta["format_version"] == 3
    for entry, lp in zip(meta["layers"], plan.layers):
        assert entry["novice"] == lp.novice  # nothing dropped: router positions are the original ids
        assert [p for p, w in enumerate(entry["widths"]) if w is not None] == sorted(
            set(lp.kept) - set(lp.novice)
        )


def _block_errors(moe: MoEModel, inputs: dict[int, list], plan: Plan, stats) -> list[float]:
    """Per MoE layer, ||block(h) - full block(h)||^2 over non-padding tokens, on the full model's inputs."""
    errors = []
    with virtual_plan(moe, plan, stats), torch.no_grad():
        for layer in moe.layers:
            total = 0.0
            for h, out, valid in inputs[layer.index]:
                total += float((layer.block(h) - out)[valid].square().sum())
            errors.append(total)
    return errors


def test_novices_beat_dropping_the_same_experts_on_the_trained_model(trained_moe):
    model_dir, corpus = trained_moe
    model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    sources = [str(corpus / f"{d}_train.jsonl") for d in ("code", "prose", "math")]
    calib = load_data(sources, tokenizer, num_samples=48, max_length=128, seed=0)
    stats = observe(moe, calib, batch_size=8, pad_token_id=tokenizer.pad_token_id or 0, progress=False)
    novice = mone_plan(moe, stats, sparsity=0.25)
    drop = Plan.from_removals(
        ModelShape.of(moe), removals=[lp.novice for lp in novice.layers], criterion="mone",
        allocation="uniform", method="drop", sparsity=0.25,
    )  # fmt: skip
    # held-out data of the calibration distribution (mu_i is the mean output on that distribution)
    held_out = [str(corpus / f"{d}_eval.jsonl") for d in ("code", "prose", "math")]
    evaluation = load_data(held_out, tokenizer, num_samples=24, max_length=128)
    inputs = {m.index: [] for m in moe.layers}
    valid = None
    handles = [
        m.block.register_forward_hook(
            lambda mod, args, out, i=m.index: inputs[i].append((args[0].detach(), out.detach(), valid))
        )
        for m in moe.layers
    ]
    with torch.no_grad():
        for batch in evaluation.batches(8, tokenizer.pad_token_id or 0):
            valid = batch.attention_mask.bool()
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for h in handles:
        h.remove()
    novice_err = _block_errors(moe, inputs, novice, stats)
    drop_err = _block_errors(moe, inputs, drop, stats)
    assert all(n < d for n, d in zip(novice_err, drop_err)), (novice_err, drop_err)


def test_layers_with_nothing_to_do_keep_transformers_kernels():
    """Only layers with novices (or masks, or a recorder) get the routed computation."""
    moe = MoEModel(tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[]))
    first, *rest = moe.layers
    novices = {first.index: {2: torch.zeros(first.hidden_size)}}
    with override_routed(moe, RoutedOptions(novices=novices)):
        assert "forward" in first.experts.__dict__
        assert all("forward" not in layer.experts.__dict__ for layer in rest)
    with override_routed(moe, RoutedOptions(on_layer=lambda *_: None)):
        assert all("forward" in layer.experts.__dict__ for layer in moe.layers)
    assert all("forward" not in layer.experts.__dict__ for layer in moe.layers)


def test_packed_layers_can_be_observed_for_routing():
    """After novice surgery the model is packed; the observer still sees the router's real
    selection (checked against the router's own top-k) and a novice's constant output. Neuron
    statistics of mixed widths are refused."""
    moe = MoEModel(tiny_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[]))
    data = calibration((9, 9, 9, 9))  # equal lengths: no padding, every token counts
    stats = observe(moe, data, batch_size=2, progress=False)
    scores = compute_scores("mone", stats=stats)
    plan = novice_plan(moe, stats, scores, 0.25, criterion=get_criterion("mone"))
    apply_plan_physical(moe, plan, stats)
    chosen = {m.index: torch.zeros(m.num_experts, dtype=torch.long) for m in moe.layers}

    def count(index: int):
        def hook(module, args, output) -> None:  # the router's (logits, weights, indices)
            chosen[index].add_(torch.bincount(output[2].flatten(), minlength=len(chosen[index])))

        return hook

    hooks = [m.router.register_forward_hook(count(m.index)) for m in moe.layers]
    packed = observe(moe, data, batch_size=2, progress=False)
    for h in hooks:
        h.remove()
    for m, layer_stats in zip(moe.layers, packed.layers):
        assert torch.equal(layer_stats.count.long(), chosen[m.index])
        novices = {p: v for p, v in enumerate(m.experts.moeprune_slots) if v < 0}
        for p, slot in novices.items():
            if layer_stats.count[p] > 0:
                torch.testing.assert_close(layer_stats.mean[p].float(), m.experts.moeprune_novice[-1 - slot])
    with pytest.raises(MoePruneError, match="packed"):
        observe(moe, data, batch_size=2, neurons=True, progress=False)
