"""Launched by test_distributed_search.py under torchrun: the EvoESAP search split over ranks.

Arguments: an output folder, a tiny checkpoint with a tokenizer, a calibration JSONL. Each rank
runs the same searches (a straight one, one interrupted after 2 generations and resumed, and one
where rank 1 fails) and saves what it saw to ``rank{R}.json``: the results, the elites of every
generation, the allocations it evaluated itself, and every file the search library wrote from
that rank. Then every rank runs a plain (uniform) ``prune_in_memory`` into ``uniform/``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from helpers import random_data as _data  # tests/helpers.py, beside this file (no test module: see there)
from helpers import random_orders as _orders
from moeprune.config import DataOptions, PruneConfig, RunOptions, SearchConfig
from moeprune.errors import MoePruneError
from moeprune.job import (
    PruneRequest,
)
from moeprune.job import (
    run as pipeline,  # the module that writes the output (its atomic_write_dir is spied on)
)
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.runtime.distributed import init_distributed
from moeprune.search import auto, evo
from moeprune.search import run as search_run
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.evo import EvoSearch, _rank_key
from moeprune.search.options import SearchRuntime
from moeprune.search.run import run_evo_search

CONFIG = SearchConfig(population=8, elites=2, generations=4, seed=11)
BUDGET = 12
STRAIGHT = dict(fitness="esap", batch_size=3)  # racing and prefix reuse both do work here
RESUMED = dict(fitness="kl", batch_size=2)  # lower is better: negated for the search
INTERRUPTED_AT = 2


def problem():
    """The model and search set every rank (and the one-process reference) searches on."""
    moe = MoEModel(tiny_model("olmoe", num_hidden_layers=4))
    return moe, _data(n=12)


def auto_choice(moe, data) -> tuple[str, list[dict]]:
    """`--criterion auto` on the search problem (statistics from the search set itself)."""
    stats = observe(moe, data, batch_size=3, progress=False)
    config = PruneConfig(criterion="auto", sparsity=0.25)
    return auto.choose_criterion(
        moe, [stats], data, config=config, runtime=SearchRuntime(batch_size=3, progress=False)
    )


def search_once(
    moe, data, config: SearchConfig = CONFIG, fitness=None, fingerprint=None, **runtime
) -> tuple[list[int], dict]:
    """A quiet search; ``runtime``: SearchRuntime fields (state_path, resume, batch_size, ...)."""
    if fitness is not None:
        config = replace(config, fitness=fitness)
    fingerprint = {"model": "tiny"} if fingerprint is None else fingerprint
    runtime = SearchRuntime(**{"progress": False, **runtime})
    return run_evo_search(
        moe, data, _orders(moe), BUDGET, config=config, fingerprint=fingerprint, runtime=runtime
    )


@contextmanager
def recorded() -> Iterator[dict[str, list]]:
    """Record the elites of every generation, the allocations this process evaluated, and the
    files the search wrote (the state, the race log)."""
    record: dict[str, list] = {"elites": [], "evaluated": [], "writes": []}
    breed, evaluate = EvoSearch._breed, CandidateEvaluator.evaluate
    state_write, log_write = evo.write_json, search_run.write_json

    def spy_breed(self, population, rng):
        ranked = sorted({a: self.cache[a] for a in population}.items(), key=_rank_key)
        record["elites"].append([[list(a), f] for a, f in ranked[: self.config.elites]])
        return breed(self, population, rng)

    def spy_evaluate(self, allocation, threshold=None):
        record["evaluated"].append(list(allocation))
        return evaluate(self, allocation, threshold)

    def spy_state(path, payload):
        record["writes"].append(str(path))
        return state_write(path, payload)

    def spy_log(path, payload):
        record["writes"].append(str(path))
        return log_write(path, payload)

    EvoSearch._breed, CandidateEvaluator.evaluate = spy_breed, spy_evaluate
    evo.write_json, search_run.write_json = spy_state, spy_log
    try:
        yield record
    finally:
        EvoSearch._breed, CandidateEvaluator.evaluate = breed, evaluate
        evo.write_json, search_run.write_json = state_write, log_write


def summary(best: list[int], doc: dict, record: dict) -> dict[str, Any]:
    return {"best": best, "doc": doc, **record}


def main(out: Path, checkpoint: Path, calibration: Path) -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    assert world == 2, world
    moe, data = problem()
    result: dict[str, Any] = {"rank": rank}
    with recorded() as record:
        best, doc = search_once(moe, data, state_path=out / "straight_state.json", **STRAIGHT)
    result["straight"] = summary(best, doc, record)

    state = out / "resume_state.json"
    with recorded() as record:
        search_once(moe, data, replace(CONFIG, generations=INTERRUPTED_AT), state_path=state, **RESUMED)
        best, doc = search_once(moe, data, state_path=state, resume=True, **RESUMED)
    result["resumed"] = summary(best, doc, record)

    # A rank that fails makes every rank fail (no rank waits forever in a collective).
    original, calls = CandidateEvaluator.evaluate, [0]

    def failing(self, allocation, threshold=None):
        calls[0] += 1
        if rank == 1 and calls[0] == 6:
            raise RuntimeError("simulated failure on rank 1")
        return original(self, allocation, threshold)

    CandidateEvaluator.evaluate = failing
    try:
        search_once(moe, data, **STRAIGHT)
        result["failure"] = None
    except (MoePruneError, RuntimeError) as exc:
        result["failure"] = f"{type(exc).__name__}: {exc}"
    finally:
        CandidateEvaluator.evaluate = original

    # --criterion auto: each rank tries its share of the criteria; every rank gets the whole table.
    tried, compute = [], auto.compute_scores

    def spy_compute(name, *args, **kwargs):
        tried.append(name)
        return compute(name, *args, **kwargs)

    auto.compute_scores = spy_compute
    try:
        best_name, table = auto_choice(moe, data)
    finally:
        auto.compute_scores = compute
    result["auto"] = {"best": best_name, "table": table, "tried": tried}

    # Not a search: every rank observes its share, rank 0 alone writes the pruned checkpoint.
    written, write_dir = [], pipeline.atomic_write_dir

    def spy_write_dir(output, *args, **kwargs):
        written.append(str(output))
        return write_dir(output, *args, **kwargs)

    pipeline.atomic_write_dir = spy_write_dir
    try:
        report = pipeline.prune_in_memory(PruneRequest(
            checkpoint, out / "uniform", PruneConfig(criterion="frequency", sparsity=0.5),
            run=RunOptions(progress=False),
            data=DataOptions(sources=[str(calibration)], batch_size=2),
        ))  # fmt: skip
    finally:
        pipeline.atomic_write_dir = write_dir
    result["uniform"] = {"written": written, "removed": report["removed_per_layer"]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
