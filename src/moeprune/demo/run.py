"""`moeprune demo`: prune the locally trained demo MoE many ways and compare the results.

One calibration pass feeds every data-driven criterion and method; every configuration (criteria
x allocations with drop, plus novices, expert-neuron pruning, TENP and short EvoESAP searches) is
evaluated on the held-out split through the method's virtual form (the model is never copied),
against teacher distributions computed once per domain.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from moeprune.allocate import budget_from_sparsity
from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache
from moeprune.allocate.registry import searches
from moeprune.checkpoint import load_model
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.criteria.super_experts import as_report, protected_order
from moeprune.data.loading import CalibrationData, load_data
from moeprune.demo.corpus import DOMAINS
from moeprune.demo.train import CORPUS_SUBDIR, demo_spec, get_demo_model
from moeprune.models import MoEModel
from moeprune.observe import ExpertStats
from moeprune.observe.observer import observe
from moeprune.plan import Plan
from moeprune.report.kept import plot_kept
from moeprune.report.plots import plot_search_curve
from moeprune.runtime.atomic import atomic_write_dir, check_output_dir, write_json
from moeprune.runtime.progress import progress_bar, stage, transformers_bars_off
from moeprune.runtime.runlog import RunLog
from moeprune.search.gradient import gradient_allocation
from moeprune.search.gradient_mixed import gradient_mixed_allocation
from moeprune.search.mixed_search import search_mixed
from moeprune.search.options import SearchRuntime
from moeprune.search.run import run_evo_search
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import fit_novices, plan_rank
from moeprune.surgery.parameters import plan_kept_rows, plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import build_plan, guard_super_experts
from moeprune.surgery.plans import virtual_plan

DEMO_CRITERIA = ("frequency", "reap", "aimer", "mone", "seer", "ean", "tenp", "random")
QUICK_CRITERIA = ("frequency", "reap", "aimer", "mone")
ALLOCATIONS = ("uniform", "global")
SPARSITIES = (0.25, 0.5)


@dataclass(frozen=True)
class DemoSettings:
    quick: bool = False
    calibration_samples: int = 256
    eval_samples: int = 64  # per domain
    max_length: int = 256
    batch_size: int = 16
    seed: int = 0
    search_samples: int = 64
    population: int = 16
    generations: int = 12

    @classmethod
    def for_mode(cls, quick: bool) -> DemoSettings:
        if quick:
            return cls(
                quick=True,
                calibration_samples=96,
                eval_samples=32,
                max_length=192,
                search_samples=32,
                population=12,
                generations=6,
            )
        return cls()


class DomainEval:
    """Held-out batches of one domain with the full model's answer distributions cached once."""

    def __init__(self, moe: MoEModel, data: CalibrationData, batch_size: int, pad: int):
        self.moe, self.batches = moe, list(data.batches(batch_size, pad))
        self.teacher = TeacherCache()
        with torch.no_grad():
            for b in self.batches:
                logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
                self.teacher.add(
                    b.sample_index.tolist(), logits, b.input_ids, b.answer_mask, b.attention_mask
                )

    def score(
        self, context: Callable[[], AbstractContextManager], model: torch.nn.Module | None = None
    ) -> dict[str, float]:
        """ESAP vs the full model and NLL on answer tokens, under a (fresh) virtual pruning context;
        `model`: another model scored on the same batches (a saved, e.g. quantized, result)."""
        esap, nll = FitnessAccumulator(self.teacher, "esap"), FitnessAccumulator(self.teacher, "nll")
        model = self.moe.model if model is None else model
        with torch.no_grad(), context():
            for b in self.batches:
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
                for acc in (esap, nll):
                    acc.add(b.sample_index.tolist(), logits, b.answer_mask, b.attention_mask)
        return {"esap": esap.result(), "nll": nll.result()}


# Beyond criteria x allocations with drop: the other surgery methods (with the method's options
# where a row needs them: the ones that beat their baseline in docs/surgery.md's measurements) and
# the searched allocation.
EXTRA: tuple[tuple[str, str, str, dict | None], ...] = (
    ("mone", "uniform", "novice", None),
    ("mone", "uniform", "novice", {"novice_rank": 16}),  # low-rank novices beat constant ones
    ("reap", "uniform", "drop", {"reroute": "none"}),  # empty picks beat re-routing on sigmoid routers
    ("reap", "uniform", "neurons", None),
    ("tenp", "trapezoid", "tenp", None),
)
# the searched rows: (criterion, allocation, method); the quick demo runs the first two only
# (mixed + evo under the tenp order: the best recipe on both quick demo models, docs/allocation.md;
# the gradient rows train 120 steps: 20-60 s each even on the quick models, so the full demo only)
SEARCHED = (
    ("frequency", "evo", "drop"),
    ("tenp", "evo", "mixed"),
    ("reap", "evo", "drop"),
    ("frequency", "gradient", "drop"),
    ("tenp", "gradient", "mixed"),
)


def configurations(quick: bool) -> Iterator[tuple[str, str, str, float, dict | None]]:
    """(criterion, allocation, method, sparsity, method options) rows of the comparison, cheapest first."""
    for sparsity in SPARSITIES:
        for criterion in QUICK_CRITERIA if quick else DEMO_CRITERIA:
            for allocation in ALLOCATIONS:
                yield criterion, allocation, "drop", sparsity, None
        for criterion, allocation, method, options in EXTRA:
            yield criterion, allocation, method, sparsity, options
        for criterion, allocation, method in SEARCHED[:2] if quick else SEARCHED:
            yield criterion, allocation, method, sparsity, None


def method_label(method: str, options: dict | None) -> str:
    """The table's method cell: the method, then the options that make the row (`novice, rank 16`)."""
    named = {"novice_rank": "rank", "reroute": "reroute"}
    return ", ".join([method, *(f"{named.get(k, k)} {v}" for k, v in (options or {}).items())])


def _sizes(moe: MoEModel, plan: Plan, before: dict[str, int]) -> dict[str, int]:
    """Parameter counts the physically pruned model would have, from the plan (no surgery)."""
    after = plan_routed_parameters(moe, plan)
    router_rows = 0
    for layer_plan in plan.layers:
        layer = moe.layer(layer_plan.layer)
        router_rows += (
            len(layer_plan.dropped) * sum(p.numel() for p in layer.router.parameters()) // layer.num_experts
        )
    total = before["total"] - (before["routed_experts"] - after["routed_experts"]) - router_rows
    return {
        **after,
        "total": total,
        "active_per_token": total - after["routed_experts"] + after["active_routed_experts"],
    }


def _search(
    moe: MoEModel,
    scores,
    search: CalibrationData,
    config: PruneConfig,
    settings: DemoSettings,
    pad: int,
    stats: ExpertStats | None = None,
) -> tuple[list, list, dict]:
    """The searched allocation of `config` on the search data: what each layer removes (drop
    counts, or mixed genes), the scores whose order the plan follows, and search.json. Evo: a short
    EvoESAP search (the demo's budget: small population, few generations), over mixed genes for
    the mixed method; gradient: `moeprune prune`'s defaults."""
    runtime = SearchRuntime(batch_size=settings.batch_size, progress=False, pad_token_id=pad)
    criterion = get_criterion(config.criterion)
    if config.allocation == "gradient" and config.method == "mixed":  # per-expert forms
        assert stats is not None, "the mixed method narrows by the observed neuron statistics"
        return gradient_mixed_allocation(
            moe, criterion, scores, [stats], search, config=config, runtime=runtime
        )
    if config.allocation == "gradient":
        return gradient_allocation(moe, criterion, scores, search, config=config, runtime=runtime)
    short = SearchConfig(population=settings.population, elites=4, generations=settings.generations, seed=42)
    if config.method == "mixed":
        assert stats is not None, "the mixed method narrows by the observed neuron statistics"
        searched = replace(config, search=short)
        genes, document = search_mixed(
            moe, criterion, scores, [stats], search, config=searched, runtime=runtime
        )
        return genes, scores, document
    budget = budget_from_sparsity(
        config.sparsity_value(), [m.num_experts for m in moe.layers], [m.top_k for m in moe.layers]
    )
    removed, document = run_evo_search(
        moe,
        search,
        [s.order for s in protected_order(scores, moe.protected)],  # super experts last
        budget,
        config=short,
        fingerprint={"demo": True},
        runtime=runtime,
    )
    return removed, scores, document


def run_demo(
    output: str | Path,
    *,
    quick: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    rebuild: bool = False,
    threads: int | None = None,
    family: str = "qwen3_moe",
) -> dict:
    """Train or reuse the demo model, compare criteria x allocations x sparsities, write results.

    `threads`: torch CPU threads for every stage, training included (None: torch's setting).
    `family`: the demo model's architecture (demo/train.py FAMILIES; deepseek_v3: sigmoid router
    with a selection bias, a shared expert, a dense first layer).
    """
    check_output_dir(output, overwrite)
    with RunLog.join() as log:
        return _run_demo(output, quick, overwrite, progress, rebuild, threads, log, family)


def _run_demo(
    output,
    quick: bool,
    overwrite: bool,
    progress: bool,
    rebuild: bool,
    threads: int | None,
    log: RunLog,
    family: str = "qwen3_moe",
) -> dict:
    settings = DemoSettings.for_mode(quick)
    start = time.perf_counter()
    threads = threads or torch.get_num_threads()
    model_dir = get_demo_model(demo_spec(family, quick), rebuild=rebuild, progress=progress, threads=threads)
    trained_s = time.perf_counter() - start
    corpus = model_dir / CORPUS_SUBDIR
    with stage(f"loading {model_dir}", progress), transformers_bars_off():
        model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    pad = tokenizer.pad_token_id or 0

    def data(split: str, domains, samples: int) -> CalibrationData:
        files = [str(corpus / f"{d}_{split}.jsonl") for d in domains]
        return load_data(
            files, tokenizer, num_samples=samples, max_length=settings.max_length, seed=settings.seed
        )

    calibration = data("train", DOMAINS, settings.calibration_samples)
    stats = observe(
        moe, calibration, batch_size=settings.batch_size, pad_token_id=pad, neurons=True, progress=progress
    )
    search = data("search", DOMAINS, settings.search_samples)
    evals = {
        d: DomainEval(moe, data("eval", [d], settings.eval_samples), settings.batch_size, pad)
        for d in DOMAINS
    }
    before = routed_parameters(moe)
    rows = [_row("full model", "-", "-", 0.0, {d: e.score(nullcontext) for d, e in evals.items()}, before)]
    configs = list(configurations(quick))
    found: dict[int, list[int]] | None = None
    search_docs: list[dict] = []
    shared = _Shared(stats, calibration, search, evals, settings, pad, before)
    for entry in (bar := progress_bar(configs, desc="demo", unit="config", enabled=progress, each_step=True)):
        row, found, document = _prune_row(moe, entry, shared)  # a line each without a terminal
        rows.append(row)
        what = " ".join(str(row[k]) for k in ("criterion", "allocation", "method"))
        bar.set_postfix_str(f"{what} at {row['sparsity']:g}: ESAP {row['esap']:.3f}")
        if document is not None:
            search_docs.append(document)
    results = {
        "model": str(model_dir),
        "mode": "quick" if quick else "full",
        "family": family,
        "domains": list(DOMAINS),
        "calibration": {"samples": len(calibration.samples), "tokens": stats.tokens},
        "super_experts": as_report(found or {}),  # kept in every row
        "eval_samples_per_domain": settings.eval_samples,
        "rows": rows,
        "searches": [  # without the per-generation and per-step histories (search.json's)
            {k: v for k, v in s.items() if k not in ("generations", "training", "keep_logits", "form_logits")}
            for s in search_docs
        ],
        "timing_s": {"model": round(trained_s, 1), "total": round(time.perf_counter() - start, 1)},
    }
    table = format_table(results)

    def write(tmp: Path) -> None:
        write_json(tmp / "results.json", results)
        (tmp / "results.md").write_text(table + "\n")
        _plots(tmp, rows)
        for doc in (d for d in search_docs if "generations" in d):  # evo's curves (gradient: no generations)
            name = f"search_{doc['criterion']}_{int(doc['sparsity'] * 100)}.png"
            plot_search_curve(tmp / name, doc["generations"], doc["fitness"])
        log.write(tmp)

    atomic_write_dir(output, write, overwrite=overwrite)
    results["table"] = table
    return results


class _Shared(NamedTuple):
    """What every configuration of the demo reuses: one observation, one data set of each kind."""

    stats: ExpertStats
    calibration: CalibrationData
    search: CalibrationData
    evals: dict[str, DomainEval]
    settings: DemoSettings
    pad: int
    before: dict[str, int]


def _prune_row(moe: MoEModel, entry: tuple, shared: _Shared) -> tuple[dict, dict | None, dict | None]:
    """One configuration of the demo's table, pruned as `moeprune prune` prunes it (its super
    experts kept, searched when its allocation searches, low-rank novices fitted and checked on
    the search data), evaluated through masks: its row, the super experts and its search document."""
    criterion, allocation, method, sparsity, options = entry
    stats, search, settings, pad = shared.stats, shared.search, shared.settings, shared.pad
    crit = get_criterion(criterion)
    scores = compute_scores(
        criterion,
        stats=stats if crit.needs_data else None,
        weights=moe.layers if crit.needs_weights else None,
        seed=settings.seed,
        num_experts=[m.num_experts for m in moe.layers],
        layers=[m.index for m in moe.layers],
    )
    config = PruneConfig(criterion, sparsity, allocation=allocation, method=method, options=options)
    found = guard_super_experts(moe, config, [stats])  # kept, as `moeprune prune` keeps them
    removed, document = None, None
    if searches(allocation):
        removed, scores, searched = _search(moe, scores, search, config, settings, pad, stats)
        document = {"criterion": criterion, "sparsity": sparsity, **searched}
    plan = build_plan(moe, crit, scores, config=config, stats=[stats], removed=removed)
    fits = (
        fit_novices(
            moe,
            plan,
            [shared.calibration],
            batch_size=settings.batch_size,
            pad_token_id=pad,
            progress=False,
            checks=FitChecks(data=search),
        )
        if plan_rank(plan)
        else None
    )
    metrics = {
        d: e.score(functools.partial(virtual_plan, moe, plan, stats, fits)) for d, e in shared.evals.items()
    }
    row = _row(
        criterion,
        allocation,
        method_label(method, options),
        sparsity,
        metrics,
        _sizes(moe, plan, shared.before),
        plan,
        plan_kept_rows(moe, plan),
    )
    return row, found, document


def _row(
    criterion,
    allocation,
    method,
    sparsity,
    metrics,
    sizes,
    plan: Plan | None = None,
    kept_rows: list[dict] | None = None,
) -> dict:
    row = {
        "criterion": criterion,
        "allocation": allocation,
        "method": method,
        "sparsity": sparsity,
        "nll": {d: round(m["nll"], 4) for d, m in metrics.items()},
        "esap": round(sum(m["esap"] for m in metrics.values()) / len(metrics), 4),
        "esap_per_domain": {d: round(m["esap"], 4) for d, m in metrics.items()},
        "parameters": sizes,
    }
    if plan is not None:
        row["kept_per_layer"] = [len(lp.kept) - len(lp.novice) for lp in plan.layers]
        row["removed"] = {str(lp.layer): sorted(lp.dropped + lp.novice) for lp in plan.layers}  # ids
        row["kept_rows"] = kept_rows
    return row


def format_table(results: dict) -> str:
    """The comparison, one row per configuration, each with the one thing to notice about it."""
    domains = results["domains"]
    head = [
        "criterion",
        "alloc",
        "method",
        "sparsity",
        *[f"NLL {d}" for d in domains],
        "ESAP",
        "params (M)",
        "what to notice",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        cells = [
            row["criterion"],
            row["allocation"],
            row["method"],
            f"{row['sparsity']:.0%}",
            *[f"{row['nll'][d]:.3f}" for d in domains],
            f"{row['esap']:.4f}",
            f"{row['parameters']['total'] / 1e6:.2f}",
            notice(row, results["rows"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notice(row: dict, rows: list[dict]) -> str:
    """One sentence: how this row compares with the rows a reader would compare it with."""
    if row["sparsity"] == 0:
        return "The reference: ESAP is 1 by definition, every NLL is the one to keep."
    peers = sorted((r for r in rows if r["sparsity"] == row["sparsity"]), key=lambda r: -r["esap"])
    rank = [id(r) for r in peers].index(id(row)) + 1
    standing = "best" if rank == 1 else "worst" if rank == len(peers) else f"{_ordinal(rank)} of {len(peers)}"
    base = next(
        (
            r
            for r in rows
            if r["sparsity"] == row["sparsity"]
            and r["criterion"] == row["criterion"]
            and r["allocation"] == "uniform"
            and r["method"] == "drop"
        ),
        None,
    )
    if row["allocation"] in ("global", "evo", "gradient") and base is not None:
        gain = row["esap"] - base["esap"]
        how = {"evo": "the search", "gradient": "training the logits"}.get(
            row["allocation"], "ranking experts across layers"
        )
        return f"{standing} at {row['sparsity']:.0%}; {how} {'gains' if gain >= 0 else 'loses'} {abs(gain):.4f} ESAP over uniform {row['criterion']}."
    if row["method"].startswith(("novice", "drop, reroute none")) and base is not None:
        gain = row["esap"] - base["esap"]
        what = {
            "novice": "keeping mean outputs",
            "drop, reroute none": "leaving their picks empty",
        }.get(row["method"], "a low-rank map of each one's input")
        return f"{standing} at {row['sparsity']:.0%}; {what} {'gains' if gain >= 0 else 'loses'} {abs(gain):.4f} ESAP over dropping the same experts."
    if row["method"] in ("neurons", "tenp"):
        return f"{standing} at {row['sparsity']:.0%}; removes {row['sparsity']:.0%} of routed parameters by narrowing experts, not dropping them."
    return (
        f"{standing} of {len(peers)} at {row['sparsity']:.0%}."
        if rank in (1, len(peers))
        else f"{standing} at {row['sparsity']:.0%}."
    )


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _plots(folder: Path, rows: list[dict]) -> dict[float, dict]:
    """density_<sparsity>.png: per layer, the routed-expert parameters (and experts) each kind of
    result keeps: uniform drop for reference, then the best criterion of every other allocation
    and method. Returns the plotted data, by sparsity."""
    plotted = {}
    for sparsity in SPARSITIES:
        best: dict[tuple[str, str], dict] = {}
        for row in rows:
            if row["sparsity"] == sparsity and "kept_rows" in row:
                key = (row["allocation"], row["method"])
                if key not in best or row["esap"] > best[key]["esap"]:
                    best[key] = row
        if not best:
            continue
        order = sorted(best, key=lambda key: key != ("uniform", "drop"))  # the reference first
        named = {f"{a} {m} ({best[a, m]['criterion']})": best[a, m]["kept_rows"] for a, m in order}
        plotted[sparsity] = plot_kept(
            folder / f"density_{int(sparsity * 100)}.png",
            named,
            expert_unit=True,
            title=f"kept per layer at sparsity {sparsity:g} (best criterion of each)",
        )
    return plotted
