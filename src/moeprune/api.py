"""The Python API behind the CLI: score experts, plan a pruning, apply it, save with evidence.

Each step is a plain function over plain objects (MoEModel, CalibrationData, ExpertStats,
LayerScores, Plan), so scripts can stop, inspect or swap any stage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeprune import __version__
from moeprune.allocate import budget_from_sparsity, global_allocation, plan_removals, uniform_allocation
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.checkpoint import (
    atomic_write_dir,
    build_skeleton,
    check_model_path,
    check_output_dir,
    load_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    write_json,
)
from moeprune.checkpoint.files import DEFAULT_MAX_SHARD_SIZE
from moeprune.criteria import Criterion, LayerScores, compute_scores, get_criterion, unseen_note
from moeprune.data.loading import CalibrationData, load_data, parse_source
from moeprune.errors import DataError, InfeasibleBudgetError, MoePruneError
from moeprune.models import MoEModel
from moeprune.models.parameters import kept_per_layer, kept_rows, padded_parameters, uniform_rows
from moeprune.observe.stats import ExpertStats
from moeprune.plan import Plan
from moeprune.report.kept import plot_kept
from moeprune.report.model_card import model_card
from moeprune.report.plots import plot_search_curve
from moeprune.surgery.drop import check_not_packed

ALLOCATIONS = ("uniform", "global", "trapezoid")
METHODS = ("drop", "novice", "neurons", "tenp")
EXPERT_METHODS = ("drop", "novice")  # sparsity = fraction of experts; else fraction of routed parameters


@dataclass
class MethodOptions:
    """Options of the surgery methods beyond drop (MoNE, ENP, TENP: README, "Surgery methods")."""

    neuron_importance: str = "projection"  # or "l2"
    important_fraction: float | None = None  # TENP: default half the kept budget
    slope: float = 0.5  # TENP: how fast the whole-expert count grows with depth


def default_allocation(method: str) -> str:
    return "trapezoid" if method == "tenp" else "uniform"


def check_method(method: str, allocation: str) -> None:
    """Reject combinations that have no meaning, before any work is done."""
    if method not in METHODS:
        raise MoePruneError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if allocation not in ALLOCATIONS + ("evo",):
        raise MoePruneError(
            f"unknown allocation {allocation!r}; choose one of: {', '.join(ALLOCATIONS + ('evo',))}"
        )
    if (method == "tenp") != (allocation == "trapezoid"):
        raise MoePruneError("the tenp method goes with the trapezoid allocation (and trapezoid only with tenp)",
                            options=("method", "allocation"))
    if method == "neurons" and allocation != "uniform":
        raise MoePruneError(
            "the neurons method prunes every expert to the same width: use the uniform allocation",
            options=("allocation",),
        )


@dataclass
class DataOptions:
    """Where calibration data comes from and how much of it to use."""

    sources: Sequence[str] = ()
    samples: int | None = 128
    max_length: int = 512
    batch_size: int = 8
    seed: int = 0
    packing: bool = False
    device: str | None = None  # None: the GPU when there is one, else the CPU; "auto": device_map="auto"
    sequential: bool = False  # observe one decoder layer at a time, never loading the whole model
    activations_dir: str | None = None  # sequential: cached activations on disk under this folder


def load_placed(model_path: str | Path, data: DataOptions | None, dtype: str | None):
    """Load MODEL where the device and dtype options say (bf16 by default on GPU, fp32 on CPU),
    and refuse weights holding NaN or inf, naming the first such tensor."""
    from moeprune.runtime.distributed import placement
    from moeprune.runtime.finite import check_finite_weights

    device, chosen, device_map = placement((data or DataOptions()).device, dtype)
    model, tokenizer = load_model(model_path, dtype=chosen, device=device, device_map=device_map)
    check_finite_weights(model, f"the model {model_path}")
    return model, tokenizer


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
        f"no tokenizer found in {str(path)!r}; give a folder with tokenizer files", options=("tokenizer_path",)
    )


def calibration_sets(
    tokenizer, criterion: Criterion, options: DataOptions, why: str = ""
) -> list[CalibrationData]:
    """One mixed set, or one set per source for TENP (it normalises per calibration domain)."""
    if not options.sources:
        raise DataError(f"{why or f'criterion {criterion.name!r}'} needs calibration data: give data files",
                        options=("data",))

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
    observe_for: str = "",
    neurons: bool = False,
    sets: Sequence[CalibrationData] | None = None,
) -> tuple[Criterion, list[LayerScores], list[ExpertStats], list[CalibrationData]]:
    """Scores of every MoE layer under one criterion (observing calibration data if it, or the
    surgery method named in `observe_for`, needs it). `sets`: calibration data already loaded
    (else it is loaded from `data` with `tokenizer`)."""
    criterion = get_criterion(criterion_name)
    stats: list[ExpertStats] = []
    sets = list(sets or [])
    if (criterion.needs_data or observe_for) and not sets:
        sets = calibration_sets(tokenizer, criterion, data or DataOptions(), observe_for)
    if sets:
        pad = getattr(tokenizer, "pad_token_id", None) or 0
        from moeprune.runtime.distributed import observe_distributed

        stats = [
            observe_distributed(moe, d, batch_size=(data or DataOptions()).batch_size, pad_token_id=pad,
                                progress=progress, neurons=neurons, domain=d.sources[0] if len(sets) > 1 else "")
            for d in sets
        ]  # fmt: skip
    scores = compute_scores(
        criterion.name,
        stats=(stats if len(stats) > 1 else stats[0]) if stats and criterion.needs_data else None,
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
    stats: Sequence[ExpertStats] = (),
    options: MethodOptions | None = None,
    removed: Sequence[int] | None = None,
    expert_multiple: int = 1,
) -> Plan:
    """Turn scores and a global budget into a per-layer plan, for any method.

    `removed` (experts removed per MoE layer) overrides the allocation; the search passes it.
    `expert_multiple`: every layer keeps a multiple of this many experts (drop and novice).
    """
    check_method(method, allocation)
    options = options or MethodOptions()
    domains = list(stats) if len(stats) > 1 else (stats[0] if stats else None)
    if method == "neurons":
        from moeprune.surgery.neurons import neuron_plan

        return neuron_plan(moe, domains, sparsity, importance=options.neuron_importance, criterion=criterion.name,
                           data_fingerprint=data_fingerprint)  # fmt: skip
    if method == "tenp":
        from moeprune.allocate.trapezoid import tenp_plan

        return tenp_plan(moe, domains, importance_scores(criterion, scores), sparsity,
                         important_fraction=options.important_fraction, slope=options.slope,
                         importance=options.neuron_importance, criterion=criterion.name,
                         data_fingerprint=data_fingerprint)  # fmt: skip
    if removed is None:
        limits = method_limits(moe, method, expert_multiple)
        removed = expert_allocation(moe, criterion, scores, sparsity, allocation, limits)
    if method == "novice":
        from moeprune.surgery.novice import novice_plan

        plan = novice_plan(moe, domains, scores, sparsity, criterion=criterion, allocation=allocation,
                           removed=list(removed), data_fingerprint=data_fingerprint)  # fmt: skip
        plan.extra["budget"] = sum(removed)
        return plan
    return drop_plan(moe, criterion, scores, removed, sparsity, allocation, data_fingerprint)


def importance_scores(criterion: Criterion, scores: Sequence[LayerScores]) -> list[LayerScores]:
    """Scores where higher means more important (TENP keeps the highest whole)."""
    if criterion.prune_first == "lowest":
        return list(scores)
    return [LayerScores(layer=s.layer, scores=-s.scores, order=s.order) for s in scores]


def expert_allocation(
    moe: MoEModel, criterion: Criterion, scores: Sequence[LayerScores], sparsity: float, allocation: str,
    limits: LayerLimits | None = None,
) -> list[int]:  # fmt: skip
    """How many experts each MoE layer loses under the global budget (uniform or global)."""
    limits = limits or layer_limits(moe)
    budget = budget_from_sparsity(sparsity, limits.num_experts, limits.top_k)
    if allocation == "uniform":
        return uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
    if allocation == "global":
        normalize = not criterion.comparable_across_layers
        return global_allocation(
            [s.scores for s in scores], criterion.prune_first, budget, limits.num_experts, limits.top_k, normalize,
            **limits.as_kwargs(),
        )  # fmt: skip
    raise MoePruneError(f"allocation {allocation!r} does not choose expert counts (use uniform, global or evo)")


def method_limits(moe: MoEModel, method: str, expert_multiple: int = 1) -> LayerLimits:
    """Drops change routing (group balance applies); novices stay routed (it does not)."""
    return layer_limits(moe, expert_multiple, routing_changes=method != "novice")


def drop_plan(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    removed: Sequence[int],
    sparsity: float,
    allocation: str,
    data_fingerprint: str,
) -> Plan:
    """Drop the first r_l experts of each layer's pruning order (group-balanced where needed)."""
    layers = moe.layers
    positions = plan_removals([s.order for s in scores], list(removed), [m.n_group for m in layers])
    ids = [[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)]
    plan = Plan.from_removals(
        model_type=moe.model_type,
        num_experts=[m.num_experts for m in layers],
        top_k=[m.top_k for m in layers],
        layer_indices=[m.index for m in layers],
        removals=ids,
        criterion=criterion.name,
        allocation=allocation,
        method="drop",
        sparsity=sparsity,
        data_fingerprint=data_fingerprint,
    )
    plan.extra["budget"] = sum(removed)
    if allocation == "global":
        normal = "none (raw scores)" if criterion.comparable_across_layers else "per-layer sum of |score|"
        plan.extra["global_normalisation"] = normal
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


def apply_plan(moe: MoEModel, plan: Plan, stats: Sequence[ExpertStats] = ()) -> dict:
    """Physical surgery of any plan (drops, novices, neuron counts); returns what was done."""
    from moeprune.surgery.plans import apply_plan_physical

    return apply_plan_physical(moe, plan, list(stats) if len(stats) > 1 else (stats[0] if stats else None))


def weight_bytes(folder: Path) -> int:
    """Bytes of a checkpoint's safetensors weights on disk."""
    from moeprune.checkpoint.files import shard_names

    return sum((Path(folder) / name).stat().st_size for name in shard_names(Path(folder)))


def layer_summary(moe: MoEModel) -> list[dict]:
    from moeprune.models.parameters import describe_layers

    return describe_layers(moe)


def parameter_summary(moe: MoEModel) -> dict[str, int]:
    """Total, routed-expert (TENP's E) and active-per-token (A) parameters, packed layers included."""
    from moeprune.models.parameters import routed_parameters

    return routed_parameters(moe)


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


@dataclass
class SaveOptions:
    """How the result is written (see docs/checkpoint-format.md)."""

    dtype: str | None = None  # None: the dtype the input checkpoint stores (bf16 stays bf16)
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE


@dataclass
class PruneJob:
    """A prune request after every check that needs no weights: what `prune` will do.

    Built by `prepare_prune` in seconds (config, file headers, a model on the meta device,
    tokenized data), so that bad input fails before the expensive part; `dry_run` stops here.
    """

    model_path: Path
    output: Path
    criterion: str
    sparsity: float
    allocation: str
    method: str
    options: MethodOptions
    search: dict
    data: DataOptions
    seed: int
    dtype: str | None
    overwrite: bool
    resume: bool
    expert_multiple: int
    save_dtype: torch.dtype
    max_shard_size: int | str
    meta: MoEModel  # the model on the meta device: structure only
    limits: LayerLimits | None
    tokenizer: object | None
    calibration: list[CalibrationData]
    search_set: CalibrationData | None
    layer_budget: dict  # what is known per layer before scoring (dry run)
    command_line: str | None = None  # how the user asked for it (the model card's "Reproduce")

    def describe(self) -> dict:
        """The plan of work, for --dry-run and the log."""
        return {
            "model": str(self.model_path),
            "family": self.meta.model_type,
            "moe_layers": [m.index for m in self.meta.layers],
            "experts_per_layer": [m.num_experts for m in self.meta.layers],
            "top_k": [m.top_k for m in self.meta.layers],
            "criterion": self.criterion,
            "allocation": self.allocation,
            "method": self.method,
            "sparsity": self.sparsity,
            "sparsity_unit": "experts" if self.method in EXPERT_METHODS else "routed-expert parameters",
            **self.layer_budget,
            "calibration": [_data_counts(d) for d in self.calibration],
            "search_data": _data_counts(self.search_set) if self.search_set is not None else None,
            "output": str(self.output),
            "save_dtype": str(self.save_dtype).removeprefix("torch."),
            "resume": self.resume,
        }


def _data_counts(data: CalibrationData) -> dict:
    return {"sources": list(data.sources), "samples": len(data.samples),
            "tokens": sum(len(s.input_ids) for s in data.samples), "truncated": data.truncated}  # fmt: skip


def prepare_prune(
    model_path: str | Path,
    output: str | Path,
    *,
    criterion: str,
    sparsity: float,
    allocation: str | None = None,
    method: str = "drop",
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    dtype: str | None = None,
    overwrite: bool = False,
    options: MethodOptions | None = None,
    search: dict | None = None,
    resume: bool = False,
    save: SaveOptions | None = None,
    expert_multiple: int = 1,
    trust_remote_code: bool = False,
) -> PruneJob:
    """Every check of a prune request that needs no weights, in the order a user would fix them."""
    from moeprune.allocate.search.auto import AUTO
    from moeprune.checkpoint.atomic import check_not_inside, recover
    from moeprune.checkpoint.files import check_weights, stored_dtype

    data, options, search, save = data or DataOptions(), options or MethodOptions(), dict(search or {}), save or SaveOptions()
    allocation = allocation or default_allocation(method)
    check_method(method, allocation)
    auto = criterion == AUTO
    crit = get_criterion("reap" if auto else criterion)  # auto: one observation feeds every criterion
    check_sparsity(sparsity)
    if data.sequential:
        raise MoePruneError(
            "sequential (layer-by-layer) observation never loads the whole model: use it to score, or to prune "
            "without loading", options=("sequential",),
        )  # fmt: skip
    from moeprune.runtime.distributed import placement

    placement(data.device, dtype)  # an unknown or absent device fails now, not after tokenizing
    model_path, output = check_model_path(model_path), Path(output)
    config = load_config(model_path, trust_remote_code)  # damaged, dense or unsupported: before anything else
    check_weights(model_path)  # empty, truncated or missing shards
    check_not_inside(output, [model_path])
    recover(output)  # a killed earlier run: put its set-aside result back, drop its temporaries
    check_resume(output, allocation, resume, overwrite)
    if not resume:
        check_output_dir(output, overwrite)
    searching = allocation == "evo" or auto
    if searching and not search.get("search_data"):
        what = "an EvoESAP search" if allocation == "evo" else "choosing the criterion automatically"
        raise MoePruneError(f"{what} needs search data (prompt/answer files)", options=("search_data",))
    if searching:
        check_search_settings(search)
    needs_stats = method != "drop" or auto
    if (crit.needs_data or needs_stats) and not data.sources:
        why = f"the {method} method" if method != "drop" else f"criterion {crit.name!r}"
        raise DataError(f"{why} needs calibration data: give data files", options=("data",))
    for source in data.sources:
        if not Path(parse_source(source)[0]).exists():
            raise DataError(f"calibration data path {parse_source(source)[0]} does not exist", options=("data",))
    meta = MoEModel(build_skeleton(model_path, meta=True))
    check_not_packed(meta)
    limits, layer_budget = _check_feasible(meta, method, allocation, sparsity, options, expert_multiple)
    tokenizer = None
    calibration: list[CalibrationData] = []
    search_set = None
    if crit.needs_data or needs_stats or searching:
        tokenizer = require_tokenizer(load_tokenizer(model_path, trust_remote_code), model_path, tokenizer_path)
        calibration = calibration_sets(tokenizer, crit, data)
        if searching:
            search_set = load_data(list(search["search_data"]), tokenizer, num_samples=search.get("search_samples") or None,
                                   max_length=data.max_length, seed=seed)  # fmt: skip
    save_dtype = resolve_dtype(save.dtype) if save.dtype else (stored_dtype(model_path) or getattr(config, "dtype", None))
    if not isinstance(save_dtype, torch.dtype):
        save_dtype = resolve_dtype(save_dtype if save_dtype in ("float32", "bfloat16", "float16") else None)
    from moeprune.checkpoint.files import parse_size

    parse_size(save.max_shard_size)
    return PruneJob(
        model_path=model_path, output=output, criterion=criterion, sparsity=sparsity, allocation=allocation,
        method=method, options=options, search=search, data=data, seed=seed, dtype=dtype, overwrite=overwrite,
        resume=resume, expert_multiple=expert_multiple, save_dtype=save_dtype, max_shard_size=save.max_shard_size,
        meta=meta, limits=limits, tokenizer=tokenizer, calibration=calibration, search_set=search_set,
        layer_budget=layer_budget,
    )  # fmt: skip


def check_sparsity(sparsity: float) -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) or not 0 < sparsity < 1:
        raise MoePruneError(f"sparsity must be a number strictly between 0 and 1, got {sparsity!r}",
                            options=("sparsity",))  # fmt: skip


def check_resume(output: Path, allocation: str, resume: bool, overwrite: bool) -> None:
    """Resuming continues an interrupted EvoESAP search; it never deletes or replaces anything."""
    if not resume:
        return
    if allocation != "evo":
        raise MoePruneError("resuming continues an interrupted EvoESAP search; it needs the evo allocation",
                            options=("resume", "allocation"))  # fmt: skip
    if overwrite:
        raise MoePruneError("resuming continues a search into a new output; it cannot also replace an existing one",
                            options=("resume", "overwrite"))  # fmt: skip
    state = search_state_path(output)
    if output.exists():
        raise MoePruneError(
            f"{str(output)!r} already exists and holds a finished result, not a search in progress: nothing to "
            "resume; choose another output", options=("resume",),
        )  # fmt: skip
    if not state.is_file():
        raise MoePruneError(f"nothing to resume: no search in progress for {str(output)!r} (no {state.name})",
                            options=("resume",))  # fmt: skip
    check_output_dir(output, overwrite=False)


def _check_feasible(
    meta: MoEModel, method: str, allocation: str, sparsity: float, options: MethodOptions, expert_multiple: int
) -> tuple[LayerLimits | None, dict]:
    """Refuse a budget no plan can meet, from the config alone; returns what is known per layer."""
    if method in EXPERT_METHODS:
        limits = method_limits(meta, method, expert_multiple)
        budget = budget_from_sparsity(sparsity, limits.num_experts, limits.top_k)
        uniform = uniform_allocation(budget, limits.num_experts, limits.top_k, **limits.as_kwargs())
        known = {"budget_experts_removed": budget}
        if allocation == "uniform":
            known["removed_per_layer"] = dict(zip(limits.layers, uniform))
        return limits, known
    if expert_multiple != 1:
        uneven = [m.index for m in meta.layers if m.num_experts % expert_multiple]
        if uneven:
            raise InfeasibleBudgetError(f"decoder layer {uneven[0]} has {meta.layer(uneven[0]).num_experts} experts, "
                                        f"not a multiple of {expert_multiple}", options=("expert_multiple",))  # fmt: skip
    from moeprune.surgery.neurons import check_importance, check_neuron_prunable, uniform_widths

    check_importance(options.neuron_importance)
    check_neuron_prunable(meta)
    if method == "neurons":
        return None, {"neurons_per_expert": dict(zip([m.index for m in meta.layers], uniform_widths(meta, sparsity)))}
    from moeprune.allocate.trapezoid import TrapezoidLayer, trapezoid_allocation
    from moeprune.surgery.packed import layer_cost

    layers = [TrapezoidLayer(m.num_experts, m.intermediate_size, layer_cost(m)) for m in meta.layers]
    alloc = trapezoid_allocation(layers, 1 - sparsity, options.important_fraction, options.slope)
    return None, {"whole_experts_per_layer": dict(zip([m.index for m in meta.layers], alloc.important)),
                  "neuron_keep_ratio": alloc.neuron_ratio}  # fmt: skip


def prune(
    model_path: str | Path,
    output: str | Path,
    *,
    criterion: str,
    sparsity: float,
    allocation: str | None = None,
    method: str = "drop",
    data: DataOptions | None = None,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    options: MethodOptions | None = None,
    search: dict | None = None,
    resume: bool = False,
    dry_run: bool = False,
    save: SaveOptions | None = None,
    expert_multiple: int = 1,
    trust_remote_code: bool = False,
    command_line: str | None = None,
) -> dict:
    """Check, load, score, plan, cut and save; returns the report written beside the checkpoint
    (with `dry_run`, the plan of work, and nothing is loaded or written).

    `search` holds the EvoESAP settings when `allocation == "evo"` (see moeprune.search).
    Under torchrun (after `init_distributed()`) every rank runs this with the same arguments:
    observation and the search are data-parallel, and rank 0 alone writes OUTPUT.
    """
    from moeprune.checkpoint.atomic import output_lock
    from moeprune.runtime.distributed import barrier, rank_and_world

    job = prepare_prune(
        model_path, output, criterion=criterion, sparsity=sparsity, allocation=allocation, method=method, data=data,
        tokenizer_path=tokenizer_path, seed=seed, dtype=dtype, overwrite=overwrite, options=options, search=search,
        resume=resume, save=save, expert_multiple=expert_multiple, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    if dry_run:
        return job.describe()
    job.command_line = command_line
    rank, _ = rank_and_world()
    barrier()  # torchrun: every rank has checked OUTPUT before rank 0 can write it
    with output_lock(job.output) if rank == 0 else nullcontext():
        return run_prune(job, progress=progress)


def run_prune(job: PruneJob, progress: bool = True) -> dict:
    """The expensive part of `prune`, on a checked job."""
    from moeprune.allocate.search.auto import AUTO, choose_criterion
    from moeprune.checkpoint import write_checkpoint
    from moeprune.runtime.distributed import rank_and_world

    rank, _ = rank_and_world()
    search, data, method, allocation = job.search, job.data, job.method, job.allocation
    auto = job.criterion == AUTO
    crit = get_criterion("reap" if auto else job.criterion)
    timer = Timer()
    model, _ = load_placed(job.model_path, data, job.dtype)
    tokenizer = job.tokenizer
    moe = MoEModel(model)
    before_layers, before_params = layer_summary(moe), parameter_summary(moe)
    kept_before = kept_per_layer(moe)
    timer.lap("load")
    crit, scores, stats, sets = score_experts(
        moe, crit.name, tokenizer=tokenizer, data=data, seed=job.seed, progress=progress,
        observe_for=f"the {method} method" if method != "drop" else ("criterion auto" if auto else ""),
        neurons=method in ("neurons", "tenp"), sets=job.calibration,
    )  # fmt: skip
    auto_table = None
    if auto:
        best, auto_table = choose_criterion(
            moe, stats, job.search_set, sparsity=job.sparsity, method=method, fitness=search.get("fitness", "esap"),
            batch_size=data.batch_size, pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            seed=job.seed, progress=progress,
        )  # fmt: skip
        crit = get_criterion(best)
        scores = compute_scores(
            best, stats=(stats if len(stats) > 1 else stats[0]) if crit.needs_data else None,
            weights=moe.layers if crit.needs_weights else None, seed=job.seed, layers=[m.index for m in moe.layers],
        )  # fmt: skip
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    removed, search_doc = None, None
    if allocation == "evo":
        removed, search_doc = search_allocation(
            moe, crit, scores, stats, job.sparsity, method=method, tokenizer=tokenizer, output=job.output,
            seed=job.seed, progress=progress, data=data, search_set=job.search_set, resume=job.resume,
            expert_multiple=job.expert_multiple, **search,
        )  # fmt: skip
        timer.lap("search")
    plan = build_plan(
        moe, crit, scores, sparsity=job.sparsity, allocation=allocation, method=method, data_fingerprint=fingerprint,
        stats=stats, options=job.options, removed=removed, expert_multiple=job.expert_multiple,
    )  # fmt: skip
    surgery = apply_plan(moe, plan, stats)
    timer.lap("surgery")
    report = {
        "command": "prune",
        "moeprune_version": __version__,
        "model": str(job.model_path),
        "output": str(job.output),
        "model_type": moe.model_type,
        "criterion": crit.name,
        "prune_first": crit.prune_first,
        "allocation": allocation,
        "method": method,
        "sparsity": job.sparsity,
        "sparsity_unit": "experts" if method in EXPERT_METHODS else "routed-expert parameters",
        "expert_multiple": job.expert_multiple,
        "budget_experts_removed": plan.extra.get("budget"),
        "removed_per_layer": {str(lp.layer): len(lp.dropped) + len(lp.novice) for lp in plan.layers},
        "surgery": surgery,
        "layers_before": before_layers,
        "layers_after": layer_summary(moe),
        "parameters_before": before_params,
        "parameters_after": parameter_summary(moe),
        "kept_per_layer": kept_rows(kept_before, kept_per_layer(moe)),
        "save_dtype": str(job.save_dtype).removeprefix("torch."),
        "data": data_summary(sets, stats),
        "unseen_experts": unseen_note(stats if len(stats) > 1 else stats[0]) if stats else [],
        "scores": scores_document(crit, scores, stats),
    }
    if auto_table is not None:
        report["criterion_auto"] = {"fitness": search.get("fitness", "esap"), "chosen": crit.name, "table": auto_table}
    if search_doc is not None:
        report["search"] = {k: search_doc[k] for k in ("fitness", "budget", "allocation", "fitness_value", "uniform", "evaluations", "stopped",
                                                       "teacher_cache", "notes") if k in search_doc}  # fmt: skip

    report["command_line"] = job.command_line
    if surgery.get("form") == "packed" or not moe.is_uniform():
        report["serving"] = {"vllm_padded_parameters": padded_parameters(moe)["total"]}

    def write(tmp: Path) -> None:
        report["format"] = write_checkpoint(model, tmp, tokenizer, dtype=job.save_dtype, max_shard_size=job.max_shard_size)
        report["disk_bytes"] = {"before": weight_bytes(job.model_path), "after": weight_bytes(tmp)}
        plan.save(tmp / "plan.json")
        if search_doc is not None:
            write_json(tmp / "search.json", search_doc)
            plot_search_curve(tmp / "search_curve.png", search_doc["generations"], search_doc["fitness"])
        draw_kept(tmp / "density.png", report, search_doc, moe)
        timer.lap("save")
        report["timing_s"] = timer.total()
        write_json(tmp / "report.json", report)
        (tmp / "README.md").write_text(model_card(report, str(job.output)))

    if rank != 0:  # torchrun: every rank holds the same result; one writes
        return report
    atomic_write_dir(job.output, write, overwrite=job.overwrite)
    if allocation == "evo":  # the search's state and race log (moeprune.search) are done with
        state = search_state_path(job.output)
        state.unlink(missing_ok=True)
        state.with_name(state.name + ".raced.json").unlink(missing_ok=True)
    return report


SEARCH_STATE = "search_state.json"


def search_state_path(output: Path) -> Path:
    """The search checkpoints beside the output folder (the output itself only appears at the end)."""
    return output.parent / f".{output.name}.{SEARCH_STATE}"


def search_allocation(
    moe: MoEModel,
    criterion: Criterion,
    scores: Sequence[LayerScores],
    stats: Sequence[ExpertStats],
    sparsity: float,
    *,
    method: str,
    tokenizer,
    output: Path,
    seed: int,
    progress: bool,
    data: DataOptions,
    search_data: Sequence[str] = (),
    search_set: CalibrationData | None = None,
    search_samples: int = 64,
    fitness: str = "esap",
    population: int = 32,
    elites: int = 4,
    generations: int = 50,
    delta_max: int = 4,
    tau_max: int = 3,
    search_seed: int = 42,
    patience: int | None = None,
    resume: bool = False,
    expert_multiple: int = 1,
) -> tuple[list[int], dict]:
    """EvoESAP: experts removed per MoE layer, searched on teacher-forced answer tokens.

    Candidates are evaluated with the method's virtual form (drop: router slicing; novice:
    constant substitution), never by copying the model. The state is checkpointed every
    generation beside OUTPUT; `resume` continues it and refuses other data or arguments.
    """
    from moeprune.allocate.search.candidates import run_evo_search
    from moeprune.allocate.search.evo import EvoConfig

    if method not in EXPERT_METHODS:
        raise MoePruneError(f"the evo allocation searches expert counts: use the drop or novice method, not {method!r}",
                            options=("method",))  # fmt: skip
    config = EvoConfig(population=population, elites=elites, generations=generations, delta_max=delta_max,
                       tau_max=tau_max, seed=search_seed, patience=patience)  # fmt: skip
    if search_set is None:
        search_set = load_data(list(search_data), tokenizer, num_samples=search_samples or None,
                               max_length=data.max_length, seed=seed)  # fmt: skip
    budget = budget_from_sparsity(
        sparsity, [m.num_experts for m in moe.layers], [m.top_k for m in moe.layers]
    )
    context = _novice_context(moe, stats) if method == "novice" else None
    fingerprint = {"model": model_fingerprint(moe), "criterion": criterion.name, "method": method,
                   "sparsity": sparsity, "calibration": [s.data_fingerprint for s in stats]}  # fmt: skip
    state = search_state_path(output)
    removed, document = run_evo_search(
        moe, search_set, [s.order for s in scores], budget, fitness=fitness, config=config, state_path=state,
        resume=resume, fingerprint=fingerprint, batch_size=data.batch_size, progress=progress,
        pad_token_id=getattr(tokenizer, "pad_token_id", None), candidate_context=context,
        expert_multiple=expert_multiple,
    )  # fmt: skip
    return removed, document


def check_search_settings(search: dict) -> None:
    """Everything about the search that can be wrong, checked before any model is loaded."""
    from moeprune.allocate.search.evo import EvoConfig
    from moeprune.allocate.search.fitness import check_fitness

    for source in search.get("search_data", ()):
        path = parse_source(source)[0]
        if not Path(path).exists():
            raise DataError(f"search data path {path} does not exist")
    check_fitness(search.get("fitness", "esap"))
    keys = ("population", "elites", "generations", "delta_max", "tau_max", "patience")
    config = EvoConfig(**{k: search[k] for k in keys if k in search})
    if config.population < config.elites:
        raise MoePruneError(f"evo population ({config.population}) must be >= elites ({config.elites})",
                            options=("population", "elites"))
    if min(config.generations, config.delta_max, config.tau_max, config.elites) < 1:
        raise MoePruneError("generations, delta_max, tau_max and elites must be at least 1",
                            options=("generations", "delta_max", "tau_max", "elites"))


def model_fingerprint(moe: MoEModel) -> str:
    """Identifies the model a search ran on: its config and a checksum of its router weights."""
    import hashlib

    digest = hashlib.sha256(json.dumps(moe.config.to_dict(), sort_keys=True, default=str).encode())
    for layer in moe.layers:
        digest.update(layer.router.weight.detach().float().cpu().numpy().tobytes())
    return f"{moe.model_type}:{digest.hexdigest()[:16]}"


def _novice_context(moe: MoEModel, stats: Sequence[ExpertStats]):
    """Virtual MoNE candidates: removed experts add g_i(t) mu_i instead of running."""
    from moeprune.models.routed import RoutedOptions, override_routed
    from moeprune.surgery.novice import layer_stats, mean_outputs

    def context(removed: dict[int, list[int]]):
        novices = {}
        for index, positions in removed.items():
            layer = moe.layer(index)
            novices[index] = mean_outputs(layer, layer_stats(list(stats), layer), positions)
        return override_routed(moe, RoutedOptions(novices=novices))

    return context


def draw_kept(path: Path, report: dict, search_doc: dict | None, moe: MoEModel) -> None:
    """density.png: kept routed parameters (and experts) per layer; uniform beside a searched one."""
    rows = report["kept_per_layer"]
    uniform = None
    if search_doc is not None:
        hidden = [m.hidden_size for m in moe.layers]
        uniform = uniform_rows(
            [{"layer": r["layer"], "experts": r["experts_before"], "routed_params": r["routed_params_before"]} for r in rows],
            search_doc["uniform"]["allocation"], hidden, novices=report["method"] == "novice",
        )  # fmt: skip
    what = f"{report['criterion']}, {report['allocation']}, {report['method']}, sparsity {report['sparsity']}"
    plot_kept(path, rows, expert_unit=report["method"] in EXPERT_METHODS, title=f"kept per layer ({what})",
              compare=uniform)  # fmt: skip


def prepare_score(
    model_path: str | Path, output: str | Path, criterion: str, *, data: DataOptions, tokenizer_path=None,
    overwrite: bool = False, trust_remote_code: bool = False, load_sets: bool = True,
) -> tuple[Path, object | None, list[CalibrationData]]:  # fmt: skip
    """The checks of `moeprune score` that need no weights; returns (model path, tokenizer, data)."""
    from moeprune.checkpoint.atomic import check_creatable, check_not_inside
    from moeprune.checkpoint.files import check_weights
    from moeprune.runtime.distributed import placement

    crit = get_criterion(criterion)
    placement(data.device if data.device != "auto" or not data.sequential else None, None)
    model_path = check_model_path(model_path)
    load_config(model_path, trust_remote_code)
    check_weights(model_path)
    output = Path(output)
    check_not_inside(output, [model_path], what="scores file")
    if output.is_dir():
        raise MoePruneError(f"{str(output)!r} is a folder; the scores go to a JSON file", options=("output",))
    if output.exists() and not overwrite:
        raise MoePruneError(f"{str(output)!r} already exists; choose another path or allow overwriting it",
                            options=("overwrite",))  # fmt: skip
    check_creatable(output)
    if not crit.needs_data:
        return model_path, None, []
    for source in data.sources:
        if not Path(parse_source(source)[0]).exists():
            raise DataError(f"calibration data path {parse_source(source)[0]} does not exist", options=("data",))
    tokenizer = require_tokenizer(load_tokenizer(model_path, trust_remote_code), model_path, tokenizer_path)
    return model_path, tokenizer, calibration_sets(tokenizer, crit, data) if load_sets else []


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
    calibration statistics observed one decoder layer at a time (--sequential).

    `observe_for` names a surgery method that needs the statistics whatever the criterion
    (`neurons`: with neuron sums); the criterion is then only a label for a weight-only
    criterion, whose scores are not streamed (an empty list: the method does not use them).
    """
    from moeprune.runtime.distributed import observe_sequential_distributed, placement
    from moeprune.shards.layout import score_checkpoint

    crit = get_criterion(criterion)
    if not crit.needs_data and not observe_for:
        return crit, score_checkpoint(model_path, criterion, seed=seed), [], []
    data = data or DataOptions()
    tokenizer = require_tokenizer(load_tokenizer(check_model_path(model_path)), model_path, tokenizer_path)
    device, chosen, _ = placement(data.device if data.device != "auto" else None, dtype)
    sets = calibration_sets(tokenizer, crit, data, observe_for)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    stats = [
        observe_sequential_distributed(model_path, d, batch_size=data.batch_size, pad_token_id=pad, device=device,
                                       dtype=chosen, progress=progress, neurons=neurons,
                                       offload_dir=data.activations_dir)
        for d in sets
    ]  # fmt: skip
    if not crit.needs_data:
        return crit, [], stats, sets
    scores = compute_scores(
        crit.name,
        stats=stats if len(stats) > 1 else stats[0],
        seed=seed,
        layers=[s.layer for s in stats[0].layers],
    )
    return crit, scores, stats, sets


NO_LOAD_METHODS = ("drop", "neurons")  # what `prune --no-load` can write as a stock checkpoint


def prune_without_loading(
    model_path: str | Path, output: str | Path, *, criterion: str, sparsity: float, seed: int = 0,
    overwrite: bool = False, data: DataOptions | None = None, tokenizer_path: str | Path | None = None,
    dtype: str | None = None, progress: bool = True, method: str = "drop", options: MethodOptions | None = None,
) -> dict:  # fmt: skip
    """Score without loading (streamed weights or layer-by-layer observation), then rewrite the
    shards: the whole model is never in memory.

    `method` "drop" removes whole experts (uniform allocation); "neurons" keeps each routed
    expert's top-K neurons (K the same for all: a stock checkpoint), chosen from neuron
    statistics observed layer by layer.
    """
    from moeprune.checkpoint.atomic import check_not_inside, output_lock, recover

    if method not in NO_LOAD_METHODS:
        raise MoePruneError(
            f"pruning without loading rewrites shards for the {' or '.join(NO_LOAD_METHODS)} method (uniform "
            f"allocation); the {method} method needs the loaded model", options=("no_load", "method"),
        )  # fmt: skip
    check_sparsity(sparsity)
    model_path = check_model_path(model_path)
    check_not_inside(output, [model_path])
    recover(Path(output))
    check_output_dir(output, overwrite)
    with output_lock(output) if _writes_outputs() else nullcontext():
        return _prune_without_loading(
            model_path, output, criterion=criterion, sparsity=sparsity, seed=seed, overwrite=overwrite, data=data,
            tokenizer_path=tokenizer_path, dtype=dtype, progress=progress, method=method, options=options,
        )  # fmt: skip


def _prune_without_loading(
    model_path: Path, output: str | Path, *, criterion: str, sparsity: float, seed: int, overwrite: bool,
    data: DataOptions | None, tokenizer_path: str | Path | None, dtype: str | None, progress: bool, method: str,
    options: MethodOptions | None,
) -> dict:  # fmt: skip
    from moeprune.shards.layout import meta_model, rewrite_checkpoint

    timer = Timer()
    moe = meta_model(model_path)
    if method == "drop":  # the budget's feasibility needs no scores: fail before scoring
        expert_allocation(moe, get_criterion(criterion), [], sparsity, "uniform")
    if method == "neurons":
        return _shrink_without_loading(
            model_path, output, moe, timer, criterion=criterion, sparsity=sparsity, seed=seed, overwrite=overwrite,
            data=data, tokenizer_path=tokenizer_path, dtype=dtype, progress=progress, options=options,
        )  # fmt: skip
    crit, scores, stats, sets = score_without_loading(
        model_path,
        criterion,
        data=data,
        tokenizer_path=tokenizer_path,
        seed=seed,
        dtype=dtype,
        progress=progress,
    )
    timer.lap("score")
    plan = build_plan(moe, crit, scores, sparsity=sparsity, allocation="uniform", method="drop")
    report = {
        **_no_load_report(model_path, output, moe, crit, "drop", sparsity),
        "budget_experts_removed": plan.extra.get("budget"),
        "removed_per_layer": {str(lp.layer): len(lp.dropped) for lp in plan.layers},
        "data": data_summary(sets, stats),
        "scores": scores_document(crit, scores, stats),
    }

    def extra(tmp: Path) -> None:
        timer.lap("rewrite")
        report["timing_s"] = timer.total()
        write_json(tmp / "report.json", report)

    if _writes_outputs():
        rewrite_checkpoint(model_path, output, plan, overwrite=overwrite, extra=extra)
    return report


def _no_load_report(
    model_path: str | Path, output: str | Path, moe: MoEModel, crit: Criterion, method: str, sparsity: float
) -> dict:
    """report.json fields every --no-load run shares (the result is always a stock checkpoint)."""
    return {
        "command": "prune --no-load",
        "moeprune_version": __version__,
        "model": str(model_path),
        "output": str(output),
        "model_type": moe.model_type,
        "criterion": crit.name,
        "allocation": "uniform",
        "method": method,
        "sparsity": sparsity,
        "format": "stock",
    }


def _writes_outputs() -> bool:
    """Under torchrun every rank observes its share of the data; rank 0 alone writes."""
    from moeprune.runtime.distributed import rank_and_world

    return rank_and_world()[0] == 0


def _shrink_without_loading(
    model_path: str | Path, output: str | Path, moe: MoEModel, timer: Timer, *, criterion: str, sparsity: float,
    seed: int, overwrite: bool, data: DataOptions | None, tokenizer_path: str | Path | None, dtype: str | None,
    progress: bool, options: MethodOptions | None,
) -> dict:  # fmt: skip
    """`prune_without_loading` for --method neurons: observe with neuron sums, plan, rewrite."""
    from moeprune.criteria import unseen_note
    from moeprune.shards.layout import meta_model
    from moeprune.shards.neurons import check_stock_shrink, keep_summary, rewrite_neuron_checkpoint
    from moeprune.surgery.neurons import check_importance, uniform_widths
    from moeprune.surgery.plans import resolve_plan

    options = options or MethodOptions()
    importance = check_importance(options.neuron_importance)
    check_stock_shrink(moe)  # before any observation
    uniform_widths(moe, sparsity)
    before_layers, before_params = layer_summary(moe), parameter_summary(moe)
    crit, scores, stats, sets = score_without_loading(
        model_path, criterion, data=data, tokenizer_path=tokenizer_path, seed=seed, dtype=dtype, progress=progress,
        observe_for="the neurons method", neurons=True,
    )  # fmt: skip
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    plan = build_plan(moe, crit, scores, sparsity=sparsity, allocation="uniform", method="neurons",
                      data_fingerprint=fingerprint, stats=stats, options=options)  # fmt: skip
    keep = resolve_plan(moe, plan, stats if len(stats) > 1 else stats[0]).keep
    width = next((c for lp in plan.layers for c in lp.neurons.values()), moe.layers[0].intermediate_size)
    report = {
        **_no_load_report(model_path, output, moe, crit, "neurons", sparsity),
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
        "unseen_experts": unseen_note(stats if len(stats) > 1 else stats[0]),
        "scores": scores_document(crit, scores, stats),
    }

    def extra(tmp: Path) -> None:
        after = meta_model(tmp)  # the written config, on the meta device
        report["layers_after"], report["parameters_after"] = layer_summary(after), parameter_summary(after)
        timer.lap("rewrite")
        report["timing_s"] = timer.total()
        write_json(tmp / "report.json", report)

    if _writes_outputs():
        rewrite_neuron_checkpoint(model_path, output, plan, keep, overwrite=overwrite, extra=extra)
    return report
