"""The joint search of mixed forms and schemes (`--method mixed --quantize auto:w4a16,w8a16
--target-size T --allocation evo`, no `--sparsity`) end to end in the quantization environment
(.venv-quant; skipped with the reason when absent): a tiny qwen3_moe with 64-wide experts, a short
search, then llm-compressor's round-to-nearest with the winner's schemes. What must hold: each
layer is written in the winner's scheme with the winner's forms (narrowed experts at the gene's
width, novices unquantized), its expert tensors weigh what the byte model priced for them, the file
is within the prediction and T, and moeprune's loader reads it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_cli, stored_tensors, write_arithmetic
from moeprune.checkpoint import load_pretrained
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.quantize.schemes import QuantizeOptions
from moeprune.shards.weight_bytes import cast_weight_bytes

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
BITS = {"w4a16": 4, "w8a16": 8}


def test_the_winner_forms_and_schemes_are_written_at_the_predicted_bytes(tmp_path):
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[],
                       moe_intermediate_size=64)  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    moe = MoEModel(model)
    size = cast_weight_bytes(tmp_path / "model", moe, torch.float32)
    every = {
        s: quantized_weight_bytes(size, moe, QuantizeOptions(s, "rtn", 16), 4).total for s in BITS
    }  # every expert whole, one scheme everywhere
    target = (every["w4a16"] + every["w8a16"]) // 2
    data = write_arithmetic(tmp_path / "calib.jsonl")
    run_cli("prune", tmp_path / "model", "--output", tmp_path / "out", "--data", data, "--search-data", data,
            "--criterion", "frequency", "--method", "mixed", "--allocation", "evo", "--population", "6",
            "--elites", "2", "--generations", "3", "--target-size", str(target), "--quantize", "auto:w4a16,w8a16",
            "--quant-method", "rtn", "--quant-group-size", "16", "--quant-python", QUANT_PYTHON, "--quiet")  # fmt: skip
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    search = json.loads((out / "search.json").read_text())
    precision = report["quantization"]["precision"]
    assert [precision["chosen"][str(i)] for i in range(3)] == search["chosen_schemes"]
    tensors = stored_tensors(out)
    for layer, (w, n, v, _d, width) in enumerate(search["genes"]):
        scheme = precision["chosen"][str(layer)]
        prefix = f"model.layers.{layer}.mlp.experts."
        shapes = [
            tensors[k] for k in tensors if k.startswith(prefix) and k.endswith("down_proj.weight_shape")
        ]
        assert sorted(int(s[1]) for s in shapes) == sorted([width] * n + [64] * w), layer  # the gene's forms
        novices = [k for k in tensors if k.startswith(prefix) and k.endswith("mean_output")]
        assert len(novices) == v and all(tensors[k].dtype == torch.float32 for k in novices)
        packed = [
            tensors[k] for k in tensors if k.startswith(prefix) and k.endswith("down_proj.weight_packed")
        ]
        assert all(p.shape[0] == 32 and p.shape[1] * 32 // BITS[scheme] in (64, width) for p in packed), layer
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert (
        written
        == precision["written_bytes"]
        <= precision["predicted_bytes"]
        == search["predicted_bytes"]
        <= target
    )
    assert precision["predicted_bytes"] - written < 0.1 * written  # the byte model's header bound, no more
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        assert torch.isfinite(load_pretrained(out).eval()(ids).logits).all()
