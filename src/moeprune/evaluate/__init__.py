"""Evaluate pruned models against their reference: divergences, speculative acceptance, routing
shift, per-layer error, sizes and (optionally) lm-eval-harness accuracies.

- registry.py     the Metric spec, METRICS and parsing a metric list
- metrics.py      every metric, registered
- run.py          one evaluation: load once, measure per data file, the report document
- divergence.py, speculative.py, routing.py, layers.py, size.py, lm_eval_bridge.py: the measurements
"""

from __future__ import annotations

from moeprune.evaluate import metrics  # noqa: F401  (registers the metrics)
from moeprune.evaluate.registry import METRICS, Metric, parse_metrics
from moeprune.evaluate.run import Context, EvalOptions, Loaded, evaluate_loaded, evaluate_models

__all__ = [
    "METRICS",
    "Context",
    "EvalOptions",
    "Loaded",
    "Metric",
    "evaluate_loaded",
    "evaluate_models",
    "parse_metrics",
]
