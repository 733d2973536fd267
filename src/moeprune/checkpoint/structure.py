"""The per-layer structure of a result a stock config cannot express, and reading it back safely.

Version 3 (docs/checkpoint-format.md) keeps it in config.json's `moeprune` section, next to a
custom `model_type` ("moeprune_<family>") so that stock transformers never builds the stock
class on these weights by accident. Versions 1 and 2 kept it in `moeprune.json`; both still load.

Every field is checked before a model is built (serve/moeprune_format.py, the one reader the
modeling files and the vLLM plugin share): a duplicated or out-of-range expert id, a count that
disagrees with the widths, a damaged file or a version from the future is one clear error, never
a wrong model.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel, own_gate
from moeprune.models.packed import layer_widths, novice_rank, router_count
from moeprune.serve import moeprune_format
from moeprune.serve.moeprune_format import (  # noqa: F401  (the format's names, read where they are defined)
    ARCHITECTURE_PREFIX,
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    LEGACY_FILE,
    MODEL_TYPE_PREFIX,
    FormatError,
    LayerStructure,
    Structure,
)

MODELING_FILE = "modeling_moeprune.py"  # what config.json's auto_map names


@contextmanager
def _as_moeprune_error():
    """The format reader's FormatError becomes moeprune's own error (one line on the command line)."""
    try:
        yield
    except FormatError as exc:
        raise MoePruneError(str(exc)) from None


def describe(moe: MoEModel) -> dict[str, Any]:
    """The `moeprune` section of config.json for this (pruned, in-memory) model."""
    layers = [
        LayerStructure(m.index, tuple(m.expert_ids), tuple(layer_widths(m)), novice_rank(m)).to_json()
        for m in moe.layers
    ]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "moeprune_version": __version__,
        "base_model_type": moe.model_type,
        "base_architecture": type(moe.model).__name__,
        "family": family_record(moe),
        "layers": layers,
    }


def family_record(moe: MoEModel) -> dict[str, Any]:
    """How the base family lays out its MoE blocks, in memory and on disk, as discovery found
    it: the self-contained modeling files read this instead of a table of family names, so a
    result of any family loads with stock transformers (serve/moeprune_layers.py `Family`)."""
    spec = moe.spec
    extra = (
        {"extra_experts": spec.extra_experts, "total_count_attrs": list(spec.total_count_attrs)}
        if spec.extra_experts
        else {}  # every other family's record stays as it was
    )
    return {
        **extra,
        "config_class": type(moe.model.config).__name__,
        "causal_lm_class": type(moe.model).__name__,
        "layers": spec.layers,
        "block_attr": spec.block_attr,
        "router_attr": spec.router_attr,
        "count_field": spec.count_field,
        "intermediate_field": spec.intermediate_field,
        "layout": spec.layout,
        "router_tensors": [list(t) for t in spec.router_tensors],
        "block_tensors": [list(t) for t in spec.block_tensors],
        "count_attrs": list(spec.count_attrs),
        "disk_renames": [list(r) for r in spec.disk_renames],
        "disk_expert_names": list(spec.disk_expert_names) if spec.disk_expert_names else None,
        "weight_on_input": spec.weight_on_input,
        "own_gate": own_gate(moe.layers[0].experts),
    }


def is_moeprune_format(folder: Path) -> bool:
    return (folder / LEGACY_FILE).is_file() or "moeprune" in read_config_dict(folder)


def read_config_dict(folder: Path) -> dict[str, Any]:
    """config.json as a dict, with one clear error when it is missing or damaged."""
    with _as_moeprune_error():
        return moeprune_format.read_config(folder)


def read(folder: Path) -> Structure | None:
    """The checkpoint's structure (any version), validated; None for a stock checkpoint."""
    with _as_moeprune_error():
        return moeprune_format.read_structure(folder)


def resolve_widths(structure: LayerStructure, full_width: int, where: str) -> LayerStructure:
    """Versions 1-2 wrote no width for unpruned experts (0 here): the config's width. Widths above
    the config's are refused."""
    widths = tuple(full_width if w == 0 else w for w in structure.widths)
    wide = [w for w in widths if w is not None and not 1 <= w <= full_width]
    if wide:
        raise MoePruneError(
            str(
                moeprune_format.damaged(
                    where, f"layer {structure.layer}: widths {wide} are outside 1..{full_width}"
                )
            )
        )
    return LayerStructure(structure.layer, structure.expert_ids, widths, structure.novice_rank)


def router_counts(moe: MoEModel) -> list[int]:
    return [router_count(m) for m in moe.layers]
