"""The Python API's one verb: prune a loaded model in place.

- `prune(model, config, data=...)` prunes an already loaded transformers MoE model in place and
  returns a `PruneResult` (plan, scores, statistics, report), like torchao's `quantize_`.

The file-level jobs the command line runs (`prune_checkpoint`, `prepare`, `prepare_score`,
`score_loaded`) are in `moeprune.job`; they call this same verb, so the API on a loaded model and
the CLI on the same arguments give the same result (tested).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

import moeprune.search.forms  # noqa: F401 - each search registers itself (search/registry.py)
import moeprune.search.gradient  # noqa: F401
import moeprune.search.run  # noqa: F401
from moeprune.config import DataOptions, PruneConfig, RunOptions
from moeprune.criteria import (
    AUTO,
    Criterion,
    LayerScores,
    compute_scores,
    get_criterion,
    score_experts,
    scores_document,
    unseen_experts,
    unseen_note,
)
from moeprune.criteria.super_experts import as_report, guard_note
from moeprune.data.loading import CalibrationData, calibration_sets
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.reshape import check_not_packed
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.repair import apply_repaired
from moeprune.report.document import PruneReport
from moeprune.report.parts import (
    CriterionAuto,
    DataSummary,
    KeptRow,
    LayerShape,
    NoviceFits,
    ParameterCounts,
    Repair,
    SearchSummary,
    Serving,
    Surgery,
)
from moeprune.search.auto import choose_criterion
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import Search, Searched, SearchJob, search_for
from moeprune.serve.vllm.layout import SERVED_FAMILIES, refusal
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import fit_novices, plan_checks, plan_rank
from moeprune.surgery.parameters import (
    describe_layers,
    kept_per_layer,
    kept_rows,
    routed_parameters,
    served_parameters,
)
from moeprune.surgery.planning import (
    build_plan,
    check_config,
    check_feasible,
    guard_super_experts,
    requirements,
)
from moeprune.surgery.registry import ResolvedConfig

_LOG = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the one verb
@dataclass
class PruneResult:
    """What `prune` did to the model (which is pruned in place)."""

    model: PreTrainedModel
    plan: Plan
    criterion: Criterion
    scores: list[LayerScores]
    stats: list[ExpertStats]
    report: PruneReport  # report.json's pruning facts (the file-level job adds paths, sizes, timings)
    search: dict | None = None  # search.json, when an EvoESAP search ran
    calibration: list[CalibrationData] = field(default_factory=list)


def _as_sets(data, tokenizer, options: DataOptions, per_domain: bool, why: str) -> list[CalibrationData]:
    """Calibration data given as loaded sets, or as files to tokenize now."""
    if data is None:
        return []
    if isinstance(data, CalibrationData):
        return [data]
    items = [data] if isinstance(data, str | Path) else list(data)
    loaded = [d for d in items if isinstance(d, CalibrationData)]
    if items and len(loaded) == len(items):
        return loaded
    if tokenizer is None:
        raise MoePruneError(
            "calibration data given as files needs the model's tokenizer", options=("tokenizer",)
        )
    return calibration_sets(
        tokenizer, replace(options, sources=[str(d) for d in items]), per_domain=per_domain, why=why
    )


@dataclass
class _Inputs:
    """The data a prune reads, read once: calibration sets, the search set, how batches are made."""

    sets: list[CalibrationData]
    search_set: CalibrationData | None
    batch_size: int
    pad_token_id: int | None  # the tokenizer's (None: it has none; batches then pad with 0)

    @property
    def pad(self) -> int:
        return self.pad_token_id or 0

    @classmethod
    def read(cls, config: ResolvedConfig, data, search_data, tokenizer, options: DataOptions) -> _Inputs:
        """Only what the config needs (calibration data for a data criterion or method, search data
        for a search), refused in one line when missing."""
        needs = requirements(config)  # without a reason to, calibration data is not read at all
        sets = (
            _as_sets(
                data, tokenizer, options, needs.per_domain, needs.calibration or "the super-expert guard"
            )
            if needs.reads_calibration(data is not None)
            else []
        )
        needs.check(calibration=bool(sets))
        search_options = replace(
            options, samples=config.search.samples or None, packing=False
        )  # answers whole
        search_set = (
            _as_sets(search_data, tokenizer, search_options, False, "the search")[0]
            if search_data is not None
            else None
        )
        needs.check(search=search_set is not None)
        return cls(sets, search_set, options.batch_size, getattr(tokenizer, "pad_token_id", None))


@dataclass
class _Observed:
    """The criterion, its scores and the statistics they come from, and the super-expert guard's find."""

    criterion: Criterion
    scores: list[LayerScores]
    stats: list[ExpertStats]
    found: dict[int, list[int]] | None
    auto_table: Any = None  # `criterion auto`: every criterion's fitness


def _observe(moe: MoEModel, config: ResolvedConfig, inputs: _Inputs, run: RunOptions) -> _Observed:
    """Score the experts (`run.observed`: the caller's pass over the same model and data), guard
    the super experts, and with `criterion auto` choose the criterion on the search data."""
    auto = config.criterion == AUTO
    crit = get_criterion("reap" if auto else config.criterion)  # auto: one observation feeds every criterion
    if run.observed is not None:
        crit, scores, stats = run.observed
    else:
        crit, scores, stats = score_experts(
            moe,
            crit.name,
            inputs.sets,
            batch_size=inputs.batch_size,
            pad_token_id=inputs.pad,
            seed=config.seed,
            progress=run.progress,
            statistics=requirements(config).statistics,  # the method's neuron sums among them
        )
    found = guard_super_experts(moe, config, stats)  # refuses a budget only removing one could meet
    if not auto:
        return _Observed(crit, scores, stats, found)
    assert inputs.search_set is not None  # needs.check refused a choice of criterion without search data
    runtime = SearchRuntime(batch_size=inputs.batch_size, pad_token_id=inputs.pad, progress=run.progress)
    best, table = choose_criterion(moe, stats, inputs.search_set, config=config, runtime=runtime)
    crit = get_criterion(best)
    scores = compute_scores(
        best,
        stats=(stats if len(stats) > 1 else stats[0]) if crit.needs_data else None,
        weights=moe.layers if crit.needs_weights else None,
        seed=config.seed,
        layers=[m.index for m in moe.layers],
    )
    return _Observed(crit, scores, stats, found, table)


def _search(
    moe: MoEModel,
    config: ResolvedConfig,
    search: Search | None,
    seen: _Observed,
    inputs: _Inputs,
    run: RunOptions,
    state: Path | None,
    checks: FitChecks,
) -> Searched:
    """The search's result, or what the caller chose already (`run.removed`, `run.novices`), or
    nothing (the allocation decides)."""
    if search is None:
        given = run.removed  # drop counts, or one gene tuple per MoE layer
        removed = (
            None if given is None else [tuple(map(int, r)) if isinstance(r, tuple) else int(r) for r in given]
        )
        return Searched(removed, novices=run.novices)
    assert inputs.search_set is not None  # needs.check refused a search without search data
    runtime = SearchRuntime(
        batch_size=inputs.batch_size,
        pad_token_id=inputs.pad_token_id,
        progress=run.progress,
        state_path=state,
        resume=run.resume,
        candidate_context=config.method_spec.search_context(moe, seen.stats, config.options),
    )
    job = SearchJob(
        moe, seen.criterion, seen.scores, seen.stats, inputs.search_set, config, runtime, inputs.sets, checks
    )
    found = search.run(job)
    if found.novices is None:
        found.novices = run.novices
    return found


def _report(
    moe: MoEModel,
    config: ResolvedConfig,
    plan: Plan,
    seen: _Observed,
    sets: list[CalibrationData],
    surgery: dict,
    before: tuple,
) -> PruneReport:
    """report.json's pruning facts: what was asked, what the model was and is, what the data saw."""
    crit, stats, found = seen.criterion, seen.stats, seen.found
    before_layers, before_params, kept_before = before
    report = PruneReport(
        criterion=crit.name,
        prune_first=crit.prune_first,
        allocation=config.allocation,
        method=config.method,
        sparsity=config.sparsity_value(),
        reroute=plan.extra.get("reroute"),  # drop --reroute none (a `next` plan has no such key)
        sparsity_unit=config.method_spec.sparsity_unit,
        expert_multiple=config.expert_multiple,
        budget_experts_removed=plan.extra.get("budget"),
        removed_per_layer={str(lp.layer): len(lp.dropped) + len(lp.novice) for lp in plan.layers},
        kept_whole=plan.extra.get("kept_whole"),
        surgery=Surgery.from_json(surgery),
        layers_before=LayerShape.rows(before_layers),
        layers_after=LayerShape.rows(describe_layers(moe)),
        parameters_before=ParameterCounts.from_json(before_params),
        parameters_after=ParameterCounts.from_json(routed_parameters(moe)),
        kept_per_layer=KeptRow.rows(kept_rows(kept_before, kept_per_layer(moe))),
        data=DataSummary.of(sets, stats),
        unseen_experts=unseen_note(stats) if stats else [],
        unseen=unseen_experts(stats) if stats else {},
        super_experts=as_report(found) if found is not None else None,
        super_experts_note=guard_note(found, config.allow_super_experts, config.method_spec.super_experts),
        scores=scores_document(crit, seen.scores, stats),
    )
    if surgery.get("form") == "packed" or not moe.is_uniform():  # moeprune's format: vLLM needs the plugin
        report.serving = (
            Serving.of(served_parameters(moe)["total"])
            if moe.model_type in SERVED_FAMILIES
            else Serving(vllm_refused=refusal(moe.model_type))
        )
    if seen.auto_table is not None:
        report.criterion_auto = CriterionAuto(config.search.fitness, crit.name, seen.auto_table)
    return report


def _one_recipe(config: PruneConfig) -> ResolvedConfig:
    """`config` resolved for a loaded model: one recipe at a sparsity (a target size and a race of
    recipes need the checkpoint's files)."""
    resolved = check_config(config)
    if resolved.sparsity is None:
        raise MoePruneError(
            "prune() of a loaded model takes a sparsity: a target size is solved from a checkpoint's "
            "files and the format it is saved in (moeprune.prune_checkpoint)",
            options=("sparsity", "target_size"),
        )
    if resolved.method_spec.portfolio is not None:
        raise MoePruneError(
            f"the {resolved.method} method races its recipes and saves the winner from a checkpoint "
            "(moeprune.prune_checkpoint); prune() of a loaded model takes one recipe",
            options=("method",),
        )
    return resolved


def prune(
    model: PreTrainedModel,
    config: PruneConfig,
    *,
    data=None,
    tokenizer=None,
    search_data=None,
    options: DataOptions | None = None,
    run: RunOptions | None = None,
    search_state: Path | None = None,
) -> PruneResult:
    """Prune a loaded transformers MoE model in place, as `config` says.

    `data` (calibration) and `search_data` are files (JSONL, text, parquet, ...; FILE:WEIGHT mixes
    them) read with `tokenizer` as `options` says (samples, max_length, batch_size, seed, packing),
    or already loaded `CalibrationData`. `search_state` checkpoints an EvoESAP search every
    generation; `run.resume` continues it. `run.removed` (experts removed per MoE layer, chosen
    already: the joint precision search, quantize/evo.py) replaces the allocation's counts and
    its search; all zeros keeps every expert (the config's sparsity then only passes the checks).
    """
    options, run = options or DataOptions(), run or RunOptions()
    resolved = _one_recipe(config)
    moe = MoEModel(model)
    check_not_packed(moe)
    check_feasible(moe, resolved)
    search = None if run.removed is not None else search_for(resolved)
    if search is not None and search.check is not None:  # before any data is read
        search.check(moe, resolved)
    inputs = _Inputs.read(resolved, data, search_data, tokenizer, options)
    before = (describe_layers(moe), routed_parameters(moe), kept_per_layer(moe))
    seen = _observe(moe, resolved, inputs, run)
    checks = FitChecks(data=inputs.search_set)  # rank-R fits: held-out search data, else calibration
    searched = _search(moe, resolved, search, seen, inputs, run, search_state, checks)
    plan = build_plan(
        moe,
        seen.criterion,
        seen.scores if searched.scores is None else searched.scores,  # a gradient search's orders
        config=resolved,
        stats=seen.stats,
        removed=searched.removed,
        data_fingerprint=",".join(d.fingerprint for d in inputs.sets),
    )
    if run.check_plan is not None:  # a caller's refusal of the plan, before the model is changed
        run.check_plan(plan)
    fits = fit_novices(
        moe,
        plan,
        inputs.sets,
        batch_size=inputs.batch_size,
        pad_token_id=inputs.pad,
        progress=run.progress,
        fitted=searched.novices,
        checks=checks,
    )
    surgery, repaired = apply_repaired(  # --repair: distilled toward the full model after the cut
        moe,
        plan,
        seen.stats,
        fits if plan_rank(plan) else None,
        config=resolved,
        sets=inputs.sets,
        search=inputs.search_set,
        runtime=SearchRuntime(batch_size=inputs.batch_size, pad_token_id=inputs.pad, progress=run.progress),
    )
    report = _report(moe, resolved, plan, seen, inputs.sets, surgery, before)
    report.repair = Repair.from_json(repaired) if repaired is not None else None
    report.search = SearchSummary.from_json(searched.doc) if searched.doc is not None else None
    fitted = plan_checks(plan, checks.found)
    report.novice_fits = NoviceFits.of(fitted, checks.source) if fitted else None
    return PruneResult(
        model, plan, seen.criterion, seen.scores, seen.stats, report, searched.doc, inputs.sets
    )
