"""What vLLM must build for a moeprune-format checkpoint, read from config.json alone.

The `moeprune` section of config.json (docs/checkpoint-format.md, version 3) lists, per MoE
layer, one width per router position (null for a MoNE novice). vLLM's fused-MoE module holds
one [experts, 2 * width, hidden] block per layer, so each layer is built with

- as many fused experts as it has weight-holding positions (novices hold no expert weights:
  they are a d-vector each, added outside the fused kernel), and
- the width of its widest expert, the narrower ones padded with zero neurons. For the gated
  MLPs of every served family this is exact: silu(0) * 0 = 0 and a zero down-projection
  column adds nothing.

This module imports neither torch nor vLLM: moeprune's model card uses `padded_parameter_count`
to print what serving costs next to the packed size on disk.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "moeprune-checkpoint"
FORMAT_VERSION = 3  # the version this plugin serves
MODEL_TYPE_PREFIX = "moeprune_"
ARCHITECTURE_PREFIX = "MoePrune"

# base model type -> vLLM's causal-LM class for it (the plugin serves "MoePrune" + that name)
SERVED_FAMILIES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


def __getattr__(name: str):
    """`REFUSED_FAMILIES` (four names) still imports, with a warning: every family the plugin does
    not serve is refused now (`refused_families`)."""
    if name == "REFUSED_FAMILIES":
        import warnings

        warnings.warn(
            "REFUSED_FAMILIES is deprecated: the plugin refuses every family it does not serve (refused_families)",
            DeprecationWarning,
            stacklevel=2,
        )
        return ("qwen3_next", "ernie4_5_moe", "gpt_oss", "llama4_text")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def refused_families(model_types) -> list[str]:
    """Of `model_types` (transformers' config types), those the plugin refuses in one sentence:
    every one it does not serve (qwen3_next, ernie4_5_moe, gpt_oss and llama4_text among the
    eleven with hand-made fixtures: fused biases, shared-router or hybrid layers whose vLLM
    classes it has not been checked against; every family found by discovery), so a moeprune
    result of any family meets the refusal, never vLLM's own 'unknown model type'."""
    return [m for m in model_types if m not in SERVED_FAMILIES]


DOWN_PROJECTIONS = ("down_proj", "w2")  # [hidden, width]; every other expert matrix is [width, hidden]


def refusal(family: str) -> str:
    """The one sentence a user sees when the plugin does not serve a family."""
    return (
        f"moeprune's vLLM plugin does not serve {family} models saved in moeprune's format (it serves "
        f"{', '.join(SERVED_FAMILIES)}); load this checkpoint with transformers "
        "(AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)) or with moeprune.load_pretrained(path)"
    )


class LayoutError(ValueError):
    """A moeprune section the plugin cannot serve; the message says what to do."""


@dataclass(frozen=True)
class LayerLayout:
    """One MoE layer: router positions and their widths (None: a novice)."""

    layer: int
    widths: tuple[int | None, ...]

    @property
    def num_experts(self) -> int:
        """Router outputs, novices included."""
        return len(self.widths)

    @property
    def novices(self) -> tuple[int, ...]:
        return tuple(p for p, w in enumerate(self.widths) if w is None)

    @property
    def weighted(self) -> tuple[int, ...]:
        """Positions holding expert weights, in router order (fused expert i is weighted[i])."""
        return tuple(p for p, w in enumerate(self.widths) if w is not None)

    @property
    def width(self) -> int:
        """The fused width of the layer: its widest expert."""
        return max(w for w in self.widths if w is not None)

    def fused_index(self, position: int) -> int:
        return self.weighted.index(position)


def read_layout(config: dict[str, Any], where: str = "config.json") -> dict[int, LayerLayout]:
    """The served structure of a moeprune-format config (a dict), checked; {} for a stock config."""
    section = config.get("moeprune")
    if section is None:
        return {}
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise LayoutError(
            f"{where}: the 'moeprune' section is not {FORMAT!r}; re-create the checkpoint with moeprune"
        )
    version = section.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise LayoutError(
            f"{where} is moeprune format version {version!r} and this vLLM plugin serves version {FORMAT_VERSION}; "
            + ("upgrade moeprune beside vLLM" if newer else
               "re-save it with moeprune.save_pretrained(moeprune.load_pretrained(path), new_path)")
        )  # fmt: skip
    layers: dict[int, LayerLayout] = {}
    for entry in section.get("layers") or []:
        index, widths = entry.get("layer"), entry.get("widths")
        if not isinstance(index, int) or not isinstance(widths, list) or index in layers:
            raise LayoutError(
                f"{where}: malformed moeprune layer entry {entry!r}; re-create the checkpoint with moeprune"
            )
        if len(widths) != entry.get("num_experts") or not all(
            w is None or (isinstance(w, int) and w > 0) for w in widths
        ):
            raise LayoutError(f"{where}: layer {index} has widths {widths} for {entry.get('num_experts')} experts; "
                              "re-create the checkpoint with moeprune")  # fmt: skip
        if all(w is None for w in widths):
            raise LayoutError(f"{where}: layer {index} has only novices, which vLLM's fused MoE cannot run; "
                              "load it with moeprune.load_pretrained(path)")  # fmt: skip
        layers[index] = LayerLayout(index, tuple(widths))
    if not layers:
        raise LayoutError(
            f"{where}: the moeprune section lists no MoE layer; re-create the checkpoint with moeprune"
        )
    return layers


_EXPERT_TENSOR = re.compile(r"\.layers\.(\d+)\.[A-Za-z_]+\.experts\.(\d+)\.([A-Za-z0-9_]+)\.weight$")


def padded_parameter_count(path: str | Path) -> int:
    """Parameters vLLM holds for the checkpoint in `path`: what is stored, plus the zero neurons
    that pad each layer's narrower experts to its widest one (gate, up and down rows/columns).

    A stock checkpoint, or a moeprune one without per-expert widths, holds exactly what it
    stores. (vLLM's CPU kernel further rounds widths up to a multiple of 32; that is the
    kernel's own alignment, not counted here.)
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    layout = read_layout(config, str(path / "config.json"))
    total = 0
    for name, shape in _stored_shapes(path).items():
        numel = 1
        for size in shape:
            numel *= size
        total += numel
        match = _EXPERT_TENSOR.search(name)
        layer = layout.get(int(match.group(1))) if match else None
        if layer is not None:
            narrow = shape[1] if match.group(3) in DOWN_PROJECTIONS else shape[0]
            total += (numel // narrow) * (layer.width - narrow)
    return total


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors headers (nothing else is read)."""
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise LayoutError(f"{path} holds no .safetensors file; pass a checkpoint folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with shard.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes
