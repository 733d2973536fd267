"""What a criterion is: one score per routed expert, a direction, and what it needs.

A criterion only ranks experts *within* a layer; how many each layer loses is the allocation's
job. `comparable_across_layers` says whether `global` allocation may rank its raw scores across
layers (else it normalises them per layer first); each criterion's module says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from moeprune.config import CALIBRATION, WEIGHTS, Registry
from moeprune.observe.kinds import NONE, Statistics


@dataclass(frozen=True)
class Criterion:
    name: str
    prune_first: str  # "lowest" | "highest"
    comparable_across_layers: bool
    help: str
    needs: tuple[str, ...] = ()  # CALIBRATION (statistics), WEIGHTS, or nothing
    per_domain: bool = False  # several calibration files are normalised per domain, not merged (TENP)
    baseline: bool = False  # a reference to compare with (random), never chosen by `criterion auto`
    fn: Callable | None = None  # data: LayerStats -> scores [E]; weights: (sum|w|, sum w^2, N) -> score
    # what its fn reads beyond the per-token sums every observation records (observe/kinds.py)
    statistics: Statistics = NONE

    @property
    def needs_data(self) -> bool:
        return CALIBRATION in self.needs

    @property
    def needs_weights(self) -> bool:
        return WEIGHTS in self.needs

    @property
    def description(self) -> str:
        return self.help


CRITERIA: Registry[Criterion] = Registry("criterion", "criterion")
AUTO = "auto"  # not a criterion: the best uniform plan over every deterministic one (search/auto.py)


def get_criterion(name: str) -> Criterion:
    return CRITERIA.get(name)


def list_criteria() -> list[str]:
    return CRITERIA.names()


class ExpertWeightSource(Protocol):
    """One MoE layer's routed-expert weights, one expert at a time (adapter or safetensors)."""

    @property
    def layer(self) -> int:  # decoder layer index
        ...

    @property
    def num_experts(self) -> int: ...

    def expert_weights(self, expert: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """gate [I, d] (None for experts without one), up [I, d], down [d, I]; biases are not part
        of the criteria."""
        ...


@dataclass
class LayerScores:
    layer: int  # decoder layer index
    scores: np.ndarray  # float64 [E], indexed by original expert id
    order: list[int]  # expert ids, the first is pruned first (ties broken by expert id)


def pruning_order_of(scores: np.ndarray, prune_first: str) -> list[int]:
    key = -scores if prune_first == "highest" else scores
    return [int(i) for i in np.argsort(key, kind="stable")]
