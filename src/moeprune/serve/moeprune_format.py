"""The one reader of moeprune's on-disk format (docs/checkpoint-format.md): standard library only.

Three readers need the per-layer structure of a moeprune-format result: moeprune itself
(checkpoint/structure.py), the self-contained modeling files copied into every result (stock
transformers, no moeprune installed: this file is copied beside them) and the vLLM plugin
(which imports neither torch nor transformers before vLLM builds a model). All three call
`parse_section` and get the same checks and the same `FormatError`, so a damaged or hand-edited
folder is refused with the same sentence wherever it is opened, never built into a model of the
wrong shape.

Version 3 keeps the structure in config.json's `moeprune` section; versions 1 and 2 kept it in
`moeprune.json` with a `packed` entry per layer (width 0 there meaning "the config's width").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from numbers import Integral
from pathlib import Path
from typing import Any, TypeGuard

FORMAT = "moeprune-checkpoint"
FORMAT_VERSION = 3  # the newest version this reader reads (and moeprune writes)
CONFIG = "config.json"
LEGACY_FILE = "moeprune.json"  # versions 1 and 2 kept the structure here
MODEL_TYPE_PREFIX = "moeprune_"
ARCHITECTURE_PREFIX = "MoePrune"
REMAKE = "re-create it with moeprune prune"
# `MoePrune<CausalLM>__<Config>`: the class stock transformers loads when the causal-LM class is
# another family's (transformers 5.24's sarvam_mla runs DeepseekV3ForCausalLM on SarvamMLAConfig).
# transformers class names never hold a double underscore, so the two names split back unambiguously.
PAIR_SEPARATOR = "__"


def auto_model_class(causal_lm: str, config: str, own_config: str | None) -> str:
    """The modeling file's class for a causal-LM class (`causal_lm`, whose own `config_class` is
    named `own_config`) run on a config of class `config`, as config.json's auto_map names it.

    transformers registers the auto_map's model class for the config's class and refuses a model
    class whose `config_class` has another name, so a family whose causal LM is another family's
    needs its own class, one per (causal-LM class, config class) pair; a family with its own causal
    LM keeps the plain `MoePrune<CausalLM>` (the name every earlier result has)."""
    if own_config is None or own_config == config:
        return ARCHITECTURE_PREFIX + causal_lm
    return f"{ARCHITECTURE_PREFIX}{causal_lm}{PAIR_SEPARATOR}{config}"


def split_auto_model_class(name: str) -> tuple[str, str | None]:
    """(causal-LM class, config class or None) named by `auto_model_class`'s result (prefix removed)."""
    causal_lm, _, config = name.removeprefix(ARCHITECTURE_PREFIX).partition(PAIR_SEPARATOR)
    return causal_lm, config or None


class FormatError(ValueError):
    """A moeprune section (or config.json) that cannot be read; the message says what to do."""


WIDTH_MERGE_TOLERANCE = Fraction(1, 20)
"""How much zero-padding an expert may take to share a fused block with wider experts.

An engine whose fused-MoE kernel holds one width per block (vLLM) serves a layer with mixed
widths as a few blocks ("width groups"), one kernel call each. Every extra group costs a kernel
launch per layer and token step; every padded neuron costs memory and compute. An expert joins a
group whose widest expert is at most this fraction of that width wider than it (its padding
<= 5% of the group's width), so a group's padding adds at most 5% to its bytes while near-equal
widths (TP-rounded, or a few neurons apart) share one kernel. Exact: the group's widest width
over the tolerance is compared in integers, so the rule never depends on float rounding."""

MAX_WIDTH_GROUPS = 4
"""The most width groups (fused blocks) one layer is served as. TENP gives two (whole experts and
narrowed ones); per-expert neuron widths can give one per expert, which would launch one kernel
per expert. Past this cap the groups the tolerance found are merged where that adds the fewest
padded neurons (an exact partition of the sorted widths), trading memory for launches."""


@dataclass(frozen=True)
class WidthGroup:
    """Weight-holding router positions served as one fused block `width` neurons wide (its widest
    member; narrower members are padded with zero neurons, exact for the served gated MLPs)."""

    width: int
    positions: tuple[int, ...]  # router positions, ascending


def width_groups(
    widths: tuple[int | None, ...] | list[int | None],
    tolerance: Fraction = WIDTH_MERGE_TOLERANCE,
    max_groups: int = MAX_WIDTH_GROUPS,
) -> tuple[WidthGroup, ...]:
    """A layer's weight-holding positions (None widths, novices, hold no weights) split into the
    fewest width groups such that each expert is padded by at most `tolerance` of its group's
    width, widest group first; merged further, with the least padding, when more than
    `max_groups` are needed.

    Greedy from the widest is the fewest groups: each group must start at the widest expert not
    yet placed and can reach down to (1 - tolerance) of it (covering sorted points with intervals).
    """
    if max_groups < 1:
        raise ValueError("max_groups must be at least 1")
    counts: dict[int, int] = {}
    for w in widths:
        if w is not None:
            counts[w] = counts.get(w, 0) + 1
    distinct = sorted(counts, reverse=True)
    if not distinct:
        return ()
    bounds: list[tuple[int, int]] = []  # [start, end) into `distinct`
    start = 0
    for i, w in enumerate(distinct):
        if (distinct[start] - w) > tolerance * distinct[start]:
            bounds.append((start, i))
            start = i
    bounds.append((start, len(distinct)))
    if len(bounds) > max_groups:
        bounds = _least_padding_split(distinct, counts, max_groups)
    groups = []
    for lo, hi in bounds:
        members = set(distinct[lo:hi])
        groups.append(
            WidthGroup(distinct[lo], tuple(p for p, w in enumerate(widths) if w is not None and w in members))
        )
    return tuple(groups)


def _least_padding_split(distinct: list[int], counts: dict[int, int], parts: int) -> list[tuple[int, int]]:
    """The split of `distinct` (descending) into at most `parts` runs with the fewest padded
    neurons, sum over members of (run's widest - width): dynamic programming over run ends
    (contiguous runs are optimal: a member padded to a wider group's top never pads less)."""
    n = len(distinct)
    members, neurons = [0], [0]  # prefix sums of experts and of their neurons
    for w in distinct:
        members.append(members[-1] + counts[w])
        neurons.append(neurons[-1] + counts[w] * w)

    def cost(lo: int, hi: int) -> int:
        return distinct[lo] * (members[hi] - members[lo]) - (neurons[hi] - neurons[lo])

    best: dict[tuple[int, int], tuple[int, list[tuple[int, int]]]] = {(0, 0): (0, [])}
    for k in range(1, parts + 1):
        for end in range(1, n + 1):
            options = [
                (best[k - 1, start][0] + cost(start, end), best[k - 1, start][1] + [(start, end)])
                for start in range(end)
                if (k - 1, start) in best
            ]
            if options:
                best[k, end] = min(options, key=lambda o: o[0])
    return min((best[k, n] for k in range(1, parts + 1) if (k, n) in best), key=lambda o: (o[0], len(o[1])))[
        1
    ]


@dataclass(frozen=True)
class LayerStructure:
    """One MoE layer as saved: router positions, their original expert ids and neuron widths."""

    layer: int  # decoder layer index
    expert_ids: tuple[int, ...]  # original expert id of each router position
    widths: tuple[int | None, ...]  # neurons of each router position; None for a novice
    novice_rank: int = 0  # rank R of the layer's low-rank novices (c + U V^T h); 0: constant novices

    @property
    def num_experts(self) -> int:
        """Router outputs, novices included."""
        return len(self.expert_ids)

    @property
    def novices(self) -> list[int]:
        return [p for p, w in enumerate(self.widths) if w is None]

    @property
    def weighted(self) -> tuple[int, ...]:
        """Positions holding expert weights, in router order (fused expert i is weighted[i])."""
        return tuple(p for p, w in enumerate(self.widths) if w is not None)

    @property
    def width(self) -> int:
        """The widest expert of the layer (its first width group's width)."""
        return max(w for w in self.widths if w is not None)

    def fused_index(self, position: int) -> int:
        return self.weighted.index(position)

    @cached_property
    def groups(self) -> tuple[WidthGroup, ...]:
        """The fused blocks an engine with one width per block serves this layer as (width_groups;
        computed once: loaders ask for every tensor)."""
        return width_groups(self.widths)

    def is_stock(self, full_width: int) -> bool:
        """Whether the stock experts module holds this layer: no novice, every expert at full width."""
        return all(w == full_width for w in self.widths)

    def packed(self, full_width: int) -> bool:
        """Whether moeprune holds this layer packed (novices, or experts narrower than the config)."""
        return not self.is_stock(full_width)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "num_experts": self.num_experts,
            "expert_ids": list(self.expert_ids),
            "widths": list(self.widths),
            "novice": self.novices,
            **({"novice_rank": self.novice_rank} if self.novice_rank else {}),  # absent: constant
        }


@dataclass(frozen=True)
class MtpLayer:
    """One multi-token-prediction layer a release keeps beside the decoder stack, as saved."""

    layer: int  # its number (DeepSeek's naming: num_hidden_layers + i)
    prefix: str  # its stored key prefix ("model.layers.61.", "mtp.layers.0.")
    expert_ids: tuple[int, ...]  # original expert id of each kept expert (empty: a dense layer)


@dataclass(frozen=True)
class MtpStructure:
    """The section's `mtp` entry: the MTP layers stored beside the stack, dropped to one count.

    The model the loaders build has no MTP layer (transformers never builds one): their tensors
    stay on disk for vLLM's drafts, and the loaders skip exactly the keys under `roots`."""

    roots: tuple[str, ...]  # every stored key of the MTP modules starts with one of them
    num_experts: int  # routed experts each MTP layer keeps (0: dense MTP layers)
    layers: tuple[MtpLayer, ...]

    def holds(self, key: str) -> bool:
        return key.startswith(self.roots)

    def to_json(self) -> dict[str, Any]:
        return {
            "roots": list(self.roots),
            "num_experts": self.num_experts,
            "layers": [
                {"layer": m.layer, "prefix": m.prefix, "expert_ids": list(m.expert_ids)} for m in self.layers
            ],
        }


def parse_mtp(data: Any, where: str) -> MtpStructure | None:
    """The `mtp` entry of a section (None when absent), checked field by field."""
    if data is None:
        return None
    at = f"{where}: 'mtp'"
    if not isinstance(data, dict):
        raise damaged(at, "is not a record")
    roots, count, entries = data.get("roots"), data.get("num_experts"), data.get("layers")
    if not isinstance(roots, list) or not roots or not all(isinstance(r, str) and r for r in roots):
        raise damaged(at, "'roots' must be a non-empty list of key prefixes")
    if not _int(count) or count < 0:
        raise damaged(at, f"'num_experts' {count!r} is not an expert count")
    if not isinstance(entries, list) or not entries:
        raise damaged(at, "'layers' is missing or empty")
    layers = []
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or not _int(entry.get("layer"))
            or not isinstance(entry.get("prefix"), str)
        ):
            raise damaged(at, f"layer entry {entry!r} needs an integer 'layer' and a 'prefix'")
        ids = entry.get("expert_ids")
        if not isinstance(ids, list) or len(ids) != count or not all(_int(e) and e >= 0 for e in ids):
            raise damaged(at, f"layer {entry['layer']}: 'expert_ids' must list {count} expert ids")
        if len(set(ids)) != len(ids):
            raise damaged(at, f"layer {entry['layer']}: expert ids appear twice")
        if not entry["prefix"].startswith(tuple(roots)):
            raise damaged(
                at, f"layer {entry['layer']}: prefix {entry['prefix']!r} is under none of the roots"
            )
        layers.append(MtpLayer(entry["layer"], entry["prefix"], tuple(ids)))
    return MtpStructure(tuple(roots), count, tuple(layers))


@dataclass(frozen=True)
class Structure:
    """What a moeprune-format checkpoint says about its MoE layers."""

    version: int
    base_model_type: str
    layers: tuple[LayerStructure, ...]
    family: dict[str, Any] | None = None  # how the base family lays out its blocks (version 3)
    mtp: MtpStructure | None = None  # the release's MTP layers kept beside the stack

    def layer(self, index: int) -> LayerStructure:
        for entry in self.layers:
            if entry.layer == index:
                return entry
        raise KeyError(index)


def damaged(where: str, what: str) -> FormatError:
    return FormatError(f"{where}: {what}; the checkpoint is damaged or was edited by hand, {REMAKE}")


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, Integral) and not isinstance(value, bool)


def parse_section(
    data: Any, where: str, *, num_hidden_layers: int | None = None, oldest_version: int = 1
) -> Structure:
    """The structure a `moeprune` section (or a version 1-2 `moeprune.json`) describes, checked
    field by field. `oldest_version` lets a reader that cannot build older layouts refuse them."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise damaged(where, f"'format' is not {FORMAT!r}")
    version = data.get("format_version")
    if not _int(version) or version < 1:
        raise damaged(where, f"'format_version' {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{where} is format version {version}, newer than this reader of moeprune's format reads "
            f"({FORMAT_VERSION}); upgrade moeprune (or use the modeling files saved with the checkpoint)"
        )
    if version < oldest_version:
        raise FormatError(
            f"{where} is format version {version}, older than this reader builds ({oldest_version}); "
            "re-save it with moeprune.save_pretrained(moeprune.load_pretrained(path), new_path)"
        )
    base = data.get("base_model_type", data.get("model_type"))
    if not isinstance(base, str):
        raise damaged(where, "the base model type is missing")
    entries = data.get("layers")
    if not isinstance(entries, list) or not entries:
        raise damaged(where, "'layers' is missing or empty")
    layers = tuple(_parse_layer(entry, where, version) for entry in entries)
    indices = [entry.layer for entry in layers]
    if indices != sorted(set(indices)):
        raise damaged(where, f"MoE layers {indices} are not unique and ascending")
    if _int(num_hidden_layers) and indices[-1] >= num_hidden_layers:
        raise damaged(
            where, f"layer {indices[-1]} does not exist (the model has {num_hidden_layers} decoder layers)"
        )
    family = data.get("family")
    if family is not None and not isinstance(family, dict):
        raise damaged(where, "'family' is not a record")
    mtp = parse_mtp(data.get("mtp"), where)
    return Structure(version=version, base_model_type=base, layers=layers, family=family, mtp=mtp)


def _parse_layer(entry: Any, where: str, version: int) -> LayerStructure:
    if not isinstance(entry, dict) or not _int(entry.get("layer")):
        raise damaged(where, f"layer entry {entry!r} has no integer 'layer'")
    at = f"layer {entry['layer']}"
    ids = entry.get("expert_ids")
    if not isinstance(ids, list) or not ids or not all(_int(e) and e >= 0 for e in ids):
        raise damaged(where, f"{at}: 'expert_ids' must be a non-empty list of expert ids")
    if len(set(ids)) != len(ids):
        raise damaged(
            where, f"{at}: expert ids {sorted(e for e in set(ids) if ids.count(e) > 1)} appear twice"
        )
    count = entry.get("num_experts")
    if count != len(ids):
        raise damaged(where, f"{at}: num_experts {count!r} disagrees with {len(ids)} expert ids")
    if version >= 3:
        widths = entry.get("widths")
        if not isinstance(widths, list) or len(widths) != len(ids):
            raise damaged(where, f"{at}: 'widths' must list one width (or null for a novice) per expert")
        if not all(w is None or (_int(w) and w > 0) for w in widths):
            raise damaged(where, f"{at}: widths must be positive neuron counts or null, got {widths}")
        novice = entry.get("novice", [])
        if not isinstance(novice, list) or sorted(novice) != [p for p, w in enumerate(widths) if w is None]:
            raise damaged(where, f"{at}: 'novice' {novice!r} disagrees with the null widths")
        rank = entry.get("novice_rank", 0)
        if not _int(rank) or rank < 0 or (rank and not novice):
            raise damaged(where, f"{at}: 'novice_rank' {rank!r} is not a rank of this layer's novices")
    else:
        widths, rank = _legacy_widths(entry, where, at, len(ids)), 0
    return LayerStructure(entry["layer"], tuple(ids), tuple(widths), rank)


def _legacy_widths(entry: dict, where: str, at: str, count: int) -> list[int | None]:
    """Versions 1-2: {"packed": {"novice": [...], "widths": {position: width}}}; 0 = full width."""
    packed = entry.get("packed") or {"novice": [], "widths": {}}
    try:
        novice = {int(p) for p in packed["novice"]}
        given = {int(p): w for p, w in packed["widths"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise damaged(where, f"{at}: malformed 'packed' entry ({exc})") from exc
    if entry.get("packed") and (novice | set(given)) != set(range(count)):
        raise damaged(where, f"{at}: 'packed' does not cover every position")
    widths = [None if p in novice else given.get(p, 0) for p in range(count)]
    if not all(w is None or (_int(w) and w >= 0) for w in widths):
        raise damaged(where, f"{at}: widths must be neuron counts, got {widths}")
    return widths


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json as a dict, with one clear error when it is missing or damaged."""
    folder = Path(folder)
    path = folder / CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{folder} has no {CONFIG}; pass a transformers checkpoint folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{path} is damaged ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(data, dict):
        raise FormatError(f"{path} is damaged (not a JSON object); restore it from the original checkpoint")
    return data


def read_structure(folder: str | Path, config: dict[str, Any] | None = None) -> Structure | None:
    """The structure of the checkpoint in `folder` (any version), checked; None for a stock one."""
    folder = Path(folder)
    config = read_config(folder) if config is None else config
    limit = config.get("num_hidden_layers")
    if "moeprune" in config:
        return parse_section(
            config["moeprune"], f"{folder / CONFIG} ('moeprune' section)", num_hidden_layers=limit
        )
    legacy = folder / LEGACY_FILE
    if legacy.is_file():
        try:
            data = json.loads(legacy.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"{legacy} is damaged ({exc}); {REMAKE}") from exc
        return parse_section(data, str(legacy), num_hidden_layers=limit)
    return None
