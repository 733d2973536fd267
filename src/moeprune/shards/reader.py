"""Expert weights read straight from the shards, one expert's byte ranges at a time (plain
positioned reads into a reused buffer), so weight-only scoring and neuron rewriting never hold
more than a few experts in memory."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from moeprune.checkpoint.files import StoredTensor
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer
from moeprune.quant.fp8 import dequantize_blocks
from moeprune.shards.layout import CheckpointLayout, LayerLayout

SUMMED = ("gate_up_proj", "up_proj", "down_proj")  # the expert parameters gate, up and down come from


def _read_at(fd: int, out: memoryview, offset: int, lock: threading.Lock) -> int:
    """One positioned read into `out`; where os.preadv is missing (Windows), a locked seek + read."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [out], offset)
    with lock:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(out))
    out[: len(data)] = data
    return len(data)


class ShardReader:
    """Memory-mapped shard handles (safe_open), opened on first use (by any worker thread)."""

    def __init__(self, root: Path, tensors: dict[str, StoredTensor]):
        self.root, self.tensors = root, tensors
        self._open: dict[str, object] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _handle(self, key: str):
        file = self.tensors[key].file
        with self._lock:
            if file not in self._open:
                self._open[file] = safe_open(str(self.root / file), framework="pt")
            return self._open[file]

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def row(self, key: str, index: int) -> torch.Tensor:
        """`tensor(key)[index]`, reading only that row."""
        return self._handle(key).get_slice(key)[index]

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.root / file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            return self._fds[file]

    def prefetch(self, key: str, start: int, length: int) -> None:
        """Ask the kernel to read these bytes of `key`'s shard in the background (a hint)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(self.tensors[key].file), start, length, os.POSIX_FADV_WILLNEED)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `key`'s shard from absolute `offset` (plain reads: no page
        faults on a fresh mapping, which cost more than the copy itself)."""
        fd, done = self._fd(self.tensors[key].file), 0
        while done < len(out):
            got = _read_at(fd, out[done:], offset + done, self._lock)
            if got == 0:
                raise MoePruneError(
                    f"{self.root / self.tensors[key].file} ended early: truncated safetensors file"
                )
            done += got

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # os may be gone at exit
        for fd in getattr(self, "_fds", {}).values():
            _close(fd)


class SafetensorsExperts:
    """ExpertWeightSource over one MoE layer of a checkpoint on disk: each call reads one expert.

    Only the requested expert's bytes are read (its own tensors, or its row of a fused tensor),
    so memory stays at one expert whatever the model size.
    """

    def __init__(self, layout: LayerLayout, shards: ShardReader):
        self.layout = layout
        self.layer = layout.index
        self.num_experts = layout.num_experts
        self._shards = shards

    def stored_parts(self, name: str, expert: int) -> list[torch.Tensor]:
        """The stored pieces of `experts.<name>[expert]`: its row of a fused tensor, or its own
        tensors (gate, up) in order; memory-mapped, nothing is copied. fp8 pieces come
        dequantized (float32, the spec's numbers), as transformers holds them after loading."""
        param = self.layout.experts[name]
        if param.fused is not None:
            if param.fused in self.layout.coded:
                return [self.decoded(name, param.fused, expert)]
            return [self._dequantized(param.fused, self._shards.row(param.fused, expert), name, expert)]
        return [
            self.decoded(name, k, expert)
            if k in self.layout.coded
            else self._dequantized(k, self._shards.tensor(k), name, expert)
            for k in param.keys(expert)
        ]

    def decoded(self, name: str, key: str, expert: int) -> torch.Tensor:
        """Stored piece `key` of `experts.<name>[expert]` kept as codes with companions (mxfp4,
        compressed-tensors), decoded as the format's library decodes it (mxfp4: float32;
        compressed-tensors: the scale's dtype): the expert's row of fused codes and of their
        companions, or its own tensors; only that expert's bytes are read."""
        companions, decode = self.layout.coded[key]
        if key == self.layout.experts[name].fused:
            return decode(*(self._shards.row(k, expert) for k in (key, *companions)))
        return decode(*(self._shards.tensor(k) for k in (key, *companions)))

    def scale_grid(self, name: str, key: str, expert: int) -> torch.Tensor | None:
        """The fp8 scale grid of stored piece `key` of `experts.<name>[expert]` (its expert's row
        of a fused scale), None for a piece that is not fp8."""
        param = self.layout.experts[name]
        scale = param.scales.get(key)
        if scale is None:
            return None
        return self._shards.row(scale, expert) if key == param.fused else self._shards.tensor(scale)

    def _dequantized(self, key: str, piece: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        scale = self.scale_grid(name, key, expert)
        if scale is None or self.layout.fp8 is None:
            return piece
        return dequantize_blocks(piece, scale, self.layout.fp8.block)

    def stored_ranges(self, name: str, expert: int) -> list[tuple[str, int, int]]:
        """(checkpoint key, absolute byte offset, byte length) of the pieces `stored_parts` maps."""
        param = self.layout.experts[name]
        if param.fused is not None:
            stored = self._shards.tensors[param.fused]
            row = (stored.end - stored.start) // self.num_experts
            return [(param.fused, stored.start + expert * row, row)]
        return [
            (k, self._shards.tensors[k].start, self._shards.tensors[k].end - self._shards.tensors[k].start)
            for k in param.keys(expert)
        ]

    def prefetch(self, expert: int) -> None:
        """Start reading one expert's bytes from disk (no-op past the last expert)."""
        if expert >= self.num_experts:
            return
        for name in self.summed_names:
            for key, start, length in self.stored_ranges(name, expert):
                self._shards.prefetch(key, start, length)

    @property
    def summed_names(self) -> list[str]:
        """The expert parameters this layer stores of SUMMED (no gate_up_proj without a gate)."""
        return [name for name in SUMMED if name in self.layout.experts]

    def stored_tensor(self, key: str) -> StoredTensor:
        return self._shards.tensors[key]

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self._shards.read_into(key, offset, out)

    def expert_tensor(self, name: str, expert: int) -> torch.Tensor:
        """`experts.<name>[expert]` exactly as the loaded model would hold it."""
        parts = self.stored_parts(name, expert)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.layout.experts[name].cat_dim)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate [I,d], up [I,d], down [d,I]), decoded by the adapter's own layout rules (gate None
        for experts without one)."""
        one = nn.Module()  # a one-expert stand-in for the experts module: plain tensor attributes
        for name in self.summed_names:
            setattr(one, name, self.expert_tensor(name, expert)[None])
        block = nn.Module()
        block.experts = one
        return MoELayer(self.layer, block, self.layout.spec).expert_weights(0)


def checkpoint_layers(path: str | Path) -> list[SafetensorsExperts]:
    """One lazy expert-weight source per MoE layer of a checkpoint folder (weights stay on disk)."""
    layout = CheckpointLayout(path)
    shards = ShardReader(layout.path, layout.tensors)
    return [SafetensorsExperts(lay, shards) for lay in layout.layers]
