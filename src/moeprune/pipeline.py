"""The Python API behind the CLI: score experts, plan a pruning, apply it, save with evidence.

Each step is a plain function over plain objects (MoEModel, CalibrationData, ExpertStats,
LayerScores, Plan), so scripts can stop, inspect or swap any stage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .allocate import (
    budget_from_sparsity,
    global_allocation,
    group_limited_cap,
    plan_removals,
    uniform_allocation,
)
from .criteria import Criterion, LayerScores, compute_scores, get_criterion, unseen_note
from .data import CalibrationData, load_data, parse_source
from .errors import DataError, MoePruneError
from .io import atomic_write_dir, check_model_path, check_output_dir, load_model, load_tokenizer, write_json
from .models import MoEModel
from .plan import Plan
from .stats import ExpertStats
from .surgery.drop import check_not_packed

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
        raise MoePruneError("--method tenp goes with --allocation trapezoid (and trapezoid only with tenp)")
    if method == "neurons" and allocation != "uniform":
        raise MoePruneError(
            "--method neurons prunes every expert to the same width: use --allocation uniform"
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
    """Load MODEL where --device / --dtype say (bf16 by default on GPU, fp32 on CPU)."""
    from .distributed import placement

    device, chosen, device_map = placement((data or DataOptions()).device, dtype)
    return load_model(model_path, dtype=chosen, device=device, device_map=device_map)


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
        f"no tokenizer found in {str(path)!r}; pass --tokenizer PATH (a folder with tokenizer files)"
    )


def calibration_sets(
    tokenizer, criterion: Criterion, options: DataOptions, why: str = ""
) -> list[CalibrationData]:
    """One mixed set, or one set per source for TENP (it normalises per calibration domain)."""
    if not options.sources:
        raise DataError(f"{why or f'criterion {criterion.name!r}'} needs calibration data: pass --data FILE")

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
) -> tuple[Criterion, list[LayerScores], list[ExpertStats], list[CalibrationData]]:
    """Scores of every MoE layer under one criterion (observing calibration data if it, or the
    surgery method named in `observe_for`, needs it)."""
    criterion = get_criterion(criterion_name)
    stats: list[ExpertStats] = []
    sets: list[CalibrationData] = []
    if criterion.needs_data or observe_for:
        sets = calibration_sets(tokenizer, criterion, data or DataOptions(), observe_for)
        pad = getattr(tokenizer, "pad_token_id", None) or 0
        from .distributed import observe_distributed

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
) -> Plan:
    """Turn scores and a global budget into a per-layer plan, for any method.

    `removed` (experts removed per MoE layer) overrides the allocation; the search passes it.
    """
    check_method(method, allocation)
    options = options or MethodOptions()
    domains = list(stats) if len(stats) > 1 else (stats[0] if stats else None)
    if method == "neurons":
        from .surgery.neurons import neuron_plan

        return neuron_plan(moe, domains, sparsity, importance=options.neuron_importance, criterion=criterion.name,
                           data_fingerprint=data_fingerprint)  # fmt: skip
    if method == "tenp":
        from .allocate.trapezoid import tenp_plan

        return tenp_plan(moe, domains, importance_scores(criterion, scores), sparsity,
                         important_fraction=options.important_fraction, slope=options.slope,
                         importance=options.neuron_importance, criterion=criterion.name,
                         data_fingerprint=data_fingerprint)  # fmt: skip
    if removed is None:
        removed = expert_allocation(moe, criterion, scores, sparsity, allocation)
    if method == "novice":
        from .surgery.novice import novice_plan

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


def removal_limits(moe: MoEModel) -> dict[str, list[int]]:
    """Per MoE layer: removals must be multiples of the routing groups and stay under the cap."""
    caps = [
        group_limited_cap(m.num_experts, m.top_k, m.n_group, m.topk_group)
        if m.n_group > 1
        else m.num_experts - m.top_k
        for m in moe.layers
    ]
    return {"multiple_of": [m.n_group for m in moe.layers], "max_removed": caps}


def expert_allocation(
    moe: MoEModel, criterion: Criterion, scores: Sequence[LayerScores], sparsity: float, allocation: str
) -> list[int]:
    """How many experts each MoE layer loses under the global budget (uniform or global)."""
    layers = moe.layers
    num_experts = [m.num_experts for m in layers]
    top_k = [m.top_k for m in layers]
    budget = budget_from_sparsity(sparsity, num_experts, top_k)
    limits = removal_limits(moe)
    if allocation == "uniform":
        return uniform_allocation(budget, num_experts, top_k, **limits)
    if allocation == "global":
        normalize = not criterion.comparable_across_layers
        return global_allocation(
            [s.scores for s in scores], criterion.prune_first, budget, num_experts, top_k, normalize, **limits
        )
    raise MoePruneError(
        f"allocation {allocation!r} does not choose expert counts (use uniform, global or evo)"
    )


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
    from .surgery.plans import apply_plan_physical

    return apply_plan_physical(moe, plan, list(stats) if len(stats) > 1 else (stats[0] if stats else None))


def layer_summary(moe: MoEModel) -> list[dict]:
    from .parameters import describe_layers

    return describe_layers(moe)


def parameter_summary(moe: MoEModel) -> dict[str, int]:
    """Total, routed-expert (TENP's E) and active-per-token (A) parameters, packed layers included."""
    from .parameters import routed_parameters

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
) -> dict:
    """Load, score, plan, cut and save; returns the report written beside the checkpoint.

    `search` holds the EvoESAP settings when `allocation == "evo"` (see moeprune.search).
    Under torchrun (after `init_distributed()`) every rank runs this with the same arguments:
    observation and the search are data-parallel, and rank 0 alone writes OUTPUT.
    """
    from .auto import AUTO, choose_criterion
    from .checkpoint import write_checkpoint
    from .distributed import barrier, rank_and_world

    allocation = allocation or default_allocation(method)
    check_method(method, allocation)
    check_output_dir(output, overwrite)  # fail before any expensive work
    rank, _ = rank_and_world()
    barrier()  # torchrun: every rank has checked OUTPUT before rank 0 can write it
    search = search or {}
    auto = criterion == AUTO
    if (allocation == "evo" or auto) and not search.get("search_data"):
        what = "--allocation evo" if allocation == "evo" else "--criterion auto"
        raise MoePruneError(f"{what} needs search data: pass --search-data FILE")
    if allocation == "evo" or auto:
        check_search_settings(search)
    crit = get_criterion("reap" if auto else criterion)  # auto: one observation feeds every criterion
    needs_stats = method != "drop" or auto
    timer = Timer()
    if data is not None and data.sequential:
        raise MoePruneError(
            "--sequential observes without loading the model: use it with `score` or `prune --no-load`"
        )
    model, tokenizer = load_placed(model_path, data, dtype)
    moe = MoEModel(model)
    check_not_packed(moe)
    before_layers, before_params = layer_summary(moe), parameter_summary(moe)
    if crit.needs_data or needs_stats or allocation == "evo":
        tokenizer = require_tokenizer(tokenizer, model_path, tokenizer_path)
    timer.lap("load")
    crit, scores, stats, sets = score_experts(
        moe, crit.name, tokenizer=tokenizer, data=data, seed=seed, progress=progress,
        observe_for=f"--method {method}" if method != "drop" else ("--criterion auto" if auto else ""),
        neurons=method in ("neurons", "tenp"),
    )  # fmt: skip
    auto_table = None
    if auto:
        options_data = data or DataOptions()
        search_set = load_data(list(search["search_data"]), tokenizer, num_samples=search.get("search_samples") or None,
                               max_length=options_data.max_length, seed=seed)  # fmt: skip
        best, auto_table = choose_criterion(
            moe, stats, search_set, sparsity=sparsity, method=method, fitness=search.get("fitness", "esap"),
            batch_size=options_data.batch_size, pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            seed=seed, progress=progress,
        )  # fmt: skip
        crit = get_criterion(best)
        scores = compute_scores(
            best, stats=(stats if len(stats) > 1 else stats[0]) if crit.needs_data else None,
            weights=moe.layers if crit.needs_weights else None, seed=seed, layers=[m.index for m in moe.layers],
        )  # fmt: skip
    timer.lap("score")
    fingerprint = sets[0].fingerprint if len(sets) == 1 else ",".join(d.fingerprint for d in sets)
    removed, search_doc = None, None
    if allocation == "evo":
        removed, search_doc = search_allocation(
            moe, crit, scores, stats, sparsity, method=method, tokenizer=tokenizer, output=Path(output),
            seed=seed, progress=progress, data=data or DataOptions(), **search,
        )  # fmt: skip
        timer.lap("search")
    plan = build_plan(
        moe, crit, scores, sparsity=sparsity, allocation=allocation, method=method, data_fingerprint=fingerprint,
        stats=stats, options=options, removed=removed,
    )  # fmt: skip
    surgery = apply_plan(moe, plan, stats)
    timer.lap("surgery")
    report = {
        "command": "prune",
        "moeprune_version": __version__,
        "model": str(model_path),
        "output": str(output),
        "model_type": moe.model_type,
        "criterion": crit.name,
        "prune_first": crit.prune_first,
        "allocation": allocation,
        "method": method,
        "sparsity": sparsity,
        "sparsity_unit": "experts" if method in EXPERT_METHODS else "routed-expert parameters",
        "budget_experts_removed": plan.extra.get("budget"),
        "removed_per_layer": {str(lp.layer): len(lp.dropped) + len(lp.novice) for lp in plan.layers},
        "surgery": surgery,
        "layers_before": before_layers,
        "layers_after": layer_summary(moe),
        "parameters_before": before_params,
        "parameters_after": parameter_summary(moe),
        "data": data_summary(sets, stats),
        "unseen_experts": unseen_note(stats if len(stats) > 1 else stats[0]) if stats else [],
        "scores": scores_document(crit, scores, stats),
    }
    if auto_table is not None:
        report["criterion_auto"] = {
            "fitness": search.get("fitness", "esap"),
            "chosen": crit.name,
            "table": auto_table,
        }
    if search_doc is not None:
        report["search"] = {k: search_doc[k] for k in ("fitness", "budget", "allocation", "fitness_value", "uniform", "evaluations",
                                                       "teacher_cache", "notes") if k in search_doc}  # fmt: skip

    def write(tmp: Path) -> None:
        report["format"] = write_checkpoint(model, tmp, tokenizer)
        plan.save(tmp / "plan.json")
        if search_doc is not None:
            write_json(tmp / "search.json", search_doc)
            _search_plots(tmp, moe, before_layers, plan, search_doc)
        timer.lap("save")
        report["timing_s"] = timer.total()
        write_json(tmp / "report.json", report)

    if rank != 0:  # torchrun: every rank holds the same result; one writes
        return report
    atomic_write_dir(output, write, overwrite=overwrite)
    if allocation == "evo":  # the search's state and race log (moeprune.search) are done with
        state = search_state_path(Path(output))
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
    search_data: Sequence[str],
    search_samples: int = 64,
    fitness: str = "esap",
    population: int = 32,
    elites: int = 4,
    generations: int = 50,
    delta_max: int = 4,
    tau_max: int = 3,
    search_seed: int = 42,
    resume: bool = False,
) -> tuple[list[int], dict]:
    """EvoESAP: experts removed per MoE layer, searched on teacher-forced answer tokens.

    Candidates are evaluated with the method's virtual form (drop: router slicing; novice:
    constant substitution), never by copying the model. The state is checkpointed every
    generation beside OUTPUT; `resume` continues it and refuses other data or arguments.
    """
    from .allocate.evo import EvoConfig
    from .search import run_evo_search

    if method not in EXPERT_METHODS:
        raise MoePruneError(
            f"--allocation evo searches expert counts: use --method drop or novice, not {method!r}"
        )
    config = EvoConfig(population=population, elites=elites, generations=generations, delta_max=delta_max,
                       tau_max=tau_max, seed=search_seed)  # fmt: skip
    search_set = load_data(list(search_data), tokenizer, num_samples=search_samples or None,
                           max_length=data.max_length, seed=seed)  # fmt: skip
    budget = budget_from_sparsity(
        sparsity, [m.num_experts for m in moe.layers], [m.top_k for m in moe.layers]
    )
    context = _novice_context(moe, stats) if method == "novice" else None
    fingerprint = {"model": model_fingerprint(moe), "criterion": criterion.name, "method": method,
                   "sparsity": sparsity, "calibration": [s.data_fingerprint for s in stats]}  # fmt: skip
    state = search_state_path(output)
    if resume and not state.is_file():
        raise MoePruneError(f"nothing to resume: no search state at {state}")
    removed, document = run_evo_search(
        moe, search_set, [s.order for s in scores], budget, fitness=fitness, config=config, state_path=state,
        resume=resume, fingerprint=fingerprint, batch_size=data.batch_size, progress=progress,
        pad_token_id=getattr(tokenizer, "pad_token_id", None), candidate_context=context,
    )  # fmt: skip
    return removed, document


def check_search_settings(search: dict) -> None:
    """Everything about the search that can be wrong, checked before any model is loaded."""
    from .allocate.evo import EvoConfig
    from .fitness import check_fitness

    for source in search.get("search_data", ()):
        path = parse_source(source)[0]
        if not Path(path).exists():
            raise DataError(f"search data path {path} does not exist")
    check_fitness(search.get("fitness", "esap"))
    keys = ("population", "elites", "generations", "delta_max", "tau_max")
    config = EvoConfig(**{k: search[k] for k in keys if k in search})
    if config.population < config.elites:
        raise MoePruneError(f"evo population ({config.population}) must be >= elites ({config.elites})")
    if min(config.generations, config.delta_max, config.tau_max, config.elites) < 1:
        raise MoePruneError("--generations, --delta-max, --tau-max and --elites must be at least 1")


def model_fingerprint(moe: MoEModel) -> str:
    """Identifies the model a search ran on: its config and a checksum of its router weights."""
    import hashlib

    digest = hashlib.sha256(json.dumps(moe.config.to_dict(), sort_keys=True, default=str).encode())
    for layer in moe.layers:
        digest.update(layer.router.weight.detach().float().cpu().numpy().tobytes())
    return f"{moe.model_type}:{digest.hexdigest()[:16]}"


def _novice_context(moe: MoEModel, stats: Sequence[ExpertStats]):
    """Virtual MoNE candidates: removed experts add g_i(t) mu_i instead of running."""
    from .models.routed import RoutedOptions, override_routed
    from .surgery.novice import layer_stats, mean_outputs

    def context(removed: dict[int, list[int]]):
        novices = {}
        for index, positions in removed.items():
            layer = moe.layer(index)
            novices[index] = mean_outputs(layer, layer_stats(list(stats), layer), positions)
        return override_routed(moe, RoutedOptions(novices=novices))

    return context


def _search_plots(folder: Path, moe: MoEModel, layers: list[dict], plan: Plan, search_doc: dict) -> None:
    from .plots import plot_layer_density, plot_search_curve

    plot_layer_density(
        folder / "density.png", search_doc["layers"], search_doc["num_experts"],
        {"uniform": search_doc["uniform"]["allocation"], "evo": search_doc["allocation"]},
    )  # fmt: skip
    plot_search_curve(folder / "search_curve.png", search_doc["generations"], search_doc["fitness"])


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
    from .distributed import observe_sequential_distributed, placement
    from .streaming import score_checkpoint

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
    from .streaming import meta_model, rewrite_checkpoint

    if method not in NO_LOAD_METHODS:
        raise MoePruneError(
            f"--no-load rewrites shards for --method {' or '.join(NO_LOAD_METHODS)} (uniform allocation); "
            f"--method {method} needs the loaded model: drop --no-load"
        )
    check_output_dir(output, overwrite)
    if Path(output).resolve() == Path(model_path).resolve():
        raise MoePruneError(
            "the output folder is the input checkpoint; write the pruned checkpoint elsewhere"
        )
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
    from .distributed import rank_and_world

    return rank_and_world()[0] == 0


def _shrink_without_loading(
    model_path: str | Path, output: str | Path, moe: MoEModel, timer: Timer, *, criterion: str, sparsity: float,
    seed: int, overwrite: bool, data: DataOptions | None, tokenizer_path: str | Path | None, dtype: str | None,
    progress: bool, options: MethodOptions | None,
) -> dict:  # fmt: skip
    """`prune_without_loading` for --method neurons: observe with neuron sums, plan, rewrite."""
    from .criteria import unseen_note
    from .streaming import meta_model
    from .streaming_neurons import check_stock_shrink, keep_summary, rewrite_neuron_checkpoint
    from .surgery.neurons import check_importance, uniform_widths
    from .surgery.plans import resolve_plan

    options = options or MethodOptions()
    importance = check_importance(options.neuron_importance)
    check_stock_shrink(moe)  # before any observation
    uniform_widths(moe, sparsity)
    before_layers, before_params = layer_summary(moe), parameter_summary(moe)
    crit, scores, stats, sets = score_without_loading(
        model_path, criterion, data=data, tokenizer_path=tokenizer_path, seed=seed, dtype=dtype, progress=progress,
        observe_for="--method neurons", neurons=True,
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
