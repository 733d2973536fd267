"""The `--quantize` schemes and methods as data: each one record that every consumer reads, so a
new scheme is one `register_scheme(Scheme(...))` here and nothing else changes.

A scheme's record carries, for one Linear weight [out, in]:

- llm-compressor's arguments (`preset`, a named preset of the library, or `weights`, the
  `QuantizationArgs` of an explicit config group whose group size is the user's): what
  driver.py hands `oneshot`;
- its tensors on disk, compressed-tensors' layout: the codes (`codes`, packed into elements of
  `code_dtype`), the scales (`scale_dtype`, the model's dtype when None; one per group of G
  inputs when `grouped`, else one per output channel) and the tensors of a fixed shape stored
  once per Linear (`extras`). pricing.py weighs and names them from these fields alone;
- its round-to-nearest model (`rounding`: the code range and how a value is rounded), which
  fake.py applies with compressed-tensors' arithmetic; None where it is not modelled (`auto:`
  then refuses the scheme).

The entries, for reference: w4a16 / w8a16 (pack-quantized, int symmetric in groups: int32 words
of codes, scales in the model's dtype, the int64 `weight_shape` [2]); fp8-dynamic (float-quantized,
e4m3 per output channel, activations per token at run time: fp8 weight, one scale per row);
nvfp4a16 (fp4 e2m1 in groups of 16: uint8 codes, fp8 scales, one float32 global scale).
Symmetric schemes store no zero point. The router (gate) and lm_head stay in the model's dtype.

How to add a scheme: one entry below, e.g. an int4 per output channel:

    register_scheme(Scheme(
        "w4a16-channel", "int4 weights per output channel, 16-bit activations", bits=4, grouped=False,
        weights={"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
        extras=(SHAPE,), rounding=Rounding(-8.0, 7.0)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# bytes of one element of each safetensors dtype a quantized result stores
DTYPE_BYTES = {"I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1, "F32": 4, "BF16": 2, "F16": 2, "F64": 8}
SHAPE = ("weight_shape", "I64", (2,))  # pack-quantized's original [out, in], once per Linear


@dataclass(frozen=True)
class Rounding:
    """A scheme's round-to-nearest model: codes clamped to [low, high] after dividing by the scale
    amax / ((high - low) / 2); `cast`: the codes are a float format, rounded by a cast to this
    torch dtype (else rounded to integers)."""

    low: float
    high: float
    cast: str | None = None


@dataclass(frozen=True)
class Scheme:
    """One `--quantize` choice (module docstring)."""

    name: str
    help: str
    bits: int  # of one code
    grouped: bool  # scales per group of `group_size` inputs (else per output channel)
    fixed_group: int | None = None  # a format whose group size is part of it (nvfp4: 16)
    # llm-compressor: a preset's name, or the weights' QuantizationArgs (the group size added)
    preset: str | None = None
    weights: dict[str, Any] | None = field(default=None, hash=False)
    # compressed-tensors' tensors of one Linear
    codes: str = "weight_packed"
    code_dtype: str = "I32"
    scale_dtype: str | None = None  # None: the model's dtype
    extras: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (suffix, dtype, shape), once per Linear
    rounding: Rounding | None = None  # fake.py's model; None: `auto:` does not offer it

    def group(self, asked: int) -> int:
        return self.fixed_group or asked

    @property
    def takes_group(self) -> bool:
        """Whether the user's group size applies (grouped, and not by the format itself)."""
        return self.grouped and not self.fixed_group

    def scale_bytes(self, dtype_bytes: int) -> int:
        return DTYPE_BYTES[self.scale_dtype] if self.scale_dtype is not None else dtype_bytes

    @property
    def extra_bytes(self) -> int:
        """Bytes of the fixed-shape tensors stored once per Linear."""
        return sum(math.prod(shape) * DTYPE_BYTES[dtype] for _, dtype, shape in self.extras)

    def linear_bytes(self, out: int, inputs: int, group: int, dtype_bytes: int) -> int:
        """Bytes of one quantized Linear weight [out, inputs] with everything stored beside it."""
        groups = inputs // self.group(group) if self.grouped else 1
        return out * inputs * self.bits // 8 + out * groups * self.scale_bytes(dtype_bytes) + self.extra_bytes

    def tensors(
        self, out: int, inputs: int, group: int, dtype: str
    ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(suffix, dtype, shape) of the tensors stored for one Linear weight [out, inputs] (`dtype`:
        the model's saved dtype's name); their bytes are `linear_bytes`."""
        codes = (self.codes, self.code_dtype, (out, inputs * self.bits // (8 * DTYPE_BYTES[self.code_dtype])))
        scales = ("weight_scale", self.scale_dtype or dtype, (out, inputs // group if self.grouped else 1))
        return [codes, scales, *self.extras]

    def llm_compressor(self, group: int) -> dict[str, Any]:
        """What driver.py builds the scheme's config group from: {"preset": name} or {"weights":
        QuantizationArgs keywords}."""
        if self.preset is not None:
            return {"preset": self.preset}
        assert self.weights is not None, f"scheme {self.name} names neither a preset nor its weights"
        return {"weights": {**self.weights, **({"group_size": group} if self.grouped else {})}}


@dataclass(frozen=True)
class QuantMethod:
    """How llm-compressor computes the codes: its modifier (module:class), the calibration pipeline
    it runs with data, and whether it needs the calibration data."""

    name: str
    help: str
    modifier: str
    pipeline: str
    needs_data: bool


SCHEMES: dict[str, Scheme] = {}
QUANT_METHODS: dict[str, QuantMethod] = {}


def register_scheme(scheme: Scheme) -> Scheme:
    if scheme.name in SCHEMES:
        raise ValueError(f"quantization scheme {scheme.name!r} is registered twice")
    SCHEMES[scheme.name] = scheme
    return scheme


def register_method(method: QuantMethod) -> QuantMethod:
    if method.name in QUANT_METHODS:
        raise ValueError(f"quantization method {method.name!r} is registered twice")
    QUANT_METHODS[method.name] = method
    return method


def _int_weights(bits: int) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group"}


register_scheme(
    Scheme(
        "w4a16",
        "int4 weights in groups, 16-bit activations (GPTQ or RTN)",
        4,
        True,
        weights=_int_weights(4),
        extras=(SHAPE,),
        rounding=Rounding(-8.0, 7.0),
    )
)
register_scheme(
    Scheme(
        "w8a16",
        "int8 weights in groups, 16-bit activations (GPTQ or RTN)",
        8,
        True,
        weights=_int_weights(8),
        extras=(SHAPE,),
        rounding=Rounding(-128.0, 127.0),
    )
)
register_scheme(
    Scheme(
        "fp8-dynamic",
        "fp8 e4m3 weights per channel, activations per token at run time",
        8,
        False,
        preset="FP8_DYNAMIC",
        codes="weight",
        code_dtype="F8_E4M3",
        rounding=Rounding(-448.0, 448.0, cast="float8_e4m3fn"),
    )
)
register_scheme(
    Scheme(
        "nvfp4a16",
        "fp4 e2m1 weights in groups of 16 with fp8 scales, 16-bit activations",
        4,
        True,
        fixed_group=16,
        preset="NVFP4A16",
        code_dtype="U8",
        scale_dtype="F8_E4M3",
        extras=(("weight_global_scale", "F32", (1,)),),
    )
)

register_method(
    QuantMethod(
        "gptq",
        "calibrated on the prune's data, every kept expert reached",
        "llmcompressor.modifiers.gptq:GPTQModifier",
        "sequential",
        needs_data=True,
    )
)
register_method(
    QuantMethod(
        "rtn",
        "round to nearest",
        "llmcompressor.modifiers.quantization:QuantizationModifier",
        "basic",
        needs_data=False,
    )
)


def modelled() -> tuple[str, ...]:
    """The schemes fake.py models (what `auto:` chooses among)."""
    return tuple(name for name, scheme in SCHEMES.items() if scheme.rounding is not None)


def taking_group() -> tuple[str, ...]:
    """The schemes the user's group size applies to."""
    return tuple(name for name, scheme in SCHEMES.items() if scheme.takes_group)


__all__ = [
    "DTYPE_BYTES",
    "QUANT_METHODS",
    "SCHEMES",
    "SHAPE",
    "QuantMethod",
    "Rounding",
    "Scheme",
    "modelled",
    "register_method",
    "register_scheme",
    "taking_group",
]
