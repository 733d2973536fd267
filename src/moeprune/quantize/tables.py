"""The byte tables per (layer, scheme) of a result whose MoE layers keep experts at chosen widths
and schemes: the per-layer precision choice (quantize/choice.py, quantize/keeps.py) and the
searches that price every candidate (quantize/mixed_space.py) read them here. They are priced by
the one function every size is (surgery/sizes.py `kept_bytes`: planned bytes, quantized bytes and
these tables from what each layer keeps, `Method.planned_keeps`)."""

from __future__ import annotations

from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.sizes import PrecisionBytes, kept_bytes

__all__ = ["LayerKeep", "PrecisionBytes", "kept_bytes"]
