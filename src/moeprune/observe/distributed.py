"""Calibration split over torchrun ranks and merged exactly.

Under torchrun every rank holds the whole model and observes a disjoint share of the calibration
batches: rank r takes batches r, r+W, r+2W, ... (the same batches one process would form). The
fp64 statistics of every rank are then gathered and merged in rank order with
`LayerStats.merge` (Chan's exact update), so counts are identical to one process and every
other statistic differs only by fp64 summation order. Every rank ends with the same result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.observe.observer import observe
from moeprune.observe.stats import (
    GATED_FIELDS,
    MAX_FIELDS,
    MOMENT_FIELDS,
    NEURON_FIELDS,
    SUM_FIELDS,
    ExpertStats,
    LayerStats,
)
from moeprune.runtime.distributed import is_distributed, shard_data

# every tensor field but the probe, gathered when the pass recorded it; merge() sums or maxes them
_GATHERED = SUM_FIELDS + MOMENT_FIELDS + NEURON_FIELDS + MAX_FIELDS + GATED_FIELDS


def observe_distributed(
    moe: MoEModel, data: CalibrationData, *, batch_size: int = 8, **observe_kwargs
) -> ExpertStats:
    """`observe` split over torchrun ranks and reduced exactly; plain `observe` when not distributed."""
    return data_parallel(observe, moe, data, batch_size, observe_kwargs)


def data_parallel(
    observer: Callable, target, data: CalibrationData, batch_size: int, kwargs: dict
) -> ExpertStats:
    if not is_distributed():
        return observer(target, data, batch_size=batch_size, **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        kwargs = {**kwargs, "progress": False}
    start = time.perf_counter()
    local = observer(target, shard_data(data, batch_size, rank, world), batch_size=batch_size, **kwargs)
    result = reduce_stats(local, data)
    result.notes.append(
        f"observed {result.tokens} tokens on {world} ranks in {time.perf_counter() - start:.1f}s"
    )
    return result


def reduce_stats(local: ExpertStats, data: CalibrationData) -> ExpertStats:
    """Every rank's statistics, merged in rank order: the same result on every rank.

    One all_gather of a flat fp64 vector per rank (all layers, all fields, and the token count).
    """
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flat = _flatten(local).to(device or "cpu")
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    ranks = [_unflatten(g.cpu(), local) for g in gathered]
    layers, tokens = ranks[0]
    for other_layers, other_tokens in ranks[1:]:
        for mine, theirs in zip(layers, other_layers, strict=True):
            mine.merge(theirs)
        tokens += other_tokens
    # the merge method's probe tokens are rows, not sums: every rank takes rank 0's
    probes = [[None if s.probe is None else s.probe.cpu() for s in local.layers]]
    dist.broadcast_object_list(probes, src=0)
    for layer, probe in zip(layers, probes[0], strict=True):
        layer.probe = probe
    return ExpertStats(
        layers=layers,
        tokens=tokens,
        samples=len(data.samples),
        truncated=data.truncated,
        data_fingerprint=data.fingerprint,
        domain=local.domain,
    )


def _fields(stats: LayerStats) -> list[str]:
    return [f for f in _GATHERED if getattr(stats, f) is not None]


def _flatten(stats: ExpertStats) -> torch.Tensor:
    parts = [getattr(s, f).reshape(-1).to(torch.float64) for s in stats.layers for f in _fields(s)]
    return torch.cat([*parts, torch.tensor([float(stats.tokens)], dtype=torch.float64)])


def _unflatten(flat: torch.Tensor, template: ExpertStats) -> tuple[list[LayerStats], int]:
    """Inverse of `_flatten`, shaped like `template` (every rank observes the same model)."""
    layers, offset = [], 0
    for s in template.layers:
        # only tensor fields, but named at run time: mypy checks `**values` against every field
        # (ints too), which only Any satisfies
        values: dict[str, Any] = {}
        for f in _fields(s):
            ref = getattr(s, f)
            values[f] = flat[offset : offset + ref.numel()].reshape(ref.shape).clone()
            offset += ref.numel()
        layers.append(dataclasses.replace(s, **values))
    return layers, int(flat[offset])
