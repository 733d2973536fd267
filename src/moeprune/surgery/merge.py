"""The merge method (REAM-style): the criterion's removed experts are merged into the kept ones
instead of being thrown away.

The kept experts are centroids; each removed expert joins its nearest centroid, its neurons are
aligned to the centroid's and the group is averaged with saliency weights (the arithmetic is
surgery/merging.py). The merged-away experts' router rows are removed, the centroid keeps its
own: the result has exactly the drop method's shape (a stock checkpoint where a drop is one),
only some kept experts' weights differ. Super experts (moe.protected) stay singletons: never
merged away (the criterion's order keeps them) and never given members.

- Virtual form (search candidates, evaluation): the router is sliced as for a drop
  (models/reshape.py `mask_experts`) and the centroids' rows of the expert tensors are swapped
  for their merged values for the duration of a `with`, then restored. Only the centroids'
  rows are copied, never the model. A search's merged rows are computed per layer on demand and
  kept for the last few removal sets of each layer (`CACHE_SETS`), so candidates that share a
  layer's removals reuse them; alignments are kept per (centroid, member) pair.
- Physical form: the merged rows are written, then the members are dropped.

The plan records the groups (`extra.merge_groups`: layer -> centroid id -> member ids); the
alignment and weights are recomputed from the statistics when the plan is applied.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch

from moeprune.allocate.basic import plan_removals
from moeprune.config import CALIBRATION
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.reshape import mask_experts
from moeprune.observe.kinds import Statistic
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.merging import LayerMerger, Tensors
from moeprune.surgery.novice import StatsInput, layer_stats, require_stats
from moeprune.surgery.registry import EXPERTS, METHODS, Method, PlanRequest

CACHE_SETS = 4  # merged rows kept per layer for this many removal sets (a search's recent candidates)
Merged = Mapping[int, Mapping[int, Tensors]]  # decoder layer -> expert (position or id) -> tensors
WHY = "the merge method (distances, alignment and saliency come from calibration data)"


def singletons(moe: MoEModel, layer: MoELayer) -> list[int]:
    """Positions of the layer's protected (super) experts: they take no members."""
    where = {orig: pos for pos, orig in enumerate(layer.expert_ids)}
    return [where[e] for e in moe.protected.get(layer.index, ()) if e in where]


@contextmanager
def swapped_weights(moe: MoEModel, merged: Merged) -> Iterator[None]:
    """The given expert rows ({layer: {position: tensors}}) hold the merged values inside the
    `with` and their own outside it (the originals of those rows only are kept)."""
    saved: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for index, experts in merged.items():
                module = moe.layer(index).experts
                for position, tensors in experts.items():
                    for name, value in tensors.items():
                        param = getattr(module, name)
                        saved.append((param, position, param.data[position].clone()))
                        param.data[position].copy_(value)
        yield
    finally:
        with torch.no_grad():
            for param, position, original in reversed(saved):
                param.data[position].copy_(original)


def write_weights(moe: MoEModel, merged: Merged) -> None:
    """Physically give the rows ({layer: {position: tensors}}) their merged values."""
    with torch.no_grad():
        for index, experts in merged.items():
            module = moe.layer(index).experts
            for position, tensors in experts.items():
                for name, value in tensors.items():
                    getattr(module, name).data[position].copy_(value)


def merge_context(moe: MoEModel, stats: StatsInput | None):
    """The virtual form for a search: `context(removed)` ({layer: positions}) drops the removed
    experts from routing and gives their centroids the merged weights, for a `with`."""
    domains = require_stats(stats, f"merge candidates: {WHY}")
    mergers: dict[int, LayerMerger] = {}
    cache: dict[int, OrderedDict[tuple[int, ...], dict[int, Tensors]]] = {}

    def layer_merged(index: int, removed: Sequence[int]) -> dict[int, Tensors]:
        key = tuple(sorted(removed))
        recent = cache.setdefault(index, OrderedDict())
        if key in recent:
            recent.move_to_end(key)
            return recent[key]
        layer = moe.layer(index)
        if index not in mergers:
            mergers[index] = LayerMerger(layer, layer_stats(domains, layer))
        merger = mergers[index]
        groups, _ = merger.groups(key, singletons(moe, layer))
        recent[key] = {c: merger.merged(c, members) for c, members in groups.items()}
        if len(recent) > CACHE_SETS:
            recent.popitem(last=False)
        return recent[key]

    @contextmanager
    def context(removed: dict[int, list[int]]) -> Iterator[None]:
        merged = {i: layer_merged(i, p) for i, p in removed.items() if p}
        with ExitStack() as stack:
            stack.enter_context(swapped_weights(moe, merged))
            stack.enter_context(mask_experts(moe, removed))
            yield

    return context


def resolve_merge(moe: MoEModel, plan: Plan, stats: StatsInput | None) -> dict[int, dict[int, Tensors]]:
    """The merged tensors a plan's groups imply for `moe` (not yet modified): {layer: {centroid
    original id: tensors}}. Every member must be dropped by the plan and every centroid kept."""
    groups = plan.extra.get("merge_groups") or {}
    if not groups:
        return {}
    domains = require_stats(stats, f"merge surgery: {WHY}")
    out: dict[int, dict[int, Tensors]] = {}
    for key, by_centroid in groups.items():
        index = int(key)
        lp, layer = plan.layer(index), moe.layer(index)
        where = {orig: pos for pos, orig in enumerate(layer.expert_ids)}
        members = [int(e) for ms in by_centroid.values() for e in ms]
        centroids = [int(c) for c in by_centroid]
        if not set(members) <= set(lp.dropped) or not set(centroids) <= set(lp.kept):
            raise MoePruneError(
                f"layer {index}: the plan's merge groups {by_centroid} must merge dropped experts into kept ones"
            )
        if not set(members + centroids) <= set(where):
            raise MoePruneError(
                f"layer {index}: the plan's merge groups name experts this model no longer has"
            )
        merger = LayerMerger(layer, layer_stats(domains, layer))
        out[index] = {
            int(c): merger.merged(where[int(c)], [where[int(e)] for e in ms]) for c, ms in by_centroid.items()
        }
    return out


def record_groups(moe: MoEModel, plan: Plan, stats: StatsInput | None) -> Plan:
    """Put each layer's groups into the plan (`extra.merge_groups`, original ids), and the removed
    experts no centroid could take (every kept one a super expert) in `extra.merge_unmerged`."""
    domains = require_stats(stats, WHY)
    groups: dict[str, dict[str, list[int]]] = {}
    unmerged: dict[str, list[int]] = {}
    for lp in plan.layers:
        if not lp.dropped:
            continue
        layer = moe.layer(lp.layer)
        ids = layer.expert_ids
        where = {orig: pos for pos, orig in enumerate(ids)}
        merger = LayerMerger(layer, layer_stats(domains, layer))
        by_centroid, alone = merger.groups([where[e] for e in lp.dropped], singletons(moe, layer))
        groups[str(lp.layer)] = {str(ids[c]): [ids[e] for e in ms] for c, ms in by_centroid.items()}
        if alone:
            unmerged[str(lp.layer)] = [ids[e] for e in alone]
    plan.extra["merge_groups"] = groups
    if unmerged:
        plan.extra["merge_unmerged"] = unmerged
    return plan


@METHODS.register(
    Method(
        "merge",
        "removed experts merged into their nearest kept expert (REAM-style: aligned neurons, "
        "saliency-weighted average); router rows of the merged-away experts removed",
        EXPERTS,
        ("uniform", "global", "evo"),
        needs=(CALIBRATION,),
        merges=True,
        candidate_context=lambda moe, stats: merge_context(moe, stats),
        statistics=frozenset({Statistic.GATED_OUTPUTS, Statistic.PROBE}),  # surgery/merging.py
    )
)
def plan_merge(request: PlanRequest) -> Plan:
    """The drop method's removals (the criterion's first r_l per layer), merged instead of dropped."""
    moe, criterion, removed = request.moe, request.criterion, request.removals()
    require_stats(request.domains, WHY)
    layers = moe.layers
    positions = plan_removals([s.order for s in request.scores], removed, [m.n_group for m in layers])
    plan = Plan.from_removals(
        ModelShape.of(moe),
        removals=[[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)],
        criterion=criterion.name,
        allocation=request.allocation,
        method="merge",
        sparsity=request.sparsity,
        data_fingerprint=request.data_fingerprint,
    )
    plan.extra["budget"] = sum(removed)
    return record_groups(moe, plan, request.domains)
