"""Per-layer precision without llm-compressor: the fake quantization on hand-computed numbers, the
`auto:` refusals, the reversible swap, the per-layer losses against a physically quantized copy,
the exact choice against brute force, and the bytes against quantize/pricing.py.
(tests/quantize/test_precision_oneshot.py checks the fake quantization against llm-compressor.)"""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

from moeprune.data.loading import CalibrationData, Sample
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.quantize.choice import (
    LayerSwap,
    PrecisionBytes,
    budget_per_scheme,
    check_auto,
    choose_schemes,
    expert_weights,
    measure_losses,
    precision_bytes,
)
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.quantize.schemes import QuantizeOptions
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.surgery.sizes import WeightBytes

pytestmark = pytest.mark.unit


def test_fake_quantization_on_hand_computed_numbers():
    w = torch.tensor([[0.75, -1.5, 0.45, 0.0, 2.0, 1.0, -0.5, 0.1]], dtype=torch.float64)
    # int4, groups of 4: amax 1.5 -> scale 0.2, codes round(3.75, -7.5, 2.25, 0) = 4, -8, 2, 0;
    # amax 2 -> scale 4/15, codes round(7.5, 3.75, -1.875, 0.375) = 8 -> clamped 7, 4, -2, 0
    s = 2.0 / 7.5
    want = torch.tensor([[0.8, -1.6, 0.4, 0.0, 7 * s, 4 * s, -2 * s, 0.0]], dtype=torch.float64)
    assert torch.allclose(fake_quantize(w, "w4a16", 4), want, atol=1e-15)
    # int8, one group of 8: scale 2/127.5
    s8 = 2.0 / 127.5
    assert torch.allclose(fake_quantize(w, "w8a16", 8), torch.round(w / s8).clamp(-128, 127) * s8, atol=1e-15)
    # fp8 per row: scale 2/448; 0.75 / scale = 168, a tie between e4m3's 160 and 176: to even, 160;
    # 0.45 / scale = 100.8 -> 104 (e4m3 steps of 8 in 64..128)
    fp8 = fake_quantize(w, "fp8-dynamic", 128)
    assert float(fp8[0, 0]) == pytest.approx(160 * 2.0 / 448, abs=1e-15) and fp8[0, 4] == 2.0
    assert abs(float(fp8[0, 2]) - 104 * 2.0 / 448) < 1e-15
    zero = fake_quantize(torch.zeros(2, 8), "w4a16", 4)  # zero scale -> eps, weights stay zero
    assert torch.equal(zero, torch.zeros(2, 8))


@pytest.mark.parametrize(
    ("text", "has_data", "says"),
    [
        ("auto:w4a16,int3", True, "unknown quantization scheme 'int3'"),
        ("auto:w4a16", True, "leaves nothing to choose"),
        ("auto:w4a16,nvfp4a16", True, "nvfp4a16 has its own group size"),
        ("auto:w4a16,w4a16", True, "named twice"),
        ("auto:w4a16,w8a16", False, "give data files"),
    ],
)
def test_auto_refusals_in_one_line(text, has_data, says):
    with pytest.raises(MoePruneError, match=says) as error:
        check_auto(text, has_data)
    assert "\n" not in str(error.value)


def test_auto_parses_and_a_single_scheme_is_not_auto():
    assert check_auto("auto:w8a16, w4a16,fp8-dynamic", True) == ("w8a16", "w4a16", "fp8-dynamic")
    assert check_auto("w4a16", False) is None


@pytest.fixture(scope="module")
def moe() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[]))


def test_swap_uses_the_fake_copies_and_restores_the_very_tensors(moe):
    swap = LayerSwap(moe, 16)
    before = {n: p.data_ptr() for n, p in expert_weights(moe, 1).items()}
    clones = {n: p.detach().clone() for n, p in expert_weights(moe, 1).items()}
    with swap.quantized(1, "w4a16"):
        for n, p in expert_weights(moe, 1).items():
            assert torch.equal(p.data, fake_quantize(clones[n], "w4a16", 16))
            assert not torch.equal(p.data, clones[n])
    for n, p in expert_weights(moe, 1).items():
        assert p.data_ptr() == before[n] and torch.equal(p.data, clones[n])


def _data() -> CalibrationData:
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(4):
        ids = torch.randint(3, 90, (12,), generator=g).tolist()
        samples.append(Sample(ids, [False] * 6 + [True] * 6, "mem", False))
    return CalibrationData(samples, "fp", 0, False, ["mem"])


def test_losses_are_the_fitness_drop_of_a_physically_quantized_copy(moe):
    data = _data()
    orders = [list(range(m.num_experts)) for m in moe.layers]
    allocation = (2, 0, 4)
    evaluator = CandidateEvaluator(moe, data, orders, fitness="kl", runtime=SearchRuntime(progress=False))
    full = evaluator.evaluate(allocation)
    losses = measure_losses(evaluator, moe, allocation, ["w4a16", "fp8-dynamic"], 16)
    assert evaluator.evaluate(allocation) == full  # weights restored exactly
    copy_moe = MoEModel(copy.deepcopy(moe.model))  # the teacher is the full-precision model
    plain = CandidateEvaluator(
        copy_moe, data, orders, fitness="kl", runtime=SearchRuntime(progress=False, fast=False)
    )
    for p in expert_weights(copy_moe, 2).values():
        p.data = fake_quantize(p.data, "w4a16", 16)
    assert losses[2]["w4a16"] == pytest.approx(full - plain.evaluate(allocation), rel=1e-4, abs=1e-7)
    assert all(row[s] != 0 for row in losses for s in row)  # every swap changed the candidate


def test_choice_is_exact_against_brute_force():
    rng = random.Random(3)
    schemes = ("w4a16", "w8a16", "fp8-dynamic")
    for _ in range(20):
        layers = tuple({s: rng.randint(10, 40) for s in schemes} for _ in range(5))
        losses = [{s: rng.random() for s in schemes} for _ in range(5)]
        bytes_ = PrecisionBytes(100, layers)
        budget = rng.randint(100 + 60, 100 + 190)
        fits = [c for c in itertools.product(schemes, repeat=5) if bytes_.total(c) <= budget]
        if not fits:
            with pytest.raises(MoePruneError, match="no per-layer choice fits"):
                choose_schemes(bytes_, losses, budget)
            continue
        best = min(sum(loss[s] for loss, s in zip(losses, c)) for c in fits)
        got = choose_schemes(bytes_, losses, budget)
        assert bytes_.total(got) <= budget
        assert sum(loss[s] for loss, s in zip(losses, got)) == pytest.approx(best, abs=1e-12)


def test_choice_on_a_hand_built_table_is_the_known_optimum():
    """Three layers, fixed 100 bytes, every layer 10 bytes in w4a16; upgrading to w8a16 costs 20
    (layer 0, loss 1.0 -> 0) or 11 (layers 1 and 2, loss 0.6 -> 0). Under 150 bytes (20 to spend)
    the best is layer 0 alone (loss 1.2), not the better gain per byte of layer 1 (loss 1.6, what a
    greedy choice by gain per byte takes); under 152, layers 1 and 2 (loss 1.0, 152 bytes)."""
    bytes_ = PrecisionBytes(
        100,
        ({"w4a16": 10, "w8a16": 30}, {"w4a16": 10, "w8a16": 21}, {"w4a16": 10, "w8a16": 21}),
    )
    losses = [{"w4a16": 1.0, "w8a16": 0.0}, {"w4a16": 0.6, "w8a16": 0.0}, {"w4a16": 0.6, "w8a16": 0.0}]
    assert choose_schemes(bytes_, losses, 150) == ["w8a16", "w4a16", "w4a16"]
    assert choose_schemes(bytes_, losses, 152) == ["w4a16", "w8a16", "w8a16"]
    assert choose_schemes(bytes_, losses, 130) == ["w4a16"] * 3
    assert choose_schemes(bytes_, losses, 10**6) == ["w8a16"] * 3
    with pytest.raises(MoePruneError, match="no per-layer choice fits 129 bytes: the smallest weighs 130"):
        choose_schemes(bytes_, losses, 129)


def test_bytes_with_one_scheme_everywhere_are_the_uniform_prediction(moe):
    size = _full_size(moe)
    layers = size.layers
    options = QuantizeOptions("w8a16", "rtn", 16)
    schemes = ["w8a16", "w4a16", "fp8-dynamic"]
    pb = precision_bytes(size, moe, schemes, options, 4, [0] * len(layers))
    for s, total in budget_per_scheme(pb, schemes).items():
        uniform = quantized_weight_bytes(size, moe, QuantizeOptions(s, "rtn", 16), 4)
        if s == "w8a16":
            assert total == uniform.total
        else:  # only the experts change scheme: the difference is theirs
            expert = sum(lay.experts * lay.expert() for lay in uniform.layers)
            base = quantized_weight_bytes(size, moe, options, 4)
            assert total == base.total - sum(lay.experts * lay.expert() for lay in base.layers) + expert
    removed = precision_bytes(size, moe, schemes, options, 4, [2, 0, 0])
    layer = quantized_weight_bytes(size, moe, options, 4).layers[0]
    assert pb.total(schemes[:1] * 3) - removed.total(schemes[:1] * 3) == 2 * (
        layer.expert() + layer.router_row
    )


def _full_size(moe: MoEModel) -> WeightBytes:
    from moeprune.surgery.sizes import LayerBytes

    hidden = moe.layers[0].hidden_size
    width = moe.layers[0].experts.down_proj.shape[-1]
    layers = tuple(LayerBytes(m.num_experts, width, 3 * hidden * 4, 0, hidden * 4) for m in moe.layers)
    return WeightBytes("float32", 10_000 + sum(lay.experts * lay.expert() for lay in layers), layers, 0)


def test_losses_scored_after_the_surgery_are_the_masked_ones_before():
    """prune's per-layer precision keeps the unpruned model's teacher (built before the surgery)
    and scores the physically pruned model: the same losses as `measure_losses` on the unpruned
    model with the plan's experts masked (the evo search's view)."""
    from moeprune.api import prune
    from moeprune.config import PruneConfig
    from moeprune.quantize.per_layer import PrecisionTarget, choose_precision, precision_teacher

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[])
    reference = MoEModel(copy.deepcopy(model))
    data, config = _data(), PruneConfig("frequency", 0.25)
    teacher = precision_teacher(MoEModel(model), data, config, 8, 0, False)
    plan = prune(model, config, data=data, run=None).plan
    schemes = ("w4a16", "w8a16")
    options = QuantizeOptions("w4a16", "rtn", 16, candidates=schemes)
    size = _full_size(reference)
    target = PrecisionTarget(schemes, 10**9, size, 4, {})
    chosen, doc = choose_precision(teacher, MoEModel(model), reference, plan, options, target)
    orders = [lp.dropped + lp.kept for lp in plan.layers]
    masked = CandidateEvaluator(
        reference, data, orders, fitness="esap", runtime=SearchRuntime(progress=False, fast=False)
    )
    want = measure_losses(masked, reference, [len(lp.dropped) for lp in plan.layers], schemes, 16)
    for layer, row in zip(("0", "1", "2"), want):
        for s in schemes:
            assert doc["losses"][layer][s] == pytest.approx(row[s], rel=1e-4, abs=1e-7), (layer, s)
    # under an unlimited budget each layer takes its least lossy scheme
    assert chosen.layer_schemes == {int(k): min(row, key=row.__getitem__) for k, row in doc["losses"].items()}


def test_the_joint_choice_scores_each_grid_point_with_every_chosen_layer_quantized(moe):
    """`choose_sparsity` (no --sparsity): per grid point, the uniform split in the criterion's
    order, the schemes chosen under the target, and the fitness with all of them fake-quantized at
    once: equal to a plain evaluator's on a copy quantized by hand; the best point is returned."""
    from moeprune.config import PruneConfig
    from moeprune.quantize.grid import choose_sparsity, uniform_split

    data, config = _data(), PruneConfig("frequency", 0.25)
    orders = [list(range(m.num_experts))[::-1] for m in moe.layers]  # any fixed order
    evaluator = CandidateEvaluator(moe, data, orders, fitness="kl", runtime=SearchRuntime(progress=False, fast=False))
    schemes = ("w4a16", "w8a16")
    options = QuantizeOptions("w4a16", "rtn", 16, candidates=schemes)
    size = _full_size(moe)
    pb = precision_bytes(size, moe, schemes, options, 4, [0, 0, 0])
    target = pb.total(["w4a16", "w8a16", "w4a16"])  # room for some w8a16 once experts are removed
    best, rows = choose_sparsity(evaluator, moe, config, options, [0.25, 0.5], size, 4, target)
    assert [r["sparsity"] for r in rows] == [0.25, 0.5]
    for row in rows:
        removed = uniform_split(moe, config, row["sparsity"])
        assert list(row["removed_per_layer"].values()) == removed
        assert row["predicted_bytes"] <= target
        copy_moe = MoEModel(copy.deepcopy(moe.model))  # its teacher pass first: the full-precision model
        plain = CandidateEvaluator(copy_moe, data, orders, fitness="kl", runtime=SearchRuntime(progress=False, fast=False))
        for position, scheme in enumerate(row["chosen"].values()):
            for p in expert_weights(copy_moe, position).values():
                p.data = fake_quantize(p.data, scheme, 16)
        assert row["fitness"] == pytest.approx(plain.evaluate(removed), rel=1e-5, abs=1e-8)
    assert best == max(rows, key=lambda r: r["fitness"])["sparsity"]
    assert "w8a16" in rows[-1]["chosen"].values()  # removing experts bought bits
