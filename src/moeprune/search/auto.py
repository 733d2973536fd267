"""`--criterion auto`: pick the criterion whose uniform plan scores best on the search data.

The best criterion differs per model (EvoESAP's finding), so rather than guess, every criterion
is tried on the same footing: one calibration pass feeds all of them, the full model's answer
distributions are computed once, and each criterion's uniform plan is evaluated through the
method's virtual form (no model copy). The whole table goes into the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moeprune.allocate.fitness import (
    FitnessAccumulator,
    TeacherCache,
    answer_positions,
    check_fitness,
    higher_is_better,
)
from moeprune.config import PruneConfig
from moeprune.criteria import CRITERIA, compute_scores, get_criterion
from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.runtime.device import Placement, input_device
from moeprune.runtime.distributed import rank_and_world, split_map
from moeprune.runtime.progress import progress_bar
from moeprune.search.options import SearchRuntime
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import virtual_plan
from moeprune.surgery.registry import default_allocation


def candidate_criteria(has_data: bool) -> list[str]:
    """Every deterministic criterion the available inputs allow (random is a baseline, not a choice)."""
    return [c.name for c in CRITERIA if not c.baseline and (has_data or not c.needs_data)]


def teacher_pass(
    moe: MoEModel, search: CalibrationData, batch_size: int, pad: int | None
) -> tuple[TeacherCache, list]:
    """The full model's answer distributions on the search data, computed once (and its batches,
    on the model's input device), for every plan scored against them."""
    device = input_device(moe.model)
    batches = [b.to(device) for b in search.batches(batch_size, pad)]
    positions = sum(int(answer_positions(b.answer_mask, b.attention_mask).sum()) for b in batches)
    nbytes = positions * int(moe.config.vocab_size) * 4
    teacher = TeacherCache(device=Placement.of(moe.model).cache_device(nbytes, what="the teacher cache"))
    with torch.no_grad():
        for b in batches:
            logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
            teacher.add(b.sample_index.tolist(), logits, b.input_ids, b.answer_mask, b.attention_mask)
    return teacher, batches


def plan_fitness(
    moe: MoEModel,
    plan: Plan,
    scored: tuple[TeacherCache, list],
    accumulator: FitnessAccumulator,
    stats: Sequence[ExpertStats] = (),
    fits: Any = None,
) -> float:
    """`plan`'s fitness on the search data against the teacher (`scored`: the cache and its
    batches, `teacher_pass`), evaluated through the method's virtual form (no model copy)."""
    _, batches = scored
    with torch.no_grad(), virtual_plan(moe, plan, list(stats) or None, fits):
        for b in batches:
            logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
            accumulator.add(b.sample_index.tolist(), logits, b.answer_mask, b.attention_mask)
    return accumulator.result()


def choose_criterion(
    moe: MoEModel,
    stats: Sequence[ExpertStats],
    search: CalibrationData,
    *,
    config: PruneConfig,
    runtime: SearchRuntime | None = None,
) -> tuple[str, list[dict]]:
    """The best criterion for a uniform plan at ``config.sparsity``, and every criterion's fitness.

    From ``config``: the sparsity, the method, the fitness (``config.search.fitness``) and the
    seed (``config.seed``: the random criterion's permutation and the sap fitness's draws); from
    ``runtime``: batch size, padding and progress.
    """
    runtime = runtime or SearchRuntime()
    sparsity, method, fitness, seed = config.sparsity, config.method, config.search.fitness, config.seed
    batch_size, pad_token_id, progress = runtime.batch_size, runtime.pad_token_id, runtime.progress
    check_fitness(fitness)
    teacher, batches = teacher_pass(moe, search, batch_size, pad_token_id)
    domains = list(stats)
    names = candidate_criteria(bool(domains))
    rank, world = rank_and_world()
    bar = progress_bar(
        total=len(names[rank::world]), desc="criterion auto", unit="criterion", enabled=progress
    )

    def evaluate(name: str) -> float:
        crit = get_criterion(name)
        scores = compute_scores(
            name,
            stats=(domains if len(domains) > 1 else domains[0]) if crit.needs_data else None,
            weights=moe.layers if crit.needs_weights else None,
            seed=seed,
            layers=[m.index for m in moe.layers],
        )
        plan = build_plan(
            moe,
            crit,
            scores,
            config=PruneConfig(name, sparsity, allocation=default_allocation(method), method=method),
            stats=domains,
        )
        value = plan_fitness(
            moe, plan, (teacher, batches), FitnessAccumulator(teacher, fitness, seed), domains
        )
        bar.update(1)
        return value

    with bar:  # under torchrun each rank tries its share of the criteria
        values = split_map(evaluate, names, "trying criteria (criterion auto)")
    table = [{"criterion": name, fitness: value} for name, value in zip(names, values)]
    sign = 1.0 if higher_is_better(fitness) else -1.0
    best = max(table, key=lambda row: sign * row[fitness])["criterion"]
    return best, table
