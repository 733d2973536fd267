"""report.json of a prune as one typed object: built once by the producer, read by every renderer.

Why: report.json is a file-format contract read by the console summary, report.md, the model card
and `moeprune report`. As a `PruneReport` a key a producer forgot or a reader misspells is an
error where it happens, and one place decides what the file holds: `to_json` writes the keys in
the order report.json has always had them, per kind of prune (in memory; without loading, by
dropping experts or narrowing them), leaving out what that kind or that stage does not know;
`from_json` reads any report back, older ones (fewer keys: defaults) and newer ones (unknown keys
kept in `extra` and written back) alike. The opaque documents (`scores`, `timing_s`,
`kept_neurons`) stay dictionaries; the parts readers use field by field are moeprune.report.parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.errors import MoePruneError
from moeprune.report.parts import (
    CriterionAuto,
    DataSummary,
    DiskBytes,
    KeptRow,
    LayerShape,
    NoviceFits,
    ParameterCounts,
    Part,
    Portfolio,
    Repair,
    SearchSummary,
    ServeCheck,
    Serving,
    Surgery,
    TargetSize,
)

PRUNE = "prune"  # `command` of a prune of the loaded model
NO_LOAD = "prune --no-load"  # `command` of a prune that rewrote the shards without loading them

_HEAD = ("command", "moeprune_version", "model", "output", "model_type")
_IN_MEMORY = (
    *_HEAD,
    *("criterion", "prune_first", "allocation", "method", "sparsity", "sparsity_unit", "expert_multiple"),
    *("budget_experts_removed", "removed_per_layer", "surgery", "layers_before", "layers_after"),
    *("parameters_before", "parameters_after", "kept_per_layer", "data", "unseen_experts", "unseen"),
    *(
        "super_experts",
        "super_experts_note",
        "release_layers",
        "scores",
        "serving",
        "criterion_auto",
        "portfolio",
        "search",
    ),
    *("save_dtype", "command_line", "format", "disk_bytes", "timing_s", "target"),
)
_NO_LOAD_HEAD = (*_HEAD, "criterion", "allocation", "method", "sparsity", "format")
_EVIDENCE = ("timing_s", "disk_bytes", "save_dtype", "target")  # written with the rewritten shards
_NO_LOAD_DROP = (
    *_NO_LOAD_HEAD,
    *("budget_experts_removed", "removed_per_layer", "data", "unseen", "super_experts", "super_experts_note"),
    *("release_layers", "scores"),
    *_EVIDENCE,
)
_NO_LOAD_NEURONS = (
    *_NO_LOAD_HEAD,
    *("prune_first", "sparsity_unit", "surgery", "kept_neurons", "layers_before", "parameters_before"),
    *("data", "unseen_experts", "unseen", "super_experts", "super_experts_note", "release_layers", "scores"),
    *("layers_after", "parameters_after"),
    *_EVIDENCE,
)
_REQUIRED = ("criterion", "allocation", "method", "sparsity")


def _part(kind: type[Part]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else kind.from_json(value)


_READ: dict[str, Callable[[Any], Any]] = {
    "surgery": _part(Surgery),
    "layers_before": LayerShape.rows,
    "layers_after": LayerShape.rows,
    "parameters_before": _part(ParameterCounts),
    "parameters_after": _part(ParameterCounts),
    "kept_per_layer": KeptRow.rows,
    "data": lambda value: DataSummary.from_json(value or {}),
    "serving": _part(Serving),
    "criterion_auto": _part(CriterionAuto),
    "portfolio": _part(Portfolio),
    "search": _part(SearchSummary),
    "novice_fits": _part(NoviceFits),
    "repair": _part(Repair),
    "disk_bytes": _part(DiskBytes),
    "target": _part(TargetSize),
    "serve_check": _part(ServeCheck),
}


def _write(value: Any) -> Any:
    if isinstance(value, Part):
        return value.to_json()
    if isinstance(value, list) and value and isinstance(value[0], Part):
        return [row.to_json() for row in value]
    return value


@dataclass(kw_only=True)
class PruneReport:
    """Everything a prune did, cost, kept and measured (report.json). None: the key is absent."""

    # where it came from and went: added by the file-level job (None in `api.prune`'s result)
    command: str | None = None  # PRUNE or NO_LOAD
    moeprune_version: str | None = None
    model: str | None = None
    output: str | None = None
    model_type: str | None = None
    # what was done
    criterion: str
    prune_first: str | None = None
    allocation: str
    method: str
    sparsity: float
    # drop's --reroute when it is not the default `next` ("none": empty picks, stored as zero novices)
    reroute: str | None = None
    sparsity_unit: str | None = None  # "experts" or "routed-expert parameters"
    expert_multiple: int = 1
    budget_experts_removed: int | None = None  # written even when None (no expert budget)
    removed_per_layer: dict[str, int] = field(default_factory=dict)
    kept_whole: dict[str, str] | None = None  # layers no method may prune (hash routing) -> why
    surgery: Surgery | None = None
    kept_neurons: dict[str, Any] | None = None  # no-load neurons: importance, digest of the kept ids
    # what it kept and cost
    layers_before: list[LayerShape] | None = None
    layers_after: list[LayerShape] | None = None
    parameters_before: ParameterCounts | None = None
    parameters_after: ParameterCounts | None = None
    kept_per_layer: list[KeptRow] | None = None
    # what it observed and measured
    data: DataSummary = field(default_factory=DataSummary)
    unseen_experts: list[str] | None = None  # notes, one per layer with unseen experts
    # what happened to the parts a release stores beside the decoder stack (MTP layers, tensors the
    # model class does not load), one note each
    release_layers: list[str] | None = None
    unseen: dict[str, list[int]] = field(default_factory=dict)  # per layer, experts no token reached
    # per layer, the super experts found in the calibration statistics (criteria/super_experts.py);
    # None: not checked (no calibration data was read)
    super_experts: dict[str, list[int]] | None = None
    super_experts_note: str | None = None  # one sentence: kept, allowed to go, or not checked and why
    scores: dict[str, Any] = field(default_factory=dict)  # the scores document (`moeprune score`)
    serving: Serving | None = None
    criterion_auto: CriterionAuto | None = None
    portfolio: Portfolio | None = None  # --method auto: every recipe's fitness and time
    search: SearchSummary | None = None
    novice_fits: NoviceFits | None = None  # low-rank novices: calibration beside held-out fit errors
    repair: Repair | None = None  # --repair: what it trained, the held-out fitness before and after
    # how it was saved
    save_dtype: str | None = None
    command_line: str | None = None
    format: str | None = None  # "stock" or "moeprune"
    disk_bytes: DiskBytes | None = None
    timing_s: dict[str, float] | None = None
    target: TargetSize | None = None  # with a size target: it, the solved sparsity, the bytes written
    # with --quantize: the scheme, llm-compressor's versions, the calibration tokens per kept expert
    quantization: dict[str, Any] | None = None
    # checked afterwards: `moeprune serve-check` (written after the keys above)
    serve_check: ServeCheck | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    @classmethod
    def no_load(
        cls,
        model: str | Path,
        output: str | Path,
        model_type: str,
        criterion: str,
        method: str,
        sparsity: float,
        allocation: str,
        **facts: Any,
    ) -> PruneReport:
        """The report of a prune without loading: a stock checkpoint (`format` set to moeprune where
        the plan keeps different counts per layer: the global allocation, layers kept whole)."""
        return cls(
            command=NO_LOAD,
            moeprune_version=__version__,
            model=str(model),
            output=str(output),
            model_type=model_type,
            criterion=criterion,
            allocation=allocation,
            method=method,
            sparsity=sparsity,
            format="stock",
            **facts,
        )

    def _layout(self) -> tuple[str, ...]:
        if self.command == NO_LOAD:
            return _NO_LOAD_NEURONS if self.kept_neurons is not None else _NO_LOAD_DROP
        return _IN_MEMORY

    def _kept_null(self) -> set[str]:
        """Keys written even when None: they are known, and their value is `null`."""
        keep = {"budget_experts_removed"}
        if self.command == PRUNE:  # set by the file-level job, the command line None from the API
            keep |= {"save_dtype", "command_line"}
        elif self.command == NO_LOAD and self.disk_bytes is not None:  # the shards' dtype, if known
            keep.add("save_dtype")
        return keep

    def to_json(self) -> dict[str, Any]:
        """report.json: this kind's keys in their order, then any other field set (off its
        default), then the unknown keys read in. Opaque documents are shared, not copied."""
        layout, nulls = self._layout(), self._kept_null()
        out = {k: _write(getattr(self, k)) for k in layout if getattr(self, k) is not None or k in nulls}
        for f in fields(self):
            if f.name in layout or f.name == "extra":
                continue
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if value != default:
                out[f.name] = _write(value)
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> PruneReport:
        """A report read back (report.json of any moeprune version): absent keys take defaults."""
        missing = [k for k in _REQUIRED if k not in document]
        if missing:
            raise MoePruneError(f"not a prune report (report.json): it has no {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: _READ.get(k, _same)(v) for k, v in document.items() if k in known}
        return cls(**values, extra={k: v for k, v in document.items() if k not in known})


def _same(value: Any) -> Any:
    return value


def as_report(report: PruneReport | Mapping[str, Any]) -> PruneReport:
    """The typed report, from itself or from report.json's dictionary (the readers take either)."""
    return report if isinstance(report, PruneReport) else PruneReport.from_json(report)
