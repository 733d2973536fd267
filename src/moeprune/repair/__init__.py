"""`--repair`: after surgery, distil the pruned model toward the full one on the calibration tokens,
training only small tensors (routers, per-layer gains, novices, norms; never expert weights), with
early stopping on held-out tokens and never worse than unrepaired there (docs/surgery.md, "Repair").

The stage after search: it reads the searches' fitness and teacher cache (allocate/fitness.py) and
applies the plan through surgery; the API calls `apply_repaired` in place of surgery's `apply_plan`.

- parts.py  What `--repair` may train: the small tensors around the experts, never the experts'
  weights
- teacher.py  The full model's distributions `--repair` learns from and is checked against, computed
  once before surgery (the model is pruned in place afterwards, so it is the only ...
- train.py  `--repair`: distil the pruned model toward the full one, training only small tensors
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moeprune.config import PruneConfig
from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.repair.parts import REPAIR_PART_REGISTRY, collect
from moeprune.repair.train import RepairData, prepare_repair, run_repair
from moeprune.search.options import SearchRuntime
from moeprune.surgery.planning import apply_plan
from moeprune.surgery.plans import Fits

__all__ = ["REPAIR_PART_REGISTRY", "RepairData", "apply_repaired", "collect", "prepare_repair", "run_repair"]


def apply_repaired(
    moe: MoEModel,
    plan: Plan,
    stats: Sequence[ExpertStats],
    fits: Fits | None,
    *,
    config: PruneConfig,
    sets: Sequence[CalibrationData],
    search: CalibrationData | None,
    runtime: SearchRuntime,
) -> tuple[dict, dict[str, Any] | None]:
    """Surgery of `plan` (`apply_plan`) and, with `config.repair.enabled`, the repair after it: the
    full model's distributions are taken before the cut. Returns what surgery did and the report's
    `repair` part (None without repair). `runtime`: batch size, padding and progress."""
    if not config.repair.enabled:
        return apply_plan(moe, plan, stats, fits), None
    data = prepare_repair(
        moe,
        config.repair,
        sets,
        search,
        fitness=config.search.fitness,
        seed=config.seed,
        batch_size=runtime.batch_size,
        pad=runtime.pad_token_id or 0,
    )
    surgery = apply_plan(moe, plan, stats, fits)
    return surgery, run_repair(moe, config.repair, data, progress=runtime.progress)
