"""Is `--method auto`'s plan the best of its portfolio on held-out data, and does it cost less than
running the candidates one by one? Every recipe with and without `--repair`, on one demo model.

The evidence behind docs/allocation.md's "auto on three models" table (issue 45): on a quick demo
model (or another one, `--spec`), at each sparsity, every recipe of auto's portfolio runs alone as
its own `moeprune prune` process, as a user trying them one by one would (its start, load,
calibration pass and search each time), then again with `--repair`; auto runs the same way, with
and without `--repair`. Every output folder is then loaded (`moeprune.load_pretrained`) and scored
on the held-out eval split, which neither the calibration nor the search data touch: ESAP against
the full model (mean over the three domains) and NLL per domain. Times are each process's wall
seconds, all measured in this one run under the same load (`--jobs` processes at a time, each with
`--threads` torch threads, under `nice`).

    python benchmarks/auto_quality.py                                    # Qwen3-MoE quick demo
    python benchmarks/auto_quality.py --family deepseek_v3
    python benchmarks/auto_quality.py --family olmoe --spec seed=3,corpus_train=1000,experts=12,top_k=3

The last line is the third model of docs/allocation.md: another architecture (OLMoE: softmax
routing without renormalisation), seed (its own initialisation, data order and corpus split),
corpus size and expert count. Each model is trained on first use (`moeprune demo`'s cache).
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

import moeprune
from auto_speed import common_flags, prune, recipe_flags  # benchmarks/auto_speed.py: the runs' flags
from moeprune.config import PruneConfig
from moeprune.demo.corpus import DOMAINS
from moeprune.demo.train import CORPUS_SUBDIR, FAMILIES
from moeprune.surgery import METHODS
from quality import load_demo  # benchmarks/quality.py: the demo, its splits and held-out evals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen3_moe", choices=FAMILIES)
    parser.add_argument(
        "--spec", default="", metavar="KEY=VALUE,...", help="fields of the quick demo spec changed"
    )
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--generations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--no-repair", action="store_true", help="leave out the repaired runs")
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="run only these: auto, recipes' labels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = load_demo(args.family, True, args.spec, args.threads)
    evals = demo.evals()  # the full model's held-out distributions, once
    print(f"model {demo.model_dir} ({args.family}, quick{', ' + args.spec if args.spec else ''})")
    repairs = (False,) if args.no_repair else (False, True)
    with tempfile.TemporaryDirectory() as tmp:
        for sparsity in args.sparsity:
            at = argparse.Namespace(**{**vars(args), "sparsity": sparsity})  # what common_flags reads
            runs = _runs(demo.model_dir, at, repairs, Path(tmp) / f"s{sparsity}")
            runs = [r for r in runs if args.only is None or r[0] in args.only]
            with ThreadPoolExecutor(args.jobs) as pool:
                seconds = list(pool.map(lambda run: prune(run[2], run[3])[0], runs))
            rows = []
            for (label, repaired, _, output), wall in zip(runs, seconds):
                model = moeprune.load_pretrained(output)
                metrics = {d: e.score(nullcontext, model) for d, e in evals.items()}
                rows.append((label, repaired, metrics, wall))
            _table(sparsity, rows)


def _runs(model: Path, args: argparse.Namespace, repairs: tuple[bool, ...], root: Path) -> list:
    """(label, repaired, flags, output) of auto and of every portfolio recipe alone, per repair setting."""
    runs = []
    recipes = METHODS.get("auto").portfolio(PruneConfig("auto", args.sparsity, method="auto"))
    for repaired in repairs:
        extra = ["--repair"] if repaired else []
        runs.append(
            (
                "auto",
                repaired,
                [*common_flags(model, args), "--method", "auto", *extra],
                root / f"auto{repaired:d}",
            )
        )
        for i, recipe in enumerate(recipes):
            flags = [*common_flags(model, args, recipe.config), *recipe_flags(recipe.config), *extra]
            if repaired and "--search-data" not in flags:  # repair stops early on the search data, as auto's
                flags += ["--search-samples", "32"]
                flags += [
                    x
                    for d in DOMAINS
                    for x in ("--search-data", str(model / CORPUS_SUBDIR / f"{d}_search.jsonl"))
                ]
            runs.append((recipe.label, repaired, flags, root / f"r{i}-{repaired:d}"))
    return runs


def _table(sparsity: float, rows: list) -> None:
    head = ["run", "repair", *[f"NLL {d}" for d in DOMAINS], "ESAP", "s"]
    print(f"\n### {sparsity:.0%} of routed parameters\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    esap = {}
    for label, repaired, metrics, wall in rows:
        esap[label, repaired] = sum(m["esap"] for m in metrics.values()) / len(metrics)
        cells = [label, "yes" if repaired else "no", *[f"{metrics[d]['nll']:.3f}" for d in DOMAINS]]
        print("| " + " | ".join([*cells, f"{esap[label, repaired]:.4f}", f"{wall:.0f}"]) + " |", flush=True)
    walls = {(label, repaired): wall for label, repaired, _, wall in rows}
    for repaired in sorted({r for _, r, _, _ in rows}):
        others = [k for k in esap if k[1] == repaired and k[0] != "auto"]
        if not others or ("auto", repaired) not in esap:
            continue
        best = max(others, key=lambda k: esap[k])
        total = sum(walls[k] for k in others)
        tag = "with repair" if repaired else "without repair"
        print(
            f"\n{tag}: auto {esap['auto', repaired]:.4f}, best candidate {best[0]} {esap[best]:.4f} "
            f"(auto - best {esap['auto', repaired] - esap[best]:+.4f}); auto {walls['auto', repaired]:.0f} s, "
            f"the {len(others)} candidates one by one {total:.0f} s (auto / sum {walls['auto', repaired] / total:.2f})"
        )


if __name__ == "__main__":
    main()
