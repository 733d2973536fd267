"""Saving and loading: the on-disk layout (names, dtype, shards, format versions) and exact reloads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close
from moeprune.checkpoint import is_moeprune_format
from moeprune.checkpoint.names import block_prefix, disk_tensors
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.packed import expert_tensor_names
from moeprune.models.reshape import drop_experts

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def non_uniform_removal(moe: MoEModel) -> dict[int, list[int]]:
    removed = {}
    for j, layer in enumerate(moe.layers):
        if layer.fixed:  # kept whole (hash routing): nothing may take its experts
            removed[layer.index] = []
        elif layer.n_group > 1:  # whole groups-balanced steps: 0 in the first layer, 1 per group after
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


def _packed(model) -> None:
    """Novices and per-expert widths in every MoE layer (what MoNE and TENP results hold)."""
    from moeprune.models.packed import pack_layer

    for layer in MoEModel(model).layers:
        width = layer.intermediate_size
        pack_layer(
            layer,
            {1: torch.randn(layer.hidden_size)},
            {0: torch.tensor([0, 2, 5]), 3: torch.arange(width // 2)},
        )


@pytest.mark.parametrize("family", supported_families())
def test_disk_names_are_what_save_pretrained_writes(family, tmp_path):
    """Stock layout on disk: every family's names, shapes and values equal save_pretrained's."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    ours = {k: v.detach() for k, v in disk_tensors(MoEModel(model), stock=True).items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("family", supported_families())
def test_packed_results_keep_familiar_names_and_reload(family, tmp_path):
    """Novices and per-expert widths: one tensor per router position, under the family's names."""
    model = tiny_model(family)
    native = expert_tensor_names(MoEModel(model).layers[0])  # fused families store these per position
    _packed(model)
    with torch.no_grad():
        before = model(TOKENS).logits
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    names = set(load_file(tmp_path / "model.safetensors"))
    moe = MoEModel(model)
    block = block_prefix(moe, moe.layers[0])
    assert f"{block}.experts.1.mean_output" in names  # the novice
    expert = moe.spec.disk_expert_names or native
    suffix = ".weight" if moe.spec.disk_expert_names else ""
    assert f"{block}.experts.0.{expert[0]}{suffix}" in names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"moeprune_{family}" and config["moeprune"]["format_version"] == 3
    layer = config["moeprune"]["layers"][0]
    assert layer["novice"] == [1] and layer["widths"][0] == 3 and layer["widths"][1] is None
    assert_logits_close(moeprune.load_pretrained(tmp_path)(TOKENS).logits, before)


@pytest.mark.parametrize("form", ["stock", "moeprune"])
def test_sharded_saves_reload_identically(form, tmp_path):
    model = tiny_model("qwen3_moe")
    moe = MoEModel(model)
    if form == "moeprune":
        drop_experts(moe, non_uniform_removal(moe))
    with torch.no_grad():
        before = model(TOKENS).logits
    assert moeprune.save_pretrained(model, tmp_path, max_shard_size="20KB") == form
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / s).stat().st_size <= 20_000 + 2_000 for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    assert_logits_close(moeprune.load_pretrained(tmp_path)(TOKENS).logits, before)
    if form == "stock":  # transformers reads the shards too
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert_logits_close(reloaded(TOKENS).logits, before)


@pytest.mark.parametrize("form", ["stock", "moeprune"])
def test_saved_dtype_is_asked_for_and_weights_shrink(form, tmp_path):
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    drop_experts(moe, non_uniform_removal(moe) if form == "moeprune" else {m.index: [0] for m in moe.layers})
    moeprune.save_pretrained(model, tmp_path / "fp32")
    moeprune.save_pretrained(model, tmp_path / "bf16", dtype="bf16")
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16")}
    assert size["bf16"] < 0.55 * size["fp32"]  # half the bytes, plus the same JSON header
    reloaded = moeprune.load_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    with torch.no_grad():  # bf16 rounding of weights and activations: a coarse but real check
        assert_logits_close(reloaded(TOKENS).logits.float(), model(TOKENS).logits, rtol=0.1)


def _write_legacy(model, folder, version: int) -> None:
    """moeprune's format versions 1 and 2: internal names in one model.safetensors + moeprune.json."""
    from safetensors.torch import save_model

    from moeprune.models.packed import is_packed, packed_structure, router_count

    moe = MoEModel(model)
    config = model.config
    field = moe.spec.count_field
    original = getattr(config, field)
    setattr(config, field, max(router_count(m) for m in moe.layers))
    config.save_pretrained(folder)
    setattr(config, field, original)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layers = []
    for m in moe.layers:
        entry = {"layer": m.index, "num_experts": router_count(m), "expert_ids": m.expert_ids}
        if is_packed(m):
            entry["packed"] = packed_structure(m)
        layers.append(entry)
    meta = {
        "format": "moeprune-checkpoint",
        "format_version": version,
        "model_type": moe.model_type,
        "layers": layers,
    }
    (folder / "moeprune.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("version", [1, 2])
def test_earlier_format_versions_still_load(version, tmp_path):
    model = tiny_model("deepseek_v3")
    moe = MoEModel(model)
    drop_experts(moe, non_uniform_removal(moe))
    if version == 2:
        _packed(model)
    with torch.no_grad():
        before = model(TOKENS).logits
    _write_legacy(model, tmp_path, version)
    assert_logits_close(moeprune.load_pretrained(tmp_path)(TOKENS).logits, before)


def test_mtp_layers_are_not_claimed_by_the_result(tmp_path, caplog):
    """transformers does not build DeepSeek's multi-token-prediction layers, so the result has
    none: its config must say 0 (vLLM would look for their weights), and the run says why."""
    model = tiny_model("deepseek_v3", num_nextn_predict_layers=1)
    moe = MoEModel(model)
    drop_experts(moe, {m.index: [0, 4] for m in moe.layers})  # one from each routing group
    with caplog.at_level("WARNING", logger="moeprune"):
        assert moeprune.save_pretrained(model, tmp_path / "out") == "stock"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert any("multi-token-prediction" in r.getMessage() for r in caplog.records)
    assert model.config.num_nextn_predict_layers == 1  # the caller's model is left as it was
