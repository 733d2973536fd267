"""One pass over calibration data collecting every per-expert statistic (fp64).

Each expert runs only on the tokens routed to it (moeprune's routed computation replaces the
model's for the pass), padding rows are excluded with the attention mask, and the routing
weights are the ones the router returned, never recomputed.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from .data import CalibrationData
from .errors import MoePruneError
from .models import MoELayer, MoEModel
from .models.routed import RoutedOptions, override_routed
from .stats import F64, ExpertStats, LayerStats


class _Accumulator:
    """Receives each expert's outputs for one batch and folds them into LayerStats."""

    def __init__(self, moe: MoEModel, neurons: bool):
        self.neurons = neurons
        self.stats = {
            m.index: LayerStats.zeros(m.index, m.num_experts, m.hidden_size, m.intermediate_size, neurons)
            for m in moe.layers
        }
        self.valid: torch.Tensor | None = None  # [B*L] bool, set per batch

    def __call__(self, layer: MoELayer, expert: int, rows, x, y, m, g) -> None:
        keep = self.valid[rows]
        if not bool(keep.all()):
            x, y, g = x[keep], y[keep], g[keep]
            m = m[keep] if m is not None else None
        n = int(y.shape[0])
        if n == 0:
            return
        stats = self.stats[layer.index]
        y64, x64, g64 = y.to(F64), x.to(F64), g.to(F64)
        norms = y64.norm(dim=1)
        cos = (x64 * y64).sum(1) / (x64.norm(dim=1) * norms).clamp_min(1e-30)
        total_norm = norms.sum()
        if not torch.isfinite(total_norm):
            raise MoePruneError(
                f"non-finite expert output in decoder layer {layer.index} (expert {expert}); "
                "check the weights or use a wider dtype (--dtype fp32)"
            )
        batch_mean = y64.mean(0)
        stats.add_moments(expert, n, batch_mean, (y64 - batch_mean).square().sum(0))
        stats.count[expert] += n
        stats.weight_sum[expert] += g64.sum()
        stats.norm_sum[expert] += total_norm
        stats.weighted_norm_sum[expert] += (g64 * norms).sum()
        stats.tenp_sum[expert] += (g64 * norms * (1 - cos)).sum()
        if self.neurons and m is not None:
            self._neurons(layer, expert, stats, y64, m.to(F64), norms)

    @staticmethod
    def _neurons(layer: MoELayer, expert: int, stats: LayerStats, y64, m64, norms) -> None:
        """Neuron k's share y_k = W_down[:, k] m_k: projection <y_k, y>/(||y||+eps) and ||y_k||."""
        down = layer.down_matrix(expert).to(F64)  # [d, I]
        projection = m64 * (y64 @ down) / (norms.unsqueeze(1) + 1e-8)
        stats.neuron_proj_sum[expert] += projection.sum(0)
        stats.neuron_l2_sum[expert] += (m64.abs() * down.norm(dim=0)).sum(0)


def observe(
    moe: MoEModel,
    data: CalibrationData,
    *,
    batch_size: int = 8,
    neurons: bool = False,
    pad_token_id: int = 0,
    progress: bool = True,
    domain: str = "",
) -> ExpertStats:
    """Run the model once over `data` and return per-expert statistics of every MoE layer."""
    model = moe.model
    device = next(model.parameters()).device
    acc = _Accumulator(moe, neurons)
    options = RoutedOptions(on_expert=acc, need_intermediate=neurons)
    tokens = 0
    start = time.perf_counter()
    batches = data.batches(batch_size, pad_token_id)
    total = (len(data.samples) + batch_size - 1) // batch_size
    with torch.no_grad(), override_routed(moe, options):
        for batch in tqdm(batches, total=total, desc="observe", unit="batch", disable=not progress):
            mask = batch.attention_mask.to(device)
            acc.valid = mask.reshape(-1).bool()
            tokens += int(mask.sum())
            model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
    stats = ExpertStats(
        layers=[acc.stats[m.index] for m in moe.layers],
        tokens=tokens,
        samples=len(data.samples),
        truncated=data.truncated,
        data_fingerprint=data.fingerprint,
        domain=domain,
    )
    stats.notes.append(f"observed {tokens} tokens in {time.perf_counter() - start:.1f}s")
    return stats
