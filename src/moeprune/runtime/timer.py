"""Wall time per named stage, for reports and the log."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timer:
    """Call `lap(name)` at the end of each stage; `total()` gives every stage and the sum."""

    stages: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        took = round(now - self._start, 3)
        self.stages[name] = round(self.stages.get(name, 0.0) + took, 3)
        self._start = now
        return took

    def total(self) -> dict[str, float]:
        return {**self.stages, "total": round(sum(self.stages.values()), 3)}
