"""The gradient allocation of mixed plans (`--method mixed --allocation gradient`): per-expert
form logits trained against the full model (RCO's idea, search/gradient.py, with four forms).

Every routed expert e has one logit theta[e, f] per form f in (whole, narrowed, novice, dropped)
(search/form_projection.py). Super experts stay whole and fixed layers untouched: their only
form is whole. A novice as large as an expert (a high `--novice-rank` on a small model) is not a
form. Each training step:

1. draws Gumbel noise g[e, f] and scores z = (theta + g) / tau;
2. projects z onto the one parameter budget (`project_forms`): a hard form per expert within
   every per-layer limit of `check_genes` (top_k experts keep weights, drops a multiple within the
   cap and balanced over routing groups), the narrowed widths filled (`fill_widths`) so the kept
   routed parameters are the budget to half a neuron row at every step, as every mixed plan;
3. runs one search batch with every routed expert computing all its forms: whole and narrowed
   share the expert's intermediate activation m (narrowed: the expert's top-w neurons in the ENP
   order `mixed_plan` keeps, y_w = y - W_down (m * (1 - mask))), the novice is its mean output
   (or, with `--novice-rank R`, its rank-R fit from `fit_every_novice`, as mixed + evo scores it),
   dropped adds nothing; the expert's output is sum_f w_f y_f times its routing weight, straight
   through: the forward sees the hard one-hot w, the backward softmax(z), so the loss sees what
   switching a form would do. An expert not narrowed in the hard plan is scored narrowed at the
   plan's width. Routing is kept, as drop's gradient allocation (its `--reroute none` form);
4. the loss is the same top-k KL from the full model as drop's (search/gradient.py `_batch_loss`);
5. Adam on theta after removing the gradient's component along the expected kept parameters
   E = sum_e sum_f softmax(theta_e)_f cost_f (the budget's normal), then a retraction puts E back
   on the budget by theta_e,f += c x price_f (price: the form's parameters over a whole expert's;
   E rises with c, so bisection finds it): RCO's projected Adam, with the form prices as the
   budget's direction (drop's sigmoid shift is the two-form case: prices 1 and 0).

The budget's direction prices a narrowed expert at the mean width of the previous step's plan
(the start plan's at the start). The logits start at the best of the evo search's seeds on the
search data (uniform drop, uniform novices, TENP's trapezoid, ENP, the mixed uniform plan of the
`--mixed-*` shares; search/mixed_space.py): its form gets `_INIT_SPREAD`, the others 0, so the
best single recipe is the prior and the data decides. The plan
is the projection of theta itself (no noise), converted to genes and per-layer pruning orders
under which `mixed_plan` makes exactly it; it and every seed are scored with the mixed
virtual fitness (router slicing, neuron masks, novices: what the evo search scores). It is the
result unless the seed it started from scores higher on the search data; then that seed is (the
result is never worse on the search data than the best single recipe, as evo's generation 0
guarantees; the straight-through gradient is a first-order guess at a discrete switch and can
walk away from a good start: on the DeepSeek-V3 quick demo model it did, docs/allocation.md).
search.json says which (`returned`), holds the trained plan either way (`trained`), every seed,
the training curve, the forms per layer and the timings.

Memory: one training step of the model (activations of one search batch kept for the backward,
each routed expert's intermediate activation and three outputs per pick; the weights are frozen),
the teacher cache, and per layer an [E, I] neuron rank table; the logits are a few kilobytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from moeprune.allocate.fitness import check_fitness
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import Criterion, LayerScores
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.lowrank import novice_output
from moeprune.observe.stats import ExpertStats
from moeprune.runtime.progress import progress_bar
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.form_projection import (
    DROPPED,
    FORMS,
    NARROWED,
    NOVICE,
    WHOLE,
    FormPlan,
    forms_of_plan,
    plan_order,
    project_forms,
)
from moeprune.search.gradient import _batch_loss, _temperature, training_settings
from moeprune.search.mixed_space import MixedSpace, as_genes
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import UNIFORM
from moeprune.surgery.lowrank import Fits
from moeprune.surgery.mixed import (
    LayerCosts,
    MixedOptions,
    mixed_options,
    mixed_plan,
    stepped_costs,
)
from moeprune.surgery.neurons import check_importance, check_neuron_prunable, neuron_importance
from moeprune.surgery.novice import layer_stats, require_stats
from moeprune.surgery.plans import virtual_plan
from moeprune.surgery.registry import PlanRequest
from moeprune.surgery.widths import check_gradient_steps

_INIT_SPREAD = 2.0  # the start plan's form leads the others by this
_RETRACTION_STEPS = 60


def check_gradient_family(moe: MoEModel, limits: LayerLimits) -> None:
    """One line for a model whose experts this allocation cannot compute form by form."""
    check_neuron_prunable(moe)
    for layer, fixed in zip(moe.layers, limits.fixed):
        if fixed:
            continue
        if (
            layer.spec.weight_on_input
            or getattr(layer.experts, "moeprune_packed", False)
            or layer.spec.extra_experts
        ):
            raise MoePruneError(
                f"the gradient allocation computes each expert's forms, which decoder layer {layer.index} "
                f"({moe.model_type}) computes differently; use --allocation evo",
                options=("allocation",),
            )


class _Forms:
    """Per MoE layer: which forms each expert may take, its neuron ranks and its novice."""

    def __init__(self, moe: MoEModel, costs: Sequence[LayerCosts], limits: LayerLimits, domains, kind, fits):
        self.allowed: list[torch.Tensor] = []  # bool [n, 4]
        self.ranks: list[torch.Tensor] = []  # [n, I] position of each neuron in its expert's ENP order
        self.novices: list[dict[int, Any]] = []
        for layer, c, fixed in zip(moe.layers, costs, limits.fixed):
            allowed = torch.ones(c.experts, 4, dtype=torch.bool)
            allowed[:, NOVICE] = c.novice < c.expert()
            protected = list(moe.protected.get(layer.index, ()))
            if fixed:
                protected = list(range(c.experts))
            allowed[protected, 1:] = False
            self.allowed.append(allowed)
            s = layer_stats(domains, layer)
            order = torch.argsort(-neuron_importance(s, kind), dim=1, stable=True)
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
            self.ranks.append(rank)
            ref = layer.down_matrix(0)
            ids = layer.expert_ids
            self.novices.append(
                {p: fits[layer.index][ids[p]] for p in range(c.experts)}
                if fits is not None
                else {p: s.mean[p].to(device=ref.device, dtype=ref.dtype) for p in range(c.experts)}
            )

    def scores(self, theta: torch.Tensor, layout: Sequence[int]) -> list[torch.Tensor]:
        return [t.masked_fill(~a, -math.inf) for t, a in zip(_split(theta, layout), self.allowed)]


def _split(values: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(values, list(sizes)))


def _forward(layer: MoELayer, state: dict[str, Any]):
    """The experts' forward computing sum_f w_f y_f per pick (module docstring, step 3)."""

    def forward(hidden_states, top_k_index=None, top_k_weights=None, **_: object):
        weights, masks, novices = state["weights"][layer.index], state["masks"][layer.index], state["novices"]
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
        flat_weights = top_k_weights.reshape(-1)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            picked = order[start : start + n]
            start += n
            rows = picked // top_k_index.shape[1]
            x = hidden_states[rows]
            y, m = layer.expert_forward(expert, x, return_intermediate=True)
            w = weights[expert].to(y.dtype)
            mix = w[WHOLE] * y
            cut = m * (1 - masks[expert].to(m.dtype))
            mix = mix + w[NARROWED] * (y - cut @ layer.down_matrix(expert).T)
            if layer.index in novices:
                mix = mix + w[NOVICE] * novice_output(novices[layer.index][expert], x)
            out.index_add_(0, rows, (mix * flat_weights[picked].unsqueeze(1).to(y.dtype)).to(out.dtype))
        return out.to(hidden_states.dtype)

    return forward


@contextmanager
def _mixed_experts(moe: MoEModel, limits: LayerLimits, state: dict[str, Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for layer, fixed in zip(moe.layers, limits.fixed):
            if fixed:
                continue
            target = layer.experts
            had_own, previous = "forward" in target.__dict__, target.__dict__.get("forward")
            target.forward = _forward(layer, state)
            stack.callback(_restore, target, had_own, previous)
        yield


def _set_state(
    state: dict[str, Any], moe: MoEModel, forms: _Forms, plan: FormPlan, mix: torch.Tensor
) -> None:
    """What `_forward` reads for one step: each expert's form weights `mix` [N, 4] and its neuron
    mask (its filled width when narrowed, else the plan's mean width: what narrowing it would keep)."""
    sizes = [m.num_experts for m in moe.layers]
    for pos, (m, part) in enumerate(zip(moe.layers, _split(mix, sizes))):
        state["weights"][m.index] = part
        w = torch.tensor([plan.widths[pos].get(e, plan.width) for e in range(sizes[pos])])
        state["masks"][m.index] = (forms.ranks[pos] < w.unsqueeze(1)).to(**_placed(m))


def _restore(module: torch.nn.Module, had_own: bool, previous) -> None:
    if had_own:
        module.forward = previous
    else:
        del module.forward


def _cost_table(costs: Sequence[LayerCosts], sizes: Sequence[int], width: int) -> torch.Tensor:
    """[N, 4] each expert's parameters per form (narrowed at `width` neurons)."""
    rows = [
        torch.tensor([c.expert(), c.expert(min(width, c.width)), c.novice, 0.0], dtype=torch.float64).expand(
            n, 4
        )
        for c, n in zip(costs, sizes)
    ]
    return torch.cat(rows)


def _expected(theta: torch.Tensor, allowed: torch.Tensor, cost: torch.Tensor) -> float:
    p = torch.softmax(theta.masked_fill(~allowed, -math.inf), dim=1)
    return float((p * cost).sum())


def _retract(theta: torch.Tensor, allowed: torch.Tensor, cost: torch.Tensor, target: float) -> torch.Tensor:
    """theta + c x price (price = cost / a whole expert's) with E[kept] = target (bisection)."""
    price = cost / cost[:, :1]
    lo, hi = -200.0, 200.0
    for _ in range(_RETRACTION_STEPS):
        mid = 0.5 * (lo + hi)
        if _expected(theta + mid * price, allowed, cost) > target:
            hi = mid
        else:
            lo = mid
    return theta + 0.5 * (lo + hi) * price


def _project_step(theta: torch.Tensor, allowed: torch.Tensor, cost: torch.Tensor) -> None:
    """Remove from theta.grad its component along the normal dE/dtheta of the expected budget."""
    assert theta.grad is not None
    with torch.no_grad():
        grad = theta.grad.double()
        grad[~allowed] = 0.0
        p = torch.softmax(theta.detach().double().masked_fill(~allowed, -math.inf), dim=1)
        normal = p * (cost - (p * cost).sum(1, keepdim=True))
        normal[~allowed] = 0.0
        grad -= (grad * normal).sum() / ((normal * normal).sum() + 1e-30) * normal
        theta.grad.copy_(grad.to(theta.grad.dtype))


def _kept(costs: Sequence[LayerCosts], plan: FormPlan) -> int:
    out = 0
    for c, g, ws in zip(costs, plan.genes, plan.widths):
        out += g.whole * c.expert() + g.novice * c.novice + sum(c.expert(w) for w in ws.values())
    return out


def _gumbel(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return -torch.log(-torch.log(u))


def run_gradient_mixed(
    request: PlanRequest,
    search_data: CalibrationData,
    *,
    config: SearchConfig,
    runtime: SearchRuntime | None = None,
    fits: Fits | None = None,
) -> tuple[list[tuple[int, int, int, int, int]], list[list[int]], dict[str, Any]]:
    """The trained mixed plan as genes and per-layer pruning orders (`mixed_plan(request with
    these orders, genes)` makes exactly it), and search.json. ``request``: a mixed PlanRequest
    (its scores in pruning order, super experts last; its options the mixed options; its stats).
    ``fits``: with a novice rank R, every expert's rank-R fit. Refusals before the teacher pass."""
    runtime = runtime or SearchRuntime()
    fitness = check_fitness(config.fitness)
    config.validate()
    moe, sparsity = request.moe, request.sparsity
    options: MixedOptions = request.options or MixedOptions()
    rank = options.novice_rank
    if rank and fits is None:
        raise MoePruneError(
            f"the gradient allocation with --novice-rank {rank} needs every expert's fit first"
        )
    limits = layer_limits(moe, request.expert_multiple)
    check_gradient_family(moe, limits)
    costs = stepped_costs(moe, limits, sparsity, options)
    check_gradient_steps([c.step for c in costs])  # the projection fills neuron by neuron
    target = (1 - sparsity) * sum(c.experts * c.expert() for c in costs)
    domains = require_stats(request.domains, "the mixed gradient allocation")
    forms = _Forms(
        moe, costs, limits, domains, check_importance(options.neuron_importance), fits if rank else None
    )
    # the evo search's generation 0 (search/mixed_space.py): one line when no recipe meets the budget
    seeds = MixedSpace(costs, limits.layers, sparsity).seeds(limits, options)
    plans: dict[tuple, Any] = {("seed", name): mixed_plan(request, as_genes(g)) for name, g in seeds.items()}
    sizes = [c.experts for c in costs]
    start = time.perf_counter()
    evaluator = CandidateEvaluator(
        moe, search_data, [s.order for s in request.scores], fitness=fitness, seed=config.seed,
        runtime=replace(runtime, fast=False, candidate_context=None),
        plan_context=lambda key: virtual_plan(moe, plans[key], domains, fits if rank else None),
    )  # fmt: skip
    values = {name: evaluator.evaluate(("seed", name)) for name in seeds}  # type: ignore[arg-type]
    first = max(values, key=lambda name: values[name])  # the best recipe on the search data (ties: the first)
    allowed = torch.cat(forms.allowed)
    init = torch.zeros(sum(sizes), 4, dtype=torch.float64)
    for pos, (m, lp) in enumerate(zip(moe.layers, plans[("seed", first)].layers)):
        base = sum(sizes[:pos])
        where = {e: p for p, e in enumerate(m.expert_ids)}
        for e in lp.kept:
            form = NOVICE if e in lp.novice else NARROWED if e in lp.neurons else WHOLE
            init[base + where[e], form] = _INIT_SPREAD
        for e in lp.dropped:
            init[base + where[e], DROPPED] = _INIT_SPREAD
    widths = [w for lp in plans[("seed", first)].layers for w in lp.neurons.values()]
    width = int(round(float(np.mean(widths)))) if widths else costs[0].width
    cost = _cost_table(costs, sizes, width)
    theta = _retract(init, allowed, cost, target).float().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)
    frozen = [p.requires_grad for p in moe.model.parameters()]
    moe.model.requires_grad_(False)
    state: dict[str, Any] = {"weights": {}, "masks": {}, "novices": {}}
    state["novices"] = {m.index: nov for m, nov in zip(moe.layers, forms.novices)}
    groups, layers = limits.groups, limits.layers
    history: list[dict[str, Any]] = []
    train_start = time.perf_counter()
    bar = progress_bar(
        total=config.steps, desc="gradient allocation (mixed)", unit="step", enabled=runtime.progress
    )
    try:
        with _mixed_experts(moe, limits, state), torch.enable_grad():
            for step in range(config.steps):
                tau = _temperature(config, step)
                gumbel = _gumbel((theta.shape[0], theta.shape[1]), generator)
                noisy = (theta.detach().double() + gumbel) / tau
                noisy_z = forms.scores(noisy, sizes)
                hard_plan = project_forms(costs, [t.numpy() for t in noisy_z], target, layers, groups)
                width = hard_plan.width
                hard = torch.nn.functional.one_hot(
                    torch.from_numpy(np.concatenate(hard_plan.forms)), 4
                ).float()
                soft = torch.softmax(((theta + gumbel.float()) / tau).masked_fill(~allowed, -math.inf), dim=1)
                free = allowed.sum(1, keepdim=True) > 1
                mix = torch.where(free, hard + soft - soft.detach(), hard)
                _set_state(state, moe, forms, hard_plan, mix)
                optimizer.zero_grad()
                loss = _batch_loss(evaluator, step % evaluator.batch_count, config.kl_top_k)
                loss.backward()
                _project_step(theta, allowed, cost)
                optimizer.step()
                cost = _cost_table(costs, sizes, width)
                with torch.no_grad():
                    theta.copy_(_retract(theta.detach().double(), allowed, cost, target).float())
                totals = {f: sum(c[f] for c in hard_plan.counts()) for f in FORMS}
                history.append({"step": step, "loss": float(loss.detach()), "temperature": tau,
                                "routed_parameters_kept": _kept(costs, hard_plan), "forms": totals})  # fmt: skip
                bar.set_postfix_str(f"top-{config.kl_top_k} KL {history[-1]['loss']:.4g}")
                bar.update(1)
    finally:
        bar.close()
        state.clear()
        for p, flag in zip(moe.model.parameters(), frozen):
            p.requires_grad_(flag)
    train_seconds = time.perf_counter() - train_start
    final = theta.detach().double()
    z: list[np.ndarray] = [t.numpy() for t in forms.scores(final, sizes)]
    plan = project_forms(costs, z, target, layers, groups)
    orders = [
        plan_order(plan, pos, z[pos], moe.protected.get(m.index, ())) for pos, m in enumerate(moe.layers)
    ]
    chosen = replace(
        request,
        scores=[LayerScores(layer=s.layer, scores=s.scores, order=o) for s, o in zip(request.scores, orders)],
    )
    plans[("trained",)] = mixed_plan(chosen, plan.genes)
    eval_start = time.perf_counter()
    value = evaluator.evaluate(("trained",))  # type: ignore[arg-type]
    sign = evaluator.sign
    trained = [(g.whole, g.narrowed, g.novice, g.dropped, g.width) for g in plan.genes]
    if value >= values[first]:  # the trained plan, unless the recipe it started from scores better
        returned, genes, saved = "trained", trained, plans[("trained",)]
    else:
        returned, genes, saved = first, list(seeds[first]), plans[("seed", first)]
        orders = [list(s.order) for s in request.scores]
    document = {
        "allocation_method": "gradient",
        "space": "mixed forms (whole, narrowed, novice, dropped) per routed expert",
        "fitness": fitness,
        "higher_is_better": sign > 0,
        "config": training_settings(config),
        "layers": layers,
        "routed_parameters_target": target,
        "routed_parameters_kept": saved.extra["routed_parameters_kept"],
        **({"novice_rank": rank} if rank else {}),
        "returned": returned,
        "genes": [list(g) for g in genes],
        "narrowed_neurons": [list(lp.neurons.values()) for lp in saved.layers],
        "forms": forms_of_plan(saved),
        "fitness_value": sign * max(value, values[first]),
        "trained": {
            "genes": [list(g) for g in trained],
            "fitness_value": sign * value,
            "forms": forms_of_plan(plans[("trained",)]),
        },
        "seeds": {
            name: {"genes": [list(g) for g in genes], "fitness_value": sign * values[name]}
            for name, genes in seeds.items()
        },
        "start": first,
        **(
            {
                "uniform": {
                    "genes": [list(g) for g in seeds["uniform"]],
                    "fitness_value": sign * values["uniform"],
                }
            }
            if UNIFORM in seeds
            else {}
        ),
        "evaluations": len(seeds) + 1,
        "steps": config.steps,
        "stopped": {"reason": "steps"},
        "training": history,
        "form_logits": {
            str(layer): [[round(float(v), 6) for v in row] for row in part]
            for layer, part in zip(layers, _split(final, sizes))
        },
        **evaluator.data_summary(),
        "timings_s": {
            "teacher_pass": round(evaluator.teacher_seconds, 3),
            "training": round(train_seconds, 3),
            "evaluation": round(time.perf_counter() - eval_start, 3),
            "total": round(time.perf_counter() - start, 3),
        },
    }
    evaluator.release()
    if not math.isfinite(value):
        raise MoePruneError("the gradient allocation's mixed plan scored a non-finite fitness")
    return genes, orders, document


def _placed(layer: MoELayer) -> dict[str, Any]:
    """The device and dtype of the layer's expert weights (the neuron masks are built on the CPU)."""
    ref = layer.down_matrix(0)
    return {"device": ref.device, "dtype": ref.dtype}


def gradient_mixed_allocation(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    stats: Sequence[ExpertStats],
    search_set: CalibrationData,
    *,
    config: PruneConfig,
    runtime: SearchRuntime | None = None,
    novices: Fits | None = None,
) -> tuple[list[tuple[int, int, int, int, int]], list[LayerScores], dict[str, Any]]:
    """`--method mixed --allocation gradient`: the genes, the scores with each layer's order making
    the trained plan (score values stay the criterion's; `build_plan(..., removed=genes)` saves it)
    and search.json. `novices`: with a novice rank R > 0, every routed expert's rank-R fit."""
    ordered = protected_order(scores, moe.protected)  # super experts last
    request = PlanRequest(
        moe, criterion, ordered, config.sparsity_value(), "gradient", "mixed", stats=stats,
        expert_multiple=config.expert_multiple, options=mixed_options(config),
    )  # fmt: skip
    genes, orders, document = run_gradient_mixed(
        request, search_set, config=config.search, runtime=runtime, fits=novices
    )
    document["criterion"] = criterion.name
    chosen = [LayerScores(layer=s.layer, scores=s.scores, order=o) for s, o in zip(ordered, orders)]
    return genes, chosen, document
