"""Quantized inputs: what moeprune reads of a quantized checkpoint and keeps through its stages,
instead of letting transformers dequantize it on load and saving full precision.

- fp8.py         the block-scaled FP8 format of the largest MoE releases, read and written with torch
- mxfp4.py       MXFP4 experts (gpt-oss), decoded to the compute dtype
- compressed.py  compressed-tensors pack- and float-quantized checkpoints, decoded
- support.py     which quantization an input has, and the refusals of what cannot keep it
- testing.py     writers of tiny quantized checkpoints for tests

Quantizing a result (`prune --quantize`, llm-compressor) is the quantize/ stage, after search/.
"""

from __future__ import annotations

from moeprune.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Format,
    dequantize_blocks,
    fp8_quantization_config,
    quantize_blocks,
    read_fp8_config,
    scale_name,
    scale_shape,
)
from moeprune.quant.support import quantization_of, refuse_quantized

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Format",
    "dequantize_blocks",
    "fp8_quantization_config",
    "quantization_of",
    "quantize_blocks",
    "read_fp8_config",
    "refuse_quantized",
    "scale_name",
    "scale_shape",
]
