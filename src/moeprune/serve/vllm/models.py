"""The `MoePrune*ForCausalLM` classes vLLM builds for moeprune-format checkpoints.

Each is vLLM's own class for the base family with two additions, shared by every family:

- construction runs inside `per_layer_moe` (moe.py), so every MoE layer gets the checkpoint's
  expert count, width groups and novices; everything else (attention, norms, the decoder loop,
  parallelism, the family's own weight loader) is vLLM's unchanged code;
- loading pads each expert with zero neurons to its width group's width; the first group's
  experts go to the family's own loader renamed to their index in the layer's fused block, the
  other groups' into their blocks through vLLM's fused-MoE weight loader (which shards them for
  tensor parallelism), and novices' tensors (mean_output, and a low-rank novice's novice_u and
  novice_v factors) into their layer's table (novices.py); every tensor of every novice and
  every expert of the other groups must be found, like every other weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm import ModelRegistry

from moeprune.serve.moeprune_format import ARCHITECTURE_PREFIX, FormatError, LayerStructure
from moeprune.serve.vllm.layout import (
    DOWN_PROJECTIONS,
    SERVED_FAMILIES,
    quantized_refusal,
    read_layout,
    route_like_transformers,
    served_family,
)
from moeprune.serve.vllm.moe import BuiltLayer, per_layer_moe
from moeprune.serve.vllm.novices import MEAN_OUTPUT, NOVICE_U, NOVICE_V

_EXPERT = re.compile(r"\.layers\.(\d+)\.[A-Za-z_]+\.experts\.(\d+)\.(.+)$")
NOVICE_TENSORS = (MEAN_OUTPUT, NOVICE_U, NOVICE_V)


if TYPE_CHECKING:
    _VllmCausalLM = Any  # the vLLM class the mixin is placed before (chosen per family in served_class)
else:
    _VllmCausalLM = object


class _MoePruneForCausalLM(_VllmCausalLM):
    """Mixin placed before vLLM's class: per-layer shapes at construction, remapped loading."""

    architecture: str  # vLLM's class this one extends

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        where = f"{getattr(config, 'name_or_path', '') or 'the checkpoint'}/config.json"
        self.family = served_family(getattr(config, "model_type", ""), self.architecture, where)
        quant = getattr(config, "quantization_config", None)
        if quant:  # kept codes and scales: the per-layer fused MoE here is built in full precision
            method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
            raise FormatError(f"{where}: {quantized_refusal(method)}")
        layout = read_layout({"moeprune": getattr(config, "moeprune", None)}, where)
        if not layout:
            raise FormatError(
                f"{where} names a MoePrune architecture but has no moeprune section; "
                "re-create the checkpoint with moeprune"
            )
        route_like_transformers(self.family, config)
        with per_layer_moe(layout, self.family) as built:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        model = self.model
        expected = {i for i in layout if model.start_layer <= i < model.end_layer}  # this pipeline stage
        if set(built) != expected:
            raise FormatError(
                f"vLLM built MoE layers {sorted(built)} for this {self.family} checkpoint, whose moeprune section "
                f"lists {sorted(expected)}; the checkpoint is damaged, or this vLLM builds MoE layers in a way "
                "moeprune's plugin does not know (it was written for vLLM 0.32)"
            )
        self._moeprune_layout = layout
        self._moeprune_built = built

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set(super().load_weights(self._fused_weights(weights)))
        names = {id(p): n for n, p in self.named_parameters()}
        for record in self._moeprune_built.values():
            if record.novices is not None:
                record.novices.check_loaded()
                loaded.update(names[id(p)] for p in record.novices.parameters())
            _check_blocks_loaded(record)
            loaded.update(names[id(p)] for block in record.blocks for p in block.parameters())
        return loaded

    def _fused_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Experts zero-padded to their width group's width: the first group's renamed to their
        index in the layer's own block (for the family's loader), the others' put into their
        blocks here; novices taken out."""
        for name, tensor in weights:
            match = _EXPERT.search(name)
            layer = self._moeprune_layout.get(int(match.group(1))) if match else None
            if match is None or layer is None:
                yield name, tensor
                continue
            position, rest = int(match.group(2)), match.group(3)
            if position >= layer.num_experts:
                raise FormatError(
                    f"{name}: layer {layer.layer} has {layer.num_experts} experts; the checkpoint is damaged"
                )
            record = self._moeprune_built.get(layer.layer)  # None: the layer lives on another pipeline stage
            if rest in NOVICE_TENSORS:
                _load_novice(record, layer, position, rest, name, tensor)
                continue
            if layer.widths[position] is None:
                raise FormatError(
                    f"{name}: position {position} of layer {layer.layer} is a novice and holds no "
                    "expert weights; the checkpoint is damaged, re-create it with moeprune"
                )
            group, index = _group_of(layer, position)
            padded = _padded(tensor, layer, position, rest, name, layer.groups[group].width)
            if group == 0:  # the family's own block: its loader takes it, named by the block's index
                yield name[: match.start(2)] + str(index) + name[match.end(2) :], padded
            elif record is not None:
                _load_into_block(record, group, index, position, rest, name, padded)


def _load_novice(
    record: BuiltLayer | None, layer: LayerStructure, position: int, part: str, name: str, tensor
) -> None:
    if position not in layer.novices:
        raise FormatError(
            f"{name}: position {position} of layer {layer.layer} is not a novice; the checkpoint is damaged"
        )
    if record is not None and record.novices is not None:
        record.novices.load(position, part, tensor)


def _group_of(layer: LayerStructure, position: int) -> tuple[int, int]:
    """(width group, index inside the group's block) of a weight-holding router position."""
    for g, group in enumerate(layer.groups):
        if position in group.positions:
            return g, group.positions.index(position)
    raise AssertionError(f"position {position} of layer {layer.layer} holds weights but is in no width group")


def _load_into_block(
    record: BuiltLayer, group: int, index: int, position: int, rest: str, name: str, tensor: torch.Tensor
) -> None:
    """One expert matrix of a width group past the first into its block, through vLLM's fused-MoE
    weight loader (it picks this rank's tensor-parallel slice)."""
    block = record.blocks[group - 1]
    projection = rest.split(".")[0]
    shards = {block.ckpt_gate_proj_name: "w1", block.ckpt_up_proj_name: "w3", block.ckpt_down_proj_name: "w2"}
    if projection not in shards or not rest.endswith(".weight"):
        raise FormatError(f"{name}: moeprune's plugin does not know where an expert's {rest!r} goes in vLLM")
    shard = shards[projection]
    param = block.w2_weight if shard == "w2" else block.w13_weight
    block.weight_loader(param, tensor, name, shard_id=shard, expert_id=index)
    record.loaded.add((position, shard))


def _check_blocks_loaded(record: BuiltLayer) -> None:
    """Every expert of every width group past the first was found, each of its three matrices."""
    expected = {
        (p, shard) for group in record.groups[1:] for p in group.positions for shard in ("w1", "w2", "w3")
    }
    missing = sorted(expected - record.loaded)
    if missing:
        raise FormatError(
            f"layer {record.layer}: the checkpoint lacks expert weights {missing} (router position, vLLM shard); "
            "it is incomplete, re-create it with moeprune"
        )


def _padded(
    tensor: torch.Tensor, layer: LayerStructure, position: int, rest: str, name: str, target: int
) -> torch.Tensor:
    """An expert matrix widened to its block's width with zero neurons (exact for gated MLPs)."""
    dim = 1 if rest.split(".")[0] in DOWN_PROJECTIONS else 0
    width = layer.widths[position]
    if tensor.dim() != 2 or tensor.shape[dim] != width:
        raise FormatError(
            f"{name} has shape {tuple(tensor.shape)} but the moeprune section gives expert {position} of "
            f"layer {layer.layer} {width} neurons; the checkpoint is damaged"
        )
    if width == target:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = target
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, width).copy_(tensor)
    return padded


def served_class(architecture: str) -> type:
    """`MoePrune<Stock>` for a vLLM class that serves families (found in vLLM's registry, so a
    family is added by naming it in SERVED_FAMILIES), with the mixin in front. The family is read
    from each checkpoint's model type, not fixed here: several may share the class."""
    stock = ModelRegistry.models[architecture].load_model_cls()
    name = ARCHITECTURE_PREFIX + stock.__name__
    attrs = {
        "architecture": architecture,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"vLLM's {stock.__name__} with moeprune's per-layer experts, widths and novices.",
    }
    return type(name, (_MoePruneForCausalLM, stock), attrs)


def __getattr__(name: str) -> type:
    """vLLM asks this module for `MoePrune<Arch>` (the plugin registers "module:Class" strings);
    each class is built on first use and kept."""
    for arch in SERVED_FAMILIES.values():
        if name == ARCHITECTURE_PREFIX + arch:
            globals()[name] = served = served_class(arch)
            return served
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
