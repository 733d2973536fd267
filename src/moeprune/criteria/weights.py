"""Criteria computed from an expert's weights alone (no data): magnitude and AIMER.

Each is a function of three sums over the expert's gate, up and down weights flattened together,
(sum |w|, sum w^2, N), accumulated in fp64 a chunk at a time so huge experts never need an fp64
copy. The streamed path (shards/) reads the same sums from the safetensors files.

- magnitude: not comparable across layers; mean |w| follows each layer's weight scale (init,
  depth, norm placement).
- aimer: comparable; scale invariant and bounded in [1/sqrt(N), 1], with N the same for every
  layer of one model, so the ratio means the same thing in every layer.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moeprune.config import WEIGHTS
from moeprune.criteria.registry import CRITERIA, Criterion, ExpertWeightSource
from moeprune.errors import MoePruneError

F64 = torch.float64
_CHUNK = 1 << 22  # elements cast to fp64 at a time


@CRITERIA.register(
    Criterion(
        "magnitude", "lowest", False, "mean |w| over the expert's gate, up and down weights", needs=(WEIGHTS,)
    )
)
def magnitude(l1: float, sq: float, n: int) -> float:
    return l1 / n


@CRITERIA.register(
    Criterion(
        "aimer",
        "highest",
        True,
        "||w||_1 / (sqrt(N) ||w||_2) over gate, up and down (AIMER)",
        needs=(WEIGHTS,),
    )
)
def aimer(l1: float, sq: float, n: int) -> float:
    return l1 / (math.sqrt(n) * math.sqrt(sq))


def weight_sums(source: ExpertWeightSource, expert: int) -> tuple[float, float, int]:
    """(sum |w|, sum w^2, N) over gate, up, down in fp64, casting a chunk at a time."""
    l1 = sq = 0.0
    n = 0
    for t in source.expert_weights(expert):
        if t is None:  # experts without a gate
            continue
        for chunk in t.detach().reshape(-1).split(_CHUNK):
            c = chunk.to(F64)
            l1 += float(c.abs().sum())
            sq += float(c.square().sum())
        n += t.numel()
    return l1, sq, n


def weight_scores(criterion: Criterion, sources: list[ExpertWeightSource]) -> dict[int, np.ndarray]:
    fn = criterion.fn
    assert fn is not None, f"weight criterion {criterion.name!r} registered without a function"
    out = {}
    for src in sources:
        scores = np.zeros(src.num_experts, dtype=np.float64)
        for e in range(src.num_experts):
            l1, sq, n = weight_sums(src, e)
            if n == 0 or sq == 0.0:
                raise MoePruneError(
                    f"criterion {criterion.name!r}: expert {e} of decoder layer {src.layer} has no non-zero weights; "
                    "its score is undefined"
                )
            scores[e] = fn(l1, sq, n)
        out[src.layer] = scores
    return out
