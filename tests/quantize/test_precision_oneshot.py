"""Per-layer precision's final quantization, in the quantization environment (.venv-quant; skipped
with the reason when absent): a tiny qwen3_moe quantized by llm-compressor's round-to-nearest with
one scheme per MoE layer (w4a16, w8a16, fp8-dynamic; the rest w8a16), one oneshot run shared by
the module.

What must hold: each layer's experts carry their scheme and every other Linear the base one; the
bytes are what quantize/choice.py predicts from quantize/pricing.py; the decoded expert
weights are bit for bit quantize/fake.py's fake quantization (the numbers the search scored); and
`moeprune.load_pretrained` computes the logits of the fake-quantized original.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_expert_header_bound, assert_logits_close, stored_tensors
from moeprune.checkpoint import load_pretrained
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.quant.compressed import WeightScheme, dequantize_float, dequantize_packed
from moeprune.quantize.choice import precision_bytes
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.oneshot import quantize_folder
from moeprune.quantize.pricing import ignored
from moeprune.quantize.schemes import SCHEMES, QuantizeOptions
from moeprune.shards.weight_bytes import cast_weight_bytes

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
CHOICE = {0: "w4a16", 1: "w8a16", 2: "fp8-dynamic"}
GROUP = 16
SAMPLES = [[5, 17, 9, 3, 42, 7, 8, 20], [1, 2, 3, 4, 5, 6, 7, 8]]  # RTN's pipeline still runs a batch


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict:
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    root = tmp_path_factory.mktemp("precision")
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[])
    model.save_pretrained(root / "model")
    shutil.copytree(root / "model", root / "out")
    options = QuantizeOptions("w8a16", "rtn", GROUP, layer_schemes=CHOICE)
    report = quantize_folder(str(QUANT_PYTHON), root / "out", options, SAMPLES, "5GB")
    moe = MoEModel(model)
    size = cast_weight_bytes(root / "model", moe, torch.float32)
    predicted = precision_bytes(size, moe, ["w8a16", "w4a16", "fp8-dynamic"], options, 4, [0, 0, 0])
    return {"model": model, "out": root / "out", "report": report, "predicted": predicted}


def _expert(tensors: dict, layer: int, expert: int, proj: str) -> dict:
    prefix = f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj."
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def test_each_layer_carries_its_scheme_and_weighs_as_predicted(quantized):
    tensors = stored_tensors(quantized["out"])
    for layer, scheme in CHOICE.items():
        stored = _expert(tensors, layer, 0, "down")
        if scheme == "fp8-dynamic":
            assert stored["weight"].dtype == torch.float8_e4m3fn and stored["weight_scale"].shape[1] == 1
        else:
            rows, inputs = (int(v) for v in stored["weight_shape"])
            assert sum(t.nbytes for t in stored.values()) == SCHEMES[scheme].linear_bytes(
                rows, inputs, GROUP, 4
            )
    attention = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.self_attn.q_proj.")}
    rows, inputs = (int(v) for v in attention["model.layers.0.self_attn.q_proj.weight_shape"])
    assert sum(t.nbytes for t in attention.values()) == SCHEMES["w8a16"].linear_bytes(rows, inputs, GROUP, 4)
    assert quantized["report"]["layer_schemes"] == {str(k): v for k, v in CHOICE.items()}
    written = sum(p.stat().st_size for p in quantized["out"].glob("*.safetensors"))
    assert written <= quantized["predicted"].total(list(CHOICE.values()))
    for layer, scheme in CHOICE.items():  # per layer: the tensors, plus a tight bound on their entries
        prefix = f"model.layers.{layer}.mlp.experts."
        stored = sum(t.nbytes for k, t in tensors.items() if k.startswith(prefix))
        assert_expert_header_bound(quantized["predicted"].layers[layer][scheme], stored, quantized["out"], prefix)
    config = json.loads((quantized["out"] / "config.json").read_text())
    assert len(config["quantization_config"]["config_groups"]) == 3


def test_llm_compressor_rtn_is_the_fake_quantization_bit_for_bit(quantized):
    tensors = stored_tensors(quantized["out"])
    model = quantized["model"]
    for layer, scheme in CHOICE.items():
        experts = model.model.layers[layer].mlp.experts
        inter = experts.down_proj.shape[-1]
        for e in range(experts.gate_up_proj.shape[0]):
            originals = {
                "gate": experts.gate_up_proj[e, :inter],
                "up": experts.gate_up_proj[e, inter:],
                "down": experts.down_proj[e],
            }
            for proj, weight in originals.items():
                stored = _expert(tensors, layer, e, proj)
                if scheme == "fp8-dynamic":
                    ws = WeightScheme("float-quantized", 8, "float", strategy="channel")
                    decoded = dequantize_float(stored["weight"], stored["weight_scale"], ws)
                else:
                    ws = WeightScheme("pack-quantized", SCHEMES[scheme].bits, "int", group_size=GROUP)
                    decoded = dequantize_packed(stored, ws)
                assert torch.equal(decoded, fake_quantize(weight, scheme, GROUP)), (layer, e, proj)


def test_moeprune_reads_the_fake_quantized_model(quantized):
    """moeprune.load_pretrained on the mixed checkpoint computes the logits of the original model
    with every quantized Linear fake-quantized as chosen (the base scheme outside the experts).
    The stock transformers stack is no oracle here: it reads one experts scheme for all layers
    (transformers' get_experts_scheme); vLLM reads each layer's from its expert 0."""
    fake = copy.deepcopy(quantized["model"]).eval()
    for name, module in fake.named_modules():
        if isinstance(module, torch.nn.Linear) and not ignored(name):
            module.weight.data = fake_quantize(module.weight.data, "w8a16", GROUP)
    for layer, scheme in CHOICE.items():
        for p in fake.model.layers[layer].mlp.experts.parameters():
            p.data = fake_quantize(p.data, scheme, GROUP)
    ids = torch.tensor([[5, 17, 90, 3, 42, 7, 8, 20, 31, 64]])
    ours = load_pretrained(quantized["out"]).eval()
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, fake(ids).logits)
