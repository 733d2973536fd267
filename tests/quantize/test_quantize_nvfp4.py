"""`prune --quantize nvfp4a16` end to end, in the quantization environment (.venv-quant; skipped
with the reason when it is absent): a tiny qwen3_moe pruned and quantized by llm-compressor once
(module-scoped, about 20 s), then read back by moeprune and pruned again.

What must hold: every kept expert's projections are stored as nvfp4 (uint8 codes [out, in/2], fp8
scales [out, in/16], a float32 global scale [1]) and the router and lm_head are not; each
quantized Linear weighs what the byte model of moeprune.quantize.schemes says; moeprune's reading
of every weight is compressed-tensors' (its NVFP4 compressor), so `moeprune.load_pretrained`
computes the logits of the compressed-tensors stack bit for bit in bf16 (the only dtype in which
that stack runs this format: it decodes to bf16 and a float32 model fails on the dtype mismatch).

The stack here is transformers 5.23 with compressed-tensors 0.20, which decodes the attention
Linears with the library but the routed experts (fused in memory, decoded by transformers' own
converter) without their global scale (huggingface/transformers#48371, open: the experts come
back scaled by the global scale, about 4,000 here, with no error). The reference model is that
stack with its experts replaced by the library's own decode of the same stored tensors; the test
checks the bug's signature too, so it goes on holding when transformers fixes it.

Pruning the nvfp4 result again (a weight criterion streamed from the shards, the no-load drop)
keeps every kept expert's codes, scales and global scale byte for byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_streamed_scores_and_no_load_drop,
    kept_expert_sources,
    run_cli,
    save_tiny_qwen,
    stock_from_pretrained,
    stored_tensors,
    write_arithmetic,
)
from moeprune.checkpoint import load_pretrained
from moeprune.quant.testing import save_dequantized_checkpoint
from moeprune.quantize.schemes import SCHEMES

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)")
PARTS = ("weight_packed", "weight_scale", "weight_global_scale")
IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]])


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> Path:
    """A tiny qwen3_moe (experts 16 wide: one nvfp4 group) pruned to 4 of 8 experts per layer and
    quantized to nvfp4a16."""
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    root = tmp_path_factory.mktemp("nvfp4")
    save_tiny_qwen(root / "model")
    data = write_arithmetic(root / "calib.jsonl")
    run_cli("prune", root / "model", "--data", data, "--criterion", "frequency", "--sparsity", "0.5",
            "--quantize", "nvfp4a16", "--quant-python", QUANT_PYTHON, "--output", root / "out", "--quiet")  # fmt: skip
    return root / "out"


def _library_decode(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """compressed-tensors' own decode of one stored nvfp4 module (its NVFP4 compressor)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    parts = {p: tensors[f"{module}.{p}"] for p in PARTS}
    return NVFP4PackedCompressor.decompress(parts, QuantizationScheme(targets=["Linear"], weights=args))[
        "weight"
    ]


def test_every_kept_expert_is_nvfp4_router_and_lm_head_not(nvfp4):
    tensors = stored_tensors(nvfp4)
    config = json.loads((nvfp4 / "config.json").read_text())
    assert config["num_local_experts"] == 4
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    seen = {
        (int(m[1]), int(m[2]), m[3])
        for k in tensors
        if (m := EXPERT.fullmatch(k)) and m[4] == "weight_packed"
    }
    assert seen == {(lay, e, p) for lay in range(3) for e in range(4) for p in ("gate", "up", "down")}
    assert not any(EXPERT.fullmatch(k) and k.endswith(".weight") for k in tensors)
    for key in (k for k in tensors if k.endswith(".weight_packed")):
        module = key.removesuffix(".weight_packed")
        packed, scale, glob = (tensors[f"{module}.{p}"] for p in PARTS)
        rows, half = packed.shape
        assert (
            packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn and glob.dtype == torch.float32
        )
        assert scale.shape == (rows, 2 * half // 16) and glob.shape == (1,), module
        assert SCHEMES["nvfp4a16"].linear_bytes(rows, 2 * half, 16, 4) == sum(
            tensors[f"{module}.{p}"].nbytes for p in PARTS
        )
    assert tensors["lm_head.weight"].dtype == torch.float32
    for lay in range(3):
        assert tensors[f"model.layers.{lay}.mlp.gate.weight"].dtype == torch.float32
        assert tensors[f"model.layers.{lay}.mlp.gate.weight"].shape[0] == 4


def test_moeprune_reads_nvfp4_as_the_compressed_tensors_stack(nvfp4):
    pytest.importorskip("compressed_tensors")
    tensors = stored_tensors(nvfp4)
    stock = stock_from_pretrained(nvfp4, dtype=torch.bfloat16)
    with torch.no_grad():
        stock_logits = stock(IDS).logits  # the first forward decompresses the attention Linears
    ours = load_pretrained(nvfp4, dtype=torch.bfloat16).eval()
    mine, theirs = ours.state_dict(), stock.state_dict()
    attention = [
        k.removesuffix(".weight_packed") for k in tensors if ".self_attn." in k and k.endswith("_packed")
    ]
    for module in attention:  # decoded by the library: ours bit for bit
        assert torch.equal(mine[f"{module}.weight"], theirs[f"{module}.weight"]), module
        assert torch.equal(mine[f"{module}.weight"], _library_decode(tensors, module)), module
    bugged = False
    for lay in range(3):
        experts = stock.model.layers[lay].mlp.experts
        prefix = f"model.layers.{lay}.mlp.experts"
        lib = {
            p: torch.stack([_library_decode(tensors, f"{prefix}.{e}.{p}_proj") for e in range(4)])
            for p in ("gate", "up", "down")
        }
        gate_up = torch.cat([lib["gate"], lib["up"]], dim=1)
        assert torch.equal(mine[f"{prefix}.gate_up_proj"], gate_up) and torch.equal(
            mine[f"{prefix}.down_proj"], lib["down"]
        )
        if not torch.equal(experts.down_proj, lib["down"]):  # transformers#48371: no global scale
            bugged = True
            unscaled = {
                k: {**tensors, f"{k}.weight_global_scale": torch.ones(1)} for k in (f"{prefix}.0.down_proj",)
            }
            key = f"{prefix}.0.down_proj"
            assert torch.equal(experts.down_proj[0], _library_decode(unscaled[key], key))
            with torch.no_grad():
                experts.gate_up_proj.copy_(gate_up)
                experts.down_proj.copy_(lib["down"])
    with torch.no_grad():
        reference = stock(IDS).logits
        got = ours(IDS).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, reference)
    assert bugged or torch.equal(got, stock_logits)


def test_pruning_the_nvfp4_result_again_keeps_its_bytes(nvfp4, tmp_path):
    reference = save_dequantized_checkpoint(nvfp4, tmp_path / "ref")
    assert_streamed_scores_and_no_load_drop(nvfp4, reference, tmp_path)
    out = tmp_path / "no_load"
    before, after = stored_tensors(nvfp4), stored_tensors(out)
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 3
    sources = kept_expert_sources(json.loads((out / "plan.json").read_text()), after)
    assert {k.rpartition(".")[2] for k in sources} == set(PARTS)
    assert len(sources) == 3 * 3 * 3 * 3  # layers, kept experts, projections, stored tensors
    for key, source in sources.items():
        assert after[key].dtype == before[source].dtype and torch.equal(
            after[key].view(torch.uint8), before[source].view(torch.uint8)
        ), key
    assert torch.equal(
        load_pretrained(out, dtype=torch.bfloat16)(IDS).logits.isfinite(),
        torch.ones(1, 10, 259, dtype=torch.bool),
    )


def test_per_layer_counts_keep_nvfp4_in_moeprune_format(nvfp4, tmp_path):
    """Different expert counts per layer (a loaded prune of 5 of 12 experts) give a moeprune-format
    folder that keeps the nvfp4 bytes; its modeling files (trust_remote_code) and
    `moeprune.load_pretrained` decode them alike, and the kept experts are the input's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mixed"
    run_cli("prune", nvfp4, "--criterion", "aimer", "--sparsity", "0.4", "--output", out, "--quiet")
    config = json.loads((out / "config.json").read_text())
    assert len({layer["num_experts"] for layer in config["moeprune"]["layers"]}) > 1, config["moeprune"]
    before, after = stored_tensors(nvfp4), stored_tensors(out)
    sources = kept_expert_sources(json.loads((out / "plan.json").read_text()), after)
    assert {k.rpartition(".")[2] for k in sources} == set(PARTS)
    for key, source in sources.items():
        assert torch.equal(after[key].view(torch.uint8), before[source].view(torch.uint8)), key
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(remote(IDS).logits, load_pretrained(out, dtype=torch.bfloat16).eval()(IDS).logits)
