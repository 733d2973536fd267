"""The search's cache of hidden states, keyed by (batch, allocation prefix).

The state entering MoE layer p depends only on the removals in layers before p, so candidates
that share a prefix of the allocation share it: a candidate resumes from its longest cached
prefix and runs only the layers after it. The cache is an LRU bounded in bytes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.search.population import Allocation

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # at most 1 GiB of cached hidden states
# The cache needs, per batch, the states of the elites' prefixes at every MoE layer: a few times
# one layer's states for the whole search set. More only ever holds one-off candidates.
PREFIX_CACHE_COPIES = 6


class PrefixCache:
    """LRU of hidden states, keyed by (batch, allocation prefix), bounded in bytes.

    A tensor larger than the whole budget is not stored. Hits refresh an entry, so the prefixes
    of elites (shared by their offspring) stay while one-off candidates age out.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise MoePruneError(f"prefix cache budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[tuple[int, Allocation], torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, Allocation]) -> torch.Tensor | None:
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
        return tensor

    def put(self, key: tuple[int, Allocation], tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.nbytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = tensor
        self.nbytes += size
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def default_prefix_cache_bytes(moe: MoEModel, search_data: CalibrationData) -> int:
    """PREFIX_CACHE_COPIES x the MoE layers x one layer's states over the search set, at most 1 GiB."""
    tokens = sum(len(s.input_ids) for s in search_data.samples)
    element = next(moe.model.parameters()).element_size()
    one_layer = tokens * int(moe.config.hidden_size) * max(element, 4)
    return min(DEFAULT_PREFIX_CACHE_BYTES, PREFIX_CACHE_COPIES * len(moe.layers) * one_layer)
