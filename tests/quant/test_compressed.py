"""compressed-tensors arithmetic of moeprune.quant.compressed, on hand-made tensors (and, where the
library is installed, against its own packing)."""

from __future__ import annotations

import pytest
import torch

from moeprune.errors import MoePruneError
from moeprune.quant.compressed import (
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    WeightScheme,
    dequantize_float,
    dequantize_packed,
    pack_int32,
    read_compressed_config,
    unpack_int32,
)

pytestmark = pytest.mark.unit

INT4_GROUP = WeightScheme("pack-quantized", 4, "int", strategy="group", group_size=8)


def test_int4_packing_by_hand():
    """Eight 4-bit values per int32, the first in the lowest bits, each offset by 8."""
    values = torch.tensor([[-8, -1, 0, 1, 2, 3, 4, 7]])
    # offset: 0, 7, 8, 9, 10, 11, 12, 15 -> nibbles from bit 0: 0x FCBA 9870
    assert pack_int32(values, 4).tolist() == [[0xFCBA9870 - 2**32]]
    assert unpack_int32(pack_int32(values, 4), 4, 8).tolist() == values.tolist()


def test_odd_widths_split_values_across_words():
    g = torch.Generator().manual_seed(0)
    for bits in (3, 5, 6, 7, 8):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (3, 40), generator=g)
        assert torch.equal(unpack_int32(pack_int32(values, bits), bits, 40), values)


def test_packing_matches_the_library():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(1)
    for bits in (4, 8):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (4, 64), generator=g, dtype=torch.int8)
        assert torch.equal(pack_int32(values, bits), helpers.pack_to_int32(values, bits))


def test_group_dequantization_by_hand():
    q = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8, 1, 1, 1, 1, 1, 1, 1, 1]])
    scale = torch.tensor([[0.5, 2.0]], dtype=torch.bfloat16)  # groups of 8 inputs
    tensors = {PACKED: pack_int32(q, 4), SCALE: scale, SHAPE: torch.tensor([1, 16])}
    w = dequantize_packed(tensors, INT4_GROUP)
    assert w.tolist() == [[0.5, -1.0, 1.5, -2.0, 2.5, -3.0, 3.5, -4.0] + [2.0] * 8]


def test_asymmetric_zero_points_are_packed_along_the_outputs():
    scheme = WeightScheme("pack-quantized", 4, "int", symmetric=False, strategy="group", group_size=4)
    q = torch.tensor([[3, 3, 3, 3, 0, 0, 0, 0], [1, 2, 3, 4, -1, -2, -3, -4]])
    zero = torch.tensor([[1, 0], [0, -1]])  # [out, groups]
    tensors = {
        PACKED: pack_int32(q, 4),
        SCALE: torch.ones(2, 2),
        SHAPE: torch.tensor([2, 8]),
        ZERO: pack_int32(zero.T.contiguous(), 4).T.contiguous(),  # packed along dim 0
    }
    w = dequantize_packed(tensors, scheme)
    assert w.tolist() == [[2, 2, 2, 2, 0, 0, 0, 0], [1, 2, 3, 4, 0, -1, -2, -3]]


def test_fp8_per_channel_and_per_block():
    weight = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 1.5, 2.0]]).to(torch.float8_e4m3fn)
    channel = WeightScheme("float-quantized", 8, "float", strategy="channel")
    assert dequantize_float(weight, torch.tensor([[2.0], [4.0]]), channel).tolist() == [
        [2.0, 4.0, 6.0, 8.0],
        [2.0, 4.0, 6.0, 8.0],
    ]
    block = WeightScheme("float-quantized", 8, "float", strategy="block", block_structure=(1, 2))
    assert dequantize_float(weight, torch.tensor([[1.0, 10.0], [2.0, 20.0]]), block).tolist() == [
        [1.0, 2.0, 30.0, 40.0],
        [1.0, 2.0, 30.0, 40.0],
    ]


def test_config_groups_and_refusals():
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "experts": {"targets": ["re:.*experts.*"], "weights": {"num_bits": 4, "type": "int", "group_size": 32}},
                "attention": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "int"}},
            },
            "ignore": ["lm_head"],
        }
    }
    fmt = read_compressed_config(config)
    assert fmt is not None and fmt.scheme_of("model.layers.0.mlp.experts.3.up_proj").num_bits == 4
    assert fmt.scheme_of("model.layers.0.self_attn.q_proj").num_bits == 8
    with pytest.raises(MoePruneError, match="cannot tell which of 2 config groups"):
        fmt.scheme_of("model.layers.0.mlp.shared_expert.up_proj")
    config["quantization_config"]["format"] = "mxfp4-pack-quantized"
    with pytest.raises(MoePruneError, match="'mxfp4-pack-quantized'"):
        read_compressed_config(config)
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"  # read, but these are int4 weights
    with pytest.raises(MoePruneError, match="group 'experts' is nvfp4-pack-quantized .* symmetric fp4 weights in groups of 16"):
        read_compressed_config(config)
    assert read_compressed_config({"quantization_config": {"quant_method": "fp8"}}) is None
