"""From scores and a budget to a Plan, for any surgery method, and applying it; and every check a
config can get before anything runs (names, numbers, combinations, the budget's feasibility).

Each method registers (METHODS, surgery/registry.py) the function that turns a `PlanRequest`
into its plan: drop and novice allocate expert counts (uniform or global, or the searched counts
passed in), neurons and TENP allocate neurons. Nothing here runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moeprune.allocate.basic import uniform_allocation
from moeprune.allocate.fitness import check_search
from moeprune.allocate.limits import layer_limits
from moeprune.allocate.registry import Allocator
from moeprune.config import SEARCH_DATA, PruneConfig
from moeprune.criteria import AUTO, CRITERIA, Criterion, LayerScores, get_criterion
from moeprune.criteria.super_experts import GUARD_STATISTICS, as_report, protected_order, super_experts
from moeprune.errors import DataError, InfeasibleBudgetError, MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.kinds import Statistics, union
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.surgery.neurons import check_neuron_prunable
from moeprune.surgery.plans import Fits, apply_plan_physical
from moeprune.surgery.registry import (
    EXPERTS,
    METHODS,
    Method,
    PlanRequest,
    ResolvedConfig,
    check_method,
)
from moeprune.surgery.target_size import check_target_config


def build_plan(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    *,
    config: PruneConfig,
    stats: Sequence[ExpertStats] = (),
    removed: Sequence[int] | None = None,
    data_fingerprint: str = "",
) -> Plan:
    """Turn scores and a global budget into a per-layer plan, for any registered method.

    `config` says what to build: its sparsity, allocation (None: the method's default), method,
    expert_multiple (every layer keeps a multiple of this many experts: drop and novice) and the
    method's own options (`config.options`). Its criterion name, seed and
    search settings are not read here: `criterion` is the one `scores` come from, and a search
    has already run when `removed` is given.
    `removed` (experts removed per MoE layer) overrides the allocation; the search passes it.
    """
    config = check_config(config)  # names resolved (once: a resolved config comes back as it is)
    request = PlanRequest.of(
        config,
        moe,
        criterion,
        protected_order(scores, moe.protected),  # the super experts last; the caps never reach them
        stats=stats,
        removed=removed,
        data_fingerprint=data_fingerprint,
    )
    plan_of = config.method_spec.fn
    assert plan_of is not None, f"method {config.method} registered without a function"
    check_fixed_layers(moe, config.method_spec)
    return finish_plan(moe, plan_of(request), config.allocator, criterion)


def finish_plan(moe: MoEModel, plan: Plan, allocator: Allocator, criterion: Criterion) -> Plan:
    """What every plan records besides its method's own: the allocation's note (the global
    allocation's normalisation; once, here, for every method) and the layers kept whole. A search
    that builds its plan itself (a mixed search's genes) passes it through here too."""
    if allocator.plan_note is not None:
        plan.extra.update(allocator.plan_note(criterion))
    return record_kept_whole(moe, plan)


def check_fixed_layers(moe: MoEModel, method: Method) -> None:
    """Refuse a method that cannot keep the fixed layers whole. Expert methods take their counts
    from `layer_limits`, where a fixed layer's cap is 0; the neuron methods (neurons, TENP) narrow
    every layer's experts and have no such limit yet, so they are refused in one line."""
    note = moe.kept_whole_note()
    if note and method.sparsity_unit != EXPERTS:
        raise MoePruneError(
            f"the {method.name} method narrows the experts of every MoE layer and cannot keep a layer whole "
            f"({note}); use the drop or novice method",
            options=("method",),
        )


def record_kept_whole(moe: MoEModel, plan: Plan) -> Plan:
    """Check that no fixed layer loses anything and record them in the plan (`extra.kept_whole`:
    layer -> reason), so plan.json, the summary and the report say which layers stayed whole and why.
    Novices would be exact even in a hash layer (routing is unchanged), but every method keeps
    fixed layers whole: one rule, and a hash layer's tokens keep their trained experts."""
    kept = moe.kept_whole()
    for index in kept:
        layer_plan = plan.layer(index)
        if layer_plan.dropped or layer_plan.novice or layer_plan.neurons:
            raise MoePruneError(
                f"the {plan.method} plan changes decoder layer {index}, which must stay whole: {kept[index]}"
            )
    if kept:
        plan.extra["kept_whole"] = {str(i): reason for i, reason in kept.items()}
    return plan


def plan_positions(moe: MoEModel, plan: Plan) -> dict[int, list[int]]:
    """The plan's dropped original ids as positions in the model's current storage."""
    out = {}
    for layer_plan in plan.layers:
        layer = moe.layer(layer_plan.layer)
        where = {orig: pos for pos, orig in enumerate(layer.expert_ids)}
        missing = [e for e in layer_plan.dropped if e not in where]
        if missing:
            raise MoePruneError(
                f"layer {layer_plan.layer}: plan drops experts {missing} this model no longer has"
            )
        out[layer_plan.layer] = [where[e] for e in layer_plan.dropped]
    return out


def apply_plan(
    moe: MoEModel, plan: Plan, stats: Sequence[ExpertStats] = (), fits: Fits | None = None
) -> dict:
    """Physical surgery of any plan (drops, novices, neuron counts); returns what was done.
    `fits`: a low-rank novice plan's fitted novices (surgery/lowrank.py `fit_novices`)."""
    return apply_plan_physical(
        moe, plan, list(stats) if len(stats) > 1 else (stats[0] if stats else None), fits
    )


@dataclass(frozen=True)
class Requirements:
    """What a prune needs besides the model, read once from its criterion, allocation and method
    (their registries' `needs`): the in-memory API, the checkpoint job and the command line ask
    this one answer instead of each re-deriving it."""

    calibration: str | None  # why calibration data is read ("criterion 'reap'", ...); None: it is not
    search: str | None  # why search data is needed ("an EvoESAP search", ...); None: it is not
    neuron_stats: bool  # the calibration pass also records each neuron's share of the expert output
    per_domain: bool  # calibration files are kept apart (TENP's per-domain normalisation)
    other_knobs: dict[str, tuple[str, ...]]  # "neurons or tenp" -> the settings only those methods read
    repair: bool = False  # --repair: trains on the calibration data, stops early on search data when given

    def reads_search(self, given: bool) -> bool:
        """Whether the search data is read: when something needs it, and by repair when it is given
        (its held-out tokens; without them repair holds back a share of the calibration data)."""
        return bool(self.search) or (self.repair and given)

    # what the calibration pass records (observe/kinds.py): the union of what the criterion (every
    # criterion for auto), the method, the allocation and the super-expert guard declare
    statistics: Statistics = frozenset()

    def reads_calibration(self, given: bool) -> bool:
        """Whether the calibration data is read: when something needs it, and whenever it is given,
        to find the super experts (a criterion that needs no data, random or a weight-only one,
        then still keeps them; with allow_super_experts the report still names them)."""
        return bool(self.calibration) or given

    def check(self, *, calibration: bool = True, search: bool = True) -> None:
        """One line naming the missing input, before anything is loaded."""
        if self.calibration and not calibration:
            raise DataError(f"{self.calibration} needs calibration data: give data files", options=("data",))
        if self.search and not search:
            raise MoePruneError(
                f"{self.search} needs search data (prompt/answer files)", options=("search_data",)
            )


def requirements(config: PruneConfig) -> Requirements:
    """What `config` needs: calibration data for a data criterion, for `--criterion auto` (one
    observation feeds every criterion) or for a method that needs statistics; search data for a
    searched allocation or `auto`."""
    config = check_config(config)
    method = config.method_spec
    auto = config.criterion == AUTO
    criterion = get_criterion("reap" if auto else config.criterion)
    if method.needs:
        calibration: str | None = f"the {method.name} method"
    elif auto:
        calibration = "criterion auto"
    else:
        calibration = f"criterion {criterion.name!r}" if criterion.needs_data else None
    if calibration is None and config.repair.enabled:
        calibration = "--repair (it distils on the calibration tokens)"
    if config.allocator.searches:
        search: str | None = config.allocator.described
    elif SEARCH_DATA in method.needs:  # auto: it scores its candidates on the search data
        search = f"the {method.name} method"
    else:
        search = "choosing the criterion automatically" if auto else None
    readers: dict[str, list[str]] = {}  # each setting this method does not read -> the methods that do
    for m in METHODS:
        for knob in m.knobs:
            if knob not in method.knobs:
                readers.setdefault(knob, []).append(m.name)
    others: dict[str, tuple[str, ...]] = {}
    for knob, names in readers.items():
        key = " or ".join(names)
        others[key] = (*others.get(key, ()), knob)
    scored = list(CRITERIA) if auto else [criterion]  # auto scores every criterion from one pass
    statistics = union(
        *(c.statistics for c in scored),
        method.observes,
        config.allocator.statistics,
        GUARD_STATISTICS,
    )
    return Requirements(
        calibration, search, method.neurons, criterion.per_domain, others, config.repair.enabled, statistics
    )


def check_config(config: PruneConfig) -> ResolvedConfig:
    """Every name and number of a config checked, once, before anything runs: returns the
    `ResolvedConfig` (the allocation set to the method's default when left unset, the method's
    options an object that validated itself, the method's and allocation's entries), which later
    stages take as it is. A config with a `target_size` has no sparsity yet: the checkpoint's sizes
    solve it (`solve_target`)."""
    if isinstance(config, ResolvedConfig):
        return config
    if config.criterion != AUTO:
        get_criterion(config.criterion)
    if check_target_config(config) is None:  # a target size solves the sparsity later (target_size.py)
        check_sparsity(config.sparsity)
    _, allocator = check_method(config.method, config.allocation)
    if (
        isinstance(config.expert_multiple, bool)
        or not isinstance(config.expert_multiple, int)
        or config.expert_multiple < 1
    ):
        raise MoePruneError(
            f"expert_multiple must be a positive integer, got {config.expert_multiple!r}",
            options=("expert_multiple",),
        )
    if config.ep_size is not None and (
        isinstance(config.ep_size, bool) or not isinstance(config.ep_size, int) or config.ep_size < 1
    ):
        raise MoePruneError(
            f"ep_size must be a positive integer, got {config.ep_size!r}", options=("ep_size",)
        )
    if not isinstance(config.allow_super_experts, bool):
        raise MoePruneError(
            f"allow_super_experts must be true or false, got {config.allow_super_experts!r}",
            options=("allow_super_experts",),
        )
    if allocator.searches or config.criterion == AUTO:
        check_search(config.search)
    if config.repair.enabled:  # a RepairConfig checks itself when made; one changed since, here
        config.repair.validate()
    return ResolvedConfig.of(config)


def check_sparsity(sparsity: float | None) -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) or not 0 < sparsity < 1:
        raise MoePruneError(
            f"sparsity must be a number strictly between 0 and 1, got {sparsity!r}", options=("sparsity",)
        )


def check_feasible(moe: MoEModel, config: PruneConfig) -> dict:
    """Refuse a budget no plan can meet, from the model's structure alone (a meta-device model
    does); returns what is already known per layer (for a dry run). A method with a `feasible`
    hook answers for itself; the expert methods share the budget's per-layer limits here."""
    config = check_config(config)
    method = config.method_spec
    check_fixed_layers(moe, method)
    config.options.check_model(moe)  # a method's own settings against the model (the novice rank <= d)
    if method.feasible is not None:
        layer_limits(moe, config.expert_multiple)  # every expert stays: each count must still be a multiple
        if method.neurons:
            check_neuron_prunable(moe)
        return dict(method.feasible(moe, config))
    limits = config.limits(moe)
    budget = limits.budget(config.sparsity_value())
    uniform = uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
    known: dict = {"budget_experts_removed": budget}
    if config.allocator.fixed:
        known["removed_per_layer"] = dict(zip([m.index for m in moe.layers], uniform))
    return known


def guard_super_experts(
    moe: MoEModel, config: PruneConfig, stats: Sequence[ExpertStats]
) -> dict[int, list[int]] | None:
    """Find the super experts in the calibration statistics and, unless the config allows removing
    them, protect them (`moe.protected`: every later plan, allocation and search keeps them).

    Returns them (None: no statistics, so not checked). Right after observation, a budget the
    other experts cannot meet is refused in one line, before any search or surgery runs.
    """
    if not stats:
        moe.protected = {}
        return None
    found = super_experts(list(stats))
    moe.protected = {} if config.allow_super_experts else found
    if moe.protected:
        check_guarded_budget(moe, config)
    return found


def check_guarded_budget(moe: MoEModel, config: PruneConfig) -> None:
    """Refuse a budget that only removing a protected (super) expert could meet."""
    config = check_config(config)
    if config.method_spec.feasible is not None:  # neuron methods: every expert stays, nothing to refuse
        return
    limits = config.limits(moe)
    budget = limits.budget(config.sparsity_value())
    try:
        uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
    except InfeasibleBudgetError as exc:
        raise InfeasibleBudgetError(
            f"sparsity {config.sparsity} removes {budget} experts, which cannot be met without removing "
            f"a super expert {as_report(moe.protected)} (per-layer limits keeping them: {limits.caps}); "
            "lower the sparsity, or allow removing super experts (at the risk of collapsing the model)",
            options=("sparsity", "allow_super_experts"),
        ) from exc
