"""Family-generic access to transformers MoE models."""

from __future__ import annotations

from moeprune.models.adapter import (
    MoELayer,
    MoEModel,
    check_config,
    decoder_layers,
    family_spec,
)
from moeprune.models.families import legacy_family_specs, supported_families
from moeprune.models.spec import FamilySpec


def __getattr__(name: str):
    """`FAMILIES` (the old table of the eleven families' specs) still imports, with a warning:
    specs are discovered from the model now."""
    if name == "FAMILIES":
        import warnings

        warnings.warn(
            "moeprune.models.FAMILIES is deprecated: specs are discovered from the model "
            "(moeprune.models.MoEModel(model).spec, moeprune.models.check_config(config))",
            DeprecationWarning,
            stacklevel=2,
        )
        return legacy_family_specs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FamilySpec",
    "MoELayer",
    "MoEModel",
    "check_config",
    "decoder_layers",
    "family_spec",
    "supported_families",
]
