"""Planned bytes and the sparsity a size target solves, on hand-made byte costs (surgery/target_size.py).

The tiny models give the structure (qwen3_moe: 2 MoE layers of 8 experts, top-2, 16 neurons, so
16 experts and at most 6 removed per layer; deepseek_v3: the same with 2 routing groups, so
removals come in pairs and at most 4 per layer); the bytes are chosen so every expected number is
worked out by hand in the comments.
"""

from __future__ import annotations

import functools

import pytest

from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.sizes import LayerBytes, WeightBytes, keeps_bytes
from moeprune.surgery.target_size import check_target_config, planned_bytes, solve_target
from moeprune.surgery.tenp import TENP_STEP

pytestmark = pytest.mark.unit  # tiny models on the CPU, no weights written

TOTAL = 100_000
# one expert: 10 bytes per neuron x 16 = 160, its router row 5, a novice's vector 3
LAYER = LayerBytes(experts=8, width=16, per_neuron=10, per_expert=0, router_row=5, novice=3)
SIZE = WeightBytes("bfloat16", TOTAL, (LAYER, LAYER))


@functools.cache
def moe(family: str) -> MoEModel:
    return MoEModel(tiny_model(family))


def solve(family: str, target: int, size: WeightBytes = SIZE, **config):
    return solve_target(moe(family), PruneConfig("magnitude", **config), size, target)


def test_drop_solves_the_smallest_budget_and_one_expert_less_does_not_fit():
    # a drop removes 165 bytes per expert: 3 experts save 495 < 496, 4 save 660
    found = solve("qwen3_moe", TOTAL - 496)
    assert (found.sparsity, found.predicted_bytes) == (4 / 16, TOTAL - 660)
    assert (found.step_below, found.step_below_bytes) == (3 / 16, TOTAL - 495)
    assert found.step_below_bytes > TOTAL - 496 >= found.predicted_bytes
    assert planned_bytes(moe("qwen3_moe"), PruneConfig("magnitude", found.sparsity), SIZE) == TOTAL - 660


def test_novices_keep_their_router_row_and_a_vector_and_equal_fits():
    # a novice saves 160 - 3 = 157 bytes; a target of exactly 4 novices' saving fits at 4
    found = solve("qwen3_moe", TOTAL - 4 * 157, method="novice")
    assert (found.sparsity, found.predicted_bytes, found.step_below_bytes) == (0.25, TOTAL - 628, TOTAL - 471)


def test_low_rank_novices_keep_d_plus_2dR_values():
    # rank 2: a novice keeps 3 x (1 + 2 x 2) = 15 bytes and saves 145; 4 of them fit 100000 - 580
    found = solve("qwen3_moe", TOTAL - 4 * 145, method="novice", options={"novice_rank": 2})
    assert (found.sparsity, found.predicted_bytes, found.step_below_bytes) == (0.25, TOTAL - 580, TOTAL - 435)
    config = PruneConfig("magnitude", 0.25, method="novice", options={"novice_rank": 2})
    assert planned_bytes(moe("qwen3_moe"), config, SIZE) == TOTAL - 580


def test_group_limited_routers_step_in_pairs():
    # deepseek_v3 removes experts two at a time: 1 is no plan, so 166 bytes need 2 (330 saved)
    first = solve("deepseek_v3", TOTAL - 166)
    assert (first.sparsity, first.predicted_bytes, first.step_below) == (2 / 16, TOTAL - 330, 0.0)
    assert first.step_below_bytes == TOTAL  # below the first step: the unpruned model
    # 496 bytes: 3 is no plan either, so 4 experts, and the step below is 2
    found = solve("deepseek_v3", TOTAL - 496)
    assert (found.sparsity, found.step_below, found.step_below_bytes) == (4 / 16, 2 / 16, TOTAL - 330)


def test_neurons_solve_a_width_and_pad_a_derived_shared_expert():
    # 16 neurons in steps of 8: K = 8 halves every expert, 8 experts x 80 bytes x 2 layers
    found = solve("qwen3_moe", TOTAL - 1, method="neurons", allocation="uniform")
    assert (found.sparsity, found.predicted_bytes, found.step_below) == (0.5, TOTAL - 1280, 0.0)
    # a shared expert of 20 neurons, 7 bytes each, is padded to 3 x 8 = 24 neurons: + 28 per layer
    shared = LayerBytes(8, 16, 10, 0, 5, 3, shared_width=20, shared_per_neuron=7)
    size = WeightBytes("bfloat16", TOTAL, (shared, shared))
    config = PruneConfig("magnitude", 0.5, method="neurons", allocation="uniform")
    assert planned_bytes(moe("qwen3_moe"), config, size) == TOTAL - 1280 + 56


def test_the_padded_shared_expert_is_priced_only_where_the_stock_form_writes_it():
    """One rule for every method (surgery/sizes.py `kept_bytes`), the one apply_plan_physical keeps:
    the stock form, so the padding, needs one width below the full one on grouped_mm's stride of 8
    for every expert that keeps weights, and no novice; dropped experts go first, then the shrink."""
    shared = LayerBytes(8, 16, 10, 0, 5, 3, shared_width=20, shared_per_neuron=7)
    size = WeightBytes("bfloat16", TOTAL, (shared, shared))
    at_8 = [LayerKeep((8,) * 8)] * 2  # 2 layers x 8 experts x 80 bytes cut; 20 -> 24 shared neurons
    assert keeps_bytes(size, at_8) == TOTAL - 1280 + 2 * 28
    dropped = [LayerKeep((8,) * 6, 0, 2)] * 2  # + 2 x 2 experts (80 bytes and a 5-byte router row)
    assert keeps_bytes(size, dropped) == TOTAL - 1280 + 2 * 28 - 4 * 85
    novices = [LayerKeep((8,) * 7, 1)] * 2  # packed: no padding; a novice keeps a 3-byte vector
    assert keeps_bytes(size, novices) == TOTAL - 1280 - 2 * 80 + 2 * 3
    assert keeps_bytes(size, novices, novice_rank=1) == TOTAL - 1280 - 2 * 80 + 2 * 3 * 3  # d + 2dR
    at_4 = [LayerKeep((4,) * 8)] * 2  # off the stride: packed, no padding
    assert keeps_bytes(size, at_4) == TOTAL - 2 * 8 * 120
    mixed = [LayerKeep((16,) + (8,) * 7)] * 2  # a whole expert: two widths, packed
    assert keeps_bytes(size, mixed) == TOTAL - 2 * 7 * 80


def test_global_is_bounded_by_the_cheapest_experts_and_uniform_is_exact():
    # layer 0's experts weigh 100 bytes, layer 1's 50: a budget of 4 (sparsity 0.25) removes
    # 2 + 2 = 300 bytes uniformly; global may remove all 4 from layer 1: at least 200
    size = WeightBytes("float32", TOTAL, (LayerBytes(8, 16, 0, 100, 0), LayerBytes(8, 16, 0, 50, 0)))
    model = moe("qwen3_moe")
    assert planned_bytes(model, PruneConfig("reap", 0.25, allocation="uniform"), size) == TOTAL - 300
    assert planned_bytes(model, PruneConfig("reap", 0.25, allocation="global"), size) == TOTAL - 200
    assert planned_bytes(model, PruneConfig("reap", 0.25, allocation="evo"), size) == TOTAL - 200


def test_tenp_solves_on_its_grid_and_one_step_less_does_not_fit():
    size = WeightBytes("float32", TOTAL, (LAYER, LAYER))  # 2 x 8 x 160 = 2560 routed bytes
    target = TOTAL - 1000
    found = solve("qwen3_moe", target, size, method="tenp", allocation="trapezoid")
    assert found.predicted_bytes <= target < found.step_below_bytes
    assert found.step_below == pytest.approx(found.sparsity - TENP_STEP)
    config = PruneConfig("tenp", found.sparsity, method="tenp", allocation="trapezoid")
    assert planned_bytes(moe("qwen3_moe"), config, size) == found.predicted_bytes
    # the routed bytes (2560) fall with the sparsity, met within one neuron (10 bytes)
    assert found.sparsity == pytest.approx(1000 / 2560, abs=10 / 2560)
    assert found.sparsity == round(found.sparsity, 4)


def test_nothing_fits_names_the_smallest_reachable_and_a_target_above_the_model_says_so():
    # at most 6 of 8 experts per layer: 12 x 165 = 1980 bytes can go
    with pytest.raises(
        MoePruneError, match=r"the smallest reachable is 98\.02 kB \(98,020 bytes\)"
    ) as caught:
        solve("qwen3_moe", 50_000)
    assert "top-k" in str(caught.value) and caught.value.options == ("target_size",)
    with pytest.raises(
        MoePruneError, match=r"already fits: 100\.00 kB \(100,000 bytes\).*nothing needs pruning"
    ):
        solve("qwen3_moe", TOTAL)


def test_a_config_gives_a_sparsity_or_a_target_never_both():
    assert check_target_config(PruneConfig("reap", 0.5)) is None
    assert check_target_config(PruneConfig("reap", target_size="1MiB")) == 2**20
    for config in (PruneConfig("reap", 0.5, target_size="1MB"), PruneConfig("reap")):
        with pytest.raises(MoePruneError) as caught:
            check_target_config(config)
        assert caught.value.options == ("sparsity", "target_size")
