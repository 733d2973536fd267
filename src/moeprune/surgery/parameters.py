"""Routed-expert parameter accounting: TENP's E (total) and A (active per token), before and after.

Works on plain, dropped, novice and packed (per-expert width) models, and on a plan not yet
applied. An expert of K neurons holds per_neuron * K + per_expert parameters (gpt_oss's down
bias is the per-expert part); a novice holds its d-vector mu_i, a rank-R novice d + 2dR
(its constant and factors U, V). A is the expectation under
uniform routing: sum over layers of top_k times the mean routed expert's parameters.
"""

from __future__ import annotations

from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.packed import layer_cost, layer_hidden, layer_widths, novice_rank, router_count
from moeprune.plan import Plan
from moeprune.serve.moeprune_format import width_groups
from moeprune.surgery.lowrank import plan_rank


def novice_params(hidden: int, rank: int) -> int:
    """A novice's parameters: its constant, and two d x R factors when it has rank R."""
    return hidden * (1 + 2 * rank)


def expert_params(layer: MoELayer) -> list[int]:
    """Parameters of each routed expert, by router position (a novice counts its mu vector)."""
    cost, novice = layer_cost(layer), novice_params(layer_hidden(layer), novice_rank(layer))
    return [novice if w is None else cost.params(w) for w in layer_widths(layer)]


def describe_layers(moe: MoEModel) -> list[dict]:
    """Per MoE layer: routed experts (novices included), novices, top-k and expert widths."""
    out = []
    for m in moe.layers:
        widths = [w for w in layer_widths(m) if w is not None]
        out.append(
            {
                "layer": m.index,
                "experts": router_count(m),
                "novices": len(layer_widths(m)) - len(widths),
                "top_k": m.top_k,
                "intermediate_size": max(widths, default=0),
                "min_intermediate_size": min(widths, default=0),
            }
        )
    return out


def _summary(per_layer: list[tuple[int, list[int]]]) -> dict[str, int]:
    """(top_k, expert params) per layer -> E and A."""
    routed = sum(sum(params) for _, params in per_layer)
    active = sum(k * sum(params) / len(params) for k, params in per_layer if params)
    return {"routed_experts": int(routed), "active_routed_experts": int(round(active))}


def routed_parameters(moe: MoEModel) -> dict[str, int]:
    """Total, routed-expert (E) and active-per-token (A) parameters of the model as it is now."""
    total = sum(p.numel() for p in moe.model.parameters())
    out = _summary([(m.top_k, expert_params(m)) for m in moe.layers])
    return {
        "total": int(total),
        **out,
        "active_per_token": int(total - out["routed_experts"] + out["active_routed_experts"]),
    }


def _plan_params(moe: MoEModel, plan: Plan) -> list[tuple[int, list[int]]]:
    """Per plan layer: (top_k, parameters of each kept router position) after applying the plan."""
    per_layer = []
    for lp in plan.layers:
        layer = moe.layer(lp.layer)
        cost, width = layer_cost(layer), layer.intermediate_size
        novice, params = set(lp.novice), novice_params(layer.hidden_size, plan_rank(plan))
        per_layer.append(
            (lp.top_k, [params if e in novice else cost.params(lp.neurons.get(e, width)) for e in lp.kept])
        )
    return per_layer


def plan_routed_parameters(moe: MoEModel, plan: Plan) -> dict[str, int]:
    """E and A that applying `plan` to this (not yet pruned) model would leave."""
    return _summary(_plan_params(moe, plan))


def plan_kept_rows(moe: MoEModel, plan: Plan) -> list[dict]:
    """`kept_rows` for a plan not yet applied to this (unpruned) model."""
    after = [
        {"layer": lp.layer, "experts": len(lp.kept) - len(lp.novice), "routed_params": sum(params)}
        for lp, (_, params) in zip(plan.layers, _plan_params(moe, plan))
    ]
    return kept_rows(kept_per_layer(moe), after)


def served_parameters(moe: MoEModel) -> dict[str, int]:
    """Parameters once each layer's experts are grouped by width and padded to their group's
    widest (what vLLM holds: its fused-MoE kernel takes one width per block, and the plugin builds
    one block per width group, `width_groups`; a zero neuron changes no output). Novices hold
    their d-vector, as in moeprune."""
    now = routed_parameters(moe)
    routed = 0
    for m in moe.layers:
        widths = layer_widths(m)
        cost = layer_cost(m)
        routed += sum(len(g.positions) * cost.params(g.width) for g in width_groups(widths))
        routed += sum(w is None for w in widths) * novice_params(layer_hidden(m), novice_rank(m))
    return {"total": now["total"] - now["routed_experts"] + routed, "routed_experts": routed}


def kept_per_layer(moe: MoEModel) -> list[dict]:
    """Per MoE layer: weight-holding experts and routed-expert parameters (novices count their vector)."""
    return [
        {
            "layer": m.index,
            "experts": sum(w is not None for w in layer_widths(m)),
            "routed_params": sum(expert_params(m)),
        }
        for m in moe.layers
    ]


def kept_rows(before: list[dict], after: list[dict]) -> list[dict]:
    """report.json's `kept_per_layer`: one row per MoE layer, before and after."""
    return [
        {
            "layer": b["layer"],
            "experts_before": b["experts"],
            "experts_after": a["experts"],
            "routed_params_before": b["routed_params"],
            "routed_params_after": a["routed_params"],
        }
        for b, a in zip(before, after)
    ]


def uniform_rows(before: list[dict], removed: list[int], hidden: list[int], novices: bool) -> list[dict]:
    """The rows a uniform allocation (experts removed per layer, full width) would give."""
    rows = []
    for b, r, d in zip(before, removed, hidden):
        per_expert = b["routed_params"] / b["experts"]
        params = (b["experts"] - r) * per_expert + (r * d if novices else 0)
        rows.append(
            {
                "layer": b["layer"],
                "experts_before": b["experts"],
                "experts_after": b["experts"] - r,
                "routed_params_before": b["routed_params"],
                "routed_params_after": int(round(params)),
            }
        )
    return rows
