"""A low-rank ("tilted") novice: an expert replaced by the affine map h -> c + U (V^T h).

Rank 0 is MoNE's constant mu. With the reduced-rank regression fit (surgery/lowrank.py) the map
equals mu + B (h - hbar) with B = U V^T of rank R, stored as its factors so that the computation
is two thin matmuls (2 d R multiply-adds per token) and the stored parameters are d + 2 d R.

This module only describes the computation, shared by the virtual form (models/routed.py), the
packed physical form (models/packed.py) and the served modules; it imports nothing of moeprune.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowRankNovice:
    """c [d], U [d, R], V [d, R]: the novice outputs c + U (V^T h) for expert input h (Llama-4: g h)."""

    constant: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.u.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, d], in x's dtype (the factors are cast to it, as every other weight is)."""
        dtype = x.dtype
        return self.constant.to(dtype) + (x @ self.v.to(dtype)) @ self.u.to(dtype).T

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> LowRankNovice:
        return LowRankNovice(
            self.constant.to(device=device, dtype=dtype),
            self.u.to(device=device, dtype=dtype),
            self.v.to(device=device, dtype=dtype),
        )

    def padded(self, rank: int) -> LowRankNovice:
        """The same map with zero columns up to `rank` (an expert fitted at a lower rank, stored
        beside rank-`rank` novices: the zero columns add exactly nothing)."""
        extra = rank - self.rank
        if extra <= 0:
            return self
        pad = self.u.new_zeros(self.u.shape[0], extra)
        return LowRankNovice(self.constant, torch.cat((self.u, pad), 1), torch.cat((self.v, pad), 1))


def novice_output(novice: torch.Tensor | LowRankNovice, x: torch.Tensor) -> torch.Tensor:
    """What a novice adds (before the routing weight) for expert inputs x [N, d]."""
    if isinstance(novice, LowRankNovice):
        return novice(x)
    return novice.to(x.dtype).expand(x.shape[0], -1)
