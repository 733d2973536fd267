"""Narrowed widths on a multiple (`--width-multiple`), and `--method neurons` keeping a planted super
expert whole (the other experts of its layer share one width; moeprune's format)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import moeprune
from helpers import assert_logits_close, run_cli
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.criteria.super_experts import NEURONS_WHOLE
from moeprune.data.loading import load_data
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.packed import layer_cost
from moeprune.observe.observer import observe
from moeprune.surgery.neurons import guarded_shared, uniform_widths
from moeprune.surgery.parameters import plan_routed_parameters
from moeprune.surgery.planning import build_plan, guard_super_experts
from moeprune.surgery.plans import apply_plan_physical, virtual_plan
from moeprune.surgery.tenp import TenpOptions, tenp_allocation, tenp_steps
from moeprune.surgery.widths import nearest_multiple, width_step

pytestmark = pytest.mark.integration

LAYER, EXPERT = 2, 5  # the planted super expert
TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_width_steps_and_rounding_by_hand():
    assert width_step(768, None, 8) == 32 and width_step(16, None, 8) == 8 and width_step(16, None) == 1
    assert width_step(32, None, 8) == 8 and width_step(20, None, 8) == 1 and width_step(16, 4, 8) == 4
    # nearest multiple, ties up, the full width always allowed (48 is no multiple of 32)
    assert nearest_multiple(47.9, 32, 768) == 32 and nearest_multiple(48, 32, 768) == 64
    assert nearest_multiple(40, 32, 48) == 48 and nearest_multiple(39, 32, 48) == 32
    assert nearest_multiple(15, 32, 768) == 0


def test_enp_widths_are_multiples_and_the_budget_is_met_to_half_a_step():
    """A 256-wide qwen3_moe: default step 32; at 0.3 each expert's target is 179.2 neurons -> 192.
    A 128-wide one is under 8 blocks: the default keeps grouped_mm's 8 (89.6 -> 88)."""
    moe = MoEModel(tiny_model("qwen3_moe", moe_intermediate_size=256, num_hidden_layers=2))
    for sparsity, asked, expected in (
        (0.3, None, 192),
        (0.3, 16, 176),
        (0.3, 24, 168),
        (0.6, None, 96),
        (0.6, 24, 96),
    ):
        widths = uniform_widths(moe, sparsity, asked)
        assert set(widths) == {expected}, (sparsity, asked, widths)
        step = asked or 32
        assert expected % step == 0 and abs(expected - (1 - sparsity) * 256) <= step / 2
    with pytest.raises(MoePruneError, match="less than one block of 32 neurons of its 256"):
        uniform_widths(moe, 0.95)
    narrow = MoEModel(tiny_model("qwen3_moe", moe_intermediate_size=128, num_hidden_layers=2))
    assert set(uniform_widths(narrow, 0.3)) == {88} and set(uniform_widths(narrow, 0.25)) == {96}


def test_tenp_widths_are_multiples_and_the_budget_within_half_a_block():
    moe = MoEModel(
        tiny_model("qwen3_moe", moe_intermediate_size=256, num_hidden_layers=4, mlp_only_layers=[])
    )
    row = layer_cost(moe.layers[0]).per_neuron
    for asked in (None, 16):
        alloc = tenp_allocation(moe, 0.5, TenpOptions(width_multiple=asked))
        step = asked or 32
        narrowed = [w for ws in alloc.widths for w in ws]
        assert narrowed and all(w % step == 0 and 0 < w < 256 for w in narrowed), narrowed
        assert abs(alloc.kept_params - alloc.target_params) <= row * step / 2
    exact = tenp_allocation(moe, 0.5, TenpOptions(width_multiple=1))
    assert abs(exact.kept_params - exact.target_params) <= row / 2


def test_tenp_falls_back_to_one_neuron_where_the_default_step_leaves_no_block():
    """256-wide experts at 80 %: the trapezoid leaves the narrowed ones under one block of 32
    neurons; the default step gives way to TENP's own 1 neuron (what the plan records), an explicit
    multiple is refused."""
    moe = MoEModel(tiny_model("qwen3_moe", moe_intermediate_size=256, num_hidden_layers=4, mlp_only_layers=[]))
    assert tenp_steps(moe, 0.8, TenpOptions()) == [1] * 4 and tenp_steps(moe, 0.5, TenpOptions()) == [32] * 4
    alloc = tenp_allocation(moe, 0.8, TenpOptions())
    assert abs(alloc.kept_params - alloc.target_params) <= layer_cost(moe.layers[0]).per_neuron / 2
    with pytest.raises(MoePruneError, match="less than one block of 32 neurons"):
        tenp_allocation(moe, 0.8, TenpOptions(width_multiple=32))


# ----------------------------------------------------------------------------- the planted super expert
def _planted():
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=4, mlp_only_layers=[])
    with torch.no_grad():
        model.model.layers[LAYER].mlp.experts.down_proj[EXPERT] *= 100.0
    return model, tokenizer


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("neuron-super") / "planted"
    model, tokenizer = _planted()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_neurons_keeps_the_planted_super_expert_whole_in_memory(data, tmp_path):
    model, tokenizer = _planted()
    moe = MoEModel(model)
    stats = observe(moe, load_data([str(data)], tokenizer, num_samples=8, max_length=64), neurons=True,
                    progress=False)  # fmt: skip
    config = PruneConfig("reap", 0.5, method="neurons")
    assert guard_super_experts(moe, config, [stats]) == {LAYER: [EXPERT]}
    crit = get_criterion("reap")
    scores = compute_scores("reap", stats=stats, layers=[m.index for m in moe.layers])
    plan = build_plan(moe, crit, scores, config=config, stats=[stats])
    cost = layer_cost(moe.layers[0])
    for lp in plan.layers:
        if lp.layer == LAYER:  # 8 x 8 neurons = 16 + 7 x 6 + 6 left: six of the seven get one more (step 1)
            assert EXPERT not in lp.neurons and sorted(lp.neurons.values()) == [6] + [7] * 6
        else:
            assert set(lp.neurons.values()) == {8} and len(lp.neurons) == 8
    assert plan.extra["super_experts_whole"] == {str(LAYER): [EXPERT]}
    kept = plan_routed_parameters(moe, plan)["routed_experts"]
    assert kept == 3 * 8 * cost.params(8) + cost.params(16) + 6 * cost.params(7) + cost.params(6)
    assert kept == 4 * 8 * cost.params(8)  # ENP's budget exactly (no biases: parameters go by neurons)
    full = logits(model)
    with virtual_plan(moe, plan, stats):
        virtual = logits(model)
    pruned = copy.deepcopy(model)
    assert apply_plan_physical(MoEModel(pruned), plan, stats)["form"] == "packed"
    physical = logits(pruned)
    assert (physical - virtual).abs().max() <= 1e-5 * max(1.0, float(full.abs().max()))
    assert moeprune.save_pretrained(pruned, tmp_path) == "moeprune"
    assert_logits_close(logits(moeprune.load_pretrained(tmp_path)), physical)


def _report(out):
    return json.loads((out / "report.json").read_text())


def test_cli_neurons_guarded_is_moeprune_format_and_allow_is_stock(planted, data, tmp_path):
    done = run_cli("prune", planted, "--output", tmp_path / "g", "--criterion", "reap", "--method", "neurons",
                   "--sparsity", "0.5", "--data", data, "--samples", "8")  # fmt: skip
    report = _report(tmp_path / "g")
    assert NEURONS_WHOLE in report["super_experts_note"] and NEURONS_WHOLE in done.output
    assert report["surgery"]["form"] == "packed"
    plan = json.loads((tmp_path / "g" / "plan.json").read_text())
    layer = next(lp for lp in plan["layers"] if lp["layer"] == LAYER)
    assert str(EXPERT) not in layer["neurons"] and EXPERT not in layer["neurons"]
    run_cli("prune", planted, "--output", tmp_path / "a", "--criterion", "reap", "--method", "neurons",
            "--sparsity", "0.5", "--data", data, "--samples", "8", "--quiet", "--allow-super-experts")  # fmt: skip
    assert _report(tmp_path / "a")["surgery"] == {"form": "rectangular", "intermediate_size": 8}


def test_no_load_neurons_refuses_guarded_super_experts_in_one_line(planted, data, tmp_path):
    refused = run_cli("prune", planted, "--output", tmp_path / "no", "--criterion", "reap", "--method", "neurons",
                      "--sparsity", "0.5", "--data", data, "--samples", "8", "--no-load", "--quiet", ok=False)  # fmt: skip
    assert refused.exit_code == 2 and "--allow-super-experts" in refused.output, refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "no").exists()
    run_cli("prune", planted, "--output", tmp_path / "ok", "--criterion", "reap", "--method", "neurons",
            "--sparsity", "0.5", "--data", data, "--samples", "8", "--no-load", "--quiet",
            "--allow-super-experts")  # fmt: skip
    assert _report(tmp_path / "ok")["surgery"]["intermediate_size"] == 8


def test_width_multiple_flag_reaches_the_plan_and_bad_values_are_refused(planted, data, tmp_path):
    run_cli("prune", planted, "--output", tmp_path / "w", "--criterion", "reap", "--method", "tenp",
            "--sparsity", "0.5", "--data", data, "--samples", "8", "--quiet", "--width-multiple", "4")  # fmt: skip
    plan = json.loads((tmp_path / "w" / "plan.json").read_text())
    widths = {w for lp in plan["layers"] for w in lp["neurons"].values()}
    assert widths and all(w % 4 == 0 for w in widths) and plan["extra"]["width_multiple"]["0"] == 4
    for bad in ("0", "x"):
        refused = run_cli("prune", planted, "--output", tmp_path / "bad", "--criterion", "reap", "--method",
                          "neurons", "--sparsity", "0.5", "--data", data, "--width-multiple", bad, ok=False)  # fmt: skip
        assert (
            refused.exit_code == 2
            and "--width-multiple" in refused.output
            and not (tmp_path / "bad").exists()
        )
    refused = run_cli("prune", planted, "--output", tmp_path / "m", "--criterion", "reap", "--method", "drop",
                      "--sparsity", "0.5", "--data", data, "--width-multiple", "8", ok=False)  # fmt: skip
    assert refused.exit_code == 2 and "width_multiple" in refused.output.replace("-", "_"), refused.output


def test_guarded_width_is_the_widest_step_within_the_enp_layer_and_the_default_falls_back():
    """64-wide experts, ENP's K = 32: one expert whole leaves 8 x 32 - 64 = 192 neurons for 7 others
    (the default step of a 64-wide expert is grouped_mm's 8; an asked 32 is refused, never relaxed)."""
    moe = MoEModel(tiny_model("qwen3_moe", moe_intermediate_size=64, num_hidden_layers=2))
    layer = moe.layers[0]
    assert layer_cost(layer).per_expert == 0  # no biases: widths compare as neuron counts
    assert guarded_shared(layer, 1, 32, None) == (24, 8)
    assert guarded_shared(layer, 1, 32, 4) == (24, 4) and guarded_shared(layer, 1, 32, 5) == (25, 5)
    with pytest.raises(MoePruneError, match="less than one block of 32 neurons"):
        guarded_shared(layer, 1, 32, 32)  # an asked multiple is never relaxed
