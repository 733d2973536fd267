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
per form and a projection that assigns forms under the parameter budget, search/gradient_mixed.py
(it shares this module's loss and temperature schedule).
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
from moeprune.runtime.progress import progress_bar
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import SEARCHES, Search, Searched, SearchJob
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


def _top_k_kl(teacher: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row KL(p_k || q_k) on the teacher's k most likely tokens, both renormalised over them
    (0 when the candidate equals the teacher; unlike RCO's, whose q is not renormalised)."""
    if 0 < k < teacher.shape[-1]:
        top, index = teacher.topk(k, dim=-1)
        logp = top - torch.logsumexp(top, dim=-1, keepdim=True)
        logq = torch.log_softmax(logits.float().gather(-1, index), dim=-1)
    else:
        logp, logq = teacher, torch.log_softmax(logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def _batch_loss(evaluator: CandidateEvaluator, index: int, k: int) -> torch.Tensor:
    """Mean over the batch's samples of each sample's mean top-k KL (every sample weighs the same)."""
    logits, rows_of_samples = evaluator.answer_logits(index)
    losses = []
    for row in rows_of_samples:
        if row.stop == row.start:
            continue
        sample = evaluator.teacher.get(row.sample_id)
        assert sample is not None, "a scored row has a teacher sample"
        rows = logits[row.start : row.stop]
        losses.append(_top_k_kl(sample.log_probs.to(rows.device), rows, k).mean())
    return torch.stack(losses).mean()


def _project_step(theta: torch.Tensor, free: torch.Tensor) -> None:
    """Remove from theta.grad its component along the budget's normal d sum sigmoid / d theta."""
    assert theta.grad is not None
    with torch.no_grad():
        grad = theta.grad
        grad[~free] = 0.0
        p = torch.sigmoid(theta.detach())
        normal = torch.where(free, p * (1 - p), torch.zeros_like(p))
        grad -= (grad @ normal) / (normal @ normal + 1e-30) * normal


def _temperature(config: SearchConfig, step: int) -> float:
    if config.steps == 1:
        return config.temperature
    frac = step / (config.steps - 1)
    return config.temperature * (config.temperature_end / config.temperature) ** frac


def training_settings(config: SearchConfig) -> dict[str, Any]:
    """search.json's `config` of a gradient allocation (drop or mixed): what its training read."""
    return {
        k: getattr(config, k)
        for k in ("steps", "learning_rate", "temperature", "temperature_end", "kl_top_k", "seed")
    }


def _dropped_order(order: Sequence[int], dropped: Sequence[int]) -> list[int]:
    """`order` with the dropped experts moved first (in their own order): a count of len(dropped)
    then removes exactly them, group by group (plan_removals takes each group's earliest)."""
    gone = set(dropped)
    return [e for e in order if e in gone] + [e for e in order if e not in gone]


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
    kept = float(layout.free.sum()) - budget
    theta = _initial_logits(orders, layout, kept).float().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)
    frozen = [p.requires_grad for p in moe.model.parameters()]
    moe.model.requires_grad_(False)
    masks: dict[int, torch.Tensor] = {}
    history: list[dict[str, float]] = []
    train_start = time.perf_counter()
    bar = progress_bar(total=config.steps, desc="gradient allocation", unit="step", enabled=runtime.progress)
    try:
        with _weighted_experts(moe, limits, masks), torch.enable_grad():
            for step in range(config.steps):
                tau = _temperature(config, step)
                noise = _logistic(theta.numel(), generator)
                noisy = (theta.detach().double() + noise) / tau
                hard = torch.ones_like(theta)
                dropped = project_budget(
                    [z.numpy() for z in layout.split(noisy)], limits, budget, moe.protected
                )
                for start_, gone in zip(layout.starts, dropped):
                    hard[[start_ + e for e in gone]] = 0.0
                soft = torch.sigmoid((theta + noise.float()) / tau)
                mask = torch.where(layout.free, hard + soft - soft.detach(), hard)
                for layer, part in zip(limits.layers, layout.split(mask)):
                    masks[layer] = part
                optimizer.zero_grad()
                loss = _batch_loss(evaluator, step % evaluator.batch_count, config.kl_top_k)
                loss.backward()
                _project_step(theta, layout.free)
                optimizer.step()
                with torch.no_grad():
                    theta.copy_(_retract(theta.detach().double(), layout.free, kept).float())
                history.append({"step": step, "loss": float(loss.detach()), "temperature": tau})
                bar.set_postfix_str(f"top-{config.kl_top_k} KL {history[-1]['loss']:.4g}")
                bar.update(1)
    finally:
        bar.close()
        masks.clear()
        for p, flag in zip(moe.model.parameters(), frozen):
            p.requires_grad_(flag)
    train_seconds = time.perf_counter() - train_start
    final = theta.detach().double()
    dropped = project_budget([z.numpy() for z in layout.split(final)], limits, budget, moe.protected)
    counts = [len(d) for d in dropped]
    eval_start = time.perf_counter()
    uniform_value = evaluator.evaluate(uniform)  # the criterion's uniform plan, for reference
    evaluator.orders = [_dropped_order(o, d) for o, d in zip(evaluator.orders, dropped)]
    evaluator.prefix_cache.clear()  # plain mode caches nothing; cleared so a new order cannot reuse
    value = evaluator.evaluate(counts)
    seconds = time.perf_counter() - start
    sign = evaluator.sign
    document = {
        "allocation_method": "gradient",
        "fitness": fitness,
        "higher_is_better": sign > 0,
        "config": training_settings(config),
        "budget": budget,
        "layers": limits.layers,
        "num_experts": limits.num_experts,
        "top_k": limits.top_k,
        "caps": limits.caps,
        "multiples": limits.multiples,
        "allocation": counts,
        "dropped": {str(layer): d for layer, d in zip(limits.layers, dropped)},
        "fitness_value": sign * value,
        "uniform": {"allocation": list(uniform), "fitness_value": sign * uniform_value},
        "evaluations": 2,
        "steps": config.steps,
        "stopped": {"reason": "steps"},
        "training": history,
        "keep_logits": {
            str(layer): [round(float(v), 6) for v in part]
            for layer, part in zip(limits.layers, layout.split(final))
        },
        **evaluator.data_summary(),
        "timings_s": {
            "teacher_pass": round(evaluator.teacher_seconds, 3),
            "training": round(train_seconds, 3),
            "evaluation": round(time.perf_counter() - eval_start, 3),
            "total": round(seconds, 3),
        },
    }
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
