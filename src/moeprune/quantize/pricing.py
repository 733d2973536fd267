"""The bytes a `--quantize` result will have, from the model's structure alone (no weight read).

`moeprune.quantize.schemes` says what one quantized Linear weighs; this module applies it to a model:
every Linear llm-compressor quantizes (attention, dense and shared MLPs, each routed expert's
projections) is replaced by its codes and scales, and everything it leaves alone (embeddings,
norms, the routers, lm_head, biases) keeps the size it has in the saved dtype. The result is a
`WeightBytes` like the full-precision one, so the same target-size solver and planned sizes
(surgery/target_size.py) work in quantized bytes: a routed expert of width w weighs
`per_neuron * w + per_expert` there too (gate and up add one row of `hidden` inputs per neuron,
down one column: `hidden` codes and, in groups, `hidden / G` scales).

The headers grow: compressed-tensors stores each quantized Linear as two or three tensors (codes,
scales, and the shape or a global scale), the experts under per-expert names. They are counted
afresh, entry by entry: a safetensors header is `{"__metadata__":{"format":"pt"},"name":{"dtype":
"I32","shape":[a,b],"data_offsets":[s,e]},...}` padded to 8 bytes, so an entry's length is known
from its name, dtype and shape but for the offsets' digits, which are bounded by those of the
unpruned, unquantized tensor bytes (no offset of any quantized result exceeds them, whatever
scheme each layer takes). The safetensors writer's tensor order is not assumed, so it stays an
upper bound and a `--target-size` is never exceeded; on the quick demo model it is within 0.2 %
of the bytes written (docs/quantization.md). A tensor the result keeps as it is (embeddings,
norms, routers) is counted from the input's header entry, with the saved dtype's name.
"""

from __future__ import annotations

import re
from dataclasses import replace

from torch import nn

from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.quantize.schemes import QuantizeOptions
from moeprune.surgery.sizes import LayerBytes, WeightBytes

# what llm-compressor is told to leave alone: lm_head and the routers (a router is an nn.Linear in
# some families, a module of its own in others: both named `mlp.gate`)
IGNORE = ("lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$")
FILE_BYTES = 8 + 7 + len('{"__metadata__":{"format":"pt"}}')  # a file's length field, padding, braces
# what `dtype_bytes` floats are saved as (2: the longer of BF16 and F16, a bound)
_FLOAT_NAMES = {2: "BF16", 4: "F32", 8: "F64"}


def ignored(name: str) -> bool:
    for pattern in IGNORE:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], name) or name == pattern:
            return True
    return False


def entry_bytes(name: str, dtype: str, shape: tuple[int, ...], digits: int) -> int:
    """Bytes of one header entry (with the comma before it) whose offsets have at most `digits` digits."""
    offset = "9" * digits
    dims = ",".join(map(str, shape))
    return len(f',"{name}":{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{offset},{offset}]}}')


def linear_tensors(
    options: QuantizeOptions, out: int, inputs: int, dtype: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(suffix, dtype, shape) of the tensors compressed-tensors stores for one quantized Linear weight
    [out, inputs] (symmetric schemes: no zero point); their bytes are `Scheme.linear_bytes`."""
    scheme, group = options.spec, options.group
    if scheme.name == "fp8-dynamic":
        return [("weight", "F8_E4M3", (out, inputs)), ("weight_scale", dtype, (out, 1))]
    if scheme.name == "nvfp4a16":
        return [
            ("weight_packed", "U8", (out, inputs // 2)),
            ("weight_scale", "F8_E4M3", (out, inputs // group)),
            ("weight_global_scale", "F32", (1,)),
        ]
    return [  # pack-quantized: int32 words of 32 / bits codes
        ("weight_packed", "I32", (out, inputs * scheme.bits // 32)),
        ("weight_scale", dtype, (out, inputs // group)),
        ("weight_shape", "I64", (2,)),
    ]


def linear_entries(
    name: str, options: QuantizeOptions, out: int, inputs: int, dtype: str, digits: int
) -> int:
    """Header bytes of one quantized Linear `name`'s tensors."""
    return sum(
        entry_bytes(f"{name}.{suffix}", d, shape, digits)
        for suffix, d, shape in linear_tensors(options, out, inputs, dtype)
    )


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
    with `options`: the tensors' bytes exact, the headers counted afresh (module docstring)."""
    scheme, group = options.spec, options.group
    scale = scheme.scale_bytes if scheme.scale_bytes is not None else dtype_bytes
    extra = scheme.shape_bytes + scheme.global_scale_bytes  # per Linear
    saved = size.saved
    total = size.total - (saved.header if saved else 0)  # the tensors' bytes
    # no offset in any file exceeds the unquantized tensors' bytes: nor those of a result with any
    # mix of schemes (per-layer precision prices each layer's from another call)
    digits = len(str(total))
    linears = quantized_linears(moe)
    for out, inputs in linears.values():
        total -= out * inputs * dtype_bytes - scheme.linear_bytes(out, inputs, group, dtype_bytes)
    layers = []
    for gated, m, lay in zip(_gated(moe), moe.layers, size.layers):
        h = m.hidden_size
        ups = 2 if gated else 1
        row = h * scheme.bits // 8 + (h // group if scheme.grouped else 1) * scale
        per_neuron = ups * row + h * scheme.bits // 8 + (h * scale // group if scheme.grouped else 0)
        per_expert = (ups + 1) * extra + (0 if scheme.grouped else h * scale)
        quantized = replace(lay, per_neuron=per_neuron, per_expert=per_expert)
        total -= lay.experts * (lay.expert() - quantized.expert())
        layers.append(quantized)
    dtype = _FLOAT_NAMES.get(dtype_bytes, "F8_E4M3")
    paths = _experts_paths(moe)
    header = 0
    if saved is not None:  # what the result keeps as it is, entry by entry
        header += FILE_BYTES * (saved.files + 1)  # one file more: the MTP layers' beside the rest
        for name, d, shape in saved.tensors:
            if name.startswith(paths) or name.removesuffix(".weight") in linears and name.endswith(".weight"):
                continue
            header += entry_bytes(name, d, shape, digits)
    for name, (out, inputs) in linears.items():
        header += linear_entries(name, options, out, inputs, dtype, digits)
    for i, (gated, m, lay) in enumerate(zip(_gated(moe), moe.layers, layers)):
        # one expert's entries, under the longest index (lay.experts) and the unpruned widths
        prefix = f"{paths[i]}{lay.experts}."
        shapes = [("gate_proj", lay.width, m.hidden_size)] if gated else []
        shapes += [("up_proj", lay.width, m.hidden_size), ("down_proj", m.hidden_size, lay.width)]
        names = sum(linear_entries(prefix + p, options, o, n, dtype, digits) for p, o, n in shapes)
        layers[i] = replace(lay, per_expert=lay.per_expert + names)
        header += lay.experts * names
    total += header
    group_text = f", groups of {group}" if scheme.grouped else ""
    return WeightBytes(
        f"compressed-tensors {scheme.name}{group_text}", total, tuple(layers), size.linear_neurons
    )


def _experts_paths(moe: MoEModel) -> tuple[str, ...]:
    """Per MoE layer, the routed experts' module path with its dot (`model.layers.0.mlp.experts.`)."""
    names = {id(module): name for name, module in moe.model.named_modules()}
    return tuple(f"{names[id(layer.experts)]}." for layer in moe.layers)


def quantized_dims(moe: MoEModel) -> list[int]:
    """Every input width llm-compressor will group: the Linears' inputs and each expert's hidden size."""
    return sorted({i for _, i in quantized_linears(moe).values()} | {m.hidden_size for m in moe.layers})


__all__ = ["IGNORE", "LayerBytes", "quantized_dims", "quantized_linears", "quantized_weight_bytes"]
