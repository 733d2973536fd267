"""The grouped expert products (models/grouped.py) compute what the per-expert loop computes.

On a CPU in fp32 the routed computation must keep its bits wherever it takes the grouped path
(golden outputs depend on it); elsewhere (bf16, layers whose activation is not row by row) the
grouped form must agree to the dtype's rounding. The per-expert loop (`RoutedOptions(grouped=False)`)
is the reference throughout.
"""

from __future__ import annotations

import pytest
import torch
from test_observe import calibration

from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.families import supported_families
from moeprune.models.grouped import expert_offsets, grouped_expert_forward, grouped_supported
from moeprune.models.routed import RoutedOptions, RoutedRows, override_routed
from moeprune.observe import neurons as neuron_module
from moeprune.observe.observer import observe

pytestmark = pytest.mark.unit

TOKENS = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(3))
# one family per layout: fused, transposed, input-weighted (Llama-4), interleaved with biases,
# ungated, and a family with its own gate function
SUPPORTED = set(supported_families())  # the installed transformers' (aria_text: from 5.17 on)


def _families(*names: str) -> list:
    """`names`, each skipped with the reason where this transformers has no such MoE family."""
    return [
        name if name in SUPPORTED
        else pytest.param(name, marks=pytest.mark.skip(reason=f"{name}: not a supported MoE family here"))
        for name in names
    ]  # fmt: skip


LAYOUTS = _families("qwen3_moe", "aria_text", "llama4_text", "gpt_oss", "nemotron_h", "glm5_next")


def _run(moe: MoEModel, grouped: bool, masks=None) -> tuple[torch.Tensor, dict[int, RoutedRows]]:
    seen: dict[int, RoutedRows] = {}

    def record(layer, routed: RoutedRows) -> None:
        seen[layer.index] = routed

    options = RoutedOptions(
        on_layer=record, need_intermediate=True, neuron_masks=masks or {}, grouped=grouped
    )
    with torch.no_grad(), override_routed(moe, options):
        logits = moe.model(TOKENS.to(moe.model.device)).logits
    return logits, seen


@pytest.mark.parametrize("family", LAYOUTS)
def test_grouped_products_equal_each_experts_forward(family):
    """Every layout's grouped products against `expert_forward` one expert at a time."""
    moe = MoEModel(tiny_model(family))
    layer = moe.layers[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, layer.num_experts, (41,), generator=gen).sort().values
    x = torch.randn(41, layer.hidden_size, generator=gen)
    with torch.no_grad():
        y, m = grouped_expert_forward(layer, x, ids, expert_offsets(ids, layer.num_experts))
        for expert in ids.unique().tolist():
            rows = ids == expert
            want_y, want_m = layer.expert_forward(expert, x[rows], return_intermediate=True)
            torch.testing.assert_close(m[rows], want_m, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(y[rows], want_y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", _families("qwen3_moe", "aria_text", "llama4_text"))
def test_grouped_routing_keeps_the_bits_on_cpu(family):
    """fp32 on a CPU: the same logits, rows, inputs, outputs, weights and activations, bit for bit,
    with and without neuron masks (a mask on one expert, the others untouched)."""
    moe = MoEModel(tiny_model(family))
    layer = moe.layers[0]
    assert grouped_supported(layer, torch.zeros(1, layer.hidden_size))  # the grouped path runs
    mask = (torch.arange(layer.intermediate_size) % 3 != 0).float()
    for masks in (None, {layer.index: {1: mask}}):
        loop_logits, loop_rows = _run(moe, grouped=False, masks=masks)
        logits, rows = _run(moe, grouped=True, masks=masks)
        assert torch.equal(logits, loop_logits)
        for index, want in loop_rows.items():
            got = rows[index]
            for name in ("rows", "experts", "inputs", "outputs", "weights", "intermediate"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (index, name)
    _, masked = _run(moe, grouped=True, masks={layer.index: {1: mask}})
    routed = masked[layer.index]
    assert torch.all(routed.intermediate[routed.experts == 1][:, mask == 0] == 0)


@pytest.mark.parametrize("family", _families("gpt_oss", "nemotron_h", "glm5_next"))
def test_layers_without_rowwise_activation_keep_the_loop_on_cpu(family):
    moe = MoEModel(tiny_model(family))
    assert not any(grouped_supported(m, torch.zeros(1, m.hidden_size)) for m in moe.layers)


def test_bf16_grouped_routing_agrees_to_bf16_rounding():
    moe = MoEModel(tiny_model("qwen3_moe").to(torch.bfloat16))
    loop_logits, loop_rows = _run(moe, grouped=False)
    logits, rows = _run(moe, grouped=True)
    assert all(torch.equal(rows[i].experts, r.experts) for i, r in loop_rows.items())
    scale = loop_logits.float().abs().max()
    assert (logits.float() - loop_logits.float()).abs().max() <= 2 * 2**-8 * scale


def test_neuron_sums_without_host_order_equal_the_ordered_ones(monkeypatch):
    """The GPU's neuron sums (padding to a spare bin, one index_add_) equal the CPU's per-expert
    sums to fp64 rounding: run here by making the CPU take the GPU's branch."""
    moe = MoEModel(tiny_model("qwen3_moe"))
    data = calibration((9, 3, 7, 2))
    ordered = observe(moe, data, batch_size=2, neurons=True, progress=False)
    monkeypatch.setattr(neuron_module, "ordered_sums", lambda device: False)
    unordered = observe(moe, data, batch_size=2, neurons=True, progress=False)
    for a, b in zip(ordered.layers, unordered.layers, strict=True):
        assert a.neuron_proj_sum is not None and b.neuron_proj_sum is not None
        torch.testing.assert_close(b.neuron_proj_sum, a.neuron_proj_sum, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(b.neuron_l2_sum, a.neuron_l2_sum, rtol=1e-6, atol=1e-9)
        assert a.neuron_l2_sum.abs().sum() > 0
