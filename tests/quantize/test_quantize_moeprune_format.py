"""`prune --quantize` of results in moeprune's format, in the quantization environment (.venv-quant;
skipped with the reason when absent): a tiny qwen3_moe with a global allocation (a different expert
count per layer) quantized W4A16 by GPTQ, a tiny deepseek_v3 with novices quantized W8A16 by
round-to-nearest, and a uniform mixed plan of a qwen3_moe with 32-wide experts (whole, narrowed on
the group's multiple of 16, novices) quantized W4A16 by round-to-nearest; one run per case, shared
by the asserts (module-scoped: each costs ~30 s of CPU).

What must hold: every kept expert's projections are stored as compressed-tensors codes under its
own name and nothing of it in full precision, while the routers, lm_head and the novices are not
quantized; each quantized Linear weighs what the byte model says and the planned size bounds the
file; `moeprune.load_pretrained`, the folder's modeling files (`trust_remote_code`) and the
compressed-tensors library's own decoding of the same bytes compute the same logits; recipe.json
records the quantization so `--config` repeats it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from helpers import assert_logits_close, run_cli, save_tiny_release, stored_tensors, write_arithmetic
from moeprune.checkpoint import load_pretrained
from moeprune.config import Recipe
from moeprune.quantize.schemes import SCHEMES

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
CASES = {
    # family[-case]: (extra config, prune arguments); the experts are 16 wide (mixed: 32): groups of 16
    "qwen3_moe-mixed": (
        {"mlp_only_layers": [], "moe_intermediate_size": 32},
        ["--method", "mixed", "--mixed-novice", "0.125", "--sparsity", "0.25", "--quantize", "w4a16",
         "--quant-method", "rtn"],
    ),
    "qwen3_moe": (
        {"mlp_only_layers": []},
        ["--allocation", "global", "--sparsity", "0.5", "--quantize", "w4a16", "--quant-method", "gptq"],
    ),
    "deepseek_v3": (
        {"qk_rope_head_dim": 16},
        ["--method", "novice", "--sparsity", "0.25", "--quantize", "w8a16", "--quant-method", "rtn"],
    ),
}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)")
IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]])


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized(request, tmp_path_factory) -> dict:
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    family = request.param.split("-")[0]
    extra, flags = CASES[request.param]
    root = tmp_path_factory.mktemp(f"quantize-moeprune-{family}")
    save_tiny_release(root / "model", family, **extra)  # deepseek_v3: with its MTP layer (model.layers.3.*)
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--output", root / "out", "--data", data, "--criterion", "frequency", *flags]
    common += ["--quant-group-size", "16", "--quant-python", QUANT_PYTHON]
    dry = run_cli("prune", *common, "--dry-run").output
    predicted = int(re.search(r"predicted .*?\(([\d,]+) bytes\)", dry)[1].replace(",", ""))
    run_cli("prune", *common)
    scheme, method = flags[flags.index("--quantize") + 1], flags[flags.index("--quant-method") + 1]
    return {"case": request.param, "family": family, "out": root / "out", "predicted": predicted, "scheme": scheme, "method": method}


def _kept(out: Path) -> dict[int, list[int]]:
    """Per MoE layer, the router positions holding an expert (not a novice), from the format's config."""
    layers = json.loads((out / "config.json").read_text())["moeprune"]["layers"]
    return {
        layer["layer"]: [p for p in range(layer["num_experts"]) if p not in set(layer.get("novice") or [])]
        for layer in layers
    }


def test_every_kept_expert_quantized_routers_lm_head_and_novices_not(quantized):
    out = quantized["out"]
    tensors = stored_tensors(out)
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "moeprune"
    kept = _kept(out)
    counts = {len(v) for v in kept.values()}
    if quantized["case"] == "qwen3_moe":
        assert len(counts) > 1, kept  # the global allocation kept a different count per layer
    if quantized["case"] == "qwen3_moe-mixed":  # narrowed on the group's multiple, whole, novices
        downs = {int(tensors[k][1]) for k in tensors if re.fullmatch(r".*experts\.\d+\.down_proj\.weight_shape", k)}
        assert downs == {16, 32}, downs
        layers = json.loads((out / "config.json").read_text())["moeprune"]["layers"]
        assert all(None in entry["widths"] and 16 in entry["widths"] for entry in layers), layers
    seen = {(int(m[1]), int(m[2]), m[3]) for k in tensors if (m := EXPERT.fullmatch(k)) and m[4] == "weight_packed"}
    assert seen == {(lay, e, p) for lay, es in kept.items() for e in es for p in ("gate", "up", "down")}
    # nothing of a kept expert left in full precision (the MTP layer's stay, below)
    assert not any((m := EXPERT.fullmatch(k)) and int(m[1]) in kept and k.endswith(".weight") for k in tensors)
    assert tensors["lm_head.weight"].dtype == torch.float32
    for lay in kept:
        assert tensors[f"model.layers.{lay}.mlp.gate.weight"].dtype == torch.float32
    novices = [k for k in tensors if k.endswith("mean_output")]
    if quantized["case"] == "qwen3_moe-mixed":
        assert novices and all(tensors[k].dtype == torch.float32 for k in novices)
    if quantized["family"] == "deepseek_v3":
        assert len(novices) == sum(8 - len(es) for es in kept.values()) > 0
        assert all(tensors[k].dtype == torch.float32 for k in novices)
        assert "model.layers.1.mlp.shared_experts.gate_proj.weight_packed" in tensors  # shared experts follow the scheme
        mtp = [k for k in tensors if k.startswith("model.layers.3.")]  # the MTP layer: kept, not quantized
        assert any(".mlp.experts." in k for k in mtp) and all(k.endswith(".weight") or "bias" in k for k in mtp)
        assert all(tensors[k].dtype == torch.float32 for k in mtp)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "does not serve moeprune-format checkpoints" in report["serving"]["vllm_refused"]


def test_bytes_as_predicted_and_the_recipe_repeats_the_quantization(quantized):
    out = quantized["out"]
    scheme = SCHEMES[quantized["scheme"]]
    tensors = stored_tensors(out)
    for name in [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]:
        rows, inputs = (int(v) for v in tensors[f"{name}.weight_shape"])
        stored = sum(tensors[f"{name}.{s}"].nbytes for s in ("weight_packed", "weight_scale", "weight_shape"))
        assert stored == scheme.linear_bytes(rows, inputs, 16, 4), name
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert 0.85 * quantized["predicted"] <= written <= quantized["predicted"]
    recipe = Recipe.load(out)
    method = quantized["method"]
    assert recipe.quantize == {"scheme": quantized["scheme"], "method": method, "group_size": 16}
    q = json.loads((out / "report.json").read_text())["quantization"]
    if method == "gptq":  # every kept expert computed on every calibration token
        assert q["least_tokens_per_expert"] >= q["calibration_tokens"] > 0


def _decoded_by_compressed_tensors(out: Path, into: Path) -> Path:
    """The folder with every quantized Linear decoded by compressed-tensors' own compressor, saved
    in full precision under moeprune's names (config without its quantization_config)."""
    compressors = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((out / "config.json").read_text())
    quant = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = next(iter(quant.config_groups.values()))
    tensors = stored_tensors(out)
    decoded = {}
    for key, value in tensors.items():
        if key.endswith(".weight_packed"):
            name = key.removesuffix(".weight_packed")
            parts = {s: tensors[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
            decoded[f"{name}.weight"] = compressors.PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        elif not key.endswith((".weight_scale", ".weight_shape")):
            decoded[key] = value
    into.mkdir()
    for item in out.iterdir():
        if item.suffix in (".py", ".json") and item.name not in ("config.json", "model.safetensors.index.json"):
            (into / item.name).write_bytes(item.read_bytes())
    (into / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in decoded.items()}, into / "model.safetensors", metadata={"format": "pt"})
    return into


def test_moeprune_modeling_files_and_compressed_tensors_compute_the_same_logits(quantized, tmp_path):
    out = quantized["out"]
    ours = load_pretrained(out).eval()
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    library = load_pretrained(_decoded_by_compressed_tensors(out, tmp_path / "decoded")).eval()
    with torch.no_grad():
        logits = ours(IDS).logits
        assert torch.equal(logits, remote.eval()(IDS).logits)
        assert_logits_close(logits, library(IDS).logits)
