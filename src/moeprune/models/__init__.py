"""Family-generic access to transformers MoE models.

- adapter.py  One view of every supported MoE family: layers, routers and per-expert weights
- classes.py  Which transformers class holds a model: the causal LM, or the multimodal wrapper
  around it
- discover.py  Find a model's MoE structure from the model itself, not from a list of family names
- disk_names.py  The names `save_pretrained` gives a family's tensors on disk, asked of transformers
  itself
- expert_parallel.py  Expert-parallel degrees: which EP sizes a model's per-layer expert counts
  allow
- factory.py  Tiny random models of every MoE family of the installed transformers, built from
  config classes (no downloads)
- families.py  Which MoE families of the installed transformers moeprune works on, found at run time
- grouped.py  Every routed expert of one layer call in two grouped products (`torch._grouped_mm`)
- lowrank.py  A low-rank ("tilted") novice: an expert replaced by the affine map h -> c + U (V^T h)
- packed.py  Routed experts stored one by one: novices (a constant vector) and per-expert neuron
  counts
- reshape.py  Expert removal, the mechanism: virtual (reversible router slicing) and physical
  (tensors sliced for good)
- routed.py  moeprune's own routed-experts computation, swapped in reversibly when a stage needs it
- routers.py  How a MoE block's router is found and checked: the module scoring the experts (an [E,
  d] matrix beside them, or a wider one whose last rows score extra experts ...
- spec.py  Data-driven descriptions of how a transformers MoE family lays out its blocks
"""

from __future__ import annotations

from moeprune.models.adapter import (
    MoELayer,
    MoEModel,
    check_config,
    decoder_layers,
    family_spec,
)
from moeprune.models.families import supported_families
from moeprune.models.spec import FamilySpec

__all__ = [
    "FamilySpec",
    "MoELayer",
    "MoEModel",
    "check_config",
    "decoder_layers",
    "family_spec",
    "supported_families",
]
