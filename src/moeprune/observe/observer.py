"""One pass over calibration data collecting every per-expert statistic (fp64).

Each expert runs only on the tokens routed to it (moeprune's routed computation replaces the
model's for the pass), padding rows are excluded with the attention mask, and the routing
weights are the ones the router returned, never recomputed.
"""

from __future__ import annotations

import time

import torch

from moeprune.data.loading import CalibrationData
from moeprune.models import MoELayer, MoEModel
from moeprune.models.routed import RoutedOptions, RoutedRows, override_routed
from moeprune.observe.stats import F64, PROBE_TOKENS, ExpertStats, LayerStats
from moeprune.runtime.device import input_device
from moeprune.runtime.finite import NonFiniteError, all_finite, kind, locate_nonfinite
from moeprune.runtime.progress import progress_bar


class _Accumulator:
    """Folds one layer call's routed rows into LayerStats with segment sums by expert id.

    Per-token terms are computed in fp32 or fp64 and every sum is accumulated in fp64; moments
    merge per batch with Chan's exact parallel update; the per-expert output maximum is a max.
    """

    def __init__(self, moe: MoEModel, neurons: bool):
        self.neurons = neurons
        self.stats = {
            m.index: LayerStats.zeros(m.index, m.num_experts, m.hidden_size, m.intermediate_size, neurons)
            for m in moe.layers
        }
        self.valid: torch.Tensor | None = None  # [B*L] bool, set per batch
        self._valid_on: dict[torch.device, torch.Tensor] = {}  # copies for layers on other GPUs

    def set_valid(self, valid: torch.Tensor) -> None:
        self.valid, self._valid_on = valid, {valid.device: valid}

    def __call__(self, layer: MoELayer, routed: RoutedRows) -> None:
        device = routed.rows.device
        if device not in self._valid_on:  # accelerate split the model: this layer is on another GPU
            assert self.valid is not None, "set_valid() comes before every batch"
            self._valid_on[device] = self.valid.to(device)
        keep = self._valid_on[device][routed.rows]
        ids, x, y, g, m = routed.experts, routed.inputs, routed.outputs, routed.weights, routed.intermediate
        if not bool(keep.all()):
            ids, x, y, g = ids[keep], x[keep], y[keep], g[keep]
            m = m[keep] if m is not None else None
        if ids.numel() == 0:
            return
        stats = self.stats[layer.index]
        if stats.count.device != ids.device:
            stats.to(ids.device)
        n_experts = stats.num_experts
        y32, x32 = y.float(), x.float()
        norms, in_norms = y32.norm(dim=1), x32.norm(dim=1)
        _check_finite(layer.index, ids, in_norms, g, norms)
        cos = (x32 * y32).sum(1) / (in_norms * norms).clamp_min(1e-30)
        g64, norms64 = g.to(F64), norms.to(F64)

        def segment(values: torch.Tensor) -> torch.Tensor:
            shape = (n_experts, *values.shape[1:])
            return torch.zeros(shape, dtype=F64, device=values.device).index_add_(0, ids, values.to(F64))

        # Per-batch moments from fp64 sums, merged into the running mean/M2 with Chan's update.
        y64 = y32.to(F64)
        counts = segment(torch.ones_like(g64))
        seen = counts > 0
        batch_mean = segment(y64) / counts.clamp_min(1).unsqueeze(1)
        batch_m2 = (segment(y64.square()) - counts.unsqueeze(1) * batch_mean.square()).clamp_min(0)
        n_a = stats.count
        n_ab = n_a + counts
        delta = batch_mean - stats.mean
        ratio = torch.where(seen, counts / n_ab.clamp_min(1), torch.zeros_like(counts))
        stats.mean += delta * ratio.unsqueeze(1)
        stats.m2 += torch.where(
            seen.unsqueeze(1), batch_m2 + delta.square() * (n_a * ratio).unsqueeze(1), 0.0
        )
        stats.count += counts
        stats.weight_sum += segment(g64)
        stats.norm_sum += segment(norms64)
        stats.weighted_norm_sum += segment(g64 * norms64)
        if stats.gated_sum is not None:
            stats.gated_sum += segment(y64 * g64.unsqueeze(1))
        if stats.probe is not None and stats.probe.shape[0] < PROBE_TOKENS:
            _probe(stats, routed.rows[keep] if not bool(keep.all()) else routed.rows, x)
        stats.tenp_sum += segment(g64 * norms64 * (1 - cos.to(F64)))
        # Super-expert statistic: the largest |output element| per expert, a max (no rounding:
        # fp32 values are exact in fp64), so batches, ranks and domains merge exactly.
        absmax = torch.zeros(n_experts, dtype=F64, device=ids.device).scatter_reduce_(
            0, ids, y32.abs().amax(1).to(F64), reduce="amax"
        )
        if stats.output_absmax is None:
            stats.output_absmax = absmax
        else:
            torch.maximum(stats.output_absmax, absmax, out=stats.output_absmax)
        if self.neurons and m is not None:
            self._neurons(layer, stats, ids, y32, m.float(), norms)

    @staticmethod
    def _neurons(layer: MoELayer, stats: LayerStats, ids, y, m, norms) -> None:
        """Neuron k's share y_k = W_down[:, k] m_k: projection <y_k, y>/(||y||+eps) and ||y_k||.

        Per-token terms in fp32 (an fp64 matmul here would cost as much as the expert itself),
        summed into fp64 accumulators; rows arrive grouped by expert.
        """
        proj_sum, l2_sum = stats.neuron_proj_sum, stats.neuron_l2_sum
        assert proj_sum is not None and l2_sum is not None, "LayerStats.zeros(neurons=True) allocates both"
        bounds = torch.bincount(ids, minlength=stats.num_experts).tolist()
        start = 0
        for expert, n in enumerate(bounds):
            if n == 0:
                continue
            sl = slice(start, start + n)
            start += n
            down = layer.down_matrix(expert).float()  # [d, I]
            projection = m[sl] * (y[sl] @ down) / (norms[sl].unsqueeze(1) + 1e-8)
            proj_sum[expert] += projection.sum(0, dtype=F64)
            l2_sum[expert] += (m[sl].abs() * down.norm(dim=0)).sum(0, dtype=F64)


def _probe(stats: LayerStats, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Keep the first distinct token rows' block inputs (rows arrive grouped by expert: a token
    routed to k experts appears k times), in token order, up to PROBE_TOKENS per layer."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    first = torch.full((unique.numel(),), rows.numel(), dtype=torch.long, device=rows.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows.numel(), device=rows.device), reduce="amin")
    stats.add_probe(x[first].float())


def _check_finite(layer: int, ids: torch.Tensor, in_norms, weights, out_norms) -> None:
    """NaN/inf in what one MoE layer received or produced stops the pass, naming the layer and, in
    order of the computation, the first culprit: the hidden states entering the block, the router's
    weights, the experts' outputs. Three reductions over per-token vectors the statistics need anyway.
    """
    if not all_finite(in_norms):
        raise NonFiniteError(
            f"the hidden states entering the MoE block of decoder layer {layer} hold {kind(in_norms)} "
            "(the attention of that layer or an earlier layer went non-finite)"
        )
    if not all_finite(weights):
        bad = sorted(set(ids[~torch.isfinite(weights)].tolist()))
        raise NonFiniteError(
            f"the router of decoder layer {layer} returned {kind(weights)} routing weights (experts {bad})"
        )
    if not all_finite(out_norms):
        bad = sorted(set(ids[~torch.isfinite(out_norms)].tolist()))
        raise NonFiniteError(f"experts {bad} of decoder layer {layer} produced {kind(out_norms)} outputs")


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
    data.check_vocabulary(model)
    device = input_device(model)
    acc = _Accumulator(moe, neurons)
    options = RoutedOptions(on_layer=acc, need_intermediate=neurons)
    tokens = 0
    start = time.perf_counter()
    batches = data.batches(batch_size, pad_token_id)
    total = (len(data.samples) + batch_size - 1) // batch_size
    batch = None
    try:
        with torch.no_grad(), override_routed(moe, options):
            for batch in progress_bar(batches, total=total, desc="observe", unit="batch", enabled=progress):
                mask = batch.attention_mask.to(device)
                acc.set_valid(mask.reshape(-1).bool())
                tokens += int(mask.sum())
                model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
    except NonFiniteError as exc:
        raise _located(exc, model, batch) from None
    layers = [acc.stats[m.index].to("cpu") for m in moe.layers]
    note = f"observed {tokens} tokens in {time.perf_counter() - start:.1f}s"
    return ExpertStats.from_pass(layers, tokens, data, domain, note)


def _located(error: NonFiniteError, model, batch) -> NonFiniteError:
    """The same error, naming the first module whose output went non-finite (one more forward of
    the failing batch, with the model's own computation and hooks on every module)."""
    return error.located(locate_nonfinite(model, batch.input_ids, batch.attention_mask)) if batch else error
