"""Evaluate pruned models against their reference: divergences, speculative acceptance, routing
shift, per-layer error, sizes and (optionally) lm-eval-harness accuracies.

- registry.py     the Metric spec, METRICS and parsing a metric list
- metrics.py      every metric, registered
- run.py          one evaluation: load once, measure per data file, the report document
- divergence.py, speculative.py, routing.py, layers.py, size.py, lm_eval_bridge.py: the measurements
- driver.py  Running a driver script in another Python (vLLM's environment) and reading its JSON
  answer
- lm_eval_vllm_driver.py  Runs in vLLM's Python, started by `moeprune eval --engine vllm`: `python
  lm_eval_vllm_driver.py SPEC OUT`
- serve_check.py  `moeprune serve-check OUT`: does vLLM serve the model moeprune made?
- vllm_driver.py  Runs in vLLM's Python, started by `moeprune serve-check` as a script: `python
  vllm_driver.py SPEC OUT`
- vllm_host.py  Can vLLM run a quantized checkpoint's MoE experts on this machine? Asked before vLLM
  starts
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
