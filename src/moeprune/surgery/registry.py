"""What a surgery method is, and what its plan builder is given.

A method says what happens to the chosen experts, what its sparsity is a fraction of, which
allocations can decide for it (the first is its default) and what it needs; its `fn` turns a
`PlanRequest` into a Plan (surgery/planning.py dispatches to it). `ResolvedConfig` is a config
checked once (surgery/planning.py `check_config`) holding the entries its names resolve to, so no
later stage looks a name up again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from moeprune.allocate.limits import LayerLimits, expert_allocation, layer_limits
from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.config import MethodOptions, PruneConfig, Registry
from moeprune.criteria import Criterion, LayerScores
from moeprune.criteria.super_experts import KEPT
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.observe.kinds import NONE, Statistic, Statistics
from moeprune.observe.stats import ExpertStats

EXPERTS, PARAMETERS = "experts", "routed-expert parameters"  # what a method's sparsity is a fraction of
# What a search of a method chooses per MoE layer (`Method.genes`): how many experts it loses
# (drop counts), or which form each expert takes (whole, narrowed, novice, dropped: mixed genes)
COUNTS, FORMS = "counts", "forms"
Opts = TypeVar("Opts", bound=MethodOptions)


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
    # its own settings: a MethodOptions dataclass of `setting` fields that validates itself
    # (PruneConfig.options holds one); the command line makes a flag of each field
    options: type[MethodOptions] = MethodOptions
    genes: str = COUNTS  # what its searches choose per layer: COUNTS or FORMS (search registry key)
    # what its plans do with the guarded super experts: the end of the report's sentence
    # "super experts (layer 1: 3) ..." (criteria/super_experts.py guard_note)
    super_experts: str = KEPT
    # (meta, config) -> what each MoE layer keeps under the config's uniform plan (LayerKeep per
    # layer), from the structure and options alone: the one source its planned bytes, quantized
    # bytes and precision tables are priced from (surgery/sizes.py `kept_bytes`); None: whole
    # experts removed with their router rows (priced by the removal counts' keeps)
    planned_keeps: Callable | None = None
    candidate_context: Callable | None = None  # (moe, stats) -> how a search applies a candidate
    # in this method's virtual form (novices: constant outputs); None: the plain expert mask
    # Size planning, before any weight loads; None: the expert methods' own (surgery/target_size.py)
    feasible: Callable | None = None  # (moe, config) -> what is known per layer; refuses what cannot be met
    target_steps: Callable | None = (
        None  # (moe, config, WeightBytes, target) -> [(sparsity, bytes)] ascending
    )
    fn: Callable | None = None  # PlanRequest -> Plan
    # calibration statistics its plan, surgery or search context reads beyond the per-token sums
    # (observe/kinds.py); `neurons` adds the per-neuron sums (`observes`)
    statistics: Statistics = NONE
    # (config) -> the recipes (surgery/auto.py `Recipe`: label, PruneConfig) this method chooses
    # among on the search data (auto); None: it builds its own plan (`fn`)
    portfolio: Callable | None = None

    @property
    def observes(self) -> Statistics:
        """Every kind of statistic this method reads from the observation pass."""
        return self.statistics | ({Statistic.NEURONS} if self.neurons else NONE)

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of its own settings (typed for another method: refused as unread)."""
        return tuple(f.name for f in fields(self.options))

    def resolve_options(self, value: Any) -> Any:
        """Its options object from a config's `options`: None (the defaults), a dict of fields (JSON),
        or an instance; anything else, or a field it does not have, is one line naming the method."""
        if value is None or value == {}:
            return self.options()
        if isinstance(value, self.options):
            return value
        if not isinstance(value, dict):
            raise MoePruneError(
                f"the {self.name} method's options are {self.options.__name__}, got {type(value).__name__}",
                options=("options",),
            )
        unknown = sorted(set(value) - set(self.knobs))
        if unknown:
            raise MoePruneError(
                f"the {self.name} method has no option {', '.join(unknown)}"
                + (f"; its options: {', '.join(self.knobs)}" if self.knobs else "; it takes none"),
                options=("method", *unknown),
            )
        return self.options(**value)

    def configured(self, options: Any = None) -> Method:
        """This method as `options` make it: options whose `keeps_routing` is true (drop's
        `--reroute none`) turn it into one that keeps routing, like novices (no group balance, its
        result in moeprune's format). Everything that asks `keeps_routing` or `whole_experts` of a
        configured run asks this one."""
        if self.keeps_routing or not self.resolve_options(options).keeps_routing:
            return self
        return replace(self, keeps_routing=True)

    def described(self, options: Any = None) -> str:
        """'the drop method', with what its options change said (' (--reroute none)'), for refusals."""
        return f"the {self.name} method{self.resolve_options(options).label}"

    def search_context(self, moe: MoEModel, stats: Any, options: Any = None) -> Callable | None:
        """How a search applies a candidate of this method, as `options` make it: the options' own
        `candidate_context(moe)` (drop's `--reroute none`: zero novices) when they have one, else the
        method's; None: the plain expert mask."""
        context = self.resolve_options(options).candidate_context(moe)
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


def check_method(method: str, allocation: str | None) -> tuple[Method, Allocator]:
    """The entries of a method and an allocation (None: the method's default), refusing a
    combination that has no meaning before any work is done."""
    spec = METHODS.get(method)
    allocator = ALLOCATIONS.get(spec.allocations[0] if allocation is None else allocation)
    if allocation is not None and spec.portfolio is not None:  # auto: each recipe has its own
        raise MoePruneError(
            f"the {method} method chooses each recipe's allocation; leave out the allocation",
            options=("method", "allocation"),
        )
    if allocator.name not in spec.allocations:
        raise MoePruneError(
            f"the {method} method goes with the {' or '.join(spec.allocations)} allocation, not {allocation}",
            options=("method", "allocation"),
        )
    return spec, allocator


def method_limits(moe: MoEModel, method: str, expert_multiple: int = 1, options: Any = None) -> LayerLimits:
    """Drops change routing (group balance applies); novices and `--reroute none` drops stay
    routed (it does not). A resolved config asks `config.limits(moe)`."""
    keeps = METHODS.get(method).configured(options).keeps_routing
    return layer_limits(moe, expert_multiple, routing_changes=not keeps)


def options_as(config: PruneConfig, kind: type[Opts]) -> Opts:
    """The config's options as a `kind` (a method's options class): the resolved object, or the
    fields a script or recipe gave (a dict, or None for the defaults) validated by the class."""
    options = config.options
    return options if isinstance(options, kind) else kind(**(options or {}))


@dataclass
class ResolvedConfig(PruneConfig):
    """A PruneConfig checked once (surgery/planning.py `check_config`, which alone makes one): the
    allocation set (the method's default when left unset), the method's options an object that
    validated itself, and the registry entries its names stand for. Every stage after the check
    takes it and asks the entries (`method_spec`, `allocator`) their hooks and flags; the names
    stay labels (plan.json, report.json, recipe.json). `dataclasses.replace` keeps the entries,
    so a copy that changes the method or allocation is resolved again from `given()`."""

    allocation: str = ""  # never None here
    options: MethodOptions = field(default_factory=MethodOptions)
    method_spec: Method = field(kw_only=True, repr=False, compare=False)
    allocator: Allocator = field(kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.method_spec.name, self.allocator.name) != (self.method, self.allocation) or not isinstance(
            self.options, self.method_spec.options
        ):
            raise TypeError(  # a programming error: a changed copy must be checked again
                f"a ResolvedConfig of {self.method}/{self.allocation} holds the entries of "
                f"{self.method_spec.name}/{self.allocator.name}: check_config(replace(config.given(), ...))"
            )

    @classmethod
    def of(cls, config: PruneConfig) -> ResolvedConfig:
        """The names of `config` resolved (surgery/planning.py `check_config` checks its numbers
        first): the allocation set, the options an object that validated itself, the entries held."""
        if isinstance(config, ResolvedConfig):
            return config
        method, allocator = check_method(config.method, config.allocation)
        given = {f.name: getattr(config, f.name) for f in fields(PruneConfig)}
        given |= {"allocation": allocator.name, "options": method.resolve_options(config.options)}
        return cls(**given, method_spec=method, allocator=allocator)

    def given(self) -> PruneConfig:
        """The plain config (what check_config is given again after a change of method)."""
        return PruneConfig(**{f.name: getattr(self, f.name) for f in fields(PruneConfig)})

    @property
    def surgery(self) -> Method:
        """The method as its options make it (drop `--reroute none`: keeps routing, like novices)."""
        return self.method_spec.configured(self.options)

    def limits(self, moe: MoEModel) -> LayerLimits:
        """The per-layer limits of this config's plans: group balance where routing changes."""
        return layer_limits(moe, self.expert_multiple, routing_changes=not self.surgery.keeps_routing)

    def described(self) -> str:
        """'the drop method (--reroute none)': the method as its options make it, for refusals."""
        return self.method_spec.described(self.options)

    @property
    def stock(self) -> bool:
        """Whether a stock config expresses the plan (the same expert count, or width, in every
        layer): a fixed allocation of whole experts or of one width."""
        method = self.surgery  # drop --reroute none keeps routing: moeprune's format
        return self.allocator.fixed and (method.whole_experts or method.one_width)


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
    options: Any = None  # the method's options (Method.options; a dict or None is resolved here)
    method_spec: Method = field(init=False, repr=False)  # the entries of the names, resolved here
    allocator: Allocator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.method_spec = METHODS.get(self.method)  # once, where the request is made
        self.allocator = ALLOCATIONS.get(self.allocation)
        self.options = self.method_spec.resolve_options(self.options)

    @classmethod
    def of(
        cls,
        config: ResolvedConfig,
        moe: MoEModel,
        criterion: Criterion,
        scores: Sequence[LayerScores],
        **kw: Any,
    ) -> PlanRequest:
        """The request of a resolved config (its sparsity, allocation, method, expert multiple, options)."""
        return cls(
            moe,
            criterion,
            scores,
            config.sparsity_value(),
            config.allocation,
            config.method,
            expert_multiple=config.expert_multiple,
            options=config.options,
            **kw,
        )

    @property
    def domains(self) -> ExpertStats | list[ExpertStats] | None:
        """The statistics as plan builders take them: one set, several domains, or none."""
        return list(self.stats) if len(self.stats) > 1 else (self.stats[0] if self.stats else None)

    def removals(self) -> list[int]:
        """Experts each MoE layer loses: the searched counts, else the allocation's."""
        if self.removed is not None:
            return list(self.removed)
        keeps = self.method_spec.configured(self.options).keeps_routing
        limits = layer_limits(self.moe, self.expert_multiple, routing_changes=not keeps)
        return expert_allocation(self.moe, self.criterion, self.scores, self.sparsity, self.allocator, limits)
