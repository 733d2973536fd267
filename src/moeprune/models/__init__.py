"""Family-generic access to transformers MoE models."""

from __future__ import annotations

from moeprune.models.adapter import (
    MoELayer,
    MoEModel,
    check_config,
    decoder_layers,
    family_spec,
)
from moeprune.models.spec import FamilySpec


def supported_families() -> list[str]:
    """Every MoE family of the installed transformers moeprune works on, found at run time
    (each family's tiny model built and its structure discovered; see models/families.py)."""
    from moeprune.models.families import working_families

    return working_families()


def __getattr__(name: str):
    """`FAMILIES` (the old table of eleven specs) still imports, with spec's deprecation warning."""
    if name == "FAMILIES":
        from moeprune.models import spec

        return spec.FAMILIES
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
