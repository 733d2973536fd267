"""The relaxation of the gradient allocation's form logits (search/gradient_mixed.py), which the
one training loop (search/training.py) trains: each expert's forms and their costs, the
straight-through forward through the forms, the projection of the logits onto the budget."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeprune.allocate.limits import LayerLimits
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.lowrank import novice_output
from moeprune.search.form_projection import (
    DROPPED,
    FORMS,
    NARROWED,
    NOVICE,
    WHOLE,
    FormPlan,
    project_forms,
)
from moeprune.search.registry import UNIFORM
from moeprune.surgery.mixed import (
    LayerCosts,
)
from moeprune.surgery.neurons import neuron_importance
from moeprune.surgery.novice import layer_stats

_INIT_SPREAD = 2.0  # the start plan's form leads the others by this
_RETRACTION_STEPS = 60


class Forms:
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
                else {p: s.need("mean")[p].to(device=ref.device, dtype=ref.dtype) for p in range(c.experts)}
            )

    def scores(self, theta: torch.Tensor, layout: Sequence[int]) -> list[torch.Tensor]:
        return [t.masked_fill(~a, -math.inf) for t, a in zip(split(theta, layout), self.allowed)]


def _placed(layer: MoELayer) -> dict[str, Any]:
    """The device and dtype of the layer's expert weights (the neuron masks are built on the CPU)."""
    ref = layer.down_matrix(0)
    return {"device": ref.device, "dtype": ref.dtype}


def split(values: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
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


def _set_state(state: dict[str, Any], moe: MoEModel, forms: Forms, plan: FormPlan, mix: torch.Tensor) -> None:
    """What `_forward` reads for one step: each expert's form weights `mix` [N, 4] and its neuron
    mask (its filled width when narrowed, else the plan's mean width: what narrowing it would keep)."""
    sizes = [m.num_experts for m in moe.layers]
    for pos, (m, part) in enumerate(zip(moe.layers, split(mix, sizes))):
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


@dataclass(frozen=True)
class Problem:
    """What the training projects onto: the layers' costs and sizes, the kept target, the forms
    each expert may take, and the per-layer limits."""

    costs: Sequence[LayerCosts]
    sizes: list[int]
    target: float
    allowed: torch.Tensor  # bool [experts, 4]
    forms: Forms
    limits: LayerLimits


def start_logits(moe: MoEModel, problem: Problem, seed_plan: Any) -> tuple[torch.Tensor, int]:
    """Form logits that start at the best seed's plan (its form of each expert ahead by the spread,
    retracted onto the budget), and the narrowed width they are priced at."""
    sizes, costs = problem.sizes, problem.costs
    widths = [w for lp in seed_plan.layers for w in lp.neurons.values()]
    width = int(round(float(np.mean(widths)))) if widths else costs[0].width
    init = torch.zeros(sum(sizes), 4, dtype=torch.float64)
    for pos, (m, lp) in enumerate(zip(moe.layers, seed_plan.layers)):
        base = sum(sizes[:pos])
        where = {e: p for p, e in enumerate(m.expert_ids)}
        for e in lp.kept:
            form = NOVICE if e in lp.novice else NARROWED if e in lp.neurons else WHOLE
            init[base + where[e], form] = _INIT_SPREAD
        for e in lp.dropped:
            init[base + where[e], DROPPED] = _INIT_SPREAD
    theta = _retract(init, problem.allowed, _cost_table(costs, sizes, width), problem.target)
    return theta.float().requires_grad_(True), width


class FormLogits:
    """The relaxation of mixed plans (search/training.py `Relaxation`): one logit per expert and
    form; Gumbel noise; the hard plan projected on the parameter budget (`project_forms`), the
    backward sees softmax(z); the budget's direction prices a narrowed expert at the previous
    step's plan's width (search/gradient_mixed.py, steps 1-3 and 5)."""

    label = "gradient allocation (mixed)"

    def __init__(self, moe: MoEModel, problem: Problem, width: int) -> None:
        self.moe, self.problem, self.width = moe, problem, width
        self.cost = _cost_table(problem.costs, problem.sizes, width)
        self.state: dict[str, Any] = {"weights": {}, "masks": {}, "novices": {}}

    @contextmanager
    def installed(self, moe: MoEModel) -> Iterator[None]:
        self.state["novices"] = {m.index: nov for m, nov in zip(moe.layers, self.problem.forms.novices)}
        try:
            with _mixed_experts(moe, self.problem.limits, self.state):
                yield
        finally:
            self.state.clear()

    def sample(self, theta: torch.Tensor, generator: torch.Generator, tau: float) -> dict[str, Any]:
        problem, allowed = self.problem, self.problem.allowed
        gumbel = _gumbel((theta.shape[0], theta.shape[1]), generator)
        noisy_z = problem.forms.scores((theta.detach().double() + gumbel) / tau, problem.sizes)
        plan = project_forms(
            problem.costs,
            [t.numpy() for t in noisy_z],
            problem.target,
            problem.limits.layers,
            problem.limits.groups,
        )
        self.width = plan.width
        hard = torch.nn.functional.one_hot(torch.from_numpy(np.concatenate(plan.forms)), 4).float()
        soft = torch.softmax(((theta + gumbel.float()) / tau).masked_fill(~allowed, -math.inf), dim=1)
        free = allowed.sum(1, keepdim=True) > 1
        _set_state(
            self.state, self.moe, problem.forms, plan, torch.where(free, hard + soft - soft.detach(), hard)
        )
        totals = {f: sum(c[f] for c in plan.counts()) for f in FORMS}
        return {"routed_parameters_kept": _kept(problem.costs, plan), "forms": totals}

    def project_gradient(self, theta: torch.Tensor) -> None:
        _project_step(theta, self.problem.allowed, self.cost)

    def retract(self, theta: torch.Tensor) -> torch.Tensor:
        """Onto the budget priced at the width of the plan just sampled."""
        self.cost = _cost_table(self.problem.costs, self.problem.sizes, self.width)
        return _retract(theta, self.problem.allowed, self.cost, self.problem.target)


def seeds_document(seeds: dict, values: dict, sign: float, first: str) -> dict[str, Any]:
    """search.json's seeds (the recipes the training started from), its start and the uniform genes."""
    out: dict[str, Any] = {
        "seeds": {
            name: {"genes": [list(g) for g in genes], "fitness_value": sign * values[name]}
            for name, genes in seeds.items()
        },
        "start": first,
    }
    if UNIFORM in seeds:
        out[UNIFORM] = {"genes": [list(g) for g in seeds[UNIFORM]], "fitness_value": sign * values[UNIFORM]}
    return out
