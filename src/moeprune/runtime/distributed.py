"""Data-parallel calibration under ``torchrun`` and the device / dtype / device-map choice.

Under torchrun every rank holds the whole model and observes a disjoint share of the calibration
batches: rank r takes batches r, r+W, r+2W, ... (the same batches one process would form). The
fp64 statistics of every rank are then gathered and merged in rank order with
``LayerStats.merge`` (Chan's exact update), so counts are identical to one process and every
other statistic differs only by fp64 summation order. Every rank ends with the same result.
gloo on CPU, NCCL when CUDA is available.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeprune.checkpoint import resolve_dtype
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.observer import observe
from moeprune.observe.sequential import observe_sequential
from moeprune.observe.stats import MOMENT_FIELDS, NEURON_FIELDS, SUM_FIELDS, ExpertStats, LayerStats

_MOMENT_FIELDS = SUM_FIELDS + MOMENT_FIELDS
_NEURON_FIELDS = NEURON_FIELDS


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed() -> tuple[int, int]:
    """Join torchrun's process group (NCCL with GPUs, gloo on CPU); (0, 1) when not launched by torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not dist.is_available() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_rank() != 0:  # every rank reads the same data: rank 0 alone warns about it
        logging.getLogger("moeprune").setLevel(logging.ERROR)
    return dist.get_rank(), dist.get_world_size()


def placement(
    device: str | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype, str | None]:
    """(input device, dtype, device_map) for loading and observing.

    ``device``: None picks the GPU (this rank's under torchrun) when there is one, else the CPU;
    ``"auto"`` spreads the model over every visible GPU with accelerate's ``device_map="auto"``
    (needs ``pip install accelerate``); inputs then go to the first GPU. A model that does not fit
    the GPUs is refused after loading (see ``io.check_not_offloaded``): ``--sequential`` is the
    CPU-offload path.
    ``dtype``: None gives bf16 on GPUs and fp32 on the CPU.
    """
    device_map = None
    if device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MoePruneError(
            "device 'auto' splits one model over every GPU, but under torchrun each rank holds its own copy: "
            "leave the device unset (each rank then takes its own GPU, cuda:LOCAL_RANK)", options=("device",)
        )
    if device == "auto":
        if importlib.util.find_spec("accelerate") is None:
            raise MoePruneError("device 'auto' uses accelerate's device_map='auto': pip install 'moeprune[gpu]'",
                                options=("device",))
        if torch.cuda.is_available():
            device_map, device = "auto", "cuda:0"
        else:
            logging.getLogger(__name__).warning(
                "device 'auto': no GPU is visible, so the model stays on the CPU"
            )
            device = "cpu"
    elif device == "cuda" or (device is None and torch.cuda.is_available()):
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # under torchrun: this rank's GPU
    elif device is None:
        device = "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise MoePruneError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto", options=("device",)) from None
    if resolved.type == "cuda" and not device_map:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= visible:
            raise MoePruneError(
                f"device {device}: this machine has {visible} visible CUDA GPU(s)"
                + (" (or this torch build has no CUDA)" if visible == 0 else "")
                + "; use the cpu, or a GPU index below the count",
                options=("device",),
            )
    if dtype is None:
        chosen = torch.bfloat16 if resolved.type == "cuda" else torch.float32
    else:
        chosen = resolve_dtype(dtype)
    return resolved, chosen, device_map


def shard_data(data: CalibrationData, batch_size: int, rank: int, world: int) -> CalibrationData:
    """Rank `rank`'s batches (r, r+W, ...) as data whose own batching yields exactly those batches."""
    starts = range(0, len(data.samples), batch_size)
    samples = [
        s
        for b, start in enumerate(starts)
        if b % world == rank
        for s in data.samples[start : start + batch_size]
    ]
    return dataclasses.replace(data, samples=samples)


def observe_distributed(
    moe: MoEModel, data: CalibrationData, *, batch_size: int = 8, **observe_kwargs
) -> ExpertStats:
    """`observe` split over torchrun ranks and reduced exactly; plain `observe` when not distributed."""
    return _data_parallel(observe, moe, data, batch_size, observe_kwargs)


def observe_sequential_distributed(
    checkpoint_path: str | Path, data: CalibrationData, *, batch_size: int = 8, **observe_kwargs
) -> ExpertStats:
    """`observe_sequential` (one layer in memory per rank) split over torchrun ranks, reduced exactly."""
    return _data_parallel(observe_sequential, checkpoint_path, data, batch_size, observe_kwargs)


def _data_parallel(
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
    return ExpertStats(
        layers=layers,
        tokens=tokens,
        samples=len(data.samples),
        truncated=data.truncated,
        data_fingerprint=data.fingerprint,
        domain=local.domain,
    )


def _fields(stats: LayerStats) -> list[str]:
    return list(_MOMENT_FIELDS) + [f for f in _NEURON_FIELDS if getattr(stats, f) is not None]


def _flatten(stats: ExpertStats) -> torch.Tensor:
    parts = [getattr(s, f).reshape(-1).to(torch.float64) for s in stats.layers for f in _fields(s)]
    return torch.cat([*parts, torch.tensor([float(stats.tokens)], dtype=torch.float64)])


def _unflatten(flat: torch.Tensor, template: ExpertStats) -> tuple[list[LayerStats], int]:
    """Inverse of `_flatten`, shaped like `template` (every rank observes the same model)."""
    layers, offset = [], 0
    for s in template.layers:
        values = {}
        for f in _fields(s):
            ref = getattr(s, f)
            values[f] = flat[offset : offset + ref.numel()].reshape(ref.shape).clone()
            offset += ref.numel()
        layers.append(dataclasses.replace(s, **values))
    return layers, int(flat[offset])


# ---------------------------------------------------------------------------------------------
# Small collectives for the data-parallel search (moeprune.search) and rank-0-only writing


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the joined torchrun group; (0, 1) when not distributed."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_gather_objects(obj: object) -> list:
    """Every rank's picklable ``obj`` in rank order, on every rank (gloo and NCCL); ``[obj]`` alone."""
    if not is_distributed():
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def split_map(fn: Callable[[Any], Any], items: Sequence[Any], what: str) -> list:
    """``[fn(x) for x in items]`` with the items dealt round-robin over the torchrun ranks (rank r
    takes r, r+W, ...) and the results all-gathered in the given order, the same on every rank.

    A rank whose ``fn`` raises still joins the gather, so every rank raises (naming the rank and
    ``what`` it was doing) instead of waiting forever. Without torchrun it is a plain loop.
    """
    rank, world = rank_and_world()
    if world == 1:
        return [fn(x) for x in items]
    failure: BaseException | None = None
    try:
        payload: tuple[str, Any] = ("ok", [fn(x) for x in items[rank::world]])
    except Exception as exc:  # reported to every rank below, then re-raised here
        failure, payload = exc, ("error", f"{type(exc).__name__}: {exc}")
    gathered = all_gather_objects(payload)
    if failure is not None:
        raise failure
    results: list = [None] * len(items)
    for other, (status, detail) in enumerate(gathered):
        if status == "error":
            raise MoePruneError(f"rank {other} failed while {what}: {detail}")
        results[other::world] = detail
    return results


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if is_distributed():
        dist.barrier()
