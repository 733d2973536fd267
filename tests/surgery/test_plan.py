"""The Plan object: validation, JSON round trip, atomic save, uniformity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeprune.errors import MoePruneError
from moeprune.plan import LayerPlan, ModelShape, Plan

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute


SHAPE = ModelShape(model_type="olmoe", layers=[0, 1, 3], num_experts=[8, 8, 8], top_k=[2, 2, 2])


def _plan(**overrides) -> Plan:
    args = {
        "removals": [[5, 1], [0], [7, 6]],
        "criterion": "reap",
        "allocation": "global",
        "sparsity": 5 / 24,
        "data_fingerprint": "abc123",
    }
    return Plan.from_removals(SHAPE, **{**args, **overrides})


def _neuron_plan(widths: dict[int, int] | None = None) -> Plan:
    layers = [
        LayerPlan(layer=i, num_experts=4, top_k=2, kept=[0, 1, 2, 3], neurons=dict(widths or {}))
        for i in (0, 1)
    ]
    return Plan.create(
        model_type="qwen3_moe",
        layers=layers,
        criterion="tenp",
        allocation="trapezoid",
        method="tenp",
        sparsity=0.0,
    )


def test_from_removals_builds_partitions_and_versions():
    plan = _plan()
    assert plan.layer(0).kept == [0, 2, 3, 4, 6, 7]
    assert plan.layer(0).dropped == [1, 5]
    assert plan.layer(3).kept == list(range(6))
    assert plan.removed_per_layer() == [2, 1, 2]
    assert set(plan.versions) == {"moeprune", "torch", "transformers"}
    novice = _plan(method="novice", novices=True)
    assert novice.layer(0).kept == list(range(8)) and novice.layer(0).novice == [1, 5]
    assert novice.removed_per_layer() == [2, 1, 2]
    with pytest.raises(MoePruneError, match="plan method must name the method"):
        _plan(method="")
    with pytest.raises(MoePruneError, match="no MoE layer 2; it covers layers \\[0, 1, 3\\]"):
        plan.layer(2)


def test_from_removals_takes_the_shape_first_or_by_keyword():
    args = {"removals": [[5, 1], [0], [7, 6]], "criterion": "reap", "allocation": "global", "sparsity": 5 / 24}
    assert Plan.from_removals(shape=SHAPE, **args, data_fingerprint="abc123") == _plan()
    with pytest.raises(TypeError, match="shape"):
        Plan.from_removals(**args)


def test_round_trip(tmp_path):
    plan = _plan(removals=[[np.int64(5), 1], [0], []])
    plan.extra = {"search": {"best": np.float64(0.93), "history": [1, 2]}}
    again = Plan.from_json(plan.to_json())
    assert again == plan
    data = json.loads(plan.to_json())
    assert data["format"] == "moeprune-plan" and data["format_version"] == 1

    neurons = _neuron_plan({0: 16, 2: 8})
    neurons.layers[0].dropped, neurons.layers[0].kept = [3], [0, 1, 2]
    loaded = Plan.load(neurons.save(tmp_path / "sub" / "plan.json"))
    assert loaded == neurons
    assert loaded.layers[0].neurons == {0: 16, 2: 8}  # int keys again after JSON's strings
    assert json.loads((tmp_path / "sub" / "plan.json").read_text())["layers"][0]["neurons"] == {
        "0": 16,
        "2": 8,
    }


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    bad = _plan()
    bad.layers[0].kept.append(1)  # overlap: save refuses before writing
    with pytest.raises(MoePruneError):
        bad.save(path)
    assert Plan.load(path) == _plan()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def _broken(change) -> Plan:
    plan = _plan()
    change(plan.layers[1])
    return plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda lp: lp.kept.insert(0, 0) or lp.kept.sort(),
            "layer 1: experts \\[0\\] are both kept and dropped",
        ),
        (lambda lp: lp.kept.remove(7), "layer 1: kept and dropped must partition .* missing \\[7\\]"),
        (lambda lp: lp.dropped.append(9), "out of range \\[9\\]"),
        (lambda lp: lp.kept.reverse(), "ascending"),
        (
            lambda lp: setattr(lp, "kept", [7]) or setattr(lp, "dropped", [0, 1, 2, 3, 4, 5, 6]),
            "keeps 1 experts, fewer than top_k 2",
        ),
        (lambda lp: setattr(lp, "kept", [1, 1, 2, 3, 4, 5, 6, 7]), "twice"),
        (lambda lp: setattr(lp, "top_k", 0), "top_k 0"),
        (lambda lp: setattr(lp, "top_k", "2"), "top_k must be an integer"),
        (lambda lp: setattr(lp, "novice", [0]), "novice experts \\[0\\] are not kept"),
        (lambda lp: setattr(lp, "neurons", {0: 4}), "neurons given for experts \\[0\\]"),
    ],
)
def test_validation_errors(change, message):
    with pytest.raises(MoePruneError, match=message):
        _broken(change).validate()


def test_plan_level_validation():
    plan = _plan()
    plan.method = ""
    with pytest.raises(MoePruneError, match="method"):
        plan.validate()
    plan = _plan()
    plan.layers = plan.layers[::-1]
    with pytest.raises(MoePruneError, match="ascending"):
        plan.validate()
    plan = _plan()
    plan.sparsity = 1.0
    with pytest.raises(MoePruneError, match="sparsity"):
        plan.validate()


def test_neuron_validation_with_intermediate_sizes():
    plan = _neuron_plan({0: 16, 1: 32})
    plan.validate({0: 32, 1: 32})
    with pytest.raises(
        MoePruneError, match="layer 1: expert 1 keeps 32 neurons; must be an integer in \\[1, 16\\]"
    ):
        plan.validate({0: 32, 1: 16})
    plan.layers[0].neurons[2] = 0
    with pytest.raises(MoePruneError, match="layer 0: expert 2 keeps 0"):
        plan.validate()
    plan.layers[0].neurons[2] = 1
    plan.layers[0].novice = [2]
    with pytest.raises(MoePruneError, match="not kept whole experts"):
        plan.validate()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"format": "something-else", "format_version": 1}', "'format' field"),
        ("[1, 2]", "'format' field"),
        ('{"format": "moeprune-plan", "format_version": 2}', "format_version 2"),
        ('{"format": "moeprune-plan", "format_version": 1, "model_type": "x"}', "malformed"),
    ],
)
def test_bad_format(text, message):
    with pytest.raises(MoePruneError, match=message):
        Plan.from_json(text)


def test_load_missing_file(tmp_path):
    with pytest.raises(MoePruneError, match="cannot read plan file"):
        Plan.load(tmp_path / "absent.json")


def test_is_uniform():
    assert _plan(removals=[[0, 1], [2, 3], [4, 5]]).is_uniform()
    assert not _plan().is_uniform()  # kept 6, 7, 6
    assert not _plan(removals=[[0], [1], [2]], method="novice", novices=True).is_uniform()
    assert _neuron_plan().is_uniform()
    assert _neuron_plan({e: 8 for e in range(4)}).is_uniform()
    assert not _neuron_plan({0: 8}).is_uniform()  # others keep every neuron
    assert not _neuron_plan({0: 8, 1: 8, 2: 8, 3: 4}).is_uniform()
