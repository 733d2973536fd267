"""Round-to-nearest fake quantization: a weight replaced by what llm-compressor's RTN
(`QuantizationModifier`) would store for it, decoded back to the weight's dtype.

Why here: the per-layer scheme choice (quantize/choice.py) scores candidate schemes without
running llm-compressor (another environment, minutes per call); it swaps each layer's experts for
their fake-quantized copies. For the scores to mean anything the copies must be the very numbers
the final checkpoint decodes to, so the arithmetic follows compressed-tensors 0.19 step by step
(`calculate_qparams`, `_quantize`, `_dequantize`), in the weight's own dtype, from the scheme's
`Rounding` record (schemes.py): per group of G inputs (grouped schemes) or per output channel,
amax = max(|min(w, 0)|, max(w, 0)); scale = amax / ((high - low) / 2) (7.5 for int4, 127.5 for
int8, 448 for fp8 e4m3); a zero scale becomes the dtype's eps; q = clamp(w / scale, low, high)
rounded (to integers, or by a cast to the record's float format); w' = q * scale.

tests/quantize/test_precision_oneshot.py checks these against llm-compressor's own output bit for
bit. A scheme without a `Rounding` (nvfp4a16: two-level fp8 scales of fp4 groups) is not
modelled: `auto:` refuses it.
"""

from __future__ import annotations

import torch

from moeprune.errors import MoePruneError
from moeprune.quantize.schemes import SCHEMES, modelled


def fake_quantize(weight: torch.Tensor, scheme: str, group: int) -> torch.Tensor:
    """`weight` (``[..., out, in]``: a Linear's, or fused experts' stacked the same way) as the
    scheme stores and decodes it; a new tensor of the same dtype and shape."""
    spec = SCHEMES.get(scheme)
    rounding = spec.rounding if spec is not None else None
    if spec is None or rounding is None:
        raise MoePruneError(
            f"no round-to-nearest model of {scheme!r}; per-layer precision chooses among {', '.join(modelled())}",
            options=("quantize",),
        )
    w = weight.detach()
    if spec.grouped and w.shape[-1] % group:
        raise MoePruneError(
            f"a group of {group} does not divide the input width {w.shape[-1]}", options=("quant_group_size",)
        )
    cast = getattr(torch, rounding.cast) if rounding.cast is not None else None
    return _quantize(w, group if spec.grouped else w.shape[-1], rounding.low, rounding.high, cast)


def _quantize(w: torch.Tensor, group: int, low: float, high: float, cast: torch.dtype | None) -> torch.Tensor:
    shape = w.shape
    g = w.reshape(*shape[:-1], shape[-1] // group, group)
    zero = torch.zeros((), dtype=w.dtype)
    amax = torch.maximum(g.amin(-1, keepdim=True).minimum(zero).abs(), g.amax(-1, keepdim=True).maximum(zero))
    scale = amax / (torch.tensor(high - low, dtype=w.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    scaled = torch.clamp(g / scale, low, high)
    q = scaled.to(cast).to(w.dtype) if cast is not None else torch.round(scaled)
    return (q * scale).reshape(shape)


__all__ = ["fake_quantize"]
