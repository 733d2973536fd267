"""The training of the gradient allocation's form logits (search/gradient_mixed.py): each
expert's forms and their costs, the straight-through forward through the forms, the projection of
the logits onto the budget, and the training loop."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeprune.allocate.limits import LayerLimits
from moeprune.config import SearchConfig
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.lowrank import novice_output
from moeprune.runtime.progress import progress_bar
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.form_projection import (
    DROPPED,
    FORMS,
    NARROWED,
    NOVICE,
    WHOLE,
    FormPlan,
    project_forms,
)
from moeprune.search.gradient import _batch_loss, _temperature
from moeprune.search.registry import UNIFORM
from moeprune.surgery.mixed import (
    LayerCosts,
)
from moeprune.surgery.neurons import neuron_importance
from moeprune.surgery.novice import layer_stats

_INIT_SPREAD = 2.0  # the start plan's form leads the others by this
_RETRACTION_STEPS = 60


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
                else {p: s.need("mean")[p].to(device=ref.device, dtype=ref.dtype) for p in range(c.experts)}
            )

    def scores(self, theta: torch.Tensor, layout: Sequence[int]) -> list[torch.Tensor]:
        return [t.masked_fill(~a, -math.inf) for t, a in zip(_split(theta, layout), self.allowed)]


def _placed(layer: MoELayer) -> dict[str, Any]:
    """The device and dtype of the layer's expert weights (the neuron masks are built on the CPU)."""
    ref = layer.down_matrix(0)
    return {"device": ref.device, "dtype": ref.dtype}


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


@dataclass(frozen=True)
class _Problem:
    """What the training projects onto: the layers' costs and sizes, the kept target, the forms
    each expert may take, and the per-layer limits."""

    costs: Sequence[LayerCosts]
    sizes: list[int]
    target: float
    allowed: torch.Tensor  # bool [experts, 4]
    forms: _Forms
    limits: LayerLimits


def _start(moe: MoEModel, problem: _Problem, seed_plan: Any) -> tuple[torch.Tensor, int]:
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


def _train(
    moe: MoEModel,
    problem: _Problem,
    theta: torch.Tensor,
    width: int,
    evaluator: CandidateEvaluator,
    config: SearchConfig,
    progress: bool,
) -> tuple[list[dict[str, Any]], float]:
    """Train `theta` in place (straight-through Gumbel samples projected on the budget, the model
    frozen); returns each step's record for search.json and the seconds it took."""
    began = time.perf_counter()
    costs, sizes, target, allowed, forms = (
        problem.costs,
        problem.sizes,
        problem.target,
        problem.allowed,
        problem.forms,
    )
    groups, layers = problem.limits.groups, problem.limits.layers
    cost = _cost_table(costs, sizes, width)
    optimizer = torch.optim.Adam([theta], lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)
    frozen = [p.requires_grad for p in moe.model.parameters()]
    moe.model.requires_grad_(False)
    state: dict[str, Any] = {"weights": {}, "masks": {}, "novices": {}}
    state["novices"] = {m.index: nov for m, nov in zip(moe.layers, forms.novices)}
    history: list[dict[str, Any]] = []
    bar = progress_bar(total=config.steps, desc="gradient allocation (mixed)", unit="step", enabled=progress)
    try:
        with _mixed_experts(moe, problem.limits, state), torch.enable_grad():
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
    return history, time.perf_counter() - began


def _rounded(part: torch.Tensor) -> list[list[float]]:
    return [[round(float(v), 6) for v in row] for row in part]


def _timings(evaluator: CandidateEvaluator, train_seconds: float, eval_start: float, start: float) -> dict:
    now = time.perf_counter()
    return {
        "teacher_pass": round(evaluator.teacher_seconds, 3),
        "training": round(train_seconds, 3),
        "evaluation": round(now - eval_start, 3),
        "total": round(now - start, 3),
    }


def _seeds_document(seeds: dict, values: dict, sign: float, first: str) -> dict[str, Any]:
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
