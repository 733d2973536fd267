"""EvoESAP on real models: masked fitness = physical pruning, the fast layer loop, speedups that keep
the selected result, feasibility, resume, bad input, and quality on a trained MoE."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import replace

import pytest
import torch

from helpers import TINY_VOCAB, random_data, random_orders
from moeprune.allocate import budget_from_sparsity
from moeprune.allocate.fitness import FitnessAccumulator
from moeprune.checkpoint import load_model
from moeprune.config import DataOptions, PruneConfig, SearchConfig
from moeprune.criteria import compute_scores, get_criterion, score_experts
from moeprune.data.loading import CalibrationData, Sample, calibration_sets, load_data
from moeprune.errors import DataError, InfeasibleBudgetError, MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import reference_families, tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.observe.observer import observe
from moeprune.report.plots import plot_layer_density, plot_search_curve
from moeprune.search.auto import choose_criterion
from moeprune.search.candidates import (
    TEXT_ONLY_NOTE,
    CandidateEvaluator,
    PrefixCache,
    layer_limits,
)
from moeprune.search.options import SearchRuntime
from moeprune.search.population import Feasibility
from moeprune.search.run import run_evo_search, search_allocation

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

VOCAB = TINY_VOCAB
SMALL = SearchConfig(population=6, elites=2, generations=4, seed=5)


_data = random_data  # the names the other search tests import from here
_orders = random_orders


def _moe(family: str, **overrides) -> MoEModel:
    return MoEModel(tiny_model(family, **overrides))


def _runtime(**fields) -> SearchRuntime:
    """How the tests' searches run: no progress bars, otherwise ``fields``."""
    return SearchRuntime(**{"progress": False, **fields})


def _some_allocation(moe: MoEModel) -> tuple[int, ...]:
    """Each layer loses a different, feasible number of experts."""
    limits = layer_limits(moe)
    return tuple(min(c, (i + 1) * m) // m * m for i, (c, m) in enumerate(zip(limits.caps, limits.multiples)))


def _physical_fitness(evaluator: CandidateEvaluator, moe: MoEModel, allocation, data, fitness: str) -> float:
    """Prune a deep copy for good, run it plainly, score it against the evaluator's teacher."""
    pruned = MoEModel(copy.deepcopy(moe.model))
    drop_experts(pruned, evaluator.removals(allocation))
    accumulator = FitnessAccumulator(evaluator.teacher, fitness, evaluator.seed)
    with torch.no_grad():
        for batch in data.batches(4, 0):
            logits = pruned.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            accumulator.add(batch.sample_index, logits, batch.answer_mask, batch.attention_mask)
    return accumulator.result()


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("fitness", ["esap", "kl", "nll", "sap"])
def test_masked_candidate_fitness_equals_physically_pruned(family, fitness):
    moe, data = _moe(family), _data()
    evaluator = CandidateEvaluator(
        moe, data, _orders(moe), fitness=fitness, seed=7, runtime=_runtime(batch_size=4)
    )
    allocation = _some_allocation(moe)
    assert sum(allocation) > 0
    got = evaluator.evaluate(allocation)
    assert got == pytest.approx(evaluator.sign * evaluator.raw(allocation))
    want = _physical_fitness(evaluator, moe, allocation, data, fitness)
    assert evaluator.raw(allocation) == pytest.approx(want, rel=1e-5, abs=1e-6)
    if family == "deepseek_v3":  # group-limited: removals are balanced over the groups
        size = moe.layers[0].num_experts // moe.layers[0].n_group
        for experts in evaluator.removals(allocation).values():
            assert len({e // size for e in experts}) == moe.layers[0].n_group


@pytest.mark.parametrize("family", supported_families())
def test_fast_layer_loop_matches_model_for_every_family(family):
    """The resumable layer loop (split mode: resumes after a layer's attention) passes its
    self-check for every family and equals the plain forward."""
    moe, data = _moe(family), _data(n=6)
    fast = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=3))
    if family in reference_families():  # others may resume per layer or fall back (the self-check decides)
        assert fast.mode == "split", f"{family}: fell back to {fast.mode}: {fast.notes}"
    plain = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=3, fast=False))
    allocation = _some_allocation(moe)
    assert fast.evaluate(allocation) == pytest.approx(plain.evaluate(allocation), rel=1e-6, abs=1e-7)
    assert fast.evaluate((0,) * len(allocation)) == pytest.approx(1.0, abs=1e-6)  # the full model


def test_resume_modes_fall_back_when_the_self_check_fails(monkeypatch):
    from moeprune.search import candidates as search

    moe, data = _moe("olmoe", num_hidden_layers=4), _data()
    plain = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=4, fast=False))
    want = plain.evaluate((2, 2, 4, 0))

    def no_split(self, decoder_index, residual):
        raise AttributeError("no post-attention norm")

    monkeypatch.setattr(CandidateEvaluator, "_moe_half", no_split)
    layer_mode = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=4))
    assert layer_mode.mode == "layer"
    layer_mode.evaluate((2, 2, 2, 2))
    assert layer_mode.evaluate((2, 2, 4, 0)) == pytest.approx(want, rel=1e-6)
    assert layer_mode.counters["prefix_hits"] == 3

    monkeypatch.setattr(search, "_final_norm", lambda model: torch.nn.Identity())  # a wrong loop
    fallback = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=4))
    assert fallback.mode == "plain" and "plain forward used" in fallback.notes[-1]
    assert fallback.evaluate((2, 2, 4, 0)) == want


def test_prefix_reuse_is_bitwise_exact_and_bounded():
    moe, data = _moe("olmoe", num_hidden_layers=4), _data()
    evaluator = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=4))
    evaluator.evaluate((2, 2, 2, 2))
    shared = evaluator.evaluate((2, 2, 4, 0))  # shares r_0, r_1: starts at MoE layer 2
    assert evaluator.counters["prefix_hits"] == 3  # one per batch
    assert evaluator.counters["decoder_layers_skipped"] == 3 * 2
    cold = CandidateEvaluator(moe, data, _orders(moe), runtime=_runtime(batch_size=4))
    assert cold.evaluate((2, 2, 4, 0)) == shared

    cache = PrefixCache(max_bytes=3 * 4 * 10)
    for i in range(5):
        cache.put((0, (i,)), torch.zeros(10))
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 3 and cache.evictions == 2
    assert cache.get((0, (0,))) is None and cache.get((0, (4,))) is not None


# ---------------------------------------------------------------------------------------------
# The search


def _search(moe, data, budget, config=SMALL, fitness=None, fingerprint=None, **runtime):
    """A quiet search; ``runtime``: SearchRuntime fields (batch size 4 unless given)."""
    if fitness is not None:
        config = replace(config, fitness=fitness)
    fingerprint = {"model": "tiny"} if fingerprint is None else fingerprint
    return run_evo_search(
        moe, data, _orders(moe), budget, config=config, fingerprint=fingerprint,
        runtime=_runtime(**{"batch_size": 4, **runtime}),
    )  # fmt: skip


def _selection(doc: dict) -> list:
    return [(g["generation"], g["best_allocation"], g["best"]) for g in doc["generations"]]


def test_speedups_do_not_change_the_selected_result(fitness="esap"):
    """Prefix reuse, the fast loop and racing vs the plain path: same trajectory and result."""
    moe, data = _moe("olmoe", num_hidden_layers=4), _data(n=12)
    config = SearchConfig(population=8, elites=2, generations=4, seed=11)
    best, doc = _search(moe, data, 12, config, fitness=fitness, batch_size=3)
    plain_best, plain = _search(moe, data, 12, config, fitness=fitness, batch_size=3, fast=False, race=False)
    assert doc["speedups"]["raced"] > 0 and doc["speedups"]["prefix_hits"] > 0  # they did work
    assert plain["speedups"]["raced"] == 0 and plain["speedups"]["prefix_hits"] == 0
    assert best == plain_best
    assert doc["fitness_value"] == pytest.approx(plain["fitness_value"], rel=1e-6)
    assert [s[:2] for s in _selection(doc)] == [s[:2] for s in _selection(plain)]
    for got, want in zip(_selection(doc), _selection(plain)):
        assert got[2] == pytest.approx(want[2], rel=1e-6)
    # A raced candidate's recorded fitness (partial mean) is worse than the final elite bar.
    assert len(doc["raced_evaluations"]) == doc["speedups"]["raced"]


def test_every_candidate_is_feasible_and_meets_the_budget(monkeypatch):
    """Group-limited layers (DeepSeek-V3, 2 groups): multiples of 2, group caps, exact budget."""
    moe = _moe("deepseek_v3", num_hidden_layers=5)
    limits = layer_limits(moe)
    assert set(limits.multiples) == {2} and len(moe.layers) == 4
    budget = 8
    feas = Feasibility(budget, limits.caps, limits.multiples)
    seen = []
    original = CandidateEvaluator.evaluate

    def checked(self, allocation, threshold=None):
        assert feas.is_feasible(allocation) and sum(allocation) == budget, allocation
        self.removals(allocation)  # group-balanced removals exist for it
        seen.append(tuple(allocation))
        return original(self, allocation, threshold)

    monkeypatch.setattr(CandidateEvaluator, "evaluate", checked)
    best, doc = _search(moe, _data(), budget, SearchConfig(population=8, elites=2, generations=5, seed=1))
    assert len(seen) == doc["evaluations"] == len(set(seen)) > 8
    assert feas.is_feasible(best) and doc["uniform"]["allocation"] == [2, 2, 2, 2]


def test_same_seed_same_result_and_resume_is_identical(tmp_path):
    """KL (lower is better, negated for the search) with racing active; resume extends a run."""
    moe, data = _moe("olmoe", num_hidden_layers=4), _data(n=8)
    config = SearchConfig(population=8, elites=2, generations=4, seed=11)
    run = dict(fitness="kl", batch_size=2)
    straight_best, straight = _search(moe, data, 12, config, **run)
    again_best, again = _search(moe, data, 12, config, **run)
    assert (straight_best, straight["generations"]) == (again_best, again["generations"])
    state = tmp_path / "evo_state.json"
    _search(moe, data, 12, replace(config, generations=2), state_path=state, **run)
    resumed_best, resumed = _search(moe, data, 12, config, state_path=state, resume=True, **run)
    assert resumed_best == straight_best and straight["speedups"]["raced"] > 0
    assert resumed["generations"] == straight["generations"]  # raced counts persist beside the state
    assert resumed["raced_evaluations"] == straight["raced_evaluations"]
    with pytest.raises(MoePruneError, match="fitness"):
        _search(moe, data, 12, config, fitness="esap", batch_size=2, state_path=state, resume=True)


def test_search_document_and_plots(tmp_path):
    moe, data = _moe("qwen2_moe"), _data()
    best, doc = _search(moe, data, 6, fitness="nll")
    json.dumps(doc)  # search.json is plain JSON
    assert doc["allocation"] == best and sum(best) == doc["budget"] == 6
    assert not doc["higher_is_better"] and doc["fitness_value"] > 0  # NLL in its own units
    assert doc["fitness_value"] <= doc["uniform"]["fitness_value"]
    assert len(doc["generations"]) == SMALL.generations
    assert all(g["best"] <= g["mean"] for g in doc["generations"])
    assert doc["teacher_cache"]["bytes"] >= doc["teacher_cache"]["answer_positions"] * VOCAB * 4
    density = plot_layer_density(
        tmp_path / "density.png", doc["layers"], doc["num_experts"],
        {"uniform": doc["uniform"]["allocation"], "searched": best},
    )  # fmt: skip
    curve = plot_search_curve(tmp_path / "curve.png", doc["generations"], "nll")
    for png in (density, curve):
        assert png.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------
# Bad input


def test_text_only_search_data_is_noted(caplog):
    moe = _moe("qwen3_moe")
    with caplog.at_level(logging.WARNING, logger="moeprune.search.candidates"):
        _, doc = _search(moe, _data(text_only=True), 4, SearchConfig(population=4, elites=2, generations=2))
    assert TEXT_ONLY_NOTE in doc["notes"] and TEXT_ONLY_NOTE in caplog.text
    _, doc = _search(moe, _data(), 4, SearchConfig(population=4, elites=2, generations=2))
    assert TEXT_ONLY_NOTE not in doc["notes"]


def test_bad_input_fails_early_with_a_reason(tmp_path):
    moe, data = _moe("deepseek_v3"), _data()
    with pytest.raises(MoePruneError, match="cannot resume"):
        _search(moe, data, 4, state_path=tmp_path / "missing.json", resume=True)
    with pytest.raises(MoePruneError, match="population .* must be >= elites"):
        _search(moe, data, 4, SearchConfig(population=2, elites=4))
    with pytest.raises(InfeasibleBudgetError):
        _search(moe, data, 3)  # group-limited layers remove multiples of 2
    with pytest.raises(InfeasibleBudgetError):
        _search(moe, data, 100)
    with pytest.raises(MoePruneError, match="unknown fitness"):
        _search(moe, data, 4, fitness="bleu")
    no_answers = CalibrationData([Sample([5, 6, 7], [False] * 3, "mem", False)], "fp", 0, False, ["mem"])
    with pytest.raises(DataError, match="no search sample has an answer"):
        _search(moe, no_answers, 4)


# ---------------------------------------------------------------------------------------------
# Quality on a trained model


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["frequency", "reap"])
def test_searched_allocation_beats_uniform_on_a_trained_model(trained_moe, criterion):

    model_dir, corpus = trained_moe
    model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    sources = [str(corpus / f"{d}_search.jsonl") for d in ("code", "prose", "math")]
    options = DataOptions(sources=sources, samples=24, max_length=128)
    _, scores, _ = score_experts(
        moe,
        criterion,
        calibration_sets(tokenizer, options),
        progress=False,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    search = load_data(sources, tokenizer, num_samples=24, max_length=128, seed=1)
    limits = layer_limits(moe)
    budget = budget_from_sparsity(0.5, limits.num_experts, limits.top_k)
    best, doc = run_evo_search(
        moe, search, [s.order for s in scores], budget, config=SearchConfig(population=8, elites=4, generations=2),
        fingerprint={"criterion": criterion}, runtime=_runtime(pad_token_id=tokenizer.pad_token_id),
    )  # fmt: skip
    assert doc["uniform"]["allocation"] != best
    assert doc["fitness_value"] > doc["uniform"]["fitness_value"] + 0.01


def test_search_allocation_and_choose_criterion_take_a_prune_config(tmp_path):
    """search_allocation searches what its PruneConfig says, runs as its SearchRuntime says (the
    checkpoint at state_path), and finds what run_evo_search finds on the same budget;
    choose_criterion reads the fitness from the config's search settings."""
    moe, data = _moe("olmoe", num_hidden_layers=4), _data(n=6)
    config = SearchConfig(population=4, elites=2, generations=2, seed=3, fitness="kl")
    stats = observe(moe, data, batch_size=3, progress=False)
    crit = get_criterion("frequency")
    scores = compute_scores("frequency", stats=stats, layers=[m.index for m in moe.layers])
    prune = PruneConfig(criterion="frequency", sparsity=0.25, allocation="evo", search=config)
    state = tmp_path / "state.json"
    removed, doc = search_allocation(
        moe, crit, scores, [stats], data, config=prune, runtime=_runtime(batch_size=3, state_path=state)
    )
    assert state.is_file() and doc["fitness"] == "kl"
    limits = layer_limits(moe)
    budget = budget_from_sparsity(0.25, limits.num_experts, limits.top_k)
    assert removed == _search(moe, data, budget, config, fingerprint={}, batch_size=3)[0]

    auto = replace(prune, criterion="auto", allocation=None, seed=1)
    choice, table = choose_criterion(moe, [stats], data, config=auto, runtime=_runtime(batch_size=3))
    assert table[0].keys() == {"criterion", "kl"} and choice in {row["criterion"] for row in table}
