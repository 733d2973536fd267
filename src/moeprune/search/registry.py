"""The searches, keyed by what they search: a searched allocation (evo, gradient) and a method's
genes (`Method.genes`: drop counts per layer, or each expert's form). `prune` asks
`search_for(config)` and runs the entry it gets, so a method with its own genes, or a new
searched allocation, is one registration beside its search and no stage compares a name.

Each entry says how it runs (`run`: `SearchJob -> Searched`), what it refuses before any data is
read (`check`, on the loaded model) and before any weight loads (`before_loading`, on the
file-level job's meta-device model), and whether `--quantize auto:` searches the schemes jointly
with it (`joint_schemes`: the quantize stage seeds its own search with the same genes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moeprune.config import Registry
from moeprune.criteria import Criterion, LayerScores
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.search.options import SearchRuntime
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import fit_every_novice
from moeprune.surgery.registry import ResolvedConfig

# search.json's key of the uniform plan (drop counts) or uniform genes (forms) a search is compared
# with: a document key, whichever allocation ran
UNIFORM = "uniform"


@dataclass
class SearchJob:
    """Everything a search reads: the model, its scores and statistics, the search data, the
    resolved config and how the search runs; the calibration sets for what it fits before it
    starts (a forms search's rank-R novices)."""

    moe: MoEModel
    criterion: Criterion
    scores: list[LayerScores]
    stats: list[ExpertStats]
    data: CalibrationData
    config: ResolvedConfig
    runtime: SearchRuntime
    calibration: Sequence[CalibrationData] = ()
    checks: FitChecks | None = None  # rank-R fits checked on held-out tokens (surgery/fit_holdout.py)

    @property
    def args(self) -> tuple:
        """(moe, criterion, scores, stats, search data): what the search drivers take first."""
        return self.moe, self.criterion, self.scores, self.stats, self.data

    @property
    def kwargs(self) -> dict[str, Any]:
        return {"config": self.config, "runtime": self.runtime}

    def every_novice(self) -> Any:
        """Every routed expert's rank-R novice, fitted once before a forms search (None: rank 0)."""
        rank = self.config.options.novice_rank
        if not rank:
            return None
        runtime = self.runtime
        return fit_every_novice(
            self.moe,
            rank,
            list(self.calibration),
            batch_size=runtime.batch_size,
            pad_token_id=runtime.pad_token_id or 0,
            progress=runtime.progress,
            checks=self.checks,
        )


@dataclass
class Searched:
    """What a search found: per MoE layer the experts removed (counts) or one gene tuple (forms),
    its search.json document, the scores whose order the plan takes (None: the criterion's), and
    the novices it fitted (the plan's are taken from them)."""

    removed: Sequence[Any] | None  # None: the allocation decides (no search ran)
    doc: dict | None = None
    scores: list[LayerScores] | None = None
    novices: Any = None


@dataclass(frozen=True)
class Search:
    name: str
    help: str
    allocation: str  # the searched allocation it runs
    genes: str  # the methods' genes it searches (surgery/registry.py COUNTS or FORMS)
    run: Callable[[SearchJob], Searched]
    check: Callable[[MoEModel, ResolvedConfig], None] | None = None  # on the model, before data
    # (meta, config, joint) before any weight loads (the file-level job); `joint`: --quantize auto
    # searches the schemes with it, and seeds itself
    before_loading: Callable[[MoEModel, ResolvedConfig, bool], None] | None = None
    joint_schemes: bool = False  # --quantize auto: searches schemes and genes together
    needs: tuple[str, ...] = ()


SEARCHES: Registry[Search] = Registry("search", "allocation")


def searches_schemes(config: ResolvedConfig) -> bool:
    """Whether `--quantize auto:` searches the schemes together with this config's search."""
    search = search_for(config)
    return search is not None and search.joint_schemes


def search_for(config: ResolvedConfig) -> Search | None:
    """The search that runs `config`'s allocation over its method's genes (None: not searched)."""
    if not config.allocator.searches:
        return None
    for entry in SEARCHES:
        if entry.allocation == config.allocator.name and entry.genes == config.method_spec.genes:
            return entry
    raise MoePruneError(
        f"no search runs {config.described()} with the {config.allocation} allocation",
        options=("method", "allocation"),
    )
