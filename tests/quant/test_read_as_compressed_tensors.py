"""llm-compressor outputs, pruned, read as transformers with compressed-tensors reads them, in the
quantization environment (.venv-quant: llm-compressor 0.14, compressed-tensors 0.19, transformers
5.17; skipped with the reason when absent) and in the main one (compressed-tensors 0.20).

A tiny deepseek_v3 and a tiny qwen3_moe are quantized by llm-compressor's round-to-nearest, FP8
dynamic (fp8 weights per channel, inputs quantized per token at run time) and W4A16 (int4 in groups
of 16): four oneshot runs in the shared warm process. Each output is pruned by magnitude (no data)
uniformly (a stock result) and with the global allocation (different counts per layer: moeprune's
format, the input's codes kept).

What must hold, in each environment, for the eight results: `moeprune.load_pretrained` and the
folder's modeling files compute the logits of the compressed-tensors stack's reading of the input
with the dropped experts masked (within the fp32 reordering tolerance, far under 1e-4); and an FP8
dynamic result quantizes the inputs of exactly the Linears the stack does (attention, dense and
shared-expert MLPs), not the routed experts nor the routers and lm_head it ignores. Before moeprune
read the activations' quantization the FP8 results were 1.96 (deepseek_v3) apart in logits, and
transformers before 5.21 (in .venv-quant) holds fp8 routed experts in bf16, which moeprune now does too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from stack_readings import readings

from helpers import assert_logits_close, run_cli
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quantize.oneshot import quantize_folder
from moeprune.quantize.options import QuantizeOptions

pytestmark = pytest.mark.quant_env

FAMILIES = {"deepseek_v3": {"qk_rope_head_dim": 16}, "qwen3_moe": {"mlp_only_layers": []}}
SCHEMES = {"fp8-dynamic": None, "w4a16": 16}  # scheme: group size
# uniform: 2 of 8 experts in every layer (a stock result); global: 6 of deepseek_v3's 16 experts
# (its groups take pairs: 4 + 2), 7 of qwen3_moe's 24: never the same count per layer (moeprune's format)
ALLOCATIONS = {
    "uniform": {"deepseek_v3": 0.25, "qwen3_moe": 0.25},
    "global": {"deepseek_v3": 6 / 16, "qwen3_moe": 7 / 24},
}
DRIVER = Path(__file__).with_name("stack_readings.py")
SRC = Path(__file__).resolve().parents[2] / "src"
IDS_FLAT = [5, 17, 9, 3, 42, 7, 8, 20]  # the calibration batch round-to-nearest still runs


@pytest.fixture(scope="module")
def results(tmp_path_factory, quant_python) -> dict[str, tuple[str, str]]:
    """case "family-scheme-allocation" -> (llm-compressor output, moeprune result)."""
    root = tmp_path_factory.mktemp("read-as-ct")
    tokenizer = byte_tokenizer()
    cases = {}
    for family, extra in FAMILIES.items():
        tiny_model(family, vocab_size=len(tokenizer), **extra).save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        for scheme, group in SCHEMES.items():
            q = root / f"{family}-{scheme}"
            shutil.copytree(root / family, q)
            quantize_folder(str(quant_python), q, QuantizeOptions(scheme, "rtn", group), [IDS_FLAT], "5GB")
            for allocation, sparsities in ALLOCATIONS.items():
                out = root / f"{family}-{scheme}-{allocation}"
                run_cli("prune", q, "--output", out, "--criterion", "magnitude", "--sparsity", sparsities[family],
                        "--allocation", allocation, "--quiet")  # fmt: skip
                cases[out.name] = (str(q), str(out))
    return cases


def _assert_read_as_the_stack(case: str, reading: dict, q: str, out: str) -> None:
    logits = {name: torch.tensor(value) for name, value in reading["logits"].items()}
    assert_logits_close(logits["load_pretrained"], logits["stack"])
    assert_logits_close(logits["modeling_files"], logits["stack"])
    model_type = json.loads((Path(out) / "config.json").read_text())["model_type"]
    assert model_type.startswith("moeprune_") == case.endswith("global"), model_type
    quant = json.loads((Path(q) / "config.json").read_text())["quantization_config"]
    group = next(iter(quant["config_groups"].values()))
    hooked = reading["input_quantized"]
    if group["input_activations"] is None:
        assert not hooked
        return
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    assert hooked and all(".self_attn." in n or ".mlp." in n for n in hooked), hooked
    assert not any(".experts." in n or n.endswith((".gate", "lm_head")) for n in hooked), hooked
    assert any(".shared_experts." in n for n in hooked) == case.startswith("deepseek_v3")


def test_the_quantization_environment_reads_as_compressed_tensors_0_19(results, quant_python, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"src": str(SRC), "cases": results}))
    done = subprocess.run([str(quant_python), str(DRIVER), str(spec), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    read = json.loads((tmp_path / "out.json").read_text())
    for case, (q, out) in results.items():
        assert read[case]["versions"][0].startswith("0.19"), read[case]["versions"]
        _assert_read_as_the_stack(case, read[case], q, out)


def test_the_main_environment_reads_as_compressed_tensors_0_20(results):
    for case, (q, out) in results.items():
        reading = readings(q, out)
        assert reading["versions"][0].startswith("0.20"), reading["versions"]
        _assert_read_as_the_stack(case, json.loads(json.dumps(reading)), q, out)
