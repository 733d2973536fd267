"""The Python API behind the CLI: score experts, plan a pruning, apply it, save with evidence.

Each step is a plain function over plain objects (MoEModel, CalibrationData, ExpertStats,
LayerScores, Plan), so scripts can stop, inspect or swap any stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .allocate import (
    budget_from_sparsity,
    global_allocation,
    group_limited_cap,
    plan_removals,
    uniform_allocation,
)
from .criteria import Criterion, LayerScores, compute_scores, get_criterion, unseen_note
from .data import CalibrationData, load_data, parse_source
from .errors import DataError, MoePruneError
from .io import atomic_write_dir, check_output_dir, load_model, load_tokenizer, write_json
from .models import MoEModel
from .observe import observe
from .plan import Plan
from .stats import ExpertStats
from .surgery import drop_experts

ALLOCATIONS = ("uniform", "global")
METHODS = ("drop",)


@dataclass
class DataOptions:
    """Where calibration data comes from and how much of it to use."""

    sources: Sequence[str] = ()
    samples: int | None = 128
    max_length: int = 512
    batch_size: int = 8
    seed: int = 0
    packing: bool = False


@dataclass
class Timer:
    """Wall time per named stage, for the report."""

    stages: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = round(now - self._start, 3)
        self._start = now

    def total(self) -> dict[str, float]:
        return {**self.stages, "total": round(sum(self.stages.values()), 3)}


def require_tokenizer(tokenizer, model_path: str | Path, tokenizer_path: str | Path | None):
    if tokenizer_path:
        return load_tokenizer(tokenizer_path) or _no_tokenizer(tokenizer_path)
    return tokenizer or _no_tokenizer(model_path)


def _no_tokenizer(path) -> None:
    raise MoePruneError(
        f"no tokenizer found in {str(path)!r}; pass --tokenizer PATH (a folder with tokenizer files)"
    )


def calibration_sets(tokenizer, criterion: Criterion, options: DataOptions) -> list[CalibrationData]:
    """One mixed set, or one set per source for TENP (it normalises per calibration domain)."""
    if not options.sources:
        raise DataError(f"criterion {criterion.name!r} needs calibration data: pass --data FILE")

    def load(sources: Sequence[str], samples: int | None) -> CalibrationData:
        return load_data(
            sources, tokenizer, num_samples=samples, max_length=options.max_length, seed=options.seed,
            packing=options.packing,
        )  # fmt: skip

    if criterion.name != "tenp" or len(options.sources) == 1:
        return [load(options.sources, options.samples)]
    weights = [parse_source(s)[1] for s in options.sources]
    shares = [
        None if options.samples is None else max(1, round(options.samples * w / sum(weights)))
        for w in weights
    ]
    return [load([source], share) for source, share in zip(options.sources, shares)]


def score_experts(
    moe: MoEModel,
    criterion_name: str,
    *,
    tokenizer=None,
    data: DataOptions | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[Criterion, list[LayerScores], list[ExpertStats], list[CalibrationData]]:
    """Scores of every MoE layer under one criterion (observing calibration data if it needs it)."""
    criterion = get_criterion(criterion_name)
    stats: list[ExpertStats] = []
    sets: list[CalibrationData] = []
    if criterion.needs_data:
        sets = calibration_sets(tokenizer, criterion, data or DataOptions())
        pad = getattr(tokenizer, "pad_token_id", None) or 0
        stats = [
            observe(moe, d, batch_size=(data or DataOptions()).batch_size, pad_token_id=pad, progress=progress,
                    domain=d.sources[0] if len(sets) > 1 else "")
            for d in sets
        ]  # fmt: skip
    scores = compute_scores(
        criterion.name,
        stats=(stats if len(stats) > 1 else stats[0]) if stats else None,
        weights=moe.layers if criterion.needs_weights else None,
        seed=seed,
        num_experts=[m.num_experts for m in moe.layers],
        layers=[m.index for m in moe.layers],
    )
    return criterion, scores, stats, sets


def scores_document(
    criterion: Criterion, scores: Sequence[LayerScores], stats: Sequence[ExpertStats]
) -> dict:
    """The `moeprune score` JSON (its keys are a contract)."""
    return {
        "criterion": criterion.name,
        "prune_first": criterion.prune_first,
        "tokens": int(sum(s.tokens for s in stats)),
        "layers": [
            {"layer": s.layer, "scores": [float(v) for v in s.scores], "order": [int(e) for e in s.order]}
            for s in scores
        ],
    }


def build_plan(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    *,
    sparsity: float,
    allocation: str = "uniform",
    method: str = "drop",
    data_fingerprint: str = "",
) -> Plan:
    """Turn scores and a global expert budget into a per-layer plan."""
    if allocation not in ALLOCATIONS:
        raise MoePruneError(f"unknown allocation {allocation!r}; choose one of: {', '.join(ALLOCATIONS)}")
    if method not in METHODS:
        raise MoePruneError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    layers = moe.layers
    num_experts = [m.num_experts for m in layers]
    top_k = [m.top_k for m in layers]
    groups = [m.n_group for m in layers]
    caps = [
        group_limited_cap(m.num_experts, m.top_k, m.n_group, m.topk_group)
        if m.n_group > 1
        else m.num_experts - m.top_k
        for m in layers
    ]
    budget = budget_from_sparsity(sparsity, num_experts, top_k)
    limits = dict(multiple_of=groups, max_removed=caps)
    if allocation == "uniform":
        removed = uniform_allocation(budget, num_experts, top_k, **limits)
    else:
        normalize = not criterion.comparable_across_layers
        removed = global_allocation(
            [s.scores for s in scores], criterion.prune_first, budget, num_experts, top_k, normalize, **limits
        )
    positions = plan_removals([s.order for s in scores], removed, groups)
    ids = [[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)]
    plan = Plan.from_removals(
        model_type=moe.model_type,
        num_experts=num_experts,
        top_k=top_k,
        layer_indices=[m.index for m in layers],
        removals=ids,
        criterion=criterion.name,
        allocation=allocation,
        method=method,
        sparsity=sparsity,
        data_fingerprint=data_fingerprint,
    )
    plan.extra["budget"] = budget
    if allocation == "global":
        plan.extra["global_normalisation"] = "per-layer sum of |score|" if normalize else "none (raw scores)"
    return plan


def plan_positions(moe: MoEModel, plan: Plan) -> dict[int, list[int]]:
    """The plan's dropped original ids as positions in the model's current storage."""
    out = {}
    for layer_plan in plan.layers:
        layer = moe.layer(layer_plan.layer)
        where = {orig: pos for pos, orig in enumerate(layer.expert_ids)}
        missing = [e for e in layer_plan.dropped if e not in where]
        if missing:
            raise MoePruneError(
                f"layer {layer_plan.layer}: plan drops experts {missing} this model no longer has"
            )
        out[layer_plan.layer] = [where[e] for e in layer_plan.dropped]
    return out


def apply_plan(moe: MoEModel, plan: Plan) -> None:
    """Physical surgery of a drop plan."""
    drop_experts(moe, plan_positions(moe, plan))


def layer_summary(moe: MoEModel) -> list[dict]:
    return [
        {
            "layer": m.index,
            "experts": m.num_experts,
            "top_k": m.top_k,
            "intermediate_size": m.intermediate_size,
        }
        for m in moe.layers
    ]


def data_summary(sets: Sequence[CalibrationData], stats: Sequence[ExpertStats]) -> dict:
    if not sets:
        return {}
    return {
        "sources": [s for d in sets for s in d.sources],
        "samples": sum(len(d.samples) for d in sets),
        "tokens": int(sum(s.tokens for s in stats)),
        "truncated_samples": sum(d.truncated for d in sets),
        "text_only": all(d.text_only for d in sets),
        "fingerprint": sets[0].fingerprint if len(sets) == 1 else [d.fingerprint for d in sets],
        "notes": [n for d in sets for n in d.notes],
    }


def prune(
    model_path: str | Path,
    output: str | Path,
    *,
    criterion: str,
    sparsity: float,
    allocation: str = "uniform",
    method: str = "drop",
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Load, score, plan, cut and save; returns the report written beside the checkpoint."""
    from .checkpoint import save_pretrained

    check_output_dir(output, overwrite)  # fail before any expensive work
    get_criterion(criterion)
    timer = Timer()
    model, tokenizer = load_model(model_path, dtype=dtype)
    moe = MoEModel(model)
    before_layers, before_params = layer_summary(moe), moe.parameter_counts()
    if get_criterion(criterion).needs_data:
        tokenizer = require_tokenizer(tokenizer, model_path, tokenizer_path)
    timer.lap("load")
    crit, scores, stats, sets = score_experts(
        moe, criterion, tokenizer=tokenizer, data=data, seed=seed, progress=progress
    )
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    plan = build_plan(
        moe,
        crit,
        scores,
        sparsity=sparsity,
        allocation=allocation,
        method=method,
        data_fingerprint=fingerprint,
    )
    apply_plan(moe, plan)
    timer.lap("surgery")
    report = {
        "command": "prune",
        "moeprune_version": __version__,
        "model": str(model_path),
        "output": str(output),
        "model_type": moe.model_type,
        "criterion": crit.name,
        "prune_first": crit.prune_first,
        "allocation": allocation,
        "method": method,
        "sparsity": sparsity,
        "budget_experts_removed": plan.extra.get("budget"),
        "removed_per_layer": {str(lp.layer): len(lp.dropped) for lp in plan.layers},
        "layers_before": before_layers,
        "layers_after": layer_summary(moe),
        "parameters_before": before_params,
        "parameters_after": moe.parameter_counts(),
        "data": data_summary(sets, stats),
        "unseen_experts": unseen_note(stats if len(stats) > 1 else stats[0]) if stats else [],
        "scores": scores_document(crit, scores, stats),
    }

    def write(tmp: Path) -> None:
        report["format"] = save_pretrained(model, tmp, tokenizer)
        plan.save(tmp / "plan.json")
        timer.lap("save")
        report["timing_s"] = timer.total()
        write_json(tmp / "report.json", report)

    atomic_write_dir(output, write, overwrite=overwrite)
    return report
