"""Family-generic access to transformers MoE models."""

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
