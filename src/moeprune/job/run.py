"""`moeprune prune` on a checkpoint folder: the checked job loaded, pruned by `moeprune.api.prune`,
and saved with its evidence (report, plan, recipe, plots, model card, run log), atomically."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.api import prune
from moeprune.checkpoint import load_placed, write_checkpoint
from moeprune.checkpoint.quantized import quantization_format
from moeprune.config import Recipe, SaveOptions
from moeprune.job.evidence import Evidence, write_evidence
from moeprune.job.prepare import PruneJob, PruneRequest, prepare
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.quantize.evo import NOTHING_REMOVED, run_joint
from moeprune.quantize.grid import choose_sparsity, criterion_orders
from moeprune.quantize.mixed import run_joint_mixed
from moeprune.quantize.oneshot import ignore_prefixes, quantize_folder
from moeprune.quantize.per_layer import choose_precision, precision_note, precision_teacher, scoring_data
from moeprune.quantize.schemes import check_group
from moeprune.report.document import PRUNE
from moeprune.report.parts import SearchSummary, Serving
from moeprune.runtime.atomic import atomic_write_dir, output_lock
from moeprune.runtime.distributed import barrier, rank_and_world
from moeprune.runtime.progress import stage, transformers_bars_off
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.search.run import search_state_path
from moeprune.serve.vllm.layout import quantized_refusal
from moeprune.serve.vllm_native import write_native
from moeprune.shards.mtp import MTP_NOT_REQUANTIZED, MtpPlan, ignored_note, record_mtp
from moeprune.shards.rewrite import (
    DROP_MTP,
    append_input_tensors,
    ignored_keys,
    release_mtp,
    rewrite_checkpoint,
    with_mtp,
)
from moeprune.surgery.registry import method_limits


def prune_in_memory(request: PruneRequest) -> dict:
    """The in-memory pipeline: check, load, prune, save with evidence; returns report.json (with
    `request.run.dry_run`, the plan of work: nothing is loaded or written).

    Under torchrun every rank runs this with the same request: observation and the search are
    data-parallel, and rank 0 alone writes the output.
    """
    job = prepare(request)
    if job.run.dry_run:
        return job.describe()
    rank, _ = rank_and_world()
    barrier()  # torchrun: every rank has checked OUTPUT before rank 0 can write it
    with output_lock(job.output) if rank == 0 else nullcontext():
        return run_job(job)


def run_job(job: PruneJob) -> dict:
    """The expensive part of `prune_in_memory`, on a checked job."""
    with RunLog.join(job.run.command_line) as log:
        return _run(job, log, job.run.progress)


def _check_quantizable(job: PruneJob) -> Callable[[Plan], None] | None:
    """The plan's kept widths against the quantization group, before the surgery: what prepare
    could not know before loading (the widths a mixed search chose) is refused here, after the
    scoring and search but before the model is changed or anything is written."""
    quantize = job.quantize
    if quantize is None:
        return None

    def check(plan: Plan) -> None:
        check_group(quantize, [], sorted({w for lp in plan.layers for w in lp.neurons.values()}))

    return check


def _quantize(job: PruneJob, tmp: Path, report, log: RunLog, progress: bool, mtp: MtpPlan | None) -> None:
    """The saved, pruned model quantized in place by llm-compressor (quantize/oneshot.py), calibrated
    on the prune's calibration data with every kept expert reached; report.json records how (and,
    for per-layer precision, the choice, its losses and the bytes predicted and written). Kept
    MTP layers stay unquantized (transformers does not build them, so llm-compressor never sees
    them) and the config's `ignore` names them."""
    assert job.quantize is not None and job.quant_python is not None
    moeprune_format = report.format == "moeprune"  # loaded there through its own modeling files
    samples = [list(map(int, s.input_ids)) for d in job.calibration for s in d.samples]
    with stage(f"quantizing {job.quantize.describe()} with llm-compressor ({job.quant_python})", progress):
        report.quantization = quantize_folder(
            job.quant_python, tmp, job.quantize, samples, job.max_shard_size, moeprune_format
        )
    if mtp is not None and not mtp.left_out:
        ignore_prefixes(tmp, mtp.roots)
    if moeprune_format:  # vLLM's plugin reads moeprune's format unquantized only
        report.serving = Serving(vllm_refused=quantized_refusal(f"compressed-tensors {job.quantize.scheme}"))
    if job.precision_choice is not None:
        written = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        report.quantization["precision"] = {**job.precision_choice, "written_bytes": written}
        log.note(precision_note(report.quantization["precision"]))
    q = report.quantization
    log.note(
        f"quantized {q['scheme']} ({q['method']}) by llm-compressor {q['versions']['llmcompressor']}: every "
        f"kept expert computed on at least {q['least_tokens_per_expert']} calibration tokens "
        f"({q['calibration_tokens']} tokens, all experts calibrated); routers and lm_head left unquantized"
    )


def _quantize_recipe(job: PruneJob) -> dict | None:
    """recipe.json's `quantize`: per-layer precision adds its target (the sparsity is the config's)."""
    if job.quantize is None:
        return None
    out = job.quantize.recipe()
    if job.precision is not None:
        out["target_size"] = job.precision.target_bytes
    return out


@dataclass
class _BeforePrune:
    """What per-layer precision decides on the full model before `prune`: the job (at the chosen
    sparsity and schemes), the teacher of the fixed-split choice, the grid's rows, the removals or
    mixed genes chosen already, search.json, and the observation `prune` reuses."""

    job: PruneJob
    teacher: CandidateEvaluator | None = None
    grid_rows: list[dict[str, Any]] | None = None
    removed: list[Any] | None = None
    joint: dict[str, Any] | None = None
    observed: tuple | None = None
    novices: Any = None  # the joint mixed search's rank-R fits of every routed expert


def _joint_mixed(job: PruneJob, full: MoEModel, progress: bool) -> _BeforePrune:
    """The mixed method's forms and schemes searched together (quantize/mixed.py). A winner
    that keeps every expert whole is the "quantize only" point: pruned as drop with nothing removed."""
    assert job.precision is not None and job.quantize is not None
    runtime = SearchRuntime(
        batch_size=job.data.batch_size, pad_token_id=getattr(job.tokenizer, "pad_token_id", None),
        progress=progress, state_path=search_state_path(job.output), resume=job.run.resume,
    )  # fmt: skip
    scored = scoring_data(job.search_set, job.calibration, job.config.search.samples)
    with stage("searching the mixed forms and the schemes per layer together", progress):
        won = run_joint_mixed(full, job.config, job.quantize, job.precision, job.calibration, scored, runtime)
    job = replace(job, config=won.config, quantize=won.quantize, precision_choice=won.choice)
    if any(g[1] or g[2] or g[3] for g in won.genes):
        return _BeforePrune(
            job, removed=list(won.genes), joint=won.search, observed=won.observed, novices=won.novices
        )
    won.choice["no_expert_removed"] = NOTHING_REMOVED
    job = replace(job, config=replace(won.config, method="drop", options=None))
    return _BeforePrune(job, removed=[0] * len(won.genes), joint=won.search, observed=won.observed)


def _precision_teacher(job: PruneJob, full: MoEModel, progress: bool) -> _BeforePrune:
    """Per-layer precision's teacher on the full model before the surgery; without --sparsity the
    grid of uniform splits chooses the sparsity, and with evo the joint search the counts too:
    (the job at that sparsity, the teacher or None, the grid's rows, the removals, search.json)."""
    assert job.precision is not None and job.quantize is not None
    data, p, quantize = job.data, job.precision, job.quantize
    teacher, grid_rows, removed, joint = None, None, None, None
    pad = getattr(job.tokenizer, "pad_token_id", None)
    orders = None
    observed = None
    if quantize.joint:  # the grid masks experts in the criterion's order
        orders, observed = criterion_orders(
            full, job.config, job.calibration, data.batch_size, pad or 0, progress
        )
    with stage("teacher pass of the per-layer precision scores", progress):
        scored = scoring_data(job.search_set, job.calibration, job.config.search.samples)
        teacher = precision_teacher(full, scored, job.config, data.batch_size, pad, progress, orders)
    if quantize.joint:
        with stage("choosing the sparsity with the schemes (a grid of uniform splits)", progress):
            grid = [s for s, _ in p.grid]
            sparsity, grid_rows = choose_sparsity(
                teacher, full, job.config, quantize, grid, p.size, p.dtype_bytes, p.target_bytes
            )
        if job.config.allocation == "evo":  # counts and schemes searched together, the grid as seeds
            assert teacher is not None
            teacher.release()
            teacher = None
            assert orders is not None
            runtime = SearchRuntime(
                batch_size=data.batch_size, pad_token_id=pad, progress=progress,
                state_path=search_state_path(job.output), resume=job.run.resume,
            )  # fmt: skip
            with stage("searching the experts removed and the schemes per layer together", progress):
                removed, quantize, choice, joint = run_joint(
                    full, job.config, quantize, p, orders, scored, grid_rows, runtime
                )
            job = replace(job, quantize=quantize, precision_choice=choice)
            sparsity = (
                sum(removed)
                / method_limits(
                    full, job.config.method, job.config.expert_multiple, job.config.options
                ).prunable_experts
            )
        elif sparsity == 0:
            removed = [0] * len(full.layers)
        if sparsity > 0:  # else the planning sparsity stays: the config needs one above 0
            job = replace(job, config=replace(job.config, sparsity=sparsity))
    return _BeforePrune(job, teacher, grid_rows, removed, joint, observed)


def _run(job: PruneJob, log: RunLog, progress: bool) -> dict:
    timer = Timer()
    with stage(f"loading {job.model_path}", progress), transformers_bars_off():
        model, _ = load_placed(job.model_path, job.placement, job.run.trust_remote_code)
    timer.lap("load")
    data = job.data
    asked, before = job.config, _BeforePrune(job)
    joint_mixed = job.quantize is not None and job.quantize.joint and job.config.method == "mixed"
    if job.precision is not None and joint_mixed:
        before = _joint_mixed(job, MoEModel(model), progress)  # forms and schemes together
    elif job.precision is not None:  # per-layer precision: its teacher is the full model, before surgery
        before = _precision_teacher(job, MoEModel(model), progress)
    job, teacher, grid_rows, removed, joint = (
        before.job,
        before.teacher,
        before.grid_rows,
        before.removed,
        before.joint,
    )
    result = prune(
        model,
        job.config,
        data=job.calibration or None,
        tokenizer=job.tokenizer,
        search_data=job.search_set,
        options=data,
        run=replace(
            job.run,
            check_plan=_check_quantizable(job),
            removed=tuple(removed) if removed is not None else None,
            observed=before.observed,
            novices=before.novices,
        ),
        search_state=search_state_path(job.output),
    )
    timer.lap("prune")
    if removed is not None and not any(removed):  # quantize only: nothing was pruned
        result.report.sparsity = result.plan.sparsity = 0.0
        log.note(NOTHING_REMOVED)
    if joint is not None:
        result.search = joint
        result.report.search = SearchSummary.from_json(joint)
    moe = MoEModel(model)
    if teacher is not None:
        assert job.precision is not None and job.quantize is not None
        with stage("scoring each layer's schemes (fake-quantized, one layer at a time)", progress):
            quantize, choice = choose_precision(
                teacher, moe, job.meta, result.plan, job.quantize, job.precision
            )
        if grid_rows is not None:
            choice["sparsity_grid"] = grid_rows
            if removed is not None:
                choice["no_expert_removed"] = NOTHING_REMOVED
        job = replace(job, quantize=quantize, precision_choice=choice)
        timer.lap("precision")
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
    recipe = Recipe(
        # chosen counts or genes (a joint search, or no expert removed): the rerun, as asked, searches again
        job.config
        if removed is None or job.precision is None
        else replace(asked, sparsity=None, target_size=job.precision.target_bytes),
        data,
        job.search_data,
        # a dtype --config reads back; None: the input's (a kept quantization is the default)
        SaveOptions(
            None if job.kept_quantization is not None else report.save_dtype, job.max_shard_size, job.drop_mtp
        ),
        pipeline="in-memory",
        target_size=job.sizes.target.target_bytes if job.sizes is not None and job.sizes.target else None,
        quantize=_quantize_recipe(job),
    )
    report.target = job.sizes.report(None) if job.sizes is not None else None
    quantized_input = quantization_format(job.model_path) is not None
    mtp = release_mtp(
        job.model_path,
        result.plan,
        DROP_MTP
        if job.drop_mtp
        else MTP_NOT_REQUANTIZED
        if quantized_input and not job.kept_quantization
        else "",
    )
    with_mtp(result.plan, mtp)
    if mtp is not None and not mtp.left_out and job.quantize is not None:
        mtp.unquantized = True  # the summary says so
    ignored = ignored_keys(job.model_path) if not quantized_input else []  # a kept quantization copies all
    carry = result.plan.is_uniform()  # a stock result: its loader skips them as the input's did
    notes = ([mtp.note()] if mtp is not None else []) + ([ignored_note(ignored, carry)] if ignored else [])
    report.release_layers = notes or None
    for note in notes:
        log.note(note)
    evidence = Evidence(
        job.model_path,
        job.output,
        report,
        result.plan,
        recipe,
        job.meta,
        log,
        timer,
        search=result.search,
        tokenizer_path=job.tokenizer_path,
    )

    def write(tmp: Path) -> None:
        with stage(f"saving to {job.output}", progress), transformers_bars_off():
            report.format = write_checkpoint(
                model,
                tmp,
                job.tokenizer,
                dtype=job.save_dtype,
                max_shard_size=job.max_shard_size,
                keep_mtp=mtp is not None and not mtp.left_out,
            )
            append = (mtp is not None and not mtp.left_out) or bool(ignored and carry)
            # a stock result is quantized through transformers' class, whose save_pretrained writes
            # only what it builds: the input's other tensors are added after (moeprune's format is
            # rewritten by names, quantize/layout.py, and keeps them)
            after = job.quantize is not None and report.format == "stock"
            if append and not after:
                append_input_tensors(job.model_path, tmp, mtp, ignored if carry else ())
            record_mtp(tmp, mtp)  # moeprune's format: the MTP layers' count and ids in its section
        if job.quantize is not None:
            _quantize(job, tmp, report, log, progress, mtp)
            if append and after:  # as stored in the unquantized result, byte for byte
                append_input_tensors(job.model_path, tmp, mtp, ignored if carry else ())
        if report.format == "moeprune" and report.serving is not None:  # vLLM 0.33's own description
            report.serving.vllm_native = write_native(tmp)
        write_evidence(tmp, evidence, moe)

    if rank_and_world()[0] != 0:  # torchrun: every rank holds the same result; one writes
        return report.to_json()
    if job.kept_quantization is not None:  # the kept experts' quantized bytes and scales, copied as they are
        report.format = "stock" if result.plan.is_uniform() else "moeprune"
        if report.format == "moeprune":
            report.serving = Serving(vllm_refused=quantized_refusal(job.kept_quantization.saved_as))
        with stage(f"writing {job.output} from the input's quantized shards", progress):
            rewrite_checkpoint(
                job.model_path,
                job.output,
                result.plan,
                job.run.overwrite,
                extra=lambda tmp: write_evidence(tmp, evidence, moe),
                stock=False,
                mtp=mtp,
            )
    else:
        atomic_write_dir(job.output, write, overwrite=job.run.overwrite)
    state = search_state_path(job.output)  # the search's state and race log are done with
    state.unlink(missing_ok=True)
    state.with_name(state.name + ".raced.json").unlink(missing_ok=True)
    return report.to_json()
