"""Data-parallel EvoESAP under torchrun (2 gloo processes on CPU) reaches one process's result.

Candidates are split over the ranks, the fitness caches merged; elites, per-generation best and
the result equal one process exactly (a candidate's fitness does not depend on its rank's
history). Only raced candidates' partial fitnesses may differ (racing uses the generation's
starting threshold under torchrun). Only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_distributed import free_port

from distributed_search_worker import (
    CONFIG,
    INTERRUPTED_AT,
    RESUMED,
    STRAIGHT,
    auto_choice,
    problem,
    recorded,
    search_once,
)
from moeprune.cli.main import main

pytestmark = pytest.mark.distributed  # starts torchrun process groups

WORLD = 2


def torchrun_env() -> dict[str, str]:
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU even on a GPU machine
        "OMP_NUM_THREADS": "1",
    }


def torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args,
    ]  # fmt: skip
    done = subprocess.run(command, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def selection(doc: dict) -> list:
    """What the search selected, per generation: index, best allocation, best fitness."""
    return [(g["generation"], g["best_allocation"], g["best"]) for g in doc["generations"]]


def caches(state_path: Path, doc: dict) -> tuple[dict[tuple, float], set[tuple]]:
    """The fitness cache saved in the state, and which of its allocations were raced."""
    cache = {tuple(a): f for a, f in json.loads(state_path.read_text())["cache"]}
    return cache, {tuple(e["allocation"]) for e in doc["raced_evaluations"]}


def write_calibration(path: Path) -> Path:
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i}?", "answer": f" It is {2 * i}."} for i in range(12)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    return write_calibration(tmp_path_factory.mktemp("dsearch_data") / "calib.jsonl")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_checkpoint, calibration) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("dsearch")
    worker = Path(__file__).parents[1] / "distributed_search_worker.py"
    torchrun(str(worker), str(out), str(tiny_checkpoint), str(calibration))
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_two_ranks_select_exactly_what_one_process_selects(ranks, tmp_path):
    out, (rank0, rank1) = ranks
    moe, data = problem()
    with recorded() as one:
        best, doc = search_once(moe, data, state_path=tmp_path / "state.json", **STRAIGHT)
    for rank in (rank0, rank1):  # every rank ends with the same, one-process result
        got = rank["straight"]
        assert got["best"] == best
        assert got["doc"]["fitness_value"] == doc["fitness_value"]  # bitwise: same float
        assert got["elites"] == one["elites"]  # every generation's elites and their fitnesses
        assert selection(got["doc"]) == selection(doc)
        assert got["doc"]["evaluations"] == doc["evaluations"]
        assert got["doc"]["uniform"] == doc["uniform"]
    assert len(one["elites"]) == CONFIG.generations
    # Every fully evaluated allocation has the one-process fitness, whichever rank evaluated it;
    # raced ones (partial means) may differ: racing uses the generation's starting threshold.
    two, two_raced = caches(out / "straight_state.json", rank0["straight"]["doc"])
    one_cache, one_raced = caches(tmp_path / "state.json", doc)
    assert two.keys() == one_cache.keys()
    full = two.keys() - two_raced - one_raced
    assert len(full) > len(two) // 2 and all(two[a] == one_cache[a] for a in full)
    bar = one["elites"][-1][-1][1]  # the final m-th best: no raced candidate reaches it
    assert all(two[a] < bar for a in two_raced) and all(one_cache[a] < bar for a in one_raced)
    # The candidates were really split: disjoint strict subsets that cover what one process evaluated.
    mine = [{tuple(a) for a in r["straight"]["evaluated"]} for r in (rank0, rank1)]
    assert [len(r["straight"]["evaluated"]) for r in (rank0, rank1)] == [len(m) for m in mine]
    assert all(0 < len(m) < doc["evaluations"] for m in mine)
    assert not mine[0] & mine[1] and mine[0] | mine[1] == {tuple(a) for a in one["evaluated"]}
    info = rank0["straight"]["doc"]["distributed"]
    assert info["world_size"] == WORLD and info["backend"] == "gloo"
    assert info["evaluations_per_rank"] == [len(m) for m in mine]
    assert rank0["straight"]["doc"]["speedups"]["candidates"] == doc["evaluations"]  # summed over ranks
    assert rank0["straight"]["doc"]["speedups"]["raced"] > 0  # racing was exercised
    assert rank0["straight"]["doc"]["speedups"]["prefix_hits"] > 0
    assert "distributed" not in doc


def test_criterion_auto_splits_the_criteria_over_ranks(ranks):
    """Each rank tries a disjoint share of the criteria; both end with one process's whole table."""
    _, (rank0, rank1) = ranks
    moe, data = problem()
    best, table = auto_choice(moe, data)
    for rank in (rank0, rank1):
        assert (rank["auto"]["best"], rank["auto"]["table"]) == (best, table)
    tried = [set(rank["auto"]["tried"]) for rank in (rank0, rank1)]
    assert tried[0] and tried[1] and not tried[0] & tried[1]
    assert tried[0] | tried[1] == {row["criterion"] for row in table}


def test_only_rank_zero_writes(ranks):
    out, (rank0, rank1) = ranks
    for run in ("straight", "resumed"):
        assert rank1[run]["writes"] == []
        assert rank0[run]["writes"] and all(Path(p).parent == out for p in rank0[run]["writes"])
    assert {p.name for p in out.iterdir()} == {
        "straight_state.json", "straight_state.json.raced.json", "resume_state.json",
        "resume_state.json.raced.json", "rank0.json", "rank1.json", "uniform",
    }  # fmt: skip


def test_plain_prune_under_torchrun_is_written_by_rank_zero_only(
    ranks, tiny_checkpoint, calibration, tmp_path
):
    out, (rank0, rank1) = ranks
    assert rank0["uniform"]["written"] == [str(out / "uniform")] and rank1["uniform"]["written"] == []
    assert rank0["uniform"]["removed"] == rank1["uniform"]["removed"]
    assert (out / "uniform" / "plan.json").is_file() and (out / "uniform" / "report.json").is_file()
    result = CliRunner().invoke(
        main,
        ["prune", str(tiny_checkpoint), "--output", str(tmp_path / "one"), "--criterion", "frequency",
         "--sparsity", "0.5", "--data", str(calibration), "--batch-size", "2", "--quiet"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    one = json.loads((tmp_path / "one" / "plan.json").read_text())
    assert json.loads((out / "uniform" / "plan.json").read_text()) == one


def test_resume_under_torchrun_equals_one_straight_process(ranks):
    _, (rank0, rank1) = ranks
    moe, data = problem()
    with recorded() as one:
        best, doc = search_once(moe, data, **RESUMED)
    for rank in (rank0, rank1):
        got = rank["resumed"]
        assert got["best"] == best and got["doc"]["fitness_value"] == doc["fitness_value"]
        assert selection(got["doc"]) == selection(doc)
        # Elites of the interrupted run's generations, then of the resumed ones.
        assert got["elites"] == one["elites"]
    assert len(one["elites"]) == CONFIG.generations > INTERRUPTED_AT


def test_a_failing_rank_fails_every_rank(ranks):
    _, (rank0, rank1) = ranks
    assert rank1["failure"] == "RuntimeError: simulated failure on rank 1"
    assert rank0["failure"].startswith("MoePruneError: rank 1 failed while evaluating search candidates")


def test_cli_prune_evo_under_torchrun_equals_one_process(tiny_checkpoint, calibration, tmp_path):
    data = calibration
    args = ["prune", str(tiny_checkpoint), "--criterion", "frequency", "--sparsity", "0.5", "--allocation", "evo",
            "--data", str(data), "--search-data", str(data), "--search-samples", "8", "--population", "6",
            "--elites", "2", "--generations", "3", "--batch-size", "2", "--quiet"]  # fmt: skip
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    result = CliRunner().invoke(
        main, [*args, "--output", str(tmp_path / "one" / "out")], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    moeprune = Path(sys.executable).with_name("moeprune")  # the console script, as users run it
    done = torchrun(
        "--no-python", str(moeprune), *args, "--output", str(tmp_path / "two" / "out"), "--threads", "1"
    )
    assert done.stdout.count("method drop") == 1  # rank 0 alone reports (and writes)
    for folder in ("one", "two"):  # no temporary, state or race-log files left
        assert [p.name for p in (tmp_path / folder).iterdir()] == ["out"]
    one, two = tmp_path / "one" / "out", tmp_path / "two" / "out"
    assert json.loads((two / "plan.json").read_text()) == json.loads((one / "plan.json").read_text())
    s1, s2 = (json.loads((d / "search.json").read_text()) for d in (one, two))
    assert s2["allocation"] == s1["allocation"] and s2["fitness_value"] == s1["fitness_value"]
    assert selection(s2) == selection(s1)
    assert s2["distributed"]["world_size"] == WORLD and min(s2["distributed"]["evaluations_per_rank"]) > 0
    r1, r2 = (json.loads((d / "report.json").read_text()) for d in (one, two))
    assert r2["data"]["tokens"] == r1["data"]["tokens"]  # observation was split and reduced too
    assert r2["scores"]["layers"] == r1["scores"]["layers"]


def test_cli_no_load_neuron_prune_under_torchrun_is_written_once(tiny_checkpoint, calibration, tmp_path):
    """`prune --no-load` observes layer by layer split over ranks; rank 0 alone rewrites the shards
    (a second writer would find the folder taken and fail), equal to one process's rewrite."""
    args = ["prune", str(tiny_checkpoint), "--no-load", "--method", "neurons", "--criterion", "frequency",
            "--sparsity", "0.5", "--data", str(calibration), "--batch-size", "2", "--quiet",
            "--allow-super-experts"]  # fmt: skip  (no-load writes stock widths only)
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "one")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    moeprune = Path(sys.executable).with_name("moeprune")
    done = torchrun("--no-python", str(moeprune), *args, "--output", str(tmp_path / "two"), "--threads", "1")
    assert done.stdout.count("without loading it") == 1
    one, two = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert json.loads((two / "plan.json").read_text()) == json.loads((one / "plan.json").read_text())
    r1, r2 = (json.loads((d / "report.json").read_text()) for d in (one, two))
    assert r2["data"]["tokens"] == r1["data"]["tokens"] and r2["kept_neurons"] == r1["kept_neurons"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no temporary folders left
