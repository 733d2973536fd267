"""A layer's novices as vLLM serves them: constant (MoNE) or low-rank, outside the fused kernel.

A novice at router position p adds g_p(t) * (c_p + U_p (V_p^T h_t)) for a token t whose top-k
picks p (g_p(t): exactly the weight the layer's routing gives the pick), and nothing otherwise;
constant novices (rank 0) have no U, V. That is what moeprune's loader computes (models/routed.py,
models/lowrank.py) and what the modeling files do (moeprune_novices.py).

Computed on fixed shapes, so it stays correct under torch.compile and CUDA graphs:

- gates [T, n]: the weight of each of the layer's n novices per token, 0 where it is not
  picked (one gather of a position -> novice one-hot table, summed over the top-k slots);
- constant part: gates @ C, C [n, d] the novices' constants;
- low-rank part: ((h @ V) * gates per rank column) @ U^T, with V [d, n R] and U^T [n R, d]
  every novice's factors side by side. A token not routed to novice p has a zero gate on p's R
  columns, which adds exactly nothing (0 times a finite number), as the loader's computation on
  the routed tokens only. The layer pays 2 d n R multiply-adds per token for its n novices,
  whatever the routing: small beside the fused experts (at d = 2048, 32 novices of rank 16 are
  2.1 M, eight picked experts of width 768 are 37.7 M).

The factors are stored in that side-by-side layout when loading (the checkpoint stores each
novice's `novice_u`, `novice_v` [d, R]), so the forward reshapes nothing; what vLLM holds is
what the checkpoint stores, d + 2 d R per novice.
"""

from __future__ import annotations

import torch
from torch import nn

from moeprune.serve.moeprune_format import FormatError, LayerStructure

MEAN_OUTPUT = "mean_output"  # the constant c (mu for rank 0), [d]
NOVICE_U, NOVICE_V = "novice_u", "novice_v"  # the factors of a low-rank novice, [d, R] each


class NoviceTable(nn.Module):
    """A layer's novices (constants and, for rank R > 0, factors) and the map from router
    position to novice row."""

    gate: torch.Tensor  # buffer registered in __init__, declared for the type checker

    def __init__(self, layer: LayerStructure, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer.layer
        self.positions = layer.novices
        self.rank = layer.novice_rank
        self.hidden_size = hidden_size
        n = len(layer.novices)
        # gate[position, row] = 1 where router position `position` is novice `row`: one gather
        # turns the top-k picks into per-novice gates (no int64 copies, no per-pick masks)
        gate = torch.zeros(layer.num_experts, n)
        for row, position in enumerate(layer.novices):
            gate[position, row] = 1.0
        self.register_buffer("gate", gate, persistent=False)
        self.mean_output = nn.Parameter(torch.empty(n, hidden_size, dtype=dtype), requires_grad=False)
        self.novice_v: nn.Parameter | None = None
        self.novice_u: nn.Parameter | None = None  # U^T: novice row r's rows r R .. (r + 1) R - 1
        if self.rank:
            rank = self.rank
            self.novice_v = nn.Parameter(torch.empty(hidden_size, n * rank, dtype=dtype), requires_grad=False)
            self.novice_u = nn.Parameter(torch.empty(n * rank, hidden_size, dtype=dtype), requires_grad=False)
        self.loaded: set[tuple[int, str]] = set()

    def parts(self) -> tuple[str, ...]:
        """The tensors each novice of this layer stores."""
        return (MEAN_OUTPUT, NOVICE_U, NOVICE_V) if self.rank else (MEAN_OUTPUT,)

    def load(self, position: int, part: str, value: torch.Tensor) -> None:
        """One stored tensor of the novice at router `position` into its row / columns."""
        if part not in self.parts():
            raise FormatError(
                f"layer {self.layer}: novice {position} stores {part!r}, which a layer with novice_rank "
                f"{self.rank} has no place for; the checkpoint is damaged, re-create it with moeprune"
            )
        d, row = self.hidden_size, self.positions.index(position)
        expected = (d,) if part == MEAN_OUTPUT else (d, self.rank)
        if tuple(value.shape) != expected:
            raise FormatError(
                f"layer {self.layer}: novice {position}'s {part} has shape {tuple(value.shape)}, expected "
                f"{expected}; the checkpoint is damaged, re-create it with moeprune"
            )
        if part == MEAN_OUTPUT:
            self.mean_output.data[row].copy_(value)
        else:
            columns = slice(row * self.rank, (row + 1) * self.rank)
            if part == NOVICE_V:
                assert self.novice_v is not None
                self.novice_v.data[:, columns].copy_(value)
            else:
                assert self.novice_u is not None
                self.novice_u.data[columns].copy_(value.T)
        self.loaded.add((position, part))

    def check_loaded(self) -> None:
        missing = sorted({(p, part) for p in self.positions for part in self.parts()} - self.loaded)
        if missing:
            raise FormatError(
                f"layer {self.layer}: the checkpoint lacks novice tensors {missing} (router position, name); "
                "it is incomplete, re-create it with moeprune"
            )

    def forward(self, weights: torch.Tensor, ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * novice_{ids[t, k]}(h_t) over the picked novices, per token t
        (hidden_states: the experts' input h, [T, d]).

        Top-k picks are distinct, so each novice's gate sums one product and zeros: exact."""
        gates = (weights.unsqueeze(-1) * self.gate[ids].to(weights.dtype)).sum(dim=1)
        gates = gates.to(self.mean_output.dtype)
        out = gates @ self.mean_output
        if self.novice_u is None or self.novice_v is None:
            return out
        x = hidden_states.reshape(-1, self.hidden_size).to(self.novice_v.dtype)
        projected = (x @ self.novice_v).view(x.shape[0], -1, self.rank) * gates.unsqueeze(-1)
        return out + projected.flatten(1) @ self.novice_u
