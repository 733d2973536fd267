"""discover_spec keeps a spec per instance structure for the process: the same structure gets the
very same spec, without a second discovery; a changed config field, tensor shape or replaced
forward is discovered afresh, and what it finds equals a cold discovery's."""

from __future__ import annotations

import pytest

from moeprune.models import discover
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.unit


def test_the_same_structure_is_discovered_once_and_a_changed_one_afresh(monkeypatch):
    calls = []
    cold = discover._discover
    monkeypatch.setattr(discover, "_discover", lambda model: calls.append(1) or cold(model))
    monkeypatch.setattr(discover, "_DISCOVERED", {})
    first = discover.discover_spec(tiny_model("qwen3_moe"))
    again = discover.discover_spec(tiny_model("qwen3_moe"))
    assert again is first and len(calls) == 1
    wider = tiny_model("qwen3_moe", moe_intermediate_size=48)  # another config field and expert shapes
    assert discover.discover_spec(wider) == cold(wider) and len(calls) == 2
    other = tiny_model("deepseek_v3")
    assert discover.discover_spec(other) == cold(other) and discover.discover_spec(other) is not first
    patched = tiny_model("qwen3_moe")
    patched.model.layers[0].mlp.forward = patched.model.layers[0].mlp.forward  # an instance-level forward
    discover.discover_spec(patched)
    discover.discover_spec(patched)
    assert len(calls) == 3 + 2  # deepseek once; the patched instance each time (never kept)
