"""moeprune decodes each quantized format as the format's own library does, bit for bit, so that
scores, `eval`, the modeling files and the stock stacks compute the same numbers:

- compressed-tensors in the scale's dtype (its `dequantize`: codes cast to the scale's dtype, zero
  point subtracted and scale multiplied there; a bf16 scale gives bf16 weights, each product
  rounded once), NVFP4 in bf16 (the fp8 scale over the float32 global scale in float32, the
  product rounded to float32 then bf16), checked against the library in .venv (the dev extra
  installs it) and by hand (test_decode_vllm_library.py: against the release vLLM's environment pins);
- block-scaled fp8 (`weight_scale_inv`) and MXFP4 as transformers dequantizes them while loading
  (float32 products, cast to the parameter's dtype), checked against its own functions.

Every comparison is `torch.equal` on the dtype and every value.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from moeprune.quant.compressed import (
    GLOBAL_SCALE,
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    WeightScheme,
    dequantize_float,
    dequantize_nvfp4,
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


def _nvfp4_case(seed: int, rows: int = ROWS, cols: int = COLS):
    """The stored tensors of one random nvfp4 weight: every byte value (so all 16 codes in both
    nibbles), fp8 scales spread over decades, a float32 [1] global scale as llm-compressor writes."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randperm(256, generator=g).repeat(rows * cols // 2 // 256 + 1)[: rows * cols // 2]
    scale = torch.rand(rows, cols // 16, generator=g) * torch.logspace(-3, 2, cols // 16) + 2**-6
    glob = torch.rand(1, generator=g) * 5000 + 1
    return {
        PACKED: packed.reshape(rows, cols // 2).to(torch.uint8),
        SCALE: scale.to(torch.float8_e4m3fn),
        GLOBAL_SCALE: glob.to(torch.float32),
    }


def test_nvfp4_by_hand():
    """Byte 0x8F holds code 15 (-6) in its low nibble, read first, and code 8 (-0) in its high one;
    the 16 codes are E2M1_VALUES. The global scale divides: fp8 scale 2 over global scale 0.5 is a
    step of 4 for the first 16 inputs, 0.5 / 0.5 = 1 for the next 16. The result is bf16 whatever
    the scales' dtypes (the library unpacks to bf16)."""
    codes = torch.arange(16)
    packed = (codes[0::2] | codes[1::2] << 4).repeat(2)[None].to(torch.uint8)  # [1, 16]: 32 inputs
    scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    w = dequantize_nvfp4({PACKED: packed, SCALE: scale, GLOBAL_SCALE: torch.tensor([0.5])})
    assert w.dtype == torch.bfloat16 and w.shape == (1, 32)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert w[0].tolist() == [4 * v for v in table] + table
    assert torch.signbit(w[0, 8]) and not torch.signbit(w[0, 0])  # code 8 is -0
    one = dequantize_nvfp4(
        {
            PACKED: torch.tensor([[0x8F] * 8], dtype=torch.uint8),
            SCALE: torch.tensor([[1.0]]).to(torch.float8_e4m3fn),
            GLOBAL_SCALE: torch.tensor([1.0]),
        }
    )
    assert one[0, :2].tolist() == [-6.0, -0.0]
    # 3 * (1 / 3): the quotient in float32 (0.3333333432...), the product 1.0000000298 in
    # float32, rounded to bf16 1.0; not 3 * bf16(1/3) = 3 * 0.333984375 = 1.001953125
    third = {
        PACKED: torch.tensor([[0x55] * 8], dtype=torch.uint8),  # code 5 = 3.0 everywhere
        SCALE: torch.tensor([[1.0]]).to(torch.float8_e4m3fn),
        GLOBAL_SCALE: torch.tensor([3.0]),
    }
    assert dequantize_nvfp4(third).unique().tolist() == [1.0]


@pytest.mark.parametrize("glob", ["float32[1]", "float32[]", "bfloat16[1]"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_equals_the_library(seed, glob):
    """compressed-tensors' NVFP4PackedCompressor.decompress, bit for bit: llm-compressor stores a
    float32 [1] global scale (its quotient by the bf16 scale is float32 by torch's promotion); a
    0-dim or bf16 one keeps the quotient in bf16, and moeprune follows the library there too."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    tensors = _nvfp4_case(seed)
    dtype, shape = glob.split("[")
    tensors[GLOBAL_SCALE] = (
        tensors[GLOBAL_SCALE].to(getattr(torch, dtype)).reshape((1,) if shape == "1]" else ())
    )
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    theirs = NVFP4PackedCompressor.decompress(
        dict(tensors), QuantizationScheme(targets=["Linear"], weights=args)
    )
    ours = dequantize_nvfp4(tensors)
    assert ours.dtype == theirs["weight"].dtype == torch.bfloat16
    assert torch.equal(ours, theirs["weight"])
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs["weight"]))  # -0 where the library has it


@pytest.mark.parametrize("shape", [(2, 5, 64), (5, 64), (2, 3, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dynamic_inputs_equal_the_librarys_forward(shape, dtype):
    """compressed-tensors' forward quantizes an FP8-dynamic Linear's input per token (a 2-D input:
    one scale, as the library reduces it); moeprune's pre-hook computes it bit for bit, an
    all-zero token included (the dtype's eps as its scale)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    from moeprune.serve.moeprune_quantized import fake_quantize_fp8_tokens

    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x[..., 0, :] = 0  # an all-zero token (a whole zero row of a 2-D input)
    module = torch.nn.Linear(shape[-1], 4)
    module.quantization_status = QuantizationStatus.FROZEN
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    theirs = forward_quantize(module, x, "input", args)
    ours = fake_quantize_fp8_tokens(x)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs) and not torch.equal(ours, x)


def test_the_inputs_quantized_are_the_linears_the_config_targets():
    """Class and "re:" targets, a pattern's group taking precedence, `ignore`, and never a routed
    expert (fused in transformers 5, no Linear there): the Linears hooked and only they."""
    from moeprune.models.factory import tiny_model
    from moeprune.serve.moeprune_quantized import quantize_linear_inputs, rounds_fp8_experts_to_bf16

    model = tiny_model("deepseek_v3", qk_rope_head_dim=16)
    fp8 = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    quant = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "base": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}, "input_activations": fp8},
            "o": {"targets": [r"re:.*self_attn\.o_proj$"], "weights": {"num_bits": 4, "type": "int"}},
        },
        "ignore": ["lm_head", r"re:.*layers\.0\.mlp\..*"],
    }
    hooked = set(quantize_linear_inputs(model, quant, "test"))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {n for n in linears if n != "lm_head" and not n.endswith("o_proj") and ".layers.0.mlp." not in n}
    assert hooked == want and any(".shared_experts." in n for n in hooked)
    with pytest.raises(ValueError, match="input_activations"):
        quant["config_groups"]["base"]["input_activations"] = dict(fp8, dynamic=False)
        quantize_linear_inputs(model, quant, "test")
    assert rounds_fp8_experts_to_bf16("5.20.2") and rounds_fp8_experts_to_bf16("5.16.1")
    assert not rounds_fp8_experts_to_bf16("5.21.0") and not rounds_fp8_experts_to_bf16("5.23.0.dev0")
