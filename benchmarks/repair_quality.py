"""What does `--repair` buy? Each row pruned without and with repair on a trained demo model.

The evidence behind docs/surgery.md's "Repair" table: every row is pruned by `moeprune.api.prune`
(its search on the demo's search split with the demo's population, generations and seed 42), then
the same plan is cut again from a fresh copy of the full model and repaired as `--repair` does
(the full model's distributions taken before the cut; early stopping on the search split). Both
results are scored on the held-out eval split (ESAP against the full model and NLL, per domain),
which neither the calibration nor the search data touch.

    python benchmarks/repair_quality.py --quick reap/uniform/drop tenp/evo/mixed
    python benchmarks/repair_quality.py --quick --family deepseek_v3 reap/uniform/drop tenp/evo/mixed
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch

from moeprune.api import prune
from moeprune.config import RepairConfig, SearchConfig
from moeprune.demo.corpus import DOMAINS
from moeprune.models import MoEModel
from moeprune.repair import prepare_repair, run_repair
from moeprune.surgery.planning import apply_plan
from quality import (  # benchmarks/quality.py: the demo, its rows and arguments
    demo_parser,
    load_demo,
    parse_row,
)


def main() -> None:
    parser = demo_parser(__doc__, [0.5])
    parser.add_argument("--steps", type=int, default=RepairConfig.steps)
    parser.add_argument("--lr", type=float, default=RepairConfig.learning_rate)
    parser.add_argument("--parts", default=RepairConfig.parts)
    parser.add_argument("--eval-every", type=int, default=RepairConfig.eval_every)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = load_demo(args.family, args.quick, threads=args.threads)
    settings, pad = demo.settings, demo.pad
    full = copy.deepcopy(demo.moe.model)  # every row starts from it
    calibration = demo.data("train", DOMAINS, settings.calibration_samples)
    search = demo.data("search", DOMAINS, settings.search_samples)
    evals = demo.evals()
    repair = RepairConfig(
        enabled=True, steps=args.steps, learning_rate=args.lr, parts=args.parts, eval_every=args.eval_every
    )
    head = ["row", "sparsity", "repair", *[f"NLL {d}" for d in DOMAINS], "ESAP", "held-out search ESAP", "s"]
    print(f"model {demo.model_dir} ({args.family}{', quick' if args.quick else ''})")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for sparsity in args.sparsity:
        for text in args.rows:
            config = parse_row(text, sparsity)
            config = copy.copy(config)
            config.search = SearchConfig(
                population=settings.population, elites=4, generations=settings.generations, seed=42
            )
            start = time.perf_counter()
            plain = copy.deepcopy(full)
            result = prune(plain, config, data=calibration, search_data=search, tokenizer=demo.tokenizer)
            pruned_s = time.perf_counter() - start
            _print(
                text,
                sparsity,
                "no",
                {d: e.score(nullcontext, plain) for d, e in evals.items()},
                None,
                pruned_s,
            )
            start = time.perf_counter()
            repaired = MoEModel(copy.deepcopy(full))
            data = prepare_repair(
                repaired, repair, result.calibration, search, batch_size=settings.batch_size, pad=pad
            )
            apply_plan(repaired, result.plan, result.stats)
            summary = run_repair(repaired, repair, data, progress=False)
            metrics = {d: e.score(nullcontext, repaired.model) for d, e in evals.items()}
            held = f"{summary['before']:.4f} -> {summary['after']:.4f}"
            _print(text, sparsity, "yes", metrics, held, time.perf_counter() - start)
            trained = ", ".join(f"{r['part']} {r['parameters']}" for r in summary["trained"])
            print(
                f"<!-- {text} {sparsity:.0%}: trained {trained}; kept {summary['kept']}, best step "
                f"{summary['best_step']} of {summary['steps_run']}; no gradient: {len(summary['no_gradient'])} -->"
            )


def _print(
    name: str, sparsity: float, repaired: str, metrics: dict, held: str | None, seconds: float
) -> None:
    esap = sum(m["esap"] for m in metrics.values()) / len(metrics)
    cells = [name, f"{sparsity:.0%}", repaired, *[f"{metrics[d]['nll']:.3f}" for d in DOMAINS], f"{esap:.4f}"]
    print("| " + " | ".join([*cells, held or "", f"{seconds:.0f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
