"""Score and prune without ever holding the whole model (`score --streaming|--sequential`,
`prune --no-load`): weights streamed from the shards or statistics observed one decoder layer at
a time, then the shards rewritten one tensor (or byte range) at a time.

Whole experts dropped by the uniform or the global allocation are written this way (a stock
checkpoint when every layer keeps the same count, moeprune's format otherwise: the global
allocation, or layers kept whole such as DeepSeek-V4's hash layers), or every routed expert cut
to the same K neurons (a stock checkpoint). Under torchrun every rank observes its share of the data and
rank 0 alone writes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from moeprune.checkpoint import check_model_path, require_tokenizer
from moeprune.checkpoint.files import stored_dtype
from moeprune.checkpoint.quantized import check_quantized
from moeprune.checkpoint.structure import read_config_dict
from moeprune.config import DataOptions, Recipe, RunOptions, SaveOptions
from moeprune.criteria import (
    Criterion,
    LayerScores,
    compute_scores,
    get_criterion,
    scores_document,
    unseen_experts,
    unseen_note,
)
from moeprune.criteria.super_experts import GUARD_STATISTICS, as_report, guard_note
from moeprune.data.loading import CalibrationData, calibration_sets
from moeprune.errors import MoePruneError
from moeprune.job.evidence import Evidence, write_evidence
from moeprune.job.prepare import PruneRequest
from moeprune.models import MoEModel
from moeprune.observe.kinds import NONE, Statistics, union
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.quant.support import NEURON_ROUTE, refuse_quantized
from moeprune.report.document import PruneReport
from moeprune.report.parts import DataSummary, LayerShape, ParameterCounts, Serving, Surgery, TargetSize
from moeprune.report.prune_report import weight_bytes
from moeprune.runtime.atomic import check_not_inside, check_output_dir, output_lock, recover
from moeprune.runtime.device import SPREAD, Placement
from moeprune.runtime.distributed import rank_and_world
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.serve.vllm_native import write_native
from moeprune.shards.layout import CheckpointLayout, meta_model, quantization_format
from moeprune.shards.mtp import NEURONS_SKIP_MTP, MtpPlan
from moeprune.shards.neurons import check_stock_shrink, keep_summary, rewrite_neuron_checkpoint
from moeprune.shards.rewrite import DROP_MTP, release_mtp, rewrite_checkpoint, stock_counts
from moeprune.shards.sequential import SequentialOptions, observe_sequential_distributed
from moeprune.shards.weight_bytes import stored_format, stored_weight_bytes
from moeprune.shards.weight_scores import score_checkpoint
from moeprune.surgery.neurons import NeuronOptions, uniform_widths
from moeprune.surgery.parameters import describe_layers, routed_parameters
from moeprune.surgery.planning import (
    build_plan,
    check_config,
    check_feasible,
    check_fixed_layers,
    guard_super_experts,
    requirements,
)
from moeprune.surgery.plans import resolve_plan
from moeprune.surgery.registry import ResolvedConfig, options_as
from moeprune.surgery.target_size import WeightBytes, check_target_config, planned_bytes, solve_target

NO_LOAD_COUNTS = ("without loading", "or prune the loaded model", ("sparsity", "no_load"))


GUARD = "the super-expert guard"  # observe_for: the data is read only to find the super experts


def score_without_loading(
    model_path: str | Path,
    criterion: str,
    *,
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    observe_for: str = "",
    statistics: Statistics = NONE,
) -> tuple[Criterion, list[LayerScores], list[ExpertStats], list[CalibrationData]]:
    """Scores without ever holding the whole model: weights streamed from the shards, or
    calibration statistics observed one decoder layer at a time.

    `observe_for` names a surgery method that needs the statistics whatever the criterion
    (`statistics` holding Statistic.NEURONS: with neuron sums); the criterion is then only a label for a weight-only
    criterion, whose scores are not streamed (an empty list: the method does not use them).
    `observe_for=GUARD`: calibration data, when given, is observed for a weight-only criterion
    too, only to find the super experts (its scores are still streamed from the shards).
    The pass records what the criterion and the guard declare, plus `statistics` (the run's
    `Requirements.statistics`).
    """
    crit = get_criterion(criterion)
    if observe_for == GUARD and (crit.needs_data or not (data and data.sources)):
        observe_for = ""  # the criterion observes anyway, or no data was given (not checked)
    guard = observe_for == GUARD
    if not crit.needs_data and not observe_for:
        return crit, score_checkpoint(model_path, criterion, seed=seed), [], []
    checked = check_model_path(model_path)
    check_quantized(checked)  # a format moeprune cannot read, or missing scales: refused before the data
    data = data or DataOptions()
    tokenizer = require_tokenizer(check_model_path(model_path), tokenizer_path)
    placed = Placement.choose(data.device if data.device != SPREAD else None, data.dtype)
    sets = calibration_sets(
        tokenizer, data, per_domain=crit.per_domain, why=observe_for or f"criterion {crit.name!r}"
    )
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    stats = [
        observe_sequential_distributed(
            model_path,
            d,
            batch_size=data.batch_size,
            pad_token_id=pad,
            options=SequentialOptions(
                placed, data.activations_dir, union(crit.statistics, GUARD_STATISTICS, statistics)
            ),
            progress=progress,
        )
        for d in sets
    ]
    if not crit.needs_data:
        return crit, score_checkpoint(model_path, criterion, seed=seed) if guard else [], stats, sets
    scores = compute_scores(
        crit.name,
        stats=stats if len(stats) > 1 else stats[0],
        seed=seed,
        layers=[s.layer for s in stats[0].layers],
    )
    return crit, scores, stats, sets


def prune_without_loading(request: PruneRequest) -> dict:
    """Score without loading, then rewrite the shards: the whole model is never in memory (the
    body of the `no-load` pipeline, moeprune.job.pipelines, which checks the config first).

    `config` is resolved (its allocation set) and accepted by the pipeline: a method that drops whole
    experts with the uniform or global allocation (the uniform one on a model whose every layer can
    lose experts must keep one count: a stock checkpoint, `stock_only`), or a neuron
    method keeping each routed expert's top-K neurons (K the same for all: a stock checkpoint),
    chosen from neuron statistics observed layer by layer. Returns the report written beside the result.
    """
    model_path, output, config, run = (
        request.model_path,
        request.output,
        check_config(request.config),
        request.run,
    )
    data, tokenizer_path = request.data, request.tokenizer_path
    model_path = check_model_path(model_path)
    check_not_inside(output, [model_path])
    recover(Path(output))
    check_output_dir(output, run.overwrite)
    path = Path(model_path)
    moe = meta_model(path)
    check_fixed_layers(moe, config.method_spec)  # the neuron methods cannot keep a layer whole: refused now
    config, target, size = _solve_target(path, moe, config)  # before the lock: a refusal creates nothing
    if run.dry_run:
        return _plan_of_work(path, Path(output), moe, config, size, target)
    with output_lock(output) if rank_and_world()[0] == 0 else nullcontext(), RunLog.join(run.command_line):
        job = _NoLoadJob(
            path, Path(output), moe, Timer(), config, data, tokenizer_path, run, target, request.save.drop_mtp
        )
        return _shrink(job) if config.method_spec.neurons else _drop(job)


def stock_only(moe: MoEModel, config: ResolvedConfig) -> bool:
    """Whether the result must be a stock checkpoint (one expert count for every layer): the
    uniform allocation on a model whose every MoE layer can lose experts, the same sparsity in
    every layer as a stock config says it. Otherwise the counts differ by design (the global
    allocation, or layers kept whole: DeepSeek-V4's hash layers) and the rewrite writes them in
    moeprune's format, as the in-memory pipeline does."""
    return not moe.fixed_layers and config.allocator.fixed


def _solve_target(
    path: Path, moe: MoEModel, config: ResolvedConfig
) -> tuple[ResolvedConfig, TargetSize | None, WeightBytes]:
    """A `target_size` solved into the sparsity of a uniform plan, counted in the input's stored
    format (the rewrite copies tensors as they are: fp8 experts with their scales); also the sizes
    a dry run prints."""
    size = stored_weight_bytes(CheckpointLayout(path))
    target_bytes = check_target_config(config)
    if target_bytes is None:
        return config, None, size
    solution = solve_target(moe, config, size, target_bytes, stock=stock_only(moe, config))
    target = TargetSize(
        solution.target_bytes,
        solution.sparsity,
        size.format,
        solution.predicted_bytes,
        None,
        solution.unpruned_bytes,
        solution.step_below,
        solution.step_below_bytes,
    )
    return replace(config, sparsity=solution.sparsity, target_size=None), target, size


def _plan_of_work(
    path: Path,
    output: Path,
    moe: MoEModel,
    config: ResolvedConfig,
    size: WeightBytes,
    target: TargetSize | None,
) -> dict:
    """What a no-load prune would do (`run.dry_run`), in the keys of the in-memory dry run: its
    structure, the uniform plan's counts, the sizes; nothing is observed, scored or written."""
    if config.method_spec.neurons:
        check_stock_shrink(moe)
    elif stock_only(moe, config):
        stock_counts(moe, config, NO_LOAD_COUNTS)
    known = check_feasible(moe, config)
    out = {
        "model": str(path),
        "family": moe.model_type,
        "moe_layers": [m.index for m in moe.layers],
        "experts_per_layer": [m.num_experts for m in moe.layers],
        "top_k": [m.top_k for m in moe.layers],
        "criterion": config.criterion,
        "allocation": config.allocation,
        "method": config.method,
        "sparsity": config.sparsity,
        "sparsity_unit": config.method_spec.sparsity_unit,
        **known,
        "calibration": [],  # read (and counted) when the layers are observed
        "search_data": None,
        "output": str(output),
        "save_dtype": size.format,
        "resume": False,
        "input_format": stored_format(path),
        "input_bytes": weight_bytes(path),
        "output_format": size.format,
        "predicted_bytes": planned_bytes(moe, config, size),
    }
    if target is not None:
        out |= {
            "target_bytes": target.target_bytes,
            "solved_sparsity": target.sparsity,
            "step_below": target.step_below,
            "step_below_bytes": target.step_below_bytes,
        }
    return out


def _publish(tmp: Path, job: _NoLoadJob, report: PruneReport, plan: Plan) -> None:
    """The evidence of a no-load result, by the writer the in-memory pipeline uses too; the saved
    format is read off the rewritten shards (they are the input's, copied: its dtype, or its
    quantization with the scales)."""
    stored = stored_dtype(tmp)
    report.save_dtype = str(stored).removeprefix("torch.") if stored is not None else None
    kept = quantization_format(tmp)
    if kept is not None:
        report.save_dtype = kept.saved_as
    recipe = Recipe(
        job.config,
        job.data or DataOptions(),
        save=SaveOptions(drop_mtp=job.drop_mtp),
        pipeline="no-load",
        target_size=job.target.target_bytes if job.target is not None else None,
    )
    job.timer.lap("rewrite")
    evidence = Evidence(
        job.model_path,
        job.output,
        report,
        plan,
        recipe,
        job.moe,
        RunLog.join(),
        job.timer,
        tokenizer_path=Path(job.tokenizer_path) if job.tokenizer_path else None,
    )
    native = write_native(tmp) if report.format == "moeprune" else None  # vLLM 0.33's own description
    if native is not None:  # a result with novices (the no-load methods write none today)
        report.serving = report.serving or Serving()
        report.serving.vllm_native = native
    write_evidence(tmp, evidence, meta_model(tmp))


@dataclass
class _NoLoadJob:
    """One no-load prune: the input, its structure on the meta device, and the options."""

    model_path: Path
    output: Path
    moe: MoEModel
    timer: Timer
    config: ResolvedConfig
    data: DataOptions | None
    tokenizer_path: str | Path | None
    run: RunOptions
    target: TargetSize | None = None  # the size target, when the sparsity was solved for one
    drop_mtp: bool = False  # leave out the release's multi-token-prediction layers


def _release_mtp(job: _NoLoadJob, plan: Plan, report: PruneReport, left_out: str = "") -> MtpPlan | None:
    """What the rewrite does with the input's MTP layers, said in the report and the run log."""
    mtp = release_mtp(job.model_path, plan, DROP_MTP if job.drop_mtp else left_out)
    if mtp is not None:
        report.release_layers = [mtp.note()]
        RunLog.join().note(mtp.note())
    return mtp


def _drop(job: _NoLoadJob) -> dict:
    model_path, output, moe, timer, config = job.model_path, job.output, job.moe, job.timer, job.config
    if stock_only(moe, config):
        stock_counts(moe, config, NO_LOAD_COUNTS)  # before scoring
    crit, scores, stats, sets = score_without_loading(
        model_path,
        config.criterion,
        data=job.data,
        tokenizer_path=job.tokenizer_path,
        seed=config.seed,
        progress=job.run.progress,
        observe_for=GUARD,
        statistics=requirements(config).statistics,
    )
    found = guard_super_experts(moe, config, stats)  # refuses a budget only removing one could meet
    timer.lap("score")
    plan = build_plan(moe, crit, scores, config=config)
    report = PruneReport.no_load(
        model_path,
        output,
        moe.model_type,
        crit.name,
        config.method,
        config.sparsity_value(),
        str(config.allocation),
        budget_experts_removed=plan.extra.get("budget"),
        removed_per_layer={str(lp.layer): len(lp.dropped) for lp in plan.layers},
        data=DataSummary.of(sets, stats),
        unseen=unseen_experts(stats) if stats else {},
        super_experts=as_report(found) if found is not None else None,
        super_experts_note=guard_note(found, config.allow_super_experts),
        scores=scores_document(crit, scores, stats),
        target=job.target,
    )
    report.kept_whole = plan.extra.get("kept_whole")
    if not plan.is_uniform():  # the global allocation, or layers kept whole: moeprune's format
        report.format = "moeprune"

    mtp = _release_mtp(job, plan, report)
    if rank_and_world()[0] == 0:
        rewrite_checkpoint(
            model_path,
            output,
            plan,
            overwrite=job.run.overwrite,
            extra=lambda tmp: _publish(tmp, job, report, plan),
            stock=False,  # different counts (checked above where a stock result is due) in moeprune's format
            mtp=mtp,
        )
    return report.to_json()


def refuse_whole_super_experts(moe: MoEModel, config: ResolvedConfig) -> None:
    """Right after observation: the neurons method keeps guarded super experts whole, a result in
    moeprune's format (per-expert widths) that a rewrite of the shards does not write."""
    if not moe.protected or not any(
        uniform_widths(moe, config.sparsity_value(), config.options.width_multiple)[pos] < m.intermediate_size
        for pos, m in enumerate(moe.layers)
        if moe.protected.get(m.index)
    ):
        return
    raise MoePruneError(
        f"super experts found ({as_report(moe.protected)}): the neurons method keeps them whole, a result in "
        "moeprune's format (per-expert widths) that rewriting the shards does not write; prune with the model "
        "loaded, or give --allow-super-experts for a stock checkpoint (they are narrowed too)",
        options=("no_load", "allow_super_experts"),
    )


def _shrink(job: _NoLoadJob) -> dict:
    """Observe with neuron sums, plan one width for every expert, rewrite expert by expert."""
    model_path, output, moe, timer, config = job.model_path, job.output, job.moe, job.timer, job.config
    importance = options_as(config, NeuronOptions).neuron_importance  # validated once
    refuse_quantized(
        model_path,
        read_config_dict(Path(model_path)),
        "the neurons method",
        NEURON_ROUTE,
        options=("method",),
    )
    check_stock_shrink(moe)  # before any observation
    uniform_widths(moe, config.sparsity_value(), config.options.width_multiple)
    before_layers, before_params = describe_layers(moe), routed_parameters(moe)
    crit, scores, stats, sets = score_without_loading(
        model_path,
        config.criterion,
        data=job.data,
        tokenizer_path=job.tokenizer_path,
        seed=config.seed,
        progress=job.run.progress,
        observe_for="the neurons method",
        statistics=requirements(config).statistics,  # the neurons method's: Statistic.NEURONS
    )
    found = guard_super_experts(moe, config, stats)
    refuse_whole_super_experts(moe, config)
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    plan = build_plan(
        moe,
        crit,
        scores,
        config=config,
        data_fingerprint=fingerprint,
        stats=stats,
    )
    keep = resolve_plan(moe, plan, stats if len(stats) > 1 else stats[0]).keep
    width = next((c for lp in plan.layers for c in lp.neurons.values()), moe.layers[0].intermediate_size)
    report = PruneReport.no_load(
        model_path,
        output,
        moe.model_type,
        crit.name,
        config.method,
        config.sparsity_value(),
        str(config.allocation),
        prune_first=crit.prune_first,
        sparsity_unit=config.method_spec.sparsity_unit,
        surgery=Surgery(form="rectangular", intermediate_size=width)
        if keep
        else Surgery(form="rectangular", packed_layers=[]),
        kept_neurons={"importance": importance, **keep_summary(keep)},
        layers_before=LayerShape.rows(before_layers),
        parameters_before=ParameterCounts.from_json(before_params),
        data=DataSummary.of(sets, stats),
        unseen_experts=unseen_note(stats),
        unseen=unseen_experts(stats),
        super_experts=as_report(found) if found is not None else None,
        super_experts_note=guard_note(found, config.allow_super_experts, config.method_spec.super_experts),
        scores=scores_document(crit, scores, stats),
        target=job.target,
    )

    def extra(tmp: Path) -> None:
        after = meta_model(tmp)  # the written config, on the meta device
        report.layers_after = LayerShape.rows(describe_layers(after))
        report.parameters_after = ParameterCounts.from_json(routed_parameters(after))
        _publish(tmp, job, report, plan)

    mtp = _release_mtp(job, plan, report, NEURONS_SKIP_MTP)
    if rank_and_world()[0] == 0:
        rewrite_neuron_checkpoint(
            model_path, output, plan, keep, overwrite=job.run.overwrite, extra=extra, mtp=mtp
        )
    return report.to_json()
