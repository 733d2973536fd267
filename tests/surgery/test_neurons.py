"""Neuron surgery (ENP): importance formulas, virtual == physical, stock reload of uniform widths."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from test_observe import calibration
from transformers import AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close, stock_from_pretrained
from moeprune.checkpoint import is_moeprune_format
from moeprune.checkpoint.files import tensor_bytes
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.observe.stats import LayerStats
from moeprune.quantize.keeps import plan_keeps
from moeprune.shards.weight_bytes import cast_weight_bytes
from moeprune.surgery.neurons import (
    check_neuron_prunable,
    neuron_importance,
    neuron_plan,
    stock_width_expressible,
    top_neurons,
)
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.sizes import keeps_bytes

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
F64 = torch.float64


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def neuron_stats(moe: MoEModel):
    return observe(moe, calibration((20, 17, 15, 12)), batch_size=2, neurons=True, progress=False)


def test_importance_on_a_hand_computed_case():
    """d=2, I=3, one expert, two tokens; y_k = W_down[:, k] m_k."""
    down = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]], dtype=F64)
    m = torch.tensor([[-3.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    # token 1: y_k = (-3,0), (0,1), (2,0); y = (-1,1); projections (3, 1, -2)/sqrt2; norms (3, 1, 2)
    # token 2: y_k = (1,0), (0,1), (0,0);  y = (1,1);  projections (1, 1, 0)/sqrt2;  norms (1, 1, 0)
    s2 = math.sqrt(2)
    proj = torch.tensor([(3 / s2 + 1 / s2) / 2, (1 / s2 + 1 / s2) / 2, (-2 / s2) / 2], dtype=F64)
    l2 = torch.tensor([(3 + 1) / 2, (1 + 1) / 2, (2 + 0) / 2], dtype=F64)

    shares = m.unsqueeze(2) * down.T.unsqueeze(0)  # [token, k, d] = y_k
    y = shares.sum(1)
    assert torch.equal(y, torch.tensor([[-1.0, 1.0], [1.0, 1.0]], dtype=F64))
    stats = LayerStats.zeros(0, num_experts=1, hidden_size=2, intermediate_size=3, neurons=True)
    stats.neuron_proj_sum[0] = ((shares * y.unsqueeze(1)).sum(2) / (y.norm(dim=1, keepdim=True) + 1e-8)).sum(
        0
    )
    stats.neuron_l2_sum[0] = shares.norm(dim=2).sum(0)
    stats.count[0] = 2
    torch.testing.assert_close(neuron_importance(stats)[0], proj, rtol=0, atol=1e-7)
    torch.testing.assert_close(neuron_importance(stats, "l2")[0], l2, rtol=0, atol=1e-12)
    assert top_neurons(neuron_importance(stats)[0], 2).tolist() == [0, 1]  # projection drops neuron 2
    assert top_neurons(neuron_importance(stats, "l2")[0], 2).tolist() == [0, 1]  # tie 1 vs 2: lower id
    assert top_neurons(neuron_importance(stats, "l2")[0], 1).tolist() == [0]
    stats.count[0] = 0
    assert neuron_importance(stats).abs().sum() == 0  # unseen experts: importance 0


def test_projection_and_l2_choose_differently():
    stats = LayerStats.zeros(0, 1, 2, 3, neurons=True)
    stats.count[0] = 1
    stats.neuron_proj_sum[0] = torch.tensor([2.1, 0.7, -1.4], dtype=F64)
    stats.neuron_l2_sum[0] = torch.tensor([3.0, 1.0, 2.0], dtype=F64)
    assert top_neurons(neuron_importance(stats)[0], 2).tolist() == [0, 1]
    assert top_neurons(neuron_importance(stats, "l2")[0], 2).tolist() == [0, 2]


@pytest.mark.parametrize("family", supported_families())
def test_uniform_neurons_virtual_physical_and_stock_reload(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    if moe.fixed_layers:  # refused by build_plan (tests/models/test_fixed_layers.py)
        pytest.skip(f"{family}: the neuron methods refuse a model with layers kept whole")
    stats = neuron_stats(moe)
    half = moe.layers[0].intermediate_size // 2
    plan = neuron_plan(moe, stats, 0.5)  # half the neurons of every expert (16 -> 8 in the fixtures)
    assert {c for lp in plan.layers for c in lp.neurons.values()} == {half}
    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert (logits(model) - full).abs().max() == 0
    assert (virtual - full).abs().max() > 1e-4

    pruned = copy.deepcopy(model)
    pruned_moe = MoEModel(pruned)
    apply_plan_physical(pruned_moe, plan, stats)
    physical = logits(pruned)
    assert (physical - virtual).abs().max() <= 1e-5 * max(1.0, float(full.abs().max()))
    after = routed_parameters(pruned_moe)
    assert after["routed_experts"] == plan_routed_parameters(moe, plan)["routed_experts"]
    assert after["routed_experts"] <= 0.51 * routed_parameters(moe)["routed_experts"]

    fmt = moeprune.save_pretrained(pruned, tmp_path)
    if stock_width_expressible(moe):
        assert fmt == "stock" and not is_moeprune_format(tmp_path)
        reloaded = stock_from_pretrained(tmp_path, dtype=torch.float32)
        assert getattr(reloaded.config.get_text_config(), moe.spec.intermediate_field) == half
    else:  # Llama-4: the shared expert's width is the same config field
        assert fmt == "moeprune"
        reloaded = moeprune.load_pretrained(tmp_path)
    assert_logits_close(logits(reloaded), physical)


@pytest.mark.parametrize("family", ["deepseek_v3", "ernie4_5_moe"])
def test_derived_shared_expert_is_padded_not_changed(family, tmp_path):
    """Width 24 -> 16: the shared expert (24 = 24 x 1) becomes 16 x 2 with 8 zero neurons; the
    bytes it loses, padding included, are the ones the pricing of what each layer keeps predicts
    (surgery/sizes.py `kept_bytes`, the one price of size planning and quantization)."""
    model = tiny_model(family, moe_intermediate_size=24)
    moe = MoEModel(model)
    field = "n_shared_experts" if family == "deepseek_v3" else "moe_num_shared_experts"
    shared = {m.index: copy.deepcopy(m.shared_modules[0]) for m in moe.layers}
    stats = neuron_stats(moe)
    plan = neuron_plan(moe, stats, 1 / 3)
    model.save_pretrained(tmp_path / "full")
    size = cast_weight_bytes(tmp_path / "full", moe, torch.float32)
    keeps = plan_keeps(moe, plan)
    predicted = size.total - keeps_bytes(size, keeps)  # removed: 8 neurons of every routed expert
    unshared = tuple(dataclasses.replace(lay, shared_width=0) for lay in size.layers)
    assert predicted < size.total - keeps_bytes(dataclasses.replace(size, layers=unshared), keeps)  # padded
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    apply_plan_physical(moe, plan, stats)
    assert getattr(model.config, field) == 2 and model.config.moe_intermediate_size == 16
    for m in moe.layers:
        module = m.shared_modules[0]
        assert module.gate_proj.weight.shape[0] == 32
        assert (
            module.gate_proj.weight[24:].abs().sum() == 0 and module.down_proj.weight[:, 24:].abs().sum() == 0
        )
        x = torch.randn(5, 32)
        with torch.no_grad():
            torch.testing.assert_close(module(x), shared[m.index](x), rtol=0, atol=1e-6)
    assert moeprune.save_pretrained(model, tmp_path / "pruned") == "stock"
    assert tensor_bytes(tmp_path / "full") - tensor_bytes(tmp_path / "pruned") == predicted
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype=torch.float32).eval()
    assert_logits_close(logits(reloaded), logits(model))
    assert (logits(reloaded) - virtual).abs().max() <= 1e-5


def test_unaligned_uniform_width_is_packed_not_stock(tmp_path):
    """K = 6 would break transformers' grouped_mm kernel (16-byte strides): moeprune's format instead."""
    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    stats = neuron_stats(moe)
    plan = neuron_plan(moe, stats, 0.625, width_multiple=1)
    assert {c for lp in plan.layers for c in lp.neurons.values()} == {6}
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    assert apply_plan_physical(moe, plan, stats)["form"] == "packed"
    assert (logits(model) - virtual).abs().max() <= 1e-5
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    assert_logits_close(logits(moeprune.load_pretrained(tmp_path)), logits(model))


def test_half_sparsity_keeps_half_the_neurons():
    moe = MoEModel(tiny_model("qwen3_moe"))
    plan = neuron_plan(moe, neuron_stats(moe), 0.5, importance="l2")
    assert all(set(lp.neurons.values()) == {8} and len(lp.neurons) == 8 for lp in plan.layers)
    assert plan.method == "neurons" and plan.extra["neuron_importance"] == "l2"
    assert plan.is_uniform()


def test_bad_inputs_are_refused():
    moe = MoEModel(tiny_model("olmoe"))
    stats = neuron_stats(moe)
    for sparsity in (1.0, -0.5):
        with pytest.raises(MoePruneError, match=r"\(0, 1\]"):
            neuron_plan(moe, stats, sparsity)
    with pytest.raises(MoePruneError, match="less than one block of 8"):
        neuron_plan(moe, stats, 0.8)
    with pytest.raises(MoePruneError, match="less than one neuron"):
        neuron_plan(moe, stats, 0.99, width_multiple=1)
    with pytest.raises(MoePruneError, match="neurons=True"):
        neuron_plan(moe, observe(moe, calibration(), progress=False), 0.5)
    with pytest.raises(
        MoePruneError, match="needs calibration statistics: give calibration data files"
    ) as caught:
        neuron_plan(moe, None, 0.5)
    assert caught.value.options == ("data",)
    with pytest.raises(MoePruneError, match="unknown neuron importance"):
        neuron_plan(moe, stats, 0.5, importance="taylor")


def test_a_family_without_gated_experts_is_named():
    moe = MoEModel(tiny_model("mixtral"))
    for layer in moe.layers:
        layer.spec = dataclasses.replace(layer.spec, layout="dense-mlp")
    with pytest.raises(MoePruneError, match="SwiGLU-like.*mixtral.*dense-mlp"):
        check_neuron_prunable(moe)


def test_gpt_oss_clamped_gate_qualifies():
    check_neuron_prunable(MoEModel(tiny_model("gpt_oss")))
