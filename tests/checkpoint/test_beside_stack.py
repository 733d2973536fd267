"""Which stored keys belong to layers a release keeps beside the decoder stack (MTP layers)."""

from __future__ import annotations

import pytest

from moeprune.checkpoint.names import beside_stack, beside_stack_prefixes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("model.layers.61.eh_proj.weight", True),  # DeepSeek-V3: layer num_hidden_layers
        ("model.layers.60.mlp.experts.3.gate_proj.weight", False),  # the stack's last layer
        ("mtp.layers.0.mlp.gate.weight", True),  # Qwen3-Next, Qwen3.5
        ("mtp.fc.weight", True),
        ("model.mtp.layers.0.enorm.weight", True),  # MiMo, LongCat
        ("mtp.0.ffn.experts.1.w1.weight", True),  # DeepSeek's reference naming
        ("model.visual.blocks.0.attn.qkv.weight", False),
        ("model.embed_tokens.weight", False),
    ],
)
def test_beside_stack(key, expected):
    assert beside_stack(key, 61) is expected


def test_prefixes_name_each_layer_once():
    keys = [
        "model.layers.61.enorm.weight",
        "model.layers.61.mlp.experts.0.up_proj.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.fc.weight",
        "mtp.0.ffn.gate.weight",
        "model.layers.3.mlp.gate.weight",
    ]
    assert beside_stack_prefixes(keys, 61) == ["model.layers.61.", "mtp.0.", "mtp.layers.0."]
