"""The gradient allocation: per-expert keep logits trained against the full model (RCO's idea,
arXiv 2605.00649, with the per-layer limits it lacks).

One logit theta_e per routed expert says how much the expert is worth keeping. Each training step:

1. draws logistic noise (the difference of two Gumbels: the two-way Gumbel-softmax of "keep"
   against "drop") and scores z = (theta + noise) / tau;
2. projects z onto the budget (allocate/projection.py): the hard mask drops exactly the budget,
   within every per-layer limit (top-k experts kept, routing groups balanced, super experts and
   fixed layers untouched, multiples of `expert_multiple`), the experts with the lowest z;
3. runs one search batch through the frozen model with each selected expert's routing weight
   multiplied by its mask value, straight through: the forward sees the hard 0/1 mask, the
   backward the soft sigmoid(z) (a dropped expert still runs, weighted 0, so the loss sees what
   putting it back would do);
4. the loss is the KL from the full model (teacher-forced, answer positions only, the same
   teacher cache the evo fitness reads) on its `kl_top_k` most likely tokens, renormalised;
   every search sample weighs the same;
5. Adam on theta after removing the gradient's component that would change the expected kept
   count sum sigmoid(theta) (it is the budget's normal; without this every logit rises together,
   the sigmoids saturate and the gradient vanishes), then a scalar shift puts the expected kept
   count back on the budget (RCO's projected Adam and retraction).

The temperature falls geometrically from `temperature` to `temperature_end`. The plan is the
projection of theta itself (no noise). Training only changes routing weights, never the routing
itself, which is what `drop --reroute none` serves; `--reroute next` (the default) gives a removed
expert's picks to the next survivor, so the final plan and the uniform one are both scored
exactly (the method's own virtual form, as the evo search scores candidates) and search.json
reports both.

Memory: one training step of the model (the activations of one search batch kept for the
backward; the weights are frozen and get no gradient) plus the teacher cache; the logits are a
few kilobytes. Logits are initialised from the criterion's ranking (first pruned: lowest), so the
criterion is the prior and the data decides. Per-expert forms (mixed plans): one logit column
per form and a projection that assigns forms under the parameter budget, search/gradient_mixed.py.
Both are relaxations of one training loop (search/training.py: the loss, the temperature
schedule, Adam, the projection and retraction order); this module's is `KeepLogits`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from moeprune.allocate.basic import uniform_allocation
from moeprune.allocate.fitness import check_fitness
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.allocate.projection import project_budget
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import Criterion, LayerScores
from moeprune.criteria.super_experts import protected_order
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.document import SearchDocument
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import SEARCHES, Search, Searched, SearchJob
from moeprune.search.training import rounded, timings, train_logits, training_settings
from moeprune.surgery.registry import COUNTS

_INIT_SPREAD = 2.0  # logit range the criterion's ranking spans at the start
_RETRACTION_STEPS = 60  # bisection steps of the scalar shift (deterministic, ~1e-18 of the bracket)


@dataclass(frozen=True)
class _Layout:
    """Where each MoE layer's experts sit in the flat logit vector, and which may be dropped."""

    starts: list[int]
    sizes: list[int]
    free: torch.Tensor  # bool [N]: trainable (not protected, not in a fixed layer)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        return [values[s : s + n] for s, n in zip(self.starts, self.sizes)]


def _layout(moe: MoEModel, limits: LayerLimits) -> _Layout:
    sizes = list(limits.num_experts)
    starts = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
    free = torch.ones(sum(sizes), dtype=torch.bool)
    for start, size, layer, fixed in zip(starts, sizes, limits.layers, limits.fixed):
        if fixed:
            free[start : start + size] = False
        for e in moe.protected.get(layer, ()):
            free[start + int(e)] = False
    return _Layout(starts, sizes, free)


def _initial_logits(orders: Sequence[Sequence[int]], layout: _Layout, kept: float) -> torch.Tensor:
    """The criterion's ranking as logits: the first pruned lowest, spread over `_INIT_SPREAD`,
    shifted so that the expected kept count of the free experts is `kept`."""
    theta = torch.zeros(sum(layout.sizes), dtype=torch.float64)
    for start, size, order in zip(layout.starts, layout.sizes, orders):
        for rank, e in enumerate(order):
            theta[start + int(e)] = _INIT_SPREAD * (rank / max(1, size - 1) - 0.5)
    return _retract(theta, layout.free, kept)


def _retract(theta: torch.Tensor, free: torch.Tensor, kept: float) -> torch.Tensor:
    """theta + c on the free entries, with c such that sum sigmoid(theta + c) = kept (bisection)."""
    values = theta[free]
    lo, hi = -60.0, 60.0
    for _ in range(_RETRACTION_STEPS):
        mid = 0.5 * (lo + hi)
        if float(torch.sigmoid(values + mid).sum()) > kept:
            hi = mid
        else:
            lo = mid
    out = theta.clone()
    out[free] = values + 0.5 * (lo + hi)
    return out


def _logistic(shape: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return torch.log(u) - torch.log1p(-u)


@contextmanager
def _weighted_experts(moe: MoEModel, limits: LayerLimits, masks: dict[int, torch.Tensor]) -> Iterator[None]:
    """Every MoE layer's experts called with routing weights times `masks[layer][expert]` (the
    dict is read at each call, so one installation serves every step). Extra experts past the
    weighted ones (LongCat's zero experts) keep their weights."""
    handles = []

    def hook(layer_index: int, num_experts: int):
        def pre(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
            mask = masks.get(layer_index)
            if mask is None:
                return None
            given, named = list(args), dict(kwargs)
            positional = len(given) >= 3
            index = given[1] if len(given) > 1 else named["top_k_index"]
            weights = given[2] if positional else named["top_k_weights"]
            full = torch.cat([mask, mask.new_ones(max(0, int(index.max()) + 1 - num_experts))])
            scaled = weights * full.to(weights.device, weights.dtype)[index]
            if positional:
                given[2] = scaled
            else:
                named["top_k_weights"] = scaled
            return tuple(given), named

        return pre

    try:
        for layer, fixed in zip(moe.layers, limits.fixed):
            if fixed:
                continue
            if layer.spec.weight_on_input or getattr(layer.experts, "moeprune_packed", False):
                raise MoePruneError(
                    f"the gradient allocation weights each expert's output, which decoder layer "
                    f"{layer.index} ({moe.model_type}) computes differently; use --allocation evo",
                    options=("allocation",),
                )
            handles.append(
                layer.experts.register_forward_pre_hook(
                    hook(layer.index, layer.num_experts), with_kwargs=True
                )
            )
        yield
    finally:
        for handle in handles:
            handle.remove()


def _project_step(theta: torch.Tensor, free: torch.Tensor) -> None:
    """Remove from theta.grad its component along the budget's normal d sum sigmoid / d theta."""
    assert theta.grad is not None
    with torch.no_grad():
        grad = theta.grad
        grad[~free] = 0.0
        p = torch.sigmoid(theta.detach())
        normal = torch.where(free, p * (1 - p), torch.zeros_like(p))
        grad -= (grad @ normal) / (normal @ normal + 1e-30) * normal


def _dropped_order(order: Sequence[int], dropped: Sequence[int]) -> list[int]:
    """`order` with the dropped experts moved first (in their own order): a count of len(dropped)
    then removes exactly them, group by group (plan_removals takes each group's earliest)."""
    gone = set(dropped)
    return [e for e in order if e in gone] + [e for e in order if e not in gone]


class KeepLogits:
    """The relaxation of drop counts (search/training.py `Relaxation`): one keep logit per routed
    expert; logistic noise (the two-way Gumbel-softmax of keep against drop); the hard mask drops
    the budget's lowest, the backward sees sigmoid(z) (module docstring, steps 1-3 and 5)."""

    label = "gradient allocation"

    def __init__(self, moe: MoEModel, limits: LayerLimits, layout: _Layout, budget: int) -> None:
        self.limits, self.layout, self.budget, self.protected = limits, layout, budget, moe.protected
        self.kept = float(layout.free.sum()) - budget  # the expected kept count of the free experts
        self.masks: dict[int, torch.Tensor] = {}

    @contextmanager
    def installed(self, moe: MoEModel) -> Iterator[None]:
        try:
            with _weighted_experts(moe, self.limits, self.masks):
                yield
        finally:
            self.masks.clear()

    def dropped(self, z: torch.Tensor) -> list[list[int]]:
        """The experts each MoE layer drops under scores `z` (the budget's lowest, every limit kept)."""
        return project_budget(
            [p.numpy() for p in self.layout.split(z)], self.limits, self.budget, self.protected
        )

    def sample(self, theta: torch.Tensor, generator: torch.Generator, tau: float) -> dict[str, Any]:
        layout = self.layout
        noise = _logistic(theta.numel(), generator)
        hard = torch.ones_like(theta)
        for start, gone in zip(layout.starts, self.dropped((theta.detach().double() + noise) / tau)):
            hard[[start + e for e in gone]] = 0.0
        soft = torch.sigmoid((theta + noise.float()) / tau)
        mask = torch.where(layout.free, hard + soft - soft.detach(), hard)
        for layer, part in zip(self.limits.layers, layout.split(mask)):
            self.masks[layer] = part
        return {}

    def project_gradient(self, theta: torch.Tensor) -> None:
        _project_step(theta, self.layout.free)

    def retract(self, theta: torch.Tensor) -> torch.Tensor:
        return _retract(theta, self.layout.free, self.kept)


def run_gradient_search(
    moe: MoEModel,
    search_data: CalibrationData,
    orders: Sequence[Sequence[int]],
    budget: int,
    *,
    config: SearchConfig,
    runtime: SearchRuntime | None = None,
    expert_multiple: int = 1,
) -> tuple[list[list[int]], dict[str, Any]]:
    """The experts each MoE layer drops (exactly ``budget`` in all, every limit kept) and the
    search document (search.json). ``orders``: the criterion's pruning order per MoE layer, super
    experts last; it initialises the logits and breaks ties. Bad input (an unknown fitness, a budget
    no allocation meets, a family whose experts are not weighted per pick) fails before the
    teacher pass."""
    runtime = runtime or SearchRuntime()
    fitness = check_fitness(config.fitness)
    config.validate()
    limits = layer_limits(moe, expert_multiple)
    uniform = uniform_allocation(  # raises InfeasibleBudgetError with the reason
        budget, limits.num_experts, limits.top_k, multiple_of=limits.multiples, max_removed=limits.caps
    )
    layout = _layout(moe, limits)
    with _weighted_experts(moe, limits, {}):  # refuses a family it cannot weight, before any pass
        pass
    start = time.perf_counter()
    evaluator = CandidateEvaluator(
        moe, search_data, orders, fitness=fitness, seed=config.seed, runtime=replace(runtime, fast=False)
    )
    relaxation = KeepLogits(moe, limits, layout, budget)
    theta = _initial_logits(orders, layout, relaxation.kept).float().requires_grad_(True)
    history, train_seconds = train_logits(moe, relaxation, theta, evaluator, config, runtime.progress)
    final = theta.detach().double()
    dropped = relaxation.dropped(final)
    counts = [len(d) for d in dropped]
    eval_start = time.perf_counter()
    uniform_value = evaluator.evaluate(uniform)  # the criterion's uniform plan, for reference
    evaluator.orders = [_dropped_order(o, d) for o, d in zip(evaluator.orders, dropped)]
    evaluator.prefix_cache.clear()  # plain mode caches nothing; cleared so a new order cannot reuse
    value = evaluator.evaluate(counts)
    sign = evaluator.sign
    document = SearchDocument(
        head={"allocation_method": "gradient"},
        fitness=fitness,
        higher_is_better=sign > 0,
        config=training_settings(config),
        found={
            "budget": budget,
            "layers": limits.layers,
            "num_experts": limits.num_experts,
            "top_k": limits.top_k,
            "caps": limits.caps,
            "multiples": limits.multiples,
            "allocation": counts,
            "dropped": {str(layer): d for layer, d in zip(limits.layers, dropped)},
        },
        fitness_value=sign * value,
        references={"uniform": {"allocation": list(uniform), "fitness_value": sign * uniform_value}},
        evaluations=2,
        steps=config.steps,
        stopped={"reason": "steps"},
        history={
            "training": history,
            "keep_logits": {
                str(layer): rounded(part) for layer, part in zip(limits.layers, layout.split(final))
            },
        },
        **evaluator.data_summary(),
        timings_s=timings(evaluator, train_seconds, eval_start, start),
    ).to_json()
    evaluator.release()
    if not math.isfinite(value):
        raise MoePruneError("the gradient allocation's plan scored a non-finite fitness")
    return dropped, document


def gradient_allocation(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    search_set: CalibrationData,
    *,
    config: PruneConfig,
    runtime: SearchRuntime | None = None,
) -> tuple[list[int], list[LayerScores], dict[str, Any]]:
    """The gradient allocation for `config` (its sparsity, expert_multiple and search settings):
    experts removed per MoE layer, the scores with each layer's order putting the chosen experts
    first (so the method's plan removes exactly them; the score values stay the criterion's), and
    search.json. ``criterion`` ranked ``scores``; its order is the logits' starting point."""
    budget = layer_limits(moe).budget(config.sparsity_value())  # over the prunable layers only
    ordered = protected_order(scores, moe.protected)  # super experts last
    dropped, document = run_gradient_search(
        moe,
        search_set,
        [s.order for s in ordered],
        budget,
        config=config.search,
        runtime=runtime,
        expert_multiple=config.expert_multiple,
    )
    document["criterion"] = criterion.name
    chosen = [
        LayerScores(layer=s.layer, scores=s.scores, order=_dropped_order(s.order, d))
        for s, d in zip(ordered, dropped)
    ]
    return [len(d) for d in dropped], chosen, document


def _gradient_counts(job: SearchJob) -> Searched:
    removed, scores, doc = gradient_allocation(job.moe, job.criterion, job.scores, job.data, **job.kwargs)
    return Searched(removed, doc, scores)  # its order chooses the experts: the plan takes it


SEARCHES.add(Search("gradient counts", "per-expert keep logits", "gradient", COUNTS, _gradient_counts))
