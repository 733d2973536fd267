"""`--no-load` on the families whose layers are not all alike: DeepSeek-V4's hash-routed layers
(kept whole, every tensor copied as stored) and LongCat-Flash's zero experts (routed, never pruned
or counted: only the weighted experts' tensors and router rows are cut, the zero experts' rows kept
after them). The rewrite of the input's bytes must equal what the in-memory pipeline saves for the
same plan, tensor for tensor, with one count in every layer or different counts (the global
allocation, and every DeepSeek-V4 result: its hash layers keep all their experts)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tests.helpers import assert_logits_close, fixed_logits, run_cli, stored_tensors

import moeprune
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]

FAMILIES = [
    pytest.param(f, marks=pytest.mark.skipif(f not in supported_families(), reason=f"{f} not supported here"))
    for f in ("deepseek_v4", "longcat_flash")
]


def _model(family: str) -> torch.nn.Module:
    """A tiny model of `family`: DeepSeek-V4 with one hash layer whose table sends tokens to two
    distinct experts, LongCat-Flash with its zero experts made popular (tokens really reach them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "deepseek_v4":
            model = tiny_model(family, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_hidden_layers=4)
        else:
            model = tiny_model(family)
    moe = MoEModel(model)
    generator = torch.Generator().manual_seed(1)
    for layer in moe.fixed_layers:
        table = layer.router.tid2eid
        table.copy_(
            torch.stack(
                [torch.randperm(layer.num_experts, generator=generator)[: table.shape[1]] for _ in table]
            )
        )
    if moe.spec.extra_routed:
        for layer in moe.layers:
            layer.router.e_score_correction_bias[layer.num_experts :] += 0.3
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("special")
    out = {}
    for param in FAMILIES:
        family = param.values[0]
        if family in supported_families():
            _model(family).save_pretrained(root / family)
            out[family] = root / family
    return out


SPARSITY = {"uniform": "0.25", "global": "0.4"}  # global: a budget no count divides evenly


def _prune(source: Path, out: Path, allocation: str, no_load: bool) -> dict:
    run_cli(
        "prune", source, "--output", out, "--criterion", "aimer", "--sparsity", SPARSITY[allocation],
        "--allocation", allocation, "--quiet", *(["--no-load"] if no_load else []),
    )  # fmt: skip
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("allocation", ["uniform", "global"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_load_equals_in_memory_tensor_for_tensor(checkpoints, tmp_path, family, allocation):
    source = checkpoints[family]
    memory = _prune(source, tmp_path / "memory", allocation, no_load=False)
    streamed = _prune(source, tmp_path / "streamed", allocation, no_load=True)
    assert [lp["kept"] for lp in streamed["layers"]] == [lp["kept"] for lp in memory["layers"]]
    moe = MoEModel(moeprune.load_pretrained(source))
    for lp, layer in zip(streamed["layers"], moe.layers):
        if layer.fixed:  # the hash layer keeps every expert; the budget went to the others
            assert (
                lp["kept"] == list(range(8))
                and streamed["extra"]["kept_whole"] == memory["extra"]["kept_whole"]
            )
    assert sum(len(lp["dropped"]) for lp in streamed["layers"]) == round(
        float(SPARSITY[allocation]) * 8 * (len(moe.layers) - len(moe.fixed_layers))
    )
    uniform = len({len(lp["kept"]) for lp in streamed["layers"]}) == 1
    assert uniform is (allocation == "uniform" and not moe.fixed_layers)  # both kinds of result are tested
    report = json.loads((tmp_path / "streamed" / "report.json").read_text())
    assert report["format"] == ("stock" if uniform else "moeprune")
    # the same model: every parameter and buffer equal (moeprune's format in memory names tensors
    # as the model does, the rewrite keeps the input's names: both load to the same state)
    got = moeprune.load_pretrained(tmp_path / "streamed").state_dict()
    want = moeprune.load_pretrained(tmp_path / "memory").state_dict()
    assert sorted(got) == sorted(want)
    for key, tensor in got.items():
        assert tensor.dtype == want[key].dtype and torch.equal(tensor, want[key]), key
    if uniform:  # a stock checkpoint both ways: the very same stored tensors
        expected = stored_tensors(tmp_path / "memory")
        assert {k: v.shape for k, v in stored_tensors(tmp_path / "streamed").items()} == {
            k: v.shape for k, v in expected.items()
        }
    before = moeprune.load_pretrained(source).state_dict()
    for lp, layer in zip(streamed["layers"], moe.layers):
        prefix = f"model.layers.{layer.index}."
        if layer.fixed:  # every tensor of a hash layer is the input's, its token table included
            mine = {k: v for k, v in before.items() if k.startswith(prefix)}
            assert any(k.endswith("tid2eid") for k in mine)
            assert all(torch.equal(got[k], v) for k, v in mine.items())
        if layer.spec.extra_routed:  # the router keeps the kept weighted rows, then the zero experts'
            rows = lp["kept"] + list(range(8, 8 + layer.spec.extra_experts))
            for name in ("mlp.router.classifier.weight", "mlp.router.e_score_correction_bias"):
                assert torch.equal(got[prefix + name], before[prefix + name][rows]), name
            experts = "mlp.experts.gate_up_proj"  # its zero experts' rows too (never computed)
            assert torch.equal(got[prefix + experts], before[prefix + experts][rows])
    original = moeprune.load_pretrained(source)
    drop_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in streamed["layers"]})
    assert_logits_close(fixed_logits(moeprune.load_pretrained(tmp_path / "streamed")), fixed_logits(original))
