"""Schemes as data (quantize/schemes.py): a scheme is one registered record that the byte model,
the header entries, the fake quantizer, the `auto:` checks and the driver's arguments all read, so
a new scheme is one entry; and no code of the quantize stage compares a scheme's name."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from moeprune.errors import MoePruneError
from moeprune.quantize import schemes
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.options import QuantizeOptions, parse_auto
from moeprune.quantize.pricing import linear_tensors
from moeprune.quantize.schemes import DTYPE_BYTES, SCHEMES, SHAPE, Rounding, Scheme

pytestmark = pytest.mark.unit

PACKAGE = Path(schemes.__file__).parent


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_records_tensors_weigh_its_linear_bytes(name):
    scheme = SCHEMES[name]
    for out, inputs in ((48, 64), (16, 256), (7, 32)):
        group = scheme.group(16)
        tensors = scheme.tensors(out, inputs, group, "BF16")
        stored = sum(math.prod(shape) * DTYPE_BYTES[dtype] for _, dtype, shape in tensors)
        assert stored == scheme.linear_bytes(out, inputs, 16, 2), (name, out, inputs)


def test_the_records_tensors_are_compressed_tensors_layouts():
    # by hand, one Linear [48, 64] in groups of 16 (nvfp4: its own 16), bf16 scales
    assert SCHEMES["w4a16"].tensors(48, 64, 16, "BF16") == [
        ("weight_packed", "I32", (48, 8)), ("weight_scale", "BF16", (48, 4)), ("weight_shape", "I64", (2,))
    ]  # fmt: skip
    assert SCHEMES["fp8-dynamic"].tensors(48, 64, 16, "BF16") == [
        ("weight", "F8_E4M3", (48, 64)),
        ("weight_scale", "BF16", (48, 1)),
    ]
    assert SCHEMES["nvfp4a16"].tensors(48, 64, 16, "BF16") == [
        ("weight_packed", "U8", (48, 32)),
        ("weight_scale", "F8_E4M3", (48, 4)),
        ("weight_global_scale", "F32", (1,)),
    ]


def test_a_new_scheme_is_one_entry(monkeypatch):
    """int4 per output channel, registered here only: priced, named on disk, fake-quantized,
    offered by `auto:` and handed to llm-compressor without another line of code."""
    channel = Scheme(
        "w4a16-channel",
        "int4 weights per output channel",
        bits=4,
        grouped=False,
        weights={"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
        extras=(SHAPE,),
        rounding=Rounding(-8.0, 7.0),
    )
    monkeypatch.setitem(SCHEMES, channel.name, channel)
    options = QuantizeOptions(channel.name, "rtn")
    # bytes: 4-bit codes, one bf16 scale a row, the int64 shape: 48 * 64 / 2 + 48 * 2 + 16
    assert channel.linear_bytes(48, 64, options.group, 2) == 1536 + 96 + 16
    assert linear_tensors(options, 48, 64, "BF16")[1] == ("weight_scale", "BF16", (48, 1))
    # fake quantization: one scale per row, amax / 7.5 (1 here), codes rounded and clamped to [-8, 7]
    w = torch.tensor([[7.5, -3.25, 1.75, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    want = torch.tensor([[7.0, -3.0, 2.0, 0.0], [0.0] * 4], dtype=torch.float64)
    assert torch.allclose(fake_quantize(w, channel.name, 128), want, atol=1e-15)
    assert parse_auto(f"auto:w4a16,{channel.name}") == ("w4a16", channel.name)
    assert channel.llm_compressor(128) == {"weights": channel.weights}  # per channel: no group size


def test_a_scheme_without_a_rounding_model_is_refused_by_auto_and_the_fake_quantizer():
    assert SCHEMES["nvfp4a16"].rounding is None
    with pytest.raises(MoePruneError, match="does not model"):
        parse_auto("auto:w4a16,nvfp4a16")
    with pytest.raises(MoePruneError, match="no round-to-nearest model"):
        fake_quantize(torch.ones(2, 16), "nvfp4a16", 16)


def _named_comparisons(path: Path, names: set[str]) -> list[str]:
    """`x == "w4a16"`, `x in ("w4a16", ...)` and dicts keyed by a scheme name, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        literals: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                literals += side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        elif isinstance(node, ast.Dict):
            literals = [k for k in node.keys if k is not None]
        hits = [c.value for c in literals if isinstance(c, ast.Constant) and c.value in names]
        found += [f"{path.name}:{node.lineno} {hit!r}" for hit in hits]
    return found


def test_no_module_of_the_stage_switches_on_a_scheme_or_method_name():
    names = set(SCHEMES) | set(schemes.QUANT_METHODS)
    found = [hit for path in sorted(PACKAGE.glob("*.py")) for hit in _named_comparisons(path, names)]
    assert found == []
