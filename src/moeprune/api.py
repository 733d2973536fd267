"""The Python API: one verb to prune a loaded model in place, and the file-level jobs the command
line runs.

- `prune(model, config, data=...)` prunes an already loaded transformers MoE model in place and
  returns a `PruneResult` (plan, scores, statistics, report), like torchao's `quantize_`.
- `prune_checkpoint(model_path, output, config, ...)` is `moeprune prune`: every check that needs no
  weights first (`prepare`), then load, `prune`, and save the result with its evidence.
- `prepare_score(...)` and `score_loaded(...)` are `moeprune score` (weight-only criteria
  stream from the shards: `moeprune.shards.weight_scores.score_checkpoint`).

The command line calls these same functions, so the API on a loaded model and the CLI on the
same arguments give the same result (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from moeprune import __version__
from moeprune.allocate.registry import searches
from moeprune.checkpoint import (
    atomic_write_dir,
    build_skeleton,
    check_model_path,
    check_output_dir,
    load_config,
    load_placed,
    require_tokenizer,
    write_checkpoint,
    write_json,
)
from moeprune.checkpoint.atomic import check_creatable, check_not_inside, output_lock, recover
from moeprune.checkpoint.files import check_weights, parse_size, stored_dtype
from moeprune.checkpoint.quantized import QuantFormat, check_quantized
from moeprune.checkpoint.structure import read_config_dict
from moeprune.config import DataOptions, PruneConfig, RunOptions, SaveOptions, parse_target_size, split_legacy
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
from moeprune.data.loading import CalibrationData, calibration_sets, load_data, parse_source
from moeprune.errors import DataError, MoePruneError
from moeprune.models import MoEModel
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.quant.fp8 import FP8_SAVE_DTYPE, Fp8Format
from moeprune.quant.support import quantization_of
from moeprune.report.document import PRUNE, PruneReport
from moeprune.report.model_card import model_card
from moeprune.report.parts import (
    CriterionAuto,
    DataSummary,
    DiskBytes,
    KeptRow,
    LayerShape,
    ParameterCounts,
    SearchSummary,
    Serving,
    Surgery,
    TargetSize,
)
from moeprune.report.plots import plot_search_curve
from moeprune.report.prune_report import draw_kept, report_markdown, weight_bytes
from moeprune.runtime.device import Placement, precision_lost, resolve_dtype
from moeprune.runtime.distributed import barrier, rank_and_world
from moeprune.runtime.progress import stage, transformers_bars_off
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.search.auto import choose_criterion
from moeprune.search.options import SearchRuntime
from moeprune.search.run import search_allocation, search_state_path
from moeprune.serve.vllm.layout import SERVED_FAMILIES, refusal
from moeprune.shards.layout import CheckpointLayout
from moeprune.shards.rewrite import rewrite_checkpoint, rewrite_supports, stock_counts
from moeprune.shards.weight_bytes import cast_weight_bytes, stored_format, stored_weight_bytes
from moeprune.surgery import METHODS
from moeprune.surgery.drop import check_not_packed
from moeprune.surgery.parameters import (
    describe_layers,
    kept_per_layer,
    kept_rows,
    routed_parameters,
    served_parameters,
)
from moeprune.surgery.planning import apply_plan, build_plan, check_config, check_feasible, requirements
from moeprune.surgery.registry import default_allocation
from moeprune.surgery.target_size import TargetSolution, planned_bytes, solve_target

_LOG = logging.getLogger(__name__)

RECIPE = "recipe.json"
KEPT_COUNTS = (
    "to keep the input's quantization (written from its bytes)",
    "or save dequantized weights with --save-dtype bf16",
    ("sparsity", "save_dtype"),
)


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
    if items and all(isinstance(d, CalibrationData) for d in items):
        return items
    if tokenizer is None:
        raise MoePruneError(
            "calibration data given as files needs the model's tokenizer", options=("tokenizer",)
        )
    return calibration_sets(
        tokenizer, replace(options, sources=[str(d) for d in items]), per_domain=per_domain, why=why
    )


_PRUNE_LEGACY = {
    "samples": "samples",
    "max_length": "max_length",
    "batch_size": "batch_size",
    "data_seed": "seed",
    "packing": "packing",
}


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
    **legacy,
) -> PruneResult:
    """Prune a loaded transformers MoE model in place, as `config` says.

    `data` (calibration) and `search_data` are files (JSONL, text, parquet, ...; FILE:WEIGHT mixes
    them) read with `tokenizer` as `options` says (samples, max_length, batch_size, seed, packing),
    or already loaded `CalibrationData`. `search_state` checkpoints an EvoESAP search every
    generation; `run.resume` continues it. The former keywords (`samples=`, `max_length=`,
    `batch_size=`, `data_seed=`, `packing=`, `progress=`, `resume=`) still work, with a warning.
    """
    options, run = split_legacy(
        legacy,
        "prune",
        options=(options or DataOptions(), _PRUNE_LEGACY),
        run=(run or RunOptions(), {"progress": "progress", "resume": "resume"}),
    )
    config = check_config(config)
    if config.sparsity is None:
        raise MoePruneError(
            "prune() of a loaded model takes a sparsity: a target size is solved from a checkpoint's "
            "files and the format it is saved in (prune_checkpoint, moeprune.pipelines.run_pipeline)",
            options=("sparsity", "target_size"),
        )
    moe = MoEModel(model)
    check_not_packed(moe)
    check_feasible(moe, config)
    method = METHODS.get(config.method)
    auto = config.criterion == AUTO
    crit = get_criterion("reap" if auto else config.criterion)  # auto: one observation feeds every criterion
    batch_size, progress = options.batch_size, run.progress
    needs = requirements(config)  # without a reason to, calibration data is not read at all
    sets = (
        _as_sets(data, tokenizer, options, needs.per_domain, needs.calibration) if needs.calibration else []
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
    crit, scores, stats = score_experts(
        moe,
        crit.name,
        sets,
        batch_size=batch_size,
        pad_token_id=pad,
        seed=config.seed,
        progress=progress,
        neurons=method.neurons,
    )
    auto_table = None
    if auto:
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
    removed, search_doc = None, None
    if searches(config.allocation):
        removed, search_doc = search_allocation(
            moe,
            crit,
            scores,
            stats,
            search_set,
            config=config,
            runtime=SearchRuntime(
                batch_size=batch_size,
                pad_token_id=getattr(tokenizer, "pad_token_id", None),
                progress=progress,
                state_path=search_state,
                resume=run.resume,
                candidate_context=method.candidate_context(moe, stats) if method.candidate_context else None,
            ),
        )
    plan = build_plan(
        moe, crit, scores, config=config, stats=stats, removed=removed, data_fingerprint=fingerprint
    )
    surgery = apply_plan(moe, plan, stats)
    report = PruneReport(
        criterion=crit.name,
        prune_first=crit.prune_first,
        allocation=config.allocation,
        method=config.method,
        sparsity=config.sparsity,
        sparsity_unit=method.sparsity_unit,
        expert_multiple=config.expert_multiple,
        budget_experts_removed=plan.extra.get("budget"),
        removed_per_layer={str(lp.layer): len(lp.dropped) + len(lp.novice) for lp in plan.layers},
        surgery=Surgery.from_json(surgery),
        layers_before=LayerShape.rows(before_layers),
        layers_after=LayerShape.rows(describe_layers(moe)),
        parameters_before=ParameterCounts.from_json(before_params),
        parameters_after=ParameterCounts.from_json(routed_parameters(moe)),
        kept_per_layer=KeptRow.rows(kept_rows(kept_before, kept_per_layer(moe))),
        data=DataSummary.of(sets, stats),
        unseen_experts=unseen_note(stats) if stats else [],
        unseen=unseen_experts(stats) if stats else {},
        scores=scores_document(crit, scores, stats),
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
    return PruneResult(model, plan, crit, scores, stats, report, search_doc, sets)


# ----------------------------------------------------------------------------- prune a checkpoint
@dataclass(frozen=True)
class PlannedSizes:
    """The input's weights as stored and the result's as planned, in the format each is saved in
    (the dry run prints them), and the solution of a size target when one was given."""

    input_format: str
    input_bytes: int
    output_format: str
    predicted_bytes: int
    target: TargetSolution | None = None

    def describe(self) -> dict:
        out = {
            "input_format": self.input_format,
            "input_bytes": self.input_bytes,
            "output_format": self.output_format,
            "predicted_bytes": self.predicted_bytes,
        }
        if self.target is not None:
            out |= {
                "target_bytes": self.target.target_bytes,
                "solved_sparsity": self.target.sparsity,
                "step_below": self.target.step_below,
                "step_below_bytes": self.target.step_below_bytes,
            }
        return out

    def report(self, written: int) -> TargetSize | None:
        """report.json's `target`, once `written` bytes of tensors are on disk (None: no target)."""
        t = self.target
        if t is None:
            return None
        return TargetSize(
            t.target_bytes,
            t.sparsity,
            self.output_format,
            t.predicted_bytes,
            written,
            t.unpruned_bytes,
            t.step_below,
            t.step_below_bytes,
        )


def plan_sizes(
    model_path: Path, meta: MoEModel, config: PruneConfig, save_dtype: torch.dtype | None
) -> tuple[PruneConfig, PlannedSizes]:
    """The sizes of a job saved in `save_dtype` (None: as stored, a kept quantization's bytes and
    scales); a `target_size` is solved here into the config's sparsity (refused in one line when
    nothing fits, or when the unpruned model already does)."""
    if save_dtype is None:
        size = stored_weight_bytes(CheckpointLayout(model_path))
    else:
        size = cast_weight_bytes(model_path, meta, save_dtype)
    solution = None
    if config.target_size is not None:  # as stored: the rewrite writes one count in every layer
        target = parse_target_size(config.target_size)
        solution = solve_target(meta, config, size, target, stock=save_dtype is None)
        config = replace(config, sparsity=solution.sparsity, target_size=None)
    sizes = PlannedSizes(
        stored_format(model_path),
        weight_bytes(model_path),
        size.format,
        planned_bytes(meta, config, size),
        solution,
    )
    return config, sizes


@dataclass
class PruneJob:
    """A prune request after every check that needs no weights: what `prune_checkpoint` will do.

    Built by `prepare` in seconds (config, file headers, a model on the meta device, tokenized
    data), so that bad input fails before the expensive part; a dry run stops here.
    """

    model_path: Path
    output: Path
    config: PruneConfig
    data: DataOptions
    placement: Placement
    save_dtype: torch.dtype
    max_shard_size: int | str
    run: RunOptions
    meta: MoEModel  # the model on the meta device: structure only
    tokenizer: object | None
    calibration: list[CalibrationData]
    search_set: CalibrationData | None
    layer_budget: dict  # what is known per layer before scoring
    search_data: list[str] = field(default_factory=list)
    kept_quantization: QuantFormat | None = None  # the input's quantization, kept: written from its bytes

    @property
    def saved_as(self) -> str:
        """The saved weights' format, as the report names it."""
        if self.kept_quantization is not None:
            return self.kept_quantization.saved_as
        return str(self.save_dtype).removeprefix("torch.")

    sizes: PlannedSizes | None = None  # the input's weights and the result's, planned

    def describe(self) -> dict:
        """The plan of work, for a dry run and the log."""

        def counts(d) -> dict:
            return {
                "sources": list(d.sources),
                "samples": len(d.samples),
                "tokens": sum(len(s.input_ids) for s in d.samples),
                "truncated": d.truncated,
            }

        return {
            "model": str(self.model_path),
            "family": self.meta.model_type,
            "moe_layers": [m.index for m in self.meta.layers],
            "experts_per_layer": [m.num_experts for m in self.meta.layers],
            "top_k": [m.top_k for m in self.meta.layers],
            "criterion": self.config.criterion,
            "allocation": self.config.allocation,
            "method": self.config.method,
            "sparsity": self.config.sparsity,
            "sparsity_unit": METHODS.get(self.config.method).sparsity_unit,
            **self.layer_budget,
            "calibration": [counts(d) for d in self.calibration],
            "search_data": counts(self.search_set) if self.search_set is not None else None,
            "output": str(self.output),
            "save_dtype": self.saved_as,
            "resume": self.run.resume,
            **(self.sizes.describe() if self.sizes is not None else {}),
        }


def check_resume(output: Path, allocation: str, resume: bool, overwrite: bool) -> None:
    """Resuming continues an interrupted EvoESAP search; it never deletes or replaces anything."""
    if not resume:
        return
    if not searches(allocation):
        raise MoePruneError(
            "resuming continues an interrupted EvoESAP search; it needs the evo allocation",
            options=("resume", "allocation"),
        )
    if overwrite:
        raise MoePruneError(
            "resuming continues a search into a new output; it cannot also replace an existing one",
            options=("resume", "overwrite"),
        )
    if output.exists():
        raise MoePruneError(
            f"{str(output)!r} already exists and holds a finished result, not a search in progress: "
            "nothing to resume; choose another output",
            options=("resume",),
        )
    state = search_state_path(output)
    if not state.is_file():
        raise MoePruneError(
            f"nothing to resume: no search in progress for {str(output)!r} (no {state.name})",
            options=("resume",),
        )


def _check_sources(sources: Sequence[str], what: str) -> None:
    for source in sources:
        path = parse_source(source)[0]
        if not Path(path).exists():
            raise DataError(
                f"{what} path {path} does not exist", options=("search_data" if "search" in what else "data",)
            )


_JOB_LEGACY = {  # prune_checkpoint's and prepare's former keywords -> (parameter, field)
    "dtype": ("data", "dtype"),
    **{
        name: ("run", name)
        for name in ("overwrite", "resume", "dry_run", "trust_remote_code", "progress", "command_line")
    },
}


def _job_options(legacy: dict, where: str, data, run) -> tuple[DataOptions, RunOptions]:
    """The data and run options of a checkpoint job, the former keywords folded in."""
    return tuple(
        split_legacy(
            legacy,
            where,
            **{
                name: (obj, {k: f for k, (owner, f) in _JOB_LEGACY.items() if owner == name})
                for name, obj in (("data", data or DataOptions()), ("run", run or RunOptions()))
            },
        )
    )


def prepare(
    model_path: str | Path,
    output: str | Path,
    config: PruneConfig,
    *,
    data: DataOptions | None = None,
    search_data: Sequence[str] = (),
    tokenizer_path: str | Path | None = None,
    save: SaveOptions | None = None,
    run: RunOptions | None = None,
    **legacy,
) -> PruneJob:
    """Every check of a prune request that needs no weights, in the order a user would fix them."""
    data, run = _job_options(legacy, "prepare", data, run)
    save = save or SaveOptions()
    overwrite, resume, trust_remote_code = run.overwrite, run.resume, run.trust_remote_code
    config = check_config(config)
    if data.sequential:
        raise MoePruneError(
            "sequential (layer-by-layer) observation never loads the whole model: use it to score, "
            "or to prune without loading",
            options=("sequential",),
        )
    placement = Placement.choose(data.device, data.dtype)  # an unknown or absent device fails now
    model_path, output = check_model_path(model_path), Path(output)
    model_config = load_config(
        model_path, trust_remote_code
    )  # damaged, dense or unsupported: before anything else
    kept_quantization = _kept_quantization(model_path, config, save)
    check_weights(model_path)  # empty, truncated or missing shards
    check_not_inside(output, [model_path])
    recover(output)  # a killed earlier run: put its set-aside result back, drop its temporaries
    check_resume(output, config.allocation, resume, overwrite)
    check_output_dir(output, overwrite)
    needs = requirements(config)  # also refuses an unknown criterion or method
    needs.check(search=bool(search_data))
    _check_sources(search_data, "search data")
    needs.check(calibration=bool(data.sources))
    _check_sources(data.sources, "calibration data")
    meta = MoEModel(build_skeleton(model_path, meta=True))
    check_not_packed(meta)
    stored = stored_dtype(model_path) or getattr(model_config, "dtype", None)
    save_dtype = (
        resolve_dtype(save.dtype)
        if save.dtype and kept_quantization is None
        else (stored if isinstance(stored, torch.dtype) else torch.float32)
    )
    if config.target_size is None:
        check_feasible(meta, config)  # an impossible sparsity is refused before sizes are planned
    config, sizes = plan_sizes(model_path, meta, config, None if kept_quantization else save_dtype)
    if kept_quantization is not None:  # written from the input's bytes: one count in every layer
        stock_counts(meta, config, KEPT_COUNTS)
    layer_budget = check_feasible(meta, config)
    parse_size(save.max_shard_size)
    tokenizer, calibration, search_set = None, [], None
    if needs.calibration or needs.search:
        tokenizer = require_tokenizer(model_path, tokenizer_path, trust_remote_code)
        if needs.calibration:
            calibration = calibration_sets(tokenizer, data, per_domain=needs.per_domain)
        if needs.search:
            search_set = load_data(
                list(search_data),
                tokenizer,
                num_samples=config.search.samples or None,
                max_length=data.max_length,
                seed=data.seed,
            )
    lost = precision_lost(placement.dtype, save_dtype) if kept_quantization is None else None
    if lost:  # (a kept quantization is written from the input's bytes: no compute dtype reaches the disk)
        _LOG.warning(lost)
    return PruneJob(
        model_path,
        output,
        config,
        data,
        placement,
        save_dtype,
        save.max_shard_size,
        run,
        meta,
        tokenizer,
        calibration,
        search_set,
        layer_budget,
        list(search_data),
        kept_quantization,
        sizes,
    )


def _kept_quantization(model_path: Path, config: PruneConfig, save: SaveOptions) -> QuantFormat | None:
    """The input's quantization when the result keeps it: by default for a quantized input (a
    smaller model was asked for, never a silently up-cast one), unless a full-precision
    `save.dtype` asks for dequantized weights; `save.dtype` "float8_e4m3fn" asks for fp8 explicitly.

    Keeping it means writing the result from the input's bytes (`rewrite_checkpoint`), which
    writes what a stock checkpoint expresses: whole experts dropped, the same number per layer.
    Anything else is refused here, before the model is loaded, naming the ways that work.
    """
    fmt = check_quantized(model_path)  # a format moeprune cannot read, or missing scales, fail here
    asked = save.dtype is not None and str(save.dtype).removeprefix("torch.") == FP8_SAVE_DTYPE
    if asked and not isinstance(fmt, Fp8Format):
        raise MoePruneError(
            f"saving as fp8 keeps an fp8 input's blocks, and {model_path} is "
            f"{'not quantized' if fmt is None else fmt.saved_as} (moeprune does not quantize): save as fp32, "
            "bf16 or fp16",
            options=("save_dtype",),
        )
    if fmt is None or (save.dtype is not None and not asked):
        return None  # full precision in, or dequantized weights asked for
    allocation = config.allocation or default_allocation(config.method)
    if not rewrite_supports(config.method, allocation):
        described = quantization_of(read_config_dict(model_path))
        raise MoePruneError(
            f"{model_path} is quantized ({described}): a result in that format is written from the input's bytes, "
            "which expresses the uniform drop only (--method drop --allocation uniform; cutting neurons would "
            f"split scale blocks, per-layer counts need moeprune's format); for the {config.method} method with "
            f"the {allocation} allocation, save dequantized weights with --save-dtype bf16 (larger on disk)",
            options=("method", "allocation", "save_dtype"),
        )
    return fmt


def prune_checkpoint(
    model_path: str | Path,
    output: str | Path,
    config: PruneConfig,
    *,
    data: DataOptions | None = None,
    search_data: Sequence[str] = (),
    tokenizer_path: str | Path | None = None,
    save: SaveOptions | None = None,
    run: RunOptions | None = None,
    **legacy,
) -> dict:
    """`moeprune prune`: check, load, prune, save with evidence; returns report.json (with
    `run.dry_run`, the plan of work: nothing is loaded or written).

    `data` says where calibration data comes from and where the model runs (device, dtype); `run`
    what the job may overwrite, whether it resumes a search, what it prints. The former keywords
    (`dtype=`, `overwrite=`, `resume=`, `dry_run=`, `trust_remote_code=`, `progress=`,
    `command_line=`) still work, with a warning.

    Under torchrun every rank runs this with the same arguments: observation and the search are
    data-parallel, and rank 0 alone writes OUTPUT.
    """
    data, run = _job_options(legacy, "prune_checkpoint", data, run)
    job = prepare(
        model_path,
        output,
        config,
        data=data,
        search_data=search_data,
        tokenizer_path=tokenizer_path,
        save=save,
        run=run,
    )
    if run.dry_run:
        return job.describe()
    rank, _ = rank_and_world()
    barrier()  # torchrun: every rank has checked OUTPUT before rank 0 can write it
    with output_lock(job.output) if rank == 0 else nullcontext():
        return run_job(job)


def run_job(job: PruneJob) -> dict:
    """The expensive part of `prune_checkpoint`, on a checked job."""
    with RunLog.join(job.run.command_line) as log:
        return _run(job, log, job.run.progress)


def _run(job: PruneJob, log: RunLog, progress: bool) -> dict:
    timer = Timer()
    with stage(f"loading {job.model_path}", progress), transformers_bars_off():
        model, _ = load_placed(job.model_path, job.placement, job.run.trust_remote_code)
    timer.lap("load")
    data = job.data
    result = prune(
        model,
        job.config,
        data=job.calibration or None,
        tokenizer=job.tokenizer,
        search_data=job.search_set,
        options=data,
        run=job.run,
        search_state=search_state_path(job.output),
    )
    timer.lap("prune")
    moe = MoEModel(model)
    report = replace(
        result.report,
        command=PRUNE,
        moeprune_version=__version__,
        model=str(job.model_path),
        output=str(job.output),
        model_type=moe.model_type,
        save_dtype=job.saved_as,
        command_line=job.run.command_line,
    )
    recipe = {
        "moeprune_version": __version__,
        "config": job.config.to_dict(),
        "data": {
            "calibration": list(data.sources),
            "search": job.search_data,
            "samples": data.samples,
            "max_length": data.max_length,
            "batch_size": data.batch_size,
            "seed": data.seed,
            "packing": data.packing,
        },
        "save": {  # a dtype --config reads back; None: the input's (a kept quantization is the default)
            "dtype": None if job.kept_quantization is not None else report.save_dtype,
            "max_shard_size": job.max_shard_size,
        },
    }
    if job.sizes is not None and job.sizes.target is not None:  # the config holds the solved sparsity
        recipe["target"] = {
            "target_size": job.sizes.target.target_bytes,
            "solved_sparsity": job.config.sparsity,
        }

    def write(tmp: Path) -> None:
        with stage(f"saving to {job.output}", progress), transformers_bars_off():
            report.format = write_checkpoint(
                model, tmp, job.tokenizer, dtype=job.save_dtype, max_shard_size=job.max_shard_size
            )
        evidence(tmp)

    def evidence(tmp: Path) -> None:
        report.disk_bytes = DiskBytes(weight_bytes(job.model_path), weight_bytes(tmp))
        report.target = job.sizes.report(report.disk_bytes.after) if job.sizes is not None else None
        result.plan.save(tmp / "plan.json")
        write_json(tmp / RECIPE, recipe)
        if result.search is not None:
            write_json(tmp / "search.json", result.search)
            plot_search_curve(
                tmp / "search_curve.png", result.search["generations"], result.search["fitness"]
            )
        draw_kept(
            tmp / "density.png",
            report,
            result.search,
            [m.hidden_size for m in moe.layers],
            expert_unit=METHODS.get(job.config.method).sparsity_unit == "experts",
        )
        timer.lap("save")
        report.timing_s = timer.total()
        write_json(tmp / "report.json", report.to_json())
        (tmp / "README.md").write_text(model_card(report, str(job.output)))
        log.write(tmp)  # before report.md, so that its file list names the log
        (tmp / "report.md").write_text(report_markdown(report, tmp))

    if rank_and_world()[0] != 0:  # torchrun: every rank holds the same result; one writes
        return report.to_json()
    if job.kept_quantization is not None:  # the kept experts' quantized bytes and scales, copied as they are
        report.format = "stock"
        with stage(f"writing {job.output} from the input's quantized shards", progress):
            rewrite_checkpoint(job.model_path, job.output, result.plan, job.run.overwrite, extra=evidence)
    else:
        atomic_write_dir(job.output, write, overwrite=job.run.overwrite)
    state = search_state_path(job.output)  # the search's state and race log are done with
    state.unlink(missing_ok=True)
    state.with_name(state.name + ".raced.json").unlink(missing_ok=True)
    return report.to_json()


# ----------------------------------------------------------------------------- score a checkpoint
def prepare_score(
    model_path: str | Path,
    output: str | Path,
    criterion: str,
    *,
    data: DataOptions,
    tokenizer_path=None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    load_sets: bool = True,
) -> tuple[Path, object | None, list[CalibrationData]]:
    """The checks of `moeprune score` that need no weights; returns (model path, tokenizer, data)."""
    crit = get_criterion(criterion)
    Placement.choose(data.device if data.device != "auto" or not data.sequential else None, None)
    model_path = check_model_path(model_path)
    load_config(model_path, trust_remote_code)
    check_weights(model_path)
    check_quantized(model_path)  # fp8 is read (dequantized as it loads); other formats, bad scales fail here
    output = Path(output)
    check_not_inside(output, [model_path], what="scores file")
    if output.is_dir():
        raise MoePruneError(f"{str(output)!r} is a folder; the scores go to a JSON file", options=("output",))
    if output.exists() and not overwrite:
        raise MoePruneError(
            f"{str(output)!r} already exists; choose another path or allow overwriting it",
            options=("overwrite",),
        )
    check_creatable(output)
    if not crit.needs_data:
        return model_path, None, []
    _check_sources(data.sources, "calibration data")
    tokenizer = require_tokenizer(model_path, tokenizer_path, trust_remote_code)
    return (
        model_path,
        tokenizer,
        calibration_sets(tokenizer, data, per_domain=crit.per_domain) if load_sets else [],
    )


def score_loaded(
    model_path: Path,
    criterion: str,
    sets: list[CalibrationData],
    data: DataOptions,
    *,
    tokenizer=None,
    seed: int = 0,
    run: RunOptions | None = None,
) -> dict:
    """`moeprune score` on the loaded model: the scores document."""
    run = run or RunOptions()
    progress = run.progress
    with stage(f"loading {model_path}", progress), transformers_bars_off():
        model, _ = load_placed(model_path, Placement.choose(data.device, data.dtype), run.trust_remote_code)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    crit, scores, stats = score_experts(
        MoEModel(model),
        criterion,
        sets,
        batch_size=data.batch_size,
        pad_token_id=pad,
        seed=seed,
        progress=progress,
    )
    return {**scores_document(crit, scores, stats), "unseen": unseen_experts(stats) if stats else {}}
