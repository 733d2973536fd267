"""LongCat-Flash as released: the weighted experts' tensors only (the zero experts have router rows
and no weights), and a dense multi-token-prediction layer under `model.mtp.*`. Both pipelines
prune the weighted experts only, keep the zero experts' router rows after the kept ones, keep the
MTP layer as stored in a stock result (left out, saying so, with per-layer counts), and the result
reloads to the masked original's logits. transformers cannot load the release itself (it sizes
gate_up_proj for the zero experts too); moeprune loads it (`checkpoint/zero_rows.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tests.helpers import assert_logits_close, fixed_logits, run_cli, stored_tensors
from tests.release_layouts import longcat_mtp_keys, write_longcat_release

import moeprune
from moeprune.models import MoEModel, supported_families
from moeprune.models.reshape import drop_experts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(
        "longcat_flash" not in supported_families(), reason="longcat_flash not supported here"
    ),
]
SPARSITY = {"uniform": "0.25", "global": "0.4"}  # global: 13 of 32 experts, no count divides it
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_longcat_release(tmp_path_factory.mktemp("longcat") / "release")


def test_the_release_loads_with_only_its_weighted_experts_stored(release):
    stored = stored_tensors(release)
    assert max(int(m.group(1)) for k in stored if (m := _EXPERT.search(k))) == 7  # experts 0-7 of 8
    assert stored["model.layers.0.mlp.router.classifier.weight"].shape[0] == 10  # 8 weighted + 2 zero
    model = moeprune.load_pretrained(release)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 10 and not experts.gate_up_proj[8:].any()  # never computed
    gate, up = (stored[f"model.layers.0.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(experts.gate_up_proj[3], torch.cat([gate, up]))


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_release_prunes_its_weighted_experts_and_keeps_its_mtp_layer(release, tmp_path, allocation, no_load):
    out = tmp_path / "out"
    run_cli("prune", release, "--output", out, "--criterion", "aimer", "--sparsity", SPARSITY[allocation],
            "--allocation", allocation, "--quiet", *(["--no-load"] if no_load else []))  # fmt: skip
    plan = json.loads((out / "plan.json").read_text())
    counts = [len(lp["kept"]) for lp in plan["layers"]]
    assert sum(8 - c for c in counts) == round(float(SPARSITY[allocation]) * 32)
    assert (len(set(counts)) == 1) is (allocation == "uniform")
    before, after = moeprune.load_pretrained(release).state_dict(), moeprune.load_pretrained(out).state_dict()
    for lp in plan["layers"]:
        prefix, rows = f"model.layers.{lp['layer']}.mlp.", [*lp["kept"], 8, 9]  # the zero experts' rows last
        for name in ("router.classifier.weight", "router.e_score_correction_bias", "experts.gate_up_proj"):
            assert torch.equal(after[prefix + name], before[prefix + name][rows]), name
        assert torch.equal(
            after[prefix + "experts.down_proj"], before[prefix + "experts.down_proj"][lp["kept"]]
        )
    if (
        no_load and allocation == "uniform"
    ):  # a stock rewrite stores what the release does: weighted experts only
        written = {int(m.group(1)) for k in stored_tensors(out) if (m := _EXPERT.search(k))}
        assert written == set(range(max(counts)))
    mtp_before, mtp_after = longcat_mtp_keys(release), longcat_mtp_keys(out)
    notes = json.loads((out / "report.json").read_text())["release_layers"]
    # stock or moeprune's format (per-layer counts): the dense MTP layer kept as stored
    assert mtp_after.keys() == mtp_before.keys() and len(mtp_before) == 17
    assert all(torch.equal(mtp_after[k], v) for k, v in mtp_before.items())
    assert notes[0].startswith(
        "1 multi-token-prediction layer (model.mtp.layers.0.*) kept as stored (no routed experts)"
    )
    original = moeprune.load_pretrained(release)
    drop_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in plan["layers"]})
    assert_logits_close(fixed_logits(moeprune.load_pretrained(out)), fixed_logits(original))
