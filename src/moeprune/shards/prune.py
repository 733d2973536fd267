"""Score and prune without ever holding the whole model (`score --streaming|--sequential`,
`prune --no-load`): weights streamed from the shards or statistics observed one decoder layer at
a time, then the shards rewritten one tensor (or byte range) at a time.

Only what a stock config can express is written this way: a uniform drop, or every routed
expert cut to the same K neurons. Under torchrun every rank observes its share of the data and
rank 0 alone writes.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from moeprune.allocate.limits import expert_allocation
from moeprune.checkpoint import check_model_path, check_output_dir, require_tokenizer, write_json
from moeprune.checkpoint.atomic import check_not_inside, output_lock, recover
from moeprune.checkpoint.files import stored_dtype
from moeprune.config import DataOptions, PruneConfig
from moeprune.criteria import (
    Criterion,
    LayerScores,
    compute_scores,
    get_criterion,
    scores_document,
    unseen_experts,
    unseen_note,
)
from moeprune.data.loading import CalibrationData, calibration_sets
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.sequential import observe_sequential_distributed
from moeprune.observe.stats import ExpertStats
from moeprune.report.prune_report import data_summary, no_load_report, report_markdown, weight_bytes
from moeprune.runtime.device import Placement
from moeprune.runtime.distributed import rank_and_world
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.shards.layout import meta_model
from moeprune.shards.neurons import check_stock_shrink, keep_summary, rewrite_neuron_checkpoint
from moeprune.shards.rewrite import rewrite_checkpoint
from moeprune.shards.weight_scores import score_checkpoint
from moeprune.surgery.neurons import check_importance, uniform_widths
from moeprune.surgery.parameters import describe_layers, routed_parameters
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import resolve_plan
from moeprune.surgery.registry import method_limits

NO_LOAD_METHODS = ("drop", "neurons")  # what can be written as a stock checkpoint without loading


def score_without_loading(
    model_path: str | Path,
    criterion: str,
    *,
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    dtype: str | None = None,
    progress: bool = True,
    observe_for: str = "",
    neurons: bool = False,
) -> tuple[Criterion, list[LayerScores], list[ExpertStats], list[CalibrationData]]:
    """Scores without ever holding the whole model: weights streamed from the shards, or
    calibration statistics observed one decoder layer at a time.

    `observe_for` names a surgery method that needs the statistics whatever the criterion
    (`neurons`: with neuron sums); the criterion is then only a label for a weight-only
    criterion, whose scores are not streamed (an empty list: the method does not use them).
    """
    crit = get_criterion(criterion)
    if not crit.needs_data and not observe_for:
        return crit, score_checkpoint(model_path, criterion, seed=seed), [], []
    data = data or DataOptions()
    tokenizer = require_tokenizer(check_model_path(model_path), tokenizer_path)
    placed = Placement.choose(data.device if data.device != "auto" else None, dtype)
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
            device=placed.device,
            dtype=placed.dtype,
            progress=progress,
            neurons=neurons,
            offload_dir=data.activations_dir,
        )
        for d in sets
    ]
    if not crit.needs_data:
        return crit, [], stats, sets
    scores = compute_scores(
        crit.name,
        stats=stats if len(stats) > 1 else stats[0],
        seed=seed,
        layers=[s.layer for s in stats[0].layers],
    )
    return crit, scores, stats, sets


def prune_without_loading(
    model_path: str | Path,
    output: str | Path,
    config: PruneConfig,
    *,
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    command_line: str | None = None,
) -> dict:
    """Score without loading, then rewrite the shards: the whole model is never in memory.

    `config.method` "drop" removes whole experts (uniform allocation); "neurons" keeps each routed
    expert's top-K neurons (K the same for all: a stock checkpoint), chosen from neuron statistics
    observed layer by layer. Returns the report written beside the result.
    """
    if config.method not in NO_LOAD_METHODS or (config.allocation or "uniform") != "uniform":
        raise MoePruneError(
            f"pruning without loading rewrites shards for the {' or '.join(NO_LOAD_METHODS)} method with the uniform "
            f"allocation; the {config.method} method with {config.allocation or 'its'} allocation needs the loaded "
            "model",
            options=("no_load", "method"),
        )
    model_path = check_model_path(model_path)
    check_not_inside(output, [model_path])
    recover(Path(output))
    check_output_dir(output, overwrite)
    with output_lock(output) if rank_and_world()[0] == 0 else nullcontext(), RunLog.join(command_line):
        timer = Timer()
        moe = meta_model(model_path)
        if config.method == "neurons":
            return _shrink(
                model_path, output, moe, timer, config, data, tokenizer_path, dtype, overwrite, progress
            )
        return _drop(model_path, output, moe, timer, config, data, tokenizer_path, dtype, overwrite, progress)


def _write_evidence(tmp: Path, report: dict, timer: Timer, model_path: Path) -> None:
    """report.json, the run log and report.md into the folder about to be published."""
    report["timing_s"] = timer.total()
    report["disk_bytes"] = {"before": weight_bytes(model_path), "after": weight_bytes(tmp)}
    stored = stored_dtype(tmp)  # shards are copied as they are: the input's dtype
    report["save_dtype"] = str(stored).removeprefix("torch.") if stored is not None else None
    write_json(tmp / "report.json", report)
    RunLog.join().write(tmp)
    (tmp / "report.md").write_text(report_markdown(report, tmp))


def _drop(
    model_path: Path,
    output,
    moe: MoEModel,
    timer: Timer,
    config: PruneConfig,
    data,
    tokenizer_path,
    dtype,
    overwrite: bool,
    progress: bool,
) -> dict:
    limits = method_limits(moe, "drop", config.expert_multiple)
    expert_allocation(
        moe, get_criterion(config.criterion), [], config.sparsity, "uniform", limits
    )  # before scoring
    crit, scores, stats, sets = score_without_loading(
        model_path,
        config.criterion,
        data=data,
        tokenizer_path=tokenizer_path,
        seed=config.seed,
        dtype=dtype,
        progress=progress,
    )
    timer.lap("score")
    plan = build_plan(
        moe,
        crit,
        scores,
        sparsity=config.sparsity,
        allocation="uniform",
        method="drop",
        expert_multiple=config.expert_multiple,
    )
    report = {
        **no_load_report(model_path, output, moe.model_type, crit.name, "drop", config.sparsity),
        "budget_experts_removed": plan.extra.get("budget"),
        "removed_per_layer": {str(lp.layer): len(lp.dropped) for lp in plan.layers},
        "data": data_summary(sets, stats),
        "unseen": unseen_experts(stats) if stats else {},
        "scores": scores_document(crit, scores, stats),
    }

    def extra(tmp: Path) -> None:
        timer.lap("rewrite")
        _write_evidence(tmp, report, timer, model_path)

    if rank_and_world()[0] == 0:
        rewrite_checkpoint(model_path, output, plan, overwrite=overwrite, extra=extra)
    return report


def _shrink(
    model_path: Path,
    output,
    moe: MoEModel,
    timer: Timer,
    config: PruneConfig,
    data,
    tokenizer_path,
    dtype,
    overwrite: bool,
    progress: bool,
) -> dict:
    """Observe with neuron sums, plan one width for every expert, rewrite expert by expert."""
    importance = check_importance(config.neuron_importance)
    check_stock_shrink(moe)  # before any observation
    uniform_widths(moe, config.sparsity)
    before_layers, before_params = describe_layers(moe), routed_parameters(moe)
    crit, scores, stats, sets = score_without_loading(
        model_path,
        config.criterion,
        data=data,
        tokenizer_path=tokenizer_path,
        seed=config.seed,
        dtype=dtype,
        progress=progress,
        observe_for="the neurons method",
        neurons=True,
    )
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    plan = build_plan(
        moe,
        crit,
        scores,
        sparsity=config.sparsity,
        allocation="uniform",
        method="neurons",
        data_fingerprint=fingerprint,
        stats=stats,
        neuron_importance=importance,
    )
    keep = resolve_plan(moe, plan, stats if len(stats) > 1 else stats[0]).keep
    width = next((c for lp in plan.layers for c in lp.neurons.values()), moe.layers[0].intermediate_size)
    report = {
        **no_load_report(model_path, output, moe.model_type, crit.name, "neurons", config.sparsity),
        "prune_first": crit.prune_first,
        "sparsity_unit": "routed-expert parameters",
        "surgery": {
            "form": "rectangular",
            **({"intermediate_size": width} if keep else {"packed_layers": []}),
        },
        "kept_neurons": {"importance": importance, **keep_summary(keep)},
        "layers_before": before_layers,
        "parameters_before": before_params,
        "data": data_summary(sets, stats),
        "unseen_experts": unseen_note(stats),
        "unseen": unseen_experts(stats),
        "scores": scores_document(crit, scores, stats),
    }

    def extra(tmp: Path) -> None:
        after = meta_model(tmp)  # the written config, on the meta device
        report["layers_after"], report["parameters_after"] = describe_layers(after), routed_parameters(after)
        timer.lap("rewrite")
        _write_evidence(tmp, report, timer, model_path)

    if rank_and_world()[0] == 0:
        rewrite_neuron_checkpoint(model_path, output, plan, keep, overwrite=overwrite, extra=extra)
    return report
