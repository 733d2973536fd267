"""`prune --quantize auto:w4a16,w8a16 --target-size T --allocation evo` without `--sparsity`: the
experts removed per layer and each layer's scheme searched together (quantize/evo.py,
quantize/evo_space.py), with llm-compressor's oneshot stood in for (its part, bytes on disk,
is tests/quantize/test_precision_oneshot.py's quant_env test): runs everywhere.

What must hold: every candidate the space makes is within the per-layer limits and under T, its
bytes those of `precision_bytes` exactly; the winner is under T and at least as fit on the search
data as every grid seed, as the search scored them; the fake-quantized swaps leave the weights as
they were; the result prunes the winner's counts and quantizes with its schemes; and "quantize only"
(sparsity 0) is a grid point whenever it fits, and when it is chosen the full model is quantized.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from helpers import oneshot_stand_in, run_cli, save_tiny_qwen, write_arithmetic
from moeprune.config import PruneConfig, SearchConfig
from moeprune.criteria import scoring
from moeprune.data.loading import load_data
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.quantize import stage as stage_module
from moeprune.quantize.choice import LayerSwap, budget_per_scheme, precision_bytes
from moeprune.quantize.evo import joint_candidate, joint_space, search_joint
from moeprune.quantize.options import QuantizeOptions
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.evo import EvoIO, EvoSearch
from moeprune.search.options import SearchRuntime
from moeprune.shards.weight_bytes import cast_weight_bytes
from moeprune.surgery.sizes import WeightBytes

pytestmark = pytest.mark.integration

SCHEMES = ("w4a16", "w8a16")
OPTIONS = QuantizeOptions("w4a16", "rtn", 16, candidates=SCHEMES)
CONFIG = PruneConfig(criterion="frequency", sparsity=0.25, allocation="evo")


SIZES: dict[int, WeightBytes] = {}


def _size(moe: MoEModel) -> WeightBytes:
    return SIZES[id(moe)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> MoEModel:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("precision-evo-tiny")
    model, _ = save_tiny_qwen(folder)
    moe = MoEModel(model)
    SIZES[id(moe)] = cast_weight_bytes(folder, moe, torch.float32)
    return moe


def test_the_space_bytes_are_the_byte_model_and_every_mutant_is_feasible(tiny):
    size = _size(tiny)
    every = budget_per_scheme(precision_bytes(size, tiny, SCHEMES, OPTIONS, 4, [0, 0, 0]), SCHEMES)
    target = (every["w4a16"] + every["w8a16"]) // 2
    space = joint_space(tiny, CONFIG, OPTIONS, size, 4, target)
    rng = np.random.default_rng(0)
    seed = space.repair([(0, 1), (0, 1), (0, 0)], rng)
    assert seed is not None and space.feasible(seed)
    seen = {seed}
    for _ in range(200):
        child = space.mutate(list(seen)[int(rng.integers(len(seen)))], SearchConfig(), rng)
        assert space.feasible(child)
        removed, choice = [r for r, _ in child], space.named(child)
        exact = precision_bytes(size, tiny, SCHEMES, OPTIONS, 4, removed)
        assert space.bytes(child) == exact.total(choice) and space.layer_bytes(child) == list(
            layer[s] for layer, s in zip(exact.layers, choice)
        )
        seen.add(child)
    assert len({tuple(space.named(c)) for c in seen}) > 2  # schemes flip, not only counts move
    assert len({sum(r for r, _ in c) for c in seen}) > 1  # the total removed is free


def test_a_known_optimum_is_found_from_the_seeds(tiny):
    """T = the full model at the base scheme: sparsity 0 fits only with every layer at w4a16, any
    w8a16 layer costs experts. Fitness: minus the experts removed. The quantize-only seed wins."""
    size = _size(tiny)
    target = budget_per_scheme(precision_bytes(size, tiny, SCHEMES, OPTIONS, 4, [0, 0, 0]), SCHEMES)["w4a16"]
    space = joint_space(tiny, CONFIG, OPTIONS, size, 4, target)
    only = ((0, 0), (0, 0), (0, 0))
    richer = space.repair([(0, 1), (0, 1), (0, 1)], np.random.default_rng(0))
    assert richer is not None and sum(r for r, _ in richer) > 0
    search = EvoSearch(
        lambda c: -float(sum(r for r, _ in c)), space, {"grid 0.5": richer, "grid 0": only},
        SearchConfig(population=6, elites=2, generations=3),
    )  # fmt: skip
    result = search.run()
    assert result.best == only and result.best_fitness == 0.0
    assert search.cache[richer] < 0


def test_a_resumed_search_ends_where_an_uninterrupted_one_does(tiny, tmp_path):
    size = _size(tiny)
    every = budget_per_scheme(precision_bytes(size, tiny, SCHEMES, OPTIONS, 4, [0, 0, 0]), SCHEMES)
    space = joint_space(tiny, CONFIG, OPTIONS, size, 4, (every["w4a16"] + every["w8a16"]) // 2)
    seeds = {"seed": space.repair([(0, 0), (0, 1), (0, 0)], np.random.default_rng(0))}

    def fitness(c):  # a made-up score that prefers removals late and w8a16 early
        return float(sum(r * (i + 1) for i, (r, _) in enumerate(c)) - sum(s * (3 - i) for i, (_, s) in enumerate(c)))

    def search(generations: int, state) -> EvoSearch:
        config = SearchConfig(population=5, elites=2, generations=generations, seed=3)
        return EvoSearch(fitness, space, seeds, config, io=EvoIO(state_path=state, progress=False))

    whole = search(5, tmp_path / "whole.json").run()
    search(2, tmp_path / "part.json").run()
    resumed = search(5, tmp_path / "part.json").run(resume=True)
    assert resumed.best == whole.best and [h.fitnesses for h in resumed.history] == [
        h.fitnesses for h in whole.history
    ]
    assert space.feasible(whole.best) and whole.best_fitness >= fitness(seeds["seed"])


@pytest.fixture(scope="module")
def searched(tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision-evo-unit")
    data = load_data([str(write_arithmetic(root / "search.jsonl", 4))], byte_tokenizer(), max_length=48)
    size = _size(tiny)
    every = budget_per_scheme(precision_bytes(size, tiny, SCHEMES, OPTIONS, 4, [0, 0, 0]), SCHEMES)
    space = joint_space(tiny, CONFIG, OPTIONS, size, 4, (every["w4a16"] + every["w8a16"]) // 2)
    before = {n: (p.data, p.data.clone()) for n, p in tiny.model.named_parameters()}
    rng = np.random.default_rng(1)
    seeds = {"a": space.repair([(0, 0), (0, 1), (0, 0)], rng), "b": space.repair([(2, 1), (2, 1), (2, 1)], rng)}
    orders = [list(range(m.num_experts)) for m in tiny.layers]
    config = PruneConfig(
        criterion="frequency", sparsity=0.25, allocation="evo",
        search=SearchConfig(population=4, elites=2, generations=3),
    )  # fmt: skip
    runtime = SearchRuntime(batch_size=4, progress=False)
    best, doc = search_joint(tiny, space, seeds, orders, data, config, runtime, 16)  # type: ignore[arg-type]
    return {"space": space, "best": best, "doc": doc, "before": before, "seeds": seeds, "data": data, "orders": orders}


def test_the_winner_is_under_t_and_no_worse_than_any_seed(searched):
    doc, space = searched["doc"], searched["space"]
    assert space.bytes(searched["best"]) == doc["predicted_bytes"] <= space.target
    assert all(doc["fitness_value"] >= seed["fitness_value"] for seed in doc["seeds"].values())
    assert doc["allocation"] == [r for r, _ in searched["best"]] and doc["evaluations"] > len(searched["seeds"])


def test_the_prefix_cached_fitness_is_the_plain_forward_of_the_candidate(tiny, searched):
    """The prefix cache is keyed by each earlier layer's (removed, scheme): a candidate resumed
    from a cached prefix scores what the plain forward of the whole candidate scores."""
    doc = searched["doc"]
    assert doc["speedups"]["resume_mode"] != "plain" and doc["speedups"]["prefix_hits"] > 0
    swap = LayerSwap(tiny, 16)
    plain: CandidateEvaluator | None = None

    def context(c):
        return joint_candidate(plain, tiny, swap, SCHEMES, c)

    plain = CandidateEvaluator(
        tiny, searched["data"], searched["orders"], seed=42, plan_context=context,
        runtime=SearchRuntime(batch_size=4, progress=False, fast=False),
    )  # fmt: skip
    for name, seed in searched["seeds"].items():
        assert plain.evaluate(seed) == pytest.approx(doc["seeds"][name]["fitness_value"], abs=1e-6)
    assert plain.evaluate(searched["best"]) == pytest.approx(doc["fitness_value"], abs=1e-6)


def test_the_swaps_leave_every_weight_as_it_was(tiny, searched):
    for name, p in tiny.model.named_parameters():
        original, copy = searched["before"][name]
        assert p.data_ptr() == original.data_ptr() and torch.equal(p.data, copy), name


# -- through prune: the grid seeds the search, the winner is pruned and quantized -------------
@pytest.fixture(scope="module")
def joint(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision-evo")
    save_tiny_qwen(root / "model")
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--data", data, "--criterion", "frequency",
              "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn", "--quant-group-size", "16",
              "--quant-python", sys.executable, "--quiet"]  # fmt: skip
    evo = ["--search-data", data, "--allocation", "evo", "--population", "4", "--elites", "2", "--generations", "3", "--seed", "0"]
    out: dict = {"passes": []}
    observe = scoring.observe_distributed

    def counted(*args, **kwargs):
        out["passes"].append(1)
        return observe(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
        patch.setattr(scoring, "observe_distributed", counted)
        run_cli("prune", *common, *evo, "--output", root / "evo", "--target-size", "127300")
        patch.setattr(scoring, "observe_distributed", observe)
        out["evo dry"] = run_cli("prune", *common, *evo, "--output", root / "d", "--target-size", "127300", "--dry-run").output
        dry = run_cli("prune", *common, "--output", root / "x", "--target-size", "10MB", "--dry-run").output
        every_w4 = int(re.search(r"sparsity 0: every layer in one scheme w4a16 ([\d,]+)", dry)[1].replace(",", ""))
        run_cli("prune", *common, "--quant-sparsity-grid", "1", "--output", root / "only",
                "--target-size", str(every_w4 + 5000))  # fmt: skip
    for name in ("evo", "only"):
        folder = root / name
        out[name] = {k: json.loads((folder / f"{k}.json").read_text()) for k in ("report", "recipe")}
        out[name]["folder"] = folder
    out["search"] = json.loads((root / "evo" / "search.json").read_text())
    return out


def test_prune_keeps_the_winner_counts_and_schemes(joint):
    report, search = joint["evo"]["report"], joint["search"]
    precision = report["quantization"]["precision"]
    keys = sorted(report["removed_per_layer"], key=int)
    assert [report["removed_per_layer"][k] for k in keys] == search["allocation"]
    assert [precision["chosen"][k] for k in keys] == search["chosen_schemes"]
    assert report["quantization"]["layer_schemes"] == precision["chosen"]
    assert precision["predicted_bytes"] == search["predicted_bytes"] <= 127300
    assert precision["fixed_bytes"] + sum(precision["expert_bytes"].values()) == precision["predicted_bytes"]
    assert all(search["fitness_value"] >= s["fitness_value"] for s in search["seeds"].values())
    assert {f"grid {r['sparsity']:.4g}" for r in precision["sparsity_grid"]} == set(search["seeds"])
    assert joint["evo"]["recipe"]["config"]["sparsity"] is None  # a rerun searches again
    grid = [float(x) for x in re.findall(r"grid      sparsity ([\d.]+):", joint["evo dry"])]
    assert grid == [float(f"{r['sparsity']:.6g}") for r in precision["sparsity_grid"]]  # as printed
    assert "search    evo over experts removed and scheme per MoE layer" in joint["evo dry"]
    assert len(joint["passes"]) == 1  # prune reuses the grid's observation of the full model


def test_quantize_only_is_a_grid_point_and_prunes_nothing_when_chosen(joint):
    report = joint["only"]["report"]
    precision = report["quantization"]["precision"]
    assert [r["sparsity"] for r in precision["sparsity_grid"]] == [0.0]
    assert report["sparsity"] == 0.0 and set(report["removed_per_layer"].values()) == {0}
    assert "no expert removed" in precision["no_expert_removed"]
    assert "no expert removed" in (joint["only"]["folder"] / "moeprune.log").read_text()
    assert precision["predicted_bytes"] <= precision["target_bytes"]
