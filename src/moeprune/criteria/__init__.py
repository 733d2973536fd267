"""Expert criteria: one score per routed expert and which end is pruned first.

- registry.py  the Criterion spec and the CRITERIA registry (names, help, needs, direction)
- baseline.py  random
- weights.py   magnitude, aimer (weights only)
- data.py      frequency, seer, ean, reap, mone, tenp, man, msan (calibration statistics)
- scoring.py   scores of every layer under one criterion, the `score` JSON, unseen experts

A new criterion is one module that registers itself with `@CRITERIA.register(Criterion(...))`
and one import below; the command line, its help and the README table read the registry.

- super_experts.py  Super experts: the few routed experts whose massive activations the model cannot
  lose
"""

from __future__ import annotations

# Importing registers; this order is the table's: baseline, weight-only, data-driven.
# isort: off
from moeprune.criteria import baseline  # noqa: F401
from moeprune.criteria import weights  # noqa: F401
from moeprune.criteria import data  # noqa: F401

# isort: on
from moeprune.criteria.registry import (
    AUTO,
    CRITERIA,
    Criterion,
    ExpertWeightSource,
    LayerScores,
    get_criterion,
    list_criteria,
    pruning_order_of,
)
from moeprune.criteria.scoring import (
    compute_scores,
    importance_scores,
    score_experts,
    scores_document,
    unseen_experts,
    unseen_note,
)

__all__ = [
    "AUTO",
    "CRITERIA",
    "Criterion",
    "ExpertWeightSource",
    "LayerScores",
    "compute_scores",
    "get_criterion",
    "importance_scores",
    "list_criteria",
    "pruning_order_of",
    "score_experts",
    "scores_document",
    "unseen_experts",
    "unseen_note",
]
