"""MXFP4 weights, the format gpt-oss ships its experts in, read and written with torch alone.

The format (the OCP Microscaling spec's MXFP4, as gpt-oss stores it): `config.json` carries
`quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`, and each
quantized expert parameter `<name>` (in memory [E, in, out], e.g. `experts.gate_up_proj`) is
stored as its transpose's codes: `<name>_blocks` uint8 [E, out, in/32, 16], two 4-bit e2m1
values per byte (the low nibble first), and `<name>_scales` uint8 [E, out, in/32], one shared
power-of-two exponent per 32 values (e8m0: 2^(byte - 127)). The dequantized parameter is
`(e2m1 value * 2^(scale - 127))` reshaped to [E, out, in] and transposed to [E, in, out]. Every
product is exact in float32 (a 2-bit mantissa times a power of two), so dequantizing is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.errors import MoePruneError
from moeprune.serve.moeprune_quantized import E2M1_VALUES, MXFP4_BLOCKS, MXFP4_GROUP, MXFP4_SCALES
from moeprune.serve.moeprune_quantized import dequantize_mxfp4 as decode_mxfp4

GROUP = MXFP4_GROUP  # values sharing one scale
BLOCKS_SUFFIX, SCALES_SUFFIX = MXFP4_BLOCKS, MXFP4_SCALES
_E2M1_EMAX = 2  # exponent of e2m1's largest normal value (6 = 1.5 * 2^2)


@dataclass(frozen=True)
class Mxfp4Format:
    """An mxfp4 `quantization_config` as moeprune needs it (`raw`: as config.json has it)."""

    modules_to_not_convert: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def saved_as(self) -> str:
        """How reports name weights kept in this format."""
        return "mxfp4 (e2m1 codes, one e8m0 scale per 32 values)"


def read_mxfp4_config(config_dict: dict[str, Any]) -> Mxfp4Format | None:
    """The mxfp4 format of a checkpoint from its config.json dict (None: another method or none)."""
    quant = config_dict.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "mxfp4":
        return None
    return Mxfp4Format(tuple(str(s) for s in quant.get("modules_to_not_convert") or ()), dict(quant))


def stored_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (blocks, scales) shapes that store an in-memory parameter of `shape` [..., in, out]."""
    *lead, cols, rows = shape
    if cols % GROUP:
        raise MoePruneError(
            f"mxfp4 quantizes groups of {GROUP} values; a {list(shape)} weight has {cols} inputs"
        )
    return (*lead, rows, cols // GROUP, GROUP // 2), (*lead, rows, cols // GROUP)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The in-memory parameter [..., in, out] that `<name>_blocks` [..., out, G, 16] and
    `<name>_scales` [..., out, G] store, computed in float32 (exact), then cast to `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MoePruneError(f"mxfp4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise MoePruneError(
            f"mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks are "
            f"[..., rows, groups, {GROUP // 2}] and scales [..., rows, groups]"
        )
    return decode_mxfp4(blocks, scales).to(dtype).contiguous()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An in-memory parameter `w` [..., in, out] as (blocks, scales) such that `dequantize_mxfp4`
    gives it back to mxfp4 precision (for writing test checkpoints; moeprune never re-quantizes).

    Per group of 32 inputs, the spec's shared exponent `floor(log2(amax)) - 2` puts the largest
    magnitude in e2m1's top binade, then each value is rounded to the nearest e2m1 value (ties to
    the even code) and clamped to +-6. An all-zero group gets the smallest scale the byte
    holds (2^-127) and zero codes.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise MoePruneError(
            f"mxfp4 quantization takes a float [..., in, out] tensor, got {w.dtype} {tuple(w.shape)}"
        )
    rows_first = w.detach().to(torch.float32).transpose(-1, -2)  # [..., out, in]
    stored_shapes(tuple(w.shape))  # the group size check
    groups = rows_first.unflatten(-1, (-1, GROUP))  # [..., out, G, 32]
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - _E2M1_EMAX, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = torch.ldexp(groups, (-exponent).to(torch.int32)[..., None]).clamp(-6.0, 6.0)
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    distance = (scaled.abs()[..., None] - table).abs()  # [..., 32, 8]
    nearest = distance.argmin(dim=-1)  # first minimum: the lower (even) code on a tie
    codes = (nearest + 8 * torch.signbit(scaled).long()).to(torch.uint8)  # -0 keeps its sign code
    pairs = codes.unflatten(-1, (GROUP // 2, 2))
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return blocks, (exponent + 127).to(torch.uint8).contiguous()


def mxfp4_quantization_config(modules_to_not_convert: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The `quantization_config` gpt-oss writes for mxfp4 experts."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(modules_to_not_convert)}
