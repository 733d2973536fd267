"""moeprune's own checkpoint format: non-uniform results reload with identical logits."""

from __future__ import annotations

import json

import pytest
import torch

import moeprune
from helpers import assert_logits_close
from moeprune.checkpoint import is_moeprune_format
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.surgery import drop_experts

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def non_uniform_removal(moe: MoEModel) -> dict[int, list[int]]:
    removed = {}
    for j, layer in enumerate(moe.layers):
        if layer.n_group > 1:  # whole groups-balanced steps: 0 in the first layer, 1 per group after
            size = layer.num_experts // layer.n_group
            removed[layer.index] = [] if j == 0 else [g * size for g in range(layer.n_group)]
        else:
            removed[layer.index] = [0, 5, 6][: 1 + j % 3]
    return removed


@pytest.mark.parametrize("family", supported_families())
def test_non_uniform_save_and_load_pretrained_identical_logits(family, tmp_path):
    model = tiny_model(family)
    moe = MoEModel(model)
    drop_experts(moe, non_uniform_removal(moe))
    assert not moe.is_uniform()
    with torch.no_grad():
        before = model(TOKENS).logits
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    assert is_moeprune_format(tmp_path)
    reloaded = moeprune.load_pretrained(tmp_path)
    with torch.no_grad():
        after = reloaded(TOKENS).logits
    assert_logits_close(after, before)
    for a, b in zip(MoEModel(reloaded).layers, moe.layers):
        assert a.num_experts == b.num_experts and a.expert_ids == b.expert_ids


def test_uniform_results_stay_stock(tmp_path):
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    drop_experts(moe, {m.index: [2, 3] for m in moe.layers})
    assert moeprune.save_pretrained(model, tmp_path) == "stock"
    assert not is_moeprune_format(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(moeprune.load_pretrained(tmp_path)(TOKENS).logits, model(TOKENS).logits)


def test_unknown_format_version_is_refused(tmp_path):
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    drop_experts(moe, non_uniform_removal(moe))
    moeprune.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["moeprune"]["format_version"] = 99
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoePruneError, match="upgrade moeprune"):
        moeprune.load_pretrained(tmp_path)


def test_tied_embeddings_reload_in_moeprune_format(tmp_path):
    model = tiny_model("qwen3_moe", tie_word_embeddings=True)
    moe = MoEModel(model)
    drop_experts(moe, non_uniform_removal(moe))
    moeprune.save_pretrained(model, tmp_path)
    reloaded = moeprune.load_pretrained(tmp_path)
    with torch.no_grad():
        assert_logits_close(reloaded(TOKENS).logits, model(TOKENS).logits)
