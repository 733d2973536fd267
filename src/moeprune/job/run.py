"""`moeprune prune` on a checkpoint folder: the checked job loaded, pruned by `moeprune.api.prune`,
and saved with its evidence (report, plan, recipe, plots, model card, run log), atomically."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from moeprune import __version__
from moeprune.api import prune
from moeprune.checkpoint import load_placed, write_checkpoint
from moeprune.checkpoint.quantized import quantization_format
from moeprune.config import PruneConfig, Recipe, SaveOptions
from moeprune.job.evidence import Evidence, write_evidence
from moeprune.job.prepare import PruneJob, PruneRequest, prepare
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.quantize.stage import (
    Asked,
    BeforePrune,
    Saved,
    after_prune,
    before_prune,
    plan_check,
    quantize_saved,
    recipe,
    recipe_config,
)
from moeprune.report.document import PRUNE, PruneReport
from moeprune.report.parts import Serving
from moeprune.runtime.atomic import atomic_write_dir, output_lock
from moeprune.runtime.distributed import barrier, rank_and_world
from moeprune.runtime.progress import stage, transformers_bars_off
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
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


def _asked(job: PruneJob, progress: bool) -> Asked:
    """What the quantize stage's before-prune step reads of the job (its searches' runtime: batch,
    padding, the search's state for --resume)."""
    runtime = SearchRuntime(
        batch_size=job.data.batch_size,
        pad_token_id=getattr(job.tokenizer, "pad_token_id", None),
        progress=progress,
        state_path=search_state_path(job.output),
        resume=job.run.resume,
    )
    return Asked(job.config, job.quantize, job.precision, job.calibration, job.search_set, runtime)


@dataclass
class _Release:
    """The release's MTP layers and the tensors no module holds, as the result carries them."""

    mtp: MtpPlan | None
    ignored: list[str]
    carry: bool  # a stock result: its loader skips the ignored tensors as the input's did
    notes: list[str]

    def append(self, model_path: Path, tmp: Path) -> None:
        """Those tensors added to a saved result, byte for byte (when it carries any)."""
        if (self.mtp is not None and not self.mtp.left_out) or (self.ignored and self.carry):
            append_input_tensors(model_path, tmp, self.mtp, self.ignored if self.carry else ())


def _release_layers(job: PruneJob, plan: Plan, log: RunLog) -> _Release:
    """What the result does with the release's MTP layers and ignored tensors, noted in the log."""
    quantized_input = quantization_format(job.model_path) is not None
    if job.drop_mtp:
        why = DROP_MTP
    else:
        why = MTP_NOT_REQUANTIZED if quantized_input and not job.kept_quantization else ""
    mtp = release_mtp(job.model_path, plan, why)
    with_mtp(plan, mtp)
    if mtp is not None and not mtp.left_out and job.quantize is not None:
        mtp.unquantized = True  # the summary says so
    ignored = ignored_keys(job.model_path) if not quantized_input else []  # a kept quantization copies all
    carry = plan.is_uniform()
    notes = ([mtp.note()] if mtp is not None else []) + ([ignored_note(ignored, carry)] if ignored else [])
    for note in notes:
        log.note(note)
    return _Release(mtp, ignored, carry, notes)


def _recipe(job: PruneJob, asked: PruneConfig, before: BeforePrune, save_dtype: str | None) -> Recipe:
    """recipe.json: the run as asked where a joint search chose counts or genes (its rerun searches
    again), the dtype `--config` reads back (None: the input's, a kept quantization's default)."""
    return Recipe(
        recipe_config(asked, job.config, before, job.precision),
        job.data,
        job.search_data,
        SaveOptions(
            None if job.kept_quantization is not None else save_dtype, job.max_shard_size, job.drop_mtp
        ),
        pipeline="in-memory",
        target_size=job.sizes.target.target_bytes if job.sizes is not None and job.sizes.target else None,
        quantize=recipe(job.quantize, job.precision),
    )


def _write_kept(
    job: PruneJob, plan: Plan, report: PruneReport, evidence: Evidence, moe: MoEModel, mtp, progress: bool
) -> None:
    """A kept quantization: the result written from the input's shards, the kept experts' quantized
    bytes and scales copied as they are."""
    assert job.kept_quantization is not None
    report.format = "stock" if plan.is_uniform() else "moeprune"
    if report.format == "moeprune":
        report.serving = Serving(vllm_refused=quantized_refusal(job.kept_quantization.saved_as))
    with stage(f"writing {job.output} from the input's quantized shards", progress):
        rewrite_checkpoint(
            job.model_path,
            job.output,
            plan,
            job.run.overwrite,
            extra=lambda tmp: write_evidence(tmp, evidence, moe),
            stock=False,
            mtp=mtp,
        )


def _report(job: PruneJob, pruned: PruneReport, moe: MoEModel) -> PruneReport:
    """report.json: the pruning facts with the job's paths, format and planned sizes."""
    report = replace(
        pruned,
        command=PRUNE,
        moeprune_version=__version__,
        model=str(job.model_path),
        output=str(job.output),
        model_type=moe.model_type,
        save_dtype=job.saved_as,
        command_line=job.run.command_line,
    )
    report.target = job.sizes.report(None) if job.sizes is not None else None
    return report


def _save(
    job: PruneJob,
    moe: MoEModel,
    report: PruneReport,
    release: _Release,
    evidence: Evidence,
    log: RunLog,
    progress: bool,
    tmp: Path,
) -> None:
    """The pruned model saved into `tmp` (the atomic write's folder), quantized when asked, with
    the release's other tensors and the evidence."""
    mtp = release.mtp
    with stage(f"saving to {job.output}", progress), transformers_bars_off():
        report.format = write_checkpoint(
            moe.model,
            tmp,
            job.tokenizer,
            dtype=job.save_dtype,
            max_shard_size=job.max_shard_size,
            keep_mtp=mtp is not None and not mtp.left_out,
        )
        # a stock result is quantized through transformers' class, whose save_pretrained writes
        # only what it builds: the input's other tensors are added after (moeprune's format is
        # rewritten by names, quantize/layout.py, and keeps them)
        after = job.quantize is not None and report.format == "stock"
        if not after:
            release.append(job.model_path, tmp)
        record_mtp(tmp, mtp)  # moeprune's format: the MTP layers' count and ids in its section
    if job.quantize is not None:
        assert job.quant_python is not None
        saved = Saved(
            job.quantize, job.quant_python, job.calibration, job.max_shard_size, job.precision_choice
        )
        quantize_saved(tmp, saved, report, log, progress, mtp)
        if after:  # as stored in the unquantized result, byte for byte
            release.append(job.model_path, tmp)
    if report.format == "moeprune" and report.serving is not None:  # vLLM 0.33's own description
        report.serving.vllm_native = write_native(tmp)
    write_evidence(tmp, evidence, moe)


def _given(options: dict) -> dict:
    """The run options a step before `prune` chose (the joint search's, or auto's contest's, kept
    in the job's run options): what it left None does not replace them."""
    return {name: value for name, value in options.items() if value is not None}


def _run(job: PruneJob, log: RunLog, progress: bool) -> dict:
    timer = Timer()
    with stage(f"loading {job.model_path}", progress), transformers_bars_off():
        model, _ = load_placed(job.model_path, job.placement, job.run.trust_remote_code)
    timer.lap("load")
    full, portfolio = MoEModel(model), None
    if job.choose is not None:  # --method auto: the contest picks the recipe this job runs
        job, portfolio = job.choose(full, job)
        timer.lap("auto")
    asked = job.config
    before = before_prune(full, _asked(job, progress))
    job = replace(job, config=before.config, quantize=before.quantize, precision_choice=before.choice)
    result = prune(
        model,
        job.config,
        data=job.calibration or None,
        tokenizer=job.tokenizer,
        search_data=job.search_set,
        options=job.data,
        run=replace(job.run, check_plan=plan_check(job.quantize), **_given(before.run_options())),
        search_state=search_state_path(job.output),
    )
    timer.lap("prune")
    moe = MoEModel(model)
    quantize, choice = after_prune(before, result, moe, job.meta, job.precision, log, timer, progress)
    job = replace(job, quantize=quantize, precision_choice=choice)
    report = _report(job, result.report, moe)
    report.portfolio = portfolio
    release = _release_layers(job, result.plan, log)
    report.release_layers = release.notes or None
    recipe = _recipe(job, asked, before, report.save_dtype)
    evidence = Evidence(
        job.model_path,
        job.output,
        report,
        result.plan,
        recipe,
        job.meta,
        log,
        timer,
        search=result.search or job.search_doc,
        tokenizer_path=job.tokenizer_path,
    )
    if rank_and_world()[0] != 0:  # torchrun: every rank holds the same result; one writes
        return report.to_json()
    if job.kept_quantization is not None:
        _write_kept(job, result.plan, report, evidence, moe, release.mtp, progress)
    else:
        write = partial(_save, job, moe, report, release, evidence, log, progress)
        atomic_write_dir(job.output, write, overwrite=job.run.overwrite)
    state = search_state_path(job.output)  # the search's state and race log are done with
    state.unlink(missing_ok=True)
    state.with_name(state.name + ".raced.json").unlink(missing_ok=True)
    return report.to_json()
