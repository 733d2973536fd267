"""How good is each pruning recipe on a trained demo model? ESAP and NLL per domain, one table.

The evidence behind docs/criteria.md and docs/surgery.md: every row is evaluated on the held-out
eval split through the method's virtual form, as `moeprune demo` does, against the full model's
distributions (computed once). A row is `criterion/allocation/method` with optional settings after
a fourth slash (`key=value,...`: the method's own options, or `allow_super_experts=true`).

    python benchmarks/quality.py --quick man/uniform/drop msan/uniform/drop reap/uniform/drop
    python benchmarks/quality.py --quick --family deepseek_v3 mone/uniform/novice
    python benchmarks/quality.py --quick --family deepseek_v3 --spec seed=1,experts=16,top_k=4 \\
        reap/uniform/drop reap/uniform/drop/reroute=none
    python benchmarks/quality.py --quick --plant 30 frequency/uniform/drop \\
        frequency/uniform/drop/allow_super_experts=true
    python benchmarks/quality.py --quick reap/evo/drop reap/evo/mixed enp/uniform/neurons tenp/trapezoid/tenp
    python benchmarks/quality.py --quick mone/uniform/novice/novice_rank=16 tenp/evo/mixed/novice_rank=16 \
        mone/uniform/novice/novice_rank=16,params=true

An `evo` row first searches on the demo's search split (the demo's population, generations and
seed); a mixed + evo row also prints its seeds' search fitness beside the winner's. Low-rank
novices (`novice_rank=R`) are fitted on the calibration split as `moeprune prune` fits them: after
planning, or for mixed + evo every expert once before the search (the plan takes those fits).

The `kept` column is the share of routed-expert parameters the plan keeps. The novice and drop
methods' sparsity is a share of experts, so rank-R novices (d + 2dR parameters each) keep more
than 1 - S: `params=true` makes the row's sparsity a share of routed parameters instead (the
experts whose novices leave (1 - S) of them, to the nearest whole expert: as mixed's novice seed;
where even every expert above top-k is not enough, that many, and the kept column shows the excess).

`--plant SCALE` first makes a super expert: the least-routed expert of the first MoE layer gets its
down_proj multiplied by SCALE (so its rare outputs are massive), and that model is the reference.
The table's last column says whether each row kept it. Sparsities: `--sparsity 0.25 0.5`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from moeprune.checkpoint import load_model
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.data.loading import load_data
from moeprune.demo.corpus import DOMAINS
from moeprune.demo.run import DemoSettings, DomainEval
from moeprune.demo.train import CORPUS_SUBDIR, FAMILIES, demo_spec, get_demo_model
from moeprune.models import MoEModel
from moeprune.observe.observer import observe
from moeprune.search.gradient_mixed import gradient_mixed_allocation
from moeprune.search.mixed_search import search_mixed
from moeprune.search.options import SearchRuntime
from moeprune.search.run import search_allocation
from moeprune.surgery.lowrank import fit_every_novice, fit_novices, plan_rank
from moeprune.surgery.parameters import novice_params, plan_routed_parameters, routed_parameters
from moeprune.surgery.planning import build_plan, guard_super_experts
from moeprune.surgery.plans import virtual_plan


def expert_sparsity(moe: MoEModel, sparsity: float, rank: int) -> float:
    """The share of experts whose rank-`rank` novices leave (1 - sparsity) of the routed parameters
    (every layer alike: P and d the same in each MoE layer of the demo models)."""
    layer, experts = moe.layers[0], sum(m.num_experts for m in moe.layers)
    expert = routed_parameters(moe)["routed_experts"] / experts
    wanted = sparsity * expert / (expert - novice_params(layer.hidden_size, rank))
    most = sum(m.num_experts - m.top_k for m in moe.layers) / experts  # every layer keeps top-k experts
    if wanted > most:  # the novices alone cannot reach the budget: the kept column shows by how much
        print(f"<!-- rank-{rank} novices reach {sparsity:.0%} of routed parameters at {wanted:.1%} of experts; "
              f"at most {most:.1%} can be removed -->")  # fmt: skip
    return min(wanted, most)


def parse_row(text: str, sparsity: float) -> PruneConfig:
    """`criterion/allocation/method[/key=value,...]` at `sparsity`."""
    parts = text.split("/")
    if len(parts) not in (3, 4):
        raise SystemExit(f"row {text!r}: write criterion/allocation/method[/key=value,...]")
    criterion, allocation, method = parts[:3]
    settings: dict[str, Any] = {}
    for item in parts[3].split(",") if len(parts) == 4 else []:
        key, _, value = item.partition("=")
        settings[key] = json.loads(value) if value[:1] in '0123456789-tf[{"' else value
    allow = bool(settings.pop("allow_super_experts", False))
    settings.pop("params", None)  # read by main: the sparsity is a share of routed parameters
    return PruneConfig(
        criterion,
        sparsity,
        allocation=allocation,
        method=method,
        options=settings or None,
        allow_super_experts=allow,
    )


def plant_super_expert(moe: MoEModel, stats, scale: float) -> tuple[int, int]:
    """Scale the down_proj of the first MoE layer's least-routed (seen) expert; returns (layer, expert)."""
    layer = moe.layers[0]
    counts = stats.layer(layer.index).count
    seen = [i for i in range(layer.num_experts) if counts[i] > 0]
    expert = min(seen, key=lambda i: float(counts[i]))
    down = layer.experts.down_proj
    with torch.no_grad():
        down[expert].mul_(scale)
    return layer.index, expert


@dataclasses.dataclass
class Demo:
    """A trained demo model, loaded, with its settings and its corpus's splits (shared with
    benchmarks/quantize_quality.py)."""

    model_dir: Path
    moe: MoEModel
    tokenizer: Any
    settings: DemoSettings
    pad: int

    def files(self, split: str, domains) -> list[str]:
        return [str(self.model_dir / CORPUS_SUBDIR / f"{d}_{split}.jsonl") for d in domains]

    def data(self, split: str, domains, samples: int):
        files = self.files(split, domains)
        return load_data(
            files, self.tokenizer, num_samples=samples, max_length=self.settings.max_length, seed=0
        )

    def evals(self) -> dict[str, DomainEval]:
        """Held-out eval batches per domain, with the (current) model's distributions as reference."""
        return {
            d: DomainEval(
                self.moe,
                self.data("eval", [d], self.settings.eval_samples),
                self.settings.batch_size,
                self.pad,
            )
            for d in DOMAINS
        }


def load_demo(family: str, quick: bool, spec_text: str = "", threads: int = 1) -> Demo:
    """The demo model of `family` (quick or full; `spec_text` changes fields of its spec), trained once and cached."""
    settings = DemoSettings.for_mode(quick)
    spec = demo_spec(family, quick)
    if spec_text:  # another trained model of the same architecture (a second seed, more experts)
        changes = dict(item.split("=", 1) for item in spec_text.split(","))
        spec = dataclasses.replace(spec, **{k: type(getattr(spec, k))(v) for k, v in changes.items()})
    model_dir = get_demo_model(spec, progress=False, threads=threads)
    model, tokenizer = load_model(model_dir)
    return Demo(model_dir, MoEModel(model), tokenizer, settings, tokenizer.pad_token_id or 0)


def demo_parser(doc: str | None, sparsities: list[float]) -> argparse.ArgumentParser:
    """The arguments every demo benchmark takes: its rows, the demo family, quick or not, the
    sparsities (`sparsities` by default) and the torch threads."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", help="criterion/allocation/method[/key=value,...]")
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    parser.add_argument("--quick", action="store_true", help="the quick demo model and settings")
    parser.add_argument("--sparsity", type=float, nargs="+", default=sparsities)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def main() -> None:
    parser = demo_parser(__doc__, [0.25, 0.5])
    parser.add_argument("--plant", type=float, default=None, metavar="SCALE", help="plant a super expert")
    parser.add_argument(
        "--spec",
        default="",
        metavar="KEY=VALUE,...",
        help="another demo model: fields of the demo spec changed (e.g. seed=1,experts=16,top_k=4)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    demo = load_demo(args.family, args.quick, args.spec, args.threads)
    model_dir, moe, settings, pad, data = demo.model_dir, demo.moe, demo.settings, demo.pad, demo.data
    calibration = data("train", DOMAINS, settings.calibration_samples)
    search = functools.cache(lambda: data("search", DOMAINS, settings.search_samples))

    def observed():
        return observe(
            moe, calibration, batch_size=settings.batch_size, pad_token_id=pad, neurons=True, progress=False
        )

    stats = observed()
    planted = None
    if args.plant:
        planted = plant_super_expert(moe, stats, args.plant)
        stats = observed()  # the planted model is the one pruned and the reference
    evals = demo.evals()
    head = ["row", "sparsity", "kept", *[f"NLL {d}" for d in DOMAINS], "ESAP"] + (
        ["planted kept"] if planted else []
    )
    print(f"model {model_dir} ({args.family}{', quick' if args.quick else ''})")
    if planted:
        print(f"planted super expert: layer {planted[0]} expert {planted[1]} (down_proj x {args.plant:g})")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    full = {d: e.score(nullcontext) for d, e in evals.items()}
    print(_line("full model", 0.0, 1.0, full, "yes" if planted else None))
    routed_total = routed_parameters(moe)["routed_experts"]
    every_novice = functools.cache(  # every expert at rank R, for mixed + evo (fitted once per rank)
        lambda rank: fit_every_novice(
            moe, rank, [calibration], batch_size=settings.batch_size, pad_token_id=pad, progress=False
        )
    )
    for sparsity in args.sparsity:
        for text in args.rows:
            config = parse_row(text, sparsity)
            rank = int((config.options or {}).get("novice_rank", 0))
            if "params=true" in text and config.method == "novice":
                config = dataclasses.replace(config, sparsity=expert_sparsity(moe, sparsity, rank))
            found = guard_super_experts(moe, config, [stats])
            crit = get_criterion(config.criterion)
            scores = compute_scores(
                config.criterion,
                stats=stats if crit.needs_data else None,
                weights=moe.layers if crit.needs_weights else None,
                seed=0,
                num_experts=[m.num_experts for m in moe.layers],
                layers=[m.index for m in moe.layers],
            )
            removed = None
            if config.allocation == "evo":  # the demo's search budget, on its search split
                config = dataclasses.replace(
                    config,
                    search=SearchConfig(
                        population=settings.population, elites=4, generations=settings.generations, seed=42
                    ),
                )
                runtime = SearchRuntime(batch_size=settings.batch_size, progress=False, pad_token_id=pad)
                find = search_mixed if config.method == "mixed" else search_allocation
                ranked = {"novices": every_novice(rank)} if rank and config.method == "mixed" else {}
                removed, doc = find(
                    moe, crit, scores, [stats], search(), config=config, runtime=runtime, **ranked
                )
                seeds = {k: round(v["fitness_value"], 4) for k, v in doc.get("seeds", {}).items()}
                print(
                    f"<!-- {text} {sparsity:.0%}: search fitness {doc['fitness_value']:.4f}"
                    + (f", seeds {seeds}, genes {doc['genes']}" if seeds else "")
                    + f", {doc['timings_s']['total']:.0f} s -->"
                )
            if config.allocation == "gradient" and config.method == "mixed":  # its defaults, seed 42
                config = dataclasses.replace(config, search=SearchConfig(seed=42))
                runtime = SearchRuntime(batch_size=settings.batch_size, progress=False, pad_token_id=pad)
                ranked = {"novices": every_novice(rank)} if rank else {}
                removed, scores, doc = gradient_mixed_allocation(  # type: ignore[assignment]
                    moe, crit, scores, [stats], search(), config=config, runtime=runtime, **ranked
                )
                print(
                    f"<!-- {text} {sparsity:.0%}: search fitness {doc['fitness_value']:.4f} ({doc['returned']}; "
                    f"trained {doc['trained']['fitness_value']:.4f}, start {doc['start']}), genes {doc['genes']}, "
                    f"{doc['timings_s']['total']:.0f} s -->"
                )
            plan = build_plan(moe, crit, scores, config=config, stats=[stats], removed=removed)
            fits = None
            if plan_rank(plan):  # as `moeprune prune`: after planning, or the search's own fits
                fitted = every_novice(rank) if config.method == "mixed" and removed is not None else None
                fits = fit_novices(
                    moe, plan, [calibration], batch_size=settings.batch_size, pad_token_id=pad,
                    progress=False, fitted=fitted,
                )  # fmt: skip
            metrics = {
                d: e.score(functools.partial(virtual_plan, moe, plan, stats, fits)) for d, e in evals.items()
            }
            kept_share = plan_routed_parameters(moe, plan)["routed_experts"] / routed_total
            kept = None
            if planted:
                layer_plan = next(lp for lp in plan.layers if lp.layer == planted[0])
                kept = "no" if planted[1] in layer_plan.dropped or planted[1] in layer_plan.novice else "yes"
                kept += f" (super: {found})" if found and text == args.rows[0] else ""
            print(_line(text, sparsity, kept_share, metrics, kept))
    print(f"({time.perf_counter() - start:.0f} s)")


def _line(name: str, sparsity: float, share: float, metrics: dict, kept: str | None) -> str:
    esap = sum(m["esap"] for m in metrics.values()) / len(metrics)
    cells = [name, f"{sparsity:.0%}", f"{share:.4f}", *[f"{metrics[d]['nll']:.3f}" for d in DOMAINS]]
    cells.append(f"{esap:.4f}")
    return "| " + " | ".join(cells + ([kept] if kept is not None else [])) + " |"


if __name__ == "__main__":
    main()
