"""Block-scaled FP8 weights, the format of the largest MoE releases (DeepSeek-V3/R1, Qwen3-*-FP8,
GLM-4.x-FP8, MiniMax-M2), read and written with torch alone.

The format: `config.json` carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [B0, B1], ...}`, and every quantized Linear
`<name>.weight` [out, in] is stored as `float8_e4m3fn` beside `<name>.weight_scale_inv` float32
[ceil(out/B0), ceil(in/B1)], one scale per B0 x B1 block (the last row and column of blocks may be
partial). The dequantized weight is `fp8.float() * scale_inv` of the element's block, in float32.

Why here and not through transformers: on a CPU transformers dequantizes such a checkpoint while
loading it (to the model's dtype), so a pipeline that loads, prunes and saves writes full precision
and drops `quantization_config`. Keeping the quantization means reading and writing fp8 blocks
ourselves (a streamed score dequantizes one tensor at a time; a rewrite that drops experts copies
the kept experts' fp8 bytes and scales as they are, never re-quantizing them), so the arithmetic of
the format lives here, with nothing of moeprune's but its error type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from moeprune.errors import MoePruneError
from moeprune.serve.moeprune_quantized import FP8_SCALE_SUFFIX, dequantize_fp8_blocks

FP8_DTYPE = torch.float8_e4m3fn
FP8_SAVE_DTYPE = "float8_e4m3fn"  # the save dtype that keeps an fp8 input's blocks (--save-dtype fp8)
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: the largest finite e4m3fn value
SCALE_SUFFIX = FP8_SCALE_SUFFIX  # `<name>.weight` -> `<name>.weight_scale_inv`, as the releases name it
# `fmt` spellings the releases use for e4m3fn (DeepSeek and Qwen write "e4m3", MiniMax the dtype)
_E4M3_NAMES = ("e4m3", "e4m3fn", "float8_e4m3fn")
_SCALE_FORMATS = ("float", "ue8m0")  # transformers' `scale_fmt`: fp32 scales, or powers of two


@dataclass(frozen=True)
class Fp8Format:
    """An fp8 `quantization_config` as moeprune needs it.

    `block` is `weight_block_size` (rows, columns); `modules_to_not_convert` the release's skip
    list (MiniMax spells it `ignored_layers`), empty when absent; `raw` the dict exactly as it
    stood in config.json, to be written back unchanged by a stage that keeps the quantization.
    """

    block: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"
    scale_fmt: str = "float"
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def saved_as(self) -> str:
        """How reports name weights kept in this format ("float8_e4m3fn (fp8, 128x128 blocks)")."""
        return f"{FP8_SAVE_DTYPE} (fp8, {self.block[0]}x{self.block[1]} blocks)"


def scale_name(weight_name: str) -> str:
    """`<name>.weight` -> `<name>.weight_scale_inv`, the releases' (and transformers') naming."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` [..., out, in]: [..., ceil(out/B0), ceil(in/B1)]."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)
        or min(block) <= 0
    ):
        raise MoePruneError(f"an fp8 block size is two positive integers, got {tuple(block)!r}")
    return int(block[0]), int(block[1])


def _padded_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`w` [..., out, in] zero-padded to whole blocks and viewed as [..., R, B0, C, B1]."""
    rows, cols = w.shape[-2:]
    grid_r, grid_c = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    pad_r, pad_c = grid_r * block[0] - rows, grid_c * block[1] - cols
    padded = F.pad(w, (0, pad_c, 0, pad_r)) if pad_r or pad_c else w
    return padded.unflatten(-1, (grid_c, block[1])).unflatten(-3, (grid_r, block[0]))


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [..., out, in] (any float dtype) as (`float8_e4m3fn` [..., out, in], float32 scale_inv
    [..., ceil(out/B0), ceil(in/B1)]) such that `dequantize_blocks` gives back `w` to fp8 precision.

    Per block, in float32: `scale_inv = amax(|w|) / 448` (the block's largest magnitude lands on
    e4m3fn's largest finite value, the releases' and DeepSeek's own convention), then
    `fp8 = clamp(w / scale_inv, -448, 448)` cast with round-to-nearest-even (the clamp only catches
    the one-ulp overshoot of the division). Partial last blocks take the amax of the elements they
    have. A block whose amax is 0, or so small that amax / 448 underflows float32 to 0, gets
    `scale_inv = 1`: its values (all below 6.3e-43) then quantize to 0, it dequantizes to exact
    zeros and never divides by zero (transformers' own quantizer also writes 1 for zero blocks).
    Non-finite weights are refused: their block's scale would be inf or nan and poison the whole
    block on dequantization.
    """
    block = _check_block(block)
    if w.dim() < 2 or not w.is_floating_point():
        raise MoePruneError(
            f"fp8 block quantization takes a float [..., out, in] tensor, got {w.dtype} {tuple(w.shape)}"
        )
    w32 = w.detach().to(torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise MoePruneError("cannot quantize a weight holding inf or nan to fp8")
    rows, cols = w32.shape[-2:]
    amax = _padded_blocks(w32.abs(), block).amax(dim=(-3, -1))  # [..., R, C]; the padding is 0
    scale_inv = amax / FP8_MAX
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    expanded = scale_inv.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block[1], dim=-1)[..., :cols]
    fp8 = (w32 / expanded).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return fp8, scale_inv.contiguous()


def dequantize_blocks(
    fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The spec's dequantization: every element of `fp8` [..., out, in] times its block's scale,
    computed in float32 (`fp8.float() * scale_inv`), then cast to `dtype`.

    `scale_inv` must be exactly the grid [..., ceil(out/B0), ceil(in/B1)]: the last blocks are
    partial, and the block size comes from the config, never from the grid (a grid of 3 rows over
    40 rows does not say whether blocks are 16 or 14 rows). Only float8 weights are accepted, so a
    weight that was already dequantized is not scaled a second time.
    """
    block = _check_block(block)
    if fp8.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or fp8.dim() < 2:
        raise MoePruneError(
            f"dequantize_blocks takes a float8 [..., out, in] weight, got {fp8.dtype} {tuple(fp8.shape)}"
        )
    expected = scale_shape(fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise MoePruneError(
            f"fp8 scales of shape {tuple(scale_inv.shape)} do not fit a {tuple(fp8.shape)} weight in "
            f"{block[0]}x{block[1]} blocks (expected {expected})"
        )
    if scale_inv.dtype != torch.uint8 and not scale_inv.is_floating_point():
        raise MoePruneError(f"fp8 scales are floats (or ue8m0 bytes), got {scale_inv.dtype}")
    return dequantize_fp8_blocks(fp8, scale_inv, block).to(dtype).contiguous()


def _block_size(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise MoePruneError(
            f"this fp8 checkpoint's quantization_config has weight_block_size {value!r}: moeprune reads "
            "block-scaled fp8 only, with two positive integers there (e.g. [128, 128])"
        )
    return int(value[0]), int(value[1])


def read_fp8_config(config_dict: dict[str, Any]) -> Fp8Format | None:
    """The fp8 format of a checkpoint from its config.json (the top-level dict, where transformers
    reads `quantization_config`), or None when it has no quantization_config or another method's
    (those are not this module's to judge; a caller must refuse them itself).

    Refused in one line (MoePruneError): `weight_block_size` missing, null (per-tensor scales) or
    not two positive integers; a `fmt` other than e4m3; a `scale_fmt` other than float or ue8m0.
    """
    quant = config_dict.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    if str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    block = _block_size(quant.get("weight_block_size"))
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt not in _E4M3_NAMES:
        raise MoePruneError(
            f"this fp8 checkpoint stores {fmt!r} weights: moeprune reads e4m3 (float8_e4m3fn) only"
        )
    scale_fmt = str(quant.get("scale_fmt", "float")).lower()
    if scale_fmt not in _SCALE_FORMATS:
        raise MoePruneError(
            f"this fp8 checkpoint has scale_fmt {scale_fmt!r}: moeprune reads float or ue8m0 scales"
        )
    skip = quant.get("modules_to_not_convert")
    if skip is None:
        skip = quant.get("ignored_layers")  # MiniMax's name for the same list
    return Fp8Format(
        block=block,
        modules_to_not_convert=tuple(str(s) for s in skip or ()),
        activation_scheme=str(quant.get("activation_scheme", "dynamic")).lower(),
        scale_fmt=scale_fmt,
        raw=dict(quant),
    )


def fp8_quantization_config(
    block: tuple[int, int], modules_to_not_convert: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """The `quantization_config` the releases write, for weights quantized by `quantize_blocks`."""
    block = _check_block(block)
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block[0], block[1]],
    }
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return config
