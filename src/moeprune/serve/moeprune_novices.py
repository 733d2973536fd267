"""moeprune's low-rank novices for stock transformers (part of modeling_moeprune.py; copied with
it into every moeprune-format folder).

A low-rank novice of rank R replaces an expert by c + U (V^T h): `mean_output` holds c, and
`novice_u`, `novice_v` ([d, R]) the factors. config.json's layer entry says `"novice_rank": R`;
without it a layer's novices are the constant vectors of MoNE (moeprune_layers.MoePruneNovice).
"""

from __future__ import annotations

import torch
from torch import nn

from .moeprune_layers import MoePruneNovice


class MoePruneLowRankNovice(MoePruneNovice):
    """A novice whose output depends on its input through a rank-R map: c + U (V^T h)."""

    def __init__(self, constant: torch.Tensor, rank: int):
        super().__init__(constant)
        hidden = constant.shape[0]
        self.novice_u = nn.Parameter(constant.new_zeros(hidden, rank))
        self.novice_v = nn.Parameter(constant.new_zeros(hidden, rank))

    def extra_repr(self) -> str:
        return f"rank={self.novice_u.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, u = self.novice_v.to(x.dtype), self.novice_u.to(x.dtype)
        return self.mean_output.to(x.dtype) + (x @ v) @ u.T


def novice_module(constant: torch.Tensor, rank: int) -> MoePruneNovice:
    """The module of one novice: constant (rank 0) or low-rank."""
    return MoePruneLowRankNovice(constant, rank) if rank else MoePruneNovice(constant)
