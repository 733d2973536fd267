"""`--method auto` as a file-level job: the portfolio's recipes (surgery/auto.py) checked and sized
before any weight loads, listed with their estimated time by a dry run, raced on the loaded model
(search/portfolio.py), and the winner built and saved exactly as the in-memory pipeline builds
its recipe (job/run.py), from the contest's observation, search result and fits."""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from moeprune.allocate.fitness import higher_is_better
from moeprune.checkpoint import check_model_path, require_tokenizer
from moeprune.checkpoint.quantized import quantization_format
from moeprune.config.repair import RepairConfig
from moeprune.data.loading import CalibrationData, load_data
from moeprune.errors import MoePruneError
from moeprune.job.prepare import PlannedSizes, PruneJob, PruneRequest, plan_sizes, prepare
from moeprune.job.run import run_job
from moeprune.models import MoEModel
from moeprune.models.expert_parallel import apply_ep_size
from moeprune.repair import prepare_repair, run_repair
from moeprune.report.parts import Portfolio
from moeprune.runtime.atomic import output_lock
from moeprune.runtime.device import room_for_a_copy
from moeprune.runtime.distributed import barrier, rank_and_world
from moeprune.runtime.progress import say
from moeprune.search.options import SearchRuntime
from moeprune.search.portfolio import ETA, NOISE, RUNGS, Entry, Found, Shared, contest, observe_once
from moeprune.surgery.planning import apply_plan, check_config, check_feasible, requirements
from moeprune.surgery.registry import ResolvedConfig

_LOG = logging.getLogger(__name__)
HALVING = (
    f"plans without a search once; searched recipes at {', '.join(f'{r:.3g}' for r in RUNGS)} of their "
    f"search budget (evo's generations, gradient's steps), the best 1/{ETA} going on with any within "
    f"{NOISE:g} standard error(s) of the leader's paired gap"
)
# a rough rate for the dry run's estimate: floating-point operations a second of a forward pass
_FLOPS = {"cuda": 5e13, "cpu": 2e10}
# A model this small is built at random on the CPU and one pass over the search data timed for the
# dry run's estimate (a fraction of a second): there, per-layer overheads, not FLOPs, set the time,
# and the FLOPs rate alone read 10-50x low. Larger models (or GPUs) keep the FLOPs rate.
_TIMED_PARAMETERS = 50_000_000
# A contest's estimate is within this factor of its measured time on a tiny model (tested).
ESTIMATE_FACTOR = 3.0
# With --repair, the best plans of this many recipes are each repaired and the best repaired one
# wins: repair lifts some plans far more than others (novices it can train, routers of a drop),
# so the best plan before repair need not be the best after it.
FINALISTS = 3


def check_auto(request: PruneRequest, config: ResolvedConfig) -> None:
    """auto's refusals, one line each, before any weight loads: the data it scores on, a quantized
    input or output, a resumed search, an allocation it chooses itself."""
    requirements(config).check(calibration=bool(request.data.sources), search=bool(request.search_data))
    if request.quantize is not None:
        raise MoePruneError(
            "the auto method chooses among full-precision plans; quantize its result in a second run, "
            "or name one recipe (--criterion, --method) to quantize with it",
            options=("method", "quantize"),
        )
    if request.run.resume:
        raise MoePruneError(
            "the auto method runs its searches afresh; resume continues one named search",
            options=("method", "resume"),
        )
    if request.config.allocation is not None:
        raise MoePruneError(
            "the auto method chooses each recipe's allocation; leave out the allocation",
            options=("method", "allocation"),
        )
    path = check_model_path(request.model_path)
    if quantization_format(path) is not None and request.save.dtype is None:
        raise MoePruneError(
            f"{request.model_path} is quantized and auto's recipes cut scale groups a result in that "
            "format cannot hold: save dequantized weights (--save-dtype bf16), or name one recipe",
            options=("method", "save_dtype"),
        )


@dataclass
class _Candidate:
    entry: Entry
    sizes: PlannedSizes | None
    passes: float  # the estimated cost in passes over the search data, at the full budget
    fixed: float = 1.0  # of which this many at any budget (scoring, seeds, evo's first generation)


def _passes(config: ResolvedConfig, samples: int, batch_size: int) -> tuple[float, float]:
    """The estimated forward passes over the search data a recipe costs (a backward pass counts
    twice), and how many of them it costs at any budget: one to score its plan; evo's first
    generation (the whole population), then the offspring of each later one; the gradient's
    reference plans (the uniform one or the seeds, and the result: up to 6) and its steps (one
    batch each, forward and backward)."""
    search, knobs = config.search, config.allocator.knobs
    if "generations" in knobs:
        offspring = (search.population - search.elites) * (search.generations - 1)
        return 1 + search.population + offspring, 1 + search.population
    if "gradient_steps" in knobs:
        return 7 + 3 * search.steps * min(batch_size, samples) / max(samples, 1), 7.0
    return 1.0, 1.0


def _candidates(job: PruneJob, request: PruneRequest, auto: ResolvedConfig) -> list[_Candidate]:
    """Every recipe resolved under the budget (a target size solved for each one's method), the
    ones that cannot meet it named and left out, cheapest first."""
    out = []
    samples = len(job.search_set.samples) if job.search_set is not None else 1
    assert auto.method_spec.portfolio is not None
    for recipe in auto.method_spec.portfolio(auto):
        config = apply_ep_size(job.meta, recipe.config)
        sizes = None
        try:
            config = check_config(config)
            if config.target_size is not None:
                saved = None if job.kept_quantization else job.save_dtype
                config, sizes = plan_sizes(job.model_path, job.meta, config, saved)
            check_feasible(job.meta, config)
        except MoePruneError as refusal:
            entry = Entry(recipe.label, ResolvedConfig.of(recipe.config), refused=str(refusal))
            out.append(_Candidate(entry, None, float("inf")))
            continue
        resolved = ResolvedConfig.of(config)
        passes, fixed = _passes(resolved, samples, job.data.batch_size)
        out.append(_Candidate(Entry(recipe.label, resolved), sizes, passes, fixed))
    out.sort(key=lambda c: c.passes)
    return out


def _seconds_a_pass(job: PruneJob) -> float:
    """One forward pass over the search data: 2 FLOPs a parameter a token at a rough rate, or,
    for a model small enough to build in a moment on the CPU, that model timed on this machine."""
    params = sum(p.numel() for p in job.meta.model.parameters())
    tokens = _tokens(job.search_set)
    rated = 2 * params * tokens / _FLOPS["cuda" if job.placement.device.type == "cuda" else "cpu"]
    if params > _TIMED_PARAMETERS or job.placement.device.type != "cpu" or job.search_set is None:
        return rated
    try:
        return max(rated, _timed_pass(job.meta.model, job.search_set, job.data.batch_size))
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:  # not built from its config alone
        _LOG.debug("dry-run estimate: no timed pass (%s); FLOPs rate used", exc)
        return rated


def _timed_pass(meta: Any, data: CalibrationData, batch_size: int) -> float:
    """Seconds of one forward pass over `data` of a model of `meta`'s architecture, built at
    random on the CPU (no weight is read): the faster of two passes, after one batch of warm-up."""
    model = type(meta)(meta.config).eval()
    pad = getattr(meta.config, "pad_token_id", None)
    batches = list(data.batches(batch_size, pad if isinstance(pad, int) else None))
    passes = []
    with torch.no_grad():
        model(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask, use_cache=False)
        for _ in range(2):
            start = time.perf_counter()
            for b in batches:
                model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
            passes.append(time.perf_counter() - start)
    return min(passes)


def _contest_seconds(
    candidates: list[_Candidate], per_pass: float, calibration_passes: float, batches: int = 1
) -> float:
    """The contest's estimated seconds: the observation (a pass over the calibration data) and the
    teacher pass, the fits of each novice rank (a calibration pass each), every plan without a
    search once, and the searches by successive halving as `halving` runs them: each rung's
    recipes at the mean cost of the searched ones at that budget (a continued run counted afresh);
    with --repair, the repairs (`_repair_passes`) of the finalists and of the winner."""
    ran = [c for c in candidates if not c.entry.refused]
    searched = [c for c in ran if c.entry.config.allocator.searches]
    ranks = {c.entry.config.options.novice_rank for c in ran} - {0}
    total = per_pass * (1 + calibration_passes * (1 + len(ranks)))
    total += per_pass * sum(c.passes for c in ran if c not in searched)
    alive = len(searched)
    fixed = sum(c.fixed for c in searched) / max(alive, 1)
    varying = sum(c.passes - c.fixed for c in searched) / max(alive, 1)
    for rung, fraction in enumerate(RUNGS):
        if alive > 1 or rung == len(RUNGS) - 1:
            total += per_pass * alive * (fixed + varying * fraction)
            alive = max(1, math.ceil(alive / ETA))
    repair = ran[0].entry.config.repair if ran else None
    if repair is not None and repair.enabled:  # the finalists repaired, then the winner again
        repairs = min(FINALISTS, len(ran)) + 1 if len(ran) > 1 else 1
        total += per_pass * repairs * _repair_passes(repair, calibration_passes, batches)
    return total if searched or ran else 0.0


def _repair_passes(repair: RepairConfig, calibration_passes: float, batches: int) -> float:
    """A repair's estimated passes over the search data: its teacher (a calibration pass and a
    held-out one), its steps at most (one calibration batch forward and backward, 3 forward
    passes' worth, each 1/`batches` of a calibration pass), a held-out evaluation every
    `eval_every` steps. Early stopping makes it less."""
    steps = 3 * repair.steps * calibration_passes / max(batches, 1)
    return calibration_passes + 1 + steps + repair.steps / repair.eval_every


def _rows(candidates: list[_Candidate], job: PruneJob) -> list[dict]:
    per_pass = _seconds_a_pass(job)
    rows = []
    for c in candidates:
        config = c.entry.config
        row: dict[str, Any] = {
            "label": c.entry.label,
            "criterion": config.criterion,
            "method": config.method,
            "allocation": config.allocation,
            "sparsity": config.sparsity,
        }
        if config.options.novice_rank:
            row["novice_rank"] = config.options.novice_rank
        if c.entry.refused:
            row["refused"] = c.entry.refused
        else:
            row["estimated_s"] = float(f"{c.passes * per_pass:.3g}")
        if c.entry.runs:
            row["runs"] = c.entry.runs
        if c.entry.repaired:
            row["repaired"] = c.entry.repaired
        rows.append(row)
    return rows


def prune_auto(request: PruneRequest) -> dict:
    """`--method auto` on a checkpoint: every check before loading, then (unless a dry run) the
    contest on the loaded model and the winner saved with its evidence; returns report.json."""
    auto = check_config(request.config)
    check_auto(request, auto)
    assert auto.method_spec.portfolio is not None
    recipes = auto.method_spec.portfolio(auto)
    # the data read as the most demanding recipe reads it: the search data, per domain (TENP's)
    base = max(
        recipes, key=lambda r: (bool(requirements(r.config).search), requirements(r.config).per_domain)
    )
    job = prepare(replace(request, config=base.config))
    if job.search_set is None:  # no recipe searches (--stock): the contest still scores on it
        tokenizer: Any = job.tokenizer or require_tokenizer(job.model_path, request.tokenizer_path, False)
        search_set = load_data(
            list(request.search_data),
            tokenizer,
            num_samples=auto.search.samples or None,
            max_length=job.data.max_length,
            seed=job.data.seed,
        )
        job = replace(job, tokenizer=tokenizer, search_set=search_set, search_data=list(request.search_data))
    candidates = _candidates(job, request, auto)
    if job.run.dry_run:
        return _dry_run(job, auto, candidates)
    rank, _ = rank_and_world()
    barrier()
    with output_lock(job.output) if rank == 0 else nullcontext():
        return run_job(replace(job, choose=lambda moe, j: _choose(moe, j, candidates)))


def _dry_run(job: PruneJob, auto: ResolvedConfig, candidates: list[_Candidate]) -> dict:
    """The dry run's plan: the base recipe's sizes, every recipe with its estimate, the contest's."""
    plan = {k: v for k, v in job.describe().items() if k not in job.layer_budget}  # the base recipe's
    plan |= {"criterion": auto.criterion, "method": auto.method, "allocation": "chosen per recipe"}
    calibration = sum(_tokens(d) for d in job.calibration) / max(_tokens(job.search_set), 1)
    batches = sum(math.ceil(len(d.samples) / job.data.batch_size) for d in job.calibration)
    total = _contest_seconds(candidates, _seconds_a_pass(job), calibration, batches)
    rows = _rows(candidates, job)
    return plan | {"portfolio": rows, "halving": HALVING, "estimated_s": float(f"{total:.3g}")}


def _tokens(data: CalibrationData | None) -> int:
    return sum(len(s.input_ids) for s in data.samples) if data is not None else 0


def _choose(moe: MoEModel, job: PruneJob, candidates: list[_Candidate]) -> tuple[PruneJob, Portfolio]:
    """The contest on the loaded model: the job as the winner's recipe would have run it (its
    config, sizes, and the observation, search result and fits the prune takes as given)."""
    start = time.perf_counter()
    runtime = SearchRuntime(
        batch_size=job.data.batch_size,
        pad_token_id=getattr(job.tokenizer, "pad_token_id", None),
        progress=job.run.progress,
    )
    entries = [c.entry for c in candidates if not c.entry.refused]
    assert job.search_set is not None  # check_auto refused auto without search data
    stats = observe_once(moe, [e.config for e in entries], job.calibration, runtime, job.data.seed)
    shared = Shared(moe, stats, job.calibration, job.search_set, runtime)
    ranked = contest(shared, entries, partial(say, enabled=job.run.progress))
    found = _repaired_best(shared, ranked, entries) if ranked[0].config.repair.enabled else ranked[0]
    winner = next(c for c in candidates if c.entry.label == found.label)
    run = replace(
        job.run,
        observed=(found.criterion, found.scores, stats),
        removed=tuple(found.searched.removed) if found.searched.removed is not None else None,
        novices=found.searched.novices,
    )
    portfolio = Portfolio(
        found.config.search.fitness,
        winner.entry.label,
        found.budget,
        _rows(candidates, job),
        HALVING,
        round(time.perf_counter() - start, 1),
    )
    chosen = replace(job, config=found.config, run=run, sizes=winner.sizes or job.sizes, choose=None)
    return replace(chosen, search_doc=found.searched.doc), portfolio


def _repaired_best(shared: Shared, ranked: list[Found], entries: list[Entry]) -> Found:
    """With `--repair`: the best plans of the first FINALISTS recipes, each cut into a copy of the
    model and repaired there against one teacher pass, and the one best after repair on the
    held-out tokens (of equal ones, the better before repair); each finalist's fitness before and
    after goes to its entry. The job then repairs the winner on the model itself (repair is seeded:
    the same result). Without room for a copy, the best plan before repair (with a warning)."""
    finalists = ranked[:FINALISTS]
    moe = shared.moe
    if len(finalists) < 2:
        return ranked[0]
    if not room_for_a_copy(moe.model):
        _LOG.warning(
            "auto: no room for a second copy of the model to repair the %d best recipes on; "
            "repairing the best plan before repair only",
            len(finalists),
        )
        return ranked[0]
    settings = finalists[0].config
    data = prepare_repair(
        moe,
        settings.repair,
        shared.sets,
        shared.search_set,
        fitness=settings.search.fitness,
        seed=settings.seed,
        batch_size=shared.runtime.batch_size,
        pad=shared.runtime.pad_token_id or 0,
    )
    after = {}
    for found in finalists:
        candidate = MoEModel(copy.deepcopy(moe.model))
        apply_plan(candidate, found.plan, shared.stats, found.fits)
        outcome = run_repair(candidate, found.config.repair, data, progress=shared.runtime.progress)
        del candidate
        after[found.label] = outcome["after"]
        entry = next(e for e in entries if e.label == found.label)
        entry.repaired = {"before": outcome["before"], "after": outcome["after"]}
        say(
            f"auto: {found.label} repaired: held-out {data.fitness} {outcome['before']:.4f} -> "
            f"{outcome['after']:.4f}",
            shared.runtime.progress,
        )
    sign = 1.0 if higher_is_better(data.fitness) else -1.0
    return max(finalists, key=lambda found: sign * after[found.label])
