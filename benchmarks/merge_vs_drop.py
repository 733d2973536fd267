"""Merge vs drop on the demo model: the same criterion's removals, merged into the kept experts
or dropped, scored like `moeprune demo` (ESAP and answer NLL per held-out domain).

    python benchmarks/merge_vs_drop.py [--quick] [--criterion reap] [--threads N]

Prints a markdown table (docs/surgery.md holds one). Every plan is evaluated in its virtual form
(the router sliced, the centroids' merged rows swapped in), which equals the physical result
(tests/surgery/test_merge.py).
"""

from __future__ import annotations

import argparse
import functools
import time
from contextlib import nullcontext

import torch

from moeprune.checkpoint import load_model
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.data.loading import load_data
from moeprune.demo.corpus import DOMAINS
from moeprune.demo.run import DemoSettings, DomainEval
from moeprune.demo.train import CORPUS_SUBDIR, DEMO, FIXTURE, get_demo_model
from moeprune.models import MoEModel
from moeprune.observe.observer import observe
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import virtual_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small fixture model and settings")
    parser.add_argument("--criterion", default="reap")
    parser.add_argument("--allocations", default="uniform,global")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = DemoSettings.for_mode(args.quick)
    start = time.perf_counter()
    model_dir = get_demo_model(FIXTURE if args.quick else DEMO, progress=False, threads=args.threads)
    corpus = model_dir / CORPUS_SUBDIR
    model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    pad = tokenizer.pad_token_id or 0

    def data(split: str, domains, samples: int):
        files = [str(corpus / f"{d}_{split}.jsonl") for d in domains]
        return load_data(files, tokenizer, num_samples=samples, max_length=settings.max_length, seed=settings.seed)

    stats = observe(
        moe, data("train", DOMAINS, settings.calibration_samples), batch_size=settings.batch_size,
        pad_token_id=pad, progress=False,
    )  # fmt: skip
    evals = {
        d: DomainEval(moe, data("eval", [d], settings.eval_samples), settings.batch_size, pad) for d in DOMAINS
    }
    crit = get_criterion(args.criterion)
    scores = compute_scores(crit.name, stats=stats, layers=[m.index for m in moe.layers])
    header = "| sparsity | allocation | method | " + " | ".join(f"{d} ESAP / NLL" for d in DOMAINS) + " |"
    lines = [header, "|" + "---|" * (3 + len(DOMAINS))]

    def row(sparsity: str, allocation: str, method: str, context) -> None:
        metrics = {d: e.score(context) for d, e in evals.items()}
        cells = [f"{metrics[d]['esap']:.4f} / {metrics[d]['nll']:.4f}" for d in DOMAINS]
        lines.append(f"| {sparsity} | {allocation} | {method} | " + " | ".join(cells) + " |")

    row("0", "-", "full model", nullcontext)
    for sparsity in (0.25, 0.5):
        for allocation in args.allocations.split(","):
            for method in ("drop", "merge"):
                config = PruneConfig(crit.name, sparsity, allocation=allocation, method=method)
                plan = build_plan(moe, crit, scores, config=config, stats=[stats])
                row(f"{sparsity:.0%}", allocation, method, functools.partial(virtual_plan, moe, plan, stats))
    print(f"model {model_dir}, criterion {crit.name}, {time.perf_counter() - start:.0f} s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
