"""A checkpoint's weight bytes per expert, neuron and router row (shards/weight_bytes.py), two ways.

`cast_weight_bytes` counts from the model on the meta device (parameters per expert, per neuron,
per router row, times the dtype's size); `stored_weight_bytes` from the checkpoint's own tensors
as the layout maps them to experts (their header byte ranges). Saved in the model's dtype both
must agree to the byte in every family, or one of them misreads the structure; an fp8 expert
weighs its fp8 bytes and its scales, worked out by hand from the block grid.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeprune.checkpoint.files import header_bytes, stored_tensors, tensor_bytes
from moeprune.errors import MoePruneError
from moeprune.models.factory import tiny_model
from moeprune.models.families import supported_families
from moeprune.quant.testing import save_fp8_checkpoint
from moeprune.shards.layout import CheckpointLayout, meta_model
from moeprune.shards.weight_bytes import HEADER_SLACK, cast_weight_bytes, header_bound, stored_weight_bytes

pytestmark = pytest.mark.integration  # saves a tiny checkpoint of every family


@pytest.mark.parametrize("family", supported_families())
def test_meta_model_and_headers_agree_on_every_part(family, tmp_path):
    tiny_model(family).save_pretrained(tmp_path)
    try:
        layout = CheckpointLayout(tmp_path)
    except MoePruneError as exc:  # a layout the no-load path refuses: nothing to compare
        pytest.skip(f"{family}: {exc}")
    stored = stored_weight_bytes(layout)
    cast = cast_weight_bytes(tmp_path, meta_model(tmp_path), torch.float32)
    assert stored.layers == cast.layers
    tensors = stored_tensors(tmp_path)
    bound = header_bytes(tmp_path) + HEADER_SLACK * (len(tensors) + len({t.file for t in tensors.values()}))
    assert header_bound(tmp_path) == bound
    assert stored.total == cast.total == tensor_bytes(tmp_path) + bound
    halved = cast_weight_bytes(tmp_path, meta_model(tmp_path), torch.bfloat16)
    floats = sum(math.prod(t.shape) for t in tensors.values() if t.dtype == "F32")
    assert halved.total == stored.total - 2 * floats  # every float32 tensor saved in 2 bytes
    assert [lay.expert() for lay in halved.layers] == [lay.expert() // 2 for lay in stored.layers]


def test_an_fp8_expert_weighs_its_fp8_bytes_and_its_scales(tmp_path):
    # qwen3_moe's tiny experts: gate and up [16, 32], down [32, 16], one byte per value, and
    # float32 scales over 16x16 blocks: [1, 2], [1, 2], [2, 1], 4 bytes each
    save_fp8_checkpoint(tiny_model("qwen3_moe"), tmp_path, block=(16, 16))
    size = stored_weight_bytes(CheckpointLayout(tmp_path))
    per_expert = 3 * 16 * 32 + 3 * 2 * 4
    assert [lay.expert() for lay in size.layers] == [per_expert] * len(size.layers)
    assert not size.linear_neurons and size.format == "float8_e4m3fn (fp8, 16x16 blocks)"
    assert size.total == tensor_bytes(tmp_path) + header_bound(tmp_path)
