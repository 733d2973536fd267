"""One reader of moeprune's on-disk format (serve/moeprune_format.py), shared by moeprune, the
self-contained modeling files and the vLLM plugin: standard library only, one error type, and
the same sentence for the same damage wherever the folder is opened."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moeprune.checkpoint import structure
from moeprune.errors import MoePruneError
from moeprune.serve import moeprune_format
from moeprune.serve.moeprune_format import FormatError, parse_section

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

SECTION = {
    "format": "moeprune-checkpoint",
    "format_version": 3,
    "base_model_type": "qwen3_moe",
    "layers": [
        {"layer": 0, "num_experts": 3, "expert_ids": [0, 2, 3], "widths": [16, None, 8], "novice": [1]},
        {"layer": 2, "num_experts": 2, "expert_ids": [1, 3], "widths": [16, 16], "novice": []},
    ],
}


def _edited(edit) -> dict:
    section = copy.deepcopy(SECTION)
    edit(section)
    return section


DAMAGE = {  # what is wrong -> (the edit, a phrase of the one message every reader gives)
    "duplicate ids": (lambda s: s["layers"][1].update(expert_ids=[3, 3]), "expert ids [3] appear twice"),
    "count disagrees": (
        lambda s: s["layers"][0].update(num_experts=4),
        "num_experts 4 disagrees with 3 expert ids",
    ),
    "novice disagrees": (
        lambda s: s["layers"][0].update(novice=[2]),
        "'novice' [2] disagrees with the null widths",
    ),
    "zero width": (
        lambda s: s["layers"][0]["widths"].__setitem__(0, 0),
        "widths must be positive neuron counts",
    ),
    "layers unordered": (lambda s: s["layers"].reverse(), "MoE layers [2, 0] are not unique and ascending"),
    "layer beyond the model": (lambda s: s["layers"][1].update(layer=9), "layer 9 does not exist"),
    "future version": (
        lambda s: s.update(format_version=4),
        "newer than this reader of moeprune's format reads",
    ),
    "not moeprune's": (lambda s: s.update(format="other"), "'format' is not 'moeprune-checkpoint'"),
}


def test_a_good_section_reads_the_same_everywhere():
    parsed = parse_section(SECTION, "config.json", num_hidden_layers=4)
    assert [layer.to_json() for layer in parsed.layers] == SECTION["layers"]
    first = parsed.layer(0)
    assert (first.num_experts, first.novices, first.weighted, first.width) == (3, [1], (0, 2), 16)
    assert first.fused_index(2) == 1 and not first.is_stock(16) and parsed.layer(2).is_stock(16)


def _config_object(section: dict):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=4)
    config.model_type = "moeprune_qwen3_moe"
    config.moeprune = section
    return config


@pytest.mark.parametrize("damage", DAMAGE)
def test_every_reader_refuses_the_same_damage_in_the_same_words(damage, tmp_path):
    edit, phrase = DAMAGE[damage]
    section = _edited(edit)
    # moeprune itself (inspect, load_pretrained): MoePruneError, one line on the command line
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "moeprune_qwen3_moe", "num_hidden_layers": 4, "moeprune": section})
    )
    with pytest.raises(MoePruneError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        structure.read(tmp_path)
    # the modeling files copied into a result (stock transformers, no moeprune)
    from moeprune.serve.moeprune_families import read_structure

    with pytest.raises(FormatError) as caught:
        read_structure(_config_object(section))
    assert phrase in str(caught.value)
    # the vLLM plugin (config.json as a dict, before vLLM builds anything)
    from moeprune.serve.vllm.layout import read_layout

    with pytest.raises(FormatError) as caught:
        read_layout({"num_hidden_layers": 4, "moeprune": section})
    assert phrase in str(caught.value)
    assert issubclass(FormatError, ValueError)


def test_the_reader_needs_only_the_standard_library(tmp_path):
    """Loaded from its file alone, as a result folder holds it: no torch, transformers or moeprune."""
    path = Path(moeprune_format.__file__)
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('moeprune_format', {str(path)!r})\n"
        "module = sys.modules['moeprune_format'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.parse_section(json.loads({json.dumps(json.dumps(SECTION))}), 'config.json')\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True, cwd=tmp_path).stdout))  # fmt: skip
    assert not {m.split(".")[0] for m in loaded} & {
        "torch",
        "transformers",
        "moeprune",
        "numpy",
        "safetensors",
    }
