"""Observation: one pass over calibration data collecting fp64 per-expert statistics, the input
of every data-driven criterion, the super-expert guard, novice, merge and neuron surgery. The pass
records the kinds of statistic the run's entries declare (kinds.py), not every kind there is.

- kinds.py        Statistic: the kinds a pass can record beyond the per-token sums, each asked for
                  by the criteria, methods, allocations and guard that declare it
- observer.py     the in-memory pass (routed tokens only, padding excluded); its accumulator also
                  serves the layer-by-layer pass, shards/sequential.py
- stats.py        ExpertStats / LayerStats: fp64 sums and Welford/Chan moments that merge exactly
- neurons.py      per-neuron importance sums of one layer call (neuron methods)
- distributed.py  the pass split over torchrun ranks and merged exactly
- moments.py      a second, targeted pass: input/output co-moments of the experts a plan
                  replaces by low-rank novices
"""

from moeprune.observe.observer import observe
from moeprune.observe.stats import ExpertStats

__all__ = ["ExpertStats", "observe"]
