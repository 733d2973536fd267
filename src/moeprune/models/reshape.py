"""Expert removal, the mechanism: virtual (reversible router slicing) and physical (tensors
sliced for good).

Both forms slice the router's own per-expert tensors (router rows, router bias, selection
bias) to the kept experts, so the router runs its unchanged code on the survivors. The virtual
form then maps the router's indices back to original ids and leaves the expert tensors alone:
no expert weight is copied, and the result equals physical removal by construction.

Which experts go is decided elsewhere (surgery/drop.py builds the plan); loading a pruned
checkpoint reshapes the stock layer with the same functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from moeprune.errors import MoePruneError
from moeprune.models.adapter import EXPERT_IDS_ATTR, MoELayer, MoEModel, get_path, set_path


def check_not_packed(moe: MoEModel | Sequence[MoELayer]) -> None:
    """Refuse to prune a packed result again: its router positions map onto novices and
    per-expert widths that drop, novice and neuron surgery do not know how to renumber."""
    for layer in moe.layers if isinstance(moe, MoEModel) else moe:
        if getattr(layer.experts, "moeprune_packed", False):
            raise MoePruneError(
                f"decoder layer {layer.index} is packed (moeprune format: novices or per-expert widths), "
                "so it cannot be pruned again; prune the original checkpoint instead"
            )


def kept_experts(layer: MoELayer, removed: Sequence[int]) -> list[int]:
    """Positions (in the block's current storage) that survive removing `removed`."""
    check_not_packed([layer])
    if layer.kept_whole and removed:  # the one gate every mask and drop passes (allocations never ask)
        raise MoePruneError(f"decoder layer {layer.index} is kept whole: its router {layer.kept_whole}")
    n = layer.num_experts
    bad = [e for e in removed if not 0 <= e < n]
    if bad:
        raise MoePruneError(f"layer {layer.index}: expert ids {bad} out of range (it has {n} experts)")
    removed_set = set(removed)
    kept = [e for e in range(n) if e not in removed_set]
    if len(kept) < layer.top_k:
        raise MoePruneError(
            f"layer {layer.index}: removing {len(removed_set)} of {n} experts leaves {len(kept)}, "
            f"fewer than its top-k ({layer.top_k}); remove at most {n - layer.top_k}"
        )
    check_group_balance(layer, removed_set)
    return kept


def check_group_balance(layer: MoELayer, removed: set[int]) -> None:
    """Group-limited routers view experts as [n_group, E / n_group]: every group must lose the same."""
    groups = layer.n_group
    if groups <= 1:
        return
    size = layer.num_experts // groups
    per_group = [sum(1 for e in removed if e // size == g) for g in range(groups)]
    if len(set(per_group)) != 1:
        raise MoePruneError(
            f"layer {layer.index} routes within {groups} groups of {size} experts; removals per group "
            f"{per_group} are unbalanced: remove the same number from every group"
        )
    left = size - per_group[0]
    if left < 2 or left * layer.topk_group < layer.top_k:
        raise MoePruneError(
            f"layer {layer.index}: {left} experts per group left is too few for group-limited top-{layer.top_k} "
            f"routing over {layer.topk_group} groups"
        )


def with_extra(kept: torch.Tensor, count: int, extra: int) -> torch.Tensor:
    """The kept weighted rows followed by every extra expert's row (rows count..count+extra-1):
    zero or null experts stay routed whatever is pruned."""
    if not extra:
        return kept
    return torch.cat((kept, torch.arange(count, count + extra, dtype=kept.dtype, device=kept.device)))


def _rows(tensor: torch.Tensor, dim: int, kept: torch.Tensor, count: int, extra: int) -> torch.Tensor:
    """`tensor`'s kept rows along `dim`: the weighted ones, and the extra experts' when it has them."""
    index = with_extra(kept, count, extra) if extra and tensor.shape[dim] == count + extra else kept
    return tensor.detach().index_select(dim, index.to(tensor.device))


def _slice_router(layer: MoELayer, kept: torch.Tensor) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Replace the routing's per-expert tensors (on the router, and any the block holds) by
    their kept rows (the extra experts' rows kept after them); returns the originals."""
    originals = []
    count, extra = layer.num_experts, layer.spec.extra_experts
    for owner, path, dim in layer.routing_tensors():
        tensor = get_path(owner, path)
        originals.append((owner, path, tensor))
        set_path(owner, path, _rows(tensor, dim, kept, count, extra))
    return originals


def _set_counts(
    layer: MoELayer, modules: Sequence[nn.Module], count: int
) -> list[tuple[nn.Module, str, int]]:
    changed = []
    totals = {attr: count + layer.spec.extra_experts for attr in layer.spec.total_count_attrs}
    for module in modules:
        for attr, value in {**dict.fromkeys(layer.spec.count_attrs, count), **totals}.items():
            if hasattr(module, attr) and isinstance(getattr(module, attr), int):
                changed.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
    return changed


def _remap_hook(layer: MoELayer, kept: torch.Tensor, total: int):
    """Forward hook mapping the sliced router's outputs back to the block's expert positions
    (an extra expert's index, past the kept weighted ones, back to its own position)."""
    if layer.spec.weight_on_input:  # Llama-4: (scores [T, E'], logits [T, E']) -> full width

        def expand(module, args, output):
            scores, logits = output
            full_scores = scores.new_zeros(scores.shape[0], total)
            full_logits = logits.new_full((logits.shape[0], total), float("-inf"))
            idx = kept.to(scores.device)
            full_scores[:, idx] = scores
            full_logits[:, idx] = logits
            return full_scores, full_logits

        return expand

    position = layer.spec.router_index_position
    kept = with_extra(kept, total, layer.spec.extra_experts)

    def remap(module, args, output):
        indices = output[position]
        return tuple(kept.to(indices.device)[indices] if i == position else t for i, t in enumerate(output))

    return remap


@contextmanager
def mask_experts(moe: MoEModel, removed: Mapping[int, Sequence[int]]) -> Iterator[None]:
    """Temporarily remove experts from routing ({decoder layer: expert positions}).

    Reversible and copy-free for expert weights: only the router's per-expert rows are sliced.
    """
    with ExitStack() as stack:
        for layer_index, experts in removed.items():
            if not experts:
                continue
            layer = moe.layer(layer_index)
            device = get_path(layer.router, layer.spec.router_tensors[0][0]).device
            kept = torch.tensor(
                kept_experts(layer, experts), dtype=torch.long, device=device
            )  # one copy, not one per call
            originals = _slice_router(layer, kept)
            counts = _set_counts(layer, [layer.router], len(kept))
            handle = layer.router.register_forward_hook(_remap_hook(layer, kept, layer.num_experts))
            stack.callback(_restore, layer, originals, counts, handle)
        yield


def _restore(layer: MoELayer, originals, counts, handle) -> None:
    handle.remove()
    for owner, path, tensor in originals:
        set_path(owner, path, tensor)
    for module, attr, value in counts:
        setattr(module, attr, value)


def drop_experts(moe: MoEModel, removed: Mapping[int, Sequence[int]]) -> None:
    """Physically delete experts: router rows and biases, expert tensors, counts, config field."""
    for layer_index, experts in removed.items():
        if not experts:
            continue
        layer = moe.layer(layer_index)
        positions = kept_experts(layer, experts)
        kept = torch.tensor(positions, dtype=torch.long)
        original_ids = layer.expert_ids
        n = layer.num_experts
        _slice_router(layer, kept)
        extra = layer.spec.extra_experts
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            if param.dim() >= 1 and param.shape[0] in (n, n + extra):
                set_path(layer.experts, name, _rows(param, 0, kept, n, extra))
        _set_counts(layer, [layer.block, layer.router, layer.experts], len(positions))
        setattr(layer.block, EXPERT_IDS_ATTR, [original_ids[p] for p in positions])
    sync_config_counts(moe)


def sync_config_counts(moe: MoEModel) -> None:
    """Set the config's expert-count field when every MoE layer agrees (stock reload needs it)."""
    counts = {layer.num_experts for layer in moe.layers}
    if len(counts) == 1:
        setattr(moe.config, moe.spec.count_field, counts.pop())
