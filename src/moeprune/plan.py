"""The pruning plan: the one object every stage produces or consumes.

A plan says, per MoE layer, which original experts stay, which are dropped, which become
novices (a constant vector, still routed) and how many intermediate neurons each kept expert
keeps. It is plain JSON so a plan can be inspected, diffed, edited and applied later, and it
always uses *original* expert ids, so it stays meaningful after surgery renumbers experts.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.errors import MoePruneError

FORMAT = "moeprune-plan"
FORMAT_VERSION = 1


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _ids(values: list[Any], what: str, where: str) -> list[int]:
    if not all(_is_int(v) for v in values):
        raise MoePruneError(f"{where}: {what} must hold integer expert ids, got {values!r}")
    ids = [int(v) for v in values]
    if len(set(ids)) != len(ids):
        raise MoePruneError(f"{where}: {what} lists an expert id twice: {ids}")
    return ids


@dataclass
class LayerPlan:
    """What happens to the routed experts of one MoE layer (original expert ids throughout)."""

    layer: int  # decoder layer index
    num_experts: int  # original routed experts
    top_k: int
    kept: list[int]  # ascending
    dropped: list[int] = field(default_factory=list)  # weights and router row removed
    novice: list[int] = field(default_factory=list)  # replaced by a constant vector; still routed
    neurons: dict[int, int] = field(default_factory=dict)  # expert id -> neurons kept; absent = all

    def validate(self, intermediate_size: int | None = None) -> None:
        """Raise MoePruneError naming this layer if the invariants do not hold."""
        where = f"plan layer {self.layer}"
        for name in ("layer", "num_experts", "top_k"):
            if not _is_int(getattr(self, name)):
                raise MoePruneError(f"{where}: {name} must be an integer, got {getattr(self, name)!r}")
        kept = _ids(self.kept, "kept", where)
        dropped = _ids(self.dropped, "dropped", where)
        novice = set(_ids(self.novice, "novice", where))
        if not 1 <= self.top_k <= self.num_experts:
            raise MoePruneError(
                f"{where}: top_k {self.top_k} must be between 1 and num_experts {self.num_experts}"
            )
        if kept != sorted(kept):
            raise MoePruneError(f"{where}: kept must be in ascending order, got {kept}")
        if set(kept) & set(dropped):
            raise MoePruneError(
                f"{where}: experts {sorted(set(kept) & set(dropped))} are both kept and dropped"
            )
        missing = set(range(self.num_experts)) - set(kept) - set(dropped)
        unknown = (set(kept) | set(dropped)) - set(range(self.num_experts))
        if missing or unknown:
            raise MoePruneError(
                f"{where}: kept and dropped must partition experts 0..{self.num_experts - 1}; "
                f"missing {sorted(missing)}, out of range {sorted(unknown)}"
            )
        if len(kept) < self.top_k:
            raise MoePruneError(f"{where}: keeps {len(kept)} experts, fewer than top_k {self.top_k}")
        if not novice <= set(kept):
            raise MoePruneError(f"{where}: novice experts {sorted(novice - set(kept))} are not kept")
        bad_keys = set(_ids(list(self.neurons), "neurons keys", where)) - (set(kept) - novice)
        if bad_keys:
            raise MoePruneError(
                f"{where}: neurons given for experts {sorted(bad_keys)} that are not kept whole experts"
            )
        high = intermediate_size if intermediate_size is not None else float("inf")
        for expert, count in self.neurons.items():
            if not _is_int(count) or not 1 <= count <= high:
                raise MoePruneError(
                    f"{where}: expert {expert} keeps {count!r} neurons; must be an integer in [1, {high}]"
                )

    @property
    def removed(self) -> int:
        """Experts that lost their weights: dropped ones plus novices."""
        return len(self.dropped) + len(self.novice)


@dataclass(frozen=True)
class ModelShape:
    """The model a plan is made for: its type and, per MoE layer, the decoder layer index, the
    routed expert count and top_k (what `Plan.from_removals` needs besides the removals).

    One record instead of three parallel lists passed side by side; `of` reads it from a model, a
    meta-device model or a checkpoint's layout (anything with `model_type` and `layers` whose
    entries have `index`, `num_experts` and `top_k`).
    """

    model_type: str
    layers: Sequence[int]  # decoder layer indices, in order
    num_experts: Sequence[int]  # original routed experts per layer
    top_k: Sequence[int]

    @classmethod
    def of(cls, moe: Any) -> ModelShape:
        """The shape of an MoEModel (or a checkpoint layout that looks like one)."""
        layers = moe.layers
        return cls(
            model_type=moe.model_type,
            layers=[m.index for m in layers],
            num_experts=[m.num_experts for m in layers],
            top_k=[m.top_k for m in layers],
        )


@dataclass
class Plan:
    """A whole-model pruning plan; see the module docstring."""

    model_type: str
    layers: list[LayerPlan]
    criterion: str
    allocation: str
    method: str  # the registered method that made it (a label: the layers say what happens)
    sparsity: float
    data_fingerprint: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        *,
        model_type: str,
        layers: list[LayerPlan],
        criterion: str,
        allocation: str,
        method: str,
        sparsity: float,
        data_fingerprint: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Plan:
        """Build and validate a plan, recording the library versions that made it."""
        plan = cls(
            model_type=model_type,
            layers=layers,
            criterion=criterion,
            allocation=allocation,
            method=method,
            sparsity=sparsity,
            data_fingerprint=data_fingerprint,
            versions=_versions(),
            extra=dict(extra or {}),
        )
        plan.validate()
        return plan

    @classmethod
    def from_removals(
        cls,
        shape: ModelShape,
        *,
        removals: Sequence[Sequence[int]],
        criterion: str,
        allocation: str,
        method: str = "drop",
        sparsity: float,
        novices: bool = False,
        data_fingerprint: str = "",
    ) -> Plan:
        """A plan from per-layer expert ids to remove: dropped, or made novices with `novices`.

        `shape` is the model's per-layer structure (`ModelShape.of(moe)`); `removals` has one entry
        per MoE layer, in `shape.layers` order.
        """
        num_experts, top_k, layer_indices = shape.num_experts, shape.top_k, shape.layers
        lengths = {len(num_experts), len(top_k), len(layer_indices), len(removals)}
        if len(lengths) != 1:
            raise MoePruneError(
                "num_experts, top_k, layer_indices and removals must have one entry per MoE layer"
            )
        layers = []
        for index, n, k, gone in zip(layer_indices, num_experts, top_k, removals):
            gone_ids = sorted(_ids(list(gone), "removals", f"plan layer {index}"))
            rest = sorted(set(range(int(n))) - set(gone_ids))
            layers.append(
                LayerPlan(
                    layer=int(index),
                    num_experts=int(n),
                    top_k=int(k),
                    kept=list(range(int(n))) if novices else rest,
                    dropped=[] if novices else gone_ids,
                    novice=gone_ids if novices else [],
                )
            )
        return cls.create(
            model_type=shape.model_type,
            layers=layers,
            criterion=criterion,
            allocation=allocation,
            method=method,
            sparsity=sparsity,
            data_fingerprint=data_fingerprint,
        )

    def validate(self, intermediate_sizes: dict[int, int] | None = None) -> None:
        """Raise MoePruneError (naming the layer) if the plan is inconsistent.

        ``intermediate_sizes`` maps decoder layer index to the experts' intermediate size, to
        bound the neuron counts.
        """
        if not isinstance(self.method, str) or not self.method:
            raise MoePruneError(f"plan method must name the method that made it, got {self.method!r}")
        if (
            isinstance(self.sparsity, bool)
            or not isinstance(self.sparsity, Real)
            or not 0 <= self.sparsity < 1
        ):
            raise MoePruneError(f"plan sparsity must be in [0, 1), got {self.sparsity!r}")
        if not self.layers:
            raise MoePruneError("plan has no layers")
        indices = [lp.layer for lp in self.layers]
        if indices != sorted(set(indices)):
            raise MoePruneError(f"plan layers must be unique and in ascending order, got {indices}")
        sizes = intermediate_sizes or {}
        for lp in self.layers:
            lp.validate(sizes.get(lp.layer))

    def removed_per_layer(self) -> list[int]:
        """Per layer, experts that lost their weights (dropped plus novices): the allocation r_l."""
        return [lp.removed for lp in self.layers]

    def is_uniform(self) -> bool:
        """True when a stock config can express the result: equal expert counts, equal widths.

        That is: every layer keeps the same number of experts, no novices, and every kept expert
        of every layer has the same neuron count (or none is neuron-pruned).
        """
        if any(lp.novice for lp in self.layers) or len({len(lp.kept) for lp in self.layers}) > 1:
            return False
        widths = {lp.neurons.get(e) for lp in self.layers for e in lp.kept}
        return len(widths) <= 1

    def layer(self, layer_index: int) -> LayerPlan:
        """The plan of decoder layer ``layer_index``."""
        for lp in self.layers:
            if lp.layer == layer_index:
                return lp
        raise MoePruneError(
            f"plan has no MoE layer {layer_index}; it covers layers {[lp.layer for lp in self.layers]}"
        )

    def to_json(self) -> str:
        data = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        for lp in data["layers"]:
            lp["neurons"] = {str(int(e)): int(c) for e, c in sorted(lp["neurons"].items())}
        return json.dumps(data, indent=2, default=_json_default) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse and validate; anything that is not a version-1 moeprune plan is an error."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MoePruneError(f"not a moeprune plan: invalid JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MoePruneError(f"not a moeprune plan: the 'format' field must be {FORMAT!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise MoePruneError(
                f"unsupported moeprune plan format_version {data.get('format_version')!r}; this version reads {FORMAT_VERSION}"
            )
        try:
            layers = [
                LayerPlan(**{**lp, "neurons": {int(e): c for e, c in lp.get("neurons", {}).items()}})
                for lp in data.pop("layers")
            ]
            del data["format"], data["format_version"]
            plan = cls(layers=layers, **data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MoePruneError(f"malformed moeprune plan: {exc}") from exc
        plan.validate()
        return plan

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Validate, then write atomically (temporary file + rename): a crash never leaves half a plan."""
        self.validate()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(self.to_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise MoePruneError(f"cannot read plan file {path}: {exc.strerror or exc}") from exc
        return cls.from_json(text)


def _json_default(value: Any) -> Any:
    """numpy scalars (common in ``extra``) serialise as plain numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _versions() -> dict[str, str]:
    """Library versions, read from package metadata so that torch need not be imported (a copy:
    each plan owns its own)."""
    return dict(_installed_versions())


@functools.cache
def _installed_versions() -> dict[str, str]:
    """Read once a process: a search builds a plan per candidate, and reading package metadata
    took 28 ms each time (8 % of a mixed + evo search on the quick demo models, profiled)."""
    versions = {"moeprune": __version__}
    for name in ("torch", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
