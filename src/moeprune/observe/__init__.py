"""Observation: one pass over calibration data (or one decoder layer at a time) collecting fp64
per-expert statistics, the input of every data-driven criterion, novice and neuron surgery.

- observer.py    the in-memory pass (routed tokens only, padding excluded)
- sequential.py  the same statistics one decoder layer at a time, never holding the whole model
- stats.py       ExpertStats / LayerStats: fp64 sums and Welford/Chan moments that merge exactly
"""

from moeprune.observe.observer import observe
from moeprune.observe.stats import ExpertStats

__all__ = ["ExpertStats", "observe"]
