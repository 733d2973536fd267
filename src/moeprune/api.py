"""The Python API's one verb: prune a loaded model in place.

- `prune(model, config, data=...)` prunes an already loaded transformers MoE model in place and
  returns a `PruneResult` (plan, scores, statistics, report), like torchao's `quantize_`.

The file-level jobs the command line runs (`prune_checkpoint`, `prepare`, `prepare_score`,
`score_loaded`) are in `moeprune.job`; they call this same verb, so the API on a loaded model and
the CLI on the same arguments give the same result (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from moeprune.allocate.limits import layer_limits
from moeprune.allocate.registry import searches
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
from moeprune.search.gradient import gradient_allocation
from moeprune.search.gradient_mixed import check_gradient_family, gradient_mixed_allocation
from moeprune.search.mixed_search import search_mixed
from moeprune.search.options import SearchRuntime
from moeprune.search.run import search_allocation
from moeprune.serve.vllm.layout import SERVED_FAMILIES, refusal
from moeprune.surgery import METHODS
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import fit_every_novice, fit_novices, plan_checks, plan_rank
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
    config = check_config(config)
    if config.sparsity is None:
        raise MoePruneError(
            "prune() of a loaded model takes a sparsity: a target size is solved from a checkpoint's "
            "files and the format it is saved in (moeprune.prune_checkpoint)",
            options=("sparsity", "target_size"),
        )
    moe = MoEModel(model)
    check_not_packed(moe)
    check_feasible(moe, config)
    if config.method == "mixed" and config.allocation == "gradient":  # before any data is read
        check_gradient_family(moe, layer_limits(moe, config.expert_multiple))
    method = METHODS.get(config.method)
    auto = config.criterion == AUTO
    crit = get_criterion("reap" if auto else config.criterion)  # auto: one observation feeds every criterion
    batch_size, progress = options.batch_size, run.progress
    needs = requirements(config)  # without a reason to, calibration data is not read at all
    sets = (
        _as_sets(data, tokenizer, options, needs.per_domain, needs.calibration or "the super-expert guard")
        if needs.reads_calibration(data is not None)
        else []
    )
    needs.check(calibration=bool(sets))
    search_options = replace(
        options, samples=config.search.samples or None, packing=False
    )  # answers stay whole
    search_set = (
        _as_sets(search_data, tokenizer, search_options, False, "the search")[0]
        if search_data is not None
        else None
    )
    needs.check(search=search_set is not None)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    before_layers, before_params, kept_before = (
        describe_layers(moe),
        routed_parameters(moe),
        kept_per_layer(moe),
    )
    if run.observed is not None:  # the caller's pass over the same model and data (job/run.py)
        crit, scores, stats = run.observed
    else:
        crit, scores, stats = score_experts(
            moe,
            crit.name,
            sets,
            batch_size=batch_size,
            pad_token_id=pad,
            seed=config.seed,
            progress=progress,
            statistics=needs.statistics,  # the method's neuron sums among them
        )
    found = guard_super_experts(moe, config, stats)  # refuses a budget only removing one could meet
    auto_table = None
    if auto:
        assert search_set is not None  # needs.check refused a choice of criterion without search data
        best, auto_table = choose_criterion(
            moe,
            stats,
            search_set,
            config=config,
            runtime=SearchRuntime(batch_size=batch_size, pad_token_id=pad, progress=progress),
        )
        crit = get_criterion(best)
        scores = compute_scores(
            best,
            stats=(stats if len(stats) > 1 else stats[0]) if crit.needs_data else None,
            weights=moe.layers if crit.needs_weights else None,
            seed=config.seed,
            layers=[m.index for m in moe.layers],
        )
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    search_doc, plan_scores = None, scores
    every_novice = run.novices  # a mixed search's rank-R novices: scored by the search, saved by the plan
    checks = FitChecks(data=search_set)  # low-rank fits: checked on the search data, or held-back calibration
    removed: Sequence[Any] | None = None  # drop counts, or mixed genes (one tuple per MoE layer)
    if run.removed is not None:  # drop counts, or mixed genes (a tuple per layer)
        removed = [tuple(int(x) for x in r) if isinstance(r, tuple) else int(r) for r in run.removed]
    elif searches(config.allocation):
        assert search_set is not None  # needs.check refused a search without search data
        runtime = SearchRuntime(
            batch_size=batch_size,
            pad_token_id=getattr(tokenizer, "pad_token_id", None),
            progress=progress,
            state_path=search_state,
            resume=run.resume,
            candidate_context=method.search_context(moe, stats, config.options),
        )
        mixed = config.method == "mixed"  # genes per layer, not drop counts
        if mixed and config.options.novice_rank:  # resolved: MixedOptions
            every_novice = fit_every_novice(
                moe,
                config.options.novice_rank,
                sets,
                batch_size=batch_size,
                pad_token_id=pad,
                progress=progress,
                checks=checks,
            )
        if mixed and config.allocation == "gradient":  # forms per expert: its orders go to the plan
            removed, plan_scores, search_doc = gradient_mixed_allocation(
                moe, crit, scores, stats, search_set, config=config, runtime=runtime, novices=every_novice
            )
        elif config.allocation == "gradient":  # chooses the experts too: its order goes to the plan
            removed, plan_scores, search_doc = gradient_allocation(
                moe, crit, scores, search_set, config=config, runtime=runtime
            )
        elif mixed:
            removed, search_doc = search_mixed(
                moe, crit, scores, stats, search_set, config=config, runtime=runtime, novices=every_novice
            )
        else:
            removed, search_doc = search_allocation(
                moe, crit, scores, stats, search_set, config=config, runtime=runtime
            )
    plan = build_plan(
        moe, crit, plan_scores, config=config, stats=stats, removed=removed, data_fingerprint=fingerprint
    )
    if run.check_plan is not None:  # a caller's refusal of the plan, before the model is changed
        run.check_plan(plan)
    fits = fit_novices(
        moe, plan, sets, batch_size=batch_size, pad_token_id=pad, progress=progress, fitted=every_novice,
        checks=checks,
    )  # fmt: skip
    surgery, repaired = apply_repaired(  # --repair: distilled toward the full model after the cut
        moe,
        plan,
        stats,
        fits if plan_rank(plan) else None,
        config=config,
        sets=sets,
        search=search_set,
        runtime=SearchRuntime(batch_size=batch_size, pad_token_id=pad, progress=progress),
    )
    report = PruneReport(
        criterion=crit.name,
        prune_first=crit.prune_first,
        allocation=str(config.allocation),  # resolved: check_config set it
        method=config.method,
        sparsity=config.sparsity,
        reroute=plan.extra.get("reroute"),  # drop --reroute none (a `next` plan has no such key)
        sparsity_unit=method.sparsity_unit,
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
        super_experts_note=guard_note(found, config.allow_super_experts, config.method),
        scores=scores_document(crit, scores, stats),
        repair=Repair.from_json(repaired) if repaired is not None else None,
    )
    if surgery.get("form") == "packed" or not moe.is_uniform():  # moeprune's format: vLLM needs the plugin
        report.serving = (
            Serving.of(served_parameters(moe)["total"])
            if moe.model_type in SERVED_FAMILIES
            else Serving(vllm_refused=refusal(moe.model_type))
        )
    if auto_table is not None:
        report.criterion_auto = CriterionAuto(config.search.fitness, crit.name, auto_table)
    if search_doc is not None:
        report.search = SearchSummary.from_json(search_doc)
    if plan_checks(plan, checks.found):
        report.novice_fits = NoviceFits.of(plan_checks(plan, checks.found), checks.source)
    return PruneResult(model, plan, crit, scores, stats, report, search_doc, sets)
