"""Tensor names on disk: the names `save_pretrained` gives a stock checkpoint of each family.

transformers holds routed experts fused ([E, 2I, d] gate_up_proj and so on) and renames a few
modules in memory (Mixtral's block is `mlp`, on disk `block_sparse_moe`), while checkpoints on
disk keep the family's historical names, one tensor per expert. moeprune writes what the disk
layout says, for both of its formats, so every tool that reads stock layouts finds familiar
names; in moeprune's format each router position has its own expert tensors (any width) or a
`mean_output` vector for a novice. A test compares these names, shapes and values with what
`save_pretrained` writes for every family, so the table in FamilySpec cannot drift.

`disk_tensors` returns views into the model, never copies: the saver writes them and the loader
copies stored values into the views of a freshly built model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel, decoder_layers
from moeprune.models.packed import (
    NOVICE_PARAM,
    NOVICE_U,
    NOVICE_V,
    expert_tensor_names,
    expert_tensors,
    is_packed,
    layer_widths,
)
from moeprune.models.spec import FUSED

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MEAN_OUTPUT = "mean_output"  # a novice's stored vector: mu_i, what the block adds times g_i(t)
# a low-rank novice's factors [d, R] (it adds c + U V^T h; `mean_output` holds c)
NOVICE_FACTORS = {"novice_u": NOVICE_U, "novice_v": NOVICE_V}


def decoder_prefix(moe: MoEModel) -> str:
    """Qualified name of the decoder layer list ("model.layers" in every supported family)."""
    layers = decoder_layers(moe.model)
    for name, module in moe.model.named_modules():
        if module is layers:
            return name
    raise MoePruneError(f"cannot find the decoder layers of {type(moe.model).__name__}")  # pragma: no cover


def to_disk(moe: MoEModel, internal: str) -> str:
    """The on-disk name of an internal (transformers) tensor name outside the routed experts."""
    if not moe.spec.disk_names_known:
        return internal
    for old, new in moe.spec.disk_renames:
        internal = internal.replace(old, new)
    return internal


def block_prefix(moe: MoEModel, layer: MoELayer) -> str:
    """On-disk prefix of a MoE block, e.g. "model.layers.3.mlp" (Mixtral: "...block_sparse_moe")."""
    return to_disk(moe, f"{internal_block(moe, layer)}.").rstrip(".")


def internal_block(moe: MoEModel, layer: MoELayer) -> str:
    """transformers' qualified name of a MoE block ("model.layers.3.mlp"; the layer itself
    when it holds the experts, as in Gemma-4)."""
    return ".".join(p for p in (decoder_prefix(moe), str(layer.index), layer.spec.block_attr) if p)


def native_expert(layer: MoELayer, position: int) -> dict[str, torch.Tensor]:
    """One weight-holding expert's tensors in the family's native per-expert shape (views)."""
    experts = layer.experts
    if is_packed(layer):
        slots = cast("list[int]", experts.moeprune_slots)  # set by models.packed.pack_layer
        return expert_tensors(experts, slots[position])
    return {name: getattr(experts, name)[position] for name in expert_tensor_names(layer)}


def novice_vector(layer: MoELayer, position: int) -> torch.Tensor:
    slots = cast("list[int]", layer.experts.moeprune_slots)  # set by models.packed.pack_layer
    return getattr(layer.experts, NOVICE_PARAM)[-1 - slots[position]]


def _expert_tensors(moe: MoEModel, layer: MoELayer) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = f"{block_prefix(moe, layer)}.experts"
    names = layer.spec.disk_expert_names
    if names is None and not is_packed(layer):  # gpt_oss, Llama-4: the stock fused tensors
        for name in expert_tensor_names(layer):
            yield f"{prefix}.{name}", getattr(layer.experts, name)
        return
    for position, width in enumerate(layer_widths(layer)):
        if width is None:
            yield f"{prefix}.{position}.{MEAN_OUTPUT}", novice_vector(layer, position)
            slot = -1 - cast("list[int]", layer.experts.moeprune_slots)[position]
            for disk, memory in NOVICE_FACTORS.items():
                if hasattr(layer.experts, memory):
                    yield f"{prefix}.{position}.{disk}", getattr(layer.experts, memory)[slot]
            continue
        native = native_expert(layer, position)
        if names is None:  # one expert's slice of the fused tensors
            for name, tensor in native.items():
                yield f"{prefix}.{position}.{name}", tensor
            continue
        if layer.spec.layout != FUSED:  # pragma: no cover - every per-expert family is fused in memory
            raise MoePruneError(f"{layer.spec.model_type}: per-expert names need the fused layout")
        gate_up, down = native["gate_up_proj"], native["down_proj"]  # [2K, d], [d, K]
        gate, up, down_name = names
        yield f"{prefix}.{position}.{gate}.weight", gate_up[:width]
        yield f"{prefix}.{position}.{up}.weight", gate_up[width:]
        yield f"{prefix}.{position}.{down_name}.weight", down


def _converted_by_transformers(moe: MoEModel) -> dict[str, torch.Tensor]:
    """A stock checkpoint of a family whose disk layout only transformers' own save-time
    conversion knows: the same conversion save_pretrained runs (copies where it concatenates)."""
    from transformers.core_model_loading import revert_weight_conversion

    state: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in moe.model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key not in seen:
            seen.add(key)
            state[name] = tensor
    return dict(revert_weight_conversion(cast("PreTrainedModel", moe.model), state))  # a transformers model


def disk_tensors(moe: MoEModel, stock: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the model under its on-disk name, in the model's order (views; tied
    copies appear once, under the first name, as save_pretrained keeps them).

    A stock checkpoint of a family whose disk layout moeprune cannot name (`disk_names_known`
    false) goes through transformers' own save-time conversion; moeprune's format keeps
    transformers' internal names for such a family (its loader reads them back the same way)."""
    if stock and not moe.spec.disk_names_known:
        return _converted_by_transformers(moe)
    routed = {f"{internal_block(moe, m)}.experts.": m for m in moe.layers}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    written: set[int] = set()  # MoE layers whose experts are listed
    for name, tensor in moe.model.state_dict(keep_vars=True).items():
        layer = next((m for start, m in routed.items() if name.startswith(start)), None)
        if layer is not None:
            if layer.index not in written:
                written.add(layer.index)
                out.update(_expert_tensors(moe, layer))
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key in seen:  # tied to a tensor already listed (lm_head and the embedding)
            continue
        seen.add(key)
        out[to_disk(moe, name)] = tensor
    return out


_MTP_MODULE = re.compile(r"(^|\.)mtp\.")
_NUMBERED_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"(?:^|\.)mtp\.(?:layers\.)?\d+\.")


def beside_stack(key: str, num_hidden_layers: int) -> bool:
    """Whether a stored key belongs to a layer a release keeps beside the decoder stack: an
    `mtp.` module (Qwen3-Next, MiMo, DeepSeek-V4), or a layer numbered past the stack's last
    (DeepSeek-V3 and GLM-4.5 store their multi-token-prediction layer as layer
    num_hidden_layers). transformers does not build them; moeprune prunes and keeps them
    (shards/mtp.py), so loading never calls them unexpected."""
    if _MTP_MODULE.search(key):
        return True
    match = _NUMBERED_LAYER.search(key)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def beside_stack_prefixes(keys, num_hidden_layers: int) -> list[str]:
    """The stored prefixes of the layers a release keeps beside the stack (`beside_stack`), each
    named down to its layer number ("model.layers.61.", "mtp.layers.0.")."""
    found = set()
    for key in keys:
        if not beside_stack(key, num_hidden_layers):
            continue
        match = _MTP_LAYER.search(key) or _NUMBERED_LAYER.search(key)
        found.add(key[: match.end()] if match else key.rsplit(".", 1)[0] + ".")
    return sorted(p for p in found if _NUMBERED_LAYER.search(p) or _MTP_LAYER.search(p))
