"""The nested parts of report.json that its readers use field by field, as small dataclasses.

Why dataclasses: the console summary, report.md and the model card each pick numbers out of these
parts; an attribute a producer forgot to fill or a reader misspells fails where it happens,
instead of silently dropping a line. Each part writes its keys in field order and leaves a key out
where its field is None (in report.json a part's keys are either there with a value or absent), so
`Part.from_json(d).to_json() == d` for every part a prune writes. Unknown keys are not kept: the
parts are summaries whose keys moeprune decides (search.json's other keys, for one, stay out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from moeprune.data.loading import CalibrationData
    from moeprune.observe.stats import ExpertStats
    from moeprune.surgery.fit_holdout import FitCheck

_P = TypeVar("_P", bound="Part")


class Part:
    """A JSON object with fixed keys: written in field order, a None field being an absent key."""

    nested: ClassVar[Mapping[str, type[Part]]] = {}  # fields that are parts themselves

    def __bool__(self) -> bool:
        """False when it has no key, like the empty JSON object it writes (`if report.disk_bytes:`)."""
        return any(getattr(self, f.name) is not None for f in fields(self))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.to_json() if isinstance(value, Part) else value
        return out

    @classmethod
    def from_json(cls: type[_P], document: Mapping[str, Any]) -> _P:
        """The part from its JSON object; keys it does not know are left out."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in document:
                value = document[f.name]
                part = cls.nested.get(f.name)
                values[f.name] = part.from_json(value) if part is not None and value is not None else value
        return cls(**values)

    @classmethod
    def rows(cls: type[_P], rows: Sequence[Mapping[str, Any]] | None) -> list[_P] | None:
        """A list of parts from a list of JSON objects (None stays None: the key was absent)."""
        return None if rows is None else [cls.from_json(row) for row in rows]


@dataclass
class ParameterCounts(Part):
    """`parameters_before` / `parameters_after`: total, routed-expert (E) and active (A) parameters."""

    total: int | None = None
    routed_experts: int | None = None
    active_routed_experts: int | None = None
    active_per_token: int | None = None


@dataclass
class DiskBytes(Part):
    """`disk_bytes`: the safetensors weights on disk, before and after."""

    before: int | None = None
    after: int | None = None


@dataclass
class TargetSize(Part):
    """`target`: a size target and the sparsity solved for it. Bytes are the safetensors files'
    (`disk_bytes`): `predicted_bytes` the planned result's (its tensors exactly, its headers
    bounded by the input's), `written_bytes` the files written; `step_below` the next lower
    sparsity step, whose plan (`step_below_bytes`) would not fit."""

    target_bytes: int | None = None
    sparsity: float | None = None
    format: str | None = None  # the format the bytes are counted in ("bfloat16", fp8 ...)
    predicted_bytes: int | None = None
    written_bytes: int | None = None
    unpruned_bytes: int | None = None
    step_below: float | None = None
    step_below_bytes: int | None = None


@dataclass(kw_only=True)
class LayerShape(Part):
    """One row of `layers_before` / `layers_after`: a MoE layer's experts, novices, top-k, widths."""

    layer: int
    experts: int
    novices: int = 0
    top_k: int | None = None
    intermediate_size: int | None = None
    min_intermediate_size: int | None = None  # absent in reports older than per-expert widths


@dataclass(kw_only=True)
class KeptRow(Part):
    """One row of `kept_per_layer` (what density.png draws): experts and routed parameters kept."""

    layer: int
    experts_before: int
    experts_after: int | None = None
    routed_params_before: int
    routed_params_after: int


@dataclass
class Surgery(Part):
    """`surgery`: what the surgery did: a rectangular (stock) result and its one expert width, or
    the layers it packed."""

    form: str | None = None
    intermediate_size: int | None = None
    packed_layers: list[int] | None = None


@dataclass
class DataSummary(Part):
    """`data`: the calibration data read; empty (`{}`) when the prune read none."""

    sources: list[str] | None = None
    samples: int | None = None
    tokens: int | None = None
    truncated_samples: int | None = None
    text_only: bool | None = None
    fingerprint: str | list[str] | None = None
    notes: list[str] | None = None

    @classmethod
    def of(cls, sets: Sequence[CalibrationData], stats: Sequence[ExpertStats]) -> DataSummary:
        """The summary of the calibration sets a prune observed (and the statistics they gave)."""
        if not sets:
            return cls()
        return cls(
            sources=[s for d in sets for s in d.sources],
            samples=sum(len(d.samples) for d in sets),
            tokens=int(sum(s.tokens for s in stats)),
            truncated_samples=sum(d.truncated for d in sets),
            text_only=all(d.text_only for d in sets),
            fingerprint=sets[0].fingerprint if len(sets) == 1 else [d.fingerprint for d in sets],
            notes=[n for d in sets for n in d.notes],
        )


@dataclass
class Serving(Part):
    """`serving` (moeprune's format only): the parameters vLLM holds (`vllm_parameters`: each layer
    served as width groups, experts padded to their group's widest), or why moeprune's plugin does
    not serve this family; for a result with novices, which vLLM path serves them (`vllm_native`:
    natively in vLLM >= 0.33, serve/vllm_native.py, or through the plugin only, and why)."""

    vllm_parameters: int | None = None
    vllm_refused: str | None = None
    vllm_native: str | None = None

    @classmethod
    def of(cls, parameters: int) -> Serving:
        """What vLLM holds."""
        return cls(vllm_parameters=parameters)


@dataclass
class CriterionAuto(Part):
    """`criterion_auto`: the uniform plan of every criterion scored by `fitness` on the search
    data; `table` rows are `{"criterion": name, fitness: value}`."""

    fitness: str
    chosen: str
    table: list[dict[str, Any]]


@dataclass
class Portfolio(Part):
    """`portfolio`: `--method auto`'s contest (search/portfolio.py). Each of `recipes` is one:
    `label`, `criterion`, `method`, `allocation`, `sparsity`, and its `runs` ({budget, fitness,
    seconds}: successive halving ran it at those fractions of its search budget; `within_noise`
    {leader, gap, standard_error} on a run outside its rung's best third that went on) or `refused`
    (why it could not run), and `repaired` ({before, after}: with --repair, the held-out fitness of
    its best plan repaired, for the finalists); `chosen` is the winning row's label, `budget` the
    fraction it won at, `halving` how the contest stopped recipes."""

    fitness: str
    chosen: str
    budget: float
    recipes: list[dict[str, Any]]
    halving: str
    seconds: float | None = None  # the whole contest, observation and teacher included

    def line(self) -> str:
        """The summary's line: the winner and how many recipes it beat."""
        ran = [r for r in self.recipes if r.get("runs")]
        best = max((run[self.fitness] for run in _runs_of(self.recipes, self.chosen)), default=float("nan"))
        repaired = [r for r in self.recipes if r.get("repaired")]
        after = next((r["repaired"]["after"] for r in repaired if r["label"] == self.chosen), None)
        tail = (
            f"; of the {len(repaired)} best repaired, it was best after repair ({after:.4f})"
            if after is not None
            else ""
        )
        return (
            f"{self.chosen} ({self.fitness} {best:.4f} on the search data) beat {len(ran) - 1} other "
            f"recipes in {self.seconds or 0:.0f} s{tail}; portfolio.png shows them all"
        )


def _runs_of(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    return next((r.get("runs") or [] for r in rows if r["label"] == label), [])


@dataclass
class Repair(Part):
    """`repair`: what `--repair` trained (per part: tensors and parameters; tensors no gradient
    reached), the held-out fitness before and after, and whether the repaired tensors were kept."""

    parts: list[str] | None = None
    trained: list[dict[str, Any]] | None = None  # {"part", "tensors", "parameters"}
    no_gradient: list[str] | None = None  # selection-only tensors (a correction bias): left as they were
    fitness: str | None = None
    held_out: str | None = None  # "search data" or "held-back calibration samples"
    held_out_samples: int | None = None
    calibration_positions: int | None = None
    before: float | None = None
    after: float | None = None
    kept: bool | None = None
    best_step: int | None = None
    steps_run: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    history: list[dict[str, float]] | None = None
    seconds: dict[str, float] | None = None

    def line(self) -> str:
        """One sentence: what was trained and the held-out fitness before and after."""
        trained = ", ".join(f"{r['part']} ({r['parameters']:,} parameters)" for r in self.trained or [])
        outcome = (
            f"kept (best at step {self.best_step} of {self.steps_run})"
            if self.kept
            else f"not kept: no step of {self.steps_run} beat the unrepaired model there"
        )
        return (
            f"trained {trained or 'nothing'}; {self.fitness} on the {self.held_out} "
            f"{self.before:.4f} before, {self.after:.4f} after; {outcome}"
        )


@dataclass
class SearchUniform(Part):
    """The uniform allocation a search is measured against, and its fitness."""

    allocation: list[int] | None = None
    fitness_value: float | None = None


@dataclass
class SearchStop(Part):
    """Why an EvoESAP search stopped, after how many generations."""

    reason: str | None = None
    generations_run: int | None = None
    patience: int | None = None


@dataclass
class SearchSummary(Part):
    """`search`: the summary of search.json a report keeps (`from_json(search_doc)` picks it)."""

    nested: ClassVar[Mapping[str, type[Part]]] = {"uniform": SearchUniform, "stopped": SearchStop}

    fitness: str | None = None
    budget: int | None = None
    allocation: list[int] | None = None
    genes: list[list[int]] | None = None  # mixed + evo: (whole, narrowed, novice, dropped, width) per layer
    seeds: dict[str, Any] | None = None  # mixed + evo: the recipes of generation 0, their genes and fitness
    fitness_value: float | None = None
    uniform: SearchUniform | None = None
    evaluations: int | None = None
    steps: int | None = None  # the gradient allocation's training steps (evo: None)
    stopped: SearchStop | None = None
    teacher_cache: dict[str, Any] | None = None
    notes: list[str] | None = None


@dataclass
class NoviceFits(Part):
    """`novice_fits`: low-rank novices checked on tokens they were not fitted on (surgery/
    fit_holdout.py). Per MoE layer, the saved novices' squared error relative to constant novices'
    (1: no better; token-weighted over the layer's novices) on the calibration tokens they were
    fitted on beside the held-out tokens, and the held-out error the unshrunk rank-R fit would have
    had, so overfitting shows; how many kept only their constant; each novice with too few routed
    tokens for its parameters in one line."""

    rank: int | None = None
    held_out: str | None = None  # where the held-out tokens came from
    layers: list[dict[str, Any]] | None = None
    too_few: list[str] | None = None

    @classmethod
    def of(cls, checks: Sequence[FitCheck], source: str) -> NoviceFits:
        rows = []
        for layer in sorted({c.layer for c in checks}):
            mine = [c for c in checks if c.layer == layer]
            held = [c for c in mine if c.held_out is not None]
            rows.append(
                {
                    "layer": layer,
                    "novices": len(mine),
                    "constant": sum(c.chosen_rank == 0 for c in mine),
                    "calibration": _weighted([(c.calibration, c.tokens) for c in mine]),
                    "held_out": _weighted([(c.held_out, c.held_tokens) for c in held]),
                    "unshrunk_held_out": _weighted([(c.unshrunk, c.held_tokens) for c in held]),
                }
            )
        too_few = [c.warning() for c in checks if c.too_few]
        return cls(max((c.rank for c in checks), default=0), source, rows, too_few or None)


def _weighted(pairs: Sequence[tuple[float | None, int]]) -> float | None:
    """The weight-averaged value (None: no weight, or no value)."""
    total = sum(w for v, w in pairs if v is not None)
    return round(sum(v * w for v, w in pairs if v is not None) / total, 6) if total else None


@dataclass
class ServeCheck(Part):
    """`serve_check`: what `moeprune serve-check` measured (moeprune.evaluate.serve_check): vLLM's
    greedy tokens and top-k logprobs against `moeprune.load_pretrained`'s on the same prompts,
    both in float32, and vLLM's generation speed (and the base model's, with a reference)."""

    verdict: str | None = None  # "match" or "mismatch"
    vllm_version: str | None = None
    dtype: str | None = None
    prompt_sources: list[str] | None = None
    prompts: int | None = None
    new_tokens: int | None = None  # generated per prompt
    top_k: int | None = None  # logprobs compared per position
    tokens_compared: int | None = None
    ties: int | None = None  # positions where the engines' tokens differ within rounding
    max_logprob_difference: float | None = None
    logprob_atol: float | None = None
    first_difference: str | None = None  # in words: prompt, generated token, what differs
    first_difference_at: list[int] | None = None  # [prompt, generated token], 0-based
    vllm_tokens_per_s: float | None = None
    reference: str | None = None
    reference_tokens_per_s: float | None = None
    throughput_ratio: float | None = None  # vllm_tokens_per_s / reference_tokens_per_s
