"""One tensor of a rewritten shard, described before any byte is written (`shards/rewrite.py`
writes it; `shards/internal.py` renames and fuses them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

ITEMSIZE = {  # bytes per element of the safetensors dtypes a slice may cut
    **dict.fromkeys(("F64", "I64", "U64", "C64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}


@dataclass(frozen=True)
class OutTensor:
    """One tensor of a rewritten shard: its header entry and the source byte ranges it is made of,
    or (`chunks`) a function giving its data as tensors in the stored dtype, made in memory
    piece by piece while the shard is written (an expert's sliced tensor, a padded one)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...] = ()  # (absolute offset in the source shard, length)
    chunks: Callable[[], Iterable[torch.Tensor]] | None = None  # row-major pieces, in order

    @property
    def nbytes(self) -> int:
        if self.chunks is not None:
            return math.prod(self.shape) * ITEMSIZE[self.dtype]
        return sum(length for _, length in self.ranges)
