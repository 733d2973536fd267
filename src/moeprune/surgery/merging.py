"""The arithmetic of expert merging (REAM-style), one MoE layer at a time; surgery/merge.py is
the method around it (plans, virtual and physical forms).

Everything is read from the observer's statistics and the layer's current weights:

- distance d(e, c) = 1 - ((cos(ybar_e, ybar_c) + 1) / 2 + s(e, c)) / 2 (formulas.md), ybar the
  mean gated output (LayerStats.gated_sum; a cosine ignores the 1/n) and s the cosine of the two
  experts' router-probability columns (softmax of the router's own logits) over the probe tokens;
- neurons of a member aligned to its centroid's by the Hungarian algorithm on the distance of
  their activation profiles (every expert run on the same probe tokens) plus the distance of
  their weight rows (gate row, up row, down column, each profile normalised to unit length);
- the group averaged with weights proportional to REAP saliency, mean over routed tokens of
  g ||E(h)|| (one gate factor: `weighted_norm_sum / count`).

Why the probe: neurons of two experts, or router columns, can only be compared on the same
tokens, and running every expert on every calibration token would cost E / k times the pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from scipy.optimize import linear_sum_assignment

from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer
from moeprune.models.packed import expert_tensor_names, is_packed, slice_neurons
from moeprune.observe.stats import F64, LayerStats

Tensors = dict[str, torch.Tensor]  # one expert's native tensors by name (gate_up_proj, down_proj, ...)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length (a zero row stays zero: cosine 0 with everything)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def cosine_matrix(rows: torch.Tensor) -> torch.Tensor:
    """[n, n] cosine of every pair of rows (fp64)."""
    unit = _unit_rows(rows.to(F64))
    return unit @ unit.T


def expert_distance(gated: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[E, E] d(e, c) from mean gated outputs (rows of `gated`, [E, d]) and router-probability
    columns (`columns` [P, E], one column per expert): 0 for identical experts, 1 at most."""
    out = (cosine_matrix(gated) + 1) / 2
    route = cosine_matrix(columns.T)
    return 1 - (out + route) / 2


def router_probabilities(layer: MoELayer, probe: torch.Tensor) -> torch.Tensor:
    """[P, E] softmax of the router's logits on the probe tokens (its own forward; only the
    weighted experts' columns: extra experts' logits take part in the softmax)."""
    count, extra = layer.num_experts, layer.spec.extra_experts
    weight = next(layer.router.parameters())
    rows = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        try:
            out = layer.router(rows)
        except TypeError:  # a router that takes more than the hidden states (a bias the block passes):
            path, axis = layer.spec.router_tensors[0]  # its logits are the linear map of its weight
            matrix = layer.router.get_parameter(path)
            out = rows @ (matrix if axis == 1 else matrix.T)
    found = [
        t
        for t in (out if isinstance(out, tuple) else (out,))
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dim() == 2
        and t.shape == (probe.shape[0], t.shape[1])
        and t.shape[1] in (count, count + extra)
    ]
    if not found:
        raise MoePruneError(
            f"decoder layer {layer.index}: the router of {type(layer.block).__name__} returned no logits over "
            "its experts, so the merge method cannot compare their routing"
        )
    # transformers' routers return (logits, weights, indices); Llama-4's (scores, logits): the last
    return torch.softmax(found[-1].to(F64), dim=-1)[:, :count].cpu()


def reap_saliency(stats: LayerStats) -> torch.Tensor:
    """[E] REAP: mean over routed tokens of g_i(t) ||E_i(h_t)|| (0 for an expert never routed)."""
    count = stats.count.to(F64)
    return torch.where(count > 0, stats.weighted_norm_sum.to(F64) / count.clamp_min(1), 0.0)


def group_weights(saliency: torch.Tensor, group: Sequence[int]) -> torch.Tensor:
    """Weights proportional to saliency over `group` (equal when none of them was ever routed)."""
    s = saliency[list(group)].to(F64)
    total = float(s.sum())
    return s / total if total > 0 else torch.full_like(s, 1 / len(group))


def assign_groups(
    distance: torch.Tensor, kept: Sequence[int], removed: Sequence[int], singletons: Sequence[int] = ()
) -> tuple[dict[int, list[int]], list[int]]:
    """Each removed expert joins its nearest kept expert ({centroid: [members]}, ties: the lower
    position); `singletons` (super experts) take no members. Removed experts with no centroid to
    join (every kept one a singleton) come back second: they are dropped unmerged."""
    centroids = [c for c in kept if c not in set(singletons)]
    groups: dict[int, list[int]] = {}
    if not centroids:
        return groups, sorted(removed)
    for e in sorted(removed):
        near = distance[e, centroids]
        c = centroids[int(torch.argmin(near))]  # first minimum: the lowest position among ties
        groups.setdefault(c, []).append(e)
    return dict(sorted(groups.items())), []


def align_neurons(cost: torch.Tensor) -> torch.Tensor:
    """The member neuron that goes to each centroid slot: perm[k] minimises sum_k cost[k, perm[k]]."""
    rows, cols = linear_sum_assignment(cost.detach().cpu().numpy())
    perm = torch.empty(cost.shape[0], dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return perm


def expert_tensors(layer: MoELayer, position: int) -> Tensors:
    """One expert's native tensors (views), by name."""
    return {name: getattr(layer.experts, name)[position] for name in expert_tensor_names(layer)}


def permuted(layer: MoELayer, tensors: Mapping[str, torch.Tensor], perm: torch.Tensor) -> Tensors:
    """An expert's tensors with its neurons reordered so that slot k holds neuron perm[k]: the
    expert computes exactly the same function (gate/up rows and down columns move together)."""
    width = layer.intermediate_size
    return {n: slice_neurons(layer.spec.layout, n, t, perm, width) for n, t in tensors.items()}


def weighted_average(parts: Sequence[Mapping[str, torch.Tensor]], weights: torch.Tensor) -> Tensors:
    """sum_j w_j theta_j per tensor, computed in fp32 and returned in each tensor's dtype."""
    out: Tensors = {}
    for name, ref in parts[0].items():
        total = sum(float(w) * p[name].float() for w, p in zip(weights, parts))
        out[name] = cast(torch.Tensor, total).to(ref.dtype)
    return out


class LayerMerger:
    """What one layer's merges need, computed once and kept: the distance matrix, saliency, each
    expert's neuron features and each (centroid, member) alignment. A search asks for many
    removal sets; only the weighted sums depend on which experts meet."""

    def __init__(self, layer: MoELayer, stats: LayerStats):
        if is_packed(layer):
            raise MoePruneError(
                f"decoder layer {layer.index} is packed (novices or per-expert widths): its experts cannot be "
                "merged; merge the original checkpoint"
            )
        if stats.gated_sum is None or stats.probe is None or stats.probe.shape[0] == 0:
            raise MoePruneError(
                f"layer {layer.index}: the statistics have no mean gated outputs or probe tokens (saved by "
                "an older moeprune); observe the model again for the merge method"
            )
        self.layer, self.stats = layer, stats
        ref = cast(torch.Tensor, layer.experts.down_proj)
        self.probe = stats.probe.to(device=ref.device, dtype=ref.dtype)
        self.distance = expert_distance(stats.gated_sum, router_probabilities(layer, self.probe))
        self.saliency = reap_saliency(stats)
        self._features: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def features(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's neurons as ([I, P] activation profiles, [I, 3d] weight rows), unit rows."""
        if e not in self._features:
            with torch.no_grad():
                _, m = self.layer.expert_forward(e, self.probe, return_intermediate=True)
            gate, up, down = self.layer.expert_weights(e)
            rows = [up, down.T] if gate is None else [gate, up, down.T]
            weights = torch.cat([r.detach().float() for r in rows], dim=1)
            self._features[e] = (_unit_rows(m.detach().float().T), _unit_rows(weights))
        return self._features[e]

    def permutation(self, centroid: int, member: int) -> torch.Tensor:
        if (centroid, member) not in self._perms:
            (act_c, w_c), (act_m, w_m) = self.features(centroid), self.features(member)
            cost = torch.cdist(act_c, act_m) + torch.cdist(w_c, w_m)
            self._perms[(centroid, member)] = align_neurons(cost)
        return self._perms[(centroid, member)]

    def groups(
        self, removed: Sequence[int], singletons: Sequence[int] = ()
    ) -> tuple[dict[int, list[int]], list[int]]:
        removed_set = set(removed)
        kept = [p for p in range(self.layer.num_experts) if p not in removed_set]
        return assign_groups(self.distance, kept, removed, singletons)

    def merged(self, centroid: int, members: Sequence[int]) -> Tensors:
        """The centroid's new tensors: itself and its aligned members, saliency-weighted."""
        parts = [expert_tensors(self.layer, centroid)]
        for e in members:
            parts.append(permuted(self.layer, expert_tensors(self.layer, e), self.permutation(centroid, e)))
        return weighted_average(parts, group_weights(self.saliency, [centroid, *members]))
