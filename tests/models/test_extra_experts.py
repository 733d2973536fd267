"""Zero / identity / null experts beside the weighted ones (LongCat-Flash, Inkling).

LongCat-Flash's router scores `n_routed_experts` weighted experts and `zero_expert_num` zero
(identity) experts after them, and selects among all of them; Inkling's router scores its shared
experts after the routed ones (a sink, never selected). Only the weighted experts are experts to
moeprune: counted, scored, pruned. The extra rows stay routed, after the kept weighted rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moeprune
from helpers import assert_logits_close, stock_from_pretrained
from moeprune.data.loading import CalibrationData, Sample
from moeprune.models import MoEModel, supported_families
from moeprune.models.adapter import get_path
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts, mask_experts
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.observe.observer import observe

pytestmark = pytest.mark.integration

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
# family -> (extra experts, the router selects them, router matrix path, config field of the zero experts)
EXTRA = {
    "longcat_flash": (2, True, "classifier.weight", "zero_expert_num"),
    "inkling_text": (1, False, "weight", None),
}
FAMILIES = [  # those this transformers has and moeprune supports in it (5.16's LongCat router differs)
    pytest.param(f, marks=pytest.mark.skipif(f not in supported_families(), reason=f"{f} not supported here"))
    for f in EXTRA
]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def model_of(family: str):
    """The tiny model, its zero experts made popular (LongCat) so that tokens really reach them."""
    model = tiny_model(family)
    moe = MoEModel(model)
    if moe.spec.extra_routed:
        for layer in moe.layers:
            bias = layer.router.e_score_correction_bias
            bias[layer.num_experts :] += 1.0  # softmax scores are < 1: every token picks a zero expert
    return model, moe


def routed_indices(moe: MoEModel) -> dict[int, torch.Tensor]:
    """The indices every router hands its experts in one forward."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        layer.experts.register_forward_hook(lambda m, args, out, i=layer.index: seen.__setitem__(i, args[1]))
        for layer in moe.layers
    ]
    logits(moe.model)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_discovery_counts_only_the_weighted_experts(family):
    extra, routed, weight_path, zero_field = EXTRA[family]
    model, moe = model_of(family)
    assert moe.spec.extra_experts == extra and moe.spec.extra_routed is routed
    assert moe.spec.router_tensors[0] == (weight_path, 0)
    for layer in moe.layers:
        assert layer.num_experts == 8 and layer.expert_ids == list(range(8))
        assert layer.router.get_parameter(weight_path).shape[0] == 8 + extra
    assert getattr(moe.config, moe.spec.count_field) == 8
    if routed:  # the router really selects the zero experts
        assert all(bool((i >= 8).any()) for i in routed_indices(moe).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_router_rows_after_pruning_are_the_kept_weighted_then_the_extra_rows(family):
    extra, routed, weight_path, zero_field = EXTRA[family]
    model, moe = model_of(family)
    before = {
        layer.index: {
            p: get_path(layer.router, p)  # a parameter or a buffer, as the transformers release has it
            for p, _ in moe.spec.router_tensors
        }
        for layer in moe.layers
    }
    before = {i: {p: t.detach().clone() for p, t in ts.items()} for i, ts in before.items()}
    zero_count = getattr(moe.config, zero_field) if zero_field else None
    drop_experts(moe, {layer.index: [1, 6] for layer in moe.layers})
    kept = [0, 2, 3, 4, 5, 7]
    for layer in moe.layers:
        assert layer.num_experts == 6 and layer.expert_ids == kept
        for path, tensor in before[layer.index].items():
            now = get_path(layer.router, path)
            expected = tensor[kept + list(range(8, tensor.shape[0]))]  # extra rows untouched, last
            assert torch.equal(now, expected), path
    assert getattr(moe.config, moe.spec.count_field) == 6
    if zero_field:
        assert getattr(moe.config, zero_field) == zero_count  # the zero experts' count is unchanged
        layer = moe.layers[0]
        assert layer.router.n_routed_experts == 6 + extra and layer.experts.total_experts == 6 + extra
        assert layer.experts.gate_up_proj.shape[0] == 6 + extra and layer.experts.down_proj.shape[0] == 6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("uniform", [True, False])
def test_mask_equals_surgery_and_saved_results_reload_equal(family, uniform, tmp_path):
    model, moe = model_of(family)
    removed = {layer.index: ([1, 6] if uniform or j else [1, 3, 6]) for j, layer in enumerate(moe.layers)}
    full = logits(model)
    with mask_experts(moe, removed):
        masked = logits(model)
    assert (masked - full).abs().max() > 1e-4
    pruned = copy.deepcopy(model)
    drop_experts(MoEModel(pruned), removed)
    assert_logits_close(logits(pruned), masked)
    form = moeprune.save_pretrained(pruned, tmp_path)
    assert form == ("stock" if uniform else "moeprune")
    reloaded = stock_from_pretrained(tmp_path) if uniform else moeprune.load_pretrained(tmp_path)
    assert_logits_close(logits(reloaded), masked)
    if not uniform:
        import json

        record = json.loads((tmp_path / "config.json").read_text())["moeprune"]["family"]
        assert record["extra_experts"] == EXTRA[family][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_observation_never_attributes_extra_expert_tokens_to_weighted_experts(family):
    model, moe = model_of(family)
    indices = routed_indices(moe)
    weighted = {i: torch.bincount(t[t < 8].flatten(), minlength=8).double() for i, t in indices.items()}
    seen: dict[int, list[int]] = {}
    with override_routed(
        moe,
        RoutedOptions(on_layer=lambda layer, r: seen.setdefault(layer.index, []).extend(r.experts.tolist())),
    ):
        with_recording = logits(model)
    assert_logits_close(
        with_recording, logits(model)
    )  # the extra experts still ran, as the family's code does
    for i, ids in seen.items():
        assert max(ids) < 8 and len(ids) == int(weighted[i].sum())
    samples = [
        Sample(input_ids=row.tolist(), answer_mask=[True] * len(row), source="t", truncated=False)
        for row in TOKENS
    ]
    data = CalibrationData(samples=samples, fingerprint="t", truncated=0, text_only=True, sources=["t"])
    stats = observe(moe, data, batch_size=2, progress=False)
    for layer_stats in stats.layers:
        assert layer_stats.num_experts == 8
        assert torch.equal(
            layer_stats.count, weighted[layer_stats.layer]
        )  # frequency of weighted experts, exact


def test_streaming_maps_the_zero_experts_rows_apart(tmp_path):
    """transformers sizes LongCat's gate_up_proj for the zero experts too (rows it never computes)
    and saves them as experts 8 and 9 (gate and up, no down): the checkpoint layout reads them as
    those rows, not as weighted experts; the rewrite keeps them after the kept weighted experts
    (tests/shards/test_no_load_special_layers.py)."""
    if "longcat_flash" not in supported_families():
        pytest.skip("longcat_flash not supported here")
    model, moe = model_of("longcat_flash")
    moeprune.save_pretrained(model, tmp_path)
    from moeprune.shards.layout import CheckpointLayout

    layout = CheckpointLayout(tmp_path)
    layer = layout.layers[0]
    assert layer.num_experts == 8
    gate_up, down = layer.experts["gate_up_proj"], layer.experts["down_proj"]
    assert (gate_up.extra_rows, gate_up.extra_stored) == (2, 2) and sorted(gate_up.parts) == list(range(10))
    assert (down.extra_rows, down.extra_stored) == (0, 0) and sorted(down.parts) == list(range(8))
    assert {path: layout.tensors[key].shape for path, (key, _) in layer.router.items()} == {
        "router.classifier.weight": (10, 32),
        "router.e_score_correction_bias": (10,),
    }
