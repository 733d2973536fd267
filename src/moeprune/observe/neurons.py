"""Per-neuron importances (ENP/TENP's projection and L2 terms) of one layer call, in fp64 sums.

Neuron k's share of expert output y = W_down m is y_k = W_down[:, k] m_k; its importance sums
<y_k, y> / (||y|| + 1e-8) (projection) and ||y_k||_2 = |m_k| ||W_down[:, k]|| (L2) over the routed
tokens (docs/formulas.md). Per-token terms are fp32 (an fp64 product would cost as much as the
expert itself), summed into fp64 accumulators.

Why a module of its own: the products y @ W_down of every expert run as one grouped product
(`torch._grouped_mm`, models/grouped.py) where torch has one, instead of a loop over experts.
On a CPU the padding rows are dropped first and each expert's fp64 sum is taken over its rows as
before, so the sums keep their bits; on a GPU padding rows go to a bin past the experts and one
`index_add_` sums every expert without reading anything back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeprune.models import MoELayer
from moeprune.models.grouped import aligned, down_matrices, expert_offsets, grouped_mm_works
from moeprune.observe.stats import F64, LayerStats


@dataclass
class NeuronRows:
    """One layer call's routed rows, sorted by expert id, as the observer has them in fp32."""

    experts: torch.Tensor  # [N] expert id (padding rows included, sorted)
    bins: torch.Tensor  # [N] expert id, or num_experts for a padding row
    keep: torch.Tensor  # [N] bool, not padding
    outputs: torch.Tensor  # [N, d] y
    intermediate: torch.Tensor  # [N, I] m
    norms: torch.Tensor  # [N] ||y||


def neuron_sums(layer: MoELayer, stats: LayerStats, rows: NeuronRows) -> None:
    """Add this call's projection and L2 terms to `stats.neuron_proj_sum` / `neuron_l2_sum`."""
    proj_sum, l2_sum = stats.neuron_proj_sum, stats.neuron_l2_sum
    assert proj_sum is not None and l2_sum is not None, "LayerStats.zeros(neurons=True) allocates both"
    experts, y, m, norms = rows.experts, rows.outputs, rows.intermediate, rows.norms
    on_cpu = ordered_sums(y.device)
    if on_cpu:  # dropping padding costs nothing here, and per-expert sums keep their order
        keep = rows.keep
        experts, y, m, norms = experts[keep], y[keep], m[keep], norms[keep]
    down = down_matrices(layer).float()  # [E, d, I]
    projected = _products(y, down, experts)  # [N, I]: y @ W_down of each row's expert
    projection = m * projected / (norms.unsqueeze(1) + 1e-8)
    l2 = m.abs() * down.norm(dim=1)[experts]
    if on_cpu:
        start = 0
        for expert, n in enumerate(torch.bincount(experts, minlength=stats.num_experts).tolist()):
            if n:
                proj_sum[expert] += projection[start : start + n].sum(0, dtype=F64)
                l2_sum[expert] += l2[start : start + n].sum(0, dtype=F64)
                start += n
        return
    bins, n_experts = rows.bins, stats.num_experts
    for total, terms in ((proj_sum, projection), (l2_sum, l2)):
        sums = torch.zeros(n_experts + 1, terms.shape[1], dtype=F64, device=terms.device)
        total += sums.index_add_(0, bins, terms.to(F64))[:n_experts]


def ordered_sums(device: torch.device) -> bool:
    """Whether each expert's sum is taken over its own rows in order (a CPU, where reading the
    counts costs nothing), rather than by one index_add_ without a host read (a GPU)."""
    return device.type == "cpu"


def _products(y: torch.Tensor, down: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """y_t @ W_down[expert_t] for rows sorted by expert: one grouped product, or a loop over the
    experts where torch has none for this device (one host read of the counts)."""
    if y.shape[0] and aligned(y) and aligned(down) and grouped_mm_works(y.device, y.dtype):
        return torch._grouped_mm(y, down, offs=expert_offsets(experts, down.shape[0]))
    out = torch.empty(y.shape[0], down.shape[2], dtype=y.dtype, device=y.device)
    start = 0
    for expert, n in enumerate(torch.bincount(experts, minlength=down.shape[0]).tolist()):
        if n:
            torch.mm(y[start : start + n], down[expert], out=out[start : start + n])
            start += n
    return out
