"""moeprune decodes each quantized format as the format's own library does, bit for bit, so that
scores, `eval`, the modeling files and the stock stacks compute the same numbers:

- compressed-tensors in the scale's dtype (its `dequantize`: codes cast to the scale's dtype, zero
  point subtracted and scale multiplied there; a bf16 scale gives bf16 weights, each product
  rounded once), checked against the library in .venv (the dev extra installs it) and by hand
  (test_decode_vllm_library.py: against the release vLLM's environment pins);
- block-scaled fp8 (`weight_scale_inv`) and MXFP4 as transformers dequantizes them while loading
  (float32 products, cast to the parameter's dtype), checked against its own functions.

Every comparison is `torch.equal` on the dtype and every value.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from moeprune.quant.compressed import (
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    WeightScheme,
    dequantize_float,
    dequantize_packed,
    pack_int32,
)
from moeprune.quant.fp8 import dequantize_blocks
from moeprune.quant.mxfp4 import dequantize_mxfp4

pytestmark = pytest.mark.unit

SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS, COLS = 16, 64  # 16 rows: the library's 4-bit unpacking of zero points needs 2+ packed rows


def _packed_case(bits: int, symmetric: bool, strategy: str, dtype: torch.dtype, seed: int):
    """(stored tensors, scheme) of one random pack-quantized [16, 64] weight, groups of 16."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if strategy == "group" else None
    groups = COLS // group if group else 1
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(low, high, (ROWS, COLS), generator=g)
    # scales spread over decades so that products land between bf16 values
    scale = (torch.rand(ROWS, groups, generator=g) * torch.logspace(-4, 0, groups)).to(dtype)
    tensors = {PACKED: pack_int32(q, bits), SCALE: scale, SHAPE: torch.tensor([ROWS, COLS])}
    if not symmetric:
        zero = torch.randint(low, high, (ROWS, groups), generator=g)
        tensors[ZERO] = pack_int32(zero.T.contiguous(), bits).T.contiguous()  # packed along the outputs
    return tensors, WeightScheme("pack-quantized", bits, "int", symmetric, strategy, group)


FLOAT_CASES = {  # name -> (strategy, scale shape, group size, block structure)
    "tensor": ("tensor", (1,), None, None),
    "channel": ("channel", (ROWS, 1), None, None),
    "group": ("group", (ROWS, 4), 16, None),
    "block": ("block", (2, 2), None, (8, 32)),
    "partial_block": ("block", (3, 3), None, (6, 24)),  # the last row and column of blocks partial
}


def _float_case(case: str, dtype: torch.dtype, seed: int):
    """(fp8 weight [16, 64], scale, scheme) of one FLOAT_CASES entry."""
    g = torch.Generator().manual_seed(seed)
    strategy, shape, group, block = FLOAT_CASES[case]
    weight = (torch.randn(ROWS, COLS, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = (torch.rand(*shape, generator=g) * 0.01 + 1e-4).to(dtype)
    return weight, scale, WeightScheme("float-quantized", 8, "float", True, strategy, group, block)


def library_pads_partial_blocks() -> bool:
    """compressed-tensors decodes partial blocks from 0.20 on (0.17 fails on them)."""
    major, minor = (int(part) for part in version("compressed-tensors").split(".")[:2])
    return (major, minor) >= (0, 20)


PACKED_PARAMS = [
    (bits, symmetric, strategy, dtype)
    for bits in (4, 8)
    for symmetric in (True, False)
    for strategy in ("group", "channel")
    for dtype in SCALE_DTYPES
]


def test_a_bf16_scale_gives_bf16_weights_rounded_once_by_hand():
    """bf16 keeps 8 significant bits. With the scale 1 + 2^-7 (1.0000001b):
    7 * it = 111.0000111b rounds up to 111.00010b = 7.0625 (the float32 product is 7.0546875);
    4, 2 and 1 times it are exact. Asymmetric, the codes minus the zero point -2 are 9, -2, 4, 3:
    9 * it = 1001.0001001b rounds down to 9.0625, and 3 * it = 11.0000011b is a tie that goes to
    the even neighbour, 11.000010b = 3.03125."""
    scale = torch.tensor([[1 + 2**-7]], dtype=torch.bfloat16)
    codes = torch.tensor([[7, -4, 2, 1]])
    tensors = {PACKED: pack_int32(codes, 4), SCALE: scale, SHAPE: torch.tensor([1, 4])}
    w = dequantize_packed(tensors, WeightScheme("pack-quantized", 4, "int", strategy="channel"))
    assert w.dtype == torch.bfloat16
    assert w.tolist() == [[7.0625, -4.03125, 2.015625, 1.0078125]]
    assert 7 * (1 + 2**-7) == 7.0546875  # the float32 product moeprune used to keep
    zero = pack_int32(torch.tensor([[-2]]), 4)  # one channel's zero point, packed along the outputs
    asym = WeightScheme("pack-quantized", 4, "int", symmetric=False, strategy="channel")
    assert dequantize_packed({**tensors, ZERO: zero}, asym).tolist() == [
        [9.0625, -2.015625, 4.03125, 3.03125]
    ]
    fp8 = torch.tensor([[7.0]]).to(torch.float8_e4m3fn)
    channel = WeightScheme("float-quantized", 8, "float", strategy="channel")
    assert dequantize_float(fp8, scale, channel).item() == 7.0625
    assert dequantize_float(fp8, scale.float(), channel).item() == 7.0546875  # a float32 scale: float32


@pytest.mark.parametrize("bits,symmetric,strategy,dtype", PACKED_PARAMS)
def test_pack_quantized_equals_the_library(bits, symmetric, strategy, dtype):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    tensors, scheme = _packed_case(bits, symmetric, strategy, dtype, seed=bits * 10 + symmetric)
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=scheme.group_size
    )
    theirs = PackedQuantizationCompressor.decompress(
        dict(tensors), QuantizationScheme(targets=["Linear"], weights=args)
    )["weight"]
    ours = dequantize_packed(tensors, scheme)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("case", sorted(FLOAT_CASES))
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_float_quantized_equals_the_library(case, dtype):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if case == "partial_block" and not library_pads_partial_blocks():
        pytest.skip("this compressed-tensors release does not decode partial blocks")
    weight, scale, scheme = _float_case(case, dtype, seed=len(case))
    args = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=scheme.strategy,
        group_size=scheme.group_size,
        block_structure=list(scheme.block_structure) if scheme.block_structure else None,
    )
    theirs = NaiveQuantizationCompressor.decompress(
        {"weight": weight, SCALE: scale}, QuantizationScheme(targets=["Linear"], weights=args)
    )["weight"]
    ours = dequantize_float(weight, scale, scheme)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_fp8_blocks_equal_transformers(scale_dtype, dtype):
    """transformers' Fp8Dequantize (what `from_pretrained` runs on a CPU): float32 products of the
    fp8 values and the float (or ue8m0 byte) scales, cast to the parameter's dtype."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(3, 32, 48, generator=g) * 200).to(torch.float8_e4m3fn)
    if scale_dtype == torch.uint8:
        scale = torch.randint(100, 140, (3, 2, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    else:
        scale = (torch.rand(3, 2, 3, generator=g) * 0.01 + 1e-5).to(scale_dtype)
    theirs = fp8.Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype)
    ours = dequantize_blocks(weight, scale, (16, 16), dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_mxfp4_equals_transformers(dtype):
    """transformers computes MXFP4 in the parameter's dtype (its e2m1 table in that dtype, then
    ldexp); moeprune's float32 values cast to it are the same, overflow to inf included."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 4, 9, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 255, (2, 4, 9), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 2, 100, 127, 140, 200, 253, 254])  # the extremes of e8m0
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)
