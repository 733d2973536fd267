"""What a checkpoint's weights weigh in the format a prune writes, from the shard headers alone.

A size target is met before any weight is read, so the bytes come from the safetensors headers
(every stored tensor's dtype and shape) and the model on the meta device (which tensors are
routed experts and router rows, and how an expert's size grows with its width). The files'
headers count too, bounded by the input's (`header_bound`): the result's headers list fewer or
the same tensors under the same names, or fewer packed ones; so a target is met with the exact
tensor bytes plus that bound (for a real checkpoint the headers are well under 0.1 %). Two formats:

- cast to a floating dtype (the in-memory pipeline saves every floating tensor in `--save-dtype`,
  else the stored dtype): bytes are elements times that dtype's size, other tensors as stored;
- as stored (the no-load pipeline, and a kept quantization, copy tensors byte for byte):
  block-scaled fp8 experts weigh their fp8 bytes plus their `weight_scale_inv` scales, mxfp4
  ones their codes plus their exponents, read key by key from the layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from moeprune.checkpoint.files import StoredTensor, header_bytes, stored_dtype, stored_tensors
from moeprune.checkpoint.structure import read_config_dict
from moeprune.models import MoEModel
from moeprune.models.adapter import MoELayer, get_path
from moeprune.models.packed import layer_cost
from moeprune.quant import quantization_of
from moeprune.shards.layout import CheckpointLayout
from moeprune.surgery.neurons import shared_multiplier, stock_width_expressible
from moeprune.surgery.sizes import LayerBytes, SavedTensors, WeightBytes

HEADER_SLACK = 8  # bytes per tensor a result's header may add to the input's (longer offsets, dtype names)
_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors dtypes a save casts, and their sizes
_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _nbytes(t: StoredTensor) -> int:
    return t.end - t.start


def header_bound(path: Path) -> int:
    """A bound on the headers of a result made of (some of) this checkpoint's tensors: the input's
    headers plus `HEADER_SLACK` bytes per tensor and 8 per file (headers are padded to 8 bytes)."""
    tensors = stored_tensors(path)
    files = {t.file for t in tensors.values()}
    return header_bytes(path) + HEADER_SLACK * (len(tensors) + len(files))


def _routing_elements(layer: MoELayer) -> int:
    """Elements of one expert's router rows and per-expert routing tensors (a row's size: a router
    also scoring extra experts, LongCat's zero experts, has more rows than experts)."""
    return sum(
        (t := get_path(owner, path)).numel() // t.shape[dim] for owner, path, dim in layer.routing_tensors()
    )


def _shared(moe: MoEModel, layer: MoELayer) -> tuple[int, int]:
    """(width, elements per neuron) of a shared expert a neuron shrink zero-pads (neurons.py), else (0, 0):
    a family whose stock form cannot hold a narrower width is packed, its shared expert unpadded."""
    if (
        not moe.spec.shared_width_derived
        or shared_multiplier(moe) is None
        or not stock_width_expressible(moe)
    ):
        return 0, 0
    width = per_neuron = 0
    for module in layer.shared_modules:
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
            continue
        assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(down, nn.Linear)
        width = gate.out_features
        per_neuron += gate.in_features + up.in_features + down.out_features
        per_neuron += (gate.bias is not None) + (up.bias is not None)
    return width, per_neuron


def cast_weight_bytes(path: str | Path, moe: MoEModel, dtype: torch.dtype) -> WeightBytes:
    """The checkpoint's weights with every floating tensor saved as `dtype` (the in-memory pipeline)."""
    size = torch.empty((), dtype=dtype).element_size()
    header = header_bound(Path(path))  # the result's headers name at most these tensors
    total = header
    tensors = stored_tensors(Path(path))
    for t in tensors.values():
        total += math.prod(t.shape) * size if t.dtype in _FLOATS else _nbytes(t)
    name = _NAMES.get(dtype, "F8_E4M3")  # another dtype: a name at least as long
    saved = SavedTensors(
        header,
        len({t.file for t in tensors.values()}),
        tuple((k, name if t.dtype in _FLOATS else t.dtype, t.shape) for k, t in tensors.items()),
    )
    layers = []
    for m in moe.layers:
        cost = layer_cost(m)
        shared_width, shared_per_neuron = _shared(moe, m)
        layers.append(
            LayerBytes(
                experts=m.num_experts,
                width=m.intermediate_size,
                per_neuron=cost.per_neuron * size,
                per_expert=cost.per_expert * size,
                router_row=_routing_elements(m) * size,
                novice=m.hidden_size * size,
                shared_width=shared_width,
                shared_per_neuron=shared_per_neuron * size,
            )
        )
    return WeightBytes(str(dtype).removeprefix("torch."), total, tuple(layers), saved=saved)


def stored_weight_bytes(layout: CheckpointLayout) -> WeightBytes:
    """The checkpoint's weights as stored (the no-load pipeline copies them byte for byte): an fp8
    expert weighs its fp8 tensors and their scales, exactly as the headers say."""
    tensors = layout.tensors
    total = header_bound(layout.path) + sum(_nbytes(t) for t in tensors.values())
    layers = []
    fused = {p.fused for lay in layout.layers for p in lay.experts.values() if p.fused}
    for lay, m in zip(layout.layers, layout.moe.layers):
        n = lay.num_experts  # the rows of extra experts (LongCat's zero experts' gate/up) are no expert's
        keys = [k for p in lay.experts.values() for k in ([p.fused] if p.fused else [])]
        keys += [k for p in lay.experts.values() for e in p.parts if e < n for k in p.keys(e)]
        scales = [s for p in lay.experts.values() for s in p.scales.values()]
        scales += [c for k in keys for c in layout.companions.get(k, ())]  # mxfp4 / compressed-tensors
        routed = sum(
            _nbytes(tensors[k]) * n // tensors[k].shape[0] if k in fused else _nbytes(tensors[k])
            for k in keys
        )
        routed += sum(_nbytes(tensors[k]) for k in scales)
        # one row of each routing tensor (a router scoring extra experts has more rows than experts)
        router_row = sum(_nbytes(tensors[key]) // tensors[key].shape[dim] for key, dim in lay.router.values())
        per_expert = routed // lay.num_experts
        cost = layer_cost(m)
        item = per_expert // cost.params(m.intermediate_size) if not scales else 0
        shared_width, shared_per_neuron = _shared(layout.moe, m)
        layers.append(
            LayerBytes(
                experts=lay.num_experts,
                width=m.intermediate_size,
                per_neuron=cost.per_neuron * item,
                per_expert=per_expert - cost.per_neuron * item * m.intermediate_size,
                router_row=router_row,
                novice=m.hidden_size * item,
                shared_width=shared_width,
                shared_per_neuron=shared_per_neuron * item,
            )
        )
    quantized = layout.fp8 is not None or bool(layout.companions)
    return WeightBytes(stored_format(layout.path), total, tuple(layers), linear_neurons=not quantized)


def stored_format(path: str | Path) -> str:
    """The checkpoint's format in words: its quantization ("float8_e4m3fn (fp8, 128x128 blocks)"),
    else the floating dtype holding most of its bytes."""
    quantized = quantization_of(read_config_dict(Path(path)))
    if quantized is not None:
        return f"float8_e4m3fn ({quantized})" if quantized.startswith("fp8") else quantized
    dtype = stored_dtype(Path(path))
    return str(dtype).removeprefix("torch.") if dtype is not None else "unknown"
