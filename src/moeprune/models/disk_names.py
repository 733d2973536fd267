"""The names `save_pretrained` gives a family's tensors on disk, asked of transformers itself.

transformers 5 holds routed experts fused in memory and converts them back to each family's
checkpoint layout when saving (one tensor per expert under the family's names, renamed blocks).
Rather than keep a table of those names, moeprune runs transformers' own save-time conversion
(`revert_weight_conversion`) on small marker tensors (gate rows 1, up rows 2, down 3) to learn
the per-expert names and which is gate and which up, and on meta tensors of the whole model to
check that its fragment renames reproduce every name. Where they cannot (other tensors fused or
renamed too), stock saves go through transformers' conversion itself (`disk_names_known`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from moeprune.models.spec import FUSED, INTERLEAVED, TRANSPOSED, FamilySpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_GATE, _UP, _DOWN = 1.0, 2.0, 3.0


def disk_names(model: nn.Module, prefix: str, blocks, spec: FamilySpec) -> dict:
    """What `save_pretrained` calls the experts of the first MoE block: transformers' own
    save-time conversion run on small marker tensors (gate rows 1, up rows 2, down 3), so the
    names and which one is gate and which up come from transformers, not from a table."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers < 5.16 is not supported anyway
        return {}
    index, block_attr, _ = blocks[0]
    block = f"{prefix}.{index}.{block_attr}".rstrip(".")
    n, k, d = 2, 2, 3
    if spec.layout == FUSED:
        gate_up = torch.cat([torch.full((n, k, d), _GATE), torch.full((n, k, d), _UP)], dim=1)
        down = torch.full((n, d, k), _DOWN)
    elif spec.layout == TRANSPOSED:
        gate_up = torch.cat([torch.full((n, d, k), _GATE), torch.full((n, d, k), _UP)], dim=2)
        down = torch.full((n, k, d), _DOWN)
    else:  # interleaved (stored fused) or ungated (no gate: transformers' names kept)
        return {"disk_expert_names": None, "disk_names_known": spec.layout == INTERLEAVED}
    marked = {f"{block}.experts.gate_up_proj": gate_up, f"{block}.experts.down_proj": down}
    others = [f"{block}.{spec.router_attr}.{p}" for p, _ in spec.router_tensors]
    others += [f"{block}.{p}" for p, _ in spec.block_tensors]
    marked.update({name: torch.zeros(1) for name in others})
    try:
        reverted = revert_weight_conversion(cast("PreTrainedModel", model), dict(marked))
    except Exception:  # noqa: BLE001 - a converter that needs the real shapes: ask it at save time
        return {"disk_expert_names": None, "disk_names_known": False}
    renames = _renames(f"{prefix}.{index}.", block_attr, reverted, others)
    names = {}
    for name, tensor in reverted.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or ".0." not in name:
            continue
        value = float(tensor.flatten()[0])
        if tensor.dim() == 2 and bool((tensor == value).all()) and value in (_GATE, _UP, _DOWN):
            head, _, tail = name.partition(".experts.0.")
            if tail.endswith(".weight"):
                names[value] = tail.removesuffix(".weight")
    if sorted(names) == [_GATE, _UP, _DOWN]:
        return {"disk_expert_names": (names[_GATE], names[_UP], names[_DOWN]), "disk_renames": renames}
    if f"{block}.experts.gate_up_proj" in reverted:
        return {"disk_expert_names": None, "disk_renames": renames}
    return {"disk_expert_names": None, "disk_renames": renames, "disk_names_known": False}


def names_agree(model: nn.Module, prefix: str, blocks, spec: FamilySpec) -> bool:
    """Whether moeprune's names (the fragment renames and per-expert names above) are exactly
    what transformers' save-time conversion writes for the whole model, asked on meta tensors
    (nothing allocated); when not (other tensors fused or renamed), stock saves go through it."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover
        return True
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied to a tensor already listed, as save_pretrained drops it
            continue
        seen.add(id(tensor))
        state[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    try:
        theirs = set(revert_weight_conversion(cast("PreTrainedModel", model), state))
    except Exception:  # noqa: BLE001 - a converter that cannot run on meta tensors
        return False
    experts = {
        f"{prefix}.{i}.{path}".replace("..", ".").rstrip(".") + ".experts.": b.experts
        for i, path, b in blocks
    }
    ours: set[str] = set()
    for name in state:
        start = next((p for p in experts if name.startswith(p)), None)
        if start is None:
            for old, new in spec.disk_renames:
                name = name.replace(old, new)
            ours.add(name)
        elif spec.disk_expert_names is None:
            ours.add(_rename(start, spec) + name.removeprefix(start))
        else:
            n = int(experts[start].down_proj.shape[0])
            ours.update(
                f"{_rename(start, spec)}{e}.{part}.weight"
                for e in range(n)
                for part in spec.disk_expert_names
            )
    return ours == theirs


def _rename(name: str, spec: FamilySpec) -> str:
    for old, new in spec.disk_renames:
        name = name.replace(old, new)
    return name


def _renames(layer: str, block_attr: str, reverted: dict, others: list[str]) -> tuple[tuple[str, str], ...]:
    """Fragment renames turning internal names into disk names: the block's own name when its
    experts are stored under another one (Mixtral's `mlp` is `block_sparse_moe` on disk), then
    any per-expert router tensor that still differs (ERNIE's `gate.moe_statics` sits beside the
    gate on disk), each fragment written with its full path inside the decoder layer."""
    renames: list[tuple[str, str]] = []
    for name in reverted:
        head, sep, _ = name.partition(".experts.0.")
        if sep and head.startswith(layer) and head.removeprefix(layer) != block_attr:
            renames.append((f".{block_attr}.", f".{head.removeprefix(layer)}."))
            break

    def apply(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    disk = [n for n in reverted if n.startswith(layer) and ".experts." not in n]
    for internal in others:
        if internal in reverted or apply(internal) in reverted:
            continue
        leaf = internal.rsplit(".", 1)[-1]
        match = [n for n in disk if n.endswith("." + leaf)]
        if len(match) == 1:  # the whole path inside the layer, so no other tensor is renamed
            renames.append(("." + apply(internal).removeprefix(layer), "." + match[0].removeprefix(layer)))
    return tuple(renames)
