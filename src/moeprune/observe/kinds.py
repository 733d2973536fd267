"""The statistics an observation pass can record, asked for by the entries that read them.

Why: every feature that reads calibration statistics once made the pass compute its statistic on
every run (the guard's maxima, merge's gated sums and probe tokens, the moments, TENP's direction
term), and a REAP drop run paid for all of them. Now each registered criterion, method and
allocation declares the kinds it reads (`statistics` on its registration), the super-expert guard
declares `GUARD_STATISTICS` (criteria/super_experts.py), and the run observes their union
(`surgery/planning.py:requirements`).

Always recorded, whatever is asked: the per-token scalars the finiteness screen computes anyway,
summed per expert - count, sum g, sum ||E|| and sum g ||E|| (frequency, seer, ean, reap, man and
the merge's gate factor read nothing else). Each kind below adds one more:

- TENP           sum g ||E|| (1 - cos(h, E)): one [N, d] product per call (criterion tenp)
- MOMENTS        Welford mean and M2 of E(h) [E, d] (mone, msan, novices' mean outputs)
- MAXIMA         the largest |E(h)_j| per expert (the super-expert guard)
- GATED_OUTPUTS  sum g E(h) [E, d] (the merge method's distance)
- PROBE          the first PROBE_TOKENS block inputs of each layer (the merge method)
- NEURONS        per-neuron importance sums [E, I] (neuron methods: one extra product per expert)
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


class Statistic(Enum):
    """A kind of statistic; its value names the LayerStats fields it fills (None when not asked)."""

    TENP = ("tenp_sum",)
    MOMENTS = ("mean", "m2")
    MAXIMA = ("output_absmax",)
    GATED_OUTPUTS = ("gated_sum",)
    PROBE = ("probe",)
    NEURONS = ("neuron_proj_sum", "neuron_l2_sum")

    @property
    def fields(self) -> tuple[str, ...]:
        return self.value


Statistics = frozenset[Statistic]
NONE: Statistics = frozenset()
# what `observe` records when the caller names nothing (every kind but the per-neuron sums, which
# only neuron methods read and which cost an extra product per expert): the pass before kinds existed
DEFAULT: Statistics = frozenset(Statistic) - {Statistic.NEURONS}


def union(*groups: Iterable[Statistic]) -> Statistics:
    """Every kind any of `groups` asks for."""
    return frozenset().union(*groups)
