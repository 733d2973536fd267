"""The per-layer structure of a result a stock config cannot express, and reading it back safely.

Version 3 (docs/checkpoint-format.md) keeps it in config.json's `moeprune` section, next to a
custom `model_type` ("moeprune_<family>") so that stock transformers never builds the stock
class on these weights by accident. Versions 1 and 2 kept it in `moeprune.json`; both still load.

Every field is checked before a model is built: a duplicated or out-of-range expert id, a count
that disagrees with the widths, a damaged file or a version from the future is one clear error,
never a wrong model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel, own_gate
from moeprune.surgery.packed import layer_widths, router_count

FORMAT = "moeprune-checkpoint"
FORMAT_VERSION = 3  # the newest version this moeprune reads and writes
LEGACY_FILE = "moeprune.json"  # versions 1 and 2 kept the structure here
CONFIG = "config.json"
MODEL_TYPE_PREFIX = "moeprune_"
ARCHITECTURE_PREFIX = "MoePrune"
MODELING_FILE = "modeling_moeprune.py"  # what config.json's auto_map names


@dataclass(frozen=True)
class LayerStructure:
    """One MoE layer as saved: router positions, their original expert ids and neuron widths."""

    layer: int
    expert_ids: tuple[int, ...]
    widths: tuple[int | None, ...]  # per position; None for a novice

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)

    @property
    def novices(self) -> list[int]:
        return [p for p, w in enumerate(self.widths) if w is None]

    def packed(self, full_width: int) -> bool:
        """Whether moeprune holds this layer packed (novices, or experts narrower than the config)."""
        return any(w is None or w != full_width for w in self.widths)

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "num_experts": self.num_experts, "expert_ids": list(self.expert_ids),
                "widths": list(self.widths), "novice": self.novices}  # fmt: skip


@dataclass(frozen=True)
class Structure:
    """What a moeprune-format checkpoint says about its MoE layers."""

    version: int
    base_model_type: str
    layers: tuple[LayerStructure, ...]

    def layer(self, index: int) -> LayerStructure:
        for entry in self.layers:
            if entry.layer == index:
                return entry
        raise KeyError(index)


def describe(moe: MoEModel) -> dict[str, Any]:
    """The `moeprune` section of config.json for this (pruned, in-memory) model."""
    layers = [
        LayerStructure(m.index, tuple(m.expert_ids), tuple(layer_widths(m))).to_json() for m in moe.layers
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
    return {
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
    path = folder / CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MoePruneError(f"{folder} has no {CONFIG}; pass a transformers checkpoint folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise MoePruneError(f"{path} is damaged ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(data, dict):
        raise MoePruneError(f"{path} is damaged (not a JSON object); restore it from the original checkpoint")
    return data


def read(folder: Path) -> Structure | None:
    """The checkpoint's structure (any version), validated; None for a stock checkpoint."""
    config = read_config_dict(folder)
    if "moeprune" in config:
        return _parse(config["moeprune"], f"{folder / CONFIG} ('moeprune' section)", config)
    if (folder / LEGACY_FILE).is_file():
        try:
            legacy = json.loads((folder / LEGACY_FILE).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise MoePruneError(
                f"{folder / LEGACY_FILE} is damaged ({exc}); re-create the result with moeprune prune"
            ) from exc
        return _parse(legacy, str(folder / LEGACY_FILE), config)
    return None


def _fail(where: str, what: str) -> MoePruneError:
    return MoePruneError(
        f"{where}: {what}; the checkpoint is damaged or was edited by hand, re-create it with moeprune prune"
    )


def _int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _parse(data: Any, where: str, config: dict[str, Any]) -> Structure:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(where, f"'format' is not {FORMAT!r}")
    version = data.get("format_version")
    if not _int(version) or version < 1:
        raise _fail(where, f"'format_version' {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise MoePruneError(
            f"{where} is format version {version}, newer than this moeprune reads ({FORMAT_VERSION}); upgrade moeprune"
        )
    base = data.get("base_model_type", data.get("model_type"))
    if not isinstance(base, str):
        raise _fail(where, "the base model type is missing")
    entries = data.get("layers")
    if not isinstance(entries, list) or not entries:
        raise _fail(where, "'layers' is missing or empty")
    layers = tuple(_parse_layer(entry, where, version) for entry in entries)
    indices = [entry.layer for entry in layers]
    if indices != sorted(set(indices)):
        raise _fail(where, f"MoE layers {indices} are not unique and ascending")
    limit = config.get("num_hidden_layers")
    if _int(limit) and indices[-1] >= limit:
        raise _fail(where, f"layer {indices[-1]} does not exist (the model has {limit} decoder layers)")
    return Structure(version=version, base_model_type=base, layers=layers)


def _parse_layer(entry: Any, where: str, version: int) -> LayerStructure:
    if not isinstance(entry, dict) or not _int(entry.get("layer")):
        raise _fail(where, f"layer entry {entry!r} has no integer 'layer'")
    at = f"layer {entry['layer']}"
    ids = entry.get("expert_ids")
    if not isinstance(ids, list) or not ids or not all(_int(e) and e >= 0 for e in ids):
        raise _fail(where, f"{at}: 'expert_ids' must be a non-empty list of expert ids")
    if len(set(ids)) != len(ids):
        raise _fail(where, f"{at}: expert ids {sorted(e for e in set(ids) if ids.count(e) > 1)} appear twice")
    count = entry.get("num_experts")
    if count != len(ids):
        raise _fail(where, f"{at}: num_experts {count!r} disagrees with {len(ids)} expert ids")
    if version >= 3:
        widths = entry.get("widths")
        if not isinstance(widths, list) or len(widths) != len(ids):
            raise _fail(where, f"{at}: 'widths' must list one width (or null for a novice) per expert")
        novice = entry.get("novice", [])
        if sorted(novice) != [p for p, w in enumerate(widths) if w is None]:
            raise _fail(where, f"{at}: 'novice' {novice!r} disagrees with the null widths")
    else:
        packed = entry.get("packed") or {"novice": [], "widths": {}}
        try:
            novice = {int(p) for p in packed["novice"]}
            given = {int(p): w for p, w in packed["widths"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _fail(where, f"{at}: malformed 'packed' entry ({exc})") from exc
        if entry.get("packed") and (novice | set(given)) != set(range(len(ids))):
            raise _fail(where, f"{at}: 'packed' does not cover every position")
        widths = [None if p in novice else given.get(p, 0) for p in range(len(ids))]  # 0: full width
    if not all(w is None or (_int(w) and w >= 0) for w in widths):
        raise _fail(where, f"{at}: widths must be neuron counts, got {widths}")
    return LayerStructure(entry["layer"], tuple(ids), tuple(widths))


def resolve_widths(structure: LayerStructure, full_width: int, where: str) -> LayerStructure:
    """Versions 1-2 wrote no width for unpruned experts (0 here): the config's width. Widths above
    the config's are refused."""
    widths = tuple(full_width if w == 0 else w for w in structure.widths)
    wide = [w for w in widths if w is not None and not 1 <= w <= full_width]
    if wide:
        raise _fail(where, f"layer {structure.layer}: widths {wide} are outside 1..{full_width}")
    return LayerStructure(structure.layer, structure.expert_ids, widths)


def router_counts(moe: MoEModel) -> list[int]:
    return [router_count(m) for m in moe.layers]
