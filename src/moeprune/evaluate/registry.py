"""What an evaluation metric is: its name, what it needs, and the function that measures it.

Per-file metrics are measured on each evaluation data file (never mixed) and several may come
from one computation (esap, kl, nll and ppl share one pass: their `fn` is the same and runs once);
per-model metrics (size) are measured once per model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeprune.config import Registry
from moeprune.errors import MoePruneError

EVAL_DATA = "evaluation data"


@dataclass(frozen=True)
class Metric:
    name: str
    help: str
    per_file: bool = True  # measured on every data file (else once per model)
    needs: tuple[str, ...] = (EVAL_DATA,)
    aliases: tuple[str, ...] = ()
    report_key: str | None = None  # the per-file key it is stored under, when not its name
    measures_loading: bool = False  # it reports the load's peak memory: the loader is warmed up first
    fn: Callable | None = (
        None  # per file: (model, context, source, wanted) -> dict; per model: (model, context) -> dict
    )


METRICS: Registry[Metric] = Registry("metric", "metrics")


def parse_metrics(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Metric names from "esap,kl" (or a list); "all" or nothing means every metric, in registry order."""
    names = spec.split(",") if isinstance(spec, str) else list(spec or ["all"])
    aliases = {a: m.name for m in METRICS for a in m.aliases}
    wanted = {aliases.get(n.strip().lower(), n.strip().lower()) for n in names if n.strip()}
    if not wanted or "all" in wanted:
        return tuple(METRICS.names())
    unknown = sorted(wanted - set(METRICS.names()))
    if unknown:
        raise MoePruneError(
            f"unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRICS.names())} or all",
            options=("metrics",),
        )
    return tuple(m for m in METRICS.names() if m in wanted)
