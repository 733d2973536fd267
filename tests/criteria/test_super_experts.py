"""The super-expert guard: the statistic, the rule, and that no plan removes a planted super expert."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import run_cli
from moeprune.criteria.registry import LayerScores
from moeprune.criteria.super_experts import find_super_experts, protected_order, super_experts
from moeprune.data.loading import load_data
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.observe.observer import observe
from moeprune.observe.stats import LayerStats

pytestmark = pytest.mark.integration

LAYER, EXPERT = 2, 5  # the planted super expert


def test_the_rule_pools_every_layer_and_takes_the_percentile_and_a_tenth_of_the_max():
    # 200 experts over two layers: maxima 1..199 and one of 1000
    first = np.arange(1, 101, dtype=float)  # layer 0: 1..100
    second = np.arange(101, 201, dtype=float)  # layer 3: 101..200
    second[-1] = 1000.0  # expert 99 of layer 3
    # numpy's linear P99.5 of the pool: rank 0.995 * 199 = 198.005, between 199 and 1000
    assert np.percentile(np.concatenate([first, second]), 99.5) == pytest.approx(199 + 0.005 * 801)
    assert find_super_experts({0: first, 3: second}) == {3: [99]}
    # above P99.5 is not enough: 298 experts at 1, one at 50 and one at 1000 (pooled over layers)
    # give P99.5 = 1 + 0.505 * 49 = 25.745 (rank 0.995 * 299 = 297.505), but 50 < 1000 / 10
    low = {0: np.ones(150), 1: np.concatenate([np.ones(148), [50.0, 1000.0]])}
    assert np.percentile(np.concatenate(list(low.values())), 99.5) == pytest.approx(25.745)
    assert find_super_experts(low) == {1: [149]}
    low[1][148] = 101.0  # now above a tenth of the max too
    assert find_super_experts(low) == {1: [148, 149]}
    # experts no token reached (NaN) are left out of the pool; P99.5 of [1, 2, 10, 10, 10, 10.5]
    # is 10 + 0.975 * 0.5 = 10.4875, so only 10.5 is super
    flat = {0: np.array([10.0, 10.0, 10.0, 10.5]), 1: np.array([1.0, 2.0, np.nan])}
    assert find_super_experts(flat) == {0: [3]}
    assert find_super_experts({0: np.array([np.nan])}) == {}


def test_protected_experts_go_last_in_the_pruning_order():
    scores = [LayerScores(layer=1, scores=np.arange(4.0), order=[3, 0, 2, 1])]
    got = protected_order(scores, {1: [0, 3]})
    assert got[0].order == [2, 1, 3, 0] and got[0].scores is scores[0].scores
    assert protected_order(scores, {})[0].order == [3, 0, 2, 1]


def _planted(seed: int = 0):
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", seed=seed, vocab_size=len(tokenizer), num_hidden_layers=4, mlp_only_layers=[])
    with torch.no_grad():
        model.model.layers[LAYER].mlp.experts.down_proj[EXPERT] *= 100.0
    return model, tokenizer


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny Qwen3-MoE (4 layers of 8 experts) whose expert 5 of layer 2 writes 100x its output."""
    path = tmp_path_factory.mktemp("super") / "planted"
    model, tokenizer = _planted()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_statistic_is_the_brute_force_maximum_and_merges_by_max(data):
    model, tokenizer = _planted()
    calib = load_data([str(data)], tokenizer, num_samples=8, max_length=64)
    moe = MoEModel(model)
    stats = observe(moe, calib, batch_size=3, progress=False)
    # brute force: every routed (non-padding) token's expert output, one batch at a time
    truth = {m.index: torch.zeros(m.num_experts, dtype=torch.float64) for m in moe.layers}
    valid = {}

    def record(layer, routed):
        keep = valid["mask"][routed.rows]
        for e, y in zip(routed.experts[keep].tolist(), routed.outputs[keep]):
            truth[layer.index][e] = max(truth[layer.index][e], float(y.abs().max()))

    with torch.no_grad(), override_routed(moe, RoutedOptions(on_layer=record)):
        for batch in calib.batches(3, 0):
            valid["mask"] = batch.attention_mask.reshape(-1).bool()
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    for s in stats.layers:
        assert s.output_absmax is not None and s.output_absmax.dtype == torch.float64
        assert torch.equal(s.output_absmax, truth[s.layer])
    assert super_experts(stats) == {LAYER: [EXPERT]}
    # merging two halves (batches, ranks or domains) is the max of both
    half = observe(moe, load_data([str(data)], tokenizer, num_samples=4, max_length=64), progress=False)
    merged = LayerStats.from_dict({k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in half.layer(LAYER).to_dict().items()})  # fmt: skip
    merged.merge(stats.layer(LAYER))
    assert torch.equal(merged.output_absmax, torch.maximum(half.layer(LAYER).output_absmax,
                                                           stats.layer(LAYER).output_absmax))  # fmt: skip


def _report(out):
    return json.loads((out / "report.json").read_text())


def _dropped(out, layer=LAYER):
    plan = json.loads((out / "plan.json").read_text())
    return next(lp for lp in plan["layers"] if lp["layer"] == layer)["dropped"]


def _seed_that_drops_it(planted, data, tmp_path):
    """A seed whose random order removes the planted expert when the guard is off."""
    for seed in range(8):
        out = tmp_path / f"allowed{seed}"
        run_cli("prune", planted, "--output", out, "--criterion", "random", "--sparsity", "0.5", "--seed", seed,
                "--data", data, "--samples", "8", "--quiet", "--allow-super-experts")  # fmt: skip
        if EXPERT in _dropped(out):
            return seed, out
    raise AssertionError("no seed of 8 removes the planted expert")


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
def test_random_never_removes_the_planted_super_expert_unless_allowed(planted, data, tmp_path, no_load):
    seed, allowed = _seed_that_drops_it(planted, data, tmp_path)
    assert _report(allowed)["super_experts"] == {str(LAYER): [EXPERT]}
    assert "not protected" in _report(allowed)["super_experts_note"]
    out = tmp_path / "guarded"
    flags = ["--no-load"] if no_load else []
    done = run_cli("prune", planted, "--output", out, "--criterion", "random", "--sparsity", "0.5", "--seed", seed,
                   "--data", data, "--samples", "8", *flags)  # fmt: skip
    report = _report(out)
    assert report["super_experts"] == {str(LAYER): [EXPERT]}
    assert EXPERT not in _dropped(out)
    assert report["budget_experts_removed"] == sum(report["removed_per_layer"].values()) == 16
    assert "super experts" in done.output and f"layer {LAYER}: {EXPERT}" in done.output
    assert f"layer {LAYER}: {EXPERT}" in (out / "README.md").read_text()


@pytest.mark.parametrize("criterion", ["reap", "frequency"])
def test_a_data_criterion_keeps_it_under_global_allocation(planted, data, tmp_path, criterion):
    out = tmp_path / criterion
    run_cli("prune", planted, "--output", out, "--criterion", criterion, "--sparsity", "0.5", "--data", data,
            "--samples", "8", "--quiet", "--allocation", "global")  # fmt: skip
    report = _report(out)
    assert report["super_experts"] == {str(LAYER): [EXPERT]} and EXPERT not in _dropped(out)
    assert sum(report["removed_per_layer"].values()) == 16


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
def test_a_budget_only_removing_one_meets_is_refused_in_one_line(planted, data, tmp_path, monkeypatch, no_load):
    # One super expert never forces a refusal (every layer keeps top_k >= 1 experts anyway), and the
    # rule finds more than top_k in one layer only among hundreds of experts: three are planted in the
    # detection's result. 6 of 8 experts may go per layer (top_k 2), 5 where 3 must stay: a sparsity
    # of 0.75 (24 of 32) needs 6 in every layer.
    import moeprune.surgery.planning as planning

    monkeypatch.setattr(planning, "super_experts", lambda stats: {LAYER: [1, 5, 6]})
    flags = ["--no-load"] if no_load else []
    refused = run_cli("prune", planted, "--output", tmp_path / "no", "--criterion", "reap", "--sparsity", "0.75",
                      "--data", data, "--samples", "8", "--quiet", *flags, ok=False)  # fmt: skip
    assert refused.exit_code == 2 and "super expert" in refused.output, refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "no").exists()
    if not no_load:  # (the no-load pipeline refuses to check a layer left with exactly top_k experts)
        run_cli("prune", planted, "--output", tmp_path / "yes", "--criterion", "reap", "--sparsity", "0.75",
                "--data", data, "--samples", "8", "--quiet", "--allow-super-experts")  # fmt: skip
    # 0.625 (20 of 32, 5 per layer) is met by the other experts: layer 2 loses at most 5
    run_cli("prune", planted, "--output", tmp_path / "ok", "--criterion", "reap", "--sparsity", "0.625",
            "--data", data, "--samples", "8", "--quiet", *flags)  # fmt: skip
    assert not {1, 5, 6} & set(_dropped(tmp_path / "ok"))


def test_without_data_the_summary_says_super_experts_were_not_checked(planted, tmp_path):
    done = run_cli("prune", planted, "--output", tmp_path / "out", "--criterion", "aimer", "--sparsity", "0.25",
                   "--no-load")  # fmt: skip
    assert "super experts were not checked" in done.output and "calibration data" in done.output
    assert "super_experts" not in _report(tmp_path / "out")


def test_score_lists_them(planted, data, tmp_path):
    done = run_cli("score", planted, "--criterion", "reap", "--output", tmp_path / "s.json", "--data", data,
                   "--samples", "8")  # fmt: skip
    document = json.loads((tmp_path / "s.json").read_text())
    assert document["super_experts"] == {str(LAYER): [EXPERT]} and document["super_experts_guarded"]
    assert f"layer {LAYER}: {EXPERT}" in done.output
    layer = next(x for x in document["layers"] if x["layer"] == LAYER)
    assert layer["order"][-1] == EXPERT  # the order prune follows: the super expert last
    run_cli("score", planted, "--criterion", "reap", "--output", tmp_path / "raw.json", "--data", data,
            "--samples", "8", "--allow-super-experts")  # fmt: skip
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert not raw["super_experts_guarded"]
    raw_layer = next(x for x in raw["layers"] if x["layer"] == LAYER)
    assert raw_layer["order"] == [int(i) for i in np.argsort(raw_layer["scores"], kind="stable")]


def test_tenp_keeps_it_whole_and_neurons_says_it_narrows_it(planted, data, tmp_path):
    run_cli("prune", planted, "--output", tmp_path / "tenp", "--criterion", "tenp", "--method", "tenp",
            "--sparsity", "0.5", "--data", data, "--samples", "8", "--quiet")  # fmt: skip
    plan = json.loads((tmp_path / "tenp" / "plan.json").read_text())
    layer = next(lp for lp in plan["layers"] if lp["layer"] == LAYER)
    assert str(EXPERT) not in layer["neurons"] and EXPERT not in layer["neurons"]  # whole
    assert "whole experts" in _report(tmp_path / "tenp")["super_experts_note"]
    run_cli("prune", planted, "--output", tmp_path / "enp", "--criterion", "reap", "--method", "neurons",
            "--sparsity", "0.5", "--data", data, "--samples", "8", "--quiet")  # fmt: skip
    assert "kept whole: the result is in moeprune format" in _report(tmp_path / "enp")["super_experts_note"]
