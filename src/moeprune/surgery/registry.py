"""What a surgery method is, and what its plan builder is given.

A method says what happens to the chosen experts, what its sparsity is a fraction of, which
allocations can decide for it (the first is its default) and what it needs; its `fn` turns a
`PlanRequest` into a Plan (surgery/planning.py dispatches to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from moeprune.allocate.limits import LayerLimits, expert_allocation, layer_limits
from moeprune.allocate.registry import ALLOCATIONS
from moeprune.config import Registry
from moeprune.criteria import Criterion, LayerScores
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.observe.kinds import NONE, Statistic, Statistics
from moeprune.observe.stats import ExpertStats

EXPERTS, PARAMETERS = "experts", "routed-expert parameters"  # what a method's sparsity is a fraction of


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    sparsity_unit: str  # EXPERTS or PARAMETERS
    allocations: tuple[str, ...]  # the allocations that can decide for it; the first is its default
    needs: tuple[str, ...] = ()
    neurons: bool = False  # observation must record each neuron's share of the expert output
    one_width: bool = (
        False  # every expert narrowed to one width: a rewrite of the shards (no-load) can write it
    )
    keeps_routing: bool = False  # the router still sees every expert (novices): no group balance needed
    merges: bool = False  # kept experts' weights change (merge): not a rewrite of the input's bytes
    # its own settings: a dataclass of `setting` fields that validates itself (PruneConfig.options
    # holds one); the command line makes a flag of each field
    options: type | None = None
    candidate_context: Callable | None = None  # (moe, stats) -> how a search applies a candidate
    # in this method's virtual form (novices: constant outputs); None: the plain expert mask
    # Size planning, before any weight loads; None: the expert methods' own (surgery/target_size.py)
    feasible: Callable | None = None  # (moe, config) -> what is known per layer; refuses what cannot be met
    planned_bytes: Callable | None = None  # (moe, config, WeightBytes) -> bytes the plan leaves
    target_steps: Callable | None = (
        None  # (moe, config, WeightBytes, target) -> [(sparsity, bytes)] ascending
    )
    fn: Callable | None = None  # PlanRequest -> Plan
    # calibration statistics its plan, surgery or search context reads beyond the per-token sums
    # (observe/kinds.py); `neurons` adds the per-neuron sums (`observes`)
    statistics: Statistics = NONE

    @property
    def observes(self) -> Statistics:
        """Every kind of statistic this method reads from the observation pass."""
        return self.statistics | ({Statistic.NEURONS} if self.neurons else NONE)

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of its own settings (typed for another method: refused as unread)."""
        return tuple(f.name for f in fields(self.options)) if self.options is not None else ()

    def resolve_options(self, value: Any) -> Any:
        """Its options object from a config's `options`: None (the defaults), a dict of fields (JSON),
        or an instance; anything else, or a field it does not have, is one line naming the method."""
        if value is None or value == {}:
            return self.options() if self.options is not None else None
        if self.options is not None and isinstance(value, self.options):
            return value
        if not isinstance(value, dict):
            raise MoePruneError(
                f"the {self.name} method's options are {self.options.__name__ if self.options else 'none'}, "
                f"got {type(value).__name__}",
                options=("options",),
            )
        unknown = sorted(set(value) - set(self.knobs))
        if unknown:
            raise MoePruneError(
                f"the {self.name} method has no option {', '.join(unknown)}"
                + (f"; its options: {', '.join(self.knobs)}" if self.knobs else "; it takes none"),
                options=("method", *unknown),
            )
        assert self.options is not None  # a non-empty dict passed the check above only with fields
        return self.options(**value)

    def configured(self, options: Any = None) -> Method:
        """This method as `options` make it: options whose `keeps_routing` is true (drop's
        `--reroute none`) turn it into one that keeps routing, like novices (no group balance, its
        result in moeprune's format). Everything that asks `keeps_routing` or `whole_experts` of a
        configured run asks this one."""
        if self.keeps_routing or not getattr(self.resolve_options(options), "keeps_routing", False):
            return self
        return replace(self, keeps_routing=True)

    def described(self, options: Any = None) -> str:
        """'the drop method', with what its options change said (' (--reroute none)'), for refusals."""
        return f"the {self.name} method{getattr(self.resolve_options(options), 'label', '')}"

    def search_context(self, moe: MoEModel, stats: Any, options: Any = None) -> Callable | None:
        """How a search applies a candidate of this method, as `options` make it: the options' own
        `candidate_context(moe)` (drop's `--reroute none`: zero novices) when they have one, else the
        method's; None: the plain expert mask."""
        own = getattr(self.resolve_options(options), "candidate_context", None)
        context = own(moe) if own is not None else None
        if context is None and self.candidate_context is not None:
            context = self.candidate_context(moe, stats)
        return context

    @property
    def whole_experts(self) -> bool:
        """Its result holds whole experts only, some removed with their router rows: what a rewrite
        of the input's bytes expresses (a kept quantization, the no-load pipeline's drop). A merge
        removes whole experts too but rewrites the kept ones' weights: it is not one."""
        return self.sparsity_unit == EXPERTS and not (self.keeps_routing or self.neurons or self.merges)


METHODS: Registry[Method] = Registry("method", "method")


def default_allocation(method: str) -> str:
    return METHODS.get(method).allocations[0]


def expert_methods() -> tuple[str, ...]:
    """Methods whose sparsity is a fraction of experts (they remove whole experts)."""
    return tuple(m.name for m in METHODS if m.sparsity_unit == EXPERTS)


def check_method(method: str, allocation: str) -> None:
    """Reject combinations that have no meaning, before any work is done."""
    spec = METHODS.get(method)
    ALLOCATIONS.get(allocation)
    if allocation not in spec.allocations:
        raise MoePruneError(
            f"the {method} method goes with the {' or '.join(spec.allocations)} allocation, not {allocation}",
            options=("method", "allocation"),
        )


def method_limits(moe: MoEModel, method: str, expert_multiple: int = 1, options: Any = None) -> LayerLimits:
    """Drops change routing (group balance applies); novices and `--reroute none` drops stay
    routed (it does not)."""
    keeps = METHODS.get(method).configured(options).keeps_routing
    return layer_limits(moe, expert_multiple, routing_changes=not keeps)


@dataclass
class PlanRequest:
    """Everything a method's plan builder may read."""

    moe: MoEModel
    criterion: Criterion
    scores: Sequence[LayerScores]
    sparsity: float
    allocation: str
    method: str
    stats: Sequence[ExpertStats] = ()
    removed: Sequence[int] | None = None  # experts removed per MoE layer, from a search
    data_fingerprint: str = ""
    expert_multiple: int = 1
    options: Any = None  # the method's resolved options object (Method.options), or None

    @property
    def domains(self) -> ExpertStats | list[ExpertStats] | None:
        """The statistics as plan builders take them: one set, several domains, or none."""
        return list(self.stats) if len(self.stats) > 1 else (self.stats[0] if self.stats else None)

    def removals(self) -> list[int]:
        """Experts each MoE layer loses: the searched counts, else the allocation's."""
        if self.removed is not None:
            return list(self.removed)
        limits = method_limits(self.moe, self.method, self.expert_multiple, self.options)
        return expert_allocation(
            self.moe, self.criterion, self.scores, self.sparsity, self.allocation, limits
        )
