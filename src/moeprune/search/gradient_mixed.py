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
4. the loss is the same top-k KL from the full model as drop's (search/training.py `batch_loss`);
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
from collections.abc import Sequence
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
from moeprune.models.adapter import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.document import SearchDocument
from moeprune.search.form_projection import (
    FormPlan,
    forms_of_plan,
    plan_order,
    project_forms,
)
from moeprune.search.form_training import FormLogits, Forms, Problem, seeds_document, split, start_logits
from moeprune.search.mixed_space import MixedSpace, as_genes
from moeprune.search.options import SearchRuntime
from moeprune.search.space import listed
from moeprune.search.training import rounded, timings, train_logits, training_settings
from moeprune.surgery.lowrank import Fits
from moeprune.surgery.mixed import (
    MixedOptions,
    mixed_options,
    mixed_plan,
    stepped_costs,
)
from moeprune.surgery.neurons import check_importance, check_neuron_prunable
from moeprune.surgery.novice import require_stats
from moeprune.surgery.plans import virtual_plan
from moeprune.surgery.registry import PlanRequest
from moeprune.surgery.widths import check_gradient_steps


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


def _problem(request: PlanRequest, fits: Fits | None) -> tuple[Problem, Any, int]:
    """What the training projects onto, the observed domains and the novice rank; bad input
    (a family or width step the training cannot serve, a rank without fits) refused first."""
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
    forms = Forms(
        moe, costs, limits, domains, check_importance(options.neuron_importance), fits if rank else None
    )
    sizes = [c.experts for c in costs]
    return Problem(costs, sizes, target, torch.cat(forms.allowed), forms, limits), domains, rank


def _trained(
    request: PlanRequest, problem: Problem, final: torch.Tensor
) -> tuple[FormPlan, list[list[int]], Any]:
    """The projection of the trained logits (no noise), the per-layer orders under which
    `mixed_plan` makes exactly it, and that plan."""
    moe, limits = request.moe, problem.limits
    z: list[np.ndarray] = [t.numpy() for t in problem.forms.scores(final, problem.sizes)]
    plan = project_forms(problem.costs, z, problem.target, limits.layers, limits.groups)
    orders = [
        plan_order(plan, pos, z[pos], moe.protected.get(m.index, ())) for pos, m in enumerate(moe.layers)
    ]
    chosen = replace(
        request,
        scores=[LayerScores(layer=s.layer, scores=s.scores, order=o) for s, o in zip(request.scores, orders)],
    )
    return plan, orders, mixed_plan(chosen, plan.genes)


def run_gradient_mixed(
    request: PlanRequest,
    search_data: CalibrationData,
    *,
    config: SearchConfig,
    runtime: SearchRuntime | None = None,
    fits: Fits | None = None,
) -> tuple[list[tuple[int, int, int, int, int]], list[list[int]], dict[str, Any]]:
    """The trained mixed plan as genes and per-layer orders (`mixed_plan(request with these orders,
    genes)` makes exactly it), and search.json. ``request``: a mixed PlanRequest (scores in pruning
    order, super experts last; mixed options; stats). ``fits``: with a novice rank R, every expert's fit."""
    runtime = runtime or SearchRuntime()
    fitness = check_fitness(config.fitness)
    config.validate()
    moe = request.moe
    problem, domains, rank = _problem(request, fits)
    limits, target = problem.limits, problem.target
    # the evo search's generation 0 (search/mixed_space.py): one line when no recipe meets the budget
    seeds = MixedSpace(problem.costs, limits.layers, request.sparsity).seeds(
        limits, request.options or MixedOptions()
    )
    plans: dict[tuple, Any] = {("seed", name): mixed_plan(request, as_genes(g)) for name, g in seeds.items()}
    start = time.perf_counter()
    evaluator = CandidateEvaluator(
        moe,
        search_data,
        [s.order for s in request.scores],
        fitness=fitness,
        seed=config.seed,
        runtime=replace(runtime, fast=False, candidate_context=None),
        plan_context=lambda key: virtual_plan(moe, plans[key], domains, fits if rank else None),
    )
    values = {name: evaluator.evaluate(("seed", name)) for name in seeds}  # type: ignore[arg-type]
    first = max(values, key=lambda name: values[name])  # the best recipe on the search data (ties: the first)
    theta, width = start_logits(moe, problem, plans[("seed", first)])
    relaxation = FormLogits(moe, problem, width)
    history, train_seconds = train_logits(moe, relaxation, theta, evaluator, config, runtime.progress)
    layers = limits.layers
    final = theta.detach().double()
    plan, orders, plans[("trained",)] = _trained(request, problem, final)
    eval_start = time.perf_counter()
    value = evaluator.evaluate(("trained",))  # type: ignore[arg-type]
    sign = evaluator.sign
    trained = [(g.whole, g.narrowed, g.novice, g.dropped, g.width) for g in plan.genes]
    if value >= values[first]:  # the trained plan, unless the recipe it started from scores better
        returned, genes, saved = "trained", trained, plans[("trained",)]
    else:
        returned, genes, saved = first, list(seeds[first]), plans[("seed", first)]
        orders = [list(s.order) for s in request.scores]
    document = SearchDocument(
        head={
            "allocation_method": "gradient",
            "space": "mixed forms (whole, narrowed, novice, dropped) per routed expert",
        },
        fitness=fitness,
        higher_is_better=sign > 0,
        config=training_settings(config),
        found={
            "layers": layers,
            "routed_parameters_target": target,
            "routed_parameters_kept": saved.extra["routed_parameters_kept"],
            **({"novice_rank": rank} if rank else {}),
            "returned": returned,
            "genes": listed(genes),
            "narrowed_neurons": [list(lp.neurons.values()) for lp in saved.layers],
            "forms": forms_of_plan(saved),
        },
        fitness_value=sign * max(value, values[first]),
        references={
            "trained": {
                "genes": listed(trained),
                "fitness_value": sign * value,
                "forms": forms_of_plan(plans[("trained",)]),
            },
            **seeds_document(seeds, values, sign, first),
        },
        evaluations=len(seeds) + 1,
        steps=config.steps,
        stopped={"reason": "steps"},
        history={
            "training": history,
            "form_logits": {
                str(layer): rounded(part) for layer, part in zip(layers, split(final, problem.sizes))
            },
        },
        **evaluator.data_summary(),
        timings_s=timings(evaluator, train_seconds, eval_start, start),
    ).to_json()
    evaluator.release()
    if not math.isfinite(value):
        raise MoePruneError("the gradient allocation's mixed plan scored a non-finite fitness")
    return genes, orders, document


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
        moe,
        criterion,
        ordered,
        config.sparsity_value(),
        "gradient",
        "mixed",
        stats=stats,
        expert_multiple=config.expert_multiple,
        options=mixed_options(config),
    )
    genes, orders, document = run_gradient_mixed(
        request, search_set, config=config.search, runtime=runtime, fits=novices
    )
    document["criterion"] = criterion.name
    chosen = [LayerScores(layer=s.layer, scores=s.scores, order=o) for s, o in zip(ordered, orders)]
    return genes, chosen, document
