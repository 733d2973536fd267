"""Data-parallel EvoESAP: one process vs N torchrun ranks, same search, same result?

Runs the real command twice on the demo model, each process with the same number of torch
threads (default 1):

    moeprune prune DEMO --criterion frequency --allocation evo ...            (one process)
    torchrun --nproc_per_node N --no-python moeprune prune DEMO ... (N ranks)

and prints both wall times, the speedup (one process / N ranks, measured in this run) and whether
the two plans, searched allocations and fitnesses are identical (they must be). Both timings
include loading, calibration and the teacher pass, which every rank repeats, so the speedup
grows with the search (--population, --generations, --search-samples). Use N <= physical cores.

    .venv/bin/python benchmarks/search_parallel.py [--ranks 2 --population 16 --generations 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder with corpus/ beside it (default: the demo model)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--population", type=int, default=16)
    p.add_argument("--elites", type=int, default=4)
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--search-samples", type=int, default=64)
    p.add_argument("--sparsity", type=float, default=0.5)
    args = p.parse_args()

    if args.model:
        model, corpus = Path(args.model), Path(args.model) / "corpus"
    else:
        from moeprune.demo.train import CORPUS_SUBDIR, DEMO, get_demo_model

        model = get_demo_model(DEMO, progress=True)
        corpus = model / CORPUS_SUBDIR
    moeprune = Path(sys.executable).with_name("moeprune")
    command = [
        "prune", str(model), "--criterion", "frequency", "--sparsity", str(args.sparsity),
        "--allocation", "evo", "--data", str(corpus / "math_train.jsonl"), "--samples", "64",
        "--search-data", str(corpus / "math_search.jsonl"), "--search-samples", str(args.search_samples),
        "--population", str(args.population), "--elites", str(args.elites),
        "--generations", str(args.generations), "--threads", str(args.threads), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="moeprune-search-parallel-") as tmp:
        runs = {
            "1 process": [str(moeprune), *command, "--output", f"{tmp}/one"],
            f"{args.ranks} ranks": [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--no-python",
                str(moeprune), *command, "--output", f"{tmp}/many",
            ],
        }  # fmt: skip
        seconds = {}
        for name, argv in runs.items():
            start = time.perf_counter()
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            seconds[name] = time.perf_counter() - start
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            print(f"{name}: {seconds[name]:.1f} s")
        one, many = (json.loads(Path(f"{tmp}/{d}/search.json").read_text()) for d in ("one", "many"))
        plans = [json.loads(Path(f"{tmp}/{d}/plan.json").read_text())["layers"] for d in ("one", "many")]
    same = plans[0] == plans[1] and (one["allocation"], one["fitness_value"]) == (
        many["allocation"],
        many["fitness_value"],
    )
    per_rank = many["distributed"]["evaluations_per_rank"]
    print(
        f"search P={args.population} T={args.generations}: {one['evaluations']} evaluations; "
        f"per rank {per_rank}; allocation {many['allocation']} fitness {many['fitness_value']:.6f}"
    )
    print(f"identical plan, allocation and fitness: {same}")
    search_one, search_many = one["timings_s"]["total"], many["timings_s"]["total"]
    print(f"search alone (search.json, teacher pass included): {search_one:.1f} s vs {search_many:.1f} s: "
          f"{search_one / search_many:.2f}x")  # fmt: skip
    print(f"speedup (1 process / {args.ranks} ranks, wall, incl. loading and teacher pass): "
          f"{seconds['1 process'] / seconds[f'{args.ranks} ranks']:.2f}x")  # fmt: skip
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
