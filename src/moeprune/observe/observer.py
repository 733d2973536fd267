"""One pass over calibration data collecting the per-expert statistics asked for (fp64).

Each expert runs only on the tokens routed to it (moeprune's routed computation replaces the
model's for the pass), padding rows are excluded with the attention mask, and the routing
weights are the ones the router returned, never recomputed. What is recorded besides the
per-token scalars (count, sum g, sum ||E||, sum g ||E||) is what the caller asks for
(observe/kinds.py): a REAP drop run pays for the guard's maxima and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from moeprune.data.loading import CalibrationData
from moeprune.models import MoELayer, MoEModel
from moeprune.models.routed import RoutedOptions, RoutedRows, override_routed
from moeprune.observe.kinds import DEFAULT, Statistic
from moeprune.observe.neurons import NeuronRows, neuron_sums
from moeprune.observe.stats import F64, PROBE_TOKENS, ExpertStats, LayerStats
from moeprune.runtime.device import input_device
from moeprune.runtime.finite import NonFiniteError, all_finite, kind, locate_nonfinite
from moeprune.runtime.progress import progress_bar


@dataclass
class _Screen:
    """One layer call's finiteness, decided on the device (`finite`) and explained on the host
    only when it failed (the per-row tensors the statistics computed anyway)."""

    layer: int
    finite: torch.Tensor  # 0-d bool
    keep: torch.Tensor  # [N] bool, not padding
    experts: torch.Tensor  # [N]
    in_norms: torch.Tensor
    weights: torch.Tensor
    out_norms: torch.Tensor


class _Accumulator:
    """Folds one layer call's routed rows into LayerStats with segment sums by expert id.

    Per-token terms are computed in fp32 or fp64 and every sum is accumulated in fp64; moments
    merge per batch with Chan's exact parallel update; the per-expert output maximum is a max.
    Only the kinds asked for are computed; each sum keeps its bits whichever others are asked
    (a column of one index_add_ is summed in the same order as alone).
    Nothing here reads a GPU value back to the host: padding rows are summed into one bin past the
    experts and dropped (a boolean selection would wait for the GPU), and finiteness is checked once
    per batch (`check_finite`), naming the same layer and culprit as a check per layer would.
    """

    def __init__(self, moe: MoEModel, statistics: Collection[Statistic] = DEFAULT):
        self.asked = frozenset(statistics)
        self.neurons = Statistic.NEURONS in self.asked
        self.stats = {
            m.index: LayerStats.zeros(
                m.index, m.num_experts, m.hidden_size, m.intermediate_size, statistics=self.asked
            )
            for m in moe.layers
        }
        self.valid: torch.Tensor | None = None  # [B*L] bool, set per batch
        self._valid_on: dict[torch.device, torch.Tensor] = {}  # copies for layers on other GPUs
        self._screens: list[_Screen] = []  # layer calls since the last check_finite()

    def set_valid(self, valid: torch.Tensor) -> None:
        self.check_finite()  # a caller that forgot to check the previous batch still stops on it
        self.valid, self._valid_on = valid, {valid.device: valid}

    def check_finite(self) -> None:
        """Raise the error of the first layer call since the last check that received or produced
        NaN/inf (one host synchronisation; the explanation is computed only after a failure)."""
        screens, self._screens = self._screens, []
        if not screens:
            return
        device = screens[0].finite.device
        if bool(torch.stack([s.finite.to(device) for s in screens]).all()):
            return
        for s in screens:
            keep = s.keep
            _check_finite(s.layer, s.experts[keep], s.in_norms[keep], s.weights[keep], s.out_norms[keep])

    def __call__(self, layer: MoELayer, routed: RoutedRows) -> None:
        device = routed.rows.device
        if device not in self._valid_on:  # accelerate split the model: this layer is on another GPU
            assert self.valid is not None, "set_valid() comes before every batch"
            self._valid_on[device] = self.valid.to(device)
        if routed.rows.numel() == 0:
            return
        keep = self._valid_on[device][routed.rows]
        stats = self.stats[layer.index]
        if stats.count.device != device:
            stats.to(device)
        ids = torch.where(keep, routed.experts, stats.num_experts)  # padding: the bin past the experts
        x, y, g, m = routed.inputs, routed.outputs, routed.weights, routed.intermediate
        y32, x32 = y.float(), x.float()
        norms, in_norms = y32.norm(dim=1), x32.norm(dim=1)
        sums = self._sums(stats, ids, x32, y32, g, norms, in_norms)
        self._screens.append(
            _Screen(layer.index, torch.isfinite(sums[:, 1:]).all(), keep, routed.experts, in_norms, g, norms)
        )
        if stats.probe is not None and stats.probe.shape[0] < PROBE_TOKENS:  # the first batches only
            _probe(stats, routed.rows[keep], x[keep])
        if stats.output_absmax is not None:
            _maxima(stats, ids, y32)
        if self.neurons and m is not None:
            neuron_sums(layer, stats, NeuronRows(routed.experts, ids, keep, y32, m.float(), norms))

    def _sums(self, stats: LayerStats, ids, x32, y32, g, norms, in_norms) -> torch.Tensor:
        """Add this call's segment sums to `stats`; returns the per-token scalars' sums [E, k]
        (their last column, sum ||h||, is there only to screen finiteness: a sum is finite iff
        every term is).

        Every segment sum of the call goes into one fp64 buffer (one allocation, each column
        summed in the same order as alone): the per-token scalars, then, when asked for, sum y and
        sum y^2 (the moments) and sum g y (the merge's gated outputs)."""
        n_experts = stats.num_experts
        g64, norms64 = g.to(F64), norms.to(F64)
        gn = g64 * norms64
        columns = [torch.ones_like(g64), g64, norms64, gn]
        if stats.tenp_sum is not None:
            cos = (x32 * y32).sum(1) / (in_norms * norms).clamp_min(1e-30)
            columns.append(gn * (1 - cos.to(F64)))
        columns.append(in_norms.to(F64))
        k, d = len(columns), y32.shape[1]
        moments, gated = stats.mean is not None, stats.gated_sum is not None
        wide = (2 if moments else 0) + (1 if gated else 0)
        buffer = torch.zeros(n_experts + 1, k + wide * d, dtype=F64, device=ids.device)
        buffer[:, :k].index_add_(0, ids, torch.stack(columns, dim=1))
        if wide:
            y64, at = y32.to(F64), k
            if moments:
                buffer[:, at : at + d].index_add_(0, ids, y64)
                buffer[:, at + d : at + 2 * d].index_add_(0, ids, y64.square())
                at += 2 * d
            if gated:
                buffer[:, at:].index_add_(0, ids, y64 * g64.unsqueeze(1))
        sums = buffer[:n_experts]  # the spare bin (padding) dropped
        counts = sums[:, 0]
        if moments:
            _merge_moments(stats, counts, sums[:, k : k + d], sums[:, k + d : k + 2 * d])
        stats.count += counts
        stats.weight_sum += sums[:, 1]
        stats.norm_sum += sums[:, 2]
        stats.weighted_norm_sum += sums[:, 3]
        if stats.tenp_sum is not None:
            stats.tenp_sum += sums[:, 4]
        if stats.gated_sum is not None:
            stats.gated_sum += sums[:, k + (2 * d if moments else 0) :]
        return sums[:, :k]


def _merge_moments(
    stats: LayerStats, counts: torch.Tensor, sum_y: torch.Tensor, sum_sq: torch.Tensor
) -> None:
    """Per-batch moments from fp64 sums, merged into the running mean/M2 with Chan's update
    (before `stats.count` takes this batch's counts)."""
    mean, m2 = stats.need("mean"), stats.need("m2")
    seen = counts > 0
    batch_mean = sum_y / counts.clamp_min(1).unsqueeze(1)
    batch_m2 = (sum_sq - counts.unsqueeze(1) * batch_mean.square()).clamp_min(0)
    n_a = stats.count
    n_ab = n_a + counts
    delta = batch_mean - mean
    ratio = torch.where(seen, counts / n_ab.clamp_min(1), 0.0)
    mean += delta * ratio.unsqueeze(1)
    m2 += torch.where(seen.unsqueeze(1), batch_m2 + delta.square() * (n_a * ratio).unsqueeze(1), 0.0)


def _maxima(stats: LayerStats, ids: torch.Tensor, y32: torch.Tensor) -> None:
    """Super-expert statistic: the largest |output element| per expert, a max (no rounding:
    fp32 values are exact in fp64), so batches, ranks and domains merge exactly."""
    assert stats.output_absmax is not None, "asked for: LayerStats.zeros allocated it"
    n_experts = stats.num_experts
    absmax = torch.zeros(n_experts + 1, dtype=F64, device=ids.device).scatter_reduce_(
        0, ids, y32.abs().amax(1).to(F64), reduce="amax"
    )[:n_experts]
    torch.maximum(stats.output_absmax, absmax, out=stats.output_absmax)


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
    statistics: Collection[Statistic] = DEFAULT,
) -> ExpertStats:
    """Run the model once over `data` and return per-expert statistics of every MoE layer: the
    per-token sums always, and the kinds in `statistics` (observe/kinds.py; `neurons` adds
    Statistic.NEURONS). The default records every kind but the per-neuron sums."""
    model = moe.model
    data.check_vocabulary(model)
    device = input_device(model)
    acc = _Accumulator(moe, asked(statistics, neurons))
    options = RoutedOptions(on_layer=acc, need_intermediate=acc.neurons)
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
                tokens += int(batch.attention_mask.sum())  # counted on the host: no wait for the GPU
                model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
                acc.check_finite()
    except NonFiniteError as exc:
        raise _located(exc, model, batch) from None
    layers = [acc.stats[m.index].to("cpu") for m in moe.layers]
    note = f"observed {tokens} tokens in {time.perf_counter() - start:.1f}s"
    return ExpertStats.from_pass(layers, tokens, data, domain, note)


def asked(statistics: Collection[Statistic], neurons: bool) -> frozenset[Statistic]:
    """The kinds a pass records: `statistics`, plus the per-neuron sums when `neurons` says so."""
    return frozenset(statistics) | ({Statistic.NEURONS} if neurons else frozenset())


def _located(error: NonFiniteError, model, batch) -> NonFiniteError:
    """The same error, naming the first module whose output went non-finite (one more forward of
    the failing batch, with the model's own computation and hooks on every module)."""
    return error.located(locate_nonfinite(model, batch.input_ids, batch.attention_mask)) if batch else error
