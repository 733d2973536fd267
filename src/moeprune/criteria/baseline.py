"""The random criterion: a baseline every other criterion must beat.

Not comparable across layers: a score is a position in one layer's permutation.
"""

from __future__ import annotations

import numpy as np

from moeprune.criteria.registry import CRITERIA, Criterion
from moeprune.errors import MoePruneError

CRITERIA.add(
    Criterion("random", "lowest", False, "seeded random permutation per layer (baseline)", baseline=True)
)


def random_scores(seed: int, shapes: list[tuple[int, int]]) -> dict[int, np.ndarray]:
    """Score = position in a permutation drawn from Generator((seed, layer)), so layers differ."""
    if seed < 0:
        raise MoePruneError(f"the random criterion needs a non-negative seed, got {seed}", options=("seed",))
    out = {}
    for layer, n in shapes:
        perm = np.random.default_rng((seed, layer)).permutation(n)
        scores = np.empty(n, dtype=np.float64)
        scores[perm] = np.arange(n, dtype=np.float64)
        out[layer] = scores
    return out
