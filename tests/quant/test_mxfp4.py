"""The MXFP4 arithmetic of moeprune.quant.mxfp4 (gpt-oss's expert format), on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from moeprune.errors import MoePruneError
from moeprune.quant.mxfp4 import (
    E2M1_VALUES,
    dequantize_mxfp4,
    quantize_mxfp4,
    read_mxfp4_config,
    stored_shapes,
)

pytestmark = pytest.mark.unit


def test_dequantize_by_hand():
    """Two experts, one output row of 32 inputs each: bytes hold (low, high) nibble pairs."""
    blocks = torch.zeros(2, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21  # low 1 (0.5), high 2 (1.0)
    blocks[1, 0, 0, 15] = 0xF8  # low 8 (-0.0), high 15 (-6.0): the last two inputs
    scales = torch.tensor([[[128]], [[126]]], dtype=torch.uint8)  # 2^1 and 2^-1
    w = dequantize_mxfp4(blocks, scales)
    assert w.shape == (2, 32, 1)  # [E, in, out]: the stored [E, out, in] transposed
    assert w[0, :2, 0].tolist() == [1.0, 2.0] and not w[0, 2:].any()
    assert w[1, 30:, 0].tolist() == [-0.0, -3.0] and torch.signbit(w[1, 30, 0])
    assert not w[1, :30].any()


def test_every_code_and_a_wide_range_of_scales_decode_exactly():
    """e2m1 times a power of two is exact in float32: compared with ldexp on the table."""
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2).reshape(1, 1, 1, 16)
    for scale in (1, 100, 127, 150, 200):  # (2^127 * 6 would overflow float32, as it does for everyone)
        w = dequantize_mxfp4(blocks, torch.tensor([[[scale]]], dtype=torch.uint8))
        expected = [v * 2.0 ** (scale - 127) for v in E2M1_VALUES] * 2
        assert w[0, :, 0].tolist() == expected


def test_quantize_round_trips_representable_weights_and_is_idempotent():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 64, 40), generator=g)  # [E, in, out] of representable values
    exponents = torch.randint(-8, 8, (3, 2, 40), generator=g)  # one per 32 inputs and output
    values = torch.tensor(E2M1_VALUES)[codes]
    values[:, 0::32] = 6.0  # every group's amax at the top of e2m1: the shared exponent is exact
    w = torch.ldexp(values, exponents.repeat_interleave(32, dim=1))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    assert (blocks.shape, scales.shape) == stored_shapes((3, 64, 40))
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)
    noisy = torch.randn(3, 64, 40, generator=g)
    once = dequantize_mxfp4(*quantize_mxfp4(noisy))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(once)), once)


def test_quantization_error_is_half_a_step_of_e2m1():
    """Below 4 * 2^e the values are within half an e2m1 step of the input; the step is at most
    2^e (between 4 and 6 it is 2 * 2^e, and amax in [6, 8) * 2^e is clamped to 6 * 2^e)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 32, 8, generator=g)
    back = dequantize_mxfp4(*quantize_mxfp4(w))
    amax = w.abs().amax(dim=1, keepdim=True)
    unit = torch.exp2(torch.floor(torch.log2(amax)) - 2)  # 2^e, the group's scale
    small = w.abs() < 4 * unit
    assert ((back - w).abs()[small] <= 0.5 * unit.expand_as(w)[small] + 1e-12).all()
    assert ((back - w).abs() <= 2 * unit).all()


def test_matches_transformers_dequantizer():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 48, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 48, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = mxfp4._convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs)


def test_bad_inputs_are_refused():
    with pytest.raises(MoePruneError, match="uint8"):
        dequantize_mxfp4(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, dtype=torch.uint8))
    with pytest.raises(MoePruneError, match="do not fit"):
        dequantize_mxfp4(torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.zeros(1, 1, 1, dtype=torch.uint8))
    with pytest.raises(MoePruneError, match="groups of 32"):
        quantize_mxfp4(torch.zeros(2, 48, 4))


def test_read_mxfp4_config():
    fmt = read_mxfp4_config({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}})
    assert fmt is not None and fmt.modules_to_not_convert == ("lm_head",)
    assert read_mxfp4_config({"quantization_config": {"quant_method": "fp8"}}) is None
    assert read_mxfp4_config({}) is None
