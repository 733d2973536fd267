"""What decides an allocation: how many routed experts each MoE layer loses (or keeps whole)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeprune.config import SEARCH_DATA, Registry
from moeprune.observe.kinds import NONE, Statistics


@dataclass(frozen=True)
class Allocator:
    """One allocation. `counts(criterion, scores, budget, limits)` gives the experts each MoE layer
    loses, for allocations that read them off the scores (uniform, global); the others are run by
    their own stage (evo searches them, trapezoid keeps whole experts for TENP)."""

    name: str
    help: str
    needs: tuple[str, ...] = ()
    counts: Callable | None = None
    # its per-layer counts follow from the budget alone, before any score: the planned size is
    # exact, and a stock checkpoint can be written without the loaded model (the no-load pipeline)
    fixed: bool = False
    plan_note: Callable | None = None  # criterion -> what the plan's `extra` records about this allocation
    # calibration statistics it reads itself (observe/kinds.py); none does today: each reads scores
    statistics: Statistics = NONE
    # the settings only this allocation reads (refused as unread without it: job/pipelines.py)
    knobs: tuple[str, ...] = ()
    # its plans narrow experts neuron by neuron (the gradient allocation's form projection): widths on
    # a multiple above 1 are refused before loading
    neuron_by_neuron: bool = False
    label: str = ""  # what a refusal calls it ("an EvoESAP search"); "" : "the <name> allocation"

    @property
    def described(self) -> str:
        """How refusals name it: its label, else 'the <name> allocation'."""
        return self.label or f"the {self.name} allocation"

    @property
    def searches(self) -> bool:
        """Whether the allocation is searched on teacher-forced search data (and so needs it)."""
        return SEARCH_DATA in self.needs


def searches(allocation: str | None) -> bool:
    """Whether the named allocation is a search (None, the method's default, never is)."""
    return allocation is not None and ALLOCATIONS.get(allocation).searches


ALLOCATIONS: Registry[Allocator] = Registry("allocation", "allocation")
