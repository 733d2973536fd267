"""Weight-only criteria (aimer, magnitude, random) scored from the shards: each expert is read
once, its sums taken in worker threads; the model is never loaded."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from moeprune.criteria import (
    CRITERIA,
    LayerScores,
    compute_scores,
    get_criterion,
    pruning_order_of,
)
from moeprune.errors import MoePruneError
from moeprune.quant.fp8 import FP8_DTYPE, dequantize_blocks
from moeprune.shards.reader import SafetensorsExperts, checkpoint_layers

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_BLOCK = 1 << 20  # elements per op: few enough ops that worker threads seldom queue for the GIL
WEIGHT_ONLY = tuple(c.name for c in CRITERIA if not c.needs_data)


class _Sums:
    """(sum |w|, sum w^2, N) of one expert's weights, for one worker thread.

    Each block of up to 1M values is read once into a reused byte buffer (or taken from an
    in-memory tensor), cast into a reused fp32 buffer (fp64 stays fp64), then made absolute and
    summed, squared and summed, in place: no temporaries, and few enough ops per expert that
    worker threads seldom queue for the GIL. torch's sums are cascaded (relative error ~1e-7 in
    fp32, where a BLAS dot drifts to ~1e-6); the block sums are added in fp64.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.raw = bytearray()
        self.l1 = self.sq = 0.0
        self.n = 0

    def _add(self, chunk: torch.Tensor) -> None:
        wide = torch.float64 if chunk.dtype == torch.float64 else torch.float32
        if wide not in self.buffers:
            self.buffers[wide] = torch.empty(_BLOCK, dtype=wide)
        block = self.buffers[wide][: chunk.numel()]
        block.copy_(chunk)
        self.l1 += float(block.abs_().sum())
        self.sq += float(block.square_().sum())
        self.n += chunk.numel()

    def _totals(self) -> tuple[float, float, int]:
        totals = (self.l1, self.sq, self.n)
        self.l1 = self.sq = 0.0
        self.n = 0
        return totals

    def of_tensors(self, tensors: Sequence[torch.Tensor]) -> tuple[float, float, int]:
        for t in tensors:
            for chunk in t.reshape(-1).split(_BLOCK):
                self._add(chunk)
        return self._totals()

    def _buffer(self, step: int) -> memoryview:
        if len(self.raw) < step:
            self.raw = bytearray(step)
            self.raw_tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
        return memoryview(self.raw)

    def _add_fp8(self, source: SafetensorsExperts, key: str, start: int, scale: torch.Tensor) -> None:
        """One fp8 piece [out, in] starting at `start`, dequantized whole block-rows at a time
        (each with its row of the scale grid, read once): the sums of the dequantized weight."""
        assert source.layout.fp8 is not None
        block = source.layout.fp8.block
        rows, cols = source.stored_tensor(key).shape[-2:]
        per_read = max(1, _BLOCK // (block[0] * cols)) * block[0]  # whole block-rows, ~1M values
        view = self._buffer(per_read * cols)
        for row in range(0, rows, per_read):
            n = min(per_read, rows - row)
            source.read_into(key, start + row * cols, view[: n * cols])
            fp8 = self.raw_tensor[: n * cols].view(FP8_DTYPE).view(n, cols)
            grid = scale[row // block[0] : -(-(row + n) // block[0])]
            for chunk in dequantize_blocks(fp8, grid, block).reshape(-1).split(_BLOCK):
                self._add(chunk)

    def of_stored(self, source: SafetensorsExperts, expert: int) -> tuple[float, float, int]:
        """Every layout only rearranges the elements of gate_up_proj and down_proj into gate, up
        and down, so the sums run over the stored byte ranges as they are (no decoding; fp8
        pieces are dequantized block-row by block-row)."""
        for name in source.summed_names:
            for key, start, length in source.stored_ranges(name, expert):
                if key in source.layout.coded:  # mxfp4 / compressed-tensors: the expert's piece decoded
                    for chunk in source.decoded(name, key, expert).reshape(-1).split(_BLOCK):
                        self._add(chunk)
                    continue
                scale = source.scale_grid(name, key, expert)
                if scale is not None:
                    self._add_fp8(source, key, start, scale)
                    continue
                stored = source.stored_tensor(key)
                if stored.dtype not in _FLOAT_DTYPES:
                    raise MoePruneError(
                        f"cannot score checkpoint tensor {key!r}: unsupported dtype {stored.dtype}"
                    )
                dtype = _FLOAT_DTYPES[stored.dtype]
                step = _BLOCK * dtype.itemsize
                view = self._buffer(step)
                for offset in range(0, length, step):
                    size = min(step, length - offset)
                    source.read_into(key, start + offset, view[:size])
                    self._add(self.raw_tensor[:size].view(dtype))
        return self._totals()


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for a while (worker threads must not each start
    an OpenMP team per small op: that oversubscribes the cores and is many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _all_sums(sources: Sequence[SafetensorsExperts], workers: int) -> list[list[tuple[float, float, int]]]:
    """Weight sums of every expert of every layer, `workers` experts at a time.

    Every layout only rearranges the elements of gate_up_proj and down_proj into gate, up and
    down, so the sums run over the stored pieces as they are (no concatenation, no decoding).
    Each worker owns its buffers and sums whole experts with single-threaded torch ops (which
    release the GIL); the bytes of the expert `workers` places ahead are requested from the disk
    meanwhile, so a cold read overlaps the arithmetic.
    """
    tasks = [(s, e) for s in sources for e in range(s.num_experts)]
    local = threading.local()
    ahead = workers  # deeper prefetching measured no better on a cold cache

    def expert_sums(i: int) -> tuple[float, float, int]:
        if i + ahead < len(tasks):
            src, e = tasks[i + ahead]
            src.prefetch(e)
        if not hasattr(local, "sums"):
            local.sums = _Sums()
        source, e = tasks[i]
        return local.sums.of_stored(source, e)

    for i in range(min(ahead, len(tasks))):
        tasks[i][0].prefetch(tasks[i][1])
    with _torch_threads(1):  # one worker per core instead of torch's threads inside each op
        if workers <= 1:
            flat = [expert_sums(i) for i in range(len(tasks))]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="moeprune-score") as pool:
                flat = list(pool.map(expert_sums, range(len(tasks))))
    out, start = [], 0
    for source in sources:
        out.append(flat[start : start + source.num_experts])
        start += source.num_experts
    return out


def _layer_scores(
    name: str, source: SafetensorsExperts, sums: Sequence[tuple[float, float, int]]
) -> np.ndarray:
    fn = get_criterion(name).fn
    assert fn is not None, f"weight criterion {name!r} registered without a function"
    scores = np.zeros(source.num_experts, dtype=np.float64)
    for e, (l1, sq, n) in enumerate(sums):
        if n == 0 or sq == 0.0:
            raise MoePruneError(
                f"criterion {name!r}: expert {e} of decoder layer {source.layer} has no non-zero weights; "
                "its score is undefined"
            )
        scores[e] = fn(l1, sq, n)
    if not np.isfinite(scores).all():
        raise MoePruneError(f"criterion {name!r}: non-finite scores in decoder layer {source.layer}")
    return scores


def score_checkpoint(
    path: str | Path, criterion: str, seed: int = 0, workers: int | None = None
) -> list[LayerScores]:
    """Scores of a weight-only criterion straight from the safetensors shards.

    Never builds the model with weights: anonymous memory is a read buffer of 1M stored values and
    a 4 MiB fp32 block per worker (the page cache keeps what was read; the kernel reclaims it).
    `workers` threads sum experts
    in parallel (default: torch's thread count). Equal to `compute_scores(criterion,
    weights=MoEModel(model).layers)` (fp64 throughout) to ~1e-7 relative: blocks are summed in fp32.
    """
    crit = get_criterion(criterion)
    if crit.needs_data:
        raise MoePruneError(
            f"criterion {criterion!r} needs calibration data run through the model, so it cannot be computed "
            f"from the checkpoint files; streaming supports {', '.join(WEIGHT_ONLY)} (drop the streaming option)"
        )
    sources = checkpoint_layers(path)
    if not crit.needs_weights:
        return compute_scores(criterion, weights=sources, seed=seed)
    workers = max(1, workers if workers is not None else torch.get_num_threads())
    result = []
    for source, sums in zip(sources, _all_sums(sources, workers)):
        scores = _layer_scores(crit.name, source, sums)
        result.append(
            LayerScores(layer=source.layer, scores=scores, order=pruning_order_of(scores, crit.prune_first))
        )
    return result
