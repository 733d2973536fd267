"""Per-layer precision for methods that narrow experts or keep novices (quantize/keeps.py),
without llm-compressor: the byte table of what each layer keeps against the one-scheme predictions
(`--target-size` with `--quantize`: surgery/target_size.py planned_bytes in quantized bytes) and against drop's table,
and the fake quantization of a packed layer (per-expert widths, novices): each expert's slice in
its own shape, the novices untouched, the tensors restored exactly. The tiny qwen3_moe: 2 MoE
layers of 8 experts 16 wide, hidden 32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_mixed import plan_of, setup

from moeprune.config import PruneConfig
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.packed import NOVICE_PARAM, expert_tensors, is_packed
from moeprune.quantize.choice import LayerSwap, expert_weights, precision_bytes
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.keeps import LayerKeep, kept_precision_bytes, plan_keeps, planned_keeps
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.surgery.planning import check_config
from moeprune.surgery.plans import apply_plan_physical
from moeprune.surgery.sizes import LayerBytes, WeightBytes
from moeprune.surgery.target_size import planned_bytes

pytestmark = pytest.mark.unit
SCHEMES = ("w4a16", "w8a16")
OPTIONS = QuantizeOptions("w4a16", "rtn", 8, candidates=SCHEMES)


def _size(moe: MoEModel) -> WeightBytes:
    hidden, width = moe.layers[0].hidden_size, moe.layers[0].intermediate_size
    layers = tuple(LayerBytes(m.num_experts, width, 3 * hidden * 4, 0, hidden * 4, hidden * 4) for m in moe.layers)
    return WeightBytes("float32", 10_000 + sum(lay.experts * lay.expert() for lay in layers), layers)


@pytest.mark.parametrize(
    ("method", "options"),
    [("neurons", {"width_multiple": 8}), ("mixed", {"width_multiple": 4, "mixed_novice": 0.125})],
)
def test_every_layer_in_one_scheme_is_the_one_scheme_prediction(method, options):
    meta = MoEModel(tiny_model("qwen3_moe"))
    config = check_config(PruneConfig("reap", 0.5, method=method, options=options))
    size = _size(meta)
    pb = kept_precision_bytes(size, meta, SCHEMES, OPTIONS, 4, planned_keeps(meta, config))
    base = quantized_weight_bytes(size, meta, OPTIONS, 4)
    for scheme in SCHEMES:
        each = quantized_weight_bytes(size, meta, QuantizeOptions(scheme, "rtn", 8), 4)
        one = planned_bytes(meta, config, each)
        if method == "neurons":  # every expert at K = 8 of 16 neurons: by hand
            assert one == each.total - sum(lay.experts * lay.per_neuron * 8 for lay in each.layers)
        # the table keeps the Linears outside the experts in the base scheme (w4a16), the
        # one-scheme prediction in `scheme`: the same bytes once those are set aside
        assert pb.total([scheme] * 2) - _outside(base) == one - _outside(each), scheme


def _outside(size: WeightBytes) -> int:
    return size.total - sum(lay.experts * lay.expert() for lay in size.layers)


def test_whole_experts_kept_price_as_drop_and_novices_add_their_vector_and_router_row():
    meta = MoEModel(tiny_model("qwen3_moe"))
    size = _size(meta)
    drop = precision_bytes(size, meta, SCHEMES, OPTIONS, 4, [2, 3])
    kept = kept_precision_bytes(size, meta, SCHEMES, OPTIONS, 4, [LayerKeep((16,) * 6, 0, 2), LayerKeep((16,) * 5, 0, 3)])
    assert kept == drop
    novices = kept_precision_bytes(size, meta, SCHEMES, OPTIONS, 4, [LayerKeep((16,) * 6, 2), LayerKeep((16,) * 5, 3)])
    assert novices.layers == drop.layers  # novices are not quantized: outside the choice
    assert novices.fixed - drop.fixed == 5 * (32 * 4 + 32 * 4)  # 5 fp32 vectors and router rows of 32
    rank2 = kept_precision_bytes(size, meta, SCHEMES, OPTIONS, 4, [LayerKeep((16,) * 6, 2), LayerKeep((16,) * 5, 3)], 2)
    assert rank2.fixed - drop.fixed == 5 * (32 * 4 * 5 + 32 * 4)  # d + 2dR values each


def test_a_packed_layer_is_fake_quantized_expert_by_expert_novices_untouched():
    """A mixed plan (narrowed widths on a multiple of 4, a novice, drops) made physical: the swap quantizes each
    weight-holding expert's [out, in] slice (down: groups of 4 along its own width), leaves the
    novices, restores the very tensors; the plan's keeps are what each layer holds."""
    model, moe, stats = setup("qwen3_moe")
    plan = plan_of(moe, stats, 0.6, width_multiple=4, mixed_whole=0.25, mixed_novice=0.125, mixed_width=0.5)
    pruned = MoEModel(copy.deepcopy(model))
    apply_plan_physical(pruned, plan, stats)
    layer = pruned.layers[0]
    assert is_packed(layer)
    keeps = plan_keeps(pruned, plan)
    assert sorted(keeps[0].widths) == sorted(layer.experts.moeprune_widths) and keeps[0].novices == 1
    assert keeps[0].removed == len(plan.layers[0].dropped) > 0
    weights = expert_weights(pruned, 0)
    assert NOVICE_PARAM not in weights and weights and all(p.ndim == 1 for p in weights.values())
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in weights.items()}
    slots = range(len(layer.experts.moeprune_widths))
    originals = [expert_tensors(layer.experts, s) for s in slots]
    originals = [{k: v.clone() for k, v in t.items()} for t in originals]
    novice = getattr(layer.experts, NOVICE_PARAM).detach().clone()
    with LayerSwap(pruned, 4).quantized(0, "w4a16"):
        for s, tensors in zip(slots, originals):
            for unit, original in tensors.items():
                assert torch.equal(expert_tensors(layer.experts, s)[unit], fake_quantize(original, "w4a16", 4))
        assert torch.equal(getattr(layer.experts, NOVICE_PARAM), novice)
    for n, p in expert_weights(pruned, 0).items():
        assert p.data_ptr() == before[n][0] and torch.equal(p.data, before[n][1])
