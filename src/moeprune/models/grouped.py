"""Every routed expert of one layer call in two grouped products (`torch._grouped_mm`).

Why: moeprune's per-expert loop (models/routed.py) launches about ten kernels per expert and
reads the expert counts back to the host, so on a GPU an observation pass was launch-bound
(11k kernels where the model's own forward, which transformers runs as grouped products, needs
1.5k). Here the rows are sorted by expert once and each product covers every expert: on CUDA in
bf16 (sm90+) one CUTLASS kernel without a host synchronisation; fp32 and fp16 on CUDA run ATen's
per-group fallback (one synchronisation per product); on a CPU, ATen's loop of matrix products,
which gives the same bits as the per-expert `F.linear` (tests/models/test_grouped_routed.py).

The products are the adapter's own per-expert computation (`MoELayer.expert_forward`) with the
expert index made a row attribute: same weights, same activation (the family's `_apply_gate` or
`act_fn`), same neuron masks. Where the grouped kernel is missing or refuses the tensors (an old
torch, unaligned strides), `grouped_supported` says no and the caller keeps the per-expert loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from moeprune.models.adapter import MoELayer, own_gate
from moeprune.models.spec import DOWN_IS_D_BY_I, FUSED, INTERLEAVED, TRANSPOSED, UNGATED

_WORKS: dict[tuple[str, torch.dtype], bool] = {}  # (device, dtype) -> whether the kernel ran and was right


@dataclass
class GroupedWeights:
    """One layer's experts as [E, in, out] operands of `torch._grouped_mm` (views, no copies)."""

    first: torch.Tensor  # [E, d, 2I] gate and up (or [E, d, I] up alone)
    first_bias: torch.Tensor | None  # [E, 2I]
    down: torch.Tensor  # [E, I, d]
    down_bias: torch.Tensor | None  # [E, d]


def grouped_weights(layer: MoELayer) -> GroupedWeights:
    experts: Any = layer.experts  # a family's experts module: its tensors are read by name
    layout = layer.spec.layout
    if layout == UNGATED:
        return GroupedWeights(
            experts.up_proj.transpose(-2, -1), None, experts.down_proj.transpose(-2, -1), None
        )
    if layout == FUSED:
        return GroupedWeights(
            experts.gate_up_proj.transpose(-2, -1), None, experts.down_proj.transpose(-2, -1), None
        )
    if layout == INTERLEAVED:
        return GroupedWeights(
            experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias
        )
    return GroupedWeights(experts.gate_up_proj, None, experts.down_proj, None)  # TRANSPOSED


def down_matrices(layer: MoELayer) -> torch.Tensor:
    """[E, d, I]: every expert's W_down (`MoELayer.down_matrix` of each expert, stacked as a view)."""
    down: torch.Tensor = getattr(layer.experts, "down_proj")  # noqa: B009 (typed as a tensor)
    return down if layer.spec.layout in DOWN_IS_D_BY_I else down.transpose(-2, -1)


def aligned(tensor: torch.Tensor) -> bool:
    """The grouped kernels' layout rule: 16-byte aligned base and strides, one unit stride."""
    size = tensor.element_size()
    strides = tensor.stride()
    return (
        tensor.data_ptr() % 16 == 0
        and 1 in strides[-2:]
        and all(s * size % 16 == 0 for s in strides if s != 1)
    )


def grouped_supported(layer: object, hidden: torch.Tensor) -> bool:
    """Whether this layer's experts can run as grouped products on `hidden`'s device and dtype: a
    stock (unpacked) experts module of a known layout whose router selects only weighted experts,
    aligned tensors, and a `torch._grouped_mm` that ran correctly here once."""
    if not isinstance(layer, MoELayer) or layer.spec.extra_experts or hidden.shape[0] == 0:
        return False
    if getattr(layer.experts, "moeprune_packed", False) or layer.spec.layout not in (
        FUSED,
        TRANSPOSED,
        INTERLEAVED,
        UNGATED,
    ):
        return False
    weights = grouped_weights(layer)
    if weights.first.dtype != hidden.dtype or weights.first.device != hidden.device:
        return False
    width = weights.down.shape[1] * hidden.element_size()
    if hidden.shape[-1] * hidden.element_size() % 16 or width % 16:
        return False
    if not (aligned(weights.first) and aligned(weights.down)):
        return False
    if hidden.device.type == "cpu" and not rowwise_activation(layer):
        return False
    return grouped_mm_works(hidden.device, hidden.dtype)


def rowwise_activation(layer: MoELayer) -> bool:
    """Whether the activation runs row by row whatever the number of rows, so that one call over
    every expert's rows gives each row the bits a call per expert gives it (on a CPU).

    act(gate) * up on the gate and up halves (strided views) is applied row by row. A contiguous
    activation (an ungated expert, gpt-oss's interleaved gate, a family's own `_apply_gate`) is
    applied to the whole tensor at once, and a CPU's vectorised kernel computes the last few
    elements of a call with its scalar code, whose exp can round differently from the vector exp:
    over every expert at once the same row can fall elsewhere, so those layers keep the per-expert
    loop on a CPU (measured on the tiny models of every family: 1e-8 relative, 6 of 73 families).
    GPU elementwise kernels compute every element alike, so the rule is for CPUs only."""
    return layer.spec.layout in (FUSED, TRANSPOSED) and not own_gate(layer.experts)


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: does `torch._grouped_mm` exist, run, and equal a loop of products?
    (torch <= 2.8 has no CPU kernel; older GPUs none at all.)"""
    key = (str(device), dtype)
    if key not in _WORKS:
        _WORKS[key] = _try_grouped_mm(device, dtype)
    return _WORKS[key]


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(24, 16, generator=gen).to(device, dtype)
    b = torch.randn(3, 16, 8, generator=gen).to(device, dtype)
    offsets = torch.tensor([5, 5, 24], dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(a, b, offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = torch.cat((a[:5] @ b[0], a[5:] @ b[2]))
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def expert_offsets(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32 end row of each expert's group in rows sorted by expert id (no host sync)."""
    bounds = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)


def grouped_expert_forward(
    layer: MoELayer,
    x: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mask_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_{ids}(x), m) for rows x [N, d] sorted by expert id `ids`, groups ending at `offsets`.

    `mask_rows` [N, I] multiplies the intermediate activations (a virtual neuron mask per row)."""
    weights = grouped_weights(layer)
    pre = torch._grouped_mm(x, weights.first, offs=offsets)
    if weights.first_bias is not None:
        pre = pre + weights.first_bias[ids]
    layout, experts = layer.spec.layout, cast(Any, layer.experts)
    if layout == UNGATED:
        m = experts.act_fn(pre)
    elif layout == INTERLEAVED:
        m = experts._apply_gate(pre)
    else:
        gate_pre, up_pre = pre.chunk(2, dim=-1)
        m = layer.activate(gate_pre, up_pre)
    if mask_rows is not None:
        m = m * mask_rows
    if not aligned(m):  # a family's gate function returned a view: the kernel needs its own rows
        m = m.clone(memory_format=torch.contiguous_format)
    y = torch._grouped_mm(m, weights.down, offs=offsets)
    if weights.down_bias is not None:
        y = y + weights.down_bias[ids]
    return y, m
