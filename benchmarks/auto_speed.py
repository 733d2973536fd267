"""Does `--method auto` cost less than running its candidates one by one through the command line?

Runs, one at a time, each as its own `moeprune prune` process (so each pays its start, load and
calibration pass, as a user running them one by one would): auto on a quick demo model, then every
recipe of auto's portfolio alone, with the same data and search settings. Prints a table of each
one's wall seconds and search-data fitness, the sum of the candidates, auto's, and the ratio
auto / sum, measured in this one run.

    python benchmarks/auto_speed.py                          # DeepSeek-V3 quick demo model, 50 %
    python benchmarks/auto_speed.py --family qwen3_moe --population 32 --generations 50
    python benchmarks/auto_speed.py --auto-only              # auto alone (e.g. another checkout)

The demo model is trained on first use (`moeprune demo`'s cache). Runs are CPU heavy: each is
started under `nice`; `--threads` is passed to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeprune.config import PruneConfig
from moeprune.demo.train import CORPUS_SUBDIR, demo_spec, get_demo_model
from moeprune.surgery import METHODS
from moeprune.surgery.registry import ResolvedConfig

DOMAINS = ("code", "prose", "math")


def common_flags(model: Path, args: argparse.Namespace, config: PruneConfig | None = None) -> list[str]:
    """The data and search settings a run takes (the quick demo's, docs/allocation.md): all of
    them for auto, those its search reads for one recipe (the command line refuses the others)."""
    corpus = model / CORPUS_SUBDIR
    flags = [str(model), "--sparsity", str(args.sparsity), "--samples", "96", "--max-length", "192",
             "--batch-size", "16", "--threads", str(args.threads)]  # fmt: skip
    for domain in DOMAINS:
        flags += ["--data", str(corpus / f"{domain}_train.jsonl")]
    allocator = ResolvedConfig.of(config).allocator if config is not None else None
    if allocator is None or allocator.searches:
        flags += ["--search-samples", "32"]
        for domain in DOMAINS:
            flags += ["--search-data", str(corpus / f"{domain}_search.jsonl")]
    if allocator is None or "generations" in allocator.knobs:
        flags += [
            "--population",
            str(args.population),
            "--elites",
            "4",
            "--generations",
            str(args.generations),
        ]
    return flags


def recipe_flags(config: PruneConfig) -> list[str]:
    """One portfolio recipe as command-line options (its criterion, method, allocation, options)."""
    flags = ["--criterion", config.criterion, "--method", str(config.method)]
    if config.allocation is not None:
        flags += ["--allocation", config.allocation]
    for name, value in dict(config.options or {}).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def prune(flags: list[str], output: Path) -> tuple[float, dict]:
    """One `moeprune prune` process under nice: its wall seconds and its report.json."""
    command = ["nice", "-n", "10", sys.executable, "-m", "moeprune", "prune", *flags, "--output", str(output),
               "--quiet"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True, env=os.environ.copy())
    return time.perf_counter() - start, json.loads((output / "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe"))
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--generations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--auto-only", action="store_true", help="run auto alone, not the candidates")
    args = parser.parse_args()
    model = get_demo_model(demo_spec(args.family, quick=True))
    with tempfile.TemporaryDirectory() as tmp:
        auto_s, report = prune([*common_flags(model, args), "--method", "auto"], Path(tmp) / "auto")
        part = report["portfolio"]
        print(f"auto: {auto_s:.1f} s wall (contest {part['seconds']} s), chose {part['chosen']!r} at "
              f"{part['budget']:.3g} of its budget")  # fmt: skip
        if args.auto_only:
            return
        rows = []
        recipes = METHODS.get("auto").portfolio(PruneConfig("auto", args.sparsity, method="auto"))
        for i, recipe in enumerate(recipes):
            flags = [*common_flags(model, args, recipe.config), *recipe_flags(recipe.config)]
            seconds, _ = prune(flags, Path(tmp) / f"r{i}")
            rows.append((recipe.label, seconds))
            print(f"  {recipe.label}: {seconds:.1f} s", flush=True)
    total = sum(s for _, s in rows)
    print("\n| run | wall s |\n|---|---|")
    for label, seconds in rows:
        print(f"| {label} alone | {seconds:.1f} |")
    print(f"| **sum of the {len(rows)} candidates** | **{total:.1f}** |")
    print(f"| **auto** | **{auto_s:.1f}** |")
    print(f"\nauto / sum of candidates: {auto_s / total:.2f}")


if __name__ == "__main__":
    main()
