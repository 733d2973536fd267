"""The block-scaled FP8 arithmetic and config reading of moeprune.quant.fp8, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from moeprune.errors import MoePruneError
from moeprune.quant import (
    FP8_DTYPE,
    Fp8Format,
    dequantize_blocks,
    fp8_quantization_config,
    quantize_blocks,
    read_fp8_config,
    scale_shape,
)

pytestmark = pytest.mark.unit


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors compared byte for byte (-0 and +0 differ, as they do on disk)."""
    return t.view(torch.uint8)


def test_quantize_by_hand_with_partial_blocks():
    # 3x3 in 2x2 blocks: a full block, a 2x1 column, a 1x2 row and a 1x1 corner.
    w = torch.tensor([[7.0, -3.5, -14.0], [0.5, 1.1, 2.0], [0.875, 0.4375, 0.0]])
    fp8, scale_inv = quantize_blocks(w, (2, 2))
    # amax per block: 7, 14, 0.875, 0 -> scale_inv = amax / 448 = 1/64, 1/32, 1/512; 1 for the zero block
    assert scale_inv.dtype == torch.float32
    assert scale_inv.tolist() == [[1 / 64, 1 / 32], [1 / 512, 1.0]]
    # w / scale_inv: 1.1 * 64 = 70.4 rounds to 72 (e4m3 steps by 8 in [64, 128)); the others are exact
    assert fp8.dtype == FP8_DTYPE
    assert fp8.float().tolist() == [[448, -224, -448], [32, 72, 64], [448, 224, 0]]
    assert dequantize_blocks(fp8, scale_inv, (2, 2)).tolist() == [
        [7.0, -3.5, -14.0],
        [0.5, 1.125, 2.0],
        [0.875, 0.4375, 0.0],
    ]


def test_dequantize_by_hand_uses_the_block_size_not_the_grid():
    # 3 rows in blocks of 2: rows 0-1 take scale row 0, row 2 scale row 1 (a grid-derived block of
    # ceil(3/2) = 2 would agree here, so also 5 rows in blocks of 4: rows 0-3, then row 4)
    fp8 = torch.ones(5, 3).to(FP8_DTYPE)
    scale_inv = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    out = dequantize_blocks(fp8, scale_inv, (4, 2))
    assert out.tolist() == [[2, 2, 3]] * 4 + [[5, 5, 7]]
    assert out.dtype == torch.float32
    assert dequantize_blocks(fp8, scale_inv, (4, 2), dtype=torch.bfloat16).dtype == torch.bfloat16


def representable(shape, block, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 values (nan excluded) with +-448 in every block, and power-of-two scales:
    weights that fp8 holds exactly, and whose quantization must give them back bit for bit."""
    raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x38  # e4m3fn's nan codes -> 1.0
    fp8 = raw.view(FP8_DTYPE).clone()
    rows, cols = shape
    for r in range(0, rows, block[0]):
        for c in range(0, cols, block[1]):
            fp8[r, c] = 448.0 if (r + c) % 2 else -448.0
    exponents = torch.randint(-20, 4, scale_shape(shape, block), generator=generator)
    return fp8, torch.exp2(exponents.float())


@pytest.mark.parametrize(("shape", "block"), [((32, 48), (16, 16)), ((40, 36), (16, 16)), ((7, 5), (4, 3))])
def test_representable_weights_round_trip_exactly(shape, block):
    generator = torch.Generator().manual_seed(0)
    fp8, scale_inv = representable(shape, block, generator)
    w = dequantize_blocks(fp8, scale_inv, block)
    again, again_scale = quantize_blocks(w, block)
    assert torch.equal(bits(again), bits(fp8))
    assert torch.equal(again_scale, scale_inv)
    assert torch.equal(dequantize_blocks(again, again_scale, block), w)
    # bf16 input: the same numbers (fp8 values times a power of two fit bf16), the same result
    again16, scale16 = quantize_blocks(w.to(torch.bfloat16), block)
    assert torch.equal(bits(again16), bits(fp8)) and torch.equal(scale16, scale_inv)


def test_any_scale_requantizes_to_the_same_values():
    """With arbitrary scales the recomputed scale may move by an ulp, never the fp8 values."""
    generator = torch.Generator().manual_seed(1)
    fp8, _ = representable((40, 36), (16, 16), generator)
    scale_inv = torch.rand(scale_shape((40, 36), (16, 16)), generator=generator) * 0.01 + 1e-4
    w = dequantize_blocks(fp8, scale_inv, (16, 16))
    again, again_scale = quantize_blocks(w, (16, 16))
    assert torch.equal(bits(again), bits(fp8))
    torch.testing.assert_close(again_scale, scale_inv, rtol=2**-22, atol=0)


def test_quantization_error_is_within_fp8_precision():
    """Every element within half an e4m3 step: 2^-4 of its magnitude (3 mantissa bits), or half
    the smallest subnormal step (2^-10 of its block's scale) near zero; amax lands on +-448."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(3, 40, 36, generator=generator) * torch.logspace(-6, 2, 36)
    fp8, scale_inv = quantize_blocks(w, (16, 16))
    assert scale_inv.shape == (3, 3, 3)
    out = dequantize_blocks(fp8, scale_inv, (16, 16))
    scale = scale_inv.repeat_interleave(16, -2)[:, :40].repeat_interleave(16, -1)[..., :36]
    bound = w.abs() * 2**-4 + scale * 2**-10
    assert bool(((out - w).abs() <= bound * (1 + 1e-6)).all())
    assert float(fp8.float().abs().amax()) == 448.0
    # leading dims are independent matrices
    for i in range(3):
        one, one_scale = quantize_blocks(w[i], (16, 16))
        assert torch.equal(bits(one), bits(fp8[i])) and torch.equal(one_scale, scale_inv[i])


def test_zero_and_underflowing_blocks_get_scale_one():
    w = torch.zeros(4, 8)
    w[:, 4:] = 1e-44  # amax / 448 underflows float32 to 0
    fp8, scale_inv = quantize_blocks(w, (4, 4))
    assert scale_inv.tolist() == [[1.0, 1.0]]
    assert torch.equal(dequantize_blocks(fp8, scale_inv, (4, 4)), torch.zeros(4, 8))


def test_bad_inputs_are_refused():
    with pytest.raises(MoePruneError, match="inf or nan"):
        quantize_blocks(torch.tensor([[1.0, float("inf")]]), (1, 2))
    with pytest.raises(MoePruneError, match="block size"):
        quantize_blocks(torch.ones(2, 2), (0, 2))
    fp8, scale_inv = quantize_blocks(torch.ones(40, 36), (16, 16))
    with pytest.raises(MoePruneError, match=r"expected \(3, 3\)"):
        dequantize_blocks(fp8, scale_inv[:2], (16, 16))
    with pytest.raises(MoePruneError, match=r"expected \(2, 3\)"):  # the grid of 20x16 blocks
        dequantize_blocks(fp8, scale_inv, (20, 16))
    with pytest.raises(MoePruneError, match="float8"):  # already dequantized: not scaled twice
        dequantize_blocks(torch.ones(40, 36), scale_inv, (16, 16))


def test_ue8m0_scales_decode_to_powers_of_two():
    fp8 = torch.ones(2, 2).to(FP8_DTYPE)
    as_bytes = torch.tensor([[127 - 3]], dtype=torch.uint8)
    assert dequantize_blocks(fp8, as_bytes, (2, 2)).tolist() == [[0.125, 0.125]] * 2
    e8m0 = torch.tensor([[0.125]]).to(torch.float8_e8m0fnu)
    assert dequantize_blocks(fp8, e8m0, (2, 2)).tolist() == [[0.125, 0.125]] * 2


DEEPSEEK = {
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
}


def test_read_fp8_config():
    fmt = read_fp8_config(DEEPSEEK)
    assert fmt == Fp8Format(block=(128, 128))
    assert fmt is not None and fmt.raw == DEEPSEEK["quantization_config"]
    minimax = {
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "float8_e4m3fn",
            "weight_block_size": [128, 128],
            "ignored_layers": ["gate", "e_score_correction_bias", "lm_head"],
        }
    }
    fmt = read_fp8_config(minimax)
    assert fmt is not None and fmt.modules_to_not_convert == ("gate", "e_score_correction_bias", "lm_head")
    assert read_fp8_config({"model_type": "qwen3_moe"}) is None
    assert read_fp8_config({"quantization_config": {"quant_method": "mxfp4"}}) is None
    written = {"quantization_config": fp8_quantization_config((16, 8), ["lm_head"])}
    assert read_fp8_config(written) == Fp8Format(block=(16, 8), modules_to_not_convert=("lm_head",))


@pytest.mark.parametrize("block", [None, [128], [0, 128], [128.0, 128], [True, 1], "128"])
def test_fp8_config_without_a_valid_block_size_is_refused_in_one_line(block):
    quant = {k: v for k, v in DEEPSEEK["quantization_config"].items() if k != "weight_block_size"}
    if block is not None:
        quant["weight_block_size"] = block
    with pytest.raises(MoePruneError, match="weight_block_size") as caught:
        read_fp8_config({"quantization_config": quant})
    assert "\n" not in str(caught.value)


def test_other_fp8_encodings_are_refused():
    with pytest.raises(MoePruneError, match="e5m2"):
        read_fp8_config({"quantization_config": {**DEEPSEEK["quantization_config"], "fmt": "e5m2"}})
    with pytest.raises(MoePruneError, match="scale_fmt"):
        read_fp8_config({"quantization_config": {**DEEPSEEK["quantization_config"], "scale_fmt": "e4m3"}})
