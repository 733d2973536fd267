"""compressed-tensors checkpoints (Kimi-K2, most published W4A16 and FP8 releases), read with torch
alone from the format's own definition, for the two formats MoE releases use:

- `pack-quantized` (integer weights of 4 or 8 bits, e.g. W4A16): each quantized Linear `<m>`
  stores `<m>.weight_packed` int32 (the values offset by 2^(bits-1) to unsigned, packed densely
  from the lowest bits: value i at bit i*bits of its row), `<m>.weight_scale` [out, in/group]
  (or [out, 1] per channel), `<m>.weight_shape` [out, in], and for asymmetric schemes
  `<m>.weight_zero_point` packed the same way along the output dimension. The weight is
  `(q - zero_point) * scale` per group of `group_size` inputs.
- `float-quantized` (FP8 weights): `<m>.weight` float8_e4m3fn beside `<m>.weight_scale`, one per
  tensor, per output channel or per block (`block_structure`); the weight is `fp8 * scale`.
- `nvfp4-pack-quantized` (NVFP4, llm-compressor's and `prune --quantize nvfp4a16`'s output):
  `<m>.weight_packed` uint8 [out, in/2] (two e2m1 codes a byte, the low nibble first),
  `<m>.weight_scale` float8_e4m3fn [out, in/16] and `<m>.weight_global_scale` float32 [1]; the
  weight is `e2m1 * (scale / global_scale)` per group of 16 inputs.

Which modules are quantized and how is `quantization_config.config_groups` (each with `targets`:
module class names such as "Linear", or "re:" regular expressions on module names) minus
`ignore`. On disk the class is unknown, but every quantized tensor carries its suffix, so a module
is read as the group whose targets name it, or, with one group (the common case), as that group.
Weights are decoded as compressed-tensors' own `dequantize` decodes them: in the scale's dtype
(the codes cast to it, the zero point subtracted and the scale multiplied in it), so a bf16 scale
gives bf16 weights, each product rounded once; float32 products would differ by up to half a bf16
ulp, which moves logits and flips routing against every stack that reads the checkpoint with the
library (transformers, vLLM). NVFP4 is decoded as the library's NVFP4 compressor decodes it, in
bf16 whatever the model's dtype (see `dequantize_nvfp4`). compressed-tensors itself is not needed
to read (it is the oracle of tests/quant); formats moeprune does not decode (mxfp4-pack, sparse
ones) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.errors import MoePruneError
from moeprune.serve.moeprune_quantized import (
    GLOBAL_SCALE,
    NVFP4_FORMAT,
    NVFP4_GROUP,
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    target_matches,
)
from moeprune.serve.moeprune_quantized import dequantize_float as decode_float
from moeprune.serve.moeprune_quantized import dequantize_nvfp4 as decode_nvfp4
from moeprune.serve.moeprune_quantized import dequantize_packed as decode_packed
from moeprune.serve.moeprune_quantized import expert_float as decode_expert_float
from moeprune.serve.moeprune_quantized import unpack_int32 as unpack_words

READ_FORMATS = ("pack-quantized", "float-quantized", NVFP4_FORMAT)


@dataclass(frozen=True)
class WeightScheme:
    """How one group of modules stores its weights."""

    format: str
    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool = True
    strategy: str = "group"  # "tensor", "channel", "group" or "block"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompressedFormat:
    """A compressed-tensors `quantization_config` as moeprune needs it (`raw`: as config.json has it)."""

    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def saved_as(self) -> str:
        """How reports name weights kept in this format ("compressed-tensors pack-quantized int4 ...")."""
        kinds = sorted({f"{s.format} {s.type}{s.num_bits}" for s in self.schemes})
        return f"compressed-tensors ({', '.join(kinds)})"

    def scheme_of(self, module: str) -> WeightScheme:
        """The scheme a stored module was quantized with (see the module docstring)."""
        named = [s for s in self.schemes if any(target_matches(t, module) for t in s.targets)]
        if len(named) == 1 or (not named and len(self.schemes) == 1):
            return (named or list(self.schemes))[0]
        # no pattern names it: the one group with a class target ("Linear") has it, as in
        # compressed-tensors, where a name pattern takes precedence over a class name
        by_class = [s for s in self.schemes if any(not t.startswith("re:") for t in s.targets)]
        if not named and len(by_class) == 1:
            return by_class[0]
        raise MoePruneError(
            f"compressed-tensors: cannot tell which of {len(self.schemes)} config groups quantized {module!r} "
            "from its name; moeprune reads checkpoints whose groups name their modules by regex, or have one group"
        )


def read_compressed_config(config_dict: dict[str, Any]) -> CompressedFormat | None:
    """The compressed-tensors format of a checkpoint (None: another method or none), refused in
    one line when it uses a format moeprune does not decode."""
    quant = config_dict.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "compressed-tensors":
        return None
    default = quant.get("format", "dense")
    schemes = []
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not weights:
            continue
        fmt = group.get("format") or default
        if fmt not in READ_FORMATS:
            raise MoePruneError(
                f"this compressed-tensors checkpoint stores group {name!r} as {fmt!r}; moeprune reads "
                f"{', '.join(READ_FORMATS)} weights: dequantize it to bf16 first"
            )
        nvfp4 = (
            weights.get("num_bits"),
            weights.get("type"),
            weights.get("group_size"),
            weights.get("symmetric", True),
        )
        if fmt == NVFP4_FORMAT and nvfp4 != (4, "float", NVFP4_GROUP, True):
            raise MoePruneError(
                f"this compressed-tensors checkpoint's group {name!r} is {fmt} with weights {weights!r}; "
                f"moeprune reads the format's symmetric fp4 weights in groups of {NVFP4_GROUP}: dequantize it to bf16 first"
            )
        block = weights.get("block_structure")
        schemes.append(
            WeightScheme(
                format=fmt,
                num_bits=int(weights.get("num_bits", 8)),
                type=str(weights.get("type", "int")),
                symmetric=bool(weights.get("symmetric", True)),
                strategy=str(weights.get("strategy", "tensor")),
                group_size=weights.get("group_size"),
                block_structure=tuple(block) if block else None,
                targets=tuple(group.get("targets") or ()),
            )
        )
    if not schemes:
        raise MoePruneError("this compressed-tensors checkpoint has no config group with quantized weights")
    return CompressedFormat(tuple(schemes), tuple(quant.get("ignore") or ()), dict(quant))


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """The `count` signed integers of each row of `packed` (int32, dense packing from bit 0)."""
    if packed.dtype != torch.int32:
        raise MoePruneError(f"compressed-tensors packs into int32, got {packed.dtype}")
    return unpack_words(packed, num_bits, count)


def dequantize_packed(tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> torch.Tensor:
    """The weight [out, in] of one pack-quantized module from its stored tensors, in the scale's
    dtype (see the module docstring)."""
    if tensors[PACKED].dtype != torch.int32:
        raise MoePruneError(f"compressed-tensors packs into int32, got {tensors[PACKED].dtype}")
    zero = tensors.get(ZERO) if not scheme.symmetric else None
    return decode_packed(tensors[PACKED], tensors[SCALE], tensors[SHAPE], scheme.num_bits, zero)


def dequantize_float(weight: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """The weight of one float-quantized (fp8) module in the scale's dtype: `fp8 * scale`, the
    scale per tensor, per output channel, per group or per block."""
    block = scheme.block_structure if scheme.strategy == "block" else None
    return decode_float(weight, scale, block)


def dequantize_expert_float(weight: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """A routed expert's float-quantized (fp8) weight as transformers decodes the fused experts
    while loading: the product in float32, rounded to bf16 before transformers 5.21."""
    block = scheme.block_structure if scheme.strategy == "block" else None
    return decode_expert_float(weight, scale, block)


def dequantize_nvfp4(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] of one nvfp4-pack-quantized module from its stored tensors, in bf16 as
    compressed-tensors' NVFP4 compressor returns it whatever the model's dtype: the e2m1 codes
    times `weight_scale / weight_global_scale`, that quotient in float32 (torch's promotion of the
    bf16-cast fp8 scale by the float32 [1] global scale), the product rounded to float32 then bf16."""
    if tensors[PACKED].dtype != torch.uint8:
        raise MoePruneError(f"nvfp4 packs two codes a byte into uint8, got {tensors[PACKED].dtype}")
    return decode_nvfp4(tensors[PACKED], tensors[SCALE], tensors[GLOBAL_SCALE])


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Signed integers [rows, n] packed as compressed-tensors packs them (for writing test
    checkpoints): offset to unsigned, value i at bit i*bits of its row's int32 words."""
    rows, count = values.shape
    unsigned = (values.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    words = torch.zeros(rows, -(-count * num_bits // 32), dtype=torch.int64)
    for i in range(count):
        start = i * num_bits
        words[:, start // 32] |= unsigned[:, i] << (start % 32)
        if start % 32 + num_bits > 32:
            words[:, start // 32 + 1] |= unsigned[:, i] >> (32 - start % 32)
    words &= 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_int(w: torch.Tensor, num_bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """A float weight [out, in] as symmetric pack-quantized tensors (for tests): per group of
    `group_size` inputs, `scale = amax / (2^(bits-1) - 1)` (1 for an all-zero group) in bf16, the
    values rounded to the nearest integer and clamped to the signed range."""
    out, cols = w.shape
    if cols % group_size:
        raise MoePruneError(f"{cols} inputs do not split into groups of {group_size}")
    grouped = w.detach().to(torch.float32).reshape(out, cols // group_size, group_size)
    top = (1 << (num_bits - 1)) - 1
    scale = (grouped.abs().amax(dim=-1) / top).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(grouped / scale.to(torch.float32)[..., None]).clamp(-top - 1, top).reshape(out, cols)
    return {PACKED: pack_int32(q, num_bits), SCALE: scale, SHAPE: torch.tensor([out, cols])}
