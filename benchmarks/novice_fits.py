"""Rank-R novices with and without the held-out choice of ridge and rank (docs/surgery.md, fits):
ESAP against the full model and answer NLL per held-out domain (the eval split), novices applied
virtually, mone criterion, uniform allocation.

Rows per sparsity: constant novices (rank 0); rank R unregularised (`FitChecks(shrink=False)`,
the least-squares fit moeprune saved before); rank R with the held-out choice on every 4th
calibration sample (no search data); and rank R with the choice on the search split (what
`moeprune prune --search-data` does).

    PYTHONPATH=src python benchmarks/novice_fits.py --family qwen3_moe --rank 16
    PYTHONPATH=src python benchmarks/novice_fits.py --family deepseek_v3 --rank 16 --calibration code:16

`--calibration all` is the quick demo's calibration (96 samples over the three domains);
`code:16` is 16 code samples only (the issue's over-fitting case).
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

import torch

from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.demo.corpus import DOMAINS
from moeprune.observe.observer import observe
from moeprune.surgery.fit_holdout import FitChecks
from moeprune.surgery.lowrank import RANK_KEY, fit_novices
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import virtual_plan
from quality import load_demo  # benchmarks/ is the script's folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calibration", default="all", help="all, or DOMAIN:SAMPLES")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5])
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    demo = load_demo(args.family, quick=True)
    moe, s, pad = demo.moe, demo.settings, demo.pad
    if args.calibration == "all":
        calibration = demo.data("train", DOMAINS, s.calibration_samples)
    else:
        domain, samples = args.calibration.split(":")
        calibration = demo.data("train", [domain], int(samples))
    search = demo.data("search", DOMAINS, s.search_samples)
    stats = observe(moe, calibration, batch_size=s.batch_size, pad_token_id=pad, progress=False)
    evals = demo.evals()
    print(f"model {demo.model_dir} ({args.family}, quick); calibration {args.calibration}: "
          f"{len(calibration.samples)} samples, {stats.tokens} tokens; rank {args.rank}")  # fmt: skip
    print("| sparsity | novices | " + " | ".join(f"{d} ESAP | {d} NLL" for d in DOMAINS) + " | mean ESAP |")
    print("|---|---|" + "---|---|" * len(DOMAINS) + "---|")
    scores = compute_scores("mone", stats=stats)
    rows = {
        f"rank {args.rank}, unregularised (old)": FitChecks(shrink=False),
        f"rank {args.rank}, held-out choice, calibration share (new)": FitChecks(),
        f"rank {args.rank}, held-out choice, search data (new)": FitChecks(data=search),
    }
    for sparsity in args.sparsity:
        config = PruneConfig("mone", sparsity, method="novice", options={"novice_rank": args.rank})
        plan = build_plan(moe, get_criterion("mone"), scores, config=config, stats=[stats])
        constant = copy.deepcopy(plan)
        constant.extra.pop(RANK_KEY)
        measured = {"constant (rank 0)": {d: e.score(functools.partial(virtual_plan, moe, constant, stats))
                                          for d, e in evals.items()}}  # fmt: skip
        for name, checks in rows.items():
            fits = fit_novices(
                moe,
                plan,
                [calibration],
                batch_size=s.batch_size,
                pad_token_id=pad,
                progress=False,
                checks=checks,
            )
            context = functools.partial(virtual_plan, moe, plan, stats, fits)
            measured[name] = {d: e.score(context) for d, e in evals.items()}
        for name, m in measured.items():
            cells = " | ".join(f"{m[d]['esap']:.4f} | {m[d]['nll']:.4f}" for d in DOMAINS)
            mean = sum(m[d]["esap"] for d in DOMAINS) / len(DOMAINS)
            print(f"| {sparsity:.0%} | {name} | {cells} | {mean:.4f} |", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
