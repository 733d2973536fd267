"""How a MoE block's router is found and checked: the module scoring the experts (an [E, d]
matrix beside them, or a wider one whose last rows score extra experts without weights), its
per-expert tensors, where its output holds the chosen experts, and whether it routes by token id
(hash routing: such a layer is kept whole). Read off the modules themselves, as the rest of
discovery (`models/discover.py`) is."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from moeprune.errors import UnsupportedModelError


def per_expert_tensors(module: nn.Module, count: int, recurse: bool, extra: int = 0) -> list[tuple[str, int]]:
    """(dotted path, expert axis) of every parameter and buffer with an axis of length `count`
    (or `count + extra`: rows for the extra experts follow the weighted ones')."""
    found = []
    lengths = {count, count + extra}
    tensors = list(module.named_parameters(recurse=recurse)) + list(module.named_buffers(recurse=recurse))
    for path, tensor in tensors:
        axes = [d for d, n in enumerate(tensor.shape) if n in lengths]
        if axes:
            found.append((path, axes[0]))
    return found


def find_router(block: nn.Module, count: int, hidden: int, extra: int = 0) -> tuple[str, str, int]:
    """(attribute of the router on the block, path of its [E, d] matrix inside the router, extra
    rows). A router called router or gate may score more than the E weighted experts: its last
    rows then belong to extra experts without weights (LongCat-Flash's zero experts, Inkling's
    shared-expert sink), which moeprune keeps; when the experts' own tensors carry extra rows,
    the router must carry exactly as many."""
    children = sorted(block.named_children(), key=lambda ac: ("router" not in ac[0], "gate" not in ac[0]))
    for attr, child in children:  # modules called router or gate first
        if attr == "experts" or "shared" in attr:
            continue
        for path, param in child.named_parameters():
            if param.dim() == 2 and tuple(param.shape) == (count + extra, hidden):
                return attr, path, extra
    for path, tensor in child_free_params(block):
        if tensor.dim() == 2 and tuple(tensor.shape) == (count, hidden):
            raise UnsupportedModelError(
                f"{type(block).__name__}'s router is a bare parameter ({path}), not a module: not supported yet"
            )
    wider = _wider_matrices(block, count, hidden)
    named = [w for w in wider if ("router" in w[0] or "gate" in w[0]) and "shared" not in w[0]]
    if not extra and len(named) == 1:  # the router scores extra experts after the weighted ones
        attr, path, rows = named[0]
        return attr, path, rows - count
    raise UnsupportedModelError(no_router_message(block, count, hidden, extra))


def _wider_matrices(block: nn.Module, count: int, hidden: int) -> list[tuple[str, str, int]]:
    """(child, path, rows) of every [rows > count, hidden] matrix beside the experts."""
    return [
        (attr, path, int(p.shape[0]))
        for attr, child in block.named_children()
        if attr != "experts"
        for path, p in child.named_parameters()
        if p.dim() == 2 and p.shape[-1] == hidden and p.shape[0] > count and attr not in ("mlp",)
    ]


def no_router_message(block: nn.Module, count: int, hidden: int, extra: int = 0) -> str:
    wider = _wider_matrices(block, count, hidden)
    detail = (
        f" (the nearest is {wider[0][0]}.{wider[0][1]} [{wider[0][2]}, {hidden}], wider than the expert count)"
        if wider
        else ""
    )
    also = f" and {extra} extra experts" if extra else ""
    return f"{type(block).__name__} has no router scoring its {count} routed experts{also}{detail}: not supported yet"


def router_index_position(
    router: nn.Module, weight_path: str, count: int, extra: int = 0
) -> tuple[int, int | None]:
    """Where the router's output holds the expert indices, and how many experts its logits score
    (None when not asked). The router must return its logits [T, E], the applied weights [T, k]
    and the expert indices [T, k] (an integer tensor), in any order: moeprune maps the indices
    back after narrowing the router. With extra experts the logits may span them too ([T, E + Z]:
    the router selects them) and more outputs may follow (Inkling's shared-expert gammas). Asked
    of the router itself on two zero rows (on its own device: the meta device costs nothing); a
    router that needs more than the hidden states (a bias the block passes) is taken to follow
    transformers' order."""
    weight = router.get_parameter(weight_path)
    rows = torch.zeros(2, weight.shape[1], dtype=weight.dtype, device=weight.device)
    try:
        with torch.no_grad():
            out = router(rows)
    except Exception:  # noqa: BLE001 - needs arguments the block supplies, or data-dependent code
        return 2, None
    tensors = (
        isinstance(out, tuple)
        and len(out) in ((3, 4) if extra else (3,))
        and all(isinstance(t, torch.Tensor) for t in out)
    )
    integer = [i for i, t in enumerate(out) if not t.is_floating_point()] if tensors else []
    widths = {count, count + extra}
    logits = (
        [
            i
            for i, t in enumerate(out)
            if t.dim() == 2 and t.shape[0] == 2 and t.shape[1] in widths and t.is_floating_point()
        ]
        if tensors
        else []
    )
    weights = (
        [i for i, t in enumerate(out) if t.is_floating_point() and t.shape == out[integer[0]].shape]
        if len(integer) == 1
        else []
    )
    # a layer that keeps only its top-k experts: logits, weights and indices are all [T, k], the
    # indices still the one integer tensor and the logits' width the count whichever float they are
    all_picked = tensors and not extra and len(logits) == 2 and {tuple(t.shape) for t in out} == {(2, count)}
    if (
        len(integer) == 1
        and (len(logits) == 1 or all_picked)
        and weights
        and (extra or len({tuple(t.shape) for t in out}) == 2 or all_picked)
    ):
        return integer[0], int(out[logits[0]].shape[1])
    got = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        if isinstance(t, torch.Tensor)
        else type(t).__name__
        for t in (out if isinstance(out, tuple) else (out,))
    ]
    raise UnsupportedModelError(
        f"{type(router).__name__} returns {got}, not logits, weights and expert indices as transformers' "
        "routers do: not supported with this transformers version"
    )


def child_free_params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))


HASH_ROUTING = (
    "routes by token id (hash routing): removing an expert would leave the tokens hashed to it unrouted"
)


def routes_by_token(router: nn.Module) -> bool:
    """Whether a router chooses experts by token id (DeepSeek-V4's hash layers look up a fixed
    token -> experts table) rather than from the hidden state: its forward takes `input_ids`.
    Such a layer cannot lose an expert, so it is kept whole; read off the signature, not a name."""
    return "input_ids" in inspect.signature(router.forward).parameters


def _block_routes_by_token(block: nn.Module) -> bool:
    """Whether any child of the block (its router) routes by token id."""
    return any(
        routes_by_token(child)
        for attr, child in block.named_children()
        if attr != "experts" and "shared" not in attr
    )


def learned_block(blocks: list[tuple[int, str, nn.Module]], model_type: str) -> tuple[int, str, nn.Module]:
    """The first MoE block whose router learns its choice: the family's structure is read there
    (a hash router lacks the selection bias a learned one has); hash layers are kept whole."""
    learned = [b for b in blocks if not _block_routes_by_token(b[2])]
    if not learned:
        raise UnsupportedModelError(
            f"{model_type}: every MoE layer's router routes by token id (hash routing), so no expert can be "
            "removed: nothing to prune"
        )
    return learned[0]
