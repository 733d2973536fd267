"""The safetensors header part of the quantized byte model (quantize/pricing.py), by hand:
an entry is `,"name":{"dtype":"D","shape":[a,b],"data_offsets":[s,e]}`, 46 bytes of punctuation
and keys plus the name, the dtype, the shape's digits and both offsets' digits. The tests on real
llm-compressor outputs (tests/quantize, quant_env) check that the bound is at least what is
written and over it by the offsets' digits only."""

from __future__ import annotations

import pytest
import torch

from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.quantize.pricing import entry_bytes, linear_tensors, quantized_weight_bytes
from moeprune.quantize.schemes import SCHEMES, QuantizeOptions
from moeprune.shards.weight_bytes import cast_weight_bytes

pytestmark = pytest.mark.unit

SIZES = {"I32": 4, "F32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1, "BF16": 2}


def test_one_entry_counted_by_hand():
    # ,  "m.q.weight_packed"  :  {"dtype":"I32",  "shape":[32,8],  "data_offsets":[99999,99999]}
    # 1 + 19                + 1 + 15            + 15              + 29                          = 80
    assert entry_bytes("m.q.weight_packed", "I32", (32, 8), 5) == 80
    assert entry_bytes("m.q.weight_packed", "I32", (32, 8), 6) == 82  # one digit more per offset


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_the_tensors_listed_weigh_the_schemes_bytes(scheme):
    """The header's tensors of one Linear and `Scheme.linear_bytes` describe the same layout."""
    options = QuantizeOptions(scheme, "rtn", None if scheme in ("fp8-dynamic", "nvfp4a16") else 32)
    tensors = linear_tensors(options, 48, 64, "F32")
    nbytes = sum(SIZES[d] * int(torch.tensor(shape).prod()) for _, d, shape in tensors)
    assert nbytes == SCHEMES[scheme].linear_bytes(48, 64, options.group, 4)


def test_an_experts_entries_counted_by_hand(tmp_path):
    """A tiny qwen3_moe (hidden 32, experts 16 wide, 8 a layer) saved in fp32, w4a16 in groups of
    16: one expert's bytes beyond its neurons are its three weight_shape tensors (3 x 16) plus its
    nine header entries, named under the longest index (8: `model.layers.0.mlp.experts.8.`, 29
    characters) with 6-digit offsets (the unquantized tensors' bytes have 6 digits):
    gate and down  weight_packed 46 + 52 + 3 + 4 + 12 = 117 (I32 [16,4] / [32,2])
                   weight_scale  46 + 51 + 3 + 4 + 12 = 116 (F32 [16,2] / [32,1])
                   weight_shape  46 + 51 + 3 + 1 + 12 = 113 (I64 [2])
    up             two characters shorter a name: 115 + 114 + 111."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[])
    model.save_pretrained(tmp_path)
    moe = MoEModel(model)
    size = cast_weight_bytes(tmp_path, moe, torch.float32)
    assert size.saved is not None and len(str(size.total - size.saved.header)) == 6
    quantized = quantized_weight_bytes(size, moe, QuantizeOptions("w4a16", "rtn", 16), 4)
    names = 2 * (117 + 116 + 113) + (115 + 114 + 111)
    assert [lay.per_expert for lay in quantized.layers] == [3 * 16 + names] * 2 == [1080, 1080]
