"""Multi-token-prediction layers of release layouts: read from the shards, pruned with a plan of
their own to the result's expert count, kept under the release's names, in both pipelines; left
out only when asked or when the result cannot hold them, always said."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from tests.helpers import assert_logits_close, fixed_logits, run_cli, stored_tensors
from tests.release_layouts import RELEASES, mtp_keys, write_mtp_release

from moeprune import load_pretrained
from moeprune.models import MoEModel
from moeprune.models.reshape import drop_experts

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]

FAMILIES = sorted(set(RELEASES) - {"deepseek_v4"})  # its hash layers make every result per-layer
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def assert_mtp_kept(before: dict, after: dict, kept: list[int]) -> None:
    """Every MTP tensor is there: experts renumbered from the kept ones (`kept[i]` is new expert
    i's input id), router rows and biases cut in step, everything else as stored."""
    assert {_EXPERT.sub(".experts.E.", k) for k in after} == {_EXPERT.sub(".experts.E.", k) for k in before}
    for key, tensor in after.items():
        match = _EXPERT.search(key)
        if match:
            source_key = _EXPERT.sub(f".experts.{kept[int(match.group(1))]}.", key, count=1)
            assert torch.equal(tensor, before[source_key]), key
        elif key.endswith(("mlp.gate.weight", "e_score_correction_bias", "ffn.gate.weight", "ffn.gate.bias")):
            assert torch.equal(tensor, before[key][kept]), key
        else:
            assert torch.equal(tensor, before[key]), key


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("releases")
    return {family: write_mtp_release(family, root / family) for family in RELEASES}


def _prune(source: Path, out: Path, *args: str) -> dict:
    run_cli("prune", str(source), "--output", str(out), "--criterion", "aimer", "--quiet", *args)
    return json.loads((out / "plan.json").read_text())


def _aimer(tensors: list[torch.Tensor]) -> float:
    flat = torch.cat([t.double().reshape(-1) for t in tensors])
    return float(flat.abs().sum() / (math.sqrt(flat.numel()) * flat.norm()))


def _expected_kept(mtp: dict[str, torch.Tensor], count: int) -> list[int]:
    """The MTP experts AIMER keeps, computed here from the stored tensors (highest pruned first)."""
    experts: dict[int, list[torch.Tensor]] = {}
    for key, tensor in sorted(mtp.items()):
        match = _EXPERT.search(key)
        if match and key.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            experts.setdefault(int(match.group(1)), []).append(tensor)
    scores = {e: _aimer(ts) for e, ts in experts.items()}
    order = sorted(scores, key=lambda e: (-scores[e], e))  # aimer prunes the highest first
    return sorted(order[len(order) - count :])


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layer_is_pruned_and_kept(releases, tmp_path, family, no_load):
    source = releases[family]
    plan = _prune(source, tmp_path / "out", "--sparsity", "0.25", *(["--no-load"] if no_load else []))
    before, after = mtp_keys(source, family), mtp_keys(tmp_path / "out", family)
    mtp = plan["extra"]["mtp"]["layers"]
    if not any(_EXPERT.search(k) for k in before):  # a dense MTP layer (MiMo-V2): copied as stored
        assert mtp == {} and after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert "kept as stored (no routed experts)" in (tmp_path / "out" / "report.md").read_text()
        _assert_masked_original(source, tmp_path / "out", plan)
        return
    (layer,) = mtp.values()
    kept = layer["kept"]
    assert len(kept) == 6 and kept == _expected_kept(before, 6)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    config = saved.get("text_config", saved)
    count_field = "num_experts" if "num_experts" in config else "n_routed_experts"
    assert config[count_field] == 6  # vLLM builds the MTP layer's MoE from this count
    if RELEASES[family].count_field:
        assert config[RELEASES[family].count_field] == 1
    # every MTP tensor is there: experts renumbered from the kept ones, router rows and biases cut
    # in step, everything else as stored
    assert_mtp_kept(before, after, kept)
    assert "multi-token-prediction layer" in (tmp_path / "out" / "report.md").read_text()
    assert "multi-token-prediction layer" in (tmp_path / "out" / "moeprune.log").read_text()
    assert (
        "- Beside the decoder stack: 1 multi-token-prediction layer"
        in (tmp_path / "out" / "README.md").read_text()
    )
    _assert_masked_original(source, tmp_path / "out", plan)


def _assert_masked_original(source: Path, result: Path, plan: dict) -> None:
    """The result reloads and its logits equal the input's with the plan's experts dropped."""
    original = load_pretrained(source)
    drop_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in plan["layers"]})
    assert_logits_close(fixed_logits(load_pretrained(result)), fixed_logits(original))


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_pruned_mtp_decoder_layer_computes_the_masked_original(releases, tmp_path, family, no_load):
    """DeepSeek's naming stores the MTP decoder layer as layer num_hidden_layers: transformers builds
    it when told there is one layer more, so its output is checked, not only its tensors."""
    source = releases[family]
    plan = _prune(source, tmp_path / "out", "--sparsity", "0.25", *(["--no-load"] if no_load else []))
    n = json.loads((source / "config.json").read_text())["num_hidden_layers"]

    def mtp_layer(folder: Path, dropped: list[int] | None) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        config.num_hidden_layers = n + 1
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
        if dropped is not None:
            drop_experts(MoEModel(model), {n: dropped})
        return model.model.layers[n].eval()

    kept = plan["extra"]["mtp"]["layers"][str(n)]["kept"]
    layer_before = mtp_layer(source, [e for e in range(8) if e not in kept])
    layer_after = mtp_layer(tmp_path / "out", None)
    hidden = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(0))
    rotary = load_pretrained(source).model.rotary_emb(hidden, torch.arange(7)[None])
    with torch.no_grad():
        out_before = layer_before(hidden, position_embeddings=rotary, attention_mask=None)
        out_after = layer_after(hidden, position_embeddings=rotary, attention_mask=None)
    assert out_after.shape == hidden.shape
    assert_logits_close(out_after, out_before)


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
def test_drop_mtp_leaves_them_out_and_says_so(releases, tmp_path, no_load):
    source = releases["deepseek_v3"]
    _prune(source, tmp_path / "out", "--sparsity", "0.25", "--drop-mtp", *(["--no-load"] if no_load else []))
    assert mtp_keys(tmp_path / "out", "deepseek_v3") == {}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    recipe = json.loads((tmp_path / "out" / "recipe.json").read_text())
    assert recipe["save"]["drop_mtp"] is True  # --config repeats it
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["release_layers"] == [
        "1 multi-token-prediction layer (model.layers.3.*) left out: --drop-mtp asked for it"
    ]


def test_stock_load_of_a_release_accepts_its_mtp_layer(releases):
    """transformers skips DeepSeek's MTP layer by a regex naming layer 61; moeprune knows it by
    its number past the stack, whatever the depth: not a damaged checkpoint."""
    model = load_pretrained(releases["deepseek_v3"])
    assert len(model.model.layers) == 3


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
def test_fp8_release_keeps_its_mtp_layer_quantized(tmp_path, no_load):
    """DeepSeek-V3 as released: block-scaled fp8, MTP layer included. The result keeps the kept
    MTP experts' fp8 bytes and their scales, renumbered with them."""
    source = write_mtp_release("deepseek_v3", tmp_path / "fp8", fp8=True)
    plan = _prune(source, tmp_path / "out", "--sparsity", "0.25", *(["--no-load"] if no_load else []))
    kept = plan["extra"]["mtp"]["layers"]["3"]["kept"]
    before, after = mtp_keys(source, "deepseek_v3"), mtp_keys(tmp_path / "out", "deepseek_v3")
    scaled = [k for k in after if k.endswith("weight_scale_inv") and _EXPERT.search(k)]
    assert scaled and after[scaled[0].removesuffix("_scale_inv")].dtype == torch.float8_e4m3fn
    for key, tensor in after.items():
        match = _EXPERT.search(key)
        if match:
            source_key = _EXPERT.sub(f".experts.{kept[int(match.group(1))]}.", key, count=1)
            assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor,
                               before[source_key].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn
                               else before[source_key]), key  # fmt: skip
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"]
        == "fp8"
    )


def test_inspect_names_the_mtp_layer(releases):
    out = run_cli("inspect", str(releases["qwen3_5_moe"]))
    assert "1 multi-token-prediction layer(s) (mtp.layers.0.*)" in out.output


def test_tensors_the_model_class_skips_are_carried_and_named(releases, tmp_path):
    """Qwen3.5-MoE's release loaded through its text-only config: transformers skips the vision
    tower (`_keys_to_ignore_on_load_unexpected`) and the MTP layer; the result holds both."""
    source = tmp_path / "text"
    shutil.copytree(releases["qwen3_5_moe"], source)
    saved = json.loads((source / "config.json").read_text())
    text = {
        **saved["text_config"],
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
    }
    (source / "config.json").write_text(json.dumps(text))
    plan = _prune(source, tmp_path / "out", "--sparsity", "0.25")
    before, after = stored_tensors(source), stored_tensors(tmp_path / "out")
    visual = [k for k in before if k.startswith("model.visual.")]
    assert visual and all(torch.equal(after[k], before[k]) for k in visual)
    assert plan["extra"]["mtp"]["layers"]["4"]["kept"]
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["release_layers"]
    assert (
        notes[1]
        == f"{len(visual)} stored tensors the model class skips on load (model.visual.*) carried into the result as stored"
    )
    _assert_masked_original(source, tmp_path / "out", plan)


@pytest.mark.parametrize(
    "pipeline", [[], ["--no-load"], ["--no-load", "--sequential"]], ids=["in-memory", "no-load", "sequential"]
)
def test_a_data_criterion_prunes_the_stack_and_aimer_the_mtp_layer(tmp_path, data, pipeline):
    """Calibrating the MTP layer would take the MTP forward transformers does not have: with a data
    criterion (REAP observed on the calibration text, also layer by layer), the MTP layer's plan is
    AIMER's, and says so."""
    from moeprune.data.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    source = write_mtp_release("deepseek_v3", tmp_path / "in", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(source)
    args = ["--criterion", "reap", "--data", str(data), "--samples", "8", "--sparsity", "0.25"]
    run_cli(
        "prune",
        str(source),
        "--output",
        str(tmp_path / "out"),
        "--quiet",
        *args,
        *pipeline,
    )
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    mtp = plan["extra"]["mtp"]
    assert plan["criterion"] == "reap" and mtp["criterion"] == "aimer"
    assert mtp["layers"]["3"]["kept"] == _expected_kept(mtp_keys(source, "deepseek_v3"), 6)
    assert (
        "pruned to 6 of 8 experts by aimer on its own weights" in (tmp_path / "out" / "report.md").read_text()
    )
    _assert_masked_original(source, tmp_path / "out", plan)


@pytest.mark.parametrize("no_load", [False, True], ids=["in-memory", "no-load"])
def test_deepseek_v4_release_prunes_and_keeps_its_mtp_layer(releases, tmp_path, no_load):
    """DeepSeek-V4 keeps its hash-routed layers whole, so every result has per-layer counts
    (moeprune's format); its MTP layer (`mtp.0.`, reference naming) is pruned by its own plan to
    the last MoE layer's count and kept under its stored names, router rows and biases in step."""
    source = releases["deepseek_v4"]
    plan = _prune(source, tmp_path / "out", "--sparsity", "0.25", *(["--no-load"] if no_load else []))
    mtp = plan["extra"]["mtp"]
    assert "left_out" not in mtp and list(mtp["layers"]) == ["4"]
    kept = mtp["layers"]["4"]["kept"]
    last = plan["layers"][-1]
    assert len(kept) == len(last["kept"]) - len(last.get("novice", []))
    assert_mtp_kept(mtp_keys(source, "deepseek_v4"), mtp_keys(tmp_path / "out", "deepseek_v4"), kept)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["release_layers"][0].startswith(
        f"1 multi-token-prediction layer (mtp.0.*) kept, pruned to {len(kept)} of 8 experts"
    )
    _assert_masked_original(source, tmp_path / "out", plan)
