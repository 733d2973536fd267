"""compressed-tensors decoding against the library release vLLM's environment pins (.venv-vllm,
driven in a subprocess: it cannot share .venv), on the cases of test_decode_as_libraries.py:
moeprune's decode equals the library's there too, dtype and every value (NVFP4 included: 0.17
infers the group from the scale's shape where 0.20 is given the scheme, the same arithmetic).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_decode_as_libraries import (
    FLOAT_CASES,
    PACKED_PARAMS,
    SCALE_DTYPES,
    _float_case,
    _nvfp4_case,
    _packed_case,
)

from moeprune.quant.compressed import SCALE, dequantize_float, dequantize_nvfp4, dequantize_packed

pytestmark = pytest.mark.vllm  # drives .venv-vllm's python in a subprocess (no vLLM start-up)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# Run by .venv-vllm's python: the library's decode of every case in cases.safetensors (cases.json
# says which is which), written to decoded.safetensors. Only compressed-tensors is imported.
_LIBRARY_DECODE = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
folder = sys.argv[1]
tensors = load_file(folder + "/cases.safetensors")
out = {}
for name, case in json.load(open(folder + "/cases.json")).items():
    parts = {k: tensors[name + "." + k] for k in case["parts"]}
    block = case.get("block_structure")
    kind = "float" if case["type"] == "nvfp4" else case["type"]
    args = QuantizationArgs(num_bits=case["bits"], type=kind, symmetric=case["symmetric"],
                            strategy=case["strategy"], group_size=case["group_size"], block_structure=block)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = {"int": PackedQuantizationCompressor, "float": NaiveQuantizationCompressor,
                  "nvfp4": NVFP4PackedCompressor}[case["type"]]
    out[name] = compressor.decompress(parts, scheme)["weight"].contiguous()
save_file(out, folder + "/decoded.safetensors")
"""


def test_the_release_vllm_serves_with_decodes_the_same(tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm (scripts/setup_vllm.sh makes it)")
    cases: dict[str, dict] = {}
    stored: dict[str, torch.Tensor] = {}
    ours: dict[str, torch.Tensor] = {}
    for i, (bits, symmetric, strategy, dtype) in enumerate(PACKED_PARAMS):
        tensors, scheme = _packed_case(bits, symmetric, strategy, dtype, seed=100 + i)
        name = f"packed{i}"
        stored.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
        ours[name] = dequantize_packed(tensors, scheme)
        cases[name] = {"parts": sorted(tensors), "bits": bits, "type": "int", "symmetric": symmetric}
        cases[name] |= {"strategy": strategy, "group_size": scheme.group_size}
    # that release fails on partial blocks (0.20 pads them): they are checked against .venv's
    whole = sorted(c for c in FLOAT_CASES if c != "partial_block")
    for j, (case, dtype) in enumerate((c, d) for c in whole for d in SCALE_DTYPES):
        weight, scale, scheme = _float_case(case, dtype, seed=200 + j)
        strategy = scheme.strategy
        name = f"float{j}"
        stored.update({f"{name}.weight": weight, f"{name}.{SCALE}": scale})
        ours[name] = dequantize_float(weight, scale, scheme)
        block = list(scheme.block_structure) if scheme.block_structure else None
        cases[name] = {"parts": ["weight", SCALE], "bits": 8, "type": "float", "symmetric": True}
        cases[name] |= {"strategy": strategy, "group_size": scheme.group_size, "block_structure": block}
    for k in range(3):  # nvfp4: that release passes no quantization args to `dequantize` (0.20 does)
        tensors = _nvfp4_case(seed=300 + k)
        stored.update({f"nvfp4{k}.{n}": v for n, v in tensors.items()})
        ours[f"nvfp4{k}"] = dequantize_nvfp4(tensors)
        cases[f"nvfp4{k}"] = {"parts": sorted(tensors), "bits": 4, "type": "nvfp4", "symmetric": True}
        cases[f"nvfp4{k}"] |= {"strategy": "tensor_group", "group_size": 16}
    save_file(stored, str(tmp_path / "cases.safetensors"))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", _LIBRARY_DECODE, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = load_file(str(tmp_path / "decoded.safetensors"))
    assert theirs.keys() == ours.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
