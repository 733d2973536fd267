"""`prune --quantize` end to end, in the quantization environment (.venv-quant, made by
scripts/setup_quant.sh; skipped with the reason when it is absent): a tiny qwen3_moe and a tiny
deepseek_v3, pruned uniformly and quantized by llm-compressor's oneshot, one run per family
(module-scoped: each run costs about a minute of CPU).

What must hold: every kept expert's projections are quantized (codes, scales, shape) and the
routers and lm_head are not; each quantized Linear weighs exactly what the byte model of
moeprune.quantize.schemes says; the planned size bounds the file, and a --target-size in quantized
bytes is met; every kept expert was calibrated on every calibration token; the stock
compressed-tensors stack and `moeprune.load_pretrained` compute the same logits; and the
deepseek_v3 release's multi-token-prediction layer (which transformers' class does not build, so
llm-compressor's save would drop it) is in the result unquantized, byte for byte as the unquantized
prune stores it, and named in quantization_config's ignore.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tests.release_layouts import mtp_keys

from helpers import (
    assert_logits_close,
    run_cli,
    save_tiny_release,
    stock_from_pretrained,
    stored_tensors,
    write_arithmetic,
)
from moeprune.checkpoint import load_pretrained
from moeprune.quantize.schemes import SCHEMES

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
FAMILIES = {
    # family: (extra config, prune arguments); the experts are 16 wide: groups of 16
    "qwen3_moe": ({"mlp_only_layers": []}, ["--quantize", "w4a16", "--quant-group-size", "16"]),
    "deepseek_v3": ({"qk_rope_head_dim": 16}, ["--quantize", "w8a16", "--quant-group-size", "16"]),
}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)")


def _need_env() -> None:
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def quantized(request, tmp_path_factory) -> dict:
    """A tiny model of the family, its dry-run plan and its quantized prune (a --target-size for
    qwen3_moe, a sparsity for deepseek_v3)."""
    _need_env()
    family = request.param
    extra, flags = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"quantize-{family}")
    save_tiny_release(root / "model", family, **extra)  # deepseek_v3: with its MTP layer (model.layers.3.*)
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--data", data, "--criterion", "frequency", *flags, "--quant-python", QUANT_PYTHON]
    if family == "qwen3_moe":  # the target between the 4- and the 5-expert plans' quantized sizes
        sizes = {}
        for sparsity in ("0.375", "0.5"):
            out = run_cli("prune", *common, "--output", root / "x", "--sparsity", sparsity, "--dry-run").output
            sizes[sparsity] = int(re.search(r"predicted .*?\(([\d,]+) bytes\)", out)[1].replace(",", ""))
        target = (sizes["0.375"] + sizes["0.5"]) // 2
        size_flags = ["--target-size", str(target)]
    else:
        target, size_flags = None, ["--sparsity", "0.25"]
    dry = run_cli("prune", *common, "--output", root / "out", *size_flags, "--dry-run").output
    predicted = int(re.search(r"predicted .*?\(([\d,]+) bytes\)", dry)[1].replace(",", ""))
    summary = run_cli("prune", *common, "--output", root / "out", *size_flags).output
    if family == "deepseek_v3":  # the same prune unquantized: the MTP layer as it stores it
        plain = [root / "model", "--data", data, "--criterion", "frequency", "--output", root / "plain"]
        run_cli("prune", *plain, *size_flags)
    return {
        "family": family,
        "root": root,
        "out": root / "out",
        "summary": summary,
        "predicted": predicted,
        "target": target,
        "flags": flags,
    }


def test_every_kept_expert_quantized_router_and_lm_head_not(quantized):
    out = quantized["out"]
    tensors = stored_tensors(out)
    config = json.loads((out / "config.json").read_text())
    kept = next(config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k))
    report = json.loads((out / "report.json").read_text())
    removed = report["removed_per_layer"]
    assert kept == 8 - next(iter(removed.values())), (kept, removed)
    layers = {int(k) for k in removed}
    seen = {(int(m[1]), int(m[2]), m[3]) for k in tensors if (m := EXPERT.fullmatch(k)) and m[4] == "weight_packed"}
    assert seen == {(lay, e, p) for lay in layers for e in range(kept) for p in ("gate", "up", "down")}
    mtp = (f"model.layers.{config['num_hidden_layers']}.",)  # a release's MTP layer: kept unquantized (below)
    expert_weights = [k for k in tensors if EXPERT.fullmatch(k) and k.endswith(".weight")]
    assert not [k for k in expert_weights if not k.startswith(mtp)]  # nothing left in full precision
    assert tensors["lm_head.weight"].dtype == torch.float32
    for lay in layers:
        assert tensors[f"model.layers.{lay}.mlp.gate.weight"].dtype == torch.float32
        assert tensors[f"model.layers.{lay}.mlp.gate.weight"].shape[0] == kept
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def test_mtp_layer_kept_unquantized_byte_for_byte(quantized):
    """transformers' DeepseekV3 class does not build the MTP layer, so the save after quantizing
    would drop it: the result appends it as the unquantized prune stores it."""
    if quantized["family"] != "deepseek_v3":
        pytest.skip("qwen3_moe releases have no MTP layer")
    out, plain = quantized["out"], quantized["root"] / "plain"
    expected = mtp_keys(plain, "deepseek_v3")
    assert any(".mlp.experts." in k for k in expected) and len(expected) > 10
    got = mtp_keys(out, "deepseek_v3")
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert r"re:model\.layers\.3\..*" in config["quantization_config"]["ignore"]
    assert "(model.layers.3.*) kept, pruned to 6 of 8 experts" in quantized["summary"]
    assert "left unquantized by --quantize" in quantized["summary"]


def test_each_quantized_linear_weighs_what_the_byte_model_says(quantized):
    out, flags = quantized["out"], quantized["flags"]
    scheme = SCHEMES[flags[1]]
    tensors = stored_tensors(out)
    linears = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    assert linears
    for name in linears:
        rows, inputs = (int(v) for v in tensors[f"{name}.weight_shape"])
        stored = sum(tensors[f"{name}.{s}"].nbytes for s in ("weight_packed", "weight_scale", "weight_shape"))
        assert stored == scheme.linear_bytes(rows, inputs, 16, 4), name
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert written <= quantized["predicted"]  # the plan bounds the file (headers included)
    # and is a tight one: over by the header offsets' digits (quantize/pricing.py), and for
    # deepseek_v3 by the MTP layer's experts its prune removes (the byte model keeps them whole)
    slack = 0.01 * written
    if quantized["family"] == "deepseek_v3":
        mtp = "model.layers.3.mlp.experts."
        source = stored_tensors(quantized["root"] / "model")
        slack += sum(t.nbytes for k, t in source.items() if k.startswith(mtp))
        slack -= sum(t.nbytes for k, t in tensors.items() if k.startswith(mtp))
    assert quantized["predicted"] - written <= slack, (quantized["predicted"], written)
    if quantized["target"] is not None:
        report = json.loads((out / "report.json").read_text())
        assert written <= quantized["target"]
        assert report["target"]["sparsity"] == 0.5  # 4 experts kept: the 5-expert plan does not fit
        assert report["target"]["step_below_bytes"] > quantized["target"]
        assert report["target"]["written_bytes"] == written


def test_every_kept_expert_calibrated_on_every_token(quantized):
    q = json.loads((quantized["out"] / "report.json").read_text())["quantization"]
    assert q["calibration_tokens"] > 0
    assert q["least_tokens_per_expert"] >= q["calibration_tokens"]
    assert all(min(counts) >= q["calibration_tokens"] for counts in q["tokens_per_expert"].values())
    assert q["ignored"][0] == "lm_head"


def test_compressed_tensors_stack_and_moeprune_compute_the_same_logits(quantized):
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]])
    stock = stock_from_pretrained(quantized["out"], dtype=torch.float32)
    ours = load_pretrained(quantized["out"]).eval()
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, stock(ids).logits)
