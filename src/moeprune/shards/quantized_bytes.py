"""The bytes a `--quantize` result will have, from the model's structure alone (no weight read).

`moeprune.quant.schemes` says what one quantized Linear weighs; this module applies it to a model:
every Linear llm-compressor quantizes (attention, dense and shared MLPs, each routed expert's
projections) is replaced by its codes and scales, and everything it leaves alone (embeddings,
norms, the routers, lm_head, biases) keeps the size it has in the saved dtype. The result is a
`WeightBytes` like the full-precision one, so the same target-size solver and planned sizes
(surgery/target_size.py) work in quantized bytes: a routed expert of width w weighs
`per_neuron * w + per_expert` there too (gate and up add one row of `hidden` inputs per neuron,
down one column: `hidden` codes and, in groups, `hidden / G` scales).

The headers grow: compressed-tensors stores each quantized Linear as three tensors (codes, scales,
shape), under per-expert names; HEADER_ENTRY bytes a tensor bound what each entry adds.
"""

from __future__ import annotations

import re
from dataclasses import replace

from torch import nn

from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.quant.schemes import QuantizeOptions
from moeprune.surgery.sizes import LayerBytes, WeightBytes

# what llm-compressor is told to leave alone: lm_head and the routers (a router is an nn.Linear in
# some families, a module of its own in others: both named `mlp.gate`)
IGNORE = ("lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$")
HEADER_ENTRY = 96  # bound on one safetensors header entry beyond its name (dtype, shape, offsets)


def ignored(name: str) -> bool:
    for pattern in IGNORE:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], name) or name == pattern:
            return True
    return False


def quantized_linears(moe: MoEModel) -> dict[str, tuple[int, int]]:
    """Name -> (out, in) of every Linear outside the routed experts that llm-compressor quantizes."""
    inside = {id(m) for layer in moe.layers for m in layer.experts.modules()}
    return {
        name: (module.out_features, module.in_features)
        for name, module in moe.model.named_modules()
        if isinstance(module, nn.Linear) and id(module) not in inside and not ignored(name)
    }


def _gated(moe: MoEModel) -> list[bool]:
    """Per MoE layer: gated experts (gate and up) or not (up only); other layouts are refused."""
    out = []
    for layer in moe.layers:
        experts = layer.experts
        if getattr(experts, "moeprune_slots", None) is not None or getattr(experts, "is_transposed", False):
            raise MoePruneError(
                f"quantizing {moe.model_type}'s experts as stored is not supported (llm-compressor linearizes "
                "the standard fused [experts, out, in] layout); prune without quantizing",
                options=("quantize",),
            )
        out.append(hasattr(experts, "gate_up_proj") or hasattr(experts, "gate_proj"))
    return out


def quantized_weight_bytes(
    size: WeightBytes, moe: MoEModel, options: QuantizeOptions, dtype_bytes: int
) -> WeightBytes:
    """`size` (the model's weights saved with `dtype_bytes` a value, unpruned) after quantization
    with `options`."""
    scheme, group = options.spec, options.group
    scale = scheme.scale_bytes if scheme.scale_bytes is not None else dtype_bytes
    extra = scheme.shape_bytes + scheme.global_scale_bytes  # per Linear
    total = size.total
    for name, (out, inputs) in quantized_linears(moe).items():
        total -= out * inputs * dtype_bytes - scheme.linear_bytes(out, inputs, group, dtype_bytes)
        total += 2 * (len(name) + 16 + HEADER_ENTRY)  # two more tensors beside the codes
    layers = []
    for gated, m, lay in zip(_gated(moe), moe.layers, size.layers):
        h = m.hidden_size
        ups = 2 if gated else 1
        row = h * scheme.bits // 8 + (h // group if scheme.grouped else 1) * scale
        per_neuron = ups * row + h * scheme.bits // 8 + (h * scale // group if scheme.grouped else 0)
        per_expert = (ups + 1) * extra + (0 if scheme.grouped else h * scale)
        name = f"model.layers.{m.index}.mlp.experts.{lay.experts}.gate_proj.weight_packed"
        names = (ups + 1) * 3 * (len(name) + 16 + HEADER_ENTRY)  # the header entries of its tensors
        quantized = replace(lay, per_neuron=per_neuron, per_expert=per_expert + names)
        total -= lay.experts * (lay.expert() - quantized.expert())
        layers.append(quantized)
    group_text = f", groups of {group}" if scheme.grouped else ""
    return WeightBytes(
        f"compressed-tensors {scheme.name}{group_text}", total, tuple(layers), size.linear_neurons
    )


def quantized_dims(moe: MoEModel) -> list[int]:
    """Every input width llm-compressor will group: the Linears' inputs and each expert's hidden size."""
    return sorted({i for _, i in quantized_linears(moe).values()} | {m.hidden_size for m in moe.layers})


__all__ = ["IGNORE", "LayerBytes", "quantized_dims", "quantized_linears", "quantized_weight_bytes"]
