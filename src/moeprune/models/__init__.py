"""Family-generic access to transformers MoE models."""

from __future__ import annotations

from moeprune.models.adapter import (
    MoELayer,
    MoEModel,
    check_config,
    decoder_layers,
    family_spec,
)
from moeprune.models.spec import FAMILIES, FamilySpec, supported_families

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "MoELayer",
    "MoEModel",
    "check_config",
    "decoder_layers",
    "family_spec",
    "supported_families",
]
