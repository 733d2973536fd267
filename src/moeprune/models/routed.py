"""moeprune's own routed-experts computation, swapped in reversibly when a stage needs it.

The router still runs unchanged; only the experts' computation is replaced, by one that runs
each expert on exactly the tokens routed to it and can (a) report each expert's unweighted
output to an observer, (b) substitute a novice (a constant vector, or a low-rank affine map of
the expert's input), (c) mask intermediate neurons.
Swapping an instance's `forward` touches no weights and is undone on exit.
Where torch has a grouped product for the layer (models/grouped.py), every expert of a call runs in
two grouped products without a host synchronisation; elsewhere, one expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.grouped import expert_offsets, grouped_expert_forward, grouped_supported
from moeprune.models.lowrank import LowRankNovice, novice_output


@dataclass
class RoutedRows:
    """Every (token, selected expert) pair of one layer call, grouped by expert (ascending id)."""

    rows: torch.Tensor  # [N] token row in the flattened batch
    experts: torch.Tensor  # [N] expert position
    inputs: torch.Tensor  # [N, d] block input h_t (before any input weighting)
    outputs: torch.Tensor  # [N, d] unweighted expert output E_i (Llama-4: E_i(g h))
    weights: torch.Tensor  # [N] applied routing weight g_i(t)
    intermediate: torch.Tensor | None  # [N, I] gated activations m (when asked for)


LayerCallback = Callable[[MoELayer, RoutedRows], None]


@dataclass
class RoutedOptions:
    """What the replacement computation does besides computing the experts."""

    on_layer: LayerCallback | None = None
    need_intermediate: bool = False
    # layer -> expert -> [d] constant mu, or a low-rank novice c + U (V^T h) (models/lowrank.py)
    novices: Mapping[int, Mapping[int, torch.Tensor | LowRankNovice]] = field(default_factory=dict)
    neuron_masks: Mapping[int, Mapping[int, torch.Tensor]] = field(
        default_factory=dict
    )  # layer -> expert -> [I]
    # Run a layer's experts as two grouped products where torch can (models/grouped.py); False
    # keeps the per-expert loop everywhere (the reference the grouped form is tested against).
    grouped: bool = True


def routed_compute(
    layer: MoELayer, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, options: RoutedOptions
) -> torch.Tensor:
    """sum_j g_j E_{i_j}(h) over the selected experts (Llama-4: sum_j E_{i_j}(g_j h)).

    Indices past the weighted experts select extra experts without weights (LongCat-Flash's zero
    experts): the experts module's own code computes them, and they are never reported to the
    observer, so no statistic of a weighted expert counts a token routed to one."""
    if options.grouped and not options.novices.get(layer.index) and grouped_supported(layer, hidden):
        assert isinstance(layer, MoELayer)  # grouped_supported says so
        return _grouped_compute(layer, hidden, index, weights, options)
    tokens, top_k = index.shape
    out = torch.zeros_like(hidden, dtype=torch.float32)  # top-k sums in fp32, as transformers' kernels do
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
    flat_weights = weights.reshape(-1)
    novices = options.novices.get(layer.index, {})
    masks = options.neuron_masks.get(layer.index, {})
    on_layer = options.on_layer
    record = on_layer is not None
    want_m = options.need_intermediate and record
    parts: list[tuple] = []
    start = 0
    weighted = layer.num_experts
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        picked = order[start : start + n]
        start += n
        rows = picked // top_k
        if expert >= weighted:  # an extra (zero / identity) expert: its module's own computation
            y = _extra_expert(layer, hidden[rows], expert, flat_weights[picked])
            out.index_add_(0, rows, y.to(out.dtype))
            continue
        x = hidden[rows]
        g = flat_weights[picked]
        x_in = x * g.unsqueeze(1).to(x.dtype) if layer.spec.weight_on_input else x
        m = None
        if expert in novices:
            y = novice_output(novices[expert], x_in)
        else:
            y, m = layer.expert_forward(expert, x_in, return_intermediate=True, neuron_mask=masks.get(expert))
        contribution = y if layer.spec.weight_on_input else y * g.unsqueeze(1).to(y.dtype)
        out.index_add_(0, rows, contribution.to(out.dtype))
        if record:
            parts.append((rows, x, y, m if want_m else None, g))
    if on_layer is not None and parts:
        on_layer(layer, _gather(parts, index, order))
    return out.to(hidden.dtype)


def _grouped_compute(
    layer: MoELayer, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, options: RoutedOptions
) -> torch.Tensor:
    """The per-expert loop above as one sort and two grouped products, with no host
    synchronisation: the same rows in the same order (stable sort by expert id), the same
    per-expert products, the same fp32 top-k sum (index_add_ in expert order per token)."""
    top_k = index.shape[1]
    ids, order = torch.sort(index.reshape(-1), stable=True)
    rows = order // top_k
    x = hidden[rows]
    g = weights.reshape(-1)[order]
    x_in = x * g.unsqueeze(1).to(x.dtype) if layer.spec.weight_on_input else x
    masks = options.neuron_masks.get(layer.index)
    mask_rows = _mask_rows(layer, masks, x)[ids] if masks else None
    y, m = grouped_expert_forward(layer, x_in, ids, expert_offsets(ids, layer.num_experts), mask_rows)
    contribution = y if layer.spec.weight_on_input else y * g.unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(hidden, dtype=torch.float32)
    out.index_add_(0, rows, contribution.to(out.dtype))
    if options.on_layer is not None:
        want_m = options.need_intermediate
        options.on_layer(layer, RoutedRows(rows, ids, x, y, g, m if want_m else None))
    return out.to(hidden.dtype)


def _mask_rows(layer: MoELayer, masks: Mapping[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[E, I] neuron masks of every expert (ones where an expert has none): x 1 is exact, so
    unmasked experts keep their activations bit for bit."""
    width = next(iter(masks.values())).shape[-1]
    table = torch.ones(layer.num_experts, width, dtype=like.dtype, device=like.device)
    table[list(masks)] = torch.stack([masks[e].to(like.device, like.dtype) for e in masks])
    return table


def _extra_expert(layer: MoELayer, x: torch.Tensor, expert: int, g: torch.Tensor) -> torch.Tensor:
    """g * E(x) for rows routed to extra expert `expert`, computed by the experts class's own
    forward (not a copy of it: an identity, zero or null expert stays whatever the family says)."""
    experts = layer.experts
    if layer.spec.extra_experts == 0:
        raise MoePruneError(
            f"decoder layer {layer.index}: the router selected expert {expert}, past its {layer.num_experts} "
            "experts (no extra experts are known to this layer)"
        )
    # two selections per row, the second weighted 0 (exactly nothing added): LongCat's forward
    # squeezes its one-hot mask and breaks on a single column
    index = torch.full((x.shape[0], 2), expert, dtype=torch.long, device=x.device)
    weights = torch.stack((g, torch.zeros_like(g)), dim=1).to(x.dtype)
    # the family's own class (a packed module's stock base: its zero experts touch no weights)
    stock: Any = next(
        c for c in type(experts).__mro__ if "forward" in vars(c) and not getattr(c, "moeprune_packed", False)
    )
    return stock.forward(experts, x, index, weights)


def _gather(parts: list[tuple], index: torch.Tensor, order: torch.Tensor) -> RoutedRows:
    """Concatenate per-expert pieces; rows stay grouped by ascending expert id (only the
    weighted experts' rows: extra experts, whose ids sort last, are left out)."""
    rows, x, y, m, g = zip(*parts)
    rows_cat = torch.cat(rows)
    return RoutedRows(
        rows=rows_cat,
        experts=index.reshape(-1)[order][: rows_cat.shape[0]],
        inputs=torch.cat(x),
        outputs=torch.cat([t.expand(t.shape) for t in y]),
        weights=torch.cat(g),
        intermediate=torch.cat(m) if m[0] is not None and all(t is not None for t in m) else None,
    )


def _experts_forward(layer: MoELayer, options: RoutedOptions):
    def forward(hidden_states, top_k_index=None, top_k_weights=None, **_: object):
        return routed_compute(layer, hidden_states, top_k_index, top_k_weights, options)

    return forward


def input_weighted_block_forward(layer: MoELayer, options: RoutedOptions):
    """Llama-4's block, computing only the selected experts (transformers runs all of them)."""
    block = layer.block

    def forward(hidden_states):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores, logits = block.router(hidden)
        index = torch.topk(logits, layer.top_k, dim=1).indices  # the router's own selection rule
        weights = scores.gather(1, index)
        out = block.shared_expert(hidden)
        out = out + routed_compute(layer, hidden, index, weights, options)
        return out, logits

    return forward


@contextmanager
def override_routed(moe: MoEModel, options: RoutedOptions) -> Iterator[None]:
    """Replace the routed computation of every MoE layer with something to do (recording, novices,
    neuron masks) for the duration of the context; the others keep transformers' own kernels."""
    with ExitStack() as stack:
        for layer in moe.layers:
            idle = (
                options.on_layer is None
                and not options.novices.get(layer.index)
                and not options.neuron_masks.get(layer.index)
            )
            if idle:
                continue
            if getattr(layer.experts, "moeprune_packed", False):
                stack.enter_context(_override_packed(layer, options))
                continue
            if layer.spec.weight_on_input:
                target, forward = layer.block, input_weighted_block_forward(layer, options)
            else:
                target, forward = layer.experts, _experts_forward(layer, options)
            had_own = "forward" in target.__dict__
            previous = target.__dict__.get("forward")
            target.forward = forward
            stack.callback(_restore_forward, target, had_own, previous)
        yield


@contextmanager
def _override_packed(layer: MoELayer, options: RoutedOptions) -> Iterator[None]:
    """A packed layer (moeprune format) keeps its own novices and widths; recording and extra
    masks are added on top. Neuron statistics need one width for all experts: refused.

    Packed experts describe themselves (`routed_view`, models/packed.py), so this module needs
    no knowledge of how they are stored."""
    if options.need_intermediate:
        raise MoePruneError(
            f"decoder layer {layer.index} is packed (novices or per-expert widths): its neurons cannot be "
            "observed again; start from the original checkpoint"
        )
    packed: Any = layer.experts  # a packed experts module (models/packed.py), which describes itself
    view = packed.routed_view(layer.block)
    merged = RoutedOptions(
        on_layer=options.on_layer,
        novices={
            layer.index: {
                **view.options().novices.get(layer.index, {}),
                **options.novices.get(layer.index, {}),
            }
        },
        neuron_masks=options.neuron_masks,
    )
    if layer.spec.weight_on_input:
        target, forward = layer.block, input_weighted_block_forward(view, merged)
    else:
        target = layer.experts

        def forward(hidden_states, top_k_index=None, top_k_weights=None, **_: object):
            return routed_compute(view, hidden_states, top_k_index, top_k_weights, merged)

    had_own, previous = "forward" in target.__dict__, target.__dict__.get("forward")
    target.forward = forward
    try:
        yield
    finally:
        _restore_forward(target, had_own, previous)


def _restore_forward(module: torch.nn.Module, had_own: bool, previous) -> None:
    if had_own:
        module.forward = previous
    else:
        del module.forward
