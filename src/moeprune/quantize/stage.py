"""The quantize stage's steps, in the order a pipeline that quantizes calls them:

- before loading (job/prepare.py): `check_input` (the input is full precision, the request's
  refusals, a neuron method's widths on the group), `check_groups` and `check_kept_widths` (every
  group divides what it quantizes), `plan_grid` (`auto:` without `--sparsity`: the sparsities
  tried, the job planned at the first) and `plan_target` (the bytes per scheme, an unreachable
  target refused, the joint search's memory);
- before `prune`, on the loaded full model (`before_prune`): per-layer schemes' teacher, and
  without `--sparsity` the sparsity, counts or mixed forms chosen with the schemes;
- after `prune` (`after_prune`): the choice on the pruned model, what the result and report say
  of a joint search; `plan_check`, `recipe_config` and `recipe` around it;
- after saving (`quantize_saved`): the saved folder quantized by llm-compressor (oneshot.py).

A pipeline that never loads the model (no-load) quantizes nothing: it declares so and refuses a
quantize request before anything is read (job/pipelines.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeprune.api import PruneResult
from moeprune.checkpoint.quantized import check_quantized
from moeprune.checkpoint.structure import read_config_dict
from moeprune.config import PruneConfig, parse_target_size
from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.quant.support import quantization_of
from moeprune.quantize.evo import NOTHING_REMOVED, run_joint
from moeprune.quantize.grid import choose_sparsity, criterion_orders, planning_sparsity, sparsity_grid
from moeprune.quantize.memory import check_joint_memory
from moeprune.quantize.mixed import mixed_joint_grid, run_joint_mixed
from moeprune.quantize.oneshot import ignore_prefixes, quantize_folder
from moeprune.quantize.options import QuantizeOptions, check_group, check_quantize
from moeprune.quantize.per_layer import (
    PrecisionTarget,
    choose_precision,
    plan_precision,
    precision_note,
    precision_teacher,
    scoring_data,
)
from moeprune.quantize.pricing import quantized_dims
from moeprune.report.document import PruneReport
from moeprune.report.parts import SearchSummary, Serving
from moeprune.runtime.device import Placement
from moeprune.runtime.progress import stage
from moeprune.runtime.runlog import RunLog
from moeprune.runtime.timer import Timer
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.search.registry import searches_schemes
from moeprune.serve.vllm.layout import quantized_refusal
from moeprune.shards.mtp import MtpPlan
from moeprune.shards.weight_bytes import cast_weight_bytes
from moeprune.surgery.neurons import NarrowOptions
from moeprune.surgery.planning import check_config
from moeprune.surgery.registry import FORMS, ResolvedConfig, method_limits


def _searches_forms(config: PruneConfig) -> bool:
    """Whether the joint choice searches the method's forms with the schemes (quantize/mixed.py)."""
    return ResolvedConfig.of(config).method_spec.genes == FORMS


def _joint_search(config: PruneConfig, grid: tuple) -> str:
    """What the joint search without `--sparsity` searches, for the dry run ("" when none runs)."""
    if not grid or not searches_schemes(ResolvedConfig.of(config)):
        return ""
    if _searches_forms(config):
        return (
            "evo over mixed forms (whole, narrowed, novice, dropped, width) and scheme per MoE layer under "
            "the target, generation 0 holding mixed's recipes at these points (each with its scheme)"
        )
    return (
        "evo over experts removed and scheme per MoE layer under the target, generation 0 holding these "
        "grid points (each with its best schemes)"
    )


# -- before loading ------------------------------------------------------------------------------
def check_input(
    config: PruneConfig, quantize: QuantizeOptions | None, model_path: Path, has_data: bool
) -> tuple[PruneConfig, str | None]:
    """Before the input's own format is looked at (it must be full precision): the request's
    refusals and a neuron method's default width multiple on the group; returns the config and
    the quantization environment's Python (None: nothing to quantize)."""
    if quantize is None:
        return config, None
    fmt = check_quantized(model_path)
    quantized_input = quantization_of(read_config_dict(model_path)) if fmt else None
    python = check_quantize(quantize, has_data, quantized_input)
    options = config.options
    if isinstance(options, NarrowOptions) and options.width_multiple is None and quantize.spec.grouped:
        # every kept width quantized in whole groups (surgery/widths.py); an explicit multiple is
        # kept (check_kept_widths refuses it when the group does not divide a kept width)
        config = check_config(replace(config, options=replace(options, width_multiple=quantize.group)))
    return config, python


def check_groups(quantize: QuantizeOptions | None, meta: MoEModel) -> None:
    """Every scheme's group against the quantized input widths and the experts' full widths."""
    if quantize is None:
        return
    for scheme in quantize.candidates or (quantize.scheme,):
        check_group(quantize.of(scheme), quantized_dims(meta), [m.intermediate_size for m in meta.layers])


def check_kept_widths(quantize: QuantizeOptions | None, meta: MoEModel, widths: list[int]) -> None:
    """The widths a neuron method keeps, known before loading, against the group (the largest
    group size named divides them all)."""
    if quantize is not None and widths:
        check_group(quantize, quantized_dims(meta), widths)


def plan_grid(
    meta: MoEModel,
    config: PruneConfig,
    quantize: QuantizeOptions | None,
    model_path: Path,
    save_dtype: torch.dtype,
) -> tuple[PruneConfig, tuple]:
    """`auto:` without `--sparsity`: the sparsities tried (grid.py, or mixed.py for mixed forms),
    and the config at the first one, where the job is planned and checked; else as it is."""
    if quantize is None or not quantize.joint or quantize.budget is None:
        return config, ()
    element = torch.empty((), dtype=save_dtype).element_size()
    target = parse_target_size(quantize.budget)
    size = cast_weight_bytes(model_path, meta, save_dtype)
    joint_grid = mixed_joint_grid if _searches_forms(config) else sparsity_grid
    grid = tuple(joint_grid(meta, config, quantize, size, element, target))
    return replace(config, sparsity=planning_sparsity(grid)), grid


def plan_target(
    meta: MoEModel,
    config: PruneConfig,
    quantize: QuantizeOptions | None,
    model_path: Path,
    save_dtype: torch.dtype,
    grid: tuple,
    placement: Placement,
) -> PrecisionTarget | None:
    """`auto:`'s bytes per scheme (T reachable?) and the joint search's memory; None otherwise."""
    if quantize is None or quantize.budget is None:
        return None
    full = cast_weight_bytes(model_path, meta, save_dtype)
    dtype_bytes = torch.empty((), dtype=save_dtype).element_size()
    target = plan_precision(
        meta, config, quantize, full, dtype_bytes, parse_target_size(quantize.budget), grid
    )
    memory = check_joint_memory(meta, config, quantize, placement)
    return replace(target, memory=memory, search=_joint_search(config, grid))


# -- before prune --------------------------------------------------------------------------------
@dataclass
class BeforePrune:
    """What per-layer schemes decide on the full model before `prune`: the config and options at
    the chosen sparsity and schemes, report.json's account when made already (a joint search),
    the teacher of the fixed-split choice, the grid's rows, the removals or mixed genes chosen,
    search.json, the observation `prune` reuses and the joint mixed search's novice fits."""

    config: PruneConfig
    quantize: QuantizeOptions | None
    choice: dict[str, Any] | None = None
    teacher: CandidateEvaluator | None = None
    grid_rows: list[dict[str, Any]] | None = None
    removed: list[Any] | None = None
    search: dict[str, Any] | None = None
    observed: tuple | None = None
    novices: Any = None

    def run_options(self) -> dict[str, Any]:
        """What `prune` takes of it (`RunOptions` fields)."""
        removed = tuple(self.removed) if self.removed is not None else None
        return {"removed": removed, "observed": self.observed, "novices": self.novices}


@dataclass(frozen=True)
class Asked:
    """What per-layer schemes' work before `prune` reads of the job: the config and options as
    checked, the target planned before loading, the data, and how its searches run."""

    config: PruneConfig
    quantize: QuantizeOptions | None
    target: PrecisionTarget | None
    calibration: list[CalibrationData]
    search_set: CalibrationData | None
    runtime: SearchRuntime

    def scored(self) -> CalibrationData:
        """The data the choice scores on (the search data, else the first calibration samples)."""
        return scoring_data(self.search_set, self.calibration, self.config.search.samples)


def before_prune(full: MoEModel, asked: Asked) -> BeforePrune:
    """Per-layer schemes' work on the full model before the surgery (nothing without `auto:`)."""
    quantize, target = asked.quantize, asked.target
    if quantize is None or target is None:
        return BeforePrune(asked.config, quantize)
    if quantize.joint and _searches_forms(asked.config):
        return _joint_forms(full, asked, quantize, target)
    return _teacher(full, asked, quantize, target)


def _joint_forms(
    full: MoEModel, asked: Asked, quantize: QuantizeOptions, target: PrecisionTarget
) -> BeforePrune:
    """The mixed method's forms and schemes searched together (mixed.py). A winner that keeps
    every expert whole is the "quantize only" point: pruned as drop with nothing removed."""
    runtime = asked.runtime
    with stage("searching the mixed forms and the schemes per layer together", runtime.progress):
        won = run_joint_mixed(
            full, asked.config, quantize, target, asked.calibration, asked.scored(), runtime
        )
    found = BeforePrune(
        won.config, won.quantize, won.choice, search=won.search, observed=won.observed, novices=won.novices
    )
    if any(g[1] or g[2] or g[3] for g in won.genes):
        return replace(found, removed=list(won.genes))
    won.choice["no_expert_removed"] = NOTHING_REMOVED
    drop = check_config(replace(ResolvedConfig.of(won.config).given(), method="drop", options=None))
    return replace(found, config=drop, removed=[0] * len(won.genes), novices=None)


def _teacher(full: MoEModel, asked: Asked, quantize: QuantizeOptions, target: PrecisionTarget) -> BeforePrune:
    """The fixed-split choice's teacher on the full model; without `--sparsity` the grid of
    uniform splits chooses the sparsity, and with evo the joint search the counts too."""
    config, runtime = asked.config, asked.runtime
    progress, pad, batch = runtime.progress, runtime.pad_token_id, runtime.batch_size
    orders, observed = None, None
    if quantize.joint:  # the grid masks experts in the criterion's order
        orders, observed = criterion_orders(full, config, asked.calibration, batch, pad or 0, progress)
    with stage("teacher pass of the per-layer precision scores", progress):
        scored = asked.scored()
        teacher = precision_teacher(full, scored, config, batch, pad, progress, orders)
    if not quantize.joint:
        return BeforePrune(config, quantize, teacher=teacher)
    with stage("choosing the sparsity with the schemes (a grid of uniform splits)", progress):
        grid = [s for s, _ in target.grid]
        sparsity, rows = choose_sparsity(
            teacher, full, config, quantize, grid, target.size, target.dtype_bytes, target.target_bytes
        )
    before = BeforePrune(config, quantize, teacher=teacher, grid_rows=rows, observed=observed)
    if searches_schemes(ResolvedConfig.of(config)):  # counts and schemes searched together, the grid as seeds
        teacher.release()
        assert orders is not None
        with stage("searching the experts removed and the schemes per layer together", progress):
            removed, quantize, choice, joint = run_joint(
                full, config, quantize, target, orders, scored, rows, runtime
            )
        limits = method_limits(full, config.method, config.expert_multiple, config.options)
        sparsity = sum(removed) / limits.prunable_experts
        before = replace(
            before, quantize=quantize, choice=choice, teacher=None, removed=removed, search=joint
        )
    elif sparsity == 0:
        before.removed = [0] * len(full.layers)
    if sparsity > 0:  # else the planning sparsity stays: the config needs one above 0
        before.config = replace(config, sparsity=sparsity)
    return before


# -- around and after prune ----------------------------------------------------------------------
def plan_check(quantize: QuantizeOptions | None) -> Callable[[Plan], None] | None:
    """The plan's kept widths against the group, before the surgery: what prepare could not know
    before loading (the widths a mixed search chose) is refused after the scoring and search but
    before the model is changed or anything is written."""
    if quantize is None:
        return None

    def check(plan: Plan) -> None:
        check_group(quantize, [], sorted({w for lp in plan.layers for w in lp.neurons.values()}))

    return check


def after_prune(
    before: BeforePrune,
    result: PruneResult,
    pruned: MoEModel,
    meta: MoEModel,
    target: PrecisionTarget | None,
    log: RunLog,
    timer: Timer,
    progress: bool,
) -> tuple[QuantizeOptions | None, dict[str, Any] | None]:
    """The result as a joint search left it (its search.json; no expert removed: sparsity 0), and
    the options with each layer's scheme and report.json's account of the choice."""
    if before.removed is not None and not any(before.removed):  # quantize only: nothing was pruned
        result.report.sparsity = result.plan.sparsity = 0.0
        log.note(NOTHING_REMOVED)
    if before.search is not None:
        result.search = before.search
        result.report.search = SearchSummary.from_json(before.search)
    if before.teacher is None:
        return before.quantize, before.choice
    assert target is not None and before.quantize is not None
    with stage("scoring each layer's schemes (fake-quantized, one layer at a time)", progress):
        quantize, choice = choose_precision(
            before.teacher, pruned, meta, result.plan, before.quantize, target
        )
    if before.grid_rows is not None:
        choice["sparsity_grid"] = before.grid_rows
        if before.removed is not None:
            choice["no_expert_removed"] = NOTHING_REMOVED
    timer.lap("precision")
    return quantize, choice


def recipe_config(
    asked: PruneConfig, config: PruneConfig, before: BeforePrune, target: PrecisionTarget | None
) -> PruneConfig:
    """recipe.json's config: counts or genes a joint search chose (or no expert removed) are
    searched again by the rerun, as asked, under the target."""
    if before.removed is None or target is None:
        return config
    return replace(asked, sparsity=None, target_size=target.target_bytes)


def recipe(quantize: QuantizeOptions | None, target: PrecisionTarget | None) -> dict | None:
    """recipe.json's `quantize`: per-layer schemes add their target (the sparsity is the config's)."""
    if quantize is None:
        return None
    out = quantize.recipe()
    if target is not None:
        out["target_size"] = target.target_bytes
    return out


# -- after saving --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    """What the saved result's quantization reads of the job."""

    quantize: QuantizeOptions
    python: str  # the quantization environment's
    calibration: list[CalibrationData]
    max_shard_size: int | str
    choice: dict[str, Any] | None = None  # per-layer schemes: report.json's account


def quantize_saved(
    tmp: Path, saved: Saved, report: PruneReport, log: RunLog, progress: bool, mtp: MtpPlan | None
) -> None:
    """The saved, pruned model quantized in place by llm-compressor (oneshot.py), calibrated on the
    prune's calibration data with every kept expert reached; report.json records how (and, for
    per-layer schemes, the choice, its losses and the bytes predicted and written). Kept MTP
    layers stay unquantized (transformers does not build them, so llm-compressor never sees them)
    and the config's `ignore` names them."""
    quantize = saved.quantize
    moeprune_format = report.format == "moeprune"  # loaded there through its own modeling files
    samples = [list(map(int, s.input_ids)) for d in saved.calibration for s in d.samples]
    with stage(f"quantizing {quantize.describe()} with llm-compressor ({saved.python})", progress):
        report.quantization = quantize_folder(
            saved.python, tmp, quantize, samples, saved.max_shard_size, moeprune_format
        )
    if mtp is not None and not mtp.left_out:
        ignore_prefixes(tmp, mtp.roots)
    if moeprune_format:  # vLLM's plugin reads moeprune's format unquantized only
        report.serving = Serving(vllm_refused=quantized_refusal(f"compressed-tensors {quantize.scheme}"))
    if saved.choice is not None:
        written = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        report.quantization["precision"] = {**saved.choice, "written_bytes": written}
        log.note(precision_note(report.quantization["precision"]))
    q = report.quantization
    log.note(
        f"quantized {q['scheme']} ({q['method']}) by llm-compressor {q['versions']['llmcompressor']}: every "
        f"kept expert computed on at least {q['least_tokens_per_expert']} calibration tokens "
        f"({q['calibration_tokens']} tokens, all experts calibrated); routers and lm_head left unquantized"
    )


__all__ = [
    "Asked",
    "BeforePrune",
    "Saved",
    "after_prune",
    "before_prune",
    "check_groups",
    "check_input",
    "check_kept_widths",
    "plan_check",
    "plan_grid",
    "plan_target",
    "quantize_saved",
    "recipe",
    "recipe_config",
]
