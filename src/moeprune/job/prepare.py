"""Every check of a prune request that needs no weights (`prepare`), and what it plans: the job,
its sizes (a size target solved into a sparsity), and whether a quantized input's format is kept."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moeprune.allocate.registry import searches
from moeprune.checkpoint import build_skeleton, check_model_path, load_config, require_tokenizer
from moeprune.checkpoint.files import check_weights, parse_size, stored_dtype
from moeprune.checkpoint.quantized import QuantFormat, check_quantized
from moeprune.checkpoint.structure import read_config_dict
from moeprune.config import DataOptions, PruneConfig, RunOptions, SaveOptions, parse_target_size
from moeprune.data.loading import CalibrationData, calibration_sets, load_data, parse_source
from moeprune.errors import DataError, MoePruneError
from moeprune.models import MoEModel
from moeprune.models.expert_parallel import apply_ep_size
from moeprune.models.reshape import check_not_packed
from moeprune.quant.fp8 import FP8_SAVE_DTYPE, Fp8Format
from moeprune.quant.support import quantization_of
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.per_layer import PrecisionTarget, resolve_auto
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.quantize.stage import check_groups, check_input, check_kept_widths, plan_grid, plan_target
from moeprune.report.parts import (
    TargetSize,
)
from moeprune.report.prune_report import weight_bytes
from moeprune.runtime.atomic import check_not_inside, check_output_dir, recover
from moeprune.runtime.device import Placement, precision_lost, resolve_dtype
from moeprune.search.registry import search_for
from moeprune.search.run import search_state_path
from moeprune.shards.layout import CheckpointLayout
from moeprune.shards.rewrite import rewrite_supports
from moeprune.shards.weight_bytes import cast_weight_bytes, stored_format, stored_weight_bytes
from moeprune.surgery.planning import check_config, check_feasible, requirements
from moeprune.surgery.registry import ResolvedConfig
from moeprune.surgery.target_size import TargetSolution, planned_bytes, solve_target

_LOG = logging.getLogger(__name__)


@dataclass
class PruneRequest:
    """Everything a prune job is asked to do: the input, the output and the option objects; what
    `moeprune.prune_checkpoint(request, pipeline=...)` takes, whichever pipeline runs it."""

    model_path: str | Path
    output: str | Path
    config: PruneConfig
    data: DataOptions = field(default_factory=DataOptions)
    search_data: Sequence[str] = ()
    tokenizer_path: str | Path | None = None
    save: SaveOptions = field(default_factory=SaveOptions)
    run: RunOptions = field(default_factory=RunOptions)
    quantize: QuantizeOptions | None = None  # quantize the result with llm-compressor (quantize/oneshot.py)


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

    def report(self, written: int | None) -> TargetSize | None:
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
    model_path: Path,
    meta: MoEModel,
    config: PruneConfig,
    save_dtype: torch.dtype | None,
    quantize: QuantizeOptions | None = None,
) -> tuple[PruneConfig, PlannedSizes]:
    """The sizes of a job saved in `save_dtype` (None: as stored, a kept quantization's bytes and
    scales), quantized as `quantize` says when given; a `target_size` is solved here into the
    config's sparsity (refused in one line when nothing fits, or when the unpruned model already does)."""
    if save_dtype is None:
        size = stored_weight_bytes(CheckpointLayout(model_path))
    else:
        size = cast_weight_bytes(model_path, meta, save_dtype)
        if quantize is not None:
            size = quantized_weight_bytes(
                size, meta, quantize, torch.empty((), dtype=save_dtype).element_size()
            )
    solution = None
    if config.target_size is not None:
        stock = quantize is not None and ResolvedConfig.of(config).stock
        solution = solve_target(meta, config, size, parse_target_size(config.target_size), stock=stock)
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
        if self.quantize is not None:
            return f"compressed-tensors {self.quantize.describe()}"
        return str(self.save_dtype).removeprefix("torch.")

    sizes: PlannedSizes | None = None  # the input's weights and the result's, planned
    tokenizer_path: Path | None = None  # a tokenizer given apart from the input (carried into the result)
    drop_mtp: bool = False  # leave out the release's multi-token-prediction layers
    quantize: QuantizeOptions | None = None  # quantized after saving, by llm-compressor
    quant_python: str | None = None  # the quantization environment's Python
    # `--quantize auto:...`: the per-layer budget (quantize/per_layer.py)
    precision: PrecisionTarget | None = None
    precision_choice: dict | None = None  # its choice once made (after the surgery): report.json's account
    # --method auto (job/auto.py): (loaded model, job) -> (the job as the chosen recipe runs it, the
    # report's portfolio part), called once the model is loaded; None: the config is the recipe
    choose: Callable[[MoEModel, PruneJob], tuple[PruneJob, Any]] | None = None
    search_doc: dict | None = None  # search.json of a search run before the prune (auto's winner)

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
            "sparsity_unit": ResolvedConfig.of(self.config).method_spec.sparsity_unit,
            **self.layer_budget,
            "calibration": [counts(d) for d in self.calibration],
            "search_data": counts(self.search_set) if self.search_set is not None else None,
            **({"repair": self.config.repair.to_plan()} if self.config.repair.enabled else {}),
            "output": str(self.output),
            "save_dtype": self.saved_as,
            "resume": self.run.resume,
            **(self.sizes.describe() if self.sizes is not None else {}),
            **(self.precision.describe() if self.precision is not None else {}),
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


def check_sources(sources: Sequence[str], what: str) -> None:
    for source in sources:
        path = parse_source(source)[0]
        if not Path(path).exists():
            raise DataError(
                f"{what} path {path} does not exist", options=("search_data" if "search" in what else "data",)
            )


def prepare(request: PruneRequest) -> PruneJob:
    """Every check of a prune request that needs no weights, in the order a user would fix them."""
    model_path, output, config = request.model_path, request.output, request.config
    data, search_data, tokenizer_path = request.data, request.search_data, request.tokenizer_path
    save, run = request.save, request.run
    overwrite, resume, trust_remote_code = run.overwrite, run.resume, run.trust_remote_code
    # auto:'s target is its budget, not a solved sparsity
    config, quantize = resolve_auto(config, request.quantize, bool(data.sources))
    config = check_config(config)
    if data.sequential:
        raise MoePruneError(
            "sequential (layer-by-layer) observation never loads the whole model: use it to score, "
            "or to prune without loading",
            options=("sequential",),
        )
    placement = Placement.choose(data.device, data.dtype)  # an unknown or absent device fails now
    checked, output = check_model_path(model_path), Path(output)
    model_config = load_config(
        checked, trust_remote_code
    )  # damaged, dense or unsupported: before anything else
    # before the input's own format is looked at: a quantize request needs a full-precision input
    config, quant_python = check_input(config, quantize, checked, bool(data.sources))
    kept_quantization = _kept_quantization(checked, config, save)
    if kept_quantization is not None and config.repair.enabled:
        raise MoePruneError(
            f"{model_path} is quantized and the result keeps its format, written from the input's bytes: "
            "repair's trained tensors would not reach it; repair a full-precision model, or save this one "
            "dequantized with --save-dtype bf16",
            options=("repair", "save_dtype"),
        )
    check_weights(checked)  # empty, truncated or missing shards
    check_not_inside(output, [checked])
    recover(output)  # a killed earlier run: put its set-aside result back, drop its temporaries
    check_resume(output, ResolvedConfig.of(config).allocation, resume, overwrite)
    check_output_dir(output, overwrite)
    needs = requirements(config)  # also refuses an unknown criterion or method
    needs.check(search=bool(search_data))
    check_sources(search_data, "search data")
    needs.check(calibration=bool(data.sources))
    check_sources(data.sources, "calibration data")
    meta = MoEModel(build_skeleton(checked, meta=True))
    check_not_packed(meta)
    config = apply_ep_size(meta, config)  # the family's EP divisibility: the plan's expert multiple
    check_groups(quantize, meta)
    save_dtype = _save_dtype(save, checked, model_config, kept_quantization)
    # auto: without --sparsity: the sparsities tried, the job planned at the first
    config, grid = plan_grid(meta, config, quantize, checked, save_dtype)
    if config.target_size is None:
        check_feasible(meta, config)  # an impossible sparsity is refused before sizes are planned
    config, sizes = plan_sizes(checked, meta, config, None if kept_quantization else save_dtype, quantize)
    layer_budget = check_feasible(meta, config)
    config = ResolvedConfig.of(config)
    search = search_for(config)
    if search is not None and search.before_loading is not None:  # the joint search seeds in bytes
        search.before_loading(meta, config, quantize is not None and quantize.joint)
    check_kept_widths(quantize, meta, planned_widths(layer_budget, config))  # a neuron method's, known now
    precision = plan_target(meta, config, quantize, checked, save_dtype, grid, placement)  # T reachable?
    parse_size(save.max_shard_size)
    tokenizer, calibration, search_set = _read_data(request, checked, needs, config)
    lost = precision_lost(placement.dtype, save_dtype) if kept_quantization is None else None
    if lost:  # (a kept quantization is written from the input's bytes: no compute dtype reaches the disk)
        _LOG.warning(lost)
    return PruneJob(
        checked,
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
        Path(tokenizer_path) if tokenizer_path is not None else None,
        save.drop_mtp,
        quantize,
        quant_python,
        precision,
    )


def _save_dtype(save: SaveOptions, checked: Path, model_config, kept: QuantFormat | None) -> torch.dtype:
    """The dtype the result is written in: --save-dtype, else the input's stored dtype (a kept
    quantization is written from the input's bytes, its other tensors in their stored dtype)."""
    if save.dtype and kept is None:
        return resolve_dtype(save.dtype)
    stored = stored_dtype(checked) or getattr(model_config, "dtype", None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def _read_data(request: PruneRequest, checked: Path, needs, config: ResolvedConfig):
    """The tokenizer, calibration sets and search set the run reads (none it does not need):
    GPTQ calibrates on the calibration data too, repair holds out the search data when given."""
    data, search_data = request.data, request.search_data
    tokenizer, calibration, search_set = None, [], None
    reads_calibration = needs.reads_calibration(bool(data.sources))
    reads_search = needs.reads_search(bool(search_data))
    if reads_calibration or reads_search:
        tokenizer = require_tokenizer(checked, request.tokenizer_path, request.run.trust_remote_code)
        if reads_calibration:
            calibration = calibration_sets(tokenizer, data, per_domain=needs.per_domain)
        if reads_search:
            search_set = load_data(
                list(search_data),
                tokenizer,
                num_samples=config.search.samples or None,
                max_length=data.max_length,
                seed=data.seed,
            )
    return tokenizer, calibration, search_set


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
            f"{'not quantized' if fmt is None else fmt.saved_as} (to quantize, use the quantize option): save as fp32, "
            "bf16 or fp16",
            options=("save_dtype", "quantize"),
        )
    if fmt is None or (save.dtype is not None and not asked):
        return None  # full precision in, or dequantized weights asked for
    if not rewrite_supports(ResolvedConfig.of(config)):
        described = quantization_of(read_config_dict(model_path))
        raise MoePruneError(
            f"{model_path} is quantized ({described}): a result in that format is written from the input's bytes, "
            f"which holds whole experts (--method drop, any allocation); "
            f"{ResolvedConfig.of(config).described()} would cut "
            "scale groups or add vectors the input does not have: save dequantized weights with --save-dtype "
            "bf16 (larger on disk), or drop whole experts",
            options=("method", "save_dtype"),
        )
    return fmt


def planned_widths(layer_budget: dict, config: PruneConfig) -> list[int]:
    """The narrowed expert widths a plan will keep, where the structure and options fix them before
    loading (check_feasible's answer): the neurons method's one width per layer, TENP's trapezoid
    widths, the mixed method's uniform genes' widths. A searched allocation (mixed with evo)
    chooses them after scoring: none here (the prune checks its plan before the surgery)."""
    if "neurons_per_expert" in layer_budget:
        return sorted(set(layer_budget["neurons_per_expert"].values()))
    if "narrowed_neurons" in layer_budget and not ResolvedConfig.of(config).allocator.searches:
        return sorted({w for widths in layer_budget["narrowed_neurons"].values() for w in widths})
    return []
