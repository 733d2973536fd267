"""The joint search of experts and schemes (`--quantize auto:w4a16,w8a16 --target-size T
--allocation evo`, no `--sparsity`) end to end in the quantization environment (.venv-quant; skipped
with the reason when absent): the tiny qwen3_moe of test_precision_prune.py, a short search, then
llm-compressor's round-to-nearest with the winner's schemes. What must hold: the counts pruned and
the schemes written are the search's winner, each layer's expert tensors weigh exactly what the byte
model predicted for its scheme and kept experts, and the file is within the prediction and T."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (
    assert_expert_header_bound,
    header_entries,
    run_cli,
    save_tiny_qwen,
    stored_tensors,
    write_arithmetic,
)

pytestmark = pytest.mark.quant_env

BITS = {"w4a16": 4, "w8a16": 8}


def test_the_winner_is_written_in_its_schemes_at_the_predicted_bytes(tmp_path, quant_python):
    torch.manual_seed(0)
    save_tiny_qwen(tmp_path / "model")
    data = write_arithmetic(tmp_path / "calib.jsonl")
    target = 150000
    run_cli("prune", tmp_path / "model", "--output", tmp_path / "out", "--data", data, "--search-data", data,
            "--criterion", "frequency", "--allocation", "evo", "--population", "4", "--elites", "2",
            "--generations", "2", "--target-size", str(target), "--quantize", "auto:w4a16,w8a16",
            "--quant-method", "rtn", "--quant-group-size", "16", "--quant-python", quant_python, "--quiet")  # fmt: skip
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    search = json.loads((out / "search.json").read_text())
    precision = report["quantization"]["precision"]
    layers = sorted(precision["chosen"], key=int)
    assert [report["removed_per_layer"][k] for k in layers] == search["allocation"]
    assert [precision["chosen"][k] for k in layers] == search["chosen_schemes"]
    tensors = stored_tensors(out)
    for layer in layers:
        scheme, kept = precision["chosen"][layer], 8 - report["removed_per_layer"][layer]
        prefix = f"model.layers.{layer}.mlp.experts."
        packed = tensors[f"{prefix}0.down_proj.weight_packed"]
        assert packed.shape[1] * 32 // BITS[scheme] == 16, (layer, scheme)
        stored = sum(t.nbytes for k, t in tensors.items() if k.startswith(prefix))
        assert header_entries(out, prefix)[0] == kept * 3 * 3
        assert_expert_header_bound(precision["expert_bytes"][layer], stored, out, prefix)
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert written == precision["written_bytes"] <= precision["predicted_bytes"] <= target
