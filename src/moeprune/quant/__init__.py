"""Quantized checkpoints: the block-scaled FP8 format of the largest MoE releases, read and
written with torch alone (fp8.py), and a writer of tiny FP8 checkpoints for tests (testing.py).

moeprune keeps a checkpoint's quantization through its stages instead of letting transformers
dequantize it on load and saving full precision: this package holds the format's arithmetic and
its config, with no knowledge of the stages that use it.
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
