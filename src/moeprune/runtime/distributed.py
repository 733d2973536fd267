"""torchrun: joining the process group, ranks, splitting work over them and gathering results.

Every rank holds the whole model; work is dealt round-robin (rank r takes items r, r+W, ...) and
gathered in rank order, so every rank ends with the same result as one process would. gloo on
CPU, NCCL when CUDA is available. Nothing here knows what the work is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moeprune.errors import MoePruneError
from moeprune.runtime.device import local_rank_gpu


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
        torch.cuda.set_device(local_rank_gpu())  # one rank per GPU, or one clear line
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_rank() != 0:  # every rank reads the same data: rank 0 alone warns about it
        logging.getLogger("moeprune").setLevel(logging.ERROR)
    return dist.get_rank(), dist.get_world_size()


def shard_data(data: Any, batch_size: int, rank: int, world: int) -> Any:
    """Rank `rank`'s batches (r, r+W, ...) as data whose own batching yields exactly those batches."""
    starts = range(0, len(data.samples), batch_size)
    samples = [
        s
        for b, start in enumerate(starts)
        if b % world == rank
        for s in data.samples[start : start + batch_size]
    ]
    return dataclasses.replace(data, samples=samples)


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
