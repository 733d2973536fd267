"""search.json as one typed document: every search writes a `SearchDocument`, and the report, the
summary and the plots read one (`SearchDocument.from_json`), never a hand-built dict by key.

Every search has the same spine: the fitness and its direction, the settings, what it found and
its fitness, what that is measured against (the uniform plan, the seeds, the trained plan), how
many candidates it scored and why it stopped, its history (evo: `generations`; gradient:
`training` and the trained logits), the search data and teacher cache, the timings and the
speed-ups. What a search found is its own (drop counts: `allocation`; mixed: `genes`, widths;
joint: schemes and bytes), so it is a section of its own keys (`found`), as are the history,
the references and the speed-ups.

`to_json()` writes today's search.json keys, in today's order (users' scripts and
scripts/golden.py read them): `head` (keys written before the fitness: the gradient
allocation's `allocation_method`, the joint searches' space, schemes and target), fitness,
higher_is_better, `space` (mixed evo's description), config, `found`, fitness_value,
`references`, evaluations, steps, stopped, `history`, the data summary, timings_s, `speed`,
criterion. A field that is None is not written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from moeprune.config import SearchConfig
from moeprune.errors import MoePruneError

_REFERENCES = ("trained", "uniform", "seeds", "start")  # what the result is measured against
_HISTORY = ("generations", "training", "keep_logits", "form_logits")
_SPEED = ("speedups", "raced_evaluations", "distributed")
_SECTIONS = {"head", "found", "references", "history", "speed"}
_SECTION_OF = {
    **dict.fromkeys(_REFERENCES, "references"),
    **dict.fromkeys(_HISTORY, "history"),
    **dict.fromkeys(_SPEED, "speed"),
}
_ORDER: tuple[str, ...] = (
    "head",
    "fitness",
    "higher_is_better",
    "space",
    "config",
    "found",
    "fitness_value",
    "references",
)
_ORDER += ("evaluations", "steps", "stopped", "history", "search_samples", "teacher_cache", "notes")
_ORDER += ("timings_s", "speed", "criterion")
_SPINE = ("fitness", "higher_is_better", "config", "fitness_value", "evaluations", "stopped")
EVO_SETTINGS = ("population", "elites", "generations", "delta_max", "tau_max", "seed", "patience")


def evo_settings(config: SearchConfig) -> dict[str, Any]:
    """search.json's `config` of an evo search: the search core's settings (the fitness has its own
    key; the samples are the search data's)."""
    return {k: getattr(config, k) for k in EVO_SETTINGS}


def evo_timings(teacher_seconds: float, seconds: float, evaluations: int) -> dict[str, float]:
    """search.json's times of an evo search: the teacher pass, the whole search, and one candidate
    evaluation (the search's time after the teacher pass, over the candidates it evaluated)."""
    return {
        "teacher_pass": round(teacher_seconds, 3),
        "total": round(seconds, 3),
        "per_evaluation": round((seconds - teacher_seconds) / max(1, evaluations), 4),
    }


@dataclass
class SearchDocument:
    """search.json (module docstring for the sections and their order)."""

    fitness: str
    higher_is_better: bool
    config: dict[str, Any]
    fitness_value: float
    evaluations: int
    stopped: dict[str, Any]
    found: dict[str, Any] = field(default_factory=dict)
    references: dict[str, Any] = field(default_factory=dict)
    history: dict[str, Any] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    space: str | None = None
    steps: int | None = None  # the gradient allocation's training steps
    search_samples: int | None = None
    teacher_cache: dict[str, Any] | None = None
    notes: list[str] | None = None
    timings_s: dict[str, Any] | None = None
    speed: dict[str, Any] = field(default_factory=dict)
    criterion: str | None = None  # the gradient allocation's: the criterion its logits started from

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _ORDER:
            value = getattr(self, name)
            if name in _SECTIONS:
                out.update(value)
            elif value is not None:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SearchDocument:
        """The document from search.json's object: the typed keys by name, the keys before the
        fitness as `head`, the references, history and speed-ups by name, the rest as `found`."""
        typed = {f.name for f in fields(cls)} - _SECTIONS
        keys = list(document)
        first = keys.index("fitness") if "fitness" in document else 0
        sections: dict[str, Any] = {name: {} for name in _SECTIONS}
        values: dict[str, Any] = {}
        for position, key in enumerate(keys):
            if position < first:
                sections["head"][key] = document[key]
            elif key in typed:
                values[key] = document[key]
            else:
                sections[_SECTION_OF.get(key, "found")][key] = document[key]
        missing = [f.name for f in fields(cls) if f.name in _SPINE and f.name not in values]
        if missing:
            raise MoePruneError(
                f"a search document without {', '.join(missing)}: every search writes a SearchDocument "
                "(search/document.py)"
            )
        return cls(**values, **sections)

    # -- what the readers ask -------------------------------------------------------------------
    @property
    def generations(self) -> list[dict[str, Any]] | None:
        """An evo search's per-generation history (None for the gradient allocation: `training`)."""
        return self.history.get("generations")

    @property
    def uniform_allocation(self) -> list[int] | None:
        """The uniform drop counts the result is measured against (drop counts only: a mixed
        search's uniform reference is genes)."""
        uniform = self.references.get("uniform")
        return uniform.get("allocation") if isinstance(uniform, Mapping) else None
