"""Round-to-nearest fake quantization: a weight replaced by what llm-compressor's RTN
(`QuantizationModifier`) would store for it, decoded back to the weight's dtype.

Why here: the per-layer precision search (quantize/choice.py) scores candidate schemes without
running llm-compressor (another environment, minutes per call); it swaps each layer's experts for
their fake-quantized copies. For the scores to mean anything the copies must be the very numbers
the final checkpoint decodes to, so the arithmetic follows compressed-tensors 0.19 step by step
(`calculate_qparams`, `_quantize`, `_dequantize`), in the weight's own dtype:

- int symmetric (w4a16, w8a16), groups of G along the input dimension: per group
  amax = max(|min(w, 0)|, max(w, 0)); scale = amax / ((qmax - qmin) / 2) (7.5 for int4, 127.5 for
  int8); a zero scale becomes the dtype's eps; q = clamp(round(w / scale), qmin, qmax); w' = q * scale.
- fp8-dynamic (weights e4m3 per output channel): the same with the range +-448 (scale = amax / 448)
  and the rounding a cast to float8_e4m3fn.

tests/quantize/test_precision_oneshot.py checks these against llm-compressor's own output bit for bit.
nvfp4a16 (two-level fp8 scales of fp4 groups) is not modelled: `auto:` refuses it.
"""

from __future__ import annotations

import torch

from moeprune.errors import MoePruneError

FAKE_SCHEMES = ("w4a16", "w8a16", "fp8-dynamic")
_INT_RANGE = {"w4a16": (-8, 7), "w8a16": (-128, 127)}
_FP8_MAX = 448.0


def fake_quantize(weight: torch.Tensor, scheme: str, group: int) -> torch.Tensor:
    """`weight` (``[..., out, in]``: a Linear's, or fused experts' stacked the same way) as the
    scheme stores and decodes it; a new tensor of the same dtype and shape."""
    if scheme not in FAKE_SCHEMES:
        raise MoePruneError(
            f"no round-to-nearest model of {scheme!r}; per-layer precision chooses among {', '.join(FAKE_SCHEMES)}",
            options=("quantize",),
        )
    w = weight.detach()
    if scheme == "fp8-dynamic":
        return _quantize(w, w.shape[-1], -_FP8_MAX, _FP8_MAX, fp8=True)
    low, high = _INT_RANGE[scheme]
    if w.shape[-1] % group:
        raise MoePruneError(
            f"a group of {group} does not divide the input width {w.shape[-1]}", options=("quant_group_size",)
        )
    return _quantize(w, group, float(low), float(high), fp8=False)


def _quantize(w: torch.Tensor, group: int, low: float, high: float, fp8: bool) -> torch.Tensor:
    shape = w.shape
    g = w.reshape(*shape[:-1], shape[-1] // group, group)
    zero = torch.zeros((), dtype=w.dtype)
    amax = torch.maximum(g.amin(-1, keepdim=True).minimum(zero).abs(), g.amax(-1, keepdim=True).maximum(zero))
    scale = amax / (torch.tensor(high - low, dtype=w.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    scaled = torch.clamp(g / scale, low, high)
    q = scaled.to(torch.float8_e4m3fn).to(w.dtype) if fp8 else torch.round(scaled)
    return (q * scale).reshape(shape)


__all__ = ["FAKE_SCHEMES", "fake_quantize"]
