"""The mixed method: in each MoE layer some experts stay whole, some are narrowed to their top
neurons (ENP's ranking), some become novices (their mean output, or with `--novice-rank R` the
low-rank map mu + B (h - hbar) of surgery/lowrank.py; routing unchanged) and the rest are dropped, under one routed-parameter budget met exactly.

Why one method instead of four: which surgery is best changes with the budget and the layer (the
demo's table), and a search can only trade one form for another when they live in one plan.

The gene. Each MoE layer's plan is a `LayerGene` (whole, narrowed, novice, dropped counts and the
neurons W each narrowed expert keeps): what `--allocation evo` mutates (search/mixed_space.py). The
criterion's order decides who gets which form: the dropped experts are the first of the pruning
order (group-balanced where routing is group-limited, as drop does), and of the others the most
important are whole, the next narrowed, the next novices. Super experts rank first, and every
gene keeps at least that many whole, so they stay whole.

The budget. The plan keeps (1 - sparsity) x T routed-expert parameters, T the model's: whole
experts hold P = per_neuron x I + per_expert, a narrowed one per_neuron x W + per_expert, a novice
its d-vector (rank R: d + 2dR, `novice_params`), a dropped one nothing. Whole experts and novices come in whole units, so what the
genes miss (at most half an expert per layer) is handed to the narrowed experts one neuron each
(`fill_widths`): the kept parameters then differ from the budget by at most half a neuron row,
the finest step any plan has. A gene set without narrowed experts (drop, novices) must meet it by
its counts alone, or is refused in one line.

Width multiples (`--width-multiple N`, surgery/widths.py; default: the group size with
`--quantize`, else 32 where the expert width is a multiple of 32 and at least 256, else 1): every
narrowed width is a multiple of its layer's step s_l (the full width is always allowed). The gene's
width is on the step, and the fill hands out whole blocks of s_l neurons instead of single ones, a
block given (or taken back) only while at least half of it is still owed: "met" is then TENP's
sense (allocate/trapezoid.py), the kept parameters within half a block, max(s_l) / 2 neuron rows,
of the budget (one neuron row's half at step 1, as before). Under the default step, a budget whose
uniform genes leave less than one block falls back to step 1, as TENP does (`mixed_steps`); an
explicit multiple is never relaxed.

Points of this space (docs/surgery.md): uniform drop is `--mixed-whole 0 --mixed-width 1` (every
kept expert at full width), uniform novices add `--mixed-novice S` at the parameter sparsity
S (1 - n / P, n a novice's parameters; `--novice-rank R` for low-rank ones), ENP is `--mixed-whole 0` (everything narrowed), and TENP is the per-layer genes whose
whole counts follow its trapezoid with everything else narrowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from moeprune.allocate.basic import plan_removals, uniform_allocation
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.allocate.registry import searches
from moeprune.config import NEURON_STATS, PruneConfig, setting
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.models.packed import layer_cost
from moeprune.observe.kinds import Statistic
from moeprune.plan import LayerPlan, Plan
from moeprune.surgery.genes import LayerCosts, LayerGene, LayerKeep, check_genes
from moeprune.surgery.lowrank import RANK_KEY, NoviceOptions
from moeprune.surgery.neurons import (
    NarrowOptions,
    check_importance,
    check_neuron_prunable,
    check_neuron_stats,
)
from moeprune.surgery.novice import require_stats
from moeprune.surgery.parameters import novice_params
from moeprune.surgery.registry import (
    FORMS,
    METHODS,
    PARAMETERS,
    Method,
    PlanRequest,
    ResolvedConfig,
    options_as,
)
from moeprune.surgery.sizes import WeightBytes, grid_steps
from moeprune.surgery.target_size import planned_bytes
from moeprune.surgery.widths import check_gradient_steps, hand_out_blocks, nearest_multiple, width_step

GENES_KEY = "mixed_genes"  # plan.extra: the genes the plan was made from (a search's seed)


def _share(value: object, name: str, low_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and 0 <= value <= 1
    if not ok or (low_open and value == 0):
        bound = "(0, 1]" if low_open else "[0, 1]"
        raise MoePruneError(f"{name} must be a number in {bound}, got {value!r}", options=(name,))


@dataclass(frozen=True)
class MixedOptions(NarrowOptions, NoviceOptions):
    """The uniform gene: the same shares in every MoE layer (module docstring). The neuron ranking
    and width multiple are the neuron methods' and the novices' rank the novice method's: the same
    settings (one `--width-multiple`, one `--novice-rank` flag), validated by their own classes."""

    mixed_whole: float | None = setting(
        None,
        "mixed: share of each layer's experts kept whole (the most important; super experts always are) "
        "[default: half the kept budget, as TENP].",
        minimum=0,
        maximum=1,
    )
    mixed_novice: float = setting(
        0.0,
        "mixed: share of each layer's experts replaced by novices (their mean output; ranked after the "
        "narrowed ones).",
        minimum=0,
        maximum=1,
    )
    mixed_width: float | None = setting(
        None,
        "mixed: share of neurons a narrowed expert keeps; the budget then decides how many are narrowed "
        "and the rest are dropped (1: kept experts whole, i.e. drop) [default: solved, nothing dropped].",
        minimum=0,
        maximum=1,
    )

    def __post_init__(self) -> None:
        NarrowOptions.__post_init__(self)
        NoviceOptions.__post_init__(self)
        if self.mixed_whole is not None:
            _share(self.mixed_whole, "mixed_whole")
        _share(self.mixed_novice, "mixed_novice")
        if self.mixed_width is not None:
            _share(self.mixed_width, "mixed_width", low_open=True)
        if (self.mixed_whole or 0) + self.mixed_novice > 1:
            raise MoePruneError(
                f"--mixed-whole {self.mixed_whole} and --mixed-novice {self.mixed_novice} add up to more "
                "than every expert; give shares whose sum is at most 1",
                options=("mixed_whole", "mixed_novice"),
            )


def layer_costs(
    moe: MoEModel, limits: LayerLimits | None = None, rank: int = 0, *, steps: Sequence[int] | None = None
) -> list[LayerCosts]:
    """The parameter costs of `moe`'s MoE layers (a meta-device model does), its novices of rank
    `rank` (d + 2dR parameters each), narrowed widths on `steps` (None: any width, step 1)."""
    limits = limits or layer_limits(moe)
    steps = steps or [1] * len(moe.layers)
    out = []
    for pos, m in enumerate(moe.layers):
        cost = layer_cost(m)
        out.append(
            LayerCosts(
                m.num_experts,
                m.intermediate_size,
                cost.per_neuron,
                cost.per_expert,
                novice_params(m.hidden_size, rank),
                m.top_k,
                len(moe.protected.get(m.index, ())),
                limits.caps[pos],
                limits.multiples[pos],
                steps[pos],
            )
        )
    return out


def mixed_steps(costs: Sequence[LayerCosts], sparsity: float, options: MixedOptions) -> list[int]:
    """Each MoE layer's width step: `--width-multiple` when given (never relaxed), else the serving
    alignment where the expert width allows it (surgery/widths.py `width_step`), falling back to
    step 1 where the options' uniform genes leave less than one block under it (module docstring).
    The uniform plan, the search space and the byte planning all take their steps from here."""
    asked = options.width_multiple
    steps = [width_step(c.width, asked) for c in costs]
    if asked is not None or all(s == 1 for s in steps):
        return steps

    def fits(trial: list[int]) -> bool:
        stepped = [replace(c, step=s) for c, s in zip(costs, trial)]
        try:
            fill_widths(stepped, uniform_genes(stepped, sparsity, options), _target(stepped, sparsity))
        except MoePruneError:
            return False
        return True

    ones = [1] * len(costs)
    return ones if not fits(steps) and fits(ones) else steps


def stepped_costs(
    moe: MoEModel, limits: LayerLimits, sparsity: float, options: MixedOptions
) -> list[LayerCosts]:
    """`layer_costs` with the width steps of `mixed_steps`: what every mixed plan is made on."""
    costs = layer_costs(moe, limits, options.novice_rank)
    return [replace(c, step=s) for c, s in zip(costs, mixed_steps(costs, sparsity, options))]


def uniform_genes(costs: Sequence[LayerCosts], sparsity: float, options: MixedOptions) -> list[LayerGene]:
    """Every layer keeps (1 - sparsity) of its own parameters with the options' shares; refuses in
    one line what the shares cannot reach (from the structure alone)."""
    keep = 1 - sparsity
    whole_share = keep / 2 if options.mixed_whole is None else options.mixed_whole
    genes = []
    for pos, c in enumerate(costs):
        whole, novice = (
            max(round(whole_share * c.experts), c.protected),
            round(options.mixed_novice * c.experts),
        )
        rest = c.experts - whole - novice
        left = keep * c.experts * c.expert() - whole * c.expert() - novice * c.novice
        if rest < 0 or left < -c.per_neuron / 2:
            raise MoePruneError(
                f"MoE layer {pos}: {whole} whole experts and {novice} novices keep more than {keep:.4g} of its "
                "parameters (1 - sparsity); lower --mixed-whole or --mixed-novice, or the sparsity",
                options=("mixed_whole", "mixed_novice", "sparsity"),
            )
        if options.mixed_width is None:  # nothing dropped: the narrowed experts share what is left
            width = math.floor((left - rest * c.per_expert) / (rest * c.per_neuron)) if rest else c.width
            if width < c.width:  # on the step: the fill hands the rest out in blocks
                width -= width % c.step
            if rest and not 1 <= width <= c.width:
                block = "" if c.step == 1 else f" (less than one block of {c.step})"
                raise MoePruneError(
                    f"MoE layer {pos}: its {rest} narrowed experts would keep {width} of {c.width} neurons{block}; "
                    + ("raise" if width < 1 else "lower")
                    + " --mixed-whole or --mixed-novice, give a --mixed-width, or change the sparsity"
                    + ("" if c.step == 1 else " or the width multiple"),
                    options=("mixed_whole", "mixed_novice", "mixed_width", "sparsity")
                    + (("width_multiple",) if c.step > 1 else ()),
                )
            genes.append(LayerGene(whole, rest, novice, 0, width))
            continue
        if c.step == 1:
            width = min(c.width, max(1, round(options.mixed_width * c.width)))
        else:  # the nearest multiple of the step, at least one block
            width = max(
                nearest_multiple(options.mixed_width * c.width, c.step, c.width), min(c.step, c.width)
            )
        narrowed = min(rest, max(0, round(left / c.expert(width))))
        dropped = rest - narrowed
        dropped -= dropped % c.multiple  # group-limited routing drops whole rounds
        narrowed = rest - dropped
        if c.step > 1:  # no block goes below one: drop more rather than keep more than the fill can take
            budget = keep * c.experts * c.expert() - whole * c.expert() - novice * c.novice
            slack = c.step / (2 * len(costs))  # the layers' share of the half block the budget allows
            while (
                narrowed >= c.multiple
                and narrowed * c.expert(width) - budget > (narrowed * (width - c.step) + slack) * c.per_neuron
            ):
                narrowed, dropped = narrowed - c.multiple, dropped + c.multiple
        if width == c.width:  # a narrowed expert at full width is a whole one
            whole, narrowed = whole + narrowed, 0
        genes.append(LayerGene(whole, narrowed, novice, dropped, width))
    return genes


def fill_widths(costs: Sequence[LayerCosts], genes: Sequence[LayerGene], target: float) -> list[list[int]]:
    """Per layer, the neurons of each narrowed expert (most important first) so that the kept
    parameters are within half a neuron row of `target`: the neurons the genes miss go one each to
    the narrowed experts, the most important of every layer first. Layers whose costs have a width
    step above 1 get (or give back) whole blocks of their step instead, each while at least half of
    it is owed: within max(step) / 2 neuron rows then (module docstring)."""
    rows = {c.per_neuron for c in costs}
    if len(rows) != 1:
        raise MoePruneError(f"MoE layers disagree on parameters per neuron ({sorted(rows)})")
    row = rows.pop()
    widths = [[g.width] * g.narrowed for g in genes]
    owed = (target - sum(c.kept(g) for c, g in zip(costs, genes))) / row
    extra = round(owed)
    slots = sorted(((j, pos) for pos, g in enumerate(genes) for j in range(g.narrowed)))
    if extra and not slots:
        raise MoePruneError(
            f"the mixed plan's whole experts and novices miss the budget by {abs(extra)} neurons and no "
            "expert is narrowed to absorb them; give a --mixed-width below 1, or a sparsity its counts meet",
            options=("mixed_width", "sparsity"),
        )
    if slots and all(c.step == 1 for c in costs):
        base, more = divmod(extra, len(slots))
        for n, (j, pos) in enumerate(slots):
            widths[pos][j] += base + (n < more)
    elif slots:
        owed = hand_out_blocks(widths, slots, [(c.step, c.width) for c in costs], owed)
        if abs(owed) > max(c.step for c in costs) / 2:
            raise MoePruneError(
                f"the mixed plan's narrowed experts, on their width multiple, cannot absorb the {abs(owed):.0f} "
                "neurons its other forms miss the budget by; narrow more experts (--mixed-width) or change the shares",
                options=("mixed_width", "mixed_whole", "sparsity", "width_multiple"),
            )
    for pos, (c, ws) in enumerate(zip(costs, widths)):
        if ws and not (min(ws) >= 1 and max(ws) <= c.width):
            raise MoePruneError(
                f"MoE layer {pos}: to meet the budget its narrowed experts would keep {min(ws)} to {max(ws)} "
                f"of {c.width} neurons; narrow more experts (--mixed-width) or change the shares",
                options=("mixed_width", "mixed_whole", "sparsity"),
            )
    return widths


def _target(costs: Sequence[LayerCosts], sparsity: float) -> float:
    return (1 - sparsity) * sum(c.experts * c.expert() for c in costs)


def mixed_options(config: PruneConfig) -> MixedOptions:
    """The config's mixed options resolved (a dict of fields from a recipe or a script, or None)."""
    return options_as(config, MixedOptions)


def planned_genes(moe: MoEModel, config: PruneConfig) -> tuple[list[LayerGene], list[list[int]]]:
    """The uniform genes of `config` and the narrowed widths that meet its budget. Where the shares
    cannot reach the sparsity (e.g. experts one width step wide cannot be narrowed) a search (evo,
    gradient) still runs from mixed's other recipes (search/mixed_space.py): its plan is then
    planned, sized and priced as the uniform drop recipe, nothing narrowed."""
    options = mixed_options(config)
    sparsity = config.sparsity_value()
    limits = layer_limits(moe, config.expert_multiple)
    costs = stepped_costs(moe, limits, sparsity, options)
    try:
        genes = uniform_genes(costs, sparsity, options)
        check_genes(costs, genes, [m.index for m in moe.layers])
        return genes, fill_widths(costs, genes, _target(costs, sparsity))
    except MoePruneError:
        if not searches(config.allocation):
            raise
    removed = uniform_allocation(
        limits.budget(sparsity), limits.num_experts, limits.top_k, **limits.as_kwargs()
    )
    return [LayerGene(c.experts - r, 0, 0, r, c.width) for c, r in zip(costs, removed)], [[] for _ in costs]


def mixed_plan(request: PlanRequest, genes: Sequence[LayerGene]) -> Plan:
    """The plan of `genes` at the request's sparsity (its scores in pruning order, super experts
    last: `protected_order`, as build_plan gives them). A search calls it with its own genes."""
    moe, stats, sparsity = request.moe, request.domains, request.sparsity
    options: MixedOptions = request.options or MixedOptions()
    importance = options.neuron_importance
    limits = layer_limits(moe, request.expert_multiple)
    costs = stepped_costs(moe, limits, sparsity, options)
    check_genes(costs, genes, limits.layers)
    require_stats(stats, "the mixed method (novices' mean outputs, neuron importance)")
    if any(g.narrowed for g in genes):
        check_neuron_prunable(moe)
        check_neuron_stats(moe, stats, check_importance(importance))
    target = _target(costs, sparsity)
    widths = fill_widths(costs, genes, target)
    orders = [list(s.order) for s in request.scores]
    drops = plan_removals(orders, [g.dropped for g in genes], limits.groups)
    layers = []
    for m, g, order, gone, ws in zip(moe.layers, genes, orders, drops, widths):
        ids, gone_set = m.expert_ids, set(gone)
        ranked = [ids[p] for p in reversed(order) if p not in gone_set]  # most important first
        narrowed = ranked[g.whole : g.whole + g.narrowed]
        novice = ranked[g.whole + g.narrowed :]
        layers.append(
            LayerPlan(
                layer=m.index,
                num_experts=m.num_experts,
                top_k=m.top_k,
                kept=sorted(ranked),
                dropped=sorted(ids[p] for p in gone),
                novice=sorted(novice),
                neurons=dict(sorted((e, w) for e, w in zip(narrowed, ws) if w < m.intermediate_size)),
            )
        )
    kept = sum(g.whole * c.expert() + g.novice * c.novice for c, g in zip(costs, genes))
    kept += sum(c.expert(w) for c, ws in zip(costs, widths) for w in ws)
    plan = Plan.create(
        model_type=moe.model_type,
        layers=layers,
        criterion=request.criterion.name,
        allocation=request.allocation,
        method="mixed",
        sparsity=sparsity,
        data_fingerprint=request.data_fingerprint,
        extra={
            "neuron_importance": importance,
            GENES_KEY: [asdict(g) for g in genes],
            "width_multiple": {str(m.index): c.step for m, c in zip(moe.layers, costs)},
            "routed_parameters_target": target,
            "routed_parameters_kept": int(kept),
            "routed_parameters_total": sum(c.experts * c.expert() for c in costs),
        },
    )
    if options.novice_rank:  # fitted after planning (surgery/lowrank.py), or taken from a search's fits
        plan.extra[RANK_KEY] = options.novice_rank
    plan.validate({m.index: m.intermediate_size for m in moe.layers})
    return plan


# ----------------------------------------------------------------------------- size planning
def _mixed_steps(
    moe: MoEModel, config: PruneConfig, size: WeightBytes, target: int
) -> list[tuple[float, int]]:
    """The smallest sparsity on a 1e-4 grid whose plan fits (surgery/sizes.py `grid_steps`)."""

    def at(sparsity: float) -> int | None:
        try:
            return planned_bytes(moe, replace(config, sparsity=sparsity, target_size=None), size)
        except MoePruneError:  # the shares cannot reach this sparsity
            return None

    check_neuron_prunable(moe)
    return grid_steps(at, size.total, target)


def _mixed_feasible(moe: MoEModel, config: ResolvedConfig) -> dict:
    """The uniform genes at the config's sparsity (`planned_genes`: a search the shares cannot
    reach is planned as the drop recipe)."""
    limits, sparsity = layer_limits(moe, config.expert_multiple), config.sparsity_value()
    steps = [c.step for c in stepped_costs(moe, limits, sparsity, mixed_options(config))]
    if config.allocator.neuron_by_neuron:
        check_gradient_steps(steps)
    genes, widths = planned_genes(moe, config)
    return {
        "width_multiple": dict(zip([m.index for m in moe.layers], steps)),
        "mixed_genes": {m.index: asdict(g) for m, g in zip(moe.layers, genes)},
        "narrowed_neurons": {m.index: sorted(set(ws)) for m, ws in zip(moe.layers, widths)},
    }


def _mixed_keeps(meta: MoEModel, config: PruneConfig) -> list[LayerKeep]:
    """The uniform genes' whole experts, narrowed widths, novices and drops per layer."""
    check_neuron_prunable(meta)
    genes, widths = planned_genes(meta, config)
    return [
        LayerKeep((m.intermediate_size,) * g.whole + tuple(ws), g.novice, g.dropped)
        for m, g, ws in zip(meta.layers, genes, widths)
    ]


@METHODS.register(
    Method(
        "mixed",
        "per layer the most important experts stay whole, the next are narrowed to their top neurons, "
        "the next become novices and the rest are dropped; one routed-parameter budget met exactly",
        PARAMETERS,
        ("uniform", "evo", "gradient"),
        needs=(NEURON_STATS,),
        neurons=True,
        statistics=frozenset({Statistic.MOMENTS}),  # the novices' mean outputs
        options=MixedOptions,
        genes=FORMS,
        feasible=_mixed_feasible,
        target_steps=_mixed_steps,
        planned_keeps=_mixed_keeps,
        super_experts="keep their routing and stay whole (every layer keeps at least its super experts whole)",
    )
)
def plan_mixed(request: PlanRequest) -> Plan:
    options: MixedOptions = request.options or MixedOptions()
    if request.removed is not None:  # evo / gradient: the searched genes (search/)
        return mixed_plan(request, [LayerGene(*g) for g in request.removed])  # type: ignore[misc]
    costs = stepped_costs(
        request.moe, layer_limits(request.moe, request.expert_multiple), request.sparsity, options
    )
    plan = mixed_plan(request, uniform_genes(costs, request.sparsity, options))
    plan.extra["mixed_options"] = {k: v for k, v in asdict(options).items() if k.startswith("mixed_")}
    return plan
