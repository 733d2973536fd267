"""The joint precision search's memory (quantize/memory.py), counted from the structure before
loading: every routed expert's fake-quantized copy once per scheme, in the model's dtype, beside
the model; refused in one line when they exceed the memory. (The refusal through the CLI, exit 2
and nothing written: tests/quantize/test_precision_refusals.py.)"""

from __future__ import annotations

import pytest
import torch

from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.quantize.memory import check_joint_memory, joint_copies_bytes, model_bytes
from moeprune.quantize.schemes import QuantizeOptions
from moeprune.runtime.device import Placement

pytestmark = pytest.mark.unit

JOINT = QuantizeOptions("w4a16", "rtn", 16, candidates=("w4a16", "w8a16"), budget=10**6, joint=True)
CPU = Placement(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def meta() -> MoEModel:
    """Its shapes are what is counted (prepare counts the meta skeleton's)."""
    return MoEModel(tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[]))


def test_the_copies_counted_by_hand(meta):
    # 3 MoE layers x 8 experts x (gate, up, down) x 32 x 16 weights = 36,864 weights a scheme
    assert joint_copies_bytes(meta, 2, torch.float32) == 2 * 36_864 * 4 == 294_912
    assert joint_copies_bytes(meta, 3, torch.bfloat16) == 3 * 36_864 * 2


def test_refused_in_one_line_when_the_copies_and_the_model_exceed_the_memory(meta):
    config = PruneConfig("frequency", 0.5, allocation="evo")
    need = 294_912 + model_bytes(meta, torch.float32)
    held = check_joint_memory(meta, config, JOINT, CPU, memory=need)
    assert held is not None and (held.copies, held.schemes, held.memory) == (294_912, 2, need)
    with pytest.raises(MoePruneError) as error:
        check_joint_memory(meta, config, JOINT, CPU, memory=need - 1)
    message = str(error.value)
    assert "\n" not in message and "(294,912 bytes)" in message and "give --sparsity" in message


def test_nothing_counted_without_the_joint_evo_search(meta):
    evo, grid = PruneConfig("frequency", 0.5, allocation="evo"), PruneConfig("frequency", 0.5)
    fixed = QuantizeOptions("w4a16", "rtn", 16, candidates=("w4a16", "w8a16"), budget=10**6)
    assert check_joint_memory(meta, grid, JOINT, CPU, memory=1) is None  # the grid: one copy a layer
    assert check_joint_memory(meta, evo, fixed, CPU, memory=1) is None  # --sparsity: one layer at a time
    assert check_joint_memory(meta, evo, None, CPU, memory=1) is None
